"""`od-dist pipeline import`: an Object Detection API ``pipeline.config`` -> an od-dist pipeline YAML.

The closest registered Model Garden experiment per model family, one module each (``FAMILIES``):
the model oneof it reads (``MODEL``), the feature extractors it claims and ``build``, which maps the
model; ``walk`` reads the rest, alike for all: the optimizer and its schedule, batch size, steps,
augmentations, inputs. Adding a family is adding a module and a row.

What carries over: num_classes (+1 where Model Garden counts the background as class 0), the image
size (rounded up to a multiple of the model's largest stride, which Model Garden pads to), batch
size, steps, the learning-rate schedule and warmup, the optimizer, the augmentations with a Model
Garden counterpart, L2 weight decay, the FPN/head depths, anchors and NMS settings, the input paths
and label map. Everything else is returned as one line each, with why.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field

from od_dist.data import textproto
from od_dist.model.odapi import centernet, efficientdet, faster_rcnn, ssd, walk
from od_dist.model.odapi.walk import PLACEHOLDER, ImportProblem

FAMILIES = (ssd, efficientdet, faster_rcnn, centernet)
FAMILY_NAMES = ", ".join(f.NAME for f in FAMILIES)
_OTHER_MODELS = {"experimental_model": "an experimental model"}

__all__ = [
    "FAMILIES",
    "PLACEHOLDER",
    "ImportProblem",
    "Imported",
    "convert",
    "input_paths",
    "render",
    "write",
]


@dataclass
class Imported:
    experiment: str
    doc: dict  # the pipeline YAML's content
    notes: list[str] = field(default_factory=list)  # what did not carry over, one line each
    label_map: str | None = None
    train_input: str = ""
    val_input: str = ""
    warnings: list[str] = field(default_factory=list)  # the config disagreeing with its label map


def _family(root: textproto.Message):
    """(family module, the model's block, the feature extractor's type)."""
    model = root.message("model")
    if model is None:
        raise ImportProblem("model: missing; this is not an Object Detection API pipeline.config")
    name, body = model.only()
    mine = [f for f in FAMILIES if f.MODEL == name]
    if not mine or not isinstance(body, textproto.Message):
        shown = _OTHER_MODELS.get(name, name or "(empty)")
        raise ImportProblem(
            f"model.{name or ''}: {shown} has no Model Garden counterpart od-dist can train; supported "
            f"families: {FAMILY_NAMES}"
        )
    fe = body.message("feature_extractor")
    kind = str(fe.get("type", "")) if fe else ""
    for f in mine:
        if f.claims(kind):
            return f, body, kind
    raise ImportProblem(
        f"model.{name}.feature_extractor.type: '{kind}': no Model Garden backbone od-dist maps it to; "
        f"supported: {', '.join(f.EXTRACTORS for f in mine)} (families: {FAMILY_NAMES})"
    )


def convert(text: str, data_dir: str | None = None) -> Imported:
    """The pipeline.config's text -> Imported. Raises textproto.TextFormatError, ImportProblem."""
    cfg = walk.Config(textproto.parse(text))
    try:
        return _convert(cfg, data_dir)
    except ImportProblem:
        raise
    except (TypeError, ValueError, AttributeError):  # a value of the wrong kind, e.g. num_steps: 'many'
        where, value = cfg.last
        raise ImportProblem(f"{where}: '{value}': not a value this field takes; fix the config") from None


