"""The demo's COCO AP with records written by `od-dist data voc` from the same images, against the
native shapes records.

    python benchmarks/voc_vs_native.py [--steps 1000] [--work runs/voc_vs_native]

1. `od-dist data shapes`-style records (2000 train / 200 val, seed 0);
2. those very images written out as a labelImg folder (the JPEG bytes as files, boxes as VOC XML,
   1-based inclusive pixels), one folder per split;
3. `od-dist data voc --val_fraction 0` on each folder;
4. the demo pipeline trained on each (`od-dist train`, one machine) and evaluated on its own
   validation records (`od-dist eval`): the same 200 images either way.

Prints both results side by side. The two runs see identical pixels and boxes, so their APs should
differ only by training noise (input order and augmentation draws).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)
sys.path.insert(0, os.path.join(_REPO, "tests"))
from loopback import COCO_LINE  # noqa: E402 - the one pattern of the COCO line

PIPELINE = os.path.join(_REPO, "pipelines", "shapes_retinanet.yaml")


def records_to_labelimg(record_path: str, folder: str) -> int:
    """Writes each record's image bytes and boxes as images/<id>.jpg + annotations/<id>.xml."""
    import tensorflow as tf
    from labelimg import write_xml  # the tests' labelImg writer

    images, anns = os.path.join(folder, "images"), os.path.join(folder, "annotations")
    os.makedirs(images, exist_ok=True)
    os.makedirs(anns, exist_ok=True)
    n = 0
    for data in tf.data.TFRecordDataset(record_path).as_numpy_iterator():
        f = tf.train.Example.FromString(data).features.feature
        sid = int(f["image/source_id"].bytes_list.value[0])
        h, w = f["image/height"].int64_list.value[0], f["image/width"].int64_list.value[0]
        name = f"{sid:06d}.jpg"
        with open(os.path.join(images, name), "wb") as out:
            out.write(f["image/encoded"].bytes_list.value[0])
        box = {
            k: list(f[f"image/object/bbox/{k}"].float_list.value) for k in ("xmin", "ymin", "xmax", "ymax")
        }
        texts = [t.decode() for t in f["image/object/class/text"].bytes_list.value]
        objs = [
            (t, round(x0 * w) + 1, round(y0 * h) + 1, round(x1 * w), round(y1 * h), False)
            for t, x0, y0, x1, y1 in zip(texts, box["xmin"], box["ymin"], box["xmax"], box["ymax"])
        ]
        write_xml(os.path.join(anns, f"{sid:06d}.xml"), name, w, h, objs)
        n += 1
    return n


def od_dist(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "od_dist", *args], capture_output=True, text=True, cwd=_REPO)
    if r.returncode:
        sys.exit(f"od-dist {' '.join(args)} failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-3000:]}")
    return r.stdout + r.stderr


def train_and_eval(name: str, train: str, val: str, steps: int, work: str, fresh: bool):
    model_dir = os.path.join(work, f"run_{name}")
    if fresh:
        shutil.rmtree(model_dir, ignore_errors=True)  # otherwise a finished run is only evaluated
    override = (
        f"task.train_data.input_path={train},task.validation_data.input_path={val},"
        f"trainer.train_steps={steps},trainer.optimizer_config.learning_rate.cosine.decay_steps={steps}"
    )
    t0 = time.time()
    od_dist("train", "--pipeline", PIPELINE, "--model_dir", model_dir, "--params_override", override)
    seconds = time.time() - t0
    m = COCO_LINE.search(
        od_dist("eval", "--pipeline", PIPELINE, "--model_dir", model_dir, "--params_override", override)
    )
    return (float(m["AP"]), float(m["AP50"]), float(m["AP75"]), seconds, model_dir)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--work", default=os.path.join("runs", "voc_vs_native"))
    parser.add_argument("--fresh", action="store_true", help="train again even when --work holds the runs")
    args = parser.parse_args(argv)
    from od_dist.data import shapes

    native = os.path.join(args.work, "native")
    shapes.write_dataset(native, num_train=2000, num_val=200, seed=0)
    voc_out = {}
    for split, record in (("train", shapes.TRAIN_FILE), ("val", shapes.VAL_FILE)):
        folder = os.path.join(args.work, f"labelimg_{split}")
        shutil.rmtree(folder, ignore_errors=True)
        count = records_to_labelimg(os.path.join(native, record), folder)
        voc_out[split] = os.path.join(args.work, f"voc_{split}")
        od_dist(
            "data",
            "voc",
            "--images",
            os.path.join(folder, "images"),
            "--annotations",
            os.path.join(folder, "annotations"),
            "--out",
            voc_out[split],
            "--val_fraction",
            "0",
        )
        print(
            f"{split}: {count} images -> labelImg folder -> od-dist data voc -> {voc_out[split]}", flush=True
        )
    results = {
        "native shapes records": train_and_eval(
            "native",
            os.path.join(native, shapes.TRAIN_FILE),
            os.path.join(native, shapes.VAL_FILE),
            args.steps,
            args.work,
            args.fresh,
        ),
        "od-dist data voc records": train_and_eval(
            "voc",
            os.path.join(voc_out["train"], "train-*.tfrecord"),
            os.path.join(voc_out["val"], "train-*.tfrecord"),
            args.steps,
            args.work,
            args.fresh,
        ),
    }
    print(f"\n{'records':<26} {'AP':>6} {'AP50':>6} {'AP75':>6} {'train s':>8}")
    for name, (ap, ap50, ap75, seconds, _) in results.items():
        print(f"{name:<26} {ap:>6.3f} {ap50:>6.3f} {ap75:>6.3f} {seconds:>8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
