"""The detector side: labelImg folder -> records -> a few training steps -> export -> predict, and
the run report. The end-to-end test trains for real (slow, few steps); the report and the error
paths are fast."""

import json
import os

import numpy as np
import pytest
from labelimg import SIZE, make_voc
from loopback import COCO_LINE, SMALL, od_dist, run_cli
from loopback import PIPELINE as DEMO


@pytest.fixture(scope="module")
def labelimg_run(tmp_path_factory):
    """A labelImg folder, its records, and a detector trained 6 steps on them: the SavedModel and
    the TFLite tests export the same checkpoint."""
    import tensorflow as tf

    from od_dist.data import voc
    from od_dist.model.pipeline import load_pipeline
    from od_dist.task import trainer

    tmp_path = tmp_path_factory.mktemp("labelimg_run")
    images, anns, _ = make_voc(str(tmp_path / "src"), count=24)
    data = str(tmp_path / "data")
    written, _ = voc.convert(images, anns, data, val_fraction=0.25)
    override = (
        f"trainer.train_steps=6,trainer.steps_per_loop=3,trainer.summary_interval=3,"
        f"trainer.checkpoint_interval=3,task.train_data.input_path={written.pattern('train')},"
        f"task.validation_data.input_path={written.pattern('val')},task.model.num_classes="
        f"{written.num_classes},{SMALL}"
    )
    model_dir = str(tmp_path / "run")
    trainer.train(load_pipeline(DEMO, override, "mirrored"), model_dir, tf.distribute.MirroredStrategy())
    return images, written, override, model_dir


@pytest.mark.slow
def test_labelimg_folder_to_trained_exported_model_and_drawn_detections(labelimg_run, tmp_path, capsys):
    import tensorflow as tf
    from PIL import Image

    from od_dist.model import export, predict
    from od_dist.model.pipeline import load_pipeline

    images, written, override, model_dir = labelimg_run
    assert tf.train.latest_checkpoint(model_dir).endswith("ckpt-6")

    # After 6 steps every score is near RetinaNet's 0.01 prior, under the pipeline's 0.05: export
    # with every score kept, so boxes get drawn.
    params = load_pipeline(DEMO, override)
    out = str(tmp_path / "exported")
    done = export.export(params, model_dir, out, min_score=0.0)
    assert done["checkpoint"].endswith("ckpt-6") and done["label_map"] == written.label_map
    assert predict.exported_min_score(out) == 0.0
    assert os.path.isfile(os.path.join(out, "saved_model.pb"))
    assert os.path.isfile(os.path.join(out, "label_map.pbtxt"))
    assert not [p for p in os.listdir(tmp_path) if "partial" in p]

    # A wider image than the training ones: boxes come back in ITS pixels.
    wide = str(tmp_path / "wide.png")
    Image.open(os.path.join(images, "photo_001.jpg")).resize((160, SIZE)).save(wide)
    pred_dir = str(tmp_path / "pred")
    result = predict.predict(out, [wide, os.path.join(images, "photo_002.jpg")], pred_dir, min_score=0.0)
    with open(os.path.join(pred_dir, "detections.json")) as f:
        doc = json.load(f)
    assert [os.path.basename(r["image"]) for r in doc] == ["wide.png", "photo_002.jpg"]
    first = doc[0]
    assert (first["width"], first["height"]) == (160, SIZE)
    assert first["detections"], "no detections at min_score 0"
    assert result["note"] is None
    # A model exported at the pipeline's threshold: a --min_score under it is said to show nothing more.
    with open(os.path.join(out, export.EXPORT_INFO), "w") as f:
        json.dump({"min_score": 0.05}, f)
    note = predict.predict(out, [wide], str(tmp_path / "pred2"), min_score=0.0)["note"]
    assert note == (
        "--min_score 0 is below 0.05, the score under which the exported model itself drops detections: "
        "nothing under 0.05 is shown; to see lower scores, export again with --min_score 0"
    )
    for d in first["detections"]:
        xmin, ymin, xmax, ymax = d["box"]
        assert 0 <= xmin <= xmax <= 160 and 0 <= ymin <= ymax <= SIZE
        assert d["class"] in ("circle", "square", "triangle") and 0.0 <= d["score"] <= 1.0
    scores = [d["score"] for d in first["detections"]]
    assert scores == sorted(scores, reverse=True)
    original = np.asarray(Image.open(wide).convert("RGB"))
    drawn = np.asarray(Image.open(result["images"][0]))
    assert drawn.shape == original.shape  # the input's size
    changed = np.any(drawn != original, axis=-1)
    # Where the best box is drawn, the picture differs from the input.
    xmin, ymin, xmax, ymax = (int(round(v)) for v in first["detections"][0]["box"])
    edge = changed[min(max(ymin, 0), SIZE - 1), max(xmin, 0) : min(xmax, 159) + 1]
    assert edge.any()

    code, _, err = run_cli(capsys, "report", "--model_dir", model_dir)
    assert code == 0, err
    with Image.open(os.path.join(model_dir, "report.png")) as im:
        assert im.size[0] > 400 and im.size[1] > 300


