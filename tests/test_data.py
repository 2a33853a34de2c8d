"""`od-dist data voc|coco|check` on small datasets the tests draw themselves: shapes images, XML
written the way labelImg writes it (1-based inclusive pixels, a `difficult` object), JSON the way
COCO writes it. Hostile annotations each give their one-line error, exit 2 and no output."""

import glob
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from labelimg import SIZE, labelimg_xml, make_voc
from loopback import ROOT, od_dist, run_cli

from od_dist.data import shapes


def read_records(pattern):
    import tensorflow as tf

    out = []
    for path in sorted(glob.glob(pattern)):
        out += [tf.train.Example.FromString(r) for r in tf.data.TFRecordDataset(path).as_numpy_iterator()]
    return out


def feat(ex, key):
    f = ex.features.feature[key]
    return list(f.float_list.value or f.int64_list.value or f.bytes_list.value)


@pytest.fixture
def voc(tmp_path):
    images, anns, truth = make_voc(str(tmp_path / "src"))
    return images, anns, truth, str(tmp_path / "out")


def leftovers(tmp_path):
    return [p for p in os.listdir(tmp_path) if "partial" in p or p == "out"]


# ----- data voc -------------------------------------------------------------------------------


def test_voc_converts_labelimg_folder(voc):
    from od_dist.data import voc as voc_mod

    images, anns, truth, out = voc
    written, skipped = voc_mod.convert(images, anns, out, val_fraction=0.25)
    assert skipped == 0 and written.num_classes == 4
    assert written.images == {"train": 6, "val": 2}
    with open(os.path.join(out, "label_map.pbtxt")) as f:
        assert f.read() == (
            "item {\n  id: 1\n  name: 'circle'\n}\nitem {\n  id: 2\n  name: 'square'\n}\n"
            "item {\n  id: 3\n  name: 'triangle'\n}\n"
        )
    examples = read_records(os.path.join(out, "train-*.tfrecord")) + read_records(
        os.path.join(out, "val-*.tfrecord")
    )
    assert len(examples) == 8
    ids = sorted(int(feat(e, "image/source_id")[0]) for e in examples)
    assert ids == list(range(1, 9))  # numeric and unique: COCO evaluation uses them as image ids
    ids_of = {"circle": 1, "square": 2, "triangle": 3}
    for e in examples:
        name = feat(e, "image/filename")[0].decode()
        objs = truth[name]
        assert feat(e, "image/height") == [SIZE] and feat(e, "image/width") == [SIZE]
        assert feat(e, "image/object/class/label") == [ids_of[o[0]] for o in objs]
        # 1-based inclusive pixels -> [xmin - 1, xmax] / size: exactly shapes' own box.
        np.testing.assert_allclose(
            feat(e, "image/object/bbox/xmin"), [(o[1] - 1) / SIZE for o in objs], atol=1e-6
        )
        np.testing.assert_allclose(
            feat(e, "image/object/bbox/ymin"), [(o[2] - 1) / SIZE for o in objs], atol=1e-6
        )
        np.testing.assert_allclose(feat(e, "image/object/bbox/xmax"), [o[3] / SIZE for o in objs], atol=1e-6)
        np.testing.assert_allclose(feat(e, "image/object/bbox/ymax"), [o[4] / SIZE for o in objs], atol=1e-6)
        assert feat(e, "image/object/is_crowd") == [int(o[5]) for o in objs]
    assert sum(sum(feat(e, "image/object/is_crowd")) for e in examples) == 1  # the difficult one


def test_voc_split_is_fixed_and_rerun_replaces_old_shards(voc):
    from od_dist.data import voc as voc_mod

    images, anns, _, out = voc
    voc_mod.convert(images, anns, out, val_fraction=0.25)
    first = [feat(e, "image/source_id") for e in read_records(os.path.join(out, "val-*.tfrecord"))]
    stale = os.path.join(out, "train-00003-of-00004.tfrecord")  # as if from a bigger earlier run
    open(stale, "w").close()
    voc_mod.convert(images, anns, out, val_fraction=0.25)
    assert [feat(e, "image/source_id") for e in read_records(os.path.join(out, "val-*.tfrecord"))] == first
    assert not os.path.exists(stale)
    assert not [p for p in os.listdir(os.path.dirname(out)) if "partial" in p]


