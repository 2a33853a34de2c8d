"""Which cluster and which task this process is, decided once from flags (or TF_CONFIG) and frozen."""

from __future__ import annotations

import errno
import os
import sys
import tempfile
from dataclasses import dataclass

from od_dist.cluster import duties as duties_mod
from od_dist.cluster import hostport, messages, placement, validate
from od_dist.cluster import spec as cluster_mod
from od_dist.cluster.spec import Cluster, InvalidCluster, Task
from od_dist.host import cpu_budget
from od_dist.protocol.peers import LOST_PEER_TIMEOUT_S

# multi_worker_mirrored all-reduces the gradients in this many packs by default (--all_reduce_packs):
# each pack starts as soon as its gradients are computed, so the communication overlaps the rest of
# the backward pass instead of following it. TensorFlow's default is one pack. Two 0.6-core machines
# at 100 Mbit/s: 38.8 examples/s with one pack, 45.9 with 4 (benchmarks/scaling.py, BENCHMARKS.md).
ALL_REDUCE_PACKS = 4

# --all_reduce_dtype: what multi_worker_mirrored sends of each gradient. bfloat16 halves the bytes
# of every all-reduce; it keeps float32's exponent, so no sum overflows or flushes to zero (float16
# would need loss scaling on this path), and its 8 significant bits round each element by at most
# 0.4 %, far below the noise of a minibatch's gradient. Variables and the optimizer stay float32.
ALL_REDUCE_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class TaskConfig:
    cluster: Cluster | None  # None: one machine, no cluster
    task: Task | None  # None when no single task is this machine (see `here`), or no cluster
    source: str  # the cluster file, "TF_CONFIG", or "" for one machine
    machine_note: str  # how this machine was matched, for the summary
    # With `several` and no --role: the entries of this machine when it holds more than one (every
    # task of a loopback cluster); `od-dist train` starts them all, as `launch` does.
    here: tuple[Task, ...] = ()
    # SIGTERM reaches every task of the job at once (a Slurm step): servers outlive the master's save
    term_to_all: bool = False


def public_problems(cluster: Cluster, allow_public: bool, unchecked: list[str]) -> list[str]:
    """The public-address rule, with the cluster's host names resolved where they resolve. A name
    that resolves to nothing here is unchecked: a line saying so is added to `unchecked`, for the
    caller to `warn` once the input is accepted (refused input gets its one message)."""
    if allow_public:
        return []
    from od_dist.cluster import hostinfo

    resolved = hostinfo.resolve_names(cluster)
    unchecked += placement.unchecked_names(cluster, resolved)
    return placement.check_public(cluster, allow_public, resolved)


def warn(lines: list[str]) -> None:
    for line in lines:
        print(f"od-dist: warning: {line}", file=sys.stderr, flush=True)


def load_cluster(path: str, allow_public: bool, unchecked: list[str]) -> Cluster:
    """A cluster file, validated, with the public-address rule applied (`unchecked`: as for
    public_problems)."""
    cluster = cluster_mod.load(path)
    problems = public_problems(cluster, allow_public, unchecked)
    if problems:
        raise InvalidCluster(problems, path)
    return cluster


def select(
    cluster_path: str | None,
    role: str | None,
    index: int | None,
    allow_public: bool,
    require_task: bool = True,
    allow_none: bool = False,
    machine=None,
    several: bool = False,
) -> TaskConfig:
    """Loads the cluster from --cluster (else TF_CONFIG) and picks this process's task.

    Raises InvalidCluster with every problem found. `machine` is a hostinfo.ThisMachine (tests
    pass their own); it is only looked up when the host check needs it. `several`: without --role,
    a machine that holds several entries is accepted, its tasks in `here`. The names the
    public-address rule could not check are said once the task is chosen: refused input gets its
    one message.
    """
    unchecked: list[str] = []
    selected = _select(
        cluster_path, role, index, allow_public, require_task, allow_none, machine, unchecked, several
    )
    warn(unchecked)
    return selected


