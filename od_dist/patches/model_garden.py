"""Model Garden's private names (official.*): its all-reduce settings, trainer, optimizers, experiment
registry, COCO evaluator, CenterNet loss and TFLite export."""

from __future__ import annotations

import contextlib

from od_dist.patches.base import MODEL_GARDEN, Patch, held

PATCHES = (
    Patch(
        "coco-per-class",
        MODEL_GARDEN,
        ("official.vision.evaluation.coco_evaluator:COCOEvaluator._retrieve_per_category_metrics",),
        "sets a COCOEvaluator's _per_category_metrics and _retrieve_per_category_metrics (per_class_from)",
        "Model Garden's per-category metrics read an attribute only a patched pycocotools has and give "
        "nothing with the stock one: od-dist's per-class AP (model/metrics.py) goes in their place",
        held=("official.vision.evaluation.coco_evaluator:COCOEvaluator._per_category_metrics",),
    ),
    Patch(
        "trainer-is-async",
        MODEL_GARDEN,
        (),
        "reads Model Garden's Trainer._is_async (is_async)",
        "parameter_server: each loop is spread over every worker only when it runs asynchronously",
        held=("official.core.base_trainer:Trainer._is_async",),
    ),
    Patch(
        "model-garden-all-reduce",
        MODEL_GARDEN,
        (
            "official.common.distribute_utils:_collective_communication",
            "official.common.distribute_utils:_mirrored_cross_device_ops",
        ),
        "calls distribute_utils._collective_communication and _mirrored_cross_device_ops",
        "runtime.all_reduce_alg/num_packs mean what they mean in Model Garden's own strategies",
    ),
    Patch(
        "moving-average-inner",
        MODEL_GARDEN,
        (),
        "reads Model Garden's ExponentialMovingAverage._optimizer (inner_optimizer)",
        "--all_reduce_dtype sets the gradient aggregator of the optimizer that all-reduces",
        held=("official.modeling.optimization:ExponentialMovingAverage._optimizer",),
    ),
    Patch(
        "registered-experiments",
        MODEL_GARDEN,
        ("official.core.exp_factory:_REGISTERED_CONFIGS",),
        "reads exp_factory._REGISTERED_CONFIGS (registered_experiments)",
        "the list of detection experiments `pipeline` commands offer; Model Garden has no public one",
    ),
    Patch(
        "centernet-gather",
        MODEL_GARDEN,
        ("official.projects.centernet.ops.loss_ops:get_batch_predictions_from_indices",),
        "rebinds loss_ops.get_batch_predictions_from_indices (gather_centernet_inside)",
        "CenterNet's loss gathers padding at index -1: zeros on GPUs, InvalidArgumentError on a CPU",
    ),
    Patch(
        "tflite-no-background",
        MODEL_GARDEN,
        (
            "official.vision.modeling.layers.detection_generator:_generate_detections_tflite_implements_signature",
        ),
        "rebinds detection_generator._generate_detections_tflite_implements_signature for an export "
        "(tflite_without_background)",
        "Model Garden gives TFLite's detection op every score column, its background too, which "
        "RetinaNet scores high everywhere; one class fewer makes the op skip it (its label offset), "
        "as Model Garden's own NMS does and as the Object Detection API's TFLite models count classes",
    ),
)


def per_class_from(evaluator, compute) -> None:
    """coco-per-class: a COCOEvaluator's per-category metrics are `compute(coco_eval)` (its box
    evaluation; none for masks and keypoints)."""
    held("coco-per-class", evaluator, "_per_category_metrics")
    evaluator._per_category_metrics = True
    evaluator._retrieve_per_category_metrics = lambda coco_eval, prefix="": (
        {} if prefix else compute(coco_eval)
    )


def collective_communication(all_reduce_alg: str | None):
    """model-garden-all-reduce: Model Garden's CommunicationImplementation for all_reduce_alg."""
    from official.common import distribute_utils

    return distribute_utils._collective_communication(all_reduce_alg)


def mirrored_cross_device_ops(all_reduce_alg: str | None, num_packs: int):
    """model-garden-all-reduce: Model Garden's cross-device ops for all_reduce_alg/num_packs."""
    from official.common import distribute_utils

    return distribute_utils._mirrored_cross_device_ops(all_reduce_alg, num_packs)


def inner_optimizer(optimizer):
    """moving-average-inner: the optimizer Model Garden's moving average wraps, else None."""
    from official.modeling.optimization import ExponentialMovingAverage

    if not isinstance(optimizer, ExponentialMovingAverage):
        return None
    return held("moving-average-inner", optimizer, "_optimizer")


def is_async(trainer) -> bool:
    """trainer-is-async: whether Model Garden's Trainer runs its loops asynchronously."""
    return bool(held("trainer-is-async", trainer, "_is_async"))


def registered_experiments():
    """registered-experiments: the names of every registered Model Garden experiment."""
    from official.core import exp_factory

    return list(exp_factory._REGISTERED_CONFIGS)


def gather_centernet_inside(gather) -> None:
    """centernet-gather: CenterNet's loss gathers its predictions with `gather` (once)."""
    from official.projects.centernet.ops import loss_ops

    if not hasattr(loss_ops, "od_dist_gather"):
        loss_ops.od_dist_gather = loss_ops.get_batch_predictions_from_indices
        loss_ops.get_batch_predictions_from_indices = gather


@contextlib.contextmanager
def tflite_without_background():
    """tflite-no-background: within it, the TFLite detection op a RetinaNet export emits leaves out
    class 0 (RetinaNet's background): its classes come out from 0 for Model Garden's class 1."""
    from official.vision.modeling.layers import detection_generator as generator

    signature = generator._generate_detections_tflite_implements_signature

    def without_background(config):
        return signature({**config, "num_classes": config["num_classes"] - 1})

    generator._generate_detections_tflite_implements_signature = without_background
    try:
        yield
    finally:
        generator._generate_detections_tflite_implements_signature = signature
