"""The walk over an Object Detection API pipeline.config shared by every family: the fields read
(so that every field not read is reported, with why), the image size, the optimizer and its
learning-rate schedule, the augmentations and the input readers."""

from __future__ import annotations

from dataclasses import dataclass, field

from od_dist.data import textproto
from od_dist.model.pipeline import stride_sizes

PLACEHOLDER = "PATH_TO_BE_CONFIGURED"

CHECKPOINT_WHY = (
    "Object Detection API checkpoints (the TF2 Detection Zoo's included) use its own variable "
    "names and cannot initialise a Model Garden model; training starts from scratch "
    "(task.init_checkpoint is null), or from a Model Garden backbone checkpoint, e.g. for a "
    "ResNet-50 backbone: task: {init_checkpoint: "
    "'gs://cloud-tpu-checkpoints/vision-2.0/resnet50_imagenet/ckpt-28080', "
    "init_checkpoint_modules: backbone}"
)
CROP_WHY = (
    "no counterpart in Model Garden's parser for this model (of the random crops, its RetinaNet "
    "takes the SSD family's ssd_random_crop*); its scale jitter "
    "(task.train_data.parser.aug_scale_min/max) is the nearest"
)
# The Object Detection API's ssd_random_crop without operations (preprocessor_builder's defaults).
SSD_CROP_DEFAULT = {
    "min_object_covered": (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0),
    "overlap_thresh": (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0),
    "random_coef": 0.15,
    "aspect_ratio": (0.5, 2.0),
    "area": (0.1, 1.0),
}
SSD_CROPS = ("ssd_random_crop", "ssd_random_crop_pad", "ssd_random_crop_fixed_aspect_ratio")
COLOUR_WHY = (
    "Model Garden's detection parser has no colour jitter (task.train_data.parser.aug_type: "
    "randaugment is its nearest)"
)
# Why a field (by its name, wherever it is) does not carry over; the default says "no counterpart".
WHY = {
    "fine_tune_checkpoint": CHECKPOINT_WHY,
    "use_bfloat16": "precision is runtime.mixed_precision_dtype in Model Garden (float32 written; "
    "mixed_float16 on recent GPUs, bfloat16 on TPUs)",
    "sync_replicas": "TF1 distributed-training setting; in od-dist the cluster file decides the strategy",
    "replicas_to_aggregate": "TF1 distributed-training setting; in od-dist the cluster file decides the strategy",
    "startup_delay_steps": "TF1 distributed-training setting; od-dist's tasks wait for their peers",
    "unpad_groundtruth_tensors": "an input detail; Model Garden pads boxes to max_num_instances",
    "box_coder": "Model Garden encodes boxes its own way (no setting)",
    "similarity_calculator": "Model Garden matches anchors by IoU, always",
    "conv_hyperparams": "per-layer initialisers and batch norm; Model Garden has one "
    "task.model.norm_activation for the model (only the L2 weight carries, as losses.l2_weight_decay, "
    "and EfficientDet's swish, as norm_activation.activation)",
    "localization_loss": "Model Garden's box loss (Huber, losses.box_loss_weight) is normalised "
    "differently; its defaults are kept",
    "classification_weight": "Model Garden's loss weights are normalised differently; its defaults are kept",
    "localization_weight": "Model Garden's loss weights are normalised differently; its defaults are kept",
    "hard_example_miner": "Model Garden's RetinaNet uses the focal loss, no hard-example mining",
    "random_crop_image": CROP_WHY,
    **{name: CROP_WHY for name in SSD_CROPS},  # the families whose parser has none
    "random_pad_image": "Model Garden pads every image to input_size itself",
    "random_adjust_brightness": COLOUR_WHY,
    "random_adjust_contrast": COLOUR_WHY,
    "random_adjust_hue": COLOUR_WHY,
    "random_adjust_saturation": COLOUR_WHY,
    "random_distort_color": COLOUR_WHY,
    "random_rgb_to_gray": COLOUR_WHY,
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
    "external_input_reader": "an input reader outside the Object Detection API's own (its extension is "
    "named below); write the records as TFRecord files and set the pipeline's input_path",
    "first_stage_anchor_generator": "Model Garden's Faster R-CNN has FPN anchors "
    "(task.model.anchor, levels min_level..max_level)",
}