def _select(
    cluster_path, role, index, allow_public, require_task, allow_none, machine, unchecked, several=False
) -> TaskConfig:
    role = validate.normalize_role(role)
    if index is not None and role is None:
        raise InvalidCluster([messages.problem("--index", index, "given without --role", "add --role")])
    tf_config = os.environ.get("TF_CONFIG", "").strip()
    if cluster_path:
        source = cluster_path
        cluster = load_cluster(cluster_path, allow_public, unchecked)
    elif tf_config:
        # An orchestrator (Kubernetes TFJob) names the task itself; its pod addresses are service
        # names, not this machine's own, so there is no host check.
        source = "TF_CONFIG"
        cluster, tf_role, tf_index = cluster_mod.from_tf_config(tf_config)
        if role is not None and (role, index if index is not None else 0) != (tf_role, tf_index):
            raise InvalidCluster(
                [
                    messages.problem(
                        "--role",
                        f"{role} {index if index is not None else 0}",
                        f"TF_CONFIG says this task is {tf_role} {tf_index}",
                        "leave --role/--index out, or unset TF_CONFIG",
                    )
                ]
            )
        problems = public_problems(cluster, allow_public, unchecked)
        if problems:
            raise InvalidCluster(problems, source)
        return TaskConfig(cluster, cluster.task(tf_role, tf_index), source, "named by TF_CONFIG")
    elif allow_none and role is None:
        return TaskConfig(None, None, "", "one machine, no cluster")
    elif allow_none:
        # Without a cluster this process would train alone, into a model_dir that may be the real
        # job's: a role given means a cluster was meant.
        raise InvalidCluster(
            [
                messages.problem(
                    "--role",
                    role if index is None else f"{role} {index}",
                    "given without --cluster, and TF_CONFIG is not set: there is no cluster to take this role in",
                    "pass --cluster FILE (the job's cluster file), or leave --role/--index out to train on one machine",
                )
            ]
        )
    else:
        raise InvalidCluster(
            [
                messages.problem(
                    "--cluster",
                    "",
                    "no cluster file given and TF_CONFIG is not set",
                    "pass --cluster clusters/local.yaml (or set TF_CONFIG)",
                )
            ]
        )

    if machine is None and not cluster.loopback_only():
        from od_dist.cluster import hostinfo

        machine = hostinfo.this_machine()
    is_local = machine.is_local if machine else (lambda host: hostport.is_loopback(host))
    if role is None:
        if cluster.loopback_only() and not require_task:
            return TaskConfig(cluster, None, source, "loopback-only cluster: every task runs on this machine")
        mine = cluster.tasks_on(is_local)
        if several and (len(mine) > 1 or cluster.loopback_only()):
            how = (
                "loopback-only cluster: every task runs on this machine"
                if cluster.loopback_only()
                else f"inferred from this machine's addresses ({machine.describe()})"
            )
            return TaskConfig(
                cluster, None, source, f"{how}; `od-dist train` without --role starts them all", mine
            )
        task, problems = placement.infer_task(cluster, is_local)
        if problems and not require_task and not cluster.tasks_on(is_local):
            # `validate` checks a file from any machine (a laptop before copying it out); only
            # the commands that run a task need this machine in it.
            return TaskConfig(
                cluster,
                None,
                source,
                f"none of its entries (its addresses: {machine.describe()}); the tasks run on the "
                "machines the file lists",
            )
        if problems:
            raise InvalidCluster(problems, source)
        return TaskConfig(
            cluster, task, source, f"inferred from this machine's addresses ({machine.describe()})"
        )
    index = 0 if index is None else index
    problems = placement.check_task(cluster, role, index)
    if not problems:
        problems = placement.check_this_machine(cluster, role, index, is_local)
    if problems:
        raise InvalidCluster(problems, source)
    note = (
        "loopback-only cluster: every task runs on this machine"
        if cluster.loopback_only()
        else f"an address of this machine ({machine.describe()})"
    )
    return TaskConfig(cluster, cluster.task(role, index), source, note)


