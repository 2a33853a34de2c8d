"""The multi_worker_mirrored trainers as a group: their names and ids, one small value gathered from
each, every variable set to one trainer's, and which trainer writes a shared folder. Each is
collective (every trainer calls it, in the same order) unless it says otherwise."""

from __future__ import annotations

import os

from od_dist import patches
from od_dist.protocol import membership


def trainer_names(strategy) -> list:
    """multi_worker_mirrored trainers by TensorFlow's id in cluster (chief 0, worker i -> i+1;
    without a chief, worker i -> i), by their names in the cluster file: in an elastic job's round,
    its members (whose order is that of the ids: the master, then the workers in the file's order)."""
    resolver = patches.tensorflow.cluster_resolver(strategy)
    spec = resolver.cluster_spec() if resolver else None
    if not spec or not spec.jobs:
        return ["single"]
    group = membership.group_from_env()
    if group is not None:
        return list(group.members)
    chief = ["master:0"] if "chief" in spec.jobs else []
    return chief + [f"worker:{i}" for i in range(spec.num_tasks("worker") if "worker" in spec.jobs else 0)]


def several_trainers(strategy) -> bool:
    """A multi_worker_mirrored group of more than one trainer."""
    import tensorflow as tf

    return (
        isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and len(trainer_names(strategy)) > 1
    )


def trainer_id(strategy) -> int:
    resolver = patches.tensorflow.cluster_resolver(strategy)
    if not resolver or not resolver.cluster_spec().jobs:
        return 0
    if resolver.task_type == "chief":
        return 0
    return int(resolver.task_id) + (1 if "chief" in resolver.cluster_spec().jobs else 0)


def trainer_name(strategy) -> str:
    return trainer_names(strategy)[trainer_id(strategy)]


_GATHER_WIDTH = 8  # values per trainer at most
_GATHERS: dict = {}  # strategy -> its gather, traced once


def gather(strategy, *values: int) -> dict:
    """{trainer id: (*values)} of every trainer: one all-reduce under multi_worker_mirrored (every
    trainer must call it at the same point), else ours. A table with a row per trainer, each
    filling its own (by its first replica) and zeros elsewhere, summed: traced once, as a tf.function
    (strategy.gather traces again at every call, and TensorFlow then warns on the console)."""
    import numpy as np
    import tensorflow as tf

    me = trainer_id(strategy)
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return {me: tuple(values)}
    trainers = len(trainer_names(strategy))
    if id(strategy) not in _GATHERS:
        my_first = first_replica(strategy, me)

        @tf.function
        def gather(table):
            def contribute(table):
                context = tf.distribute.get_replica_context()
                first = tf.equal(context.replica_id_in_sync_group, my_first)
                return context.all_reduce(
                    tf.distribute.ReduceOp.SUM, tf.where(first, table, tf.zeros_like(table))
                )

            return strategy.run(contribute, args=(table,))

        _GATHERS[id(strategy)] = gather
    table = np.zeros((trainers, 2 + _GATHER_WIDTH), np.int64)
    table[me, : 2 + len(values)] = [1, len(values), *values]
    summed = strategy.experimental_local_results(_GATHERS[id(strategy)](tf.constant(table)))[0].numpy()
    return {i: tuple(int(v) for v in r[2 : 2 + r[1]]) for i, r in enumerate(summed.tolist()) if r[0]}


def first_replica(strategy, trainer: int) -> int:
    """The replica id of trainer `trainer`'s first replica: TensorFlow numbers a trainer's
    replicas after those of the trainers before it, as many each as its own (collective_all_reduce_
    strategy.py, _get_replica_id_in_sync_group)."""
    return trainer * len(strategy.extended.worker_devices)


FOLDERS_COMPARED = "od-dist: the trainers compare their folders and checkpoints"
BROADCAST = "od-dist: the trainers' variables set to one trainer's"  # in the log, with the counts
_FOLDER_TOKEN = ".od-dist-trainer-"  # + a random number: which trainers share a folder


def folder_writer(strategy, model_dir: str) -> int:
    """The id of the trainer that writes checkpoints into `model_dir`: the lowest of those whose
    model_dir is this same folder (a shared folder: a network share, or trainers of one machine
    given one --model_dir). Each trainer leaves a file named by a random number in its own folder
    and looks for the others'. Collective: every multi_worker_mirrored trainer calls it at start."""
    import secrets

    import tensorflow as tf
    from absl import logging

    logging.info("%s", FOLDERS_COMPARED)  # the trainers' first all-reduce of their own
    tf.io.gfile.makedirs(model_dir)
    token = secrets.randbits(62)
    mine = os.path.join(model_dir, f"{_FOLDER_TOKEN}{token}")
    with tf.io.gfile.GFile(mine, "w") as f:
        f.write("")
    try:
        tokens = gather(strategy, token)
        here = [
            i
            for i, (t,) in tokens.items()
            if tf.io.gfile.exists(os.path.join(model_dir, f"{_FOLDER_TOKEN}{t}"))
        ]
        gather(strategy)  # every trainer has looked before any token goes
    finally:
        tf.io.gfile.remove(mine)
    return min(here)


def checkpointed_variables(trainer) -> list:
    """Every variable a checkpoint of `trainer` holds (model, optimizer and its slots, step)."""
    import tensorflow as tf

    seen, found = set(), []
    for obj in tf.train.TrackableView(trainer.checkpoint).descendants():
        if isinstance(obj, tf.Variable) and id(obj) not in seen:
            seen.add(id(obj))
            found.append(obj)
    return found


def broadcast(strategy, variables: list, source: int) -> None:
    """Every trainer's `variables` set to trainer `source`'s, in one all-reduce per dtype: `source`'s
    first replica adds its values, every other replica zeros. Each dtype's values go as one flat
    tensor, cut back into the variables after: a graph of a few ops rather than a few per variable
    (the demo's pair: the resume 3.7 s of CPU, against 5.8 s with a tf.where and an all-reduced
    tensor per variable; benchmarks/mwm_resume.py, 2026-12-02). Collective: every trainer calls it."""
    import tensorflow as tf
    from absl import logging

    first = first_replica(strategy, source)

    def as_sent(v):  # integers (the step counters) travel as float64: exact below 2**53
        value = v.read_value() if v.dtype.is_floating else tf.cast(v.read_value(), tf.float64)
        return tf.reshape(value, [-1])

    groups: dict = {}
    for v in variables:
        groups.setdefault(v.dtype if v.dtype.is_floating else tf.float64, []).append(v)

    @tf.function
    def reduce():
        def contribute():
            context = tf.distribute.get_replica_context()
            mine = tf.equal(context.replica_id_in_sync_group, first)
            sent = []
            for group in groups.values():
                values = tf.concat([as_sent(v) for v in group], 0)
                # where, not a product with 0 or 1: a NaN or an infinity elsewhere stays out of the sum
                sent.append(
                    context.all_reduce(
                        tf.distribute.ReduceOp.SUM, tf.where(mine, values, tf.zeros_like(values))
                    )
                )
            return sent

        return strategy.run(contribute)

    logging.info("%s: %d variables in %d all-reduces, one a dtype", BROADCAST, len(variables), len(groups))
    for group, value in zip(groups.values(), reduce()):
        parts = tf.split(
            strategy.experimental_local_results(value)[0], [v.shape.num_elements() for v in group]
        )
        for v, part in zip(group, parts):
            v.assign(tf.cast(tf.reshape(part, v.shape), v.dtype))
