"""`od-dist pipeline import`, `export`, `predict` and `report`: the model before and after training."""

from __future__ import annotations

import os
import sys

from absl import flags

from od_dist.cli.flags import SEVERAL, define_model_dir, define_out, define_trained_model_flags, require
from od_dist.cli.registry import UsageError, command
from od_dist.protocol import exit_codes


def define_pipeline_import_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string(
        "config", None, "The Object Detection API pipeline.config (protobuf text format).", flag_values=fv
    )
    define_out(fv, "The od-dist pipeline YAML to write.")
    flags.DEFINE_string(
        "data",
        None,
        "The folder `od-dist data odapi` wrote the records to: the pipeline reads its "
        "train-*.tfrecord and val-*.tfrecord. Default: the config's own input paths.",
        flag_values=fv,
    )
    flags.DEFINE_boolean("force", False, "Replace --out if it exists.", flag_values=fv)


@command(
    "pipeline import",
    "Turn an Object Detection API pipeline.config into an od-dist pipeline YAML.",
    """
Reads an Object Detection API pipeline.config and writes the pipeline for the closest Model Garden
experiment: SSD with a MobileNet feature extractor -> retinanet_mobile_coco with a MobileNet
backbone and FPN; SSD with a ResNet FPN -> retinanet_resnetfpn_coco; EfficientDet -> RetinaNet with
an EfficientNet backbone and an FPN for its BiFPN; Faster R-CNN with a ResNet ->
fasterrcnn_resnetfpn_coco; CenterNet (Hourglass, ResNet; boxes) -> Model Garden's CenterNet project,
centernet_hourglass_coco. Carries num_classes (+1 for the background), image size, batch size,
steps, learning-rate schedule and warmup, optimizer, the augmentations Model Garden has, anchors,
NMS, input paths and label map; prints every setting that does not carry over, one line each, with
why. The YAML is checked with the pipeline loader before it is put in place.

Example:
  od-dist pipeline import --config my_model/pipeline.config --data data/my_data --out pipelines/my_model.yaml
""",
    define_pipeline_import_flags,
)
def cmd_pipeline_import(fv) -> int:
    require(fv, "config", "out")
    from od_dist.data import textproto
    from od_dist.model import odapi

    if not os.path.isfile(fv.config):
        raise UsageError(f"--config: '{fv.config}': no such file; pass the model's pipeline.config")
    if os.path.exists(fv.out) and not fv.force:
        raise UsageError(f"--out: '{fv.out}': exists; choose another --out or pass --force to replace it")
    with open(fv.config, encoding="utf-8", errors="replace") as f:
        text = f.read()
    try:
        imported = odapi.convert(text, fv.data)
    except textproto.TextFormatError as e:
        raise UsageError(f"--config: '{fv.config}': {e}") from None
    except odapi.ImportProblem as e:
        raise UsageError(f"--config: '{fv.config}': {e}") from None

    def check(path):
        from od_dist.model.pipeline import PipelineError, load_pipeline

        try:
            load_pipeline(path)
        except PipelineError as e:
            raise odapi.ImportProblem(f"the written pipeline does not load ({e}); nothing written") from None

    try:
        odapi.write(odapi.render(imported, fv.config), fv.out, fv.force, check)
    except odapi.ImportProblem as e:
        raise UsageError(str(e)) from None
    for note in imported.notes:
        print(f"not carried over: {note}")
    for warning in imported.warnings:
        print(f"warning: {warning}")
    print(
        f"wrote {fv.out}: experiment {imported.experiment}, {len(imported.notes)} setting(s) not carried over"
    )
    if not fv.data:
        print(_records_layout_note(fv.config, text, fv.out))
    print(f"next: od-dist data check --pipeline {fv.out}", flush=True)
    return exit_codes.OK


def _records_layout_note(config: str, text: str, out: str) -> str:
    """What `pipeline import` without --data says of the config's own records: when they are here
    and hold file names as source ids, the exact commands that rewrite them and import again."""
    from od_dist.data import records
    from od_dist.model import odapi

    rewrite = f"od-dist data odapi --config {config} --out DIR"
    val = odapi.input_paths(text)[1]
    files = records.match_files(val)
    sid = records.file_name_source_id(files)
    if sid is None:
        state = "numeric source ids" if files else "not found on this machine"
        return (
            f"input paths: as in the config ({state}); records in the Object Detection API's layout "
            f"(file names as image/source_id) are rewritten once with: {rewrite}, then import again "
            "with --data DIR"
        )
    data = os.path.join("data", os.path.splitext(os.path.basename(out))[0])
    return (
        f"records: {files[0]} holds file names as image/source_id ('{sid}'), the Object Detection API's "
        "layout, which Model Garden's COCO evaluation cannot read (training can); rewrite them once "
        f"and import again: od-dist data odapi --config {config} --out {data} && od-dist pipeline "
        f"import --config {config} --data {data} --out {out} --force"
    )


# ----- export / predict / report --------------------------------------------------------------