@pytest.mark.slow
def test_tflite_float_fp16_int8_are_detectors_in_litert(labelimg_run, tmp_path, capsys):
    """The same checkpoint to the three .tflite files: each loads in LiteRT's interpreter and
    returns detections in the documented layout (the Object Detection API's TFLite detectors');
    predict draws them in the image's pixels, eval computes COCO metrics of them."""
    from ai_edge_litert.interpreter import Interpreter
    from PIL import Image

    from od_dist.data import records
    from od_dist.model import export, predict, tflite
    from od_dist.model.pipeline import load_pipeline

    images, written, override, model_dir = labelimg_run
    outs = {q: str(tmp_path / "phone" / f"model_{q}.tflite") for q in ("none", "fp16", "int8")}
    # Every score kept: after 6 steps they sit near RetinaNet's 0.01 prior.
    done = tflite.export_tflite(
        load_pipeline(DEMO, override), model_dir, outs, calibration_images=4, min_score=0.0
    )
    assert done["checkpoint"].endswith("ckpt-6") and done["label_map"] == written.label_map
    # Each model its own label map (models of other classes can share the folder), its classes in
    # its .json too.
    labels = records.read_labels(written.label_map)
    for q, out in outs.items():
        assert records.read_labels(tflite.label_map_path(out)) == labels, q
        assert tflite.read_info(out)["labels"] == {str(i): n for i, n in labels.items()}, q
    assert not os.path.exists(tmp_path / "phone" / "label_map.pbtxt")
    size = {q: os.path.getsize(outs[q]) for q in outs}
    assert {q: done["files"][q] for q in outs} == {q: (outs[q], size[q]) for q in outs}
    assert size["int8"] * 2.5 < size["none"] and size["fp16"] * 1.8 < size["none"]
    assert not [p for p in os.listdir(tmp_path / "phone") if p.startswith(".") or p.endswith(".partial")]

    photo = np.asarray(Image.open(os.path.join(images, "photo_001.jpg")).convert("RGB"))
    for q, path in outs.items():
        info = tflite.read_info(path)
        assert (info["quantize"], info["step"], info["min_score"], info["input_size"]) == (
            q,
            6,
            0.0,
            [64, 64],
        )
        assert predict.exported_min_score(path) == 0.0
        run = Interpreter(model_path=path).get_signature_runner("serving_default")
        ((name, spec),) = run.get_input_details().items()
        assert (name, list(spec["shape"]), spec["dtype"]) == ("inputs", [1, 64, 64, 3], np.float32)
        inputs, image_info = tflite.preprocess(photo, [64, 64], info["keep_aspect_ratio"])
        out = run(inputs=inputs)
        shapes = {k: (v.shape, v.dtype) for k, v in out.items()}
        assert shapes == {
            "detection_boxes": ((1, 100, 4), np.float32),
            "detection_classes": ((1, 100), np.float32),
            "detection_scores": ((1, 100), np.float32),
            "num_detections": ((1,), np.float32),
        }, q
        n = int(out["num_detections"][0])
        assert 0 < n <= 100, q
        scores, classes = out["detection_scores"][0, :n], out["detection_classes"][0, :n]
        assert list(scores) == sorted(scores, reverse=True) and ((scores >= 0) & (scores <= 1)).all(), q
        # From 0 for the label map's id 1; RetinaNet's background (its class 0) is not among them.
        assert set(classes.astype(int)) <= {0, 1, 2} and (classes == classes.astype(int)).all(), q
        boxes = tflite.to_original(out["detection_boxes"][0, :n], image_info)
        assert ((boxes[:, 0] <= boxes[:, 2]) & (boxes[:, 1] <= boxes[:, 3])).all(), q

    pred_dir = str(tmp_path / "pred")
    result = predict.predict(outs["int8"], [os.path.join(images, "photo_002.jpg")], pred_dir, min_score=0.0)
    (first,) = result["results"]
    assert first["detections"] and result["note"] is None
    for d in first["detections"]:
        xmin, ymin, xmax, ymax = d["box"]
        assert 0 <= xmin <= xmax <= first["width"] and 0 <= ymin <= ymax <= first["height"]
        assert d["class"] in ("circle", "square", "triangle")

    # eval's line for the .tflite: the step it was exported from, COCO metrics of its detections.
    code, out, err = run_cli(
        capsys, "eval", f"--pipeline={DEMO}", f"--params_override={override}", f"--model={outs['none']}"
    )
    assert code == 0, err
    (line,) = [m.group(0) for m in map(COCO_LINE.fullmatch, out.splitlines()) if m]
    assert line.startswith("od-dist eval | step 6 | AP ") and float(COCO_LINE.fullmatch(line)["AP50"]) <= 1.0

    # Another model's label map put beside it (or its own replaced): predict refuses rather than draw
    # the boxes under other names.
    own = tflite.label_map_path(outs["fp16"])
    with open(own, "w") as f:
        f.write(records.label_map_text({1: "cat", 2: "dog", 3: "bird"}))
    with pytest.raises(predict.PredictError) as refused:
        predict.predict(outs["fp16"], [os.path.join(images, "photo_002.jpg")], str(tmp_path / "p2"))
    assert str(refused.value) == (
        f"--model: '{outs['fp16']}': its label map '{own}' (1 cat, 2 dog, 3 bird) is not the one it was "
        "exported with (1 circle, 2 square, 3 triangle); put that one back, or export the model again"
    )
    # A model of other classes than the pipeline's records: eval refuses it.
    info = tflite.read_info(outs["int8"])
    with open(tflite.info_path(outs["int8"]), "w") as f:
        json.dump({**info, "labels": {"1": "cat", "2": "dog", "3": "bird"}}, f)
    os.remove(tflite.label_map_path(outs["int8"]))  # without its file, the classes of its .json
    with pytest.raises(export.ExportError) as refused:
        tflite.check_labels(outs["int8"], load_pipeline(DEMO, override))
    assert str(refused.value) == (
        f"--model: '{outs['int8']}': its classes (1 cat, 2 dog, 3 bird) are not those of the pipeline's "
        f"records ('{written.label_map}': 1 circle, 2 square, 3 triangle); pass the pipeline the model "
        "was trained with"
    )


