"""SSD -> Model Garden's RetinaNet: an SSD's box-predictor tower over FPN levels is what RetinaNet is.

- A MobileNet feature extractor (``ssd_mobilenet_v2_fpn_keras``, the FPNLite models, and the
  FPN-less ones): ``retinanet_mobile_coco`` with Model Garden's MobileNet backbone and an FPN
  (separable when the config asks for depthwise convolutions).
- A ResNet FPN (``ssd_resnet50_v1_fpn_keras``: RetinaNet itself): ``retinanet_resnetfpn_coco``.

``retinanet`` is the part EfficientDet (an SSD as well) shares.
"""

from __future__ import annotations

import re

from od_dist.model.odapi import walk

MODEL = "ssd"
NAME = "SSD with a MobileNet feature extractor or a ResNet FPN"
EXTRACTORS = "ssd_mobilenet_v1/v2/v3_large/v3_small[_fpn]_keras, ssd_resnet50/101/152_v1_fpn_keras"
WHY: dict = {}
PATH = "model.ssd"
FPATH = f"{PATH}.feature_extractor"

_MOBILENET = re.compile(r"^ssd_mobilenet_v(1|2|3_large|3_small)(_fpn)?(_keras)?$")
_RESNET = re.compile(r"^ssd_resnet(50|101|152)_v1_fpn(_keras)?$")
_MOBILENET_IDS = {
    "1": "MobileNetV1",
    "2": "MobileNetV2",
    "3_large": "MobileNetV3Large",
    "3_small": "MobileNetV3Small",
}


def claims(kind: str) -> bool:
    return bool(_MOBILENET.match(kind) or _RESNET.match(kind))


def build(cfg: walk.Config, body, kind: str, notes: list[str]) -> walk.Parts:
    fe = cfg.nested_block(body, PATH, "feature_extractor")
    cfg.carry_field(fe, FPATH, "type")
    m = _MOBILENET.match(kind)
    if m:
        experiment = "retinanet_mobile_coco"
        backbone = {"type": "mobilenet", "mobilenet": {"model_id": _MOBILENET_IDS[m.group(1)]}}
        scale = float(cfg.carry_field(fe, FPATH, "depth_multiplier", 1.0))
        if scale != 1.0:
            backbone["mobilenet"]["filter_size_scale"] = scale
    else:
        experiment = "retinanet_resnetfpn_coco"
        backbone = {"type": "resnet", "resnet": {"model_id": int(_RESNET.match(kind).group(1))}}
        cfg.carry_field(fe, FPATH, "depth_multiplier")
    fpn = cfg.nested_block(fe, FPATH, "fpn")
    separable = bool(cfg.carry_field(fe, FPATH, "use_depthwise", False))
    decoder = {"type": "fpn", "fpn": {"use_separable_conv": separable}}
    depth = cfg.carry_field(fpn, f"{FPATH}.fpn", "additional_layer_depth")
    if depth:
        decoder["fpn"]["num_filters"] = int(depth)
    if fpn is None:
        notes.append(
            f"{FPATH}.type ({kind}): an SSD without FPN has no Model Garden counterpart; "
            "written with an FPN decoder over levels 3-7 (RetinaNet)"
        )
    return retinanet(cfg, body, experiment, backbone, decoder, (fpn, f"{FPATH}.fpn"), notes)


