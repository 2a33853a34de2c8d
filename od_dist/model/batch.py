"""The batch rule of replicas in sync: each step's global batch shared out evenly over them.

One rule for every place that meets it before a task trains: `check_batch_split` reads a cluster
and a pipeline file without TensorFlow (validate, doctor, scripts, k8s, slurm, train, and an
elastic job's agreement on each group); a trainer applies it to its loaded config with
`split_over_replicas` (the default) or `scale_for_replicas` (--fixed_replica_batch).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence

import yaml

from od_dist.cluster import safe_yaml
from od_dist.model.pipeline import PipelineError, _get, _Loader, _read_file

BATCH_KEY = "task.train_data.global_batch_size"


def batch_problem(batch: int, replicas: int, clones: Sequence[int] = ()) -> str | None:
    """The one rule for replicas in sync: each step's global batch is shared out evenly over them
    (TensorFlow fails inside the first dataset otherwise). None when `batch` divides; else the
    one-line problem with the nearest batches that do. `clones`: each trainer's clones, when known,
    to name them (the trainers themselves know only the sum)."""
    if replicas <= 1 or batch % replicas == 0:
        return None
    below = batch // replicas * replicas
    multiples = f"{below} or {below + replicas}" if below else f"{replicas}"
    by = ""
    if clones:
        each = f"x {clones[0]} clone{'s' if clones[0] > 1 else ''}"
        if len(set(clones)) > 1:
            each = f"with {'+'.join(map(str, clones))} clones"
        by = f" ({len(clones)} trainer{'s' if len(clones) > 1 else ''} {each})"
    return (
        f"{BATCH_KEY}: {batch} does not split evenly over {replicas} replicas in sync{by}; set a "
        f"multiple of {replicas} ({multiples}) with --params_override {BATCH_KEY}=N, or pass "
        f"--fixed_replica_batch to make {batch} each replica's batch"
    )


def split_over_replicas(params, replicas: int) -> str:
    """The default when `replicas` train in sync: the pipeline's global_batch_size is each step's
    whole batch, shared out evenly, with the learning rate and steps as written; the same training
    as on one machine, each step's examples computed in parallel. Raises PipelineError when the
    batch does not split evenly (batch_problem). Returns a one-line description."""
    batch = params.task.train_data.global_batch_size
    problem = batch_problem(batch, replicas)
    if problem:
        raise PipelineError(problem)
    return (
        f"global batch {batch} split over {replicas} replicas, {batch // replicas} each; learning rate "
        f"and steps as written (--fixed_replica_batch: {batch} per replica instead)"
    )


def _written_override(text: str):
    """The global batch a --params_override sets, read without Model Garden (whose parser imports
    TensorFlow): None when it does not name it, "?" when it does in a form not read here."""
    if BATCH_KEY.rsplit(".", 1)[1] not in text:
        return None
    try:
        if os.path.isfile(text):
            safe_yaml.load_file(text)  # size cap, no aliases, no duplicate keys
            with open(text, encoding="utf-8") as f:
                doc = yaml.load(f, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)
        else:
            # Model Garden applies the overrides in order: the last one of the key is what trains.
            flat = re.findall(rf"(?:^|,)\s*{re.escape(BATCH_KEY)}\s*=\s*([^,]*)", text)
            if flat:
                return yaml.load(flat[-1], Loader=_Loader)  # noqa: S506
            doc = yaml.load(text, Loader=_Loader)  # noqa: S506
    except (safe_yaml.YamlError, yaml.YAMLError, OSError, UnicodeDecodeError):
        return "?"
    value = _get(doc, BATCH_KEY) if isinstance(doc, dict) else None
    return "?" if value is None else value


def in_sync_clones(cluster, num_clones: int | None = None) -> list[int]:
    """Each trainer's clones, for the trainers that step in sync (none under parameter_server):
    `num_clones` when given on the command line (every trainer's), else its host's in the file."""
    from od_dist.cluster import duties

    return [
        num_clones or cluster.clones_for(t.address.host)
        for t in cluster.server_tasks()
        if duties.of(cluster.strategy, t.role).is_trainer
        and duties.of(cluster.strategy, t.role).runs_replicas
    ]


def group_replicas(clones: Sequence[int], min_trainers: int | None) -> list[int]:
    """The replicas in sync of every group an elastic job may train in (each set of at least
    `min_trainers` of the trainers whose clones are `clones`), smallest first; without
    min_trainers, of the one group of them all."""
    if not min_trainers:
        return [sum(clones)]
    groups = {(0, 0)}  # (trainers, replicas) of the sets seen so far
    for c in clones:
        groups |= {(n + 1, r + c) for n, r in groups}
    return sorted({r for n, r in groups if n >= min_trainers})


def groups_problem(batch: int, replicas: Sequence[int], min_trainers: int) -> str | None:
    """batch_problem for an elastic job: `batch` must split over the replicas of every group
    (group_replicas), or a lost machine leaves a group that cannot train. None when it does; else
    the one-line problem with the nearest batches that split over all of them."""
    bad = [r for r in replicas if r > 1 and batch % r]
    if not bad:
        return None
    step = math.lcm(*replicas)
    below = batch // step * step
    multiples = f"{below} or {below + step}" if below else f"{step} or {2 * step}"
    groups = " and ".join(map(str, replicas))
    return (
        f"{BATCH_KEY}: {batch} does not split evenly over every group min_trainers {min_trainers} "
        f"allows ({groups} replicas in sync; not over {', '.join(map(str, bad))}), so a lost machine "
        f"would leave a group that cannot train; set a multiple of {step} ({multiples}) with "
        f"--params_override {BATCH_KEY}=N, or pass --fixed_replica_batch to make {batch} each "
        "replica's batch"
    )


def check_batch_split(
    cluster, path: str, params_override: str | None = None, num_clones: int | None = None
) -> tuple[str | None, str, bool]:
    """batch_problem for a cluster and a pipeline file, before anything starts, without TensorFlow
    (validate, doctor, scripts, k8s, slurm, train), on the batch as the file and `params_override`
    write it, over every group the cluster's min_trainers allows (groups_problem): (the problem or
    None, what was found ('' when no replicas step in sync), whether the batch was read). A batch
    the file leaves to the experiment's default is known only to Model Garden: the trainers check
    it at start. Raises PipelineError for an unreadable file."""
    clones = in_sync_clones(cluster, num_clones)
    replicas = sum(clones)
    if replicas <= 1:
        return None, "", False
    groups = group_replicas(clones, cluster.min_trainers) if len(clones) > 1 else [replicas]
    batch = _written_override(params_override) if params_override else None
    if batch is None:
        batch = _get(_read_file(path), BATCH_KEY)
    if not isinstance(batch, int) or isinstance(batch, bool) or batch <= 0:
        # Not set, or not a batch (loading the pipeline says what is wrong with it).
        return (
            None,
            f"{BATCH_KEY} not read here (the experiment's default?): the trainers check it at start",
            False,
        )
    if len(groups) > 1:
        problem = groups_problem(batch, groups, cluster.min_trainers)
        if problem:
            return f"pipeline '{path}': {problem}", "", True
        each = ", ".join(f"{r} replicas {batch // r} each" for r in groups)
        return None, f"global batch {batch} over every group min_trainers allows: {each}", True
    problem = batch_problem(batch, replicas, clones)
    if problem:
        return f"pipeline '{path}': {problem}", "", True
    return None, f"global batch {batch} over {replicas} replicas in sync, {batch // replicas} each", True


def scale_for_replicas(params, replicas: int) -> str:
    """--fixed_replica_batch: the pipeline's global_batch_size becomes the batch of ONE replica,
    so adding machines adds examples per step instead of splitting the same batch thinner.

    With `replicas` times the batch, the learning rate is multiplied by `replicas` (the linear
    scaling rule, Goyal et al. 2017) and ramps up linearly from the pipeline's own rate over the
    warmup (the pipeline's warmup steps, or 5% of trainer.train_steps when it has none), which
    keeps the first steps of the larger rate stable. Step counts (train_steps, schedule steps,
    intervals) stay as written: each step now sees `replicas` times the examples. Returns a
    one-line description. Edits `params` in place.
    """
    if replicas <= 1:
        return "one replica: batch and learning rate as the pipeline says"
    data = params.task.train_data
    base_batch = data.global_batch_size
    data.global_batch_size = base_batch * replicas
    lr = params.trainer.optimizer_config.learning_rate
    schedule = lr.get()
    base_lr = None
    if schedule is not None:
        for name, value in schedule.as_dict().items():
            if name.endswith("learning_rate") and isinstance(value, (int, float)):
                base_lr = value if name == "initial_learning_rate" or base_lr is None else base_lr
                setattr(schedule, name, value * replicas)
            elif name == "values" and value:  # stepwise: the rate of every stage
                base_lr = value[0] if base_lr is None else base_lr
                setattr(schedule, name, [v * replicas for v in value])
    warmup = params.trainer.optimizer_config.warmup
    if base_lr is not None and warmup.type is None:
        warmup.type = "linear"
        warmup.linear.warmup_steps = max(1, params.trainer.train_steps // 20)
        warmup.linear.warmup_learning_rate = base_lr
    steps = warmup.get().warmup_steps if warmup.get() is not None else 0
    shown = f"learning rate x{replicas}" if base_lr is not None else "learning rate as written (no schedule)"
    return (
        f"global batch {base_batch} x {replicas} replicas = {data.global_batch_size}, {shown}, "
        f"warmup {steps} steps"
    )
