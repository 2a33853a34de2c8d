"""Pipeline files: a Model Garden experiment plus overrides, checked before training.

A pipeline file is one YAML document::

    experiment: retinanet_mobile_coco     # a registered Model Garden experiment (the base)
    task: {...}                           # overrides of that ExperimentConfig, applied
    trainer: {...}                        # strictly: an unknown key is an error
    runtime: {...}

This is Model Garden's own layering (``--experiment``, ``--config_file``,
``--params_override``) in one file; ``params_override`` (a ``a.b=1,c.d=x`` string, or
YAML/JSON) is applied on top, as by Model Garden's flag.

The distribution strategy comes from the cluster, not from the pipeline: a pipeline that
names a different ``runtime.distribution_strategy`` is refused. Under
``parameter_server`` Model Garden needs ``trainer.eval_tf_while_loop: true`` (its
coordinator can only schedule whole loops on workers), which is set here; COCO metrics
cannot be computed by the coordinator in-process, so evaluation is the evaluator's job
(``od_dist.task.trainer.continuous_eval``), which runs eagerly on its own machine.

Every failure is a ``PipelineError`` whose one-line message names the file, the key, the
value and the fix.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable
from typing import Any

import yaml

from od_dist import patches
from od_dist.cluster import safe_yaml
from od_dist.cluster.messages import did_you_mean

STRATEGIES = ("parameter_server", "multi_worker_mirrored", "mirrored")
# Model Garden's own name for "one device, no strategy"; fine wherever 'mirrored' is.
_SINGLE_MACHINE_ALIASES = ("one_device",)
_TOP_LEVEL = ("experiment", "task", "trainer", "runtime")
_DETECTION_PREFIXES = ("retinanet", "fasterrcnn", "maskrcnn", "cascadercnn", "centernet")


class PipelineError(ValueError):
    """A pipeline that cannot be used; the message is one line, for the user."""


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads 1e-4 as a float, as Model Garden's loader does."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*)$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _read_file(path: str) -> dict:
    if not os.path.isfile(path):
        raise PipelineError(
            f"pipeline '{path}': no such file; pass the path of a pipeline YAML, "
            "e.g. pipelines/shapes_retinanet.yaml"
        )
    try:
        safe_yaml.load_file(path)  # size cap, no aliases, no duplicate keys
        with open(path, encoding="utf-8") as f:
            doc = yaml.load(f, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)
    except safe_yaml.YamlError as e:
        raise PipelineError(f"pipeline '{path}': {e}") from None
    except yaml.YAMLError as e:
        raise PipelineError(f"pipeline '{path}': invalid YAML: {e}".replace("\n", " ")) from None
    if not isinstance(doc, dict):
        raise PipelineError(
            f"pipeline '{path}': the file must be a mapping with 'experiment:' and "
            "task:/trainer:/runtime: sections"
        )
    return doc


def _parse_override(text: str) -> dict:
    """A Model Garden --params_override value: 'a.b=1,c=x', YAML/JSON, or a YAML file -> dict."""
    from official.modeling.hyperparams import params_dict

    shown = text if len(text) < 80 else text[:77] + "..."
    if os.path.isfile(text):  # a file, as Model Garden's own flag takes it
        try:
            safe_yaml.load_file(text)  # size cap, no aliases, no duplicate keys
            with open(text, encoding="utf-8") as f:
                value = yaml.load(f, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)
        except (safe_yaml.YamlError, yaml.YAMLError, OSError, UnicodeDecodeError) as e:
            raise PipelineError(f"params_override: file '{text}': {e}".replace("\n", " ")) from None
        if not isinstance(value, dict):
            raise PipelineError(
                f"params_override: file '{text}': not a YAML mapping; write e.g. 'trainer: {{train_steps: 200}}'"
            )
        return value
    try:
        converted = params_dict.nested_csv_str_to_json_str(text)
    except ValueError:
        converted = text
    try:
        value = yaml.load(converted, Loader=_Loader)  # noqa: S506
    except yaml.YAMLError:
        value = None
    if not isinstance(value, dict):
        raise PipelineError(
            f"params_override: '{shown}': not a 'key.sub=value,...' list nor a YAML mapping; "
            "write e.g. 'trainer.train_steps=200,task.train_data.global_batch_size=16'"
        )
    return value


def known_experiments() -> list[str]:
    """Registered Model Garden detection experiments."""
    import_model_garden()
    return sorted(
        n for n in patches.model_garden.registered_experiments() if n.startswith(_DETECTION_PREFIXES)
    )


def import_model_garden() -> None:
    """Registers the detection experiments, their tasks and backbones: Model Garden's vision ones
    and its CenterNet project's (which `pipeline import` maps CenterNet configs to)."""
    import official.projects.centernet.common.registry_imports  # noqa: F401
    import official.vision  # noqa: F401

    patches.model_garden.gather_centernet_inside(_gather_inside)


