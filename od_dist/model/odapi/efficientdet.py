"""EfficientDet D0-D7 (``ssd_efficientnet-bN_bifpn_keras``) -> Model Garden's RetinaNet with its
EfficientNet backbone of the same size and an FPN decoder.

Model Garden 2.20 has no BiFPN (not in ``official.vision`` nor in any of its projects), so the
BiFPN becomes an FPN with the BiFPN's width and separable convolutions, and the import says so.
"""

from __future__ import annotations

import re

from od_dist.model.odapi import ssd, walk

MODEL = "ssd"
NAME = "EfficientDet (SSD with an EfficientNet BiFPN)"
EXTRACTORS = "ssd_efficientnet-b0..b7_bifpn_keras"
WHY: dict = {}

_EFFICIENTNET = re.compile(r"^ssd_efficientnet-(b[0-7])_bifpn(_keras)?$")


def claims(kind: str) -> bool:
    return bool(_EFFICIENTNET.match(kind))


def build(cfg: walk.Config, body, kind: str, notes: list[str]) -> walk.Parts:
    fpath = ssd.FPATH
    fe = cfg.nested_block(body, ssd.PATH, "feature_extractor")
    cfg.carry_field(fe, fpath, "type")
    backbone = {"type": "efficientnet", "efficientnet": {"model_id": _EFFICIENTNET.match(kind).group(1)}}
    bifpn = cfg.nested_block(fe, fpath, "bifpn")
    bpath = f"{fpath}.bifpn"
    # EfficientDet's BiFPN convolutions are depthwise separable.
    decoder = {"type": "fpn", "fpn": {"use_separable_conv": True}}
    filters = cfg.carry_field(bifpn, bpath, "num_filters")
    if filters:
        decoder["fpn"]["num_filters"] = int(filters)
    passes = int(cfg.carry_field(bifpn, bpath, "num_iterations", 1) or 1)
    notes.append(
        f"{bpath} (num_iterations: {passes}): written as an FPN (task.model.decoder.fpn, same width, "
        f"separable): Model Garden has no BiFPN; one top-down pass instead of {passes} weighted "
        "top-down and bottom-up ones: cheaper, and a few AP lower on COCO than EfficientDet's "
        "published figures"
    )
    parts = ssd.retinanet(cfg, body, "retinanet_resnetfpn_coco", backbone, decoder, (bifpn, bpath), notes)
    # EfficientDet's BiFPN and box/class towers use swish, as the EfficientNet backbone does.
    hyper = fe.message("conv_hyperparams") if fe else None
    if hyper is not None and str(hyper.get("activation", "")).upper() == "SWISH":
        parts.model["norm_activation"] = {"activation": "swish", "use_sync_bn": False}
    return parts
