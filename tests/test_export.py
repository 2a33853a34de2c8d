"""The detector side: labelImg folder -> records -> a few training steps -> export -> predict, and
the run report. The end-to-end test trains for real (slow, few steps); the report and the error
paths are fast."""

import json
import os

import numpy as np
import pytest
from labelimg import SIZE, make_voc
from loopback import PIPELINE as DEMO
from loopback import SMALL, od_dist


@pytest.mark.slow
def test_labelimg_folder_to_trained_exported_model_and_drawn_detections(tmp_path):
    import tensorflow as tf
    from PIL import Image

    from od_dist.data import voc
    from od_dist.model import export, predict
    from od_dist.model.pipeline import load_pipeline
    from od_dist.task import trainer

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
    assert tf.train.latest_checkpoint(model_dir).endswith("ckpt-6")

    # After 6 steps every score is near RetinaNet's 0.01 prior, under the pipeline's 0.05: export
    # with every score kept, so boxes get drawn.
    params = load_pipeline(DEMO, override)
    out = str(tmp_path / "exported")
    done = export.export(params, model_dir, out, min_score=0.0)
    assert done["checkpoint"].endswith("ckpt-6") and done["label_map"] == written.label_map
    assert export.exported_min_score(out) == 0.0
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

    r = od_dist("report", "--model_dir", model_dir, timeout=300)
    assert r.returncode == 0, r.stderr
    with Image.open(os.path.join(model_dir, "report.png")) as im:
        assert im.size[0] > 400 and im.size[1] > 300


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
