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

from od_dist.cluster.validate import shown
from od_dist.data import records
from od_dist.data.records import BadAnnotation, DatasetError

MAX_XML_BYTES = 10 * 2**20  # a labelImg file is a few KB; anything this big is not an annotation
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")


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
    names += [stem + s for suffix in IMAGE_SUFFIXES for s in (suffix, suffix.upper())]
    for name in names:
        path, inside = records.image_under(images_dir, name)
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
    fmt, (width, height) = records.image_format(image_path)
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


def _scan(annotations_dir: str, images_dir: str, labels: dict[int, str] | None, labels_path: str | None):
    """Pass 1: (good XML paths, problems, class names in sorted order)."""
    good, problems, seen = [], [], set()
    known = set(labels.values()) if labels else None
    paths = list(records.matching_files(annotations_dir, ".xml"))
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
    annotations_dir: str,
    out_dir: str,
    val_fraction: float = 0.1,
    labels_path: str | None = None,
    skip_bad: bool = False,
    seed: int = 0,
    progress_stream=None,
):
    """Converts a labelImg/VOC folder. Returns (records.Written, number of skipped files).

    Raises DatasetError (bad flags, nothing to convert) and, without ``skip_bad``, BadAnnotation
    carrying the count after printing every problem (see ``records.report_problems``)."""
    for flag, d in (("--images", images_dir), ("--annotations", annotations_dir)):
        if not d or not os.path.isdir(d):
            raise DatasetError(
                f"{flag}: '{d or ''}': not a directory; pass the folder of "
                f"{'images' if flag == '--images' else 'labelImg .xml files'}"
            )
    labels = records.read_labels(labels_path) if labels_path else None
    records.split(0, val_fraction)  # checks the fraction before any work
    good, problems, seen = _scan(annotations_dir, images_dir, labels, labels_path)
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
        encoded, fmt = records.encoded_image(image.image_path, image.image_format)
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


def write_xml(
    path: str,
    image_filename: str,
    width: int,
    height: int,
    objects,
    folder: str = "images",
    image_path: str | None = None,
) -> None:
    """Writes one annotation the way labelImg does (used by tests and benchmarks).

    ``objects``: (name, xmin, ymin, xmax, ymax, difficult) with VOC's 1-based inclusive pixels."""
    lines = [
        "<annotation>",
        f"\t<folder>{folder}</folder>",
        f"\t<filename>{image_filename}</filename>",
        f"\t<path>{image_path or image_filename}</path>",
        "\t<source>",
        "\t\t<database>Unknown</database>",
        "\t</source>",
        "\t<size>",
        f"\t\t<width>{width}</width>",
        f"\t\t<height>{height}</height>",
        "\t\t<depth>3</depth>",
        "\t</size>",
        "\t<segmented>0</segmented>",
    ]
    for name, xmin, ymin, xmax, ymax, difficult in objects:
        lines += [
            "\t<object>",
            f"\t\t<name>{name}</name>",
            "\t\t<pose>Unspecified</pose>",
            "\t\t<truncated>0</truncated>",
            f"\t\t<difficult>{int(difficult)}</difficult>",
            "\t\t<bndbox>",
            f"\t\t\t<xmin>{xmin}</xmin>",
            f"\t\t\t<ymin>{ymin}</ymin>",
            f"\t\t\t<xmax>{xmax}</xmax>",
            f"\t\t\t<ymax>{ymax}</ymax>",
            "\t\t</bndbox>",
            "\t</object>",
        ]
    lines.append("</annotation>")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def write_shapes_folder(
    out_dir: str, count: int, seed: int = 0, image_size: int = 128, difficult_every: int = 0
) -> tuple[str, str]:
    """A labelImg-style folder (images/*.jpg, annotations/*.xml) of ``count`` shapes images, drawn
    by ``od_dist.data.shapes``. Every ``difficult_every``-th object is marked difficult (0: none).
    Returns (images_dir, annotations_dir)."""
    import numpy as np

    from od_dist.data import shapes

    images_dir = os.path.join(out_dir, "images")
    ann_dir = os.path.join(out_dir, "annotations")
    os.makedirs(images_dir, exist_ok=True)
    os.makedirs(ann_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    n_obj = 0
    for i in range(count):
        image, boxes, labels, _ = shapes.make_image(rng, image_size)
        name = f"img_{i:05d}"
        with open(os.path.join(images_dir, name + ".jpg"), "wb") as f:
            f.write(shapes.encode_image(image, "jpeg"))
        objs = []
        for (y0, x0, y1, x1), label in zip(boxes.tolist(), labels.tolist()):
            n_obj += 1
            # shapes' boxes are 0-based with the max exclusive: VOC's 1-based inclusive is +1 on min.
            objs.append(
                (
                    shapes.CLASSES[label - 1],
                    x0 + 1,
                    y0 + 1,
                    x1,
                    y1,
                    bool(difficult_every) and n_obj % difficult_every == 0,
                )
            )
        write_xml(os.path.join(ann_dir, name + ".xml"), name + ".jpg", image_size, image_size, objs)
    return images_dir, ann_dir
