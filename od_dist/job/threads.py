"""CPU thread budgets for tasks that share a machine.

TensorFlow sizes its thread pools for the whole machine in every process: four tasks of a loopback
cluster on two cores start four pools of two intra-op threads each and spend their time
preempting each other (torchrun sets OMP_NUM_THREADS=1 for its local processes for the same
reason). So a task that knows how many tasks share its machine takes its share of the cores:

- tasks that mostly wait (a ps, the parameter_server coordinator, an evaluator between
  checkpoints) get 1 intra-op thread and 2 inter-op threads;
- the tasks that compute (workers; the master under multi_worker_mirrored) split the cores
  evenly between their intra-op pools;
- a task alone on its machine keeps TensorFlow's defaults (all cores).

tf.data keeps its own default everywhere: capping its private pool at one thread made a
multi_worker_mirrored pair on two cores run at 4.6 steps/s against 8.6 uncapped, each trainer
burning twice the CPU per step (benchmarks/bench.py, BENCHMARKS.md). Inter-op parallelism is
never set below 2: with 1, the parameter_server coordinator deadlocks (its closures wait on each
other; measured here). 0 means TensorFlow's own default everywhere.

Which tasks share a machine comes from the cluster: tasks whose hosts are the same string, or all
loopback. No TensorFlow import at module level: the budget is decided with the other flags.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from od_dist.cluster import duties, validate
from od_dist.cluster.spec import Cluster, Task

MIN_INTER_OP = 2  # 1 deadlocks the parameter_server coordinator


@dataclass(frozen=True)
class Threads:
    """Thread pool sizes for one task; 0 leaves TensorFlow's default (sized for the machine)."""

    intra_op: int = 0
    inter_op: int = 0
    data: int = 0  # tf.data's private thread pool per input pipeline

    def describe(self) -> str:
        def show(n):
            return str(n) if n else "default"

        return f"intra-op {show(self.intra_op)}, inter-op {show(self.inter_op)}, tf.data {show(self.data)}"


def machine_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def is_light(role: str, strategy: str) -> bool:
    """Tasks that mostly wait while the others compute (cluster/duties.py)."""
    return duties.of(strategy, role).is_light


def budget(cores: int, role: str, strategy: str, roles_here: list[str]) -> Threads:
    """The default budget of a `role` task on a machine of `cores` cores that runs the tasks
    `roles_here` (this one included). Pure: the tests call it with any machine."""
    if len(roles_here) <= 1:
        return Threads()  # alone: all of the machine, as TensorFlow sizes it
    if is_light(role, strategy):
        return Threads(1, MIN_INTER_OP)
    heavy = sum(1 for r in roles_here if not is_light(r, strategy))
    share = max(1, cores // max(1, heavy))
    return Threads(share, max(MIN_INTER_OP, share))


def _same_machine(a: str, b: str) -> bool:
    return a == b or (validate.is_loopback(a) and validate.is_loopback(b))


def roles_sharing(cluster: Cluster | None, task: Task | None) -> list[str]:
    """The roles of the cluster's tasks on `task`'s machine, this one included."""
    if cluster is None or task is None:
        return ["single"]
    return [t.role for t in cluster.tasks() if _same_machine(t.address.host, task.address.host)]


def resolve(
    cluster: Cluster | None,
    task: Task | None,
    strategy: str,
    intra_op: int | None = None,
    inter_op: int | None = None,
    data: int | None = None,
    cores: int | None = None,
) -> Threads:
    """This task's threads: each flag the user gave (None: not given) over the default budget."""
    auto = budget(
        cores or machine_cores(), task.role if task else "single", strategy, roles_sharing(cluster, task)
    )
    return Threads(
        auto.intra_op if intra_op is None else intra_op,
        auto.inter_op if inter_op is None else inter_op,
        auto.data if data is None else data,
    )


def apply(threads: Threads, label: str) -> Threads:
    """Sets TensorFlow's pools before it initialises and prints what TensorFlow now reports.

    The environment variables reach every pool this process creates, the in-process servers'
    too; tf.config.threading sets the eager context's. Must run before any op or device query.
    """
    if threads.intra_op:
        os.environ["TF_NUM_INTRAOP_THREADS"] = str(threads.intra_op)
    if threads.inter_op:
        os.environ["TF_NUM_INTEROP_THREADS"] = str(threads.inter_op)
    import tensorflow as tf

    if threads.intra_op:
        tf.config.threading.set_intra_op_parallelism_threads(threads.intra_op)
    if threads.inter_op:
        tf.config.threading.set_inter_op_parallelism_threads(threads.inter_op)
    applied = Threads(
        tf.config.threading.get_intra_op_parallelism_threads(),
        tf.config.threading.get_inter_op_parallelism_threads(),
        threads.data,
    )
    print(f"{label}: threads {applied.describe()} ({machine_cores()} cores)", flush=True)
    return applied


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
