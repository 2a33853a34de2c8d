"""`od-dist pipeline import`: an Object Detection API ``pipeline.config`` -> an od-dist pipeline YAML.

The closest registered Model Garden experiment per model family:

- SSD with a MobileNet feature extractor (``ssd_mobilenet_v2_fpn_keras``, the FPNLite models, and
  the FPN-less ones): ``retinanet_mobile_coco`` with Model Garden's MobileNet backbone and an FPN
  (separable when the config asks for depthwise convolutions). An SSD's box-predictor tower over
  FPN levels is what RetinaNet is.
- SSD with a ResNet FPN (``ssd_resnet50_v1_fpn_keras``: RetinaNet itself): ``retinanet_resnetfpn_coco``.
- Faster R-CNN with a ResNet (``faster_rcnn_resnet50_keras``): ``fasterrcnn_resnetfpn_coco``.

What carries over: num_classes (+1: Model Garden counts the background as class 0), the image size
(rounded up to a multiple of 2^max_level, which Model Garden pads to), batch size, steps, the
learning-rate schedule and warmup, the optimizer, the augmentations with a Model Garden counterpart,
L2 weight decay, the FPN/head depths, anchors and NMS settings, the input paths and label map.
Everything else is returned as one line each, with why.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

from od_dist.data import textproto

FAMILIES = (
    "SSD with a MobileNet feature extractor, SSD/RetinaNet with a ResNet FPN, Faster R-CNN with a ResNet"
)
_SSD_MOBILENET = re.compile(r"^ssd_mobilenet_v(1|2|3_large|3_small)(_fpn)?(_keras)?$")
_SSD_RESNET = re.compile(r"^ssd_resnet(50|101|152)_v1_fpn(_keras)?$")
_FRCNN_RESNET = re.compile(r"^faster_rcnn_resnet(50|101|152)(_v1)?(_fpn)?(_keras)?$")
_MOBILENET_IDS = {
    "1": "MobileNetV1",
    "2": "MobileNetV2",
    "3_large": "MobileNetV3Large",
    "3_small": "MobileNetV3Small",
}
_FAMILY_NAMES = {"center_net": "CenterNet", "experimental_model": "an experimental model"}
PLACEHOLDER = "PATH_TO_BE_CONFIGURED"

_CHECKPOINT_WHY = (
    "Object Detection API checkpoints (the TF2 Detection Zoo's included) use its own variable "
    "names and cannot initialise a Model Garden model; task.init_checkpoint is null (from scratch), "
    "or set a Model Garden checkpoint with task.init_checkpoint_modules: backbone"
)
_CROP_WHY = (
    "Model Garden's detection parser has no IoU-constrained random crop; its scale jitter "
    "(task.train_data.parser.aug_scale_min/max) is the nearest"
)
_COLOUR_WHY = (
    "Model Garden's detection parser has no colour jitter (task.train_data.parser.aug_type: "
    "randaugment is its nearest)"
)
# Why a field (by its name, wherever it is) does not carry over; the default says "no counterpart".
_WHY = {
    "fine_tune_checkpoint": _CHECKPOINT_WHY,
    "use_bfloat16": "precision is runtime.mixed_precision_dtype in Model Garden (float32 written; "
    "mixed_float16 on recent GPUs, bfloat16 on TPUs)",
    "sync_replicas": "TF1 distributed-training setting; in od-dist the cluster file decides the strategy",
    "replicas_to_aggregate": "TF1 distributed-training setting; in od-dist the cluster file decides the strategy",
    "startup_delay_steps": "TF1 distributed-training setting; od-dist's tasks wait for their peers",
    "unpad_groundtruth_tensors": "an input detail; Model Garden pads boxes to max_num_instances",
    "box_coder": "Model Garden encodes boxes its own way (no setting)",
    "similarity_calculator": "Model Garden matches anchors by IoU, always",
    "conv_hyperparams": "per-layer initialisers and batch norm; Model Garden has one "
    "task.model.norm_activation for the model (only the L2 weight carries, as losses.l2_weight_decay)",
    "localization_loss": "Model Garden's box loss (Huber, losses.box_loss_weight) is normalised "
    "differently; its defaults are kept",
    "classification_weight": "Model Garden's loss weights are normalised differently; its defaults are kept",
    "localization_weight": "Model Garden's loss weights are normalised differently; its defaults are kept",
    "hard_example_miner": "Model Garden's RetinaNet uses the focal loss, no hard-example mining",
    "random_crop_image": _CROP_WHY,
    "ssd_random_crop": _CROP_WHY,
    "ssd_random_crop_pad": _CROP_WHY,
    "ssd_random_crop_fixed_aspect_ratio": _CROP_WHY,
    "random_pad_image": "Model Garden pads every image to input_size itself",
    "random_adjust_brightness": _COLOUR_WHY,
    "random_adjust_contrast": _COLOUR_WHY,
    "random_adjust_hue": _COLOUR_WHY,
    "random_adjust_saturation": _COLOUR_WHY,
    "random_distort_color": _COLOUR_WHY,
    "random_rgb_to_gray": _COLOUR_WHY,
    "metrics_set": "od-dist's evaluation reports COCO detection metrics",
    "use_moving_averages": "no moving average is trained (see train_config.optimizer.use_moving_average)",
    "num_examples": "the whole validation split is evaluated (trainer.validation_steps: -1)",
    "shuffle": "Model Garden shuffles training data and not validation data",
    "num_epochs": "Model Garden's input repeats training data and reads validation data once",
    "num_readers": "tf.data tunes its readers (od-dist --data_threads)",
    "ssd_anchor_generator": "Model Garden's RetinaNet anchors are per FPN level (task.model.anchor); "
    "its defaults are kept",
    "convolutional_box_predictor": "Model Garden's RetinaNet head is shared across FPN levels "
    "(task.model.head); its defaults are kept",
    "first_stage_anchor_generator": "Model Garden's Faster R-CNN has FPN anchors "
    "(task.model.anchor, levels min_level..max_level)",
}


class ImportProblem(ValueError):
    """The config cannot be imported; the message is one line for the user (exit 2)."""


@dataclass
class Imported:
    experiment: str
    doc: dict  # the pipeline YAML's content
    notes: list[str] = field(default_factory=list)  # what did not carry over, one line each
    label_map: str | None = None
    train_input: str = ""
    val_input: str = ""
    warnings: list[str] = field(default_factory=list)  # the config disagreeing with its label map


class _Config:
    """The parsed config and the dotted paths of the fields that were carried over."""

    def __init__(self, root: textproto.Message):
        self.root = root
        self.used: set[str] = set()
        self.last: tuple[str, object] = ("", None)  # the field read last: named when its value is unusable

    def take(self, msg: textproto.Message | None, path: str, name: str, default=None):
        if msg is None or name not in msg.fields:
            return default
        dotted = f"{path}.{name}" if path else name
        self.used.add(dotted)
        self.last = (dotted, msg.get(name))
        return msg.get(name)

    def sub(self, msg: textproto.Message | None, path: str, name: str) -> textproto.Message | None:
        value = msg.message(name) if msg is not None else None
        if value is not None and not value.fields:
            self.used.add(f"{path}.{name}" if path else name)  # an empty block: nothing to report
        return value

    def leftovers(self, msg: textproto.Message, path: str, experiment: str) -> list[str]:
        lines = []
        for name, values in msg.fields.items():
            dotted = f"{path}.{name}" if path else name
            if dotted in self.used:
                continue
            inside = [v for v in values if isinstance(v, textproto.Message)]
            if len(inside) == len(values) and (
                any(u.startswith(dotted + ".") for u in self.used)
                or (name not in _WHY and any(n in _WHY for v in inside for n in v.fields))
            ):
                for v in inside:
                    lines += self.leftovers(v, dotted, experiment)
                continue
            value = values[-1]
            shown = "{...}" if isinstance(value, textproto.Message) else repr(value)
            why = _WHY.get(name) or f"no counterpart in Model Garden's {experiment}; its default is kept"
            lines.append(f"{dotted} ({_short(shown)}): {why}")
        return lines


def _short(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


def _num(value, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ImportProblem(f"{path}: '{value}': expected a number; fix the config")
    return value


def _family(root: textproto.Message) -> tuple[str, textproto.Message]:
    model = root.message("model")
    if model is None:
        raise ImportProblem("model: missing; this is not an Object Detection API pipeline.config")
    name, body = model.only()
    if name in ("ssd", "faster_rcnn") and isinstance(body, textproto.Message):
        return name, body
    shown = _FAMILY_NAMES.get(name, name or "(empty)")
    raise ImportProblem(
        f"model.{name or ''}: {shown} has no Model Garden counterpart od-dist can train; supported "
        f"families: {FAMILIES}"
    )


def _feature_extractor(family: str, body: textproto.Message) -> tuple[str, dict, str]:
    """(experiment, backbone config, extractor type)."""
    fe = body.message("feature_extractor")
    kind = str(fe.get("type", "")) if fe else ""
    where = f"model.{family}.feature_extractor.type"
    if family == "ssd":
        m = _SSD_MOBILENET.match(kind)
        if m:
            scale = float(fe.get("depth_multiplier", 1.0))
            backbone = {"type": "mobilenet", "mobilenet": {"model_id": _MOBILENET_IDS[m.group(1)]}}
            if scale != 1.0:
                backbone["mobilenet"]["filter_size_scale"] = scale
            return "retinanet_mobile_coco", backbone, kind
        m = _SSD_RESNET.match(kind)
        if m:
            return (
                "retinanet_resnetfpn_coco",
                {"type": "resnet", "resnet": {"model_id": int(m.group(1))}},
                kind,
            )
        supported = "ssd_mobilenet_v1/v2/v3_large/v3_small[_fpn]_keras, ssd_resnet50/101/152_v1_fpn_keras"
    else:
        m = _FRCNN_RESNET.match(kind)
        if m:
            return (
                "fasterrcnn_resnetfpn_coco",
                {"type": "resnet", "resnet": {"model_id": int(m.group(1))}},
                kind,
            )
        supported = "faster_rcnn_resnet50/101/152_keras"
    raise ImportProblem(
        f"{where}: '{kind}': no Model Garden backbone od-dist maps it to; supported: {supported} "
        f"(families: {FAMILIES})"
    )


def _image_size(cfg: _Config, body, path: str, max_level: int, notes: list[str]) -> tuple[list[int], bool]:
    """([h, w, 3], keep_aspect_ratio)."""
    resizer = cfg.sub(body, path, "image_resizer")
    rpath = f"{path}.image_resizer"
    keep = True
    fixed = resizer.message("fixed_shape_resizer") if resizer else None
    aspect = resizer.message("keep_aspect_ratio_resizer") if resizer else None
    if fixed is not None:
        p = f"{rpath}.fixed_shape_resizer"
        h = int(_num(cfg.take(fixed, p, "height", 300), p + ".height"))
        w = int(_num(cfg.take(fixed, p, "width", 300), p + ".width"))
        keep = False  # the Object Detection API stretches to the fixed shape
    elif aspect is not None:
        p = f"{rpath}.keep_aspect_ratio_resizer"
        side = int(_num(cfg.take(aspect, p, "max_dimension", 1024), p + ".max_dimension"))
        cfg.take(aspect, p, "min_dimension")
        cfg.take(aspect, p, "pad_to_max_dimension")  # Model Garden always pads to input_size
        h = w = side
    else:
        raise ImportProblem(
            f"{rpath}: no fixed_shape_resizer or keep_aspect_ratio_resizer; Model Garden needs a fixed "
            "input size: add one of them"
        )
    step = 2**max_level
    rh, rw = math.ceil(h / step) * step, math.ceil(w / step) * step
    if (rh, rw) != (h, w):
        notes.append(
            f"{rpath} ({h}x{w}): written as {rh}x{rw}: Model Garden pads images to a multiple of "
            f"2^max_level ({step}) and builds the model at that size"
        )
    return [rh, rw, 3], keep


def _l2_weight(body: textproto.Message) -> float | None:
    fe = body.message("feature_extractor")
    hyper = fe.message("conv_hyperparams") if fe else None
    reg = hyper.message("regularizer") if hyper else None
    l2 = reg.message("l2_regularizer") if reg else None
    return float(l2.get("weight")) if l2 and l2.get("weight") is not None else None


def _ssd_model(cfg: _Config, body, notes: list[str]) -> tuple[dict, dict, dict]:
    """(task.model overrides, task.losses overrides, parser overrides) for an SSD."""
    path = "model.ssd"
    model: dict = {}
    fe = cfg.sub(body, path, "feature_extractor")
    fpath = f"{path}.feature_extractor"
    cfg.take(fe, fpath, "type")
    cfg.take(fe, fpath, "depth_multiplier")
    fpn = cfg.sub(fe, fpath, "fpn")
    anchors = cfg.sub(body, path, "anchor_generator")
    multi = anchors.message("multiscale_anchor_generator") if anchors else None
    apath = f"{path}.anchor_generator.multiscale_anchor_generator"
    min_level = cfg.take(fpn, f"{fpath}.fpn", "min_level") or cfg.take(multi, apath, "min_level") or 3
    max_level = cfg.take(fpn, f"{fpath}.fpn", "max_level") or cfg.take(multi, apath, "max_level") or 7
    if multi is not None:  # both name the levels; they agree in every Zoo config
        cfg.take(multi, apath, "min_level")
        cfg.take(multi, apath, "max_level")
    model["min_level"], model["max_level"] = int(min_level), int(max_level)
    separable = bool(cfg.take(fe, fpath, "use_depthwise", False))
    decoder = {"type": "fpn", "fpn": {"use_separable_conv": separable}}
    depth = cfg.take(fpn, f"{fpath}.fpn", "additional_layer_depth")
    if depth:
        decoder["fpn"]["num_filters"] = int(depth)
    if fpn is None:
        notes.append(
            f"{fpath}.type ({fe.get('type')}): an SSD without FPN has no Model Garden counterpart; "
            "written with an FPN decoder over levels 3-7 (RetinaNet)"
        )
    model["decoder"] = decoder
    if multi is not None:
        anchor = {}
        if multi.get("anchor_scale") is not None:
            anchor["anchor_size"] = float(cfg.take(multi, apath, "anchor_scale"))
        if multi.get("scales_per_octave") is not None:
            anchor["num_scales"] = int(cfg.take(multi, apath, "scales_per_octave"))
        if multi.all("aspect_ratios"):
            cfg.take(multi, apath, "aspect_ratios")
            anchor["aspect_ratios"] = [float(a) for a in multi.all("aspect_ratios")]
        model["anchor"] = anchor
    predictor = cfg.sub(body, path, "box_predictor")
    shared = predictor.message("weight_shared_convolutional_box_predictor") if predictor else None
    if shared is not None:
        ppath = f"{path}.box_predictor.weight_shared_convolutional_box_predictor"
        head = {}
        if shared.get("depth") is not None:
            head["num_filters"] = int(cfg.take(shared, ppath, "depth"))
        if shared.get("num_layers_before_predictor") is not None:
            head["num_convs"] = int(cfg.take(shared, ppath, "num_layers_before_predictor"))
        head["use_separable_conv"] = bool(cfg.take(shared, ppath, "use_depthwise", False))
        model["head"] = head
    post = cfg.sub(body, path, "post_processing")
    nms = post.message("batch_non_max_suppression") if post else None
    model["detection_generator"] = _nms(cfg, nms, f"{path}.post_processing.batch_non_max_suppression")
    if post is not None:
        cfg.take(post, f"{path}.post_processing", "score_converter")  # sigmoid, as Model Garden's RetinaNet
    losses: dict = {}
    loss = cfg.sub(body, path, "loss")
    cls = loss.message("classification_loss") if loss else None
    focal = cls.message("weighted_sigmoid_focal") if cls else None
    if focal is not None:
        lpath = f"{path}.loss.classification_loss.weighted_sigmoid_focal"
        if focal.get("gamma") is not None:
            losses["focal_loss_gamma"] = float(cfg.take(focal, lpath, "gamma"))
        if focal.get("alpha") is not None:
            losses["focal_loss_alpha"] = float(cfg.take(focal, lpath, "alpha"))
    parser: dict = {}
    matcher = cfg.sub(body, path, "matcher")
    argmax = matcher.message("argmax_matcher") if matcher else None
    if argmax is not None:
        mpath = f"{path}.matcher.argmax_matcher"
        if argmax.get("matched_threshold") is not None:
            parser["match_threshold"] = float(cfg.take(argmax, mpath, "matched_threshold"))
        if argmax.get("unmatched_threshold") is not None:
            parser["unmatched_threshold"] = float(cfg.take(argmax, mpath, "unmatched_threshold"))
    return model, losses, parser


def _nms(cfg: _Config, nms, path: str) -> dict:
    out: dict = {}
    if nms is None:
        return out
    if nms.get("iou_threshold") is not None:
        out["nms_iou_threshold"] = float(cfg.take(nms, path, "iou_threshold"))
    if nms.get("score_threshold") is not None:
        out["pre_nms_score_threshold"] = float(cfg.take(nms, path, "score_threshold"))
    if nms.get("max_total_detections") is not None:
        out["max_num_detections"] = int(cfg.take(nms, path, "max_total_detections"))
    return out


def _frcnn_model(cfg: _Config, body, notes: list[str]) -> dict:
    path = "model.faster_rcnn"
    fe = cfg.sub(body, path, "feature_extractor")
    cfg.take(fe, f"{path}.feature_extractor", "type")
    notes.append(
        f"{path}.feature_extractor ({fe.get('type') if fe else ''}): Model Garden's Faster R-CNN "
        "always has an FPN (levels 2-6) where the Object Detection API's has one feature map"
    )
    model: dict = {"min_level": 2, "max_level": 6}
    post = cfg.sub(body, path, "second_stage_post_processing")
    nms = post.message("batch_non_max_suppression") if post else None
    model["detection_generator"] = _nms(
        cfg, nms, f"{path}.second_stage_post_processing.batch_non_max_suppression"
    )
    if post is not None:
        cfg.take(post, f"{path}.second_stage_post_processing", "score_converter")  # softmax in both
    return model


def _schedule(cfg: _Config, optimizer_msg, opath: str, notes: list[str]) -> dict:
    """learning_rate + warmup of trainer.optimizer_config."""
    lr = cfg.sub(optimizer_msg, opath, "learning_rate")
    lpath = f"{opath}.learning_rate"
    name, sched = lr.only() if lr is not None else (None, None)
    p = f"{lpath}.{name}"
    out: dict = {}
    if name == "cosine_decay_learning_rate":
        base = float(_num(cfg.take(sched, p, "learning_rate_base", 0.002), p + ".learning_rate_base"))
        total = int(cfg.take(sched, p, "total_steps", 4000000))
        warm = int(cfg.take(sched, p, "warmup_steps", 0))
        warm_lr = float(cfg.take(sched, p, "warmup_learning_rate", 0.0))
        hold = int(sched.get("hold_base_rate_steps", 0) or 0)
        if hold:
            notes.append(
                f"{p}.hold_base_rate_steps ({hold}): Model Garden's cosine has no hold; the decay "
                "starts right after the warmup"
            )
            cfg.used.add(f"{p}.hold_base_rate_steps")
        # The Object Detection API's cosine starts after the warmup and ends at total_steps.
        out["learning_rate"] = {
            "type": "cosine",
            "cosine": {"initial_learning_rate": base, "decay_steps": max(total - warm, 1), "offset": warm},
        }
        if warm:
            out["warmup"] = {
                "type": "linear",
                "linear": {"warmup_steps": warm, "warmup_learning_rate": warm_lr},
            }
    elif name == "manual_step_learning_rate":
        values = [float(cfg.take(sched, p, "initial_learning_rate", 0.002))]
        boundaries = []
        for step in sched.all("schedule"):
            boundaries.append(int(step.get("step", 0)))
            values.append(float(step.get("learning_rate", 0.002)))
        cfg.take(sched, p, "schedule")
        out["learning_rate"] = {"type": "stepwise", "stepwise": {"boundaries": boundaries, "values": values}}
        if sched.get("warmup"):
            notes.append(
                f"{p}.warmup (true): written without warmup: Model Garden's warmup is a separate linear "
                "ramp (trainer.optimizer_config.warmup)"
            )
            cfg.used.add(f"{p}.warmup")
    elif name == "exponential_decay_learning_rate":
        out["learning_rate"] = {
            "type": "exponential",
            "exponential": {
                "initial_learning_rate": float(cfg.take(sched, p, "initial_learning_rate", 0.002)),
                "decay_steps": int(cfg.take(sched, p, "decay_steps", 4000000)),
                "decay_rate": float(cfg.take(sched, p, "decay_factor", 0.95)),
                "staircase": bool(cfg.take(sched, p, "staircase", True)),
            },
        }
        burnin = int(cfg.take(sched, p, "burnin_steps", 0) or 0)
        if burnin:
            burnin_lr = float(cfg.take(sched, p, "burnin_learning_rate", 0.0) or 0.0)
            out["warmup"] = {
                "type": "linear",
                "linear": {"warmup_steps": burnin, "warmup_learning_rate": burnin_lr},
            }
            notes.append(
                f"{p}.burnin_steps ({burnin}): written as a linear warmup from burnin_learning_rate "
                "(the Object Detection API holds it constant)"
            )
    elif name == "constant_learning_rate":
        out["learning_rate"] = {
            "type": "constant",
            "constant": {"learning_rate": float(cfg.take(sched, p, "learning_rate", 0.002))},
        }
    elif name is not None:
        raise ImportProblem(
            f"{lpath}.{name}: no Model Garden schedule od-dist maps it to; use cosine_decay_learning_rate, "
            "manual_step_learning_rate, exponential_decay_learning_rate or constant_learning_rate"
        )
    return out


def _optimizer(cfg: _Config, train, notes: list[str]) -> dict:
    opt = cfg.sub(train, "train_config", "optimizer")
    if opt is None:
        return {}
    path = "train_config.optimizer"
    name, body = None, None
    for candidate in ("momentum_optimizer", "adam_optimizer", "rms_prop_optimizer"):
        if opt.message(candidate) is not None:
            name, body = candidate, opt.message(candidate)
    if name is None:
        other = next((n for n, v in opt.fields.items() if isinstance(v[-1], textproto.Message)), "")
        raise ImportProblem(
            f"{path}.{other}: no Model Garden optimizer od-dist maps it to; use momentum_optimizer, "
            "adam_optimizer or rms_prop_optimizer"
        )
    p = f"{path}.{name}"
    if name == "momentum_optimizer":
        optimizer = {
            "type": "sgd",
            "sgd": {"momentum": float(cfg.take(body, p, "momentum_optimizer_value", 0.9))},
        }
    elif name == "adam_optimizer":
        optimizer = {"type": "adam", "adam": {"epsilon": float(cfg.take(body, p, "epsilon", 1e-8))}}
    else:
        optimizer = {
            "type": "rmsprop",
            "rmsprop": {
                "rho": float(cfg.take(body, p, "decay", 0.9)),
                "momentum": float(cfg.take(body, p, "momentum_optimizer_value", 0.9)),
                "epsilon": float(cfg.take(body, p, "epsilon", 1.0)),
            },
        }
    out = {"optimizer": optimizer, **_schedule(cfg, body, p, notes)}
    if opt.get("use_moving_average") is False:
        cfg.take(opt, path, "use_moving_average")
    elif opt.get("use_moving_average"):
        decay = float(cfg.take(opt, path, "moving_average_decay", 0.9999))
        cfg.take(opt, path, "use_moving_average")
        out["ema"] = {"average_decay": decay}
    return out


def _augmentations(cfg: _Config, train, family: str, parser: dict) -> None:
    parser.setdefault("aug_rand_hflip", False)
    parser.setdefault("aug_scale_min", 1.0)
    parser.setdefault("aug_scale_max", 1.0)
    for option in train.all("data_augmentation_options") if train else []:
        name, body = option.only()
        p = f"train_config.data_augmentation_options.{name}"
        if name == "random_horizontal_flip":
            parser["aug_rand_hflip"] = True
            cfg.used.add(p)
        elif name == "random_vertical_flip" and family == "faster_rcnn":
            parser["aug_rand_vflip"] = True
            cfg.used.add(p)
        elif name in ("random_scale_crop_and_pad_to_square", "random_image_scale"):
            lo, hi = (
                ("scale_min", "scale_max")
                if name.startswith("random_scale")
                else ("min_scale_ratio", "max_scale_ratio")
            )
            parser["aug_scale_min"] = float(body.get(lo, 0.1 if lo == "scale_min" else 0.5))
            parser["aug_scale_max"] = float(body.get(hi, 2.0))
            cfg.used.add(p)


def _inputs(cfg: _Config, name: str) -> tuple[str, str | None]:
    reader = cfg.root.message(name)
    records = reader.message("tf_record_input_reader") if reader else None
    paths = [str(p) for p in records.all("input_path")] if records else []
    if records is not None:
        cfg.take(records, f"{name}.tf_record_input_reader", "input_path")
    label_map = cfg.take(reader, name, "label_map_path")
    return ",".join(paths), (str(label_map) if label_map else None)


def convert(text: str, data_dir: str | None = None) -> Imported:
    """The pipeline.config's text -> Imported. Raises textproto.TextFormatError, ImportProblem."""
    cfg = _Config(textproto.parse(text))
    try:
        return _convert(cfg, data_dir)
    except ImportProblem:
        raise
    except (TypeError, ValueError, AttributeError):  # a value of the wrong kind, e.g. num_steps: 'many'
        where, value = cfg.last
        raise ImportProblem(f"{where}: '{value}': not a value this field takes; fix the config") from None


