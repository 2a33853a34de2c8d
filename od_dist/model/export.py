"""`od-dist export`: a trained checkpoint -> a SavedModel for serving, by Model Garden's
``export_saved_model_lib.export_inference_graph``.

The SavedModel's ``serving_default`` takes ``inputs``: uint8 images [1, H, W, 3] of any size
(resized inside, as in training) and returns ``detection_boxes`` [1, 100, 4] as [ymin, xmin, ymax,
xmax] normalized to the ORIGINAL image (``task.export_config.output_normalized_coordinates``, set
here), ``detection_scores``, ``detection_classes`` (ids from 1) and ``num_detections``. The label map
is copied next to it (``label_map.pbtxt``) so `od-dist predict` can name the classes. Written under a
temporary name and renamed when complete.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil

from od_dist.data import records
from od_dist.data.records import LABEL_MAP_FILE

# What an export writes into --out (a SavedModel, Model Garden's params.yaml beside it, the label
# map): replaced by the next export.
WRITTEN = re.compile(
    r"saved_model\.pb|fingerprint\.pb|keras_metadata\.pb|variables|assets|assets\.extra|params\.yaml"
    r"|label_map\.pbtxt"
)
# What `predict` needs to know of the export, in the SavedModel's folder for files the graph does not
# use (`assets.extra`, as TensorFlow Serving's warm-up requests are): {"min_score": the score under
# which the model itself drops detections}.
EXPORT_INFO = os.path.join("assets.extra", "od_dist.json")


class ExportError(RuntimeError):
    """One line for the user."""


def find_label_map(params) -> str | None:
    """label_map.pbtxt beside the training records (where the converters and `data shapes` put it)."""
    for pattern in str(params.task.train_data.input_path or "").split(","):
        files = sorted(glob.glob(pattern.strip())) if pattern.strip() else []
        for d in {os.path.dirname(f) for f in files} or {os.path.dirname(pattern.strip())}:
            path = os.path.join(d, LABEL_MAP_FILE)
            if os.path.isfile(path):
                return path
    return None


def export(
    params,
    model_dir: str,
    out_dir: str,
    checkpoint: str | None = None,
    labels: str | None = None,
    min_score: float | None = None,
) -> dict:
    """Exports the latest checkpoint of ``model_dir`` (or ``checkpoint``) to ``out_dir``. The model
    drops detections scored under ``min_score`` (default: the pipeline's
    ``detection_generator.pre_nms_score_threshold``), as its NMS would any later threshold.
    Returns {'checkpoint', 'out', 'label_map' (or None), 'input_size', 'min_score'}."""
    import tensorflow as tf

    if checkpoint:
        ckpt = checkpoint
        if not (tf.io.gfile.exists(ckpt + ".index") or os.path.isdir(ckpt)):
            raise ExportError(
                f"--checkpoint: '{ckpt}': no such checkpoint; pass a path like "
                f"{model_dir}/ckpt-1000 (without .index)"
            )
        if os.path.isdir(ckpt):
            ckpt = tf.train.latest_checkpoint(ckpt)
    else:
        ckpt = tf.train.latest_checkpoint(model_dir) if os.path.isdir(model_dir) else None
    if not ckpt:
        raise ExportError(
            f"--model_dir: '{model_dir}': no checkpoint to export; train first "
            "(od-dist train ... --model_dir) or pass --checkpoint"
        )
    try:  # reads the index only: an empty or foreign file fails here, before the model is built
        tf.train.load_checkpoint(ckpt)
    except (tf.errors.OpError, ValueError) as e:
        raise ExportError(
            f"checkpoint '{ckpt}': cannot be read ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
            "pass another --checkpoint, or train again into a fresh --model_dir"
        ) from None
    label_map = labels or find_label_map(params)
    if labels and not os.path.isfile(labels):
        raise ExportError(
            f"--labels: '{labels}': no such file; pass the label_map.pbtxt of the training data"
        )
    from official.vision.serving import export_saved_model_lib

    tf.get_logger().setLevel("ERROR")  # a page of "Skipping full serialization of layer" warnings
    params.task.export_config.output_normalized_coordinates = True
    generator = params.task.model.detection_generator
    if min_score is not None:
        generator.pre_nms_score_threshold = min_score
    size = list(params.task.model.input_size[:2])
    out_dir = os.path.normpath(out_dir)
    if os.path.exists(out_dir) and not (
        os.path.isdir(out_dir)
        and (not os.listdir(out_dir) or os.path.isfile(os.path.join(out_dir, "saved_model.pb")))
    ):
        raise ExportError(
            f"--out: '{out_dir}': exists and is not an earlier export; choose another --out "
            "(an earlier export there would be replaced)"
        )
    try:
        records.check_replaceable(out_dir)  # a mount point inside: before the export's work
    except records.DatasetError as e:
        raise ExportError(str(e)) from None
    staging = records.staging_dir(out_dir)
    try:
        try:
            export_saved_model_lib.export_inference_graph(
                input_type="image_tensor",
                batch_size=1,
                input_image_size=size,
                params=params,
                checkpoint_path=ckpt,
                export_dir=staging,
            )
        except tf.errors.OpError as e:  # e.g. a checkpoint of another model, or a damaged one
            raise ExportError(
                f"checkpoint '{ckpt}': cannot be restored into this pipeline's model "
                f"({e.message.splitlines()[0] if e.message else type(e).__name__}); pass the pipeline "
                "it was trained with"
            ) from None
        if label_map:
            shutil.copyfile(label_map, os.path.join(staging, LABEL_MAP_FILE))
        os.makedirs(os.path.join(staging, os.path.dirname(EXPORT_INFO)), exist_ok=True)
        with open(os.path.join(staging, EXPORT_INFO), "w", encoding="utf-8") as f:
            json.dump({"min_score": generator.pre_nms_score_threshold}, f)
        # An earlier export's files are replaced; anything else the user keeps there stays.
        try:
            records.move_into_place(staging, out_dir, WRITTEN.fullmatch)
        except records.DatasetError as e:  # the folder changed during the export
            raise ExportError(str(e)) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {
        "checkpoint": ckpt,
        "out": out_dir,
        "label_map": label_map,
        "input_size": size,
        "min_score": generator.pre_nms_score_threshold,
    }


def exported_min_score(model_dir: str) -> float | None:
    """The score under which an exported model drops detections itself (None: an export that
    does not say, made before od-dist wrote it)."""
    try:
        with open(os.path.join(model_dir, EXPORT_INFO), encoding="utf-8") as f:
            value = json.load(f).get("min_score")
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) else None