@pytest.mark.slow
def test_eval_of_a_chosen_checkpoint_prints_the_coco_summary_and_ap_per_class(labelimg_run, tmp_path, capsys):
    """`eval --checkpoint` evaluates that checkpoint, not the latest; --coco_summary prints the
    twelve COCO figures, each with its meaning; AP per class lands in eval_metrics.json and, with
    --per_class, on the console, under the label map's names. COCO's AP is the mean of the classes'
    APs: that holds of the figures computed here from pycocotools' precision array."""
    from od_dist.data import records
    from od_dist.model import metrics
    from od_dist.task import controller

    assert tuple(metrics.MEANINGS) == controller.COCO_KEYS
    _, written, override, model_dir = labelimg_run
    labels = records.read_labels(written.label_map)
    names = list(labels.values())
    # Refused before TensorFlow is asked for anything.
    code, _, err = run_cli(
        capsys, "eval", f"--pipeline={DEMO}", f"--model_dir={model_dir}", f"--checkpoint={model_dir}/ckpt-4"
    )
    assert code == 2 and err.strip().splitlines() == [
        f"od-dist eval: --checkpoint: '{model_dir}/ckpt-4': no such checkpoint; pass a path like "
        f"{model_dir}/ckpt-1000 (without .index), or a folder of checkpoints"
    ], err
    # Every score kept: after 3 steps they sit near RetinaNet's 0.01 prior, under the default 0.05.
    # Validation images without a square: a class with no box there is still listed, as such.
    no_square = without_class(
        written.pattern("val"),
        next(i for i, n in labels.items() if n == "square"),
        str(tmp_path / "val.tfrecord"),
    )
    keep_all = (
        f"{override},task.model.detection_generator.pre_nms_score_threshold=0.0,"
        f"task.validation_data.input_path={no_square}"
    )
    code, out, err = run_cli(
        capsys,
        "eval",
        f"--pipeline={DEMO}",
        f"--params_override={keep_all}",
        f"--model_dir={model_dir}",
        f"--checkpoint={model_dir}/ckpt-3",
        "--coco_summary",
        "--per_class",
    )
    assert code == 0, err
    with open(os.path.join(model_dir, "eval_metrics.json")) as f:
        found = json.load(f)
    assert found["step"] == 3 and os.path.isfile(os.path.join(model_dir, "validation", "metrics-3.json"))
    assert f"restored from checkpoint: {model_dir}/ckpt-3" in out.splitlines(), out
    lines = out.splitlines()
    (line,) = [m.group(0) for m in map(COCO_LINE.fullmatch, lines) if m]
    assert line.startswith("od-dist eval | step 3 | AP "), out
    start = lines.index("COCO summary:")
    summary = lines[start + 1 : start + 13]
    assert [s.split()[0] for s in summary] == list(controller.COCO_KEYS), out
    assert summary[0] == f"  AP        {found['AP']:6.3f}  {metrics.MEANINGS['AP']}"
    assert {k.split("/", 1)[1] for k in found if k.startswith("AP/")} == set(names), found
    assert found["AP/square"] == found["AP50/square"] == metrics.NO_GROUND_TRUTH, found
    classes = sorted(k.split("/", 1)[1] for k in found if k.startswith("AP/") and found[k] >= 0)
    assert classes and "square" not in classes, found
    assert found["AP"] > 0 and found["AP"] == pytest.approx(
        sum(found[f"AP/{c}"] for c in classes) / len(classes), abs=1e-6
    ), found
    assert found["AP50"] == pytest.approx(sum(found[f"AP50/{c}"] for c in classes) / len(classes), abs=1e-6)
    per_class = lines[lines.index("per class:") + 1 :]
    assert per_class[: len(names)] == [
        f"  {n:<16} AP {found[f'AP/{n}']:.3f} | AP50 {found[f'AP50/{n}']:.3f}"
        if n in classes
        else f"  {n:<16} no boxes of this class in the validation records"
        for n in names
    ], out


