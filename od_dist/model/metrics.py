"""The COCO figures of an evaluation: what each of the twelve means, and AP per class.

Model Garden's ``per_category_metrics`` reads a ``category_stats`` attribute that only a patched
pycocotools has: with the stock one it returns nothing, silently. Per-class AP is computed here
instead from what stock pycocotools does hold after ``accumulate()``: ``eval['precision']``,
[IoU thresholds, recall points, classes, area ranges, max detections], -1 where a class has no
ground truth. A class's AP is the mean of its entries at area "all" and the largest max-detections
over every IoU threshold (COCO's AP over all classes is the mean of these), AP50 the same at IoU 0.5.
Every class of the label map is listed: one with no box in the evaluated images as -1, as COCO marks
a figure without ground truth.
"""

from __future__ import annotations

from od_dist import patches

# pycocotools' summarize() lines, in its order (the order of Model Garden's metric names).
MEANINGS = {
    "AP": "average precision, IoU 0.50:0.95 (the COCO score), all sizes, up to 100 detections",
    "AP50": "average precision at IoU 0.50 (the Pascal VOC score)",
    "AP75": "average precision at IoU 0.75 (tight boxes)",
    "APs": "AP of small objects (area under 32x32 pixels)",
    "APm": "AP of medium objects (32x32 to 96x96 pixels)",
    "APl": "AP of large objects (over 96x96 pixels)",
    "ARmax1": "average recall, IoU 0.50:0.95, the best detection per image",
    "ARmax10": "average recall with up to 10 detections per image",
    "ARmax100": "average recall with up to 100 detections per image",
    "ARs": "AR of small objects (up to 100 detections)",
    "ARm": "AR of medium objects",
    "ARl": "AR of large objects",
}


def class_names(params) -> dict[int, str]:
    """The label map beside the pipeline's training records, {id: name}; {} without one."""
    from od_dist.data import records
    from od_dist.data.errors import DatasetError
    from od_dist.model.export import find_label_map

    path = find_label_map(params)
    try:
        return records.read_labels(path) if path else {}
    except DatasetError:
        return {}  # classes then go by their ids


# eval_metrics.json's keys of one class: "AP/<class name>", "AP50/<class name>".
PER_CLASS = ("AP", "AP50")

# A class without ground truth in the evaluated images: COCO's own mark for it (pycocotools
# prints -1 for a figure without ground truth, and eval_metrics.json holds numbers only: orbit
# writes each value as a TensorBoard scalar, and the controller keeps scalars only).
NO_GROUND_TRUTH = -1.0


def per_class(coco_eval, names: dict[int, str], num_classes: int | None = None) -> dict[str, float]:
    """{"AP/<name>": ..., "AP50/<name>": ...} of every class: the label map's (``names``, id ->
    name), else ids 1 .. ``num_classes`` - 1, and any other the evaluation holds (named by its
    number). A class with no box in the evaluated images gets NO_GROUND_TRUTH for both: Model
    Garden's evaluator knows only the classes of the boxes it was given, and a class left out
    would look like one never trained."""
    import numpy as np

    precision = coco_eval.eval["precision"][:, :, :, 0, -1]  # area "all", the most detections
    evaluated = {int(class_id): k for k, class_id in enumerate(coco_eval.params.catIds)}
    every_id = list(names) or list(range(1, num_classes or 0))
    found = {}
    for class_id in [*every_id, *sorted(set(evaluated) - set(every_id))]:
        name = names.get(class_id, str(class_id))
        k = evaluated.get(class_id)
        every_iou = precision[:, :, k] if k is not None else np.full(precision.shape[:2], -1.0)
        if not (every_iou > -1).any():
            found[f"AP/{name}"] = found[f"AP50/{name}"] = NO_GROUND_TRUTH
            continue
        found[f"AP/{name}"] = float(np.mean(every_iou[every_iou > -1]))
        at_50 = every_iou[0][every_iou[0] > -1]
        found[f"AP50/{name}"] = float(np.mean(at_50)) if at_50.size else 0.0
    return found


def name_classes(task, names: dict[int, str]) -> None:
    """Per-class AP in every evaluation of ``task`` (a Model Garden detection task): its COCO
    evaluator, once built, returns ``per_class`` of each evaluation beside the twelve figures."""
    build_metrics = task.build_metrics

    def build(training=True):
        built = build_metrics(training=training)
        evaluator = getattr(task, "coco_metric", None)
        if evaluator is not None:
            classes = task.task_config.model.num_classes
            patches.model_garden.per_class_from(
                evaluator, lambda coco_eval: per_class(coco_eval, names, classes)
            )
        return built

    task.build_metrics = build


def summary_lines(metrics: dict) -> list[str]:
    """The twelve COCO figures of ``metrics``, one line each with what it means."""
    return [f"  {k:<9} {metrics[k]:6.3f}  {MEANINGS[k]}" for k in MEANINGS if k in metrics]


def class_lines(metrics: dict, names: dict[int, str]) -> list[str]:
    """AP and AP50 per class, the label map's order; a class without ground truth says so."""
    lines = []
    shown = set()
    for name in [*names.values(), *sorted(k.split("/", 1)[1] for k in metrics if k.startswith("AP/"))]:
        if name in shown:
            continue
        shown.add(name)
        if metrics.get(f"AP/{name}", NO_GROUND_TRUTH) >= 0:
            lines.append(f"  {name:<16} AP {metrics[f'AP/{name}']:.3f} | AP50 {metrics[f'AP50/{name}']:.3f}")
        else:
            lines.append(f"  {name:<16} no boxes of this class in the validation records")
    return lines
