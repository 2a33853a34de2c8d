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

from od_dist import patches
from od_dist.data import errors, writing
from od_dist.data.records import LABEL_MAP_FILE
from od_dist.protocol import checkpoint_feed

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


def checkpoint_and_labels(params, model_dir: str, checkpoint: str | None, labels: str | None):
    """The checkpoint to export (``checkpoint``, else the latest of ``model_dir``), checked readable,
    and the label map to ship (``labels``, else the one beside the training records, or None)."""
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
            f"(od-dist train ... --model_dir) or pass --checkpoint; {checkpoint_feed.ELSEWHERE}"
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
    return ckpt, label_map


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

    patches.check()  # a library upgrade that breaks a patch: one line now, not a broken export
    ckpt, label_map = checkpoint_and_labels(params, model_dir, checkpoint, labels)
    from official.vision.serving import export_saved_model_lib

    tf.get_logger().setLevel("ERROR")  # a page of "Skipping full serialization of layer" warnings
    size = list(params.task.model.input_size[:2])
    module = None
    if _is_centernet(params):
        min_score = CENTERNET_MIN_SCORE if min_score is None else min_score
        module = _centernet_module(params, size, min_score)
    else:
        params.task.export_config.output_normalized_coordinates = True
        generator = params.task.model.detection_generator
        if min_score is not None:
            generator.pre_nms_score_threshold = min_score
        min_score = generator.pre_nms_score_threshold
    out_dir = os.path.normpath(out_dir)
    if os.path.exists(out_dir) and not (
        os.path.isdir(out_dir)
        and (not os.listdir(out_dir) or os.path.isfile(os.path.join(out_dir, "saved_model.pb")))
    ):
        raise ExportError(
            f"--out: '{out_dir}': exists and is not an earlier export; choose another --out "
            "(an earlier export there would be replaced)"
        )
    staging = writing.staging_dir(out_dir)
    try:
        try:
            with _without_keras_traces():
                export_saved_model_lib.export_inference_graph(
                    input_type="image_tensor",
                    batch_size=1,
                    input_image_size=size,
                    params=params,
                    checkpoint_path=ckpt,
                    export_dir=staging,
                    export_module=module,
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
            json.dump({"min_score": min_score}, f)
        # An earlier export's files are replaced; anything else the user keeps there stays.
        try:
            writing.move_into_place(staging, out_dir, WRITTEN.fullmatch)
        except errors.DatasetError as e:  # the folder changed during the export
            raise ExportError(str(e)) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {
        "checkpoint": ckpt,
        "out": out_dir,
        "label_map": label_map,
        "input_size": size,
        "min_score": min_score,
    }


def _without_keras_traces():
    """The export is its serving signature (what `predict`, TF Serving and TFLite's converter
    load). Keras would also trace every layer's call into the SavedModel, to reload it as a Keras
    model, which nothing here does: for the demo model that is half the export's time (23 -> 13 s)
    and most of each load's (predict 9.7 -> 3.6 s), for the same detections."""
    return patches.tf_keras.without_keras_traces()


# The score under which an exported CenterNet drops detections unless --min_score says otherwise:
# that of Model Garden's other detectors (detection_generator.pre_nms_score_threshold).
CENTERNET_MIN_SCORE = 0.05


def _is_centernet(params) -> bool:
    from official.projects.centernet.configs import centernet

    return isinstance(params.task, centernet.CenterNetTask)


def _centernet_module(params, size: list[int], min_score: float, model=None):
    """Model Garden ships no serving module for its CenterNet project: this one resizes and
    normalises images as the project's parser does for evaluation, and returns what every od-dist
    export returns (boxes normalised to the original image, scores, classes from 1, the count of
    detections scored min_score or more)."""
    import tensorflow as tf
    from official.core import task_factory
    from official.vision.ops import box_ops, preprocess_ops
    from official.vision.serving import export_base

    parser = params.task.validation_data.parser

    class CenterNetModule(export_base.ExportModule):
        def _build_model(self):
            return task_factory.get_task(self.params.task).build_model()

        def _one(self, image):
            image, info = preprocess_ops.resize_and_crop_image(
                tf.cast(image, tf.float32), size, padded_size=size, aug_scale_min=1.0, aug_scale_max=1.0
            )
            if parser.bgr_ordering:
                image = image[..., ::-1]
            image = preprocess_ops.normalize_image(
                image, offset=parser.channel_means, scale=parser.channel_stds
            )
            return image, info

        def serve(self, images):
            images, info = tf.map_fn(
                self._one,
                images,
                fn_output_signature=(
                    tf.TensorSpec([*size, 3], tf.float32),
                    tf.TensorSpec([4, 2], tf.float32),
                ),
                parallel_iterations=32,
            )
            out = self.inference_step(images)
            boxes = out["boxes"] / tf.tile(info[:, 2:3, :], [1, 1, 2])  # back to the original pixels
            boxes = tf.clip_by_value(box_ops.normalize_boxes(boxes, info[:, 0:1, :]), 0.0, 1.0)
            scores = out["confidence"]  # sorted, highest first
            return {
                "detection_boxes": boxes,
                "detection_scores": scores,
                "detection_classes": tf.cast(out["classes"], tf.float32),
                "num_detections": tf.reduce_sum(tf.cast(scores >= min_score, tf.int32), axis=1),
            }

    return CenterNetModule(
        params, batch_size=1, input_image_size=size, input_type="image_tensor", model=model
    )
