"""CenterNet box detection -> Model Garden's CenterNet project (``official.projects.centernet``,
experiment ``centernet_hourglass_coco``): its heatmap, offset and size heads, losses and COCO
evaluation.

- ``hourglass_104`` is the project's Hourglass-104 (two stacked Hourglass-52 modules, its default);
  ``hourglass_10/20/32/52`` one module of that depth.
- ``resnet_v1_50/101_fpn`` and ``resnet_v2_50/101`` (the Object Detection API upsamples a ResNet's
  last features to stride 4) become Model Garden's dilated ResNet of the same depth at output stride 8:
  the project's CenterNet takes a backbone without a decoder, and the dilated ResNet is the Model
  Garden ResNet that keeps its features that fine.

Keypoint configs import their box detection (the keypoint heads are not carried: the project detects
boxes); DeepMAC and the other mask heads are refused.
"""

from __future__ import annotations

import re

from od_dist.model.odapi import walk

MODEL = "center_net"
NAME = "CenterNet with an Hourglass or a ResNet (boxes; keypoint heads not carried)"
EXTRACTORS = "hourglass_10/20/32/52/104, resnet_v2_50/101, resnet_v1_50/101_fpn"
PATH = "model.center_net"
FPATH = f"{PATH}.feature_extractor"
EXPERIMENT = "centernet_hourglass_coco"
_KEYPOINTS_WHY = (
    "the keypoint heads are not carried: Model Garden's CenterNet detects boxes; the box detection "
    "is imported"
)
WHY = {
    "keypoint_estimation_task": _KEYPOINTS_WHY,
    "keypoint_label_map_path": _KEYPOINTS_WHY,
    "random_absolute_pad_image": "Model Garden pads every image to input_size itself",
    "random_square_crop_by_scale": walk.CROP_WHY,
    "task_loss_weight": "Model Garden's CenterNet trains one task (boxes); its weight is 1",
}
# The heads the project does not have: refused, with why.
_REFUSED = {
    "deepmac_mask_estimation": "DeepMAC predicts instance masks",
    "mask_estimation_task": "the mask head predicts instance masks",
    "densepose_estimation_task": "DensePose predicts surface coordinates",
    "track_estimation_task": "the tracking head predicts object identities",
}

_HOURGLASS = re.compile(r"^hourglass_(10|20|32|52|104)$")
_RESNET = re.compile(r"^resnet_v(1|2)_(50|101)(_fpn)?$")
# Hourglass depth -> its stages (Model Garden's HOURGLASS_SPECS): the input is a multiple of
# 4 (the stem) * 2^(stages - 1).
_HOURGLASS_STAGES = {10: 2, 20: 3, 32: 4, 52: 6}


def claims(kind: str) -> bool:
    return bool(_HOURGLASS.match(kind) or _RESNET.match(kind))


