"""`od-dist export --format tflite`: a trained checkpoint -> a .tflite for phones and small boards,
float32, float16 weights (`--quantize fp16`) or int8 (`--quantize int8`, calibrated on the
pipeline's training records); and the .tflite as a detector, through LiteRT's interpreter, for
`od-dist predict` and `od-dist eval`.

Model Garden does the work: a SavedModel of input type `tflite` whose RetinaNet detection generator
runs with ``nms_version: tflite`` (TFLite's ``TFLite_Detection_PostProcess`` op), converted by
``export_tflite_lib.convert_tflite_model``. Its layout is the Object Detection API's TFLite
detectors' (signature ``serving_default``):

- input ``inputs``: float32 [1, H, W, 3] (H, W: the pipeline's ``task.model.input_size``): the RGB
  image resized into H x W keeping its aspect ratio and padded at the bottom and right (stretched
  when the pipeline's ``parser.keep_aspect_ratio`` is false), then per channel (pixel - mean) / std
  with Model Garden's ImageNet mean and std on the 0-255 scale (written into the .json beside it);
- outputs: ``detection_boxes`` [1, N, 4] as [ymin, xmin, ymax, xmax] normalized to that input,
  ``detection_classes`` [1, N] (float, from 0 for the label map's id 1, as the Object Detection
  API's), ``detection_scores`` [1, N], best first, and ``num_detections`` [1]: the first
  num_detections rows are detections. N is the pipeline's
  ``detection_generator.max_num_detections``; NMS per class (as the SavedModel's) unless
  ``class_agnostic_nms``.

int8 is TFLite's integer quantization with float fallback: int8 weights and activations, float32
input and outputs (the same code runs all three), float ops where TFLite has no int8 kernel.
Beside ``x.tflite``: ``x.json`` (what `predict` and `eval` need to feed it: input size, aspect
ratio, mean and std; the checkpoint and its step; the score it drops detections under; its classes)
and its own label map, ``x.label_map.pbtxt``: models of other classes can share a folder.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from od_dist import patches
from od_dist.data.records import LABEL_MAP_FILE
from od_dist.model import export

# --quantize -> Model Garden's quant_type.
QUANTIZE = {"none": None, "fp16": "fp16", "int8": "int8_fallback"}
SUFFIX = ".tflite"
# The families Model Garden's TFLite detection op serves: RetinaNet (the demo, imported SSD,
# SSD FPN and EfficientDet configs); the others, named for the refusal.
OTHER_FAMILIES = {"MaskRCNNTask": "Faster R-CNN", "CenterNetTask": "CenterNet"}


def info_path(model: str) -> str:
    return os.path.splitext(model)[0] + ".json"


def label_map_path(model: str) -> str:
    """The model's own label map, beside it: x.tflite -> x.label_map.pbtxt."""
    return os.path.splitext(model)[0] + "." + LABEL_MAP_FILE


def labels_of(model: str) -> dict[int, str]:
    """The classes of a .tflite, {id: name}: its own label map, checked against the classes its .json
    says it was exported with (those without the file; {} when it has neither). A label map that
    differs from them (replaced since, or another model's) is refused: the boxes would be drawn under
    other names."""
    from od_dist.data import records

    path = label_map_path(model)
    names = records.read_labels(path) if os.path.isfile(path) else {}
    exported = {int(k): v for k, v in (read_info(model).get("labels") or {}).items()}
    if exported and names and names != exported:
        raise export.ExportError(
            f"--model: '{model}': its label map '{path}' ({_shown(names)}) is not the one it was exported with "
            f"({_shown(exported)}); put that one back, or export the model again"
        )
    return names or exported


def check_labels(model: str, params) -> None:
    """`eval --model`: the .tflite's classes are those of the pipeline's records (their label map),
    or its figures would be scored under other classes."""
    from od_dist.data import records

    mine = labels_of(model)
    path = export.find_label_map(params)
    theirs = records.read_labels(path) if path else {}
    if mine and theirs and mine != theirs:
        raise export.ExportError(
            f"--model: '{model}': its classes ({_shown(mine)}) are not those of the pipeline's records "
            f"('{path}': {_shown(theirs)}); pass the pipeline the model was trained with"
        )