def _gather_inside(batch_predictions, indices):
    """Model Garden's CenterNet loss gathers its padding instances at index -1 (their loss is
    masked out after): GPUs and TPUs read zeros there, a CPU raises InvalidArgumentError at the
    first step. Gathered inside the map, they give the same loss on every device."""
    import tensorflow as tf

    top = tf.shape(batch_predictions)[: tf.shape(indices)[-1]] - 1
    return tf.gather_nd(batch_predictions, tf.clip_by_value(indices, 0, top))


def _is_config(obj) -> bool:
    from official.modeling.hyperparams import base_config

    return isinstance(obj, base_config.Config)


def _check_keys(config, override: dict, source: str, prefix: str = "") -> None:
    """Unknown keys and obviously wrong value types, named by their dotted path."""
    for key, value in override.items():
        dotted = f"{prefix}{key}"
        if not isinstance(key, str) or key not in config.__dict__ or key.startswith("_"):
            known = [k for k in config.__dict__ if not k.startswith("_")]
            raise PipelineError(f"{source}: {dotted}: unknown key; {did_you_mean(key, sorted(known))}")
        current = config.__dict__[key]
        if isinstance(value, dict):
            if _is_config(current):
                _check_keys(current, value, source, dotted + ".")
            elif current is not None and not isinstance(current, dict):
                raise PipelineError(
                    f"{source}: {dotted}: a mapping was given but it holds a value "
                    f"(default {current!r}); write '{dotted}: VALUE'"
                )
            continue
        if value is None or current is None:
            continue
        if isinstance(current, bool):
            ok = isinstance(value, bool)
            want = "true or false"
        elif isinstance(current, (int, float)):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            want = "a number"
        elif isinstance(current, str):
            ok = isinstance(value, str)
            want = "a string"
        else:
            ok, want = True, ""
        if not ok:
            raise PipelineError(
                f"{source}: {dotted}: '{value}': expects {want} (default {current!r}); fix the value"
            )


def _apply(params, override: dict, source: str) -> None:
    from official.modeling import hyperparams

    _check_keys(params, override, source)
    try:
        hyperparams.override_params_dict(params, override, is_strict=True)
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        msg = str(e.args[0] if isinstance(e, KeyError) and e.args else e)
        raise PipelineError(f"{source}: cannot apply: {msg}".replace("\n", " ")) from None


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def _reconcile_strategy(params, strategy: str | None, explicit: dict[str, tuple[str, Any]]) -> None:
    """Makes runtime/trainer settings agree with the cluster's strategy, or refuses."""
    key = "runtime.distribution_strategy"
    if strategy is None:
        return
    if key in explicit:
        source, value = explicit[key]
        compatible = value == strategy or (strategy == "mirrored" and value in _SINGLE_MACHINE_ALIASES)
        if not compatible:
            raise PipelineError(
                f"{source}: {key}: '{value}': contradicts the cluster's strategy "
                f"'{strategy}'; remove {key} from {source} (the cluster file decides it)"
            )
    params.runtime.distribution_strategy = strategy
    if strategy == "parameter_server":
        ekey = "trainer.eval_tf_while_loop"
        if ekey in explicit and explicit[ekey][1] is not True:
            source, value = explicit[ekey]
            raise PipelineError(
                f"{source}: {ekey}: '{value}': parameter_server needs it true (Model Garden "
                f"schedules whole eval loops on workers); remove it or set {ekey}: true"
            )
        params.trainer.eval_tf_while_loop = True


# runtime.all_reduce_alg values each strategy can use (Model Garden's own builder's choices).
ALL_REDUCE_ALGS = {
    "mirrored": (None, "nccl", "hierarchical_copy"),
    "multi_worker_mirrored": (None, "ring", "nccl"),
    "parameter_server": (None,),
}