class ImportProblem(ValueError):
    """The config cannot be imported; the message is one line for the user (exit 2)."""


@dataclass
class Parts:
    """What a family's mapping gives the shared walk."""

    experiment: str  # the registered Model Garden experiment
    model: dict  # task.model overrides (backbone, input_size, decoder, head, ...)
    losses: dict = field(default_factory=dict)  # task.losses overrides
    parser: dict = field(default_factory=dict)  # task.train_data.parser overrides
    inputs: dict = field(default_factory=dict)  # the parser overrides of both train and validation data
    task: dict = field(default_factory=dict)  # other task overrides
    background: int = 1  # Model Garden's detectors count the background as class 0
    # Object Detection API augmentations that switch a parser flag on: name -> flag.
    switches: dict = field(default_factory=lambda: {"random_horizontal_flip": "aug_rand_hflip"})
    max_boxes: str = "parser"  # where max_number_of_boxes goes: the parser or the model
    ssd_crop: bool = False  # the parser takes Model Garden's aug_type ssd_random_crop (RetinaNet's)


class Config:
    """The parsed config and the dotted paths of the fields that were carried over."""

    def __init__(self, root: textproto.Message):
        self.root = root
        self.why = dict(WHY)  # the shared reasons; the family adds its own
        self.used: set[str] = set()
        self.last: tuple[str, object] = ("", None)  # the field read last: named when its value is unusable

    def carry_field(self, msg: textproto.Message | None, path: str, name: str, default=None):
        """The field `name` of `msg` (`default` without it), marked as carried over."""
        if msg is None or name not in msg.fields:
            return default
        dotted = f"{path}.{name}" if path else name
        self.used.add(dotted)
        self.last = (dotted, msg.get(name))
        return msg.get(name)

    def nested_block(self, msg: textproto.Message | None, path: str, name: str) -> textproto.Message | None:
        """The block `name` of `msg` (None without it); an empty one counts as carried over."""
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
                or (name not in self.why and any(n in self.why for v in inside for n in v.fields))
            ):
                for v in inside:
                    lines += self.leftovers(v, dotted, experiment)
                continue
            value = values[-1]
            shown = "{...}" if isinstance(value, textproto.Message) else repr(value)
            why = self.why.get(name) or f"no counterpart in Model Garden's {experiment}; its default is kept"
            lines.append(f"{dotted} ({short(shown)}): {why}")
        return lines


def extensions(msg: textproto.Message, path: str = "") -> list[str]:
    """One line per extension field the text-format reader left out, wherever it is."""
    lines = [
        f"{path + '.' if path else ''}[{name}] (line {line}): an extension field outside the Object "
        "Detection API's own protos (e.g. an in-house input reader); left out"
        for name, line in msg.extensions
    ]
    for name, values in msg.fields.items():
        for value in values:
            if isinstance(value, textproto.Message):
                lines += extensions(value, f"{path}.{name}" if path else name)
    return lines