def define_export_flags(fv: flags.FlagValues) -> None:
    define_trained_model_flags(fv, "The run's model_dir; its latest checkpoint is exported.")
    define_out(
        fv,
        "The SavedModel folder to write (an earlier export there is replaced; other files stay), or "
        "with --format tflite the .tflite file (its .json and label map beside it).",
    )
    flags.DEFINE_string(
        "checkpoint",
        None,
        "Export this checkpoint (e.g. runs/x/ckpt-500) instead of the latest.",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "labels",
        None,
        "The label_map.pbtxt to ship with the model. Default: the one "
        "beside the pipeline's training records.",
        flag_values=fv,
    )
    flags.DEFINE_float(
        "min_score",
        None,
        "The model drops detections scored below this (its NMS never sees them); `od-dist predict "
        "--min_score` can only raise it. Default: the pipeline's "
        "task.model.detection_generator.pre_nms_score_threshold (0.05 in Model Garden's detectors).",
        lower_bound=0.0,
        upper_bound=1.0,
        flag_values=fv,
    )
    flags.DEFINE_enum(
        "format",
        "saved_model",
        ["saved_model", "tflite"],
        "saved_model: a SavedModel folder; tflite: one .tflite file for phones and small boards "
        "(RetinaNet pipelines: the demo, imported SSD, SSD FPN and EfficientDet configs).",
        flag_values=fv,
    )
    flags.DEFINE_enum(
        "quantize",
        "none",
        ["none", "fp16", "int8"],
        "--format tflite: none (float32), fp16 (float16 weights, half the size) or int8 (int8 weights "
        "and activations, calibrated on the pipeline's training records; float32 input and outputs).",
        flag_values=fv,
    )
    flags.DEFINE_boolean(
        "class_agnostic_nms",
        False,
        "--format tflite: one NMS over every class (the Object Detection API's TFLite default): "
        "faster, and lower AP where boxes of different classes overlap. Default: per class, as the "
        "SavedModel's, for the same detections.",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "calibration_images",
        100,  # TFLite's post-training quantization guide asks for about 100-500 samples
        "--quantize int8: how many training images calibrate the int8 ranges.",
        lower_bound=1,
        flag_values=fv,
    )


@command(
    "export",
    "Export a trained checkpoint: a SavedModel for serving, or a .tflite (--format tflite).",
    """
Writes a TensorFlow SavedModel of the latest checkpoint in --model_dir (or --checkpoint) with
Model Garden's exporter. Its serving_default signature takes uint8 images [1, H, W, 3] of any size
and returns detection_boxes ([ymin, xmin, ymax, xmax], normalized to the original image),
detection_scores, detection_classes (ids from 1) and num_detections. The training data's
label_map.pbtxt is copied beside it for `od-dist predict`.

With --format tflite it writes one .tflite (float32; --quantize fp16 or int8) with TFLite's
detection post-processing op, laid out as the Object Detection API's TFLite detectors: input
float32 [1, H, W, 3] (the image resized to the pipeline's input size, normalized by the mean and
std in the .json beside it), outputs detection_boxes ([ymin, xmin, ymax, xmax] normalized to that
input), detection_classes (from 0 for the label map's id 1), detection_scores and num_detections.
`od-dist predict --model` and `od-dist eval --model` run it through LiteRT's interpreter.

Examples:
  od-dist export --pipeline pipelines/shapes_retinanet.yaml --model_dir runs/demo --out exported/demo
  od-dist export --pipeline pipelines/shapes_retinanet.yaml --model_dir runs/demo --format tflite --quantize int8 --out exported/demo_int8.tflite
""",
    define_export_flags,
)
def cmd_export(fv) -> int:
    require(fv, "pipeline", "model_dir", "out")
    if fv.format == "tflite":
        return _export_tflite(fv)
    for name in ("quantize", "calibration_images", "class_agnostic_nms"):
        if fv[name].present:
            raise UsageError(
                f"--{name}: '{fv[name].value}': applies to --format tflite only; add --format tflite"
            )
    from od_dist.model import export
    from od_dist.model.pipeline import PipelineError, load_pipeline

    try:
        params = load_pipeline(fv.pipeline, fv.params_override)
        done = export.export(params, fv.model_dir, fv.out, fv.checkpoint, fv.labels, fv.min_score)
    except PipelineError as e:
        raise UsageError(str(e)) from None
    except export.ExportError as e:
        print(f"od-dist export: {e}", file=sys.stderr)
        return exit_codes.FAILED if "no checkpoint" in str(e) else exit_codes.INVALID
    print(
        f"exported {done['checkpoint']} to {done['out']} (input: uint8 images of any size, resized to "
        f"{done['input_size'][0]}x{done['input_size'][1]} inside; detections scored from "
        f"{done['min_score']:g}; label map: "
        f"{done['label_map'] or 'none found, classes will show as ids'})",
        flush=True,
    )
    return exit_codes.OK