def test_voc_cli_prints_what_a_pipeline_needs_then_data_check_passes(voc, tmp_path):
    images, anns, _, out = voc
    r = od_dist("data", "voc", "--images", images, "--annotations", anns, "--out", out)
    assert r.returncode == 0, r.stderr
    assert "task.model.num_classes: 4" in r.stdout
    assert f"task.train_data.input_path: {out}/train-*.tfrecord" in r.stdout
    assert f"task.validation_data.input_path: {out}/val-*.tfrecord" in r.stdout
    assert "1 difficult/crowd" in r.stdout
    assert "od-dist data voc: writing | 8/8 images (100%)" in r.stderr  # progress
    pipeline = tmp_path / "p.yaml"
    with open(os.path.join(ROOT, "pipelines", "custom_retinanet.yaml")) as f:
        text = f.read().replace("data/my_data", out)
    pipeline.write_text(text)
    r = od_dist("data", "check", "--pipeline", str(pipeline))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok: every record decodes" in r.stdout
    assert "train: 1 file(s)" in r.stdout and "validation: 1 file(s)" in r.stdout
    assert "(1 is_crowd/difficult" in r.stdout
    assert "1 circle" in r.stdout and "3 triangle" in r.stdout


def _one_line_error(r, *needles):
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    for needle in needles:
        assert needle in r.stderr, r.stderr


@pytest.mark.parametrize("case", ["unreadable_xml", "box_outside", "missing_image", "unknown_class"])
def test_voc_hostile_annotation_exit_2_nothing_written(voc, tmp_path, case):
    images, anns, truth, out = voc
    xml = os.path.join(anns, "photo_003.xml")
    extra = []
    if case == "unreadable_xml":
        with open(xml, "w") as f:
            f.write("<annotation><filename>photo_003.jpg</filename><object>\n")
        want = ["photo_003.xml: not readable XML", "fix the file or remove it"]
    elif case == "box_outside":
        with open(xml, "w") as f:
            f.write(labelimg_xml("photo_003.jpg", SIZE, SIZE, [("circle", 10, 10, SIZE + 5, 40, 0)]))
        want = [
            f"photo_003.xml: object 1 'circle': box (xmin 10, ymin 10, xmax {SIZE + 5}, ymax 40) "
            f"outside the {SIZE}x{SIZE} image",
            "fix the box",
        ]
    elif case == "missing_image":
        os.remove(os.path.join(images, "photo_003.jpg"))
        want = ["photo_003.xml: image 'photo_003.jpg' not found in", "put the image there"]
    else:
        labels = tmp_path / "labels.txt"
        labels.write_text("circle\nsquare\n")  # no triangle
        extra = ["--labels", str(labels)]
        bad = sorted(n for n, objs in truth.items() if any(o[0] == "triangle" for o in objs))[0]
        want = [
            f"{bad.replace('.jpg', '.xml')}: object",
            "class 'triangle' is not in --labels",
            "add it there or fix the name",
        ]
    r = od_dist("data", "voc", "--images", images, "--annotations", anns, "--out", out, *extra)
    _one_line_error(r, *want)
    assert "nothing written" in r.stderr and "--skip_bad" in r.stderr
    assert leftovers(tmp_path) == []


def test_voc_skip_bad_skips_and_says_how_many(voc, tmp_path, capsys):
    images, anns, _, out = voc
    with open(os.path.join(anns, "photo_003.xml"), "w") as f:
        f.write("not xml at all")
    os.remove(os.path.join(images, "photo_005.jpg"))
    code, stdout, stderr = run_cli(
        capsys, "data", "voc", "--images", images, "--annotations", anns, "--out", out, "--skip_bad"
    )
    assert code == 0, stderr
    assert "photo_003.xml: not readable XML" in stderr and "photo_005.xml: image" in stderr
    assert "skipped 2 bad annotation file(s)" in stdout
    assert len(read_records(os.path.join(out, "*.tfrecord"))) == 6