def short(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


def num(value, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ImportProblem(f"{path}: '{value}': expected a number; fix the config")
    return value


def image_size(
    cfg: Config, body, path: str, step: int, notes: list[str], stretches: bool = True
) -> tuple[list[int], bool]:
    """([h, w, 3], keep_aspect_ratio); h and w rounded up to a multiple of ``step`` (the model's
    largest stride, which Model Garden pads to). ``stretches``: whether the family's parsers and
    export can stretch to a fixed shape (else a fixed_shape_resizer is said to become a letterbox)."""
    resizer = cfg.nested_block(body, path, "image_resizer")
    rpath = f"{path}.image_resizer"
    keep = True
    fixed = resizer.message("fixed_shape_resizer") if resizer else None
    aspect = resizer.message("keep_aspect_ratio_resizer") if resizer else None
    if fixed is not None:
        p = f"{rpath}.fixed_shape_resizer"
        h = int(num(cfg.carry_field(fixed, p, "height", 300), p + ".height"))
        w = int(num(cfg.carry_field(fixed, p, "width", 300), p + ".width"))
        keep = False  # the Object Detection API stretches to the fixed shape
        if not stretches:
            notes.append(
                f"{p} ({h}x{w}): this Model Garden model keeps the aspect ratio (and pads) in training, "
                "evaluation and export alike; images are not stretched"
            )
    elif aspect is not None:
        p = f"{rpath}.keep_aspect_ratio_resizer"
        side = int(num(cfg.carry_field(aspect, p, "max_dimension", 1024), p + ".max_dimension"))
        cfg.carry_field(aspect, p, "min_dimension")
        cfg.carry_field(aspect, p, "pad_to_max_dimension")  # Model Garden always pads to input_size
        h = w = side
    else:
        raise ImportProblem(
            f"{rpath}: no fixed_shape_resizer or keep_aspect_ratio_resizer; Model Garden needs a fixed "
            "input size: add one of them"
        )
    rh, rw = stride_sizes(h, step)[1], stride_sizes(w, step)[1]
    if (rh, rw) != (h, w):
        notes.append(
            f"{rpath} ({h}x{w}): written as {rh}x{rw}: Model Garden pads images to a multiple of "
            f"the model's largest stride ({step}) and builds the model at that size"
        )
    return [rh, rw, 3], keep


def l2_weight(body: textproto.Message) -> float | None:
    fe = body.message("feature_extractor")
    hyper = fe.message("conv_hyperparams") if fe else None
    reg = hyper.message("regularizer") if hyper else None
    l2 = reg.message("l2_regularizer") if reg else None
    return float(l2.get("weight")) if l2 and l2.get("weight") is not None else None


def nms(cfg: Config, msg, path: str) -> dict:
    """A batch_non_max_suppression block -> detection_generator overrides."""
    out: dict = {}
    if msg is None:
        return out
    if msg.get("iou_threshold") is not None:
        out["nms_iou_threshold"] = float(cfg.carry_field(msg, path, "iou_threshold"))
    if msg.get("score_threshold") is not None:
        out["pre_nms_score_threshold"] = float(cfg.carry_field(msg, path, "score_threshold"))
    if msg.get("max_total_detections") is not None:
        out["max_num_detections"] = int(cfg.carry_field(msg, path, "max_total_detections"))
    return out


def schedule(cfg: Config, optimizer_msg, opath: str, notes: list[str]) -> dict:
    """learning_rate + warmup of trainer.optimizer_config."""
    lr = cfg.nested_block(optimizer_msg, opath, "learning_rate")
    lpath = f"{opath}.learning_rate"
    name, sched = lr.only() if lr is not None else (None, None)
    p = f"{lpath}.{name}"
    out: dict = {}
    if name == "cosine_decay_learning_rate":
        base = float(num(cfg.carry_field(sched, p, "learning_rate_base", 0.002), p + ".learning_rate_base"))
        total = int(cfg.carry_field(sched, p, "total_steps", 4000000))
        warm = int(cfg.carry_field(sched, p, "warmup_steps", 0))
        warm_lr = float(cfg.carry_field(sched, p, "warmup_learning_rate", 0.0))
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
        values = [float(cfg.carry_field(sched, p, "initial_learning_rate", 0.002))]
        boundaries = []
        for step in sched.all("schedule"):
            boundaries.append(int(step.get("step", 0)))
            values.append(float(step.get("learning_rate", 0.002)))
        cfg.carry_field(sched, p, "schedule")
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
                "initial_learning_rate": float(cfg.carry_field(sched, p, "initial_learning_rate", 0.002)),
                "decay_steps": int(cfg.carry_field(sched, p, "decay_steps", 4000000)),
                "decay_rate": float(cfg.carry_field(sched, p, "decay_factor", 0.95)),
                "staircase": bool(cfg.carry_field(sched, p, "staircase", True)),
            },
        }
        burnin = int(cfg.carry_field(sched, p, "burnin_steps", 0) or 0)
        if burnin:
            burnin_lr = float(cfg.carry_field(sched, p, "burnin_learning_rate", 0.0) or 0.0)
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
            "constant": {"learning_rate": float(cfg.carry_field(sched, p, "learning_rate", 0.002))},
        }
    elif name is not None:
        raise ImportProblem(
            f"{lpath}.{name}: no Model Garden schedule od-dist maps it to; use cosine_decay_learning_rate, "
            "manual_step_learning_rate, exponential_decay_learning_rate or constant_learning_rate"
        )
    return out