def without_class(records: str, label: int, out: str) -> str:
    """The records of the glob `records` written to `out` without the boxes of class `label` (an image
    left with none is left out)."""
    import tensorflow as tf

    with tf.io.TFRecordWriter(out) as writer:
        for raw in tf.data.TFRecordDataset(sorted(tf.io.gfile.glob(records))):
            example = tf.train.Example.FromString(raw.numpy())
            features = example.features.feature
            keep = [c != label for c in features["image/object/class/label"].int64_list.value]
            if not any(keep):
                continue
            for key in features:
                kind = features[key].WhichOneof("kind")
                if key.startswith("image/object/") and kind:
                    values = getattr(features[key], kind).value
                    if len(values) == len(keep):
                        kept = [v for v, k in zip(values, keep) if k]
                        del values[:]
                        values.extend(kept)
            writer.write(example.SerializeToString())
    return out


def test_tflite_export_refuses_other_families_and_bad_flags_in_one_line(tmp_path):
    from od_dist.model import export, tflite
    from od_dist.model.pipeline import load_pipeline

    faster = tmp_path / "faster.yaml"
    faster.write_text("experiment: fasterrcnn_resnetfpn_coco\n")
    with pytest.raises(export.ExportError) as refused:
        tflite.export_tflite(
            load_pipeline(str(faster)),
            str(tmp_path),
            {"none": str(tmp_path / "m.tflite")},
            pipeline_path=str(faster),
        )
    assert str(refused.value) == (
        f"--format tflite: '{faster}' is a Faster R-CNN pipeline; TFLite export converts RetinaNet "
        "pipelines only (the demo, imported SSD, SSD FPN and EfficientDet configs: Model Garden's "
        "TFLite detection op is RetinaNet's); export a SavedModel instead (leave out --format)"
    )
    # The command checks its flags before it loads anything.
    r = od_dist(
        "export", f"--pipeline={DEMO}", f"--model_dir={tmp_path}", f"--out={tmp_path}/x", "--quantize=fp16"
    )
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "od-dist export: --quantize: 'fp16': applies to --format tflite only; add --format tflite"
    ], r.stderr
    r = od_dist(
        "export", f"--pipeline={DEMO}", f"--model_dir={tmp_path}", f"--out={tmp_path}/x", "--format=tflite"
    )
    assert r.returncode == 2 and "pass a file name ending in .tflite" in r.stderr, r.stderr
    assert os.listdir(tmp_path) == ["faster.yaml"]  # nothing written
    r = od_dist("eval", f"--pipeline={DEMO}", f"--model={tmp_path}/none.tflite")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"od-dist eval: --model: '{tmp_path}/none.tflite': no such .tflite; pass a file `od-dist export --format "
        "tflite` wrote"
    ], r.stderr


