"""TensorFlow's private names: checkpoint managers, the distribution strategies' variables and
collectives, eager executors."""

from __future__ import annotations

import contextlib
import functools

from od_dist.patches.base import TENSORFLOW, Patch, held

PATCHES = (
    Patch(
        "checkpoint-next-save",
        TENSORFLOW,
        (),
        "sets CheckpointManager._last_checkpoint_step (count_saves_from)",
        "a multi_worker_mirrored worker restored from model_dir (not its own folder) counts its next "
        "save from that step, as the master does: saves are collective",
        held=("tensorflow:train.CheckpointManager._last_checkpoint_step",),
    ),
    Patch(
        "checkpoint-chosen",
        TENSORFLOW,
        (),
        "sets CheckpointManager._latest_checkpoint (restore_from)",
        "`eval --checkpoint`: the Controller restores the checkpoint asked for as it starts, in its "
        "one restore, and says so, rather than the latest first",
        held=("tensorflow:train.CheckpointManager._latest_checkpoint",),
    ),
    Patch(
        "local-initial-values",
        TENSORFLOW,
        (
            "tensorflow.python.distribute.collective_all_reduce_strategy:"
            "CollectiveAllReduceExtended._get_variable_creator_initial_value",
            "tensorflow.python.distribute.mirrored_strategy:MirroredExtended._get_variable_creator_initial_value",
        ),
        "sets a MultiWorkerMirroredStrategy's extended._get_variable_creator_initial_value for a while "
        "(local_initial_values)",
        "each variable's initial value broadcast from the chief in a collective of its own (614 for "
        "the demo, 3.5-4.5 s of a core at every start) is replaced by one broadcast of the checkpoint's "
        "variables when training starts at step 0 or a trainer's folder is behind (task/controller.py); "
        "trainers that all hold the step restore their own copies",
    ),
    Patch(
        "sync-on-read-reads",
        TENSORFLOW,
        (
            "tensorflow.python.distribute.values:SyncOnReadVariable._get_cross_replica",
            "tensorflow.python.distribute.values:SyncOnReadVariable._get_on_device_or_primary",
        ),
        "rebinds SyncOnReadVariable._get_cross_replica for a while (replica_copies_read, "
        "reading_batch_norm_once)",
        "batch-norm statistics read while the model is built, and for each save, take one batched "
        "all-reduce (or none) instead of one collective per variable",
    ),
    Patch(
        "strategy-resolver",
        TENSORFLOW,
        (),
        "reads a ParameterServerStrategy's _cluster_resolver (cluster_resolver)",
        "which trainer this is and how many parameter_server workers run the steps: its public "
        "cluster_resolver is None (TensorFlow's looks on the strategy's extended, as 2.20 sets it for "
        "multi_worker_mirrored only)",
        held=("tensorflow:distribute.experimental.ParameterServerStrategy._cluster_resolver",),
    ),
    Patch(
        "checkpoint-state",
        TENSORFLOW,
        ("tensorflow:__internal__.train.update_checkpoint_state",),
        "calls tf.__internal__.train.update_checkpoint_state (update_checkpoint_state)",
        "a model_dir's checkpoint file names a complete checkpoint that a save left unnamed",
    ),
    Patch(
        "communication-options",
        TENSORFLOW,
        (),
        "merges into a strategy's extended._communication_options (merge_communication_options)",
        "--all_reduce_packs: the pack size is known only once the model is built, after the strategy",
        held=(
            "tensorflow.python.distribute.collective_all_reduce_strategy:"
            "CollectiveAllReduceExtended._communication_options",
        ),
    ),
    Patch(
        "eager-executor",
        TENSORFLOW,
        (
            "tensorflow.python.eager.context:executor_scope",
            "tensorflow.python.eager.executor:new_executor",
        ),
        "runs remote ops under a new eager executor (own_executor)",
        "a failed remote op poisons the executor it ran in: each server's stop marker gets its own",
    ),
    Patch(
        "coordinator-metrics",
        TENSORFLOW,
        ("tensorflow.python.distribute.coordinator.metric_utils:get_metric_summary",),
        "reads ParameterServerStrategy's coordinator metrics (coordinator_metrics)",
        "how busy the parameter_server workers were, said at the end of training: TensorFlow keeps "
        "the figures (closure execution, result fetches, closures in flight and queued) but no public "
        "call reads them",
    ),
)


def count_saves_from(manager, step: int) -> None:
    """checkpoint-next-save: `manager` counts its next save's interval from `step`."""
    held("checkpoint-next-save", manager, "_last_checkpoint_step")
    manager._last_checkpoint_step = step


def restore_from(manager, path: str) -> None:
    """checkpoint-chosen: `manager` restores `path` where it would restore its latest."""
    held("checkpoint-chosen", manager, "_latest_checkpoint")
    manager._latest_checkpoint = path