def _convert(cfg: _Config, data_dir: str | None) -> Imported:
    root = cfg.root
    family, body = _family(root)
    experiment, backbone, kind = _feature_extractor(family, body)
    notes: list[str] = []
    path = f"model.{family}"
    num_classes = cfg.take(body, path, "num_classes")
    if not isinstance(num_classes, int) or num_classes < 1:
        raise ImportProblem(
            f"{path}.num_classes: '{num_classes}': must be a whole number >= 1; fix the config"
        )
    losses: dict = {}
    parser: dict = {}
    if family == "ssd":
        model, losses, parser = _ssd_model(cfg, body, notes)
    else:
        model = _frcnn_model(cfg, body, notes)
    input_size, keep_aspect = _image_size(cfg, body, path, model["max_level"], notes)
    model = {"num_classes": num_classes + 1, "input_size": input_size, "backbone": backbone, **model}
    model["norm_activation"] = {"use_sync_bn": False}
    l2 = _l2_weight(body)
    if l2 is not None:
        losses["l2_weight_decay"] = l2  # both add weight * sum(w^2) / 2
    if family == "ssd" and not keep_aspect:
        parser["keep_aspect_ratio"] = False

    train = root.message("train_config")
    batch = int(_num(cfg.take(train, "train_config", "batch_size", 32), "train_config.batch_size"))
    steps = int(cfg.take(train, "train_config", "num_steps", 0) or 0)
    optimizer = _optimizer(cfg, train, notes)
    if steps <= 0:  # 0: "train forever" in the Object Detection API; the schedule's end instead
        cosine = optimizer.get("learning_rate", {}).get("cosine")
        steps = cosine["decay_steps"] + cosine["offset"] if cosine else 100000
        notes.append(
            f"train_config.num_steps (0 or missing): training forever is not a Model Garden setting; "
            f"trainer.train_steps is {steps}"
        )
    max_boxes = cfg.take(train, "train_config", "max_number_of_boxes")
    if max_boxes:
        parser["max_num_instances"] = int(max_boxes)
    _augmentations(cfg, train, family, parser)
    if train is not None and train.get("fine_tune_checkpoint"):
        cfg.take(train, "train_config", "fine_tune_checkpoint_type")
        cfg.take(train, "train_config", "fine_tune_checkpoint_version")
        cfg.take(train, "train_config", "from_detection_checkpoint")  # TF1's fine_tune_checkpoint_type

    train_input, train_labels = _inputs(cfg, "train_input_reader")
    val_input, val_labels = _inputs(cfg, "eval_input_reader")
    label_map = train_labels or val_labels
    if data_dir:
        train_input = os.path.join(data_dir, "train-*.tfrecord")
        val_input = os.path.join(data_dir, "val-*.tfrecord")
        label_map = os.path.join(data_dir, "label_map.pbtxt")
    for what, value in (("train_input_reader", train_input), ("eval_input_reader", val_input)):
        if not value or PLACEHOLDER in value:
            notes.append(
                f"{what}.tf_record_input_reader.input_path ('{value}'): not set in the config; "
                f"set task.{'train_data' if what.startswith('train') else 'validation_data'}.input_path"
            )
    eval_config = root.message("eval_config")
    eval_batch = int(cfg.take(eval_config, "eval_config", "batch_size", 0) or 0) or min(batch, 8)

    steps_per_loop = min(100, steps)
    checkpoint = max(steps_per_loop, min(1000, steps) // steps_per_loop * steps_per_loop)
    trainer = {
        "train_steps": steps,
        "steps_per_loop": steps_per_loop,
        "summary_interval": steps_per_loop,
        "checkpoint_interval": checkpoint,
        "max_to_keep": 7,  # model_main_tf2's default
        "validation_steps": -1,
        "validation_interval": checkpoint,
        "optimizer_config": optimizer,
    }
    doc = {
        "experiment": experiment,
        "runtime": {"mixed_precision_dtype": "float32"},
        "task": {
            "init_checkpoint": None,
            "annotation_file": None,
            "model": model,
            **({"losses": losses} if losses else {}),
            "train_data": {
                "input_path": train_input or PLACEHOLDER,
                "global_batch_size": batch,
                "dtype": "float32",
                "parser": parser,
            },
            "validation_data": {
                "input_path": val_input or PLACEHOLDER,
                "global_batch_size": eval_batch,
                "dtype": "float32",
                "drop_remainder": False,
            },
        },
        "trainer": trainer,
    }
    notes += cfg.leftovers(root, "", experiment)
    imported = Imported(experiment, doc, notes, label_map, train_input, val_input)
    imported.warnings = _label_map_warnings(label_map, num_classes, path)
    return imported


def _label_map_warnings(label_map: str | None, num_classes: int, path: str) -> list[str]:
    """The label map and num_classes disagreeing: the Object Detection API does not check it."""
    from od_dist.data import records

    if not label_map or not os.path.isfile(label_map):
        return []
    try:
        names = records.read_labels(label_map)
    except records.DatasetError as e:
        return [str(e)]
    if max(names) != num_classes:
        return [
            f"{path}.num_classes is {num_classes} but the label map '{label_map}' numbers its classes up "
            f"to {max(names)}; task.model.num_classes is written as {num_classes + 1} from the config: "
            f"set it to {max(names) + 1} if the label map is right"
        ]
    return []


def render(imported: Imported, config_path: str) -> str:
    import yaml

    head = [
        f"# od-dist pipeline imported from the Object Detection API config '{config_path}'",
        "# by `od-dist pipeline import`: closest Model Garden experiment, overrides below.",
        f"# Label map: {imported.label_map or 'none named in the config'}",
        "# Not carried over (printed by the import as well):",
        *(f"#   {n}" for n in imported.notes),
        *(f"# Warning: {w}" for w in imported.warnings),
        "# runtime.distribution_strategy is left out on purpose: the cluster file decides it.",
    ]
    body = yaml.safe_dump(imported.doc, sort_keys=False, default_flow_style=False)
    return "\n".join(head) + "\n" + body


def write(text: str, out: str, force: bool, check) -> None:
    """Writes ``text`` to ``out`` through a temporary file in the same folder: ``check(tmp_path)``
    (the project's pipeline loader) must accept it first; an existing ``out`` is replaced only with
    ``force``. Nothing is left behind on failure."""
    if os.path.exists(out) and not force:
        raise ImportProblem(f"--out: '{out}': exists; choose another --out or pass --force to replace it")
    from od_dist.data import records

    tmp = records.text_beside(out, text, ".yaml")  # the loader that checks it reads .yaml files
    try:
        check(tmp)
        if force:
            os.replace(tmp, out)
        else:
            try:
                os.link(tmp, out)  # fails if out appeared meanwhile: never overwrite without --force
            except FileExistsError:
                raise ImportProblem(
                    f"--out: '{out}': exists; choose another --out or pass --force to replace it"
                ) from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def input_paths(text: str) -> tuple[str, str, str | None]:
    """(train input paths, eval input paths, label map) named by a pipeline.config, comma-joined;
    placeholders left as they are. Raises textproto.TextFormatError."""
    cfg = _Config(textproto.parse(text))
    train, train_labels = _inputs(cfg, "train_input_reader")
    val, val_labels = _inputs(cfg, "eval_input_reader")
    return train, val, train_labels or val_labels