def _events(tf, path, series):
    writer = tf.summary.create_file_writer(path)
    with writer.as_default():
        for tag, values in series.items():
            for step, value in values:
                tf.summary.scalar(tag, value, step=step)
    writer.close()


def test_report_draws_loss_lr_speed_and_ap(tmp_path):
    import tensorflow as tf
    from PIL import Image

    from od_dist.model import report

    model_dir = str(tmp_path / "run")
    steps = range(50, 1050, 50)
    _events(
        tf,
        os.path.join(model_dir, "train"),
        {
            "total_loss": [(s, 2.0 / (1 + s / 200)) for s in steps],
            "cls_loss": [(s, 1.0 / (1 + s / 200)) for s in steps],
            "box_loss": [(s, 0.01 / (1 + s / 200)) for s in steps],
            "learning_rate": [(s, 0.08 * (1 - s / 1000)) for s in steps],
            "steps_per_second": [(s, 12.0) for s in steps],
        },
    )
    _events(
        tf,
        os.path.join(model_dir, "validation"),
        {"AP": [(500, 0.5), (1000, 0.8)], "AP50": [(500, 0.8), (1000, 0.97)]},
    )
    done = report.report(model_dir)
    assert done["out"] == os.path.join(model_dir, "report.png")
    assert {"total_loss", "learning_rate", "steps_per_second"} <= set(done["train"])
    assert {"AP", "AP50"} <= set(done["validation"])
    scalars = report.read_scalars(os.path.join(model_dir, "train"))
    assert len(scalars["total_loss"]) == 20  # every event, not TensorBoard's default sample of 10
    assert scalars["learning_rate"][0] == (50, pytest.approx(0.076))
    with Image.open(done["out"]) as im:
        assert im.size == (800, 560)
        assert len(np.unique(np.asarray(im.convert("RGB")).reshape(-1, 3), axis=0)) > 5  # not blank


def test_report_export_predict_errors_are_one_line(tmp_path):
    r = od_dist("report", "--model_dir", str(tmp_path))
    assert r.returncode == 2 and "no event files in train/ or validation/" in r.stderr, r.stderr
    r = od_dist("predict", "--model", str(tmp_path), "--images", str(tmp_path), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "not a SavedModel" in r.stderr, r.stderr
    r = od_dist(
        "export", "--pipeline", DEMO, "--model_dir", str(tmp_path / "none"), "--out", str(tmp_path / "x")
    )
    assert r.returncode == 1 and "no checkpoint to export" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not os.path.exists(tmp_path / "x")