def _convert(cfg: walk.Config, data_dir: str | None) -> Imported:
    root = cfg.root
    family, body, kind = _family(root)
    cfg.why.update(family.WHY)
    notes: list[str] = []
    path = f"model.{family.MODEL}"
    num_classes = cfg.carry_field(body, path, "num_classes")
    if not isinstance(num_classes, int) or num_classes < 1:
        raise ImportProblem(
            f"{path}.num_classes: '{num_classes}': must be a whole number >= 1; fix the config"
        )
    parts = family.build(cfg, body, kind, notes)
    experiment, parser = parts.experiment, {**parts.inputs, **parts.parser}
    model = {"num_classes": num_classes + parts.background, **parts.model}
    model.setdefault("norm_activation", {"use_sync_bn": False})
    losses = parts.losses

    train = root.message("train_config")
    batch = int(walk.num(cfg.carry_field(train, "train_config", "batch_size", 32), "train_config.batch_size"))
    steps = int(cfg.carry_field(train, "train_config", "num_steps", 0) or 0)
    optimizer = walk.optimizer(cfg, train, notes)
    if steps <= 0:  # 0: "train forever" in the Object Detection API; the schedule's end instead
        cosine = optimizer.get("learning_rate", {}).get("cosine")
        steps = cosine["decay_steps"] + cosine["offset"] if cosine else 100000
        notes.append(
            f"train_config.num_steps (0 or missing): training forever is not a Model Garden setting; "
            f"trainer.train_steps is {steps}"
        )
    max_boxes = cfg.carry_field(train, "train_config", "max_number_of_boxes")
    if max_boxes:
        (model if parts.max_boxes == "model" else parser)["max_num_instances"] = int(max_boxes)
    walk.augmentations(cfg, train, parts, parser, notes)
    if train is not None and train.get("fine_tune_checkpoint"):
        cfg.carry_field(train, "train_config", "fine_tune_checkpoint_type")
        cfg.carry_field(train, "train_config", "fine_tune_checkpoint_version")
        cfg.carry_field(train, "train_config", "from_detection_checkpoint")  # TF1's fine_tune_checkpoint_type

    train_input, train_labels = walk.inputs(cfg, "train_input_reader")
    val_input, val_labels = walk.inputs(cfg, "eval_input_reader")
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
    eval_batch = int(cfg.carry_field(eval_config, "eval_config", "batch_size", 0) or 0) or min(batch, 8)

    steps_per_loop = min(100, steps)
    checkpoint = max(steps_per_loop, min(1000, steps) // steps_per_loop * steps_per_loop)
    trainer = {
        "train_steps": steps,
        "steps_per_loop": steps_per_loop,
        "summary_interval": steps_per_loop,
        "checkpoint_interval": checkpoint,
        "max_to_keep": 7,  # model_main_tf2's default
        "validation_steps": -1,
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
            **parts.task,
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
                # A copy: the YAML would write the same object twice as an alias, which pipelines refuse.
                **({"parser": copy.deepcopy(parts.inputs)} if parts.inputs else {}),
            },
        },
        "trainer": trainer,
    }
    notes += cfg.leftovers(root, "", experiment) + walk.extensions(root)
    # The checkpoint first: a Zoo user expects their model to start from it, and it does not.
    notes.sort(key=lambda note: not note.startswith("train_config.fine_tune_checkpoint "))
    imported = Imported(experiment, doc, notes, label_map, train_input, val_input)
    imported.warnings = _label_map_warnings(label_map, num_classes, parts.background, path)
    return imported


def _label_map_warnings(label_map: str | None, num_classes: int, background: int, path: str) -> list[str]:
    """The label map and num_classes disagreeing: the Object Detection API does not check it."""
    from od_dist.data import errors, records

    if not label_map or not os.path.isfile(label_map):
        return []
    try:
        names = records.read_labels(label_map)
    except errors.DatasetError as e:
        return [str(e)]
    if max(names) != num_classes:
        return [
            f"{path}.num_classes is {num_classes} but the label map '{label_map}' numbers its classes up "
            f"to {max(names)}; task.model.num_classes is written as {num_classes + background} from the "
            f"config: set it to {max(names) + background} if the label map is right"
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
    from od_dist.data import writing

    tmp = writing.partial_file_beside(out, text, ".yaml")  # the loader that checks it reads .yaml files
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
    cfg = walk.Config(textproto.parse(text))
    train, train_labels = walk.inputs(cfg, "train_input_reader")
    val, val_labels = walk.inputs(cfg, "eval_input_reader")
    return train, val, train_labels or val_labels
