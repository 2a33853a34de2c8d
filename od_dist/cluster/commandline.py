"""The `od-dist train` command line of one task of a job, built here for every path that starts
tasks: `launch` (its children), `train --max_restarts` (its child), `scripts` (a script per machine)
and `k8s` (a container per role: a TFJob replica type or a JobSet replicated job). So a flag the user gave reaches every task the same way,
and what `launch` checks before any task starts is what each task is started with.

`flags` are the job's `od-dist train` flags as the user set them (`--name=value`, `--name`,
`--noname`; cli/flags.py turns its parsed flags into them), without the task's own place in the cluster
(TASK_FLAGS), which is added here. No TensorFlow here.
"""

from __future__ import annotations

from collections.abc import Sequence

from od_dist.cluster.spec import Cluster, Task

TRAIN = "train"
TASK_FLAGS = ("cluster", "role", "index")  # where a task is in the cluster: never the job's flags
NUM_CLONES = "--num_clones="


def role_flags(flags: Sequence[str], cluster: Cluster | None, role: str | None) -> list[str]:
    """The job's flags as a task of `role` gets them: --num_clones only where replicas run
    (Cluster.runs_replicas); a ps or a parameter_server master starts whatever it says."""
    if cluster is None or role is None or cluster.runs_replicas(role):
        return list(flags)
    return [a for a in flags if not a.startswith(NUM_CLONES)]


def train_args(
    flags: Sequence[str],
    cluster: Cluster | None = None,
    task: Task | None = None,
    cluster_path: str | None = None,
    index: str | None = None,
) -> list[str]:
    """`train` and its arguments for `task`: the cluster file and the task's role and index when
    the task comes from a file (a TF_CONFIG task, such as a TFJob pod, finds its own; one machine
    without a cluster has none), then the job's flags as its role gets them. `index` stands for the
    index of every task of the role in one template (a JobSet pod's `$(VAR)`, which Kubernetes fills
    in from the pod): the role and that index, the cluster coming from TF_CONFIG."""
    where = []
    if cluster_path is not None and task is not None:
        where = [f"--cluster={cluster_path}", f"--role={task.role}", f"--index={task.index}"]
    elif index is not None and task is not None:
        where = [f"--role={task.role}", f"--index={index}"]
    return [TRAIN, *where, *role_flags(flags, cluster, task.role if task else None)]


def machine_args(
    flags: Sequence[str], cluster: Cluster, tasks: Sequence[Task], cluster_path: str
) -> list[str]:
    """`train` and its arguments for the machine that holds `tasks` (a generated script): one task's
    own line, whose --role/--index has the machine checked to be that entry; for several, no role:
    `od-dist train` then starts every entry of its machine under one supervisor, as `launch` does,
    each with its role's flags (--num_clones kept when any of them runs replicas)."""
    if len(tasks) == 1:
        return train_args(flags, cluster, tasks[0], cluster_path)
    keeps = next((t.role for t in tasks if cluster.runs_replicas(t.role)), tasks[0].role)
    return [TRAIN, f"--cluster={cluster_path}", *role_flags(flags, cluster, keeps)]