def build(cfg: walk.Config, body, kind: str, notes: list[str]) -> walk.Parts:
    for name, why in _REFUSED.items():
        if body.get(name) is not None:
            raise walk.ImportProblem(
                f"{PATH}.{name}: {why}; Model Garden's CenterNet detects boxes only and od-dist maps no "
                "mask model from a CenterNet config: remove the block to train its box detection"
            )
    fe = cfg.nested_block(body, PATH, "feature_extractor")
    cfg.carry_field(fe, FPATH, "type")
    inputs: dict = {}  # how images are normalised: the same for training and validation
    m = _HOURGLASS.match(kind)
    if m:
        depth = int(m.group(1))
        model_id, stacks = (52, 2) if depth == 104 else (depth, 1)
        backbone = {"type": "hourglass", "hourglass": {"model_id": model_id, "num_hourglasses": stacks}}
        levels = [f"2_{i}" for i in range(stacks - 1)] + ["2"]
        step = 4 * 2 ** (_HOURGLASS_STAGES[model_id] - 1)
    else:
        m = _RESNET.match(kind)
        backbone = {
            "type": "dilated_resnet",
            "dilated_resnet": {"model_id": int(m.group(2)), "output_stride": 8},
        }
        levels, step = ["3"], 8
        notes.append(
            f"{FPATH}.type ({kind}): written as Model Garden's dilated ResNet-{m.group(2)} (V1 blocks) at "
            "output stride 8, the project's CenterNet taking no decoder: the Object Detection API "
            f"{'upsamples its FPN' if m.group(3) else 'upsamples its ResNet V2'} to stride 4, so the "
            "heatmaps here are half as fine"
        )
        # Model Garden's ResNet is trained on images scaled to [-1, 1], in RGB.
        inputs.update(bgr_ordering=False, channel_means=[127.5] * 3, channel_stds=[127.5] * 3)
    if fe is not None and fe.get("bgr_ordering") is not None:
        inputs["bgr_ordering"] = bool(cfg.carry_field(fe, FPATH, "bgr_ordering"))
    for name in ("channel_means", "channel_stds"):
        if fe is not None and fe.all(name):
            cfg.carry_field(fe, FPATH, name)
            inputs[name] = [float(v) for v in fe.all(name)]
    size, _ = walk.image_size(cfg, body, PATH, step, notes, stretches=False)
    model: dict = {"input_size": size, "backbone": backbone, "head": {"input_levels": levels}}

    losses: dict = {"detection": {}}
    task = cfg.nested_block(body, PATH, "object_detection_task")
    tpath = f"{PATH}.object_detection_task"
    if task is not None:
        cfg.carry_field(task, tpath, "task_loss_weight") if task.get("task_loss_weight") == 1 else None
        if task.get("offset_loss_weight") is not None:
            losses["detection"]["offset_weight"] = float(cfg.carry_field(task, tpath, "offset_loss_weight"))
        if task.get("scale_loss_weight") is not None:
            losses["detection"]["scale_weight"] = float(cfg.carry_field(task, tpath, "scale_loss_weight"))
        loc = cfg.nested_block(task, tpath, "localization_loss")
        if loc is not None and loc.message("l1_localization_loss") is not None:
            cfg.used.add(f"{tpath}.localization_loss")  # L1, as the project's
    center = cfg.nested_block(body, PATH, "object_center_params")
    cpath = f"{PATH}.object_center_params"
    if center is not None:
        if center.get("object_center_loss_weight") is not None:
            weight = float(cfg.carry_field(center, cpath, "object_center_loss_weight"))
            losses["detection"]["object_center_weight"] = weight
        if center.get("min_box_overlap_iou") is not None:
            losses["gaussian_iou"] = float(cfg.carry_field(center, cpath, "min_box_overlap_iou"))
        if center.get("max_box_predictions") is not None:
            model["detection_generator"] = {
                "max_detections": int(cfg.carry_field(center, cpath, "max_box_predictions"))
            }
        cls = center.message("classification_loss")
        focal = cls.message("penalty_reduced_logistic_focal_loss") if cls else None
        # The project's focal loss has the paper's alpha 2 and beta 4, fixed.
        if (
            focal is not None
            and float(focal.get("alpha", 2.0)) == 2.0
            and float(focal.get("beta", 4.0)) == 4.0
        ):
            cfg.used.add(f"{cpath}.classification_loss")
    if body.get("keypoint_estimation_task") is not None:
        # The keypoint heads' settings elsewhere go with them: one line says it.
        cfg.used.update(
            {
                f"{PATH}.keypoint_estimation_task",
                f"{PATH}.keypoint_label_map_path",
                "train_input_reader.num_keypoints",
                "eval_input_reader.num_keypoints",
                "eval_config.keypoint_edge",
            }
        )
        metric = cfg.root.message("eval_config")
        metric = metric.message("parameterized_metric") if metric else None
        if metric is not None and metric.message("coco_keypoint_metrics") is not None:
            cfg.used.add("eval_config.parameterized_metric")
        notes.append(f"{PATH}.keypoint_estimation_task: {_KEYPOINTS_WHY}")

    train = cfg.root.message("train_config")
    clip = cfg.carry_field(train, "train_config", "gradient_clipping_by_norm", 0.0)
    switches = {
        "random_horizontal_flip": "aug_rand_hflip",
        "random_adjust_hue": "aug_rand_hue",
        "random_adjust_contrast": "aug_rand_contrast",
        "random_adjust_saturation": "aug_rand_saturation",
        "random_adjust_brightness": "aug_rand_brightness",
    }
    return walk.Parts(
        EXPERIMENT,
        model,
        losses,
        inputs=inputs,
        # The Object Detection API's CenterNet configs have no L2 regularizer and clip only when asked.
        task={"weight_decay": 0.0, "gradient_clip_norm": float(clip or 0.0)},
        background=0,  # the project numbers classes from 1 (class_offset) without a background class
        switches=switches,
        max_boxes="model",
    )