def model_dir_problem(model_dir: str) -> str | None:
    """Why this process cannot create or write `model_dir` (its checkpoints, summaries and logs),
    or None. Probed in the folder itself, or the nearest one above it that exists (created on the
    way), with a real file: permission bits do not tell a read-only mount or /proc. Remote paths
    (gs://...) are TensorFlow's to open."""
    if "://" in model_dir:
        return None
    folder = os.path.abspath(model_dir)
    while not os.path.lexists(folder):
        folder = os.path.dirname(folder)
    where = messages.shown(folder, messages.PATH_SHOWN_MAX)
    if not os.path.isdir(folder):
        return f"'{where}' is a file, not a folder"
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM):
            return f"permission denied: this user may not write in '{where}'"
        if e.errno == errno.EROFS:
            return f"'{where}' is on a read-only file system"
        if e.errno == errno.ENOENT:  # the folder exists, yet takes no new file: /proc, /sys
            return f"'{where}' takes no new files (a virtual file system)"
        return f"'{where}': {e.strerror or e}"
    return None


@dataclass(frozen=True)
class TrainConfig:
    """Everything `od-dist train` needs, checked before TensorFlow is imported."""

    selected: TaskConfig
    pipeline: str | None
    model_dir: str | None
    num_clones: int
    clone_on_cpu: bool
    params_override: str | None
    wait_timeout: int
    threads: cpu_budget.Threads = cpu_budget.Threads()  # this task's CPU thread budget
    fixed_replica_batch: bool = False  # --fixed_replica_batch
    all_reduce_packs: int = ALL_REDUCE_PACKS  # --all_reduce_packs (multi_worker_mirrored)
    replicas: int = 1  # replicas in sync in the whole job (replicas_in_job)
    lost_peer_timeout: int = LOST_PEER_TIMEOUT_S  # --lost_peer_timeout (multi_worker_mirrored)
    all_reduce_dtype: str = "float32"  # --all_reduce_dtype (multi_worker_mirrored)
    ps_pack_gradients: bool = True  # --ps_pack_gradients (parameter_server)

    @property
    def role(self) -> str:
        """This process's role; 'single' without a cluster."""
        return self.selected.task.role if self.selected.task else "single"

    @property
    def strategy_name(self) -> str:
        return self.selected.cluster.strategy if self.selected.cluster else "mirrored"

    @property
    def duties(self) -> duties_mod.Duties:
        """What this task does (cluster/duties.py)."""
        return duties_mod.of(self.strategy_name, self.role)

    @property
    def in_sync(self) -> bool:
        """A trainer whose replicas step together with every other's (not under parameter_server)."""
        return self.duties.is_trainer and self.duties.runs_replicas

    @property
    def is_coordinator(self) -> bool:
        return self.duties.is_coordinator

    @property
    def is_server(self) -> bool:
        return self.duties.is_server


def replicas_in_job(cluster: Cluster | None, num_clones: int | None) -> int:
    """Replicas in sync: the sum of every trainer's clones. `num_clones` is the --num_clones given
    on the command line (None: not given): every trainer gets it, since one launch line (launch,
    the generated scripts, a pod template) serves every machine; else each host's num_clones from
    the cluster file. One machine without a cluster: its own clones."""
    if cluster is None:
        return num_clones or 1
    trainers, clones = cluster.trainer_clones
    return num_clones * trainers if num_clones else clones