@contextlib.contextmanager
def local_initial_values(strategy, on: bool = True):
    """local-initial-values: while inside (and `on`), the variables a multi_worker_mirrored
    trainer creates take this trainer's own initial values, as on one machine, without the chief's
    broadcast of each; the caller sets them all to one trainer's before any step (one broadcast, or
    a restore of one save on every trainer), and may end it early (end_local_initial_values)."""
    from tensorflow.python.distribute import collective_all_reduce_strategy, mirrored_strategy

    extended = strategy.extended
    if on and isinstance(extended, collective_all_reduce_strategy.CollectiveAllReduceExtended):
        own = mirrored_strategy.MirroredExtended._get_variable_creator_initial_value
        extended._get_variable_creator_initial_value = functools.partial(own, extended)
    try:
        yield
    finally:
        end_local_initial_values(strategy)


def end_local_initial_values(strategy) -> None:
    """local-initial-values: variables made from now on get TensorFlow's broadcast again."""
    strategy.extended.__dict__.pop("_get_variable_creator_initial_value", None)


@contextlib.contextmanager
def replica_copies_read():
    """sync-on-read-reads: while inside, a SyncOnReadVariable read across replicas gives this
    replica's copy rather than all-reducing the copies (trainer.py says when that holds)."""
    from tensorflow.python.distribute import values

    all_reduced = values.SyncOnReadVariable._get_cross_replica
    values.SyncOnReadVariable._get_cross_replica = lambda self: self._get_on_device_or_primary()
    try:
        yield
    finally:
        values.SyncOnReadVariable._get_cross_replica = all_reduced


def reading_batch_norm_once(save, strategy, variables):
    """sync-on-read-reads: ``save`` (a CheckpointManager's), reading the model's batch-norm
    statistics for the checkpoint in one batched all-reduce under multi_worker_mirrored. TensorFlow
    saves a SyncOnReadVariable's mean over the replicas, read eagerly one variable at a time: one
    collective and one new thread pool each, 3.3 s per save for the demo's 256 statistics (about
    0.1 s on one machine). The values saved are the same means."""
    import tensorflow as tf
    from tensorflow.python.distribute import values

    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return save
    means = [
        v
        for v in variables
        if isinstance(v, values.SyncOnReadVariable) and v.aggregation == tf.VariableAggregation.MEAN
    ]
    if not means:
        return save

    ids = {id(v) for v in means}

    @functools.wraps(save)
    def saving(*args, **kwargs):
        reduced = {}
        read_one = values.SyncOnReadVariable._get_cross_replica

        def read(var):
            if id(var) not in ids or not tf.executing_eagerly():
                return read_one(var)
            if not reduced:  # the save's first read; every trainer reads in the same order
                pairs = [(v, v) for v in means]
                results = strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.MEAN, pairs)
                reduced.update(
                    {id(v): strategy.experimental_local_results(r)[0] for v, r in zip(means, results)}
                )
            return reduced[id(var)]

        values.SyncOnReadVariable._get_cross_replica = read
        try:
            return save(*args, **kwargs)
        finally:
            values.SyncOnReadVariable._get_cross_replica = read_one

    return saving


def cluster_resolver(strategy):
    """strategy-resolver: a strategy's cluster resolver (None for one machine's)."""
    import tensorflow as tf

    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        return held("strategy-resolver", strategy, "_cluster_resolver")
    return strategy.cluster_resolver


def update_checkpoint_state(*args, **kwargs) -> None:
    """checkpoint-state: writes a model_dir's `checkpoint` file (TensorFlow's arguments)."""
    import tensorflow as tf

    tf.__internal__.train.update_checkpoint_state(*args, **kwargs)


def merge_communication_options(dist, options) -> None:
    """communication-options: `options` merged into every all-reduce of `dist` (its options are
    fixed when the strategy is built)."""
    extended = dist.extended
    merged = held("communication-options", extended, "_communication_options").merge(options)
    extended._communication_options = merged


@contextlib.contextmanager
def own_executor():
    """eager-executor: the ops inside run in a new synchronous eager executor of their own."""
    from tensorflow.python.eager import context
    from tensorflow.python.eager import executor as executor_lib

    with context.executor_scope(executor_lib.new_executor(enable_async=False)):
        yield


def coordinator_metrics() -> dict:
    """coordinator-metrics: TensorFlow's ParameterServerStrategy coordinator figures so far, in
    this process: {"closure_execution": (seconds, count), "remote_value_fetch": (seconds, count),
    "inflight_closures": n, "queued_closures": n}; zeros for a figure not yet recorded."""
    from tensorflow.python.distribute.coordinator import metric_utils

    def read(name, empty):
        try:
            return metric_utils.get_metric_summary(name)
        except KeyError:  # the coordinator has not recorded it yet
            return empty

    timed = {name: read(name, {"sum": 0.0, "num": 0}) for name in ("closure_execution", "remote_value_fetch")}
    return {
        **{name: (float(h["sum"]), int(h["num"])) for name, h in timed.items()},
        **{name: int(read(name, 0)) for name in ("inflight_closures", "queued_closures")},
    }