def retinanet(
    cfg: walk.Config, body, experiment: str, backbone: dict, decoder: dict, levels, notes
) -> walk.Parts:
    """An SSD config's levels, anchors, head, NMS, focal loss, matcher, image size and L2 weight on
    Model Garden's RetinaNet. ``levels``: (the decoder's block naming min/max_level, its path)."""
    model: dict = {}
    anchors = cfg.nested_block(body, PATH, "anchor_generator")
    multi = anchors.message("multiscale_anchor_generator") if anchors else None
    apath = f"{PATH}.anchor_generator.multiscale_anchor_generator"
    block, bpath = levels
    min_level = cfg.carry_field(block, bpath, "min_level") or cfg.carry_field(multi, apath, "min_level") or 3
    max_level = cfg.carry_field(block, bpath, "max_level") or cfg.carry_field(multi, apath, "max_level") or 7
    if multi is not None:  # both name the levels; they agree in every Zoo config
        cfg.carry_field(multi, apath, "min_level")
        cfg.carry_field(multi, apath, "max_level")
    size, keep_aspect = walk.image_size(cfg, body, PATH, 2 ** int(max_level), notes)
    model["input_size"], model["backbone"] = size, backbone
    model["min_level"], model["max_level"] = int(min_level), int(max_level)
    model["decoder"] = decoder
    if multi is not None:
        anchor = {}
        if multi.get("anchor_scale") is not None:
            anchor["anchor_size"] = float(cfg.carry_field(multi, apath, "anchor_scale"))
        if multi.get("scales_per_octave") is not None:
            anchor["num_scales"] = int(cfg.carry_field(multi, apath, "scales_per_octave"))
        if multi.all("aspect_ratios"):
            cfg.carry_field(multi, apath, "aspect_ratios")
            anchor["aspect_ratios"] = [float(a) for a in multi.all("aspect_ratios")]
        model["anchor"] = anchor
    predictor = cfg.nested_block(body, PATH, "box_predictor")
    shared = predictor.message("weight_shared_convolutional_box_predictor") if predictor else None
    if shared is not None:
        ppath = f"{PATH}.box_predictor.weight_shared_convolutional_box_predictor"
        head = {}
        if shared.get("depth") is not None:
            head["num_filters"] = int(cfg.carry_field(shared, ppath, "depth"))
        if shared.get("num_layers_before_predictor") is not None:
            head["num_convs"] = int(cfg.carry_field(shared, ppath, "num_layers_before_predictor"))
        head["use_separable_conv"] = bool(cfg.carry_field(shared, ppath, "use_depthwise", False))
        model["head"] = head
    post = cfg.nested_block(body, PATH, "post_processing")
    nms = post.message("batch_non_max_suppression") if post else None
    model["detection_generator"] = walk.nms(cfg, nms, f"{PATH}.post_processing.batch_non_max_suppression")
    if post is not None:
        cfg.carry_field(
            post, f"{PATH}.post_processing", "score_converter"
        )  # sigmoid, as Model Garden's RetinaNet
    # Sigmoid scores without a background class, as Model Garden's RetinaNet (EfficientDet says so).
    if body.get("add_background_class") is False:
        cfg.carry_field(body, PATH, "add_background_class")
    losses: dict = {}
    loss = cfg.nested_block(body, PATH, "loss")
    cls = loss.message("classification_loss") if loss else None
    focal = cls.message("weighted_sigmoid_focal") if cls else None
    lpath = f"{PATH}.loss.classification_loss.weighted_sigmoid_focal"
    _floats(cfg, focal, lpath, {"gamma": "focal_loss_gamma", "alpha": "focal_loss_alpha"}, losses)
    l2 = walk.l2_weight(body)
    if l2 is not None:
        losses["l2_weight_decay"] = l2  # both add weight * sum(w^2) / 2
    parser: dict = {}
    matcher = cfg.nested_block(body, PATH, "matcher")
    argmax = matcher.message("argmax_matcher") if matcher else None
    mpath = f"{PATH}.matcher.argmax_matcher"
    names = {"matched_threshold": "match_threshold", "unmatched_threshold": "unmatched_threshold"}
    _floats(cfg, argmax, mpath, names, parser)
    # The Object Detection API stretches to a fixed shape: validation must see the images training
    # sees (the export reads the training parser's setting).
    inputs = {} if keep_aspect else {"keep_aspect_ratio": False}
    return walk.Parts(experiment, model, losses, parser, inputs=inputs, ssd_crop=True)


def _floats(cfg: walk.Config, msg, path: str, names: dict, out: dict) -> None:
    """out[key] = the float of each field of ``msg`` named in ``names`` (field -> key) that is set."""
    for name, key in names.items():
        if msg is not None and msg.get(name) is not None:
            out[key] = float(cfg.carry_field(msg, path, name))