def _export_tflite(fv) -> int:
    from od_dist.model import export, tflite
    from od_dist.model.pipeline import PipelineError, load_pipeline

    if not fv.out.endswith(tflite.SUFFIX) or os.path.isdir(fv.out):
        raise UsageError(
            f"--out: '{fv.out}': --format tflite writes one file; pass a file name ending in {tflite.SUFFIX}"
        )
    if fv["calibration_images"].present and fv.quantize != "int8":
        raise UsageError(
            f"--calibration_images: '{fv.calibration_images}': calibrates --quantize int8 only; add "
            "--quantize int8"
        )
    if os.path.isdir(fv.model_dir):
        from od_dist.host import console

        # TensorFlow's and the TFLite converter's own lines (MLIR passes, op counts) to
        # <model_dir>/logs/export.log: the console keeps od-dist's.
        console.setup(console.task_log_path(fv.model_dir, "export"), verbose=False)
    try:
        params = load_pipeline(fv.pipeline, fv.params_override)
        problem = tflite.unsupported(params, fv.pipeline)
        if problem:
            raise UsageError(problem)
        done = tflite.export_tflite(
            params,
            fv.model_dir,
            {fv.quantize: fv.out},
            fv.calibration_images,
            fv.checkpoint,
            fv.labels,
            fv.min_score,
            fv.pipeline,
            fv.class_agnostic_nms,
        )
    except PipelineError as e:
        raise UsageError(str(e)) from None
    except export.ExportError as e:
        print(f"od-dist export: {e}", file=sys.stderr)
        return exit_codes.FAILED if "no checkpoint" in str(e) else exit_codes.INVALID
    out, size = done["files"][fv.quantize]
    kind = {"none": "float32", "fp16": "float16 weights", "int8": "int8"}[fv.quantize]
    print(
        f"exported {done['checkpoint']} to {out} ({kind}, {size / 1e6:.1f} MB; input: "
        f"float32 [1, {done['input_size'][0]}, {done['input_size'][1]}, 3], normalized as "
        f"{tflite.info_path(out)} says; detections scored from {done['min_score']:g}; label map: "
        f"{done['label_map'] or 'none found, classes will show as ids'})",
        flush=True,
    )
    return exit_codes.OK


def define_predict_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string(
        "model",
        None,
        "The SavedModel folder written by `od-dist export`, or a .tflite written by `od-dist export "
        "--format tflite` (run by LiteRT's interpreter).",
        flag_values=fv,
    )
    flags.DEFINE_multi_string("images", None, "Image files or folders of images. " + SEVERAL, flag_values=fv)
    define_out(fv, "Folder for the drawn PNGs and detections.json.")
    flags.DEFINE_float(
        "min_score",
        0.3,
        "Detections below this score are left out. The exported model has already dropped those "
        "below the score it was exported with (`od-dist export --min_score`, default 0.05): a lower "
        "value here shows nothing more, and says so.",
        lower_bound=0.0,
        upper_bound=1.0,
        flag_values=fv,
    )


@command(
    "predict",
    "Run an exported model on images: a PNG per image with boxes drawn, and a JSON.",
    """
Runs the SavedModel on each image (files, or every .jpg/.png/.bmp/.gif of a folder) and writes
<out>/<image name>.png, the image with each detection's box, class name and score drawn, and
<out>/detections.json: per image its path, size and detections, each a box [xmin, ymin, xmax,
ymax] in pixels of the original image, a class name and id, and a score.

Examples:
  od-dist predict --model exported/demo --images my_data/test --out predictions --min_score 0.5
  od-dist predict --model exported/demo --out predictions --images photos/*.jpg
""",
    define_predict_flags,
    lists=("images",),
    rest="images",
)
def cmd_predict(fv) -> int:
    require(fv, "model", "images", "out")
    from od_dist.model import predict

    try:
        done = predict.predict(fv.model, list(fv.images), fv.out, fv.min_score)
    except predict.PredictError as e:
        raise UsageError(str(e)) from None
    count = sum(len(r["detections"]) for r in done["results"])
    if done["note"]:
        print(f"od-dist predict: {done['note']}", flush=True)
    print(
        f"{len(done['images'])} image(s), {count} detection(s) with score >= {fv.min_score}: "
        f"{fv.out}/*.png and {done['json']}",
        flush=True,
    )
    return exit_codes.OK


def define_report_flags(fv: flags.FlagValues) -> None:
    define_model_dir(fv, "The run's model_dir (its train/ and validation/ event files).")
    define_out(fv, "The PNG to write. Default: <model_dir>/report.png.")
    flags.DEFINE_string("title", None, "The picture's title. Default: the model_dir.", flag_values=fv)


@command(
    "report",
    "Draw a run as one PNG: loss, learning rate, steps/s, AP/AP50 over steps.",
    """
Reads the TensorBoard event files Model Garden wrote in --model_dir (train/ and validation/) and
draws training loss (total, classification, box; validation loss), learning rate, steps/s, and
COCO AP and AP50 over steps when evaluations exist, into one PNG.

Example:
  od-dist report --model_dir runs/demo            # writes runs/demo/report.png
""",
    define_report_flags,
)
def cmd_report(fv) -> int:
    require(fv, "model_dir")
    from od_dist.model import report

    try:
        done = report.report(fv.model_dir, fv.out, fv.title)
    except report.ReportError as e:
        raise UsageError(str(e)) from None
    print(f"wrote {done['out']}", flush=True)
    return exit_codes.OK