def _shown(names: dict[int, str]) -> str:
    return ", ".join(f"{i} {n}" for i, n in sorted(names.items()))


def unsupported(params, pipeline_path: str) -> str | None:
    """One line when this pipeline's model cannot become a .tflite detector, else None."""
    from official.vision.configs import retinanet

    if not isinstance(params.task, retinanet.RetinaNetTask):
        kind = type(params.task).__name__
        family = OTHER_FAMILIES.get(kind, kind)
        return (
            f"--format tflite: '{pipeline_path}' is a {family} pipeline; TFLite export converts "
            "RetinaNet pipelines only (the demo, imported SSD, SSD FPN and EfficientDet configs: "
            "Model Garden's TFLite detection op is RetinaNet's); export a SavedModel instead "
            "(leave out --format)"
        )
    model = params.task.model
    stride = 2**model.max_level
    size = list(model.input_size[:2])
    if params.task.train_data.parser.pad and any(s % stride for s in size):
        return (
            f"task.model.input_size: {size}: a .tflite takes its input unpadded, and this model pads "
            f"it to multiples of {stride} (2**max_level); set sides that are multiples of {stride}"
        )
    return None


def export_tflite(
    params,
    model_dir: str,
    outs: dict[str, str],
    calibration_images: int = 100,  # `export --calibration_images`'s default says why
    checkpoint: str | None = None,
    labels: str | None = None,
    min_score: float | None = None,
    pipeline_path: str = "the pipeline",
    class_agnostic_nms: bool = False,
) -> dict:
    """Writes a .tflite of the latest checkpoint of ``model_dir`` (or ``checkpoint``) for each
    ``{quantize: path}`` of ``outs`` (one SavedModel converted as many times), each with its .json,
    and its own label map beside each. Returns {'checkpoint', 'label_map' (or None), 'input_size',
    'min_score', 'files': {quantize: (path, bytes)}}."""
    problem = unsupported(params, pipeline_path)
    if problem:
        raise export.ExportError(problem)
    outs = {quantize: os.path.normpath(out) for quantize, out in outs.items()}
    for quantize, out in outs.items():
        if quantize not in QUANTIZE:
            raise export.ExportError(f"--quantize: '{quantize}': not one of {', '.join(QUANTIZE)}")
        if not out.endswith(SUFFIX) or os.path.isdir(out):
            raise export.ExportError(
                f"--out: '{out}': --format tflite writes one file; pass a file name ending in {SUFFIX}"
            )
    if "int8" in outs:
        from od_dist.data import records

        pattern = params.task.train_data.input_path
        if not records.match_files(pattern):
            raise export.ExportError(
                f"task.train_data.input_path: '{pattern}': no records on this machine; --quantize int8 "
                "calibrates on them: pass the pipeline the model was trained with, on a machine that "
                "has its records"
            )
    import tensorflow as tf

    patches.check()
    ckpt, label_map = export.checkpoint_and_labels(params, model_dir, checkpoint, labels)
    from official.vision.ops import preprocess_ops
    from official.vision.serving import export_saved_model_lib, export_tflite_lib

    tf.get_logger().setLevel("ERROR")
    size = list(params.task.model.input_size[:2])
    generator = params.task.model.detection_generator
    min_score = generator.pre_nms_score_threshold if min_score is None else min_score
    generator.nms_version = "tflite"
    post = generator.tflite_post_processing
    post.max_detections = generator.max_num_detections
    post.nms_score_threshold = min_score
    post.nms_iou_threshold = generator.nms_iou_threshold
    post.normalize_anchor_coordinates = True  # boxes normalized to the input, as the OD API's
    post.max_classes_per_detection = 1  # one class a box, as the SavedModel and the OD API's
    # Per class by default, as the SavedModel's NMS: the same detections, so that eval's AP shows
    # what the conversion cost (an imported SSD after 600 steps: AP 0.634 per class, 0.497 over all
    # classes, against the SavedModel's 0.635; 56 against 39 ms on one thread).
    post.use_regular_nms = not class_agnostic_nms
    post.detections_per_class = generator.max_num_detections
    from od_dist.data import records

    info = {
        "labels": {str(i): n for i, n in records.read_labels(label_map).items()} if label_map else None,
        "checkpoint": ckpt,
        "step": _step(ckpt),
        "min_score": min_score,
        "class_agnostic_nms": class_agnostic_nms,
        "input_size": size,
        "keep_aspect_ratio": bool(params.task.validation_data.parser.keep_aspect_ratio),
        "mean": [round(v, 4) for v in preprocess_ops.MEAN_RGB],
        "std": [round(v, 4) for v in preprocess_ops.STDDEV_RGB],
    }
    files = {}
    first = os.path.dirname(next(iter(outs.values()))) or "."
    os.makedirs(first, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".od-dist-tflite-", dir=first) as tmp:
        saved = os.path.join(tmp, "saved_model")
        try:
            with patches.tf_keras.without_keras_traces(), patches.model_garden.tflite_without_background():
                export_saved_model_lib.export_inference_graph(
                    input_type="tflite",
                    batch_size=1,
                    input_image_size=size,
                    params=params,
                    checkpoint_path=ckpt,
                    export_dir=saved,
                )
        except tf.errors.OpError as e:
            raise export.ExportError(
                f"checkpoint '{ckpt}': cannot be restored into this pipeline's model "
                f"({e.message.splitlines()[0] if e.message else type(e).__name__}); pass the pipeline "
                "it was trained with"
            ) from None
        for quantize, out in outs.items():
            # Calibration reads the training split one image at a time (Model Garden sets batch 1
            # on the copy it is given).
            model = export_tflite_lib.convert_tflite_model(
                saved_model_dir=saved,
                quant_type=QUANTIZE[quantize],
                params=params.replace(),
                calibration_steps=calibration_images,
            )
            os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
            _write(out, model)
            _write(info_path(out), (json.dumps({**info, "quantize": quantize}, indent=1) + "\n").encode())
            files[quantize] = (out, len(model))
            if label_map:
                shutil.copyfile(label_map, label_map_path(out))
    return {
        "checkpoint": ckpt,
        "label_map": label_map,
        "input_size": size,
        "min_score": min_score,
        "files": files,
    }


