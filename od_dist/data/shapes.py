"""A synthetic object-detection dataset: coloured shapes on a noisy background.

Every image holds one to four non-overlapping shapes (circle, square, triangle) in
random colours on a noisy two-colour gradient. Because shapes never overlap, the
box of each object is exactly the extent of its drawn pixels, so the ground truth
is exact. Records use the standard detection ``tf.train.Example`` layout read by
Model Garden's ``TfExampleDecoder`` (and the Object Detection API):

    image/encoded (JPEG, or PNG), image/format, image/filename, image/source_id, image/height, image/width,
    image/object/bbox/{xmin,ymin,xmax,ymax} (normalized), image/object/class/label,
    image/object/class/text, image/object/area (pixels), image/object/is_crowd

Output (default ``data/shapes``, relative to the working directory, which is
where ``pipelines/shapes_retinanet.yaml`` reads)::

    train.tfrecord   val.tfrecord   label_map.pbtxt   summary.json

The same seed gives byte-identical files; the validation split does not depend
on ``num_train`` (each split draws from its own child of the seed).

Command line: ``python -m od_dist.data.shapes --num_train 2000 --num_val 200``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
from collections.abc import Sequence

import numpy as np

from od_dist.data.records import LABEL_MAP_FILE

DEFAULT_DIR = os.path.join("data", "shapes")
CLASSES: tuple[str, ...] = ("circle", "square", "triangle")  # label ids 1, 2, 3
TRAIN_FILE = "train.tfrecord"
VAL_FILE = "val.tfrecord"
SUMMARY_FILE = "summary.json"

_MAX_OBJECTS = 4
_MIN_SIZE_FRAC = 0.15  # shape extent as a fraction of the image side
_MAX_SIZE_FRAC = 0.42
_NOISE_SIGMA = 6.0
_MIN_CONTRAST = 90.0  # RGB distance between a shape and the background under it


def label_map_text(classes: Sequence[str] = CLASSES) -> str:
    """The label map in Object Detection API ``.pbtxt`` format (ids from 1)."""
    return "".join(f"item {{\n  id: {i}\n  name: '{name}'\n}}\n" for i, name in enumerate(classes, start=1))


def _background(rng: np.random.Generator, size: int) -> np.ndarray:
    """A noisy linear gradient between two random colours, float32 HxWx3."""
    c0 = rng.uniform(0, 255, 3).astype(np.float32)
    c1 = rng.uniform(0, 255, 3).astype(np.float32)
    angle = rng.uniform(0, 2 * np.pi)
    ramp = np.arange(size, dtype=np.float32) / max(size - 1, 1)
    t = np.cos(angle) * ramp[None, :] + np.sin(angle) * ramp[:, None]
    t = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
    img = c0 + (c1 - c0) * t[..., None]
    img += _NOISE_SIGMA * rng.standard_normal(img.shape, dtype=np.float32)
    return img


def _shape_mask(kind: str, ext: int, rng: np.random.Generator) -> np.ndarray:
    """Boolean ext x ext mask of one shape filling (part of) its square cell."""
    c = np.arange(ext, dtype=np.float32) + 0.5  # pixel centres
    yy, xx = c[:, None], c[None, :]
    if kind == "circle":
        r = ext / 2.0
        return (yy - r) ** 2 + (xx - r) ** 2 <= r * r
    if kind == "square":
        # Axis-aligned; allow a mildly rectangular aspect so boxes vary.
        w = int(round(ext * rng.uniform(0.8, 1.0)))
        return np.broadcast_to(xx < w, (ext, ext))
    if kind == "triangle":
        # Isosceles, apex up or down, base spanning the full width.
        apex_up = bool(rng.integers(0, 2))
        frac = yy / ext if apex_up else (ext - yy) / ext
        return np.abs(xx - ext / 2.0) <= (ext / 2.0) * frac
    raise ValueError(f"unknown shape {kind!r}")


def _overlaps(box: tuple[int, int, int, int], boxes: list[tuple[int, int, int, int]], margin: int) -> bool:
    y0, x0, y1, x1 = box
    for by0, bx0, by1, bx1 in boxes:
        if not (x1 + margin <= bx0 or bx1 + margin <= x0 or y1 + margin <= by0 or by1 + margin <= y0):
            return True
    return False


def make_image(rng: np.random.Generator, size: int = 128):
    """Draws one image.

    Returns (uint8 HxWx3 image, int64 [N,4] pixel boxes ymin,xmin,ymax,xmax with
    the max exclusive, int64 [N] labels in 1..len(CLASSES), float32 [N] areas in
    pixels). Shapes never overlap, so each box is the exact extent of its pixels.
    """
    img = _background(rng, size)
    num = int(rng.integers(1, _MAX_OBJECTS + 1))
    placed: list[tuple[int, int, int, int]] = []
    boxes, labels, areas = [], [], []
    min_ext = max(4, int(round(_MIN_SIZE_FRAC * size)))
    max_ext = max(min_ext + 1, int(round(_MAX_SIZE_FRAC * size)))
    for _ in range(num):
        for _attempt in range(20):
            ext = int(rng.integers(min_ext, max_ext + 1))
            x0 = int(rng.integers(0, size - ext + 1))
            y0 = int(rng.integers(0, size - ext + 1))
            if not _overlaps((y0, x0, y0 + ext, x0 + ext), placed, margin=2):
                break
        else:
            continue  # no room left for this object
        label = int(rng.integers(1, len(CLASSES) + 1))
        mask = _shape_mask(CLASSES[label - 1], ext, rng)
        ys, xs = np.nonzero(mask)
        if ys.size == 0:
            continue
        cell = img[y0 : y0 + ext, x0 : x0 + ext]
        under = cell[ys, xs].mean(axis=0)
        for _c in range(20):
            colour = rng.uniform(0, 255, 3)
            if np.linalg.norm(colour - under) >= _MIN_CONTRAST:
                break
        else:
            colour = np.where(under > 127, 0.0, 255.0)
        cell[ys, xs] = colour[None, :] + rng.normal(0.0, _NOISE_SIGMA / 2, (ys.size, 3))
        placed.append((y0, x0, y0 + ext, x0 + ext))
        boxes.append((y0 + int(ys.min()), x0 + int(xs.min()), y0 + int(ys.max()) + 1, x0 + int(xs.max()) + 1))
        labels.append(label)
        areas.append(int(ys.size))
    image = np.clip(np.rint(img), 0, 255).astype(np.uint8)
    return (
        image,
        np.asarray(boxes, np.int64).reshape(-1, 4),
        np.asarray(labels, np.int64),
        np.asarray(areas, np.float32),
    )


def encode_image(image: np.ndarray, image_format: str = "jpeg") -> bytes:
    """PNG (lossless, ~32 KB at 128 px) or JPEG quality 95 (~7 KB, 20x faster)."""
    from PIL import Image  # via tf-models-official

    buf = io.BytesIO()
    if image_format == "png":
        Image.fromarray(image, "RGB").save(buf, format="PNG", compress_level=6)
    elif image_format == "jpeg":
        Image.fromarray(image, "RGB").save(buf, format="JPEG", quality=95)
    else:
        raise ValueError(f"image_format must be 'jpeg' or 'png', not {image_format!r}")
    return buf.getvalue()


def _example(
    tf,
    image: np.ndarray,
    boxes: np.ndarray,
    labels: np.ndarray,
    areas: np.ndarray,
    source_id: int,
    image_format: str,
):
    h, w = image.shape[:2]
    feature = tf.train.Feature
    bl = lambda v: feature(bytes_list=tf.train.BytesList(value=v))
    il = lambda v: feature(int64_list=tf.train.Int64List(value=v))
    fl = lambda v: feature(float_list=tf.train.FloatList(value=v))
    b = boxes.astype(np.float64)
    ext = "jpg" if image_format == "jpeg" else image_format
    feats = {
        "image/encoded": bl([encode_image(image, image_format)]),
        "image/format": bl([image_format.encode()]),
        "image/source_id": bl([str(source_id).encode()]),
        "image/filename": bl([f"{source_id:06d}.{ext}".encode()]),
        "image/height": il([h]),
        "image/width": il([w]),
        "image/object/bbox/ymin": fl((b[:, 0] / h).tolist()),
        "image/object/bbox/xmin": fl((b[:, 1] / w).tolist()),
        "image/object/bbox/ymax": fl((b[:, 2] / h).tolist()),
        "image/object/bbox/xmax": fl((b[:, 3] / w).tolist()),
        "image/object/class/label": il(labels.tolist()),
        "image/object/class/text": bl([CLASSES[i - 1].encode() for i in labels]),
        "image/object/area": fl(areas.tolist()),
        "image/object/is_crowd": il([0] * len(labels)),
    }
    return tf.train.Example(features=tf.train.Features(feature=feats))


def _write_split(
    tf, path: str, rng: np.random.Generator, count: int, image_size: int, image_format: str
) -> dict[str, int]:
    objects = 0
    per_class = [0] * len(CLASSES)
    tmp = path + ".tmp"
    with tf.io.TFRecordWriter(tmp) as writer:
        for i in range(count):
            image, boxes, labels, areas = make_image(rng, image_size)
            objects += len(labels)
            for label in labels:
                per_class[label - 1] += 1
            # source_id must be a number: COCO evaluation uses it as the image id.
            writer.write(
                _example(tf, image, boxes, labels, areas, i + 1, image_format).SerializeToString(
                    deterministic=True
                )
            )
    os.replace(tmp, path)
    return {"images": count, "objects": objects, **{f"objects_{n}": c for n, c in zip(CLASSES, per_class)}}


def write_dataset(
    out_dir: str = DEFAULT_DIR,
    *,
    num_train: int,
    num_val: int,
    image_size: int = 128,
    seed: int = 0,
    image_format: str = "jpeg",
) -> dict:
    """Writes train/val TFRecords and the label map into ``out_dir``.

    Returns a summary dict: ``out_dir``, ``train``/``val``/``label_map`` paths,
    ``num_train``, ``num_val``, per-split object counts, ``image_size``, ``seed``,
    ``classes`` and ``seconds``. The summary (without ``seconds``) is also
    written to ``summary.json``.
    """
    if num_train < 0 or num_val < 0:
        raise ValueError("num_train and num_val must be >= 0")
    if image_size < 16:
        raise ValueError("image_size must be at least 16")
    if image_format not in ("jpeg", "png"):
        raise ValueError(f"image_format must be 'jpeg' or 'png', not {image_format!r}")
    import tensorflow as tf

    start = time.time()
    os.makedirs(out_dir, exist_ok=True)
    train_seq, val_seq = np.random.SeedSequence(seed).spawn(2)
    train_path = os.path.join(out_dir, TRAIN_FILE)
    val_path = os.path.join(out_dir, VAL_FILE)
    label_map_path = os.path.join(out_dir, LABEL_MAP_FILE)
    train_stats = _write_split(
        tf, train_path, np.random.default_rng(train_seq), num_train, image_size, image_format
    )
    val_stats = _write_split(tf, val_path, np.random.default_rng(val_seq), num_val, image_size, image_format)
    with open(label_map_path, "w", encoding="utf-8") as f:
        f.write(label_map_text())
    summary = {
        "out_dir": out_dir,
        "train": train_path,
        "val": val_path,
        "label_map": label_map_path,
        "num_train": num_train,
        "num_val": num_val,
        "train_objects": train_stats["objects"],
        "val_objects": val_stats["objects"],
        "image_size": image_size,
        "image_format": image_format,
        "seed": seed,
        "classes": list(CLASSES),
    }
    with open(os.path.join(out_dir, SUMMARY_FILE), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, sort_keys=True)
        f.write("\n")
    summary["seconds"] = round(time.time() - start, 3)
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m od_dist.data.shapes",
        description="Write the synthetic shapes detection dataset (TFRecords).",
    )
    parser.add_argument("--out_dir", default=DEFAULT_DIR)
    parser.add_argument("--num_train", type=int, default=2000)
    parser.add_argument("--num_val", type=int, default=200)
    parser.add_argument("--image_size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image_format", choices=("jpeg", "png"), default="jpeg")
    args = parser.parse_args(argv)
    summary = write_dataset(
        args.out_dir,
        num_train=args.num_train,
        num_val=args.num_val,
        image_size=args.image_size,
        seed=args.seed,
        image_format=args.image_format,
    )
    print(json.dumps(summary, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
