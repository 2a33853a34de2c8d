"""Pascal VOC / labelImg XML -> Model Garden detection TFRecords (train and val) + label_map.pbtxt.

VOC boxes are integer pixels, 1-based and inclusive: ``xmin=1, xmax=10`` covers the first ten pixel
columns, i.e. the continuous span [0, 10). So the normalized box is ``((xmin - 1) / W, xmax / W)``
(the Object Detection API's converter divides without subtracting 1, shifting every box by a pixel).
A 0 written by a tool that counts from 0 is taken as the image edge.

``difficult`` objects are written with ``image/object/is_crowd = 1``: Model Garden's RetinaNet and
Faster R-CNN parsers drop crowd boxes from the training targets (``skip_crowd_during_training``,
default true), and its COCO evaluation passes ``iscrowd`` to pycocotools, which treats such boxes as
ignore regions (a detection on one is neither a true nor a false positive): what the VOC metric does
with ``difficult``. They are also written as ``image/object/difficult`` for other readers.

Two passes: the first parses every XML and checks it against its image's header (nothing is
written when anything is wrong, unless ``--skip_bad``); the second re-reads each file while writing,
so only the list of file names is held in memory, never the images.
"""

from __future__ import annotations

import math
import os
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from od_dist.cluster.messages import shown
from od_dist.data import images, records
from od_dist.data.errors import BadAnnotation, DatasetError

MAX_XML_BYTES = 10 * 2**20  # a labelImg file is a few KB; anything this big is not an annotation


@dataclass(frozen=True)
class VocObject:
    name: str
    box: tuple[float, float, float, float]  # ymin, xmin, ymax, xmax in continuous pixels
    difficult: bool


@dataclass(frozen=True)
class VocImage:
    xml_path: str
    image_path: str
    image_format: str
    width: int
    height: int
    objects: tuple[VocObject, ...]


def _text(node, tag: str) -> str | None:
    child = node.find(tag)
    return child.text.strip() if child is not None and child.text is not None else None


def _number(xml_path: str, where: str, node, tag: str) -> float:
    text = _text(node, tag)
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value):  # NaN or infinity would reach the records as a box
        raise BadAnnotation(
            f"{xml_path}: {where}: <{tag}> is '{shown(text or '')}', not a finite number; fix the file"
        )
    return value


def _find_image(xml_path: str, filename: str | None, images_dir: str) -> str:
    # labelImg writes <filename>; other tools leave it out or keep an old name: try the XML's stem.
    stem = os.path.splitext(os.path.basename(xml_path))[0]
    names = [filename] if filename else []
    names += [stem + s for suffix in images.IMAGE_SUFFIXES for s in (suffix, suffix.upper())]
    for name in names:
        path, inside = images.image_under(images_dir, name)
        if path and not inside:
            raise BadAnnotation(
                f"{xml_path}: image '{shown(name)}' is outside --images '{images_dir}' (a '..', an absolute "
                "path or a symlink); put the image in that folder and name it from there"
            )
        if path:
            return path
    wanted = filename or stem + ".jpg"
    raise BadAnnotation(
        f"{xml_path}: image '{shown(wanted)}' not found in '{images_dir}'; put the image "
        "there, fix <filename>, or remove the XML"
    )


def parse(xml_path: str, images_dir: str) -> VocImage:
    """One annotation file, checked against its image's header. Raises BadAnnotation."""
    try:
        if os.path.getsize(xml_path) > MAX_XML_BYTES:
            raise BadAnnotation(
                f"{xml_path}: larger than {MAX_XML_BYTES >> 20} MiB, not an annotation; "
                "remove it from --annotations"
            )
        # ElementTree resolves no external entities, and expat >= 2.4 (Python 3.11 ships 2.5) refuses
        # entity-expansion bombs: safe for files from others.
        root = ET.parse(xml_path).getroot()
    except ET.ParseError as e:
        raise BadAnnotation(f"{xml_path}: not readable XML ({e}); fix the file or remove it") from None
    except OSError as e:
        raise BadAnnotation(
            f"{xml_path}: cannot read ({e.strerror}); fix its permissions or remove it"
        ) from None
    if root.tag != "annotation":
        raise BadAnnotation(
            f"{xml_path}: root element is <{root.tag}>, not <annotation>; this is not a "
            "Pascal VOC / labelImg file"
        )
    image_path = _find_image(xml_path, _text(root, "filename"), images_dir)
    fmt, (width, height) = images.image_format(image_path)
    size = root.find("size")
    if size is not None and _text(size, "width") and _text(size, "height"):
        w, h = _number(xml_path, "size", size, "width"), _number(xml_path, "size", size, "height")
        if (w, h) != (width, height) and (w, h) != (0, 0):
            raise BadAnnotation(
                f"{xml_path}: <size> says {w:g}x{h:g} but {image_path} is "
                f"{width}x{height}; fix <size> or annotate the right image"
            )
    objects = []
    for n, obj in enumerate(root.findall("object"), start=1):
        name = _text(obj, "name")
        where = f"object {n}{' ' + repr(name) if name else ''}"
        if not name:
            raise BadAnnotation(f"{xml_path}: object {n}: no <name>; give it a class name")
        bndbox = obj.find("bndbox")
        if bndbox is None:
            raise BadAnnotation(f"{xml_path}: {where}: no <bndbox>; draw its box or remove it")
        xmin, ymin, xmax, ymax = (
            _number(xml_path, where, bndbox, t) for t in ("xmin", "ymin", "xmax", "ymax")
        )
        shown = f"(xmin {xmin:g}, ymin {ymin:g}, xmax {xmax:g}, ymax {ymax:g})"
        if xmin < 0 or ymin < 0 or xmax > width or ymax > height:
            raise BadAnnotation(
                f"{xml_path}: {where}: box {shown} outside the {width}x{height} image "
                "(VOC counts pixels from 1 to the width); fix the box"
            )
        if xmax < xmin or ymax < ymin:
            raise BadAnnotation(f"{xml_path}: {where}: box {shown} has max < min; swap or redraw it")
        difficult = _text(obj, "difficult") in ("1", "true", "True")
        # 1-based inclusive -> continuous [min - 1, max]; a 0 from a 0-based tool is the edge.
        objects.append(VocObject(name, (max(ymin - 1, 0.0), max(xmin - 1, 0.0), ymax, xmax), difficult))
    return VocImage(xml_path, image_path, fmt, width, height, tuple(objects))