def _write(path: str, data: bytes) -> None:
    with open(path + ".partial", "wb") as f:
        f.write(data)
    os.replace(path + ".partial", path)  # a reader never sees half a model


def _step(ckpt: str) -> int | None:
    tail = ckpt.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None


def read_info(model: str) -> dict:
    """The .json `export --format tflite` wrote beside the model; {} when it is missing."""
    try:
        with open(info_path(model), encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


class Detector:
    """A .tflite detector in LiteRT's interpreter. ``detect(image)`` takes one preprocessed float32
    image [1, H, W, 3] and returns (boxes [n, 4] normalized to that input, scores [n], classes [n]
    as the label map's ids)."""

    def __init__(self, model: str, threads: int | None = None, flag: str = "--model"):
        from ai_edge_litert.interpreter import Interpreter

        try:
            interpreter = Interpreter(model_path=model, num_threads=threads)
            self._run = interpreter.get_signature_runner("serving_default")
        except (ValueError, RuntimeError) as e:
            raise export.ExportError(
                f"{flag}: '{model}': not a .tflite detector ({str(e).splitlines()[0]}); pass a file "
                "`od-dist export --format tflite` wrote"
            ) from None
        shape = self._run.get_input_details()["inputs"]["shape"]
        self.input_size = [int(shape[1]), int(shape[2])]
        self.info = read_info(model)

    def detect(self, image):
        import numpy as np

        out = self._run(inputs=np.asarray(image, dtype=np.float32))
        n = int(out["num_detections"][0])
        boxes = out["detection_boxes"][0, :n]
        scores = out["detection_scores"][0, :n]
        classes = out["detection_classes"][0, :n].astype(int) + 1
        return boxes, scores, classes


def preprocess(image, size: list[int], keep_aspect_ratio: bool = True):
    """uint8 RGB image [h, w, 3] -> (the float32 input [1, H, W, 3], image_info [4, 2]) by Model
    Garden's serving preprocessing (DetectionModule._build_inputs): what the .tflite was traced to
    receive. image_info: [original size], [H, W], [y scale, x scale], [offsets]."""
    import tensorflow as tf
    from official.vision.ops import preprocess_ops

    image = preprocess_ops.normalize_image(
        tf.cast(image, tf.float32), offset=preprocess_ops.MEAN_RGB, scale=preprocess_ops.STDDEV_RGB
    )
    image, info = preprocess_ops.resize_and_crop_image(
        image,
        size,
        padded_size=size,
        aug_scale_min=1.0,
        aug_scale_max=1.0,
        keep_aspect_ratio=keep_aspect_ratio,
    )
    return image.numpy()[None], info.numpy()


def to_original(boxes, info):
    """Boxes normalized to the model's input -> normalized to the original image (clipped)."""
    import numpy as np

    size, scale, original = info[1], info[2], info[0]
    pixels = boxes * np.tile(size, 2) / np.tile(scale, 2)  # in the original image's pixels
    return np.clip(pixels / np.tile(original, 2), 0.0, 1.0)


def evaluate(params, model: str, threads: int | None = None) -> dict:
    """COCO metrics of the .tflite on the pipeline's validation records, computed as Model Garden's
    evaluation of a checkpoint computes them (the task's own input pipeline and COCO evaluator):
    the figures compare with `od-dist eval` of the checkpoint. Returns the metrics and 'step'."""
    import numpy as np
    import tensorflow as tf
    from official.core import task_factory

    detector = Detector(model, threads)
    check_labels(model, params)
    problem = unsupported(params, "the pipeline")
    if problem:
        raise export.ExportError(problem)
    if detector.input_size != list(params.task.model.input_size[:2]):
        raise export.ExportError(
            f"--model: '{model}': takes {detector.input_size} inputs, the pipeline's model "
            f"{list(params.task.model.input_size[:2])}; pass the pipeline it was exported from"
        )
    from od_dist.model import metrics

    task = task_factory.get_task(params.task)
    metrics.name_classes(task, metrics.class_names(params))
    task.build_metrics(training=False)
    height, width = detector.input_size
    state = None
    for features, labels in task.build_inputs(params.task.validation_data):
        images = features.numpy()
        count = images.shape[0]
        rows = max(1, int(params.task.model.detection_generator.max_num_detections))
        boxes = np.zeros([count, rows, 4], np.float32)
        scores = np.zeros([count, rows], np.float32)
        classes = np.zeros([count, rows], np.float32)
        found = np.zeros([count], np.int32)
        for i in range(count):
            b, s, c = detector.detect(images[i : i + 1])
            n = min(len(s), rows)
            # In the input's pixels, as the model's own detections: the evaluator rescales them.
            boxes[i, :n] = b[:n] * [height, width, height, width]
            scores[i, :n], classes[i, :n], found[i] = s[:n], c[:n], n
        outputs = {
            "detection_boxes": tf.constant(boxes),
            "detection_scores": tf.constant(scores),
            "detection_classes": tf.constant(classes),
            "num_detections": tf.constant(found),
            "source_id": labels["groundtruths"]["source_id"],
            "image_info": labels["image_info"],
        }
        state = task.aggregate_logs(state, {task.coco_metric.name: (labels["groundtruths"], outputs)})
    found = {k: float(v) for k, v in task.reduce_aggregated_logs(state).items() if np.ndim(v) == 0}
    found["step"] = detector.info.get("step")
    return found
