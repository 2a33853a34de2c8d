"""The synthetic shapes dataset: record format, exact boxes, label map, reproducibility."""

import os

import numpy as np
import pytest
import tensorflow as tf

from od_dist.data import shapes


def _records(path):
    return [tf.train.Example.FromString(r) for r in tf.data.TFRecordDataset(path).as_numpy_iterator()]


def _read(path):
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("shapes"))
    summary = shapes.write_dataset(out, num_train=24, num_val=8, seed=3)
    return out, summary


def test_summary_and_files(small):
    out, summary = small
    assert summary["num_train"] == 24 and summary["num_val"] == 8
    assert summary["train"] == os.path.join(out, "train.tfrecord")
    assert summary["val"] == os.path.join(out, "val.tfrecord")
    assert summary["classes"] == ["circle", "square", "triangle"]
    assert len(_records(summary["train"])) == 24
    assert len(_records(summary["val"])) == 8
    assert summary["train_objects"] >= 24


def test_default_dir_is_where_the_demo_pipeline_reads():
    assert shapes.DEFAULT_DIR == os.path.join("data", "shapes")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pipelines", "shapes_retinanet.yaml")) as f:
        text = f.read()
    assert "input_path: data/shapes/train.tfrecord" in text
    assert "input_path: data/shapes/val.tfrecord" in text


def test_label_map(small):
    out, _ = small
    with open(os.path.join(out, "label_map.pbtxt")) as f:
        text = f.read()
    assert text == (
        "item {\n  id: 1\n  name: 'circle'\n}\n"
        "item {\n  id: 2\n  name: 'square'\n}\n"
        "item {\n  id: 3\n  name: 'triangle'\n}\n"
    )


def test_example_format(small):
    _, summary = small
    ids = set()
    for ex in _records(summary["val"]):
        f = ex.features.feature
        for key in (
            "image/encoded",
            "image/format",
            "image/source_id",
            "image/height",
            "image/width",
            "image/object/bbox/xmin",
            "image/object/bbox/ymin",
            "image/object/bbox/xmax",
            "image/object/bbox/ymax",
            "image/object/class/label",
            "image/object/area",
            "image/object/is_crowd",
        ):
            assert key in f, key
        assert f["image/format"].bytes_list.value[0] == b"jpeg"
        h, w = f["image/height"].int64_list.value[0], f["image/width"].int64_list.value[0]
        assert (h, w) == (128, 128)
        image = tf.io.decode_image(f["image/encoded"].bytes_list.value[0]).numpy()
        assert image.shape == (128, 128, 3)
        ids.add(int(f["image/source_id"].bytes_list.value[0]))  # numeric: COCO image ids
        n = len(f["image/object/class/label"].int64_list.value)
        assert 1 <= n <= 4
        xmin = np.array(f["image/object/bbox/xmin"].float_list.value)
        xmax = np.array(f["image/object/bbox/xmax"].float_list.value)
        ymin = np.array(f["image/object/bbox/ymin"].float_list.value)
        ymax = np.array(f["image/object/bbox/ymax"].float_list.value)
        assert all(len(a) == n for a in (xmin, xmax, ymin, ymax))
        assert (0 <= xmin).all() and (xmin < xmax).all() and (xmax <= 1).all()
        assert (0 <= ymin).all() and (ymin < ymax).all() and (ymax <= 1).all()
        labels = list(f["image/object/class/label"].int64_list.value)
        assert set(labels) <= {1, 2, 3}
        assert [t.decode() for t in f["image/object/class/text"].bytes_list.value] == [
            shapes.CLASSES[i - 1] for i in labels
        ]
        area = np.array(f["image/object/area"].float_list.value)
        assert (area > 0).all() and (area <= (xmax - xmin) * (ymax - ymin) * h * w + 1e-3).all()
        assert list(f["image/object/is_crowd"].int64_list.value) == [0] * n
    assert ids == set(range(1, 9))


def test_model_garden_decoder_reads_it(small):
    from official.vision.dataloaders import tf_example_decoder

    _, summary = small
    decoder = tf_example_decoder.TfExampleDecoder()
    raw = next(iter(tf.data.TFRecordDataset(summary["train"])))
    out = decoder.decode(raw)
    assert out["image"].shape == (128, 128, 3)
    assert out["groundtruth_boxes"].shape[1] == 4
    assert out["source_id"].numpy() == b"1"
    assert out["groundtruth_classes"].shape[0] == out["groundtruth_boxes"].shape[0]


def test_boxes_are_exact():
    """Each box is the tight extent of its shape: the fill ratio matches the geometry."""
    rng = np.random.default_rng(7)
    ratios = {1: [], 2: [], 3: []}
    for _ in range(60):
        image, boxes, labels, areas = shapes.make_image(rng, 128)
        for (y0, x0, y1, x1), label, area in zip(boxes, labels, areas):
            ratios[int(label)].append(area / ((y1 - y0) * (x1 - x0)))
    assert abs(np.mean(ratios[1]) - np.pi / 4) < 0.03  # circle
    assert np.mean(ratios[2]) == pytest.approx(1.0)  # square (filled rectangle)
    assert abs(np.mean(ratios[3]) - 0.5) < 0.04  # triangle


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    a = shapes.write_dataset(str(tmp_path / "a"), num_train=6, num_val=4, seed=11)
    b = shapes.write_dataset(str(tmp_path / "b"), num_train=6, num_val=4, seed=11)
    c = shapes.write_dataset(str(tmp_path / "c"), num_train=6, num_val=4, seed=12)
    assert _read(a["train"]) == _read(b["train"])
    assert _read(a["val"]) == _read(b["val"])
    assert _read(a["train"]) != _read(c["train"])
    # The validation split does not depend on the size of the training split.
    d = shapes.write_dataset(str(tmp_path / "d"), num_train=9, num_val=4, seed=11)
    assert _read(a["val"]) == _read(d["val"])


def test_png_option(tmp_path):
    s = shapes.write_dataset(str(tmp_path), num_train=2, num_val=1, image_format="png")
    ex = _records(s["train"])[0].features.feature
    assert ex["image/format"].bytes_list.value[0] == b"png"
    assert ex["image/encoded"].bytes_list.value[0][:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError):
        shapes.write_dataset(str(tmp_path), num_train=-1, num_val=1)
    with pytest.raises(ValueError):
        shapes.write_dataset(str(tmp_path), num_train=1, num_val=1, image_format="gif")


def test_fast_enough(tmp_path):
    import time

    t = time.time()
    shapes.write_dataset(str(tmp_path), num_train=500, num_val=50)
    assert time.time() - t < 10  # ~1.5 ms an image here
