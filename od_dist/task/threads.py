"""A task's CPU thread budget (od_dist/host/cpu_budget.py) applied inside its TensorFlow process: the
pools set before TensorFlow initialises, tf.data's private pool per input pipeline."""

from __future__ import annotations

import os

from od_dist.host.cpu_budget import Threads, cores_within, cpu_limit, runnable_cores
from od_dist.task import phases

# TensorFlow's own variables for its pool sizes, read as it creates the pools.
INTRA_OP_ENV, INTER_OP_ENV = "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"


def apply(threads: Threads, label: str) -> Threads:
    """Sets TensorFlow's pools before it initialises and says what TensorFlow now reports (in the
    task's log: phases.say).

    The environment variables reach every pool this process creates, the in-process servers'
    too; tf.config.threading sets the eager context's. Must run before any op or device query.
    """
    if threads.intra_op:
        os.environ[INTRA_OP_ENV] = str(threads.intra_op)
    if threads.inter_op:
        os.environ[INTER_OP_ENV] = str(threads.inter_op)
    import tensorflow as tf

    if threads.intra_op:
        tf.config.threading.set_intra_op_parallelism_threads(threads.intra_op)
    if threads.inter_op:
        tf.config.threading.set_inter_op_parallelism_threads(threads.inter_op)
    applied = Threads(
        tf.config.threading.get_intra_op_parallelism_threads() or _from_environment(INTRA_OP_ENV),
        tf.config.threading.get_inter_op_parallelism_threads() or _from_environment(INTER_OP_ENV),
        threads.data,
    )
    limit, runnable = cpu_limit(), runnable_cores()
    shown = f", a CPU limit of {limit:g} on {runnable}" if limit is not None and limit < runnable else ""
    cores = cores_within(limit, runnable)
    # A measurement, as the start-up's phase lines: the task's log (phases.say).
    phases.say(f"{label}: threads {applied.describe()} ({cores} core{'s' * (cores != 1)}{shown})")
    return applied


def _from_environment(name: str) -> int:
    """A pool size set through TensorFlow's own variable (by the user, where od-dist left the
    default): TensorFlow sizes the pool by it, yet tf.config.threading reports 0."""
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else 0


def with_data_threads(build_inputs, data_threads: int):
    """Wraps a Model Garden task's build_inputs so its datasets use `data_threads` threads
    (Model Garden's DataConfig has no such setting). 0 returns it unchanged."""
    if not data_threads:
        return build_inputs

    def build(*args, **kwargs):
        import tensorflow as tf

        dataset = build_inputs(*args, **kwargs)
        options = tf.data.Options()
        options.threading.private_threadpool_size = data_threads
        options.threading.max_intra_op_parallelism = 1
        return dataset.with_options(options)

    return build