def _check_communication(params, strategy: str | None, source: str) -> None:
    """runtime.all_reduce_alg and runtime.num_packs reach the strategy od-dist builds; a value
    that cannot apply to the cluster's strategy is refused rather than silently dropped."""
    rt = params.runtime
    strategy = strategy or rt.distribution_strategy
    allowed = ALL_REDUCE_ALGS.get(strategy)
    if allowed is None:
        return
    if rt.all_reduce_alg not in allowed:
        if strategy == "parameter_server":
            fix = "parameter_server has no all-reduce (the ps tasks hold the variables); remove it"
        else:
            fix = f"use one of {', '.join(a for a in allowed if a)} under {strategy}, or remove it"
        raise PipelineError(f"{source}: runtime.all_reduce_alg: '{rt.all_reduce_alg}': {fix}")
    if rt.num_packs != 1 and (strategy != "mirrored" or rt.all_reduce_alg is None):
        fix = {
            "parameter_server": "parameter_server has no all-reduce; remove it",
            "multi_worker_mirrored": "under multi_worker_mirrored od-dist sets the packs: remove it and "
            "pass --all_reduce_packs N to od-dist train",
        }.get(
            strategy, "it applies with runtime.all_reduce_alg nccl or hierarchical_copy; set one or remove it"
        )
        raise PipelineError(f"{source}: runtime.num_packs: '{rt.num_packs}': {fix}")


def _explicit_keys(doc: dict, source: str, keys: Iterable[str], out: dict[str, tuple[str, Any]]) -> None:
    for k in keys:
        v = _get(doc, k)
        if v is not None:
            out[k] = (source, v)


def stride_sizes(side: int, stride: int) -> tuple[int, int]:
    """The sizes a model whose largest stride is ``stride`` takes nearest ``side``: (the multiple
    below or equal, the multiple above or equal). Model Garden pads images to a multiple of that
    stride and builds the model at input_size, so only multiples work."""
    return side // stride * stride, -(-side // stride) * stride


def _check_input_size(model, source: str) -> None:
    """task.model.input_size against the levels of a model with an FPN (RetinaNet, the R-CNNs):
    Model Garden would stop at the first step with a layer's shape error."""
    max_level = getattr(model, "max_level", None)
    size = list(getattr(model, "input_size", None) or [])
    if not max_level or len(size) < 2:
        return
    stride = 2 ** int(max_level)
    if all(side % stride == 0 for side in size[:2]):
        return
    below, above = zip(*(stride_sizes(int(side), stride) for side in size[:2]))
    options = [list(sides) + size[2:] for sides in (below, above) if min(sides) > 0]
    raise PipelineError(
        f"{source}: task.model.input_size: '{size}': height and width must be multiples of {stride} "
        f"(2^task.model.max_level, the model's largest stride); the nearest that work: "
        + " or ".join(str(o) for o in options)
    )


def _check_params(params, source: str) -> None:
    """Rules Model Garden only discovers minutes later, checked up front."""
    _check_input_size(params.task.model, source)
    t = params.trainer
    if t.train_steps <= 0:
        raise PipelineError(
            f"{source}: trainer.train_steps: '{t.train_steps}': must be > 0; set trainer.train_steps"
        )
    if t.steps_per_loop <= 0:
        raise PipelineError(
            f"{source}: trainer.steps_per_loop: '{t.steps_per_loop}': must be > 0; set it (about 100 on CPU)"
        )
    if t.summary_interval and t.summary_interval % t.steps_per_loop:
        raise PipelineError(
            f"{source}: trainer.summary_interval: '{t.summary_interval}': must be a "
            f"multiple of trainer.steps_per_loop ({t.steps_per_loop}); set it to "
            f"{max(1, t.summary_interval // t.steps_per_loop) * t.steps_per_loop}"
        )
    if t.checkpoint_interval <= 0:
        raise PipelineError(
            f"{source}: trainer.checkpoint_interval: '{t.checkpoint_interval}': must be "
            "> 0 (checkpoints are how a run resumes); set it"
        )
    for split in ("train_data", "validation_data"):
        data = getattr(params.task, split, None)
        if data is None:
            continue
        if not data.input_path and not getattr(data, "tfds_name", ""):
            raise PipelineError(
                f"{source}: task.{split}.input_path: '': no data; set it to your "
                "TFRecords, e.g. data/shapes/train.tfrecord"
            )
        if data.global_batch_size <= 0:
            raise PipelineError(
                f"{source}: task.{split}.global_batch_size: '{data.global_batch_size}': must be > 0; set it"
            )