def test_voc_empty_dataset_and_bad_flags(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = str(tmp_path / "out")
    r = od_dist("data", "voc", "--images", str(empty), "--annotations", str(empty), "--out", out)
    _one_line_error(r, f"--annotations: '{empty}': no .xml files")
    assert r.stderr.count("\n") == 1
    r = od_dist("data", "voc", "--images", str(tmp_path / "nope"), "--annotations", str(empty), "--out", out)
    _one_line_error(r, "--images:", "not a directory")
    r = od_dist("data", "voc", "--images", str(empty), "--annotations", str(empty))
    _one_line_error(r, "--out: '': required")
    assert not os.path.exists(out)


def test_a_failure_while_writing_leaves_the_old_output(voc, tmp_path, monkeypatch):
    """An image that turns bad between the check and the write: the previous dataset stays."""
    from od_dist.data import errors
    from od_dist.data import voc as voc_mod

    images, anns, _, out = voc
    voc_mod.convert(images, anns, out)
    before = sorted(os.listdir(out))
    real = voc_mod.parse
    calls = []

    def flaky(path, images_dir):
        calls.append(path)
        if len(calls) > 10:  # the write pass
            raise errors.BadAnnotation(f"{path}: vanished")
        return real(path, images_dir)

    monkeypatch.setattr(voc_mod, "parse", flaky)
    with pytest.raises(errors.BadAnnotation):
        voc_mod.convert(images, anns, out)
    assert sorted(os.listdir(out)) == before
    assert not [p for p in os.listdir(tmp_path) if "partial" in p]


def test_labels_file_formats(tmp_path):
    from od_dist.data import errors, records

    pbtxt = tmp_path / "label_map.pbtxt"
    pbtxt.write_text("item {\n  id: 2\n  name: 'dog'\n}\nitem {\n  name: \"cat\"\n  id: 1\n}\n")
    assert records.read_labels(str(pbtxt)) == {1: "cat", 2: "dog"}
    txt = tmp_path / "labels.txt"
    txt.write_text("cat\n\ndog\n")
    assert records.read_labels(str(txt)) == {1: "cat", 2: "dog"}
    bad = tmp_path / "bad.pbtxt"
    bad.write_text("item { id: 0 name: 'x' }\n")
    with pytest.raises(errors.DatasetError, match="ids start at 1"):
        records.read_labels(str(bad))


def test_data_help_imports_no_tensorflow():
    code = (
        "import sys; from od_dist import cli\n"
        "assert {'data voc', 'data check'} <= set(cli.COMMANDS)\n"
        "for c in cli.COMMANDS:\n"
        "    assert cli.main(['od-dist', *c.split(), '--help']) == 0, c\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'official', 'keras', "
        "'tf_keras', 'matplotlib')]; print('HEAVY', heavy)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "HEAVY []" in r.stdout


# ----- data check on hand-made bad records --------------------------------------------------


def test_data_check_names_record_and_problem(tmp_path):
    import tensorflow as tf

    rng = np.random.default_rng(0)

    def example(sid, boxes, labels, h=SIZE):
        image, *_ = shapes.make_image(rng, SIZE)
        b = np.asarray(boxes, np.float32).reshape(-1, 4)
        f = tf.train.Feature
        feats = {
            "image/encoded": f(bytes_list=tf.train.BytesList(value=[shapes.encode_image(image)])),
            "image/source_id": f(bytes_list=tf.train.BytesList(value=[sid.encode()])),
            "image/height": f(int64_list=tf.train.Int64List(value=[h])),
            "image/width": f(int64_list=tf.train.Int64List(value=[SIZE])),
            "image/object/class/label": f(int64_list=tf.train.Int64List(value=labels)),
        }
        for i, k in enumerate(("ymin", "xmin", "ymax", "xmax")):
            feats[f"image/object/bbox/{k}"] = f(float_list=tf.train.FloatList(value=b[:, i].tolist()))
        return tf.train.Example(features=tf.train.Features(feature=feats)).SerializeToString()

    path = str(tmp_path / "bad.tfrecord")
    with tf.io.TFRecordWriter(path) as w:
        w.write(example("1", [[0.1, 0.1, 0.5, 0.5]], [1]))  # fine
        w.write(example("2", [[0.1, 0.1, 1.5, 0.5]], [1]))  # outside
        w.write(example("3", [[0.5, 0.5, 0.5, 0.6]], [2]))  # no area
        w.write(example("4", [[0.1, 0.1, 0.5, 0.5]], [4]))  # class id too big
        w.write(example("photo.jpg", [[0.1, 0.1, 0.5, 0.5]], [1]))  # not numeric
        w.write(example("1", [[0.1, 0.1, 0.5, 0.5]], [1]))  # repeated
        w.write(example("7", [[0.1, 0.1, 0.5, 0.5]], [1], h=50))  # stored size wrong
    with open(str(tmp_path / "cut.tfrecord"), "wb") as f:
        with open(path, "rb") as g:
            f.write(g.read()[:-100])
    r = od_dist("data", "check", "--records", path, "--num_classes", "4")
    assert r.returncode == 2, r.stdout + r.stderr
    out = r.stdout
    assert f"{path}: record 1 (source_id 2): box 1 (ymin 0.1, xmin 0.1, ymax 1.5, xmax 0.5) outside" in out
    assert f"{path}: record 2 (source_id 3): box 1" in out and "has no area" in out
    assert f"{path}: record 3 (source_id 4): object 1: class id 4 outside 1..3" in out
    assert f"{path}: record 4 (source_id photo.jpg): image/source_id 'photo.jpg' is not a number" in out
    assert f"{path}: record 5 (source_id 1): source_id 1 also used by bad.tfrecord record 0" in out
    assert f"{path}: record 6 (source_id 7): image/height is 50 but the image is {SIZE}x{SIZE}" in out
    assert "6 problems" in out
    assert "records: 1 file(s)" in out and "7 images, 7 objects" in out
    import io

    from od_dist.data import check  # in-process: TensorFlow is already imported here

    cut, buf = str(tmp_path / "cut.tfrecord"), io.StringIO()
    assert check.check({"records": cut}, None, buf) == 5  # 4 bad records before the cut, then the cut
    assert f"{cut}: record 6: unreadable" in buf.getvalue(), buf.getvalue()
    buf = io.StringIO()
    assert check.check({"train": str(tmp_path / "none-*.tfrecord")}, 4, buf) == 1
    assert "no file matches" in buf.getvalue()
    r = od_dist("data", "check")
    _one_line_error(r, "--pipeline/--records: pass exactly one")


def test_data_check_passes_the_demo_data_and_reads_ids_per_split(data_dir, tmp_path):
    """`data shapes` numbers its training and validation images from 1 each: two splits, which COCO
    evaluation never reads together, so the project's own data passes its own check, with a column
    per file. Shards of one split (what one evaluation reads) still may not repeat an id."""
    train, val = os.path.join(data_dir, "train.tfrecord"), os.path.join(data_dir, "val.tfrecord")
    r = od_dist("data", "check", "--records", train, val, env={"TF_CPP_MIN_LOG_LEVEL": None})
    assert r.returncode == 0, r.stdout + r.stderr
    # Nothing of TensorFlow's C++ log (this machine has no GPU: its failed cuInit is an ERROR line).
    assert not re.search(r"^\S+ \S+: [IWE] |cuInit", r.stderr, re.M), r.stderr
    lines = r.stdout.splitlines()
    assert lines[-1] == "ok: every record decodes, boxes and ids are valid", r.stdout
    assert f"{train}: 48 images" in r.stdout and f"{val}: 8 images" in r.stdout, r.stdout
    head = next(ln for ln in lines if ln.startswith("class "))
    assert head.split() == ["class", "train.tfrecord", "val.tfrecord"], r.stdout
    rows = [ln for ln in lines if ln[:1].isdigit()]
    assert len(rows) == 3 and all(len(ln) == len(head) for ln in rows), r.stdout  # columns line up
    for i in range(2):
        shutil.copyfile(val, tmp_path / f"val-0000{i}-of-00002.tfrecord")
    r = od_dist("data", "check", "--records", train, str(tmp_path / "val-*.tfrecord"))
    assert r.returncode == 2, r.stdout + r.stderr
    again = [ln for ln in r.stdout.splitlines() if "also used by" in ln]
    assert len(again) == 8 and all("val-00001-of-00002.tfrecord" in ln for ln in again), r.stdout
    assert "also used by val-00000-of-00002.tfrecord record 0" in again[0], r.stdout


@pytest.mark.parametrize("level", [None, "1"])
def test_data_check_in_a_programs_own_process_leaves_its_tensorflow_log_level(
    data_dir, monkeypatch, capsys, level
):
    """`data check` quiets TensorFlow's C++ ERROR lines while it runs; a program that runs it in its
    own process (cli.main) has its environment back as it was after, so the processes it starts
    next log as before (no TF_CPP_MIN_LOG_LEVEL=3 left set, a level of its own kept)."""
    from od_dist import cli
    from od_dist.cli import data

    monkeypatch.setattr(data, "_USERS_TF_LOG_LEVEL", None)  # as if od-dist were imported without one
    if level is None:
        monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    else:
        monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", level)
    train = os.path.join(data_dir, "train.tfrecord")
    assert cli.main(["od-dist", "data", "check", "--records", train]) == 0, capsys.readouterr()
    assert os.environ.get("TF_CPP_MIN_LOG_LEVEL") == level


# ----- data coco ------------------------------------------------------------------------------

COCO_IDS = {"circle": 1, "square": 3, "triangle": 7}  # COCO's ids have gaps; they are kept


def make_coco(root, count=6, seed=1):
    """images/*.png + instances.json as COCO writes it (bbox [x, y, w, h] from 0, a crowd box)."""
    images = os.path.join(root, "images")
    os.makedirs(images)
    rng = np.random.default_rng(seed)
    doc = {
        "info": {"description": "test", "version": "1.0", "year": 2026},
        "licenses": [],
        "images": [],
        "annotations": [],
        "categories": [{"supercategory": "shape", "id": i, "name": n} for n, i in COCO_IDS.items()],
    }
    for i in range(count):
        image, boxes, labels, areas = shapes.make_image(rng, SIZE)
        name = f"{i:012d}.png"
        with open(os.path.join(images, name), "wb") as f:
            f.write(shapes.encode_image(image, "png"))
        image_id = 1000 + i
        doc["images"].append(
            {
                "license": 1,
                "file_name": name,
                "coco_url": "",
                "height": SIZE,
                "width": SIZE,
                "date_captured": "2026-11-22 00:00:00",
                "flickr_url": "",
                "id": image_id,
            }
        )
        for (y0, x0, y1, x1), c, a in zip(boxes.tolist(), labels.tolist(), areas.tolist()):
            doc["annotations"].append(
                {
                    "segmentation": [[x0, y0, x1, y0, x1, y1, x0, y1]],
                    "area": float(a),
                    "iscrowd": int(len(doc["annotations"]) == 0),
                    "image_id": image_id,
                    "bbox": [float(x0), float(y0), float(x1 - x0), float(y1 - y0)],
                    "category_id": COCO_IDS[shapes.CLASSES[c - 1]],
                    "id": len(doc["annotations"]) + 1,
                }
            )
    path = os.path.join(root, "instances.json")
    with open(path, "w") as f:
        json.dump(doc, f)
    return images, path, doc


@pytest.fixture
def coco(tmp_path):
    images, path, doc = make_coco(str(tmp_path / "src"))
    return images, path, doc, str(tmp_path / "out")


def test_coco_converts_with_ids_kept(coco):
    from od_dist.data import coco as coco_mod

    images, path, doc, out = coco
    written, skipped = coco_mod.convert(images, path, out, val_fraction=0.34)
    assert skipped == 0 and written.num_classes == 8  # largest category id + 1
    assert written.images == {"train": 4, "val": 2}
    with open(os.path.join(out, "label_map.pbtxt")) as f:
        assert f.read() == (
            "item {\n  id: 1\n  name: 'circle'\n}\nitem {\n  id: 3\n  name: 'square'\n}\n"
            "item {\n  id: 7\n  name: 'triangle'\n}\n"
        )
    examples = read_records(os.path.join(out, "*.tfrecord"))
    assert sorted(int(feat(e, "image/source_id")[0]) for e in examples) == [im["id"] for im in doc["images"]]
    for e in examples:
        iid = int(feat(e, "image/source_id")[0])
        anns = [a for a in doc["annotations"] if a["image_id"] == iid]
        assert feat(e, "image/format") == [b"png"]
        assert feat(e, "image/object/class/label") == [a["category_id"] for a in anns]
        np.testing.assert_allclose(
            feat(e, "image/object/bbox/xmin"), [a["bbox"][0] / SIZE for a in anns], atol=1e-6
        )
        np.testing.assert_allclose(
            feat(e, "image/object/bbox/ymax"), [(a["bbox"][1] + a["bbox"][3]) / SIZE for a in anns], atol=1e-6
        )
        assert feat(e, "image/object/is_crowd") == [a["iscrowd"] for a in anns]


@pytest.mark.parametrize("case", ["box_outside", "missing_image", "unknown_category", "bad_json"])
def test_coco_hostile_exit_2_nothing_written(coco, tmp_path, case, capsys):
    images, path, doc, out = coco
    if case == "box_outside":
        doc["annotations"][2]["bbox"] = [50.0, 50.0, 80.0, 10.0]
        want = [
            f"image id {doc['annotations'][2]['image_id']}",
            f"annotation id 3: bbox [50, 50, 80, 10] outside the {SIZE}x{SIZE} image; fix the box",
        ]
    elif case == "missing_image":
        os.remove(os.path.join(images, doc["images"][1]["file_name"]))
        want = [f"image id 1001 ('{doc['images'][1]['file_name']}'): not found in", "put the image there"]
    elif case == "unknown_category":
        doc["annotations"][0]["category_id"] = 5
        want = ["annotation id 1: category_id 5 is not among the categories (1, 3, 7)"]
    with open(path, "w") as f:
        f.write(json.dumps(doc) if case != "bad_json" else json.dumps(doc)[:-20])
    if case == "bad_json":
        want = [f"--annotations: '{path}': not readable JSON"]
    r = od_dist("data", "coco", "--images", images, "--annotations", path, "--out", out)
    _one_line_error(r, *want)
    assert leftovers(tmp_path) == []
    if case == "box_outside":
        code, stdout, stderr = run_cli(
            capsys, "data", "coco", "--images", images, "--annotations", path, "--out", out, "--skip_bad"
        )
        assert code == 0, stderr
        assert "skipped 1 bad image(s)" in stdout and "task.model.num_classes: 8" in stdout
        assert len(read_records(os.path.join(out, "*.tfrecord"))) == 5


# PIL's name for each format a photo folder may hold, and the file suffix it is saved under.
FORMATS = {"JPEG": "jpg", "PNG": "png", "GIF": "gif", "BMP": "bmp", "TIFF": "tif", "WEBP": "webp"}


def test_both_converters_store_what_the_format_says_and_training_reads(tmp_path):
    """An image of every format the converters pick up: each record's image/format names what its
    bytes are (JPEG or PNG, the others re-encoded as PNG), and Model Garden's decoder reads it as
    the one RGB image it was (a GIF kept as it is decodes as a stack of frames, TIFF and WebP not
    at all)."""
    import io

    import tensorflow as tf
    from official.vision.dataloaders import tf_example_decoder
    from PIL import Image

    from od_dist.data import coco as coco_mod
    from od_dist.data import voc
    from od_dist.data.images import DECODABLE

    images = tmp_path / "images"
    ann = tmp_path / "ann"
    images.mkdir()
    ann.mkdir()
    pixels = np.zeros((12, 16, 3), np.uint8)
    pixels[:, :8] = (200, 30, 40)
    doc = {"images": [], "annotations": [], "categories": [{"id": 1, "name": "cat"}]}
    for n, (pil, suffix) in enumerate(FORMATS.items(), start=1):
        name = f"{pil.lower()}.{suffix}"
        Image.fromarray(pixels).save(
            images / name, format=pil, **({"lossless": True} if pil == "WEBP" else {})
        )
        (ann / f"{pil.lower()}.xml").write_text(labelimg_xml(name, 16, 12, [("cat", 1, 1, 8, 8, 0)]))
        doc["images"].append({"id": n, "file_name": name, "width": 16, "height": 12})
        doc["annotations"].append(
            {"id": n, "image_id": n, "category_id": 1, "bbox": [0, 0, 8, 8], "iscrowd": 0}
        )
    (tmp_path / "instances.json").write_text(json.dumps(doc))
    coco_mod.convert(str(images), str(tmp_path / "instances.json"), str(tmp_path / "coco"), val_fraction=0)
    voc.convert(str(images), str(ann), str(tmp_path / "voc"), val_fraction=0)
    decoder = tf_example_decoder.TfExampleDecoder()
    for converter in ("coco", "voc"):
        examples = read_records(str(tmp_path / converter / "*.tfrecord"))
        assert len(examples) == len(FORMATS)
        for e in examples:
            encoded, (fmt,) = feat(e, "image/encoded")[0], feat(e, "image/format")
            actual = Image.open(io.BytesIO(encoded)).format
            assert (fmt, actual) in ((b"jpg", "JPEG"), (b"png", "PNG")), (converter, fmt, actual)
            image = decoder.decode(tf.constant(e.SerializeToString()))["image"].numpy()
            assert image.shape == (12, 16, 3), (converter, fmt, image.shape)
            tolerance = 40 if actual == "JPEG" else 0  # JPEG is lossy; every other is stored losslessly
            assert np.abs(image.astype(int) - pixels).max() <= tolerance, (converter, fmt)
    assert DECODABLE == ("jpeg", "png")


def test_coco_empty(tmp_path):
    path = tmp_path / "empty.json"
    path.write_text(json.dumps({"images": [], "annotations": [], "categories": [{"id": 1, "name": "a"}]}))
    r = od_dist(
        "data", "coco", "--images", str(tmp_path), "--annotations", str(path), "--out", str(tmp_path / "out")
    )
    _one_line_error(r, "no images; nothing to convert")
    assert leftovers(tmp_path) == []