def train_config(
    selected: TaskConfig,
    pipeline: str | None,
    model_dir: str | None,
    num_clones: int | None,
    clone_on_cpu: bool,
    params_override: str | None,
    wait_timeout: int,
    intra_op_threads: int | None = None,
    inter_op_threads: int | None = None,
    data_threads: int | None = None,
    fixed_replica_batch: bool = False,
    all_reduce_packs: int = ALL_REDUCE_PACKS,
    lost_peer_timeout: int = LOST_PEER_TIMEOUT_S,
    files_here: bool = True,
    all_reduce_dtype: str = "float32",
    ps_pack_gradients: bool = True,
) -> TrainConfig:
    """The task's configuration, every flag checked (InvalidCluster). `files_here`: the pipeline
    file and model_dir are checked on this machine (not by `scripts`/`k8s`, whose tasks run
    elsewhere)."""
    cluster, task = selected.cluster, selected.task
    replicas = replicas_in_job(cluster, num_clones)
    if num_clones is None:
        num_clones = cluster.clones_for(task.address.host) if cluster and task else 1
    strategy = cluster.strategy if cluster else "mirrored"
    threads = cpu_budget.resolve(cluster, task, strategy, intra_op_threads, inter_op_threads, data_threads)
    config = TrainConfig(
        selected,
        pipeline,
        model_dir,
        num_clones,
        clone_on_cpu,
        params_override,
        wait_timeout,
        threads,
        fixed_replica_batch,
        all_reduce_packs,
        replicas,
        lost_peer_timeout,
        all_reduce_dtype,
        ps_pack_gradients,
    )
    problems = []
    if fixed_replica_batch and strategy == validate.PARAMETER_SERVER:
        problems.append(
            messages.problem(
                "--fixed_replica_batch",
                True,
                "parameter_server runs each step's whole batch on one worker (no replicas in sync)",
                "remove the flag, or use multi_worker_mirrored",
            )
        )
    if inter_op_threads == 1 and strategy == validate.PARAMETER_SERVER:
        problems.append(
            messages.problem(
                "--inter_op_threads",
                1,
                "deadlocks the parameter_server coordinator",
                f"use {cpu_budget.MIN_INTER_OP} or more, or 0 for TensorFlow's default",
            )
        )
    if not config.is_server:  # servers run no pipeline; the same launch line still works for them
        for flag, value in (("--pipeline", pipeline), ("--model_dir", model_dir)):
            if not value:
                problems.append(
                    messages.problem(flag, "", f"required for the {config.role} role", f"pass {flag}=...")
                )
        why = model_dir_problem(model_dir) if model_dir and files_here else None
        if why:
            problems.append(
                messages.problem(
                    "--model_dir",
                    model_dir,
                    f"cannot be created or written: {why}",
                    "pass a folder this user can write (on every machine whose task writes it)",
                    messages.PATH_SHOWN_MAX,
                )
            )
        if files_here and pipeline and not os.path.isfile(pipeline):
            problems.append(
                messages.problem(
                    "--pipeline",
                    pipeline,
                    "no such file",
                    "pass a pipeline YAML, e.g. pipelines/shapes_retinanet.yaml",
                    messages.PATH_SHOWN_MAX,
                )
            )
    if cluster and cluster.min_trainers and strategy == validate.PARAMETER_SERVER:
        # The coordinator's lease (host/lease.py) comes from --lost_peer_timeout: refused when
        # shorter than two of its looks, rather than a healthy coordinator killed every few seconds.
        from od_dist.host.lease import lease_problem

        lease = lease_problem(lost_peer_timeout)
        if lease:
            problems.append(lease)
    if cluster and clone_on_cpu and num_clones > 1:
        # Both cluster strategies place replicas on GPUs only (one CPU device per task).
        problems.append(
            messages.problem(
                "--num_clones",
                num_clones,
                f"--clone_on_cpu runs several replicas only on one machine; "
                f"{cluster.strategy} uses one CPU device per task",
                "use --num_clones=1, GPUs, or no --cluster",
            )
        )
    if problems:
        raise InvalidCluster(problems, selected.source)
    return config
