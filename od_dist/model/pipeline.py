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
(``od_dist.job.trainer.continuous_eval``), which runs eagerly on its own machine.

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

from od_dist.cluster import safe_yaml
from od_dist.cluster.validate import did_you_mean

STRATEGIES = ("parameter_server", "multi_worker_mirrored", "mirrored")
# Model Garden's own name for "one device, no strategy"; fine wherever 'mirrored' is.
_SINGLE_MACHINE_ALIASES = ("one_device",)
_TOP_LEVEL = ("experiment", "task", "trainer", "runtime")
_DETECTION_PREFIXES = ("retinanet", "fasterrcnn", "maskrcnn", "cascadercnn")


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
    """A Model Garden --params_override value: 'a.b=1,c=x' or YAML/JSON -> dict."""
    from official.modeling.hyperparams import params_dict

    shown = text if len(text) < 80 else text[:77] + "..."
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
    _import_model_garden()
    from official.core import exp_factory

    return sorted(n for n in exp_factory._REGISTERED_CONFIGS if n.startswith(_DETECTION_PREFIXES))


def _import_model_garden() -> None:
    import official.vision  # noqa: F401 (registers the detection experiments)


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


def _explicit_keys(doc: dict, source: str, keys: Iterable[str], out: dict[str, tuple[str, Any]]) -> None:
    for k in keys:
        v = _get(doc, k)
        if v is not None:
            out[k] = (source, v)


def _check_params(params, source: str) -> None:
    """Rules Model Garden only discovers minutes later, checked up front."""
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
    try:
        params.validate()
    except (KeyError, ValueError) as e:
        msg = str(e.args[0] if isinstance(e, KeyError) and e.args else e)
        raise PipelineError(f"{source}: invalid: {msg}".replace("\n", " ")) from None
    return params
