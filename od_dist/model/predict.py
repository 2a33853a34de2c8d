"""`od-dist predict`: an exported SavedModel, or .tflite (model/tflite.py), on the user's own images.

For each image: ``<out>/<name>.png``, the image with its detections drawn (class name and score,
Model Garden's ``visualization_utils``), and one ``<out>/detections.json`` for all images:
``[{"image": path, "width": W, "height": H, "detections": [{"box": [xmin, ymin, xmax, ymax] in
pixels of the original image, "class": name, "class_id": id, "score": s}, ...]}, ...]``, best first.
"""

from __future__ import annotations

import json
import os

from od_dist.data.images import IMAGE_SUFFIXES

JSON_FILE = "detections.json"


class PredictError(RuntimeError):
    """One line for the user."""


def image_paths(paths: list[str]) -> list[str]:
    """Files as given, folders expanded to their images (sorted); globs and comma-separated lists
    as every flag that takes several files reads them (records.expand_paths)."""
    from od_dist.data import records

    found = []
    for p in records.expand_paths(paths):
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


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([path, folder]) == folder


def _earlier_outputs(out_dir: str) -> set[str] | None:
    """The files an earlier `od-dist predict` wrote into out_dir (its PNGs, from its
    detections.json, and that file), or None when there is no such detections.json."""
    path = os.path.join(out_dir, JSON_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        # Outputs are written directly into out_dir; their names hold wherever it is run from.
        folder = os.path.realpath(out_dir)
        pngs = {
            os.path.join(folder, os.path.basename(r["output"]))
            for r in doc
            if set(r) >= {"image", "output", "detections"}
        }
    except (OSError, ValueError, TypeError, AttributeError, KeyError, RecursionError):
        return None
    return pngs | {os.path.realpath(path)}


def _check_out(out_dir: str, paths: list[str], files: list[str]) -> list[str]:
    """The output PNG of each image, once out_dir is known to be safe to write: it is not an input
    and holds none (the drawn images would replace the photos, and be read back as input), and
    every file it would replace is od-dist's own output from an earlier run."""
    for given in list(paths) + list(files):
        if _inside(given, out_dir):
            raise PredictError(
                f"--out: '{out_dir}': is or holds the input '{given}'; the drawn images would replace "
                "the photos: choose another --out"
            )
    used: set = set()
    outputs = [os.path.join(out_dir, _out_name(path, used)) for path in files]
    ours = _earlier_outputs(out_dir) or set()
    for path in outputs + [os.path.join(out_dir, JSON_FILE)]:
        if os.path.lexists(path) and (os.path.islink(path) or os.path.realpath(path) not in ours):
            raise PredictError(
                f"--out: '{path}': exists and is not an earlier od-dist predict output; "
                "choose another --out, or move the file"
            )
    return outputs


def exported_min_score(model_dir: str) -> float | None:
    """The score under which an exported model drops detections itself (None: an export that
    does not say, made before od-dist wrote it). ``model_dir`` may be a .tflite (its .json says)."""
    from od_dist.model import export, tflite

    if model_dir.endswith(tflite.SUFFIX):
        value = tflite.read_info(model_dir).get("min_score")
        return float(value) if isinstance(value, (int, float)) else None
    try:
        with open(os.path.join(model_dir, export.EXPORT_INFO), encoding="utf-8") as f:
            value = json.load(f).get("min_score")
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) else None


def below_export_threshold(model_dir: str, min_score: float) -> str | None:
    """One line when `min_score` is under the score the exported model already drops detections
    at: a lower --min_score then shows nothing more."""
    exported = exported_min_score(model_dir)
    if exported is None or min_score >= exported:
        return None
    return (
        f"--min_score {min_score:g} is below {exported:g}, the score under which the exported model "
        f"itself drops detections: nothing under {exported:g} is shown; to see lower scores, export "
        f"again with --min_score {min_score:g}"
    )


def predict(model_dir: str, paths: list[str], out_dir: str, min_score: float = 0.3) -> dict:
    """Runs the model on each image; writes the drawn PNGs and detections.json into ``out_dir``.
    Returns the JSON document's list, the output paths, and `note`: the line of
    ``below_export_threshold`` or None."""
    is_tflite = os.path.isfile(model_dir) and model_dir.endswith(".tflite")
    if not (is_tflite or os.path.isfile(os.path.join(model_dir, "saved_model.pb"))):
        raise PredictError(
            f"--model: '{model_dir}': not a SavedModel or a .tflite; pass the folder `od-dist export` "
            "wrote, or its .tflite"
        )
    files = image_paths(paths)
    outputs = _check_out(out_dir, paths, files)
    import numpy as np
    from official.vision.utils.object_detection import visualization_utils as viz
    from PIL import Image

    if is_tflite:
        from od_dist.model import export, tflite

        try:
            names = tflite.labels_of(model_dir)
        except export.ExportError as e:
            raise PredictError(str(e)) from None
    else:
        names = read_label_map(model_dir)
    category_index = {i: {"id": i, "name": n} for i, n in names.items()}
    detect = _tflite_detector(model_dir) if is_tflite else _saved_model_detector(model_dir)
    os.makedirs(out_dir, exist_ok=True)
    results, written = [], []
    for path, png in zip(files, outputs):
        try:
            with Image.open(path) as im:
                image = np.asarray(im.convert("RGB"))
        except (OSError, Image.DecompressionBombError) as e:
            raise PredictError(
                f"--images: '{path}': not a readable image ({e}); remove it from --images"
            ) from None
        h, w = image.shape[:2]
        boxes, scores, classes = detect(image)
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
        Image.fromarray(drawn).save(png + ".tmp", format="PNG")
        os.replace(png + ".tmp", png)  # replaces a link itself, never the file it points to
        written.append(png)
        results.append({"image": path, "width": w, "height": h, "output": png, "detections": dets})
    json_path = os.path.join(out_dir, JSON_FILE)
    tmp = json_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
        f.write("\n")
    os.replace(tmp, json_path)
    return {
        "results": results,
        "json": json_path,
        "images": written,
        "note": below_export_threshold(model_dir, min_score),
    }


def _saved_model_detector(model_dir: str):
    """image -> (boxes normalized to it, scores, classes) of an exported SavedModel."""
    import tensorflow as tf

    serve = tf.saved_model.load(model_dir).signatures["serving_default"]

    def detect(image):
        out = serve(tf.constant(image[None]))
        n = int(out["num_detections"][0])
        boxes = out["detection_boxes"][0, :n].numpy()  # normalized to this image (export sets it)
        return (
            boxes,
            out["detection_scores"][0, :n].numpy(),
            out["detection_classes"][0, :n].numpy().astype(int),
        )

    return detect


def _tflite_detector(model: str):
    """The same for a .tflite, through LiteRT's interpreter, fed as its export says."""
    from od_dist.model import export, tflite

    try:
        detector = tflite.Detector(model)
    except export.ExportError as e:
        raise PredictError(str(e)) from None
    keep_aspect = detector.info.get("keep_aspect_ratio", True)

    def detect(image):
        inputs, info = tflite.preprocess(image, detector.input_size, keep_aspect)
        boxes, scores, classes = detector.detect(inputs)
        return tflite.to_original(boxes, info), scores, classes

    return detect