def optimizer(cfg: Config, train, notes: list[str]) -> dict:
    opt = cfg.nested_block(train, "train_config", "optimizer")
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
            "sgd": {"momentum": float(cfg.carry_field(body, p, "momentum_optimizer_value", 0.9))},
        }
    elif name == "adam_optimizer":
        optimizer = {"type": "adam", "adam": {"epsilon": float(cfg.carry_field(body, p, "epsilon", 1e-8))}}
    else:
        optimizer = {
            "type": "rmsprop",
            "rmsprop": {
                "rho": float(cfg.carry_field(body, p, "decay", 0.9)),
                "momentum": float(cfg.carry_field(body, p, "momentum_optimizer_value", 0.9)),
                "epsilon": float(cfg.carry_field(body, p, "epsilon", 1.0)),
            },
        }
    out = {"optimizer": optimizer, **schedule(cfg, body, p, notes)}
    if opt.get("use_moving_average") is False:
        cfg.carry_field(opt, path, "use_moving_average")
    elif opt.get("use_moving_average"):
        decay = float(cfg.carry_field(opt, path, "moving_average_decay", 0.9999))
        cfg.carry_field(opt, path, "use_moving_average")
        out["ema"] = {"average_decay": decay}
    return out


def augmentations(cfg: Config, train, parts: Parts, parser: dict, notes: list[str]) -> None:
    switches = parts.switches
    parser.setdefault("aug_rand_hflip", False)
    parser.setdefault("aug_scale_min", 1.0)
    parser.setdefault("aug_scale_max", 1.0)
    for option in train.all("data_augmentation_options") if train else []:
        name, body = option.only()
        p = f"train_config.data_augmentation_options.{name}"
        if name in switches:
            parser[switches[name]] = True
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
        elif name in SSD_CROPS and parts.ssd_crop and "aug_type" not in parser:
            parser["aug_type"] = ssd_crop(name, body, p, notes)
            cfg.used.add(p)


def ssd_crop(name: str, body: textproto.Message, path: str, notes: list[str]) -> dict:
    """An ssd_random_crop* block -> Model Garden's ``aug_type: ssd_random_crop``: one of the
    operations picked at random per image, as in the Object Detection API."""
    ops = body.all("operations") if body is not None else []
    d = SSD_CROP_DEFAULT
    if ops:
        params = [
            {
                "min_object_covered": float(op.get("min_object_covered", 0.0)),
                "min_box_overlap": float(op.get("overlap_thresh", 0.0)),
                "prob_to_apply": 1.0 - float(op.get("random_coef", 0.0)),
            }
            for op in ops
        ]
    else:
        params = [
            {"min_object_covered": c, "min_box_overlap": o, "prob_to_apply": 1.0 - d["random_coef"]}
            for c, o in zip(d["min_object_covered"], d["overlap_thresh"])
        ]

    def widest(lo: str, hi: str, default: tuple) -> list[float]:
        lows = {float(op.get(lo, default[0])) for op in ops} or {default[0]}
        highs = {float(op.get(hi, default[1])) for op in ops} or {default[1]}
        if len(lows) > 1 or len(highs) > 1:
            notes.append(
                f"{path}.operations ({lo}/{hi} differ): Model Garden's ssd_random_crop has one range "
                f"for every operation; written as the widest, {min(lows)}-{max(highs)}"
            )
        return [min(lows), max(highs)]

    if name == "ssd_random_crop_fixed_aspect_ratio":
        ratio = float(body.get("aspect_ratio", 1.0)) if body is not None else 1.0
        aspect = [ratio, ratio]
    else:
        aspect = widest("min_aspect_ratio", "max_aspect_ratio", d["aspect_ratio"])
    if name == "ssd_random_crop_pad":
        notes.append(
            f"{path}: written as Model Garden's ssd_random_crop without the padding (Model Garden pads "
            "every image to input_size itself)"
        )
    crop = {
        "ssd_random_crop_params": params,
        "aspect_ratio_range": aspect,
        "area_range": widest("min_area", "max_area", d["area"]),
    }
    return {"type": "ssd_random_crop", "ssd_random_crop": crop}


def inputs(cfg: Config, name: str) -> tuple[str, str | None]:
    reader = cfg.root.message(name)
    records = reader.message("tf_record_input_reader") if reader else None
    paths = [str(p) for p in records.all("input_path")] if records else []
    if records is not None:
        cfg.carry_field(records, f"{name}.tf_record_input_reader", "input_path")
    label_map = cfg.carry_field(reader, name, "label_map_path")
    return ",".join(paths), (str(label_map) if label_map else None)
