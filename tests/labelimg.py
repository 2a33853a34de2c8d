"""labelImg-style folders (images/*.jpg, annotations/*.xml) drawn from the shapes generator, for
the tests and the benchmarks (which put tests/ on their path)."""

import os

import numpy as np

from od_dist.data import shapes

SIZE = 96


def labelimg_xml(filename, width, height, objects):
    """An annotation exactly as labelImg saves it (its PascalVocWriter's layout)."""
    parts = [
        f"<annotation>\n\t<folder>images</folder>\n\t<filename>{filename}</filename>\n"
        f"\t<path>/home/user/my_data/images/{filename}</path>\n\t<source>\n\t\t<database>Unknown"
        f"</database>\n\t</source>\n\t<size>\n\t\t<width>{width}</width>\n\t\t<height>{height}"
        "</height>\n\t\t<depth>3</depth>\n\t</size>\n\t<segmented>0</segmented>\n"
    ]
    for name, xmin, ymin, xmax, ymax, difficult in objects:
        parts.append(
            f"\t<object>\n\t\t<name>{name}</name>\n\t\t<pose>Unspecified</pose>\n"
            f"\t\t<truncated>0</truncated>\n\t\t<difficult>{int(difficult)}</difficult>\n"
            f"\t\t<bndbox>\n\t\t\t<xmin>{xmin}</xmin>\n\t\t\t<ymin>{ymin}</ymin>\n"
            f"\t\t\t<xmax>{xmax}</xmax>\n\t\t\t<ymax>{ymax}</ymax>\n\t\t</bndbox>\n\t</object>\n"
        )
    parts.append("</annotation>\n")
    return "".join(parts)


def make_voc(root, count=8, seed=0):
    """images/*.jpg + annotations/*.xml; object 2 of image 0 is difficult. Returns the truth:
    {filename: [(name, xmin, ymin, xmax, ymax, difficult), ...]} in VOC pixels."""
    images, anns = os.path.join(root, "images"), os.path.join(root, "annotations")
    os.makedirs(images)
    os.makedirs(anns)
    rng = np.random.default_rng(seed)
    truth = {}
    for i in range(count):
        image, boxes, labels, _ = shapes.make_image(rng, SIZE)
        while len(labels) < 2 and i == 0:  # image 0 needs two objects (one difficult)
            image, boxes, labels, _ = shapes.make_image(rng, SIZE)
        name = f"photo_{i:03d}.jpg"
        with open(os.path.join(images, name), "wb") as f:
            f.write(shapes.encode_image(image, "jpeg"))
        # shapes' boxes: 0-based, max exclusive -> VOC: 1-based, max inclusive.
        objs = [
            (shapes.CLASSES[c - 1], x0 + 1, y0 + 1, x1, y1, i == 0 and k == 1)
            for k, ((y0, x0, y1, x1), c) in enumerate(zip(boxes.tolist(), labels.tolist()))
        ]
        truth[name] = objs
        with open(os.path.join(anns, name.replace(".jpg", ".xml")), "w") as f:
            f.write(labelimg_xml(name, SIZE, SIZE, objs))
    return images, anns, truth


def write_xml(
    path: str,
    image_filename: str,
    width: int,
    height: int,
    objects,
    folder: str = "images",
    image_path: str | None = None,
) -> None:
    """Writes one annotation the way labelImg does.

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