def load_pipeline(path: str, params_override: str | None = None, strategy: str | None = None):
    """Loads a pipeline file into a validated Model Garden ``ExperimentConfig``.

    Args:
      path: the pipeline YAML (``experiment:`` + task/trainer/runtime overrides).
      params_override: Model Garden ``--params_override`` text ('a.b=1,c=x' or YAML/JSON),
        applied after the file.
      strategy: the cluster's strategy ('parameter_server', 'multi_worker_mirrored',
        'mirrored') or None to keep the pipeline's own ``runtime.distribution_strategy``.

    Returns:
      The (unlocked) ``official.core.config_definitions.ExperimentConfig``.

    Raises:
      PipelineError: with a one-line message naming the key, the value and the fix.
    """
    if strategy is not None and strategy not in STRATEGIES:
        raise PipelineError(f"strategy: '{strategy}': unknown; use one of {', '.join(STRATEGIES)}")
    doc = _read_file(path)
    source = f"pipeline '{path}'"
    for key in doc:
        if key not in _TOP_LEVEL:
            raise PipelineError(
                f"{source}: {key}: unknown top-level key; {did_you_mean(key, sorted(_TOP_LEVEL))}"
            )
    name = doc.get("experiment")
    if not isinstance(name, str) or not name:
        raise PipelineError(
            f"{source}: experiment: '{name if name is not None else ''}': missing; name the "
            f"base Model Garden experiment, one of {', '.join(known_experiments())}"
        )
    known = known_experiments()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise PipelineError(
            f"{source}: experiment: '{name}': not a registered detection experiment; "
            f"{hint}known: {', '.join(known)}"
        )
    from official.core import exp_factory

    params = exp_factory.get_exp_config(name)
    body = {k: v for k, v in doc.items() if k != "experiment"}
    for section, value in body.items():
        if not isinstance(value, dict):
            raise PipelineError(
                f"{source}: {section}: '{value}': must be a mapping of overrides; "
                f"indent its keys under {section}:"
            )
    explicit: dict[str, tuple[str, Any]] = {}
    watched = ("runtime.distribution_strategy", "trainer.eval_tf_while_loop")
    _apply(params, body, source)
    _explicit_keys(body, source, watched, explicit)
    if params_override:
        override = _parse_override(params_override)
        _apply(params, override, "params_override")
        _explicit_keys(override, "params_override", watched, explicit)
    _reconcile_strategy(params, strategy, explicit)
    if params_override:
        source += " with params_override"
    _check_params(params, source)
    _check_communication(params, strategy, source)
    try:
        params.validate()
    except (KeyError, ValueError) as e:
        msg = str(e.args[0] if isinstance(e, KeyError) and e.args else e)
        raise PipelineError(f"{source}: invalid: {msg}".replace("\n", " ")) from None
    return params


def check_inputs(params, path: str, train: bool = False, evaluate: bool = False) -> None:
    """The records a task opens, before TensorFlow builds anything (Model Garden would find a
    problem minutes later, deep in a traceback): with `train` the training records, with
    `evaluate` the validation records, which must also hold numeric source ids. Every pattern of
    their input_path must name a file on this machine; remote ones (gs://...) are TensorFlow's to
    open. Raises PipelineError naming the key, the pattern and the fix."""
    splits = (["train_data"] if train else []) + (["validation_data"] if evaluate else [])
    for split in splits:
        problem = input_problem(params, path, split)
        if problem:
            raise PipelineError(problem)
    problem = file_name_ids(params, path) if evaluate else None
    if problem:
        raise PipelineError(problem)


def validation_problem(params, path: str) -> str | None:
    """What the evaluation of this pipeline's validation records would fail on here, in one line (a
    path that matches nothing, file names as source ids); None when nothing."""
    return input_problem(params, path, "validation_data") or file_name_ids(params, path)


def input_problem(params, path: str, split: str) -> str | None:
    """The first pattern of task.<split>.input_path that names no file on this machine, in one line;
    None when each does (or the data is not files here: TFDS, gs://...)."""
    from od_dist.data import records

    data = getattr(params.task, split)
    if data.tfds_name:
        return None
    key = f"task.{split}.input_path"
    found = records.patterns(data.input_path)
    if not found:
        return (
            f"pipeline '{path}': {key}: '': not set; set it to the records (a file, a glob or "
            "a comma-separated list)"
        )
    for pattern in found:
        if "://" not in pattern and not records.files_of(pattern):
            return (
                f"pipeline '{path}': {key}: '{pattern}': matches no file on this machine (working "
                f"directory {os.getcwd()}); fix the path or copy the records here, then "
                f"'od-dist data check --pipeline {path}' reads every record"
            )
    return None


