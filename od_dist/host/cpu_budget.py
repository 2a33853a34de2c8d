"""CPU thread budgets for tasks that share a machine.

TensorFlow sizes its thread pools for the whole machine in every process: four tasks of a loopback
cluster on two cores start four pools of two intra-op threads each and spend their time
preempting each other (torchrun sets OMP_NUM_THREADS=1 for its local processes for the same
reason). So a task that knows how many tasks share its machine takes its share of the cores:

- tasks that mostly wait (a ps, the parameter_server coordinator, an evaluator between
  checkpoints) get 1 intra-op thread and 2 inter-op threads;
- the tasks that compute (workers; the master under multi_worker_mirrored) split the cores
  evenly between their intra-op pools;
- a task alone on its machine keeps TensorFlow's defaults (all cores), unless a CPU limit (a
  container's, a Kubernetes pod's `limits.cpu`: a cgroup CPU quota) gives it fewer cores than it
  may run on: TensorFlow sizes its pools by the cores it may run on and ignores the limit, so its
  threads outnumber the CPU time they get, wait for each other, and waste the rest spinning. The
  limit's whole cores (at least 1) then size the pools. One trainer on a machine capped at 0.6
  cores: 21.8 examples/s with TensorFlow's pools, 36.0 with 1 intra-op thread
  (benchmarks/scaling.py, BENCHMARKS.md). A task that may run on one core only (bound to it:
  Slurm's task/affinity, taskset) gets 1 intra-op and 2 inter-op threads, where TensorFlow would
  size its inter-op pool at 1.

tf.data keeps its own default everywhere: capping its private pool at one thread made a
multi_worker_mirrored pair on two cores run at 4.6 steps/s against 8.6 uncapped, each trainer
burning twice the CPU per step (benchmarks/bench.py, BENCHMARKS.md). Inter-op parallelism is
never set below 2: with 1, the parameter_server coordinator deadlocks (its closures wait on each
other; measured here). 0 means TensorFlow's own default everywhere.

Which tasks share a machine comes from the cluster: tasks whose hosts are the same string, or all
loopback. No TensorFlow: the budget is decided with the other flags, before TensorFlow starts;
od_dist/task/threads.py applies it inside the task.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from od_dist.cluster import duties
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


def runnable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which cpusets and taskset narrow): what
    TensorFlow sizes its pools by."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _mounts(root: str) -> list[tuple[str, str, str, set[str]]]:
    """(hierarchy path mounted, mount point, fs type, super options) of each cgroup mount."""
    found = []
    with open(os.path.join(root, "proc/self/mountinfo")) as f:
        for line in f:
            head, _, tail = line.partition(" - ")
            fields, kind = head.split(), tail.split()
            if len(fields) >= 5 and len(kind) >= 3 and kind[0] in ("cgroup", "cgroup2"):
                found.append((fields[3], fields[4], kind[0], set(kind[2].split(","))))
    return found


def _quota(folder: str, version: int) -> float | None:
    """One cgroup's CPU quota in cores; None when it has none."""
    try:
        if version == 2:
            with open(os.path.join(folder, "cpu.max")) as f:
                quota, period = f.read().split()[:2]
        else:
            with open(os.path.join(folder, "cpu.cfs_quota_us")) as f:
                quota = f.read().strip()
            with open(os.path.join(folder, "cpu.cfs_period_us")) as f:
                period = f.read().strip()
        if quota in ("max", "-1") or int(period) <= 0:
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        return None


def cpu_limit(root: str = "/") -> float | None:
    """This process's CPU limit in cores (its cgroup's quota over its period, the tightest of its
    cgroup and their parents, cgroup v1 or v2); None without one. `root`: where /proc and the
    cgroup mounts are (the tests give a folder that looks like one)."""
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as f:
            groups = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
        mounts = _mounts(root)
    except OSError:
        return None
    limits = []
    for _, controllers, path in groups:
        version = 2 if controllers == "" else 1
        if version == 1 and "cpu" not in controllers.split(","):
            continue
        for mounted, point, kind, options in mounts:
            if (kind == "cgroup2") != (version == 2) or (version == 1 and "cpu" not in options):
                continue
            inside = os.path.relpath(path, mounted) if path.startswith(mounted) else "."
            top = os.path.join(root, point.lstrip("/"))
            folder = os.path.normpath(os.path.join(top, inside))
            while True:  # a parent's quota caps its children too
                limits.append(_quota(folder, version))
                if folder == top or not folder.startswith(top):
                    break
                folder = os.path.dirname(folder)
    limits = [q for q in limits if q is not None]
    return min(limits) if limits else None


def cores_within(limit: float | None, runnable: int) -> int:
    """The cores a process has: those it may run on (`runnable`), no more than its CPU limit's
    whole cores (at least 1)."""
    return min(runnable, max(1, int(limit))) if limit is not None else runnable


def machine_cores() -> int:
    """This process's cores (cores_within)."""
    return cores_within(cpu_limit(), runnable_cores())


def mostly_waits(role: str, strategy: str) -> bool:
    """Tasks that mostly wait while the others compute (cluster/duties.py)."""
    return duties.of(strategy, role).mostly_waits


def budget(cores: int, role: str, strategy: str, roles_here: list[str], limited: bool = False) -> Threads:
    """The default budget of a `role` task on a machine of `cores` cores that runs the tasks
    `roles_here` (this one included); `limited`: the cores are a CPU limit's, fewer than
    TensorFlow sees. Pure: the tests call it with any machine."""
    if len(roles_here) <= 1:
        # Alone: all of the machine, as TensorFlow sizes it, unless a CPU limit makes it smaller,
        # or it has one core (a task bound to it: Slurm's task/affinity, taskset), where
        # TensorFlow's own inter-op pool would be of 1 thread.
        return Threads(cores, max(MIN_INTER_OP, cores)) if limited or cores < MIN_INTER_OP else Threads()
    if mostly_waits(role, strategy):
        return Threads(1, MIN_INTER_OP)
    heavy = sum(1 for r in roles_here if not mostly_waits(r, strategy))
    share = max(1, cores // max(1, heavy))
    return Threads(share, max(MIN_INTER_OP, share))


def roles_sharing(cluster: Cluster | None, task: Task | None) -> list[str]:
    """The roles of the cluster's tasks on `task`'s machine, this one included."""
    if cluster is None or task is None:
        return ["single"]
    return list(cluster.roles_on(task.address.host))


def resolve(
    cluster: Cluster | None,
    task: Task | None,
    strategy: str,
    intra_op: int | None = None,
    inter_op: int | None = None,
    data: int | None = None,
    cores: int | None = None,
) -> Threads:
    """This task's threads: each flag the user gave (None: not given) over the default budget.
    `cores`: the machine's (the tests'); by default this process's, a CPU limit's if it has one."""
    limited = False
    if cores is None:
        runnable = runnable_cores()
        cores = cores_within(cpu_limit(), runnable)
        limited = cores < runnable
    auto = budget(cores, task.role if task else "single", strategy, roles_sharing(cluster, task), limited)
    return Threads(
        auto.intra_op if intra_op is None else intra_op,
        auto.inter_op if inter_op is None else inter_op,
        auto.data if data is None else data,
    )
