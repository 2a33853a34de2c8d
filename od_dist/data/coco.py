"""COCO JSON (``images``, ``annotations`` with ``bbox: [x, y, width, height]`` in pixels,
``categories``) -> Model Garden detection TFRecords (train and val) + label_map.pbtxt.

The records are made by Model Garden's own ``create_coco_tf_record.create_tf_example``. Around it,
od-dist checks what that function skips silently or fails on with a traceback: boxes outside the
image or of no size (it drops them), unknown image or category ids, missing image files, an image
whose size disagrees with the JSON. Category ids and image ids are kept as in the JSON (so the
same JSON can serve as ``task.annotation_file``); ``iscrowd`` boxes stay crowd (ignored in
training and scoring).
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import os

from od_dist.cluster.messages import shown
from od_dist.data import images, records
from od_dist.data.errors import BadAnnotation, DatasetError

_EDGE_TOLERANCE = 1.0  # pixels: COCO tools round, so x + w may pass the edge by a fraction


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _load(path: str) -> dict:
    if not os.path.isfile(path):
        raise DatasetError(
            f"--annotations: '{path}': no such file; pass the COCO JSON (e.g. instances_train.json)"
        )
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DatasetError(f"--annotations: '{path}': not readable JSON ({e}); fix the file") from None
    except RecursionError:  # json recurses once per level
        raise DatasetError(
            f"--annotations: '{path}': JSON nested too deep to be a COCO file; fix the file"
        ) from None
    if not isinstance(doc, dict):
        raise DatasetError(
            f"--annotations: '{path}': the top level must be an object with images, "
            "annotations and categories"
        )
    for key in ("images", "annotations", "categories"):
        if not isinstance(doc.get(key), list):
            raise DatasetError(
                f"--annotations: '{path}': no '{key}' list; a COCO detection file has "
                "images, annotations and categories"
            )
    return doc


def _categories(doc: dict, path: str) -> dict[int, str]:
    names = {}
    for n, c in enumerate(doc["categories"]):
        cid = c.get("id") if isinstance(c, dict) else None
        if not isinstance(cid, int) or isinstance(cid, bool) or cid < 1 or not c.get("name"):
            raise DatasetError(
                f"--annotations: '{path}': categories[{n}]: needs an integer id >= 1 "
                f"(0 is the background) and a name; got {c!r:.80}"
            )
        if cid in names:
            raise DatasetError(
                f"--annotations: '{path}': category id {cid} is listed twice; give each category its own id"
            )
        names[cid] = str(c["name"])
    if not names:
        raise DatasetError(f"--annotations: '{path}': no categories; list the classes under \"categories\"")
    return names


def _check_image(image: dict, anns: list, images_dir: str, names: dict[int, str], path: str) -> list:
    """Checks one image and its boxes; returns the annotations to write (clipped copies)."""
    fname = image.get("file_name")
    where = f"{path}: image id {shown(image.get('id'))} ('{shown(fname)}')"
    if not fname or not isinstance(fname, str):
        raise BadAnnotation(f"{where}: no file_name (a path as text); add it")
    file_path, inside = images.image_under(images_dir, fname)
    if not file_path:
        raise BadAnnotation(f"{where}: not found in '{images_dir}'; put the image there or fix file_name")
    if not inside:
        raise BadAnnotation(
            f"{where}: outside --images '{images_dir}' (a '..', an absolute path or a symlink); put the "
            "image in that folder and name it from there"
        )
    _, (width, height) = images.image_format(file_path)
    if (image.get("width"), image.get("height")) != (width, height):
        raise BadAnnotation(
            f"{where}: width/height {image.get('width')}x{image.get('height')} but the "
            f"file is {width}x{height}; fix width and height"
        )
    out = []
    for a in anns:
        awhere = f"{where}: annotation id {shown(a.get('id'))}"
        bbox = a.get("bbox")
        if (
            not isinstance(bbox, list)
            or len(bbox) != 4
            or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in bbox
            )
        ):
            raise BadAnnotation(f"{awhere}: bbox {bbox!r:.60} is not [x, y, width, height]; fix it")
        x, y, w, h = (float(v) for v in bbox)
        if not _whole(a.get("category_id")) or a["category_id"] not in names:
            raise BadAnnotation(
                f"{awhere}: category_id {shown(a.get('category_id'))} is not among the "
                f"categories ({', '.join(map(str, sorted(names)))}); fix it or add the "
                "category"
            )
        box = f"bbox [{x:g}, {y:g}, {w:g}, {h:g}]"
        if w <= 0 or h <= 0:
            raise BadAnnotation(f"{awhere}: {box} has no size; fix or remove the annotation")
        if (
            x < -_EDGE_TOLERANCE
            or y < -_EDGE_TOLERANCE
            or x + w > width + _EDGE_TOLERANCE
            or y + h > height + _EDGE_TOLERANCE
        ):
            raise BadAnnotation(f"{awhere}: {box} outside the {width}x{height} image; fix the box")
        # Within the tolerance: clip, or create_tf_example would drop the box without a word.
        x0, y0 = max(x, 0.0), max(y, 0.0)
        x1, y1 = min(x + w, float(width)), min(y + h, float(height))
        area = a.get("area")
        if area is not None and (
            isinstance(area, bool) or not isinstance(area, (int, float)) or not math.isfinite(area)
        ):
            raise BadAnnotation(f"{awhere}: area {area!r:.40} is not a finite number; fix it or leave it out")
        crowd = a.get("iscrowd", 0) or 0
        if crowd not in (0, 1):  # also refuses "abc", 1.5 and Infinity, which int() cannot take
            raise BadAnnotation(f"{awhere}: iscrowd {shown(crowd)} is not 0 or 1; fix it")
        fixed = dict(a, bbox=[x0, y0, x1 - x0, y1 - y0], iscrowd=int(crowd))
        fixed.setdefault("area", (x1 - x0) * (y1 - y0))
        out.append(fixed)
    return out


def convert(
    images_dir: str,
    annotations_path: str,
    out_dir: str,
    val_fraction: float = 0.1,
    skip_bad: bool = False,
    seed: int = 0,
    progress_stream=None,
):
    """Converts a COCO JSON and its images. Returns (records.Written, number of skipped images).
    Raises DatasetError (whole-file problems) or, without ``skip_bad``, BadAnnotation."""
    if not images_dir or not os.path.isdir(images_dir):
        raise DatasetError(
            f"--images: '{images_dir or ''}': not a directory; pass the folder the "
            "JSON's file_name entries are relative to"
        )
    records.split(0, val_fraction)
    doc = _load(annotations_path)
    names = _categories(doc, annotations_path)
    by_image = collections.defaultdict(list)
    problems = []
    for n, a in enumerate(doc["annotations"]):
        iid = a.get("image_id") if isinstance(a, dict) else None
        if not _whole(iid):
            problems.append(
                f"{annotations_path}: annotations[{n}]: image_id {shown(iid)} is not a whole number; "
                "COCO image ids are integers"
            )
            continue
        by_image[iid].append(a)
    good, seen = [], set()
    progress = records.Progress("data coco: checking", len(doc["images"]))
    for n, image in enumerate(doc["images"]):
        progress.step()
        iid = image.get("id") if isinstance(image, dict) else None
        if not _whole(iid):
            problems.append(
                f"{annotations_path}: images[{n}]: id {shown(iid)} is not a whole number; "
                "COCO image ids are integers"
            )
            continue
        if iid in seen:
            problems.append(f"{annotations_path}: image id {iid} is listed twice; give each image its own id")
            continue
        seen.add(iid)
        try:
            _check_image(image, by_image.get(iid, []), images_dir, names, annotations_path)
        except BadAnnotation as e:
            problems.append(str(e))
            continue
        good.append(n)
    orphans = sorted(set(by_image) - seen)
    if orphans:
        problems.append(
            f"{annotations_path}: annotations refer to image id(s) "
            f"{', '.join(map(str, orphans[:5]))}{' ...' if len(orphans) > 5 else ''} that "
            "are not in 'images'; fix image_id or add the images"
        )
    if not good and not problems:
        raise DatasetError(f"--annotations: '{annotations_path}': no images; nothing to convert")
    records.report_problems(problems, "data coco", skip_bad, unit="image(s)")
    if not good:
        raise DatasetError(
            f"--annotations: '{annotations_path}': every image had a problem; nothing to convert"
        )

    def make_example(index, _source_id):
        from official.vision.data import create_coco_tf_record

        image = doc["images"][index]
        anns = _check_image(image, by_image.get(image["id"], []), images_dir, names, annotations_path)
        example, _ = create_coco_tf_record.create_tf_example(
            image, [images_dir], bbox_annotations=anns, id_to_name_map=names
        )
        # create_tf_example stores the file's bytes as they are and always says 'jpg': the
        # converters' rule instead, so that every record holds what it says and training reads it.
        path = os.path.join(images_dir, image["file_name"])
        encoded, fmt = images.encoded_image(path, images.image_format(path)[0])
        feature = example.features.feature
        feature["image/encoded"].bytes_list.value[:] = [encoded]
        feature["image/format"].bytes_list.value[:] = [fmt.encode()]
        feature["image/key/sha256"].bytes_list.value[:] = [hashlib.sha256(encoded).hexdigest().encode()]
        return example, len(anns), sum(1 for a in anns if a["iscrowd"])

    splits = records.split(len(good), val_fraction, seed)
    written = records.write_dataset(out_dir, good, splits, make_example, names, "data coco", progress_stream)
    return written, len(problems)
