"""`od-dist predict`: an exported SavedModel on the user's own images.

For each image: ``<out>/<name>.png``, the image with its detections drawn (class name and score,
Model Garden's ``visualization_utils``), and one ``<out>/detections.json`` for all images:
``[{"image": path, "width": W, "height": H, "detections": [{"box": [xmin, ymin, xmax, ymax] in
pixels of the original image, "class": name, "class_id": id, "score": s}, ...]}, ...]``, best first.
"""

from __future__ import annotations

import json
import os

from od_dist.data.records import IMAGE_SUFFIXES

JSON_FILE = "detections.json"


class PredictError(RuntimeError):
    """One line for the user."""


def image_paths(paths: list[str]) -> list[str]:
    """Files as given, folders expanded to their images (sorted)."""
    found = []
    for p in paths:
        if os.path.isdir(p):
            found += sorted(os.path.join(p, n) for n in os.listdir(p) if n.lower().endswith(IMAGE_SUFFIXES))
        elif os.path.isfile(p):
            found.append(p)
        else:
            raise PredictError(
                f"--images: '{p}': no such file or folder; pass image files or a folder of images"
            )
    if not found:
        raise PredictError(f"--images: '{','.join(paths)}': no images ({', '.join(IMAGE_SUFFIXES)}) found")
    return found


def read_label_map(model_dir: str) -> dict[int, str]:
    from od_dist.data import records

    path = os.path.join(model_dir, records.LABEL_MAP_FILE)
    return records.read_labels(path) if os.path.isfile(path) else {}


def _out_name(path: str, used: set) -> str:
    base = os.path.splitext(os.path.basename(path))[0]
    name, n = base, 1
    while name in used:  # the same file name from two folders
        n += 1
        name = f"{base}_{n}"
    used.add(name)
    return name + ".png"


def predict(model_dir: str, paths: list[str], out_dir: str, min_score: float = 0.3) -> dict:
    """Runs the model on each image; writes the drawn PNGs and detections.json into ``out_dir``.
    Returns the JSON document's list and the output paths."""
    if not os.path.isfile(os.path.join(model_dir, "saved_model.pb")):
        raise PredictError(
            f"--model: '{model_dir}': not a SavedModel; pass the folder `od-dist export` wrote"
        )
    files = image_paths(paths)
    import numpy as np
    import tensorflow as tf
    from official.vision.utils.object_detection import visualization_utils as viz
    from PIL import Image

    names = read_label_map(model_dir)
    category_index = {i: {"id": i, "name": n} for i, n in names.items()}
    model = tf.saved_model.load(model_dir)
    serve = model.signatures["serving_default"]
    os.makedirs(out_dir, exist_ok=True)
    results, used, written = [], set(), []
    for path in files:
        try:
            with Image.open(path) as im:
                image = np.asarray(im.convert("RGB"))
        except OSError as e:
            raise PredictError(
                f"--images: '{path}': not a readable image ({e}); remove it from --images"
            ) from None
        h, w = image.shape[:2]
        out = serve(tf.constant(image[None]))
        n = int(out["num_detections"][0])
        boxes = out["detection_boxes"][0, :n].numpy()  # normalized to this image (export sets it)
        scores = out["detection_scores"][0, :n].numpy()
        classes = out["detection_classes"][0, :n].numpy().astype(int)
        keep = scores >= min_score
        dets = [
            {
                "box": [
                    round(float(b[1] * w), 1),
                    round(float(b[0] * h), 1),
                    round(float(b[3] * w), 1),
                    round(float(b[2] * h), 1),
                ],
                "class": names.get(int(c), str(int(c))),
                "class_id": int(c),
                "score": round(float(s), 4),
            }
            for b, s, c in zip(boxes[keep], scores[keep], classes[keep])
        ]
        drawn = image.copy()
        viz.visualize_boxes_and_labels_on_image_array(
            drawn,
            boxes[keep],
            classes[keep],
            scores[keep],
            category_index or {int(c): {"id": int(c), "name": str(int(c))} for c in classes[keep]},
            use_normalized_coordinates=True,
            max_boxes_to_draw=None,
            min_score_thresh=min_score,
            line_thickness=max(1, round(min(h, w) / 200)),
        )
        png = os.path.join(out_dir, _out_name(path, used))
        Image.fromarray(drawn).save(png)
        written.append(png)
        results.append({"image": path, "width": w, "height": h, "output": png, "detections": dets})
    json_path = os.path.join(out_dir, JSON_FILE)
    tmp = json_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
        f.write("\n")
    os.replace(tmp, json_path)
    return {"results": results, "json": json_path, "images": written}
