"""Faster R-CNN with a ResNet (``faster_rcnn_resnet50_keras``) -> Model Garden's
``fasterrcnn_resnetfpn_coco``."""

from __future__ import annotations

import re

from od_dist.model.odapi import walk

MODEL = "faster_rcnn"
NAME = "Faster R-CNN with a ResNet"
EXTRACTORS = "faster_rcnn_resnet50/101/152_keras"
WHY: dict = {}
PATH = "model.faster_rcnn"

_RESNET = re.compile(r"^faster_rcnn_resnet(50|101|152)(_v1)?(_fpn)?(_keras)?$")


def claims(kind: str) -> bool:
    return bool(_RESNET.match(kind))


def build(cfg: walk.Config, body, kind: str, notes: list[str]) -> walk.Parts:
    fe = cfg.nested_block(body, PATH, "feature_extractor")
    cfg.carry_field(fe, f"{PATH}.feature_extractor", "type")
    notes.append(
        f"{PATH}.feature_extractor ({kind}): Model Garden's Faster R-CNN "
        "always has an FPN (levels 2-6) where the Object Detection API's has one feature map"
    )
    size, _ = walk.image_size(cfg, body, PATH, 2**6, notes, stretches=False)
    model: dict = {
        "input_size": size,
        "backbone": {"type": "resnet", "resnet": {"model_id": int(_RESNET.match(kind).group(1))}},
        "min_level": 2,
        "max_level": 6,
    }
    post = cfg.nested_block(body, PATH, "second_stage_post_processing")
    nms = post.message("batch_non_max_suppression") if post else None
    model["detection_generator"] = walk.nms(
        cfg, nms, f"{PATH}.second_stage_post_processing.batch_non_max_suppression"
    )
    if post is not None:
        cfg.carry_field(post, f"{PATH}.second_stage_post_processing", "score_converter")  # softmax in both
    l2 = walk.l2_weight(body)
    losses = {"l2_weight_decay": l2} if l2 is not None else {}
    switches = {"random_horizontal_flip": "aug_rand_hflip", "random_vertical_flip": "aug_rand_vflip"}
    return walk.Parts("fasterrcnn_resnetfpn_coco", model, losses, switches=switches)