def file_name_ids(params, path: str) -> str | None:
    """When the validation records hold file names as image/source_id (the Object Detection API's
    layout), what to do about it in one line; else None. COCO evaluation needs numeric ids: Model
    Garden's would stop with a graph error (StringToNumberOp) after building everything."""
    from od_dist.data import records

    val = ",".join(records.patterns(params.task.validation_data.input_path))
    files = records.match_files(val)
    sid = records.file_name_source_id(files)
    if sid is None:
        return None
    train = ",".join(records.patterns(params.task.train_data.input_path))
    return (
        f"pipeline '{path}': task.validation_data.input_path: '{val}': its records hold file names as "
        f"image/source_id ('{sid}' in {files[0]}), the Object Detection API's layout, and COCO "
        f'evaluation needs numbers; rewrite them once with \'od-dist data odapi --train "{train}" '
        f"--val \"{val}\" --out DIR' and point the pipeline's input paths at DIR"
    )


# The pieces of a detection model, as Keras names their layers, and the pipeline key that shapes
# each: a build error names a layer, the user needs a key.
_LIKELY_KEYS = (
    (
        ("classnet", "boxnet", "head"),
        "task.model.decoder / task.model.head (the head runs on every level with one width: a "
        "backbone's levels differ unless a decoder such as fpn gives them one)",
    ),
    (("fpn", "decoder", "aspp"), "task.model.decoder"),
    (
        ("dimensions must be equal", "incompatible shapes", "must be divisible"),
        "task.model.input_size (a multiple of 2^max_level) or task.model.min_level/max_level",
    ),
    (("mobilenet", "resnet", "spinenet", "efficientnet", "backbone"), "task.model.backbone"),
)


def _model_error_line(e: Exception) -> str:
    """The one telling line of a (Keras) build error, without its call-argument dump."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    useful = [
        ln
        for ln in lines
        if not ln.startswith(("Exception encountered", "Call arguments", "•", "File ", "in user code"))
    ]
    line = (useful or lines or [type(e).__name__])[0]
    return line if len(line) <= 240 else line[:237] + "..."


# What a pipeline can get wrong in a model build (Keras' and Model Garden's checks, a shape that
# does not fit). Out of memory, CUDA and a library's own failures are no pipeline's: they are not
# caught, so they stay exit 1 rather than a permanent "invalid pipeline" (FailJobSet on Kubernetes).
_PIPELINE_ERRORS = (ValueError, TypeError, KeyError, IndexError, NotImplementedError, AssertionError)


def check_model(params, path: str, build=None):
    """Builds the pipeline's model and runs it once on one dummy image at its input size, without
    training: a model that cannot be built (a backbone whose levels the head cannot take, an input
    size the levels do not divide) is one line naming the pipeline and the likely key (raises
    PipelineError), not a traceback at the first step. ``build``: the task's own build_model, so
    that a trainer checks the model it trains instead of building a second one (about 3 s of CPU);
    by default a throwaway model. Returns the model."""
    import tensorflow as tf

    import_model_garden()
    from official.core import task_factory
    from official.vision.configs import retinanet as retinanet_cfg

    try:
        model = (build or task_factory.get_task(params.task).build_model)()
        if isinstance(params.task.model, retinanet_cfg.RetinaNet):
            # A RetinaNet's head meets its inputs only when called; the two-stage models take
            # ground truth in training and are checked as far as build_model goes. The parts are
            # called, not the model: its detection generator (NMS per class, run eagerly here)
            # checks no shape and costs 20 s of CPU for a COCO pipeline's 90 classes.
            height, width = params.task.model.input_size[:2]
            features = model.backbone(tf.zeros([1, height, width, 3]), training=False)
            if model.decoder:
                features = model.decoder(features, training=False)
            model.head(features, training=False)
    except (*_PIPELINE_ERRORS, tf.errors.InvalidArgumentError) as e:
        text = str(e).lower()
        key = next((k for words, k in _LIKELY_KEYS if any(w in text for w in words)), "task.model")
        raise PipelineError(
            f"pipeline '{path}': the model cannot be built: {_model_error_line(e)}; check {key}"
        ) from None
    return model