def xml_files(annotations: list[str]) -> list[str]:
    """The .xml files of --annotations: every one under each folder, and each file given."""
    found = []
    for path in annotations:
        found += records.matching_files(path, ".xml") if os.path.isdir(path) else [path]
    return list(dict.fromkeys(found))


def _scan(paths: list[str], images_dir: str, labels: dict[int, str] | None, labels_path: str | None):
    """Pass 1: (good XML paths, problems, class names in sorted order)."""
    good, problems, seen = [], [], set()
    known = set(labels.values()) if labels else None
    progress = records.Progress("data voc: checking", len(paths))
    for xml_path in paths:
        progress.step()
        try:
            image = parse(xml_path, images_dir)
            for n, obj in enumerate(image.objects, start=1):
                if known is not None and obj.name not in known:
                    raise BadAnnotation(
                        f"{xml_path}: object {n}: " + records.unknown_class(obj.name, known, labels_path)
                    )
        except BadAnnotation as e:
            problems.append(str(e))
            continue
        good.append(xml_path)
        seen.update(o.name for o in image.objects)
    return good, problems, seen


def convert(
    images_dir: str,
    annotations,
    out_dir: str,
    val_fraction: float = 0.1,
    labels_path: str | None = None,
    skip_bad: bool = False,
    seed: int = 0,
    progress_stream=None,
):
    """Converts a labelImg/VOC folder. `annotations`: folders of .xml files and .xml files, as
    records.expand_paths reads a flag (several, globs, comma-separated). Returns (records.Written,
    number of skipped files).

    Raises DatasetError (bad flags, nothing to convert) and, without ``skip_bad``, BadAnnotation
    carrying the count after printing every problem (see ``records.report_problems``)."""
    if not images_dir or not os.path.isdir(images_dir):
        raise DatasetError(f"--images: '{images_dir or ''}': not a directory; pass the folder of images")
    given = records.expand_paths(annotations)
    for path in given or [""]:
        if not os.path.isdir(path) and not (os.path.isfile(path) and path.lower().endswith(".xml")):
            raise DatasetError(
                f"--annotations: '{path}': neither a directory nor an .xml file; pass the folder of "
                "labelImg .xml files (or the files)"
            )
    annotations_dir = ",".join(given)
    labels = records.read_labels(labels_path) if labels_path else None
    records.split(0, val_fraction)  # checks the fraction before any work
    good, problems, seen = _scan(xml_files(given), images_dir, labels, labels_path)
    if not good and not problems:
        raise DatasetError(
            f"--annotations: '{annotations_dir}': no .xml files; point it at the folder "
            "labelImg saved into (Pascal VOC format)"
        )
    records.report_problems(problems, "data voc", skip_bad)
    if not good:
        raise DatasetError(
            f"--annotations: '{annotations_dir}': every annotation file was bad; nothing to convert"
        )
    if labels is None:
        labels = {i: n for i, n in enumerate(sorted(seen), start=1)}
    ids = {n: i for i, n in labels.items()}

    def make_example(xml_path, source_id):
        import tensorflow as tf
        from official.vision.data import tfrecord_lib

        image = parse(xml_path, images_dir)  # pass 2: re-read, so nothing is kept from pass 1
        encoded, fmt = images.encoded_image(image.image_path, image.image_format)
        feats = tfrecord_lib.image_info_to_feature_dict(
            image.height, image.width, os.path.relpath(image.image_path, images_dir), source_id, encoded, fmt
        )
        h, w = float(image.height), float(image.width)
        objs = image.objects
        feats.update(
            records.box_features(
                [(o.box[0] / h, o.box[1] / w, o.box[2] / h, o.box[3] / w) for o in objs],
                [ids[o.name] for o in objs],
                labels,
                [int(o.difficult) for o in objs],
                [(o.box[2] - o.box[0]) * (o.box[3] - o.box[1]) for o in objs],
            )
        )
        example = tf.train.Example(features=tf.train.Features(feature=feats))
        return example, len(objs), sum(o.difficult for o in objs)

    splits = records.split(len(good), val_fraction, seed)
    written = records.write_dataset(out_dir, good, splits, make_example, labels, "data voc", progress_stream)
    return written, len(problems)
