"""`od-dist scripts`, `k8s` and `slurm`: write what starts the job elsewhere (a script per machine, a
Kubernetes manifest, a Slurm batch script). Renderers: no TensorFlow."""

from __future__ import annotations

import os
import sys

from absl import flags

from od_dist.cli.checks import batch_split
from od_dist.cli.flags import (
    LAUNCH_MAX_RESTARTS,
    ONE_TASK,
    check_task_args,
    define_out,
    define_restart_flags,
    define_train_flags,
    passed_on_args,
    require,
    restart_args,
)
from od_dist.cli.registry import UsageError, command
from od_dist.cluster import commandline
from od_dist.protocol import exit_codes


def _render_input(fv, what: str, warn_unresolved: bool = True, elastic: bool = False):
    """The cluster and the passed-on train flags for a renderer; checks what every task will need.
    `warn_unresolved`: say which hosts do not resolve here (not for Slurm: its tasks check the
    nodes' addresses). `elastic`: whether what it writes runs min_trainers' smaller groups (the
    scripts; a JobSet's or an srun step's group is fixed, which it says in one line)."""
    import dataclasses

    from od_dist.host import config

    if fv.role is not None or fv.index is not None:
        raise UsageError(f"--role/--index: {what} covers every task of the cluster; leave them out")
    require(fv, "cluster", "pipeline", "model_dir")
    unchecked: list[str] = []
    cluster = config.load_cluster(fv.cluster, fv.allow_public_addresses, unchecked)
    passed_on = passed_on_args(fv)
    for task in cluster.tasks():  # as launch checks them; the pipeline is looked for on each machine
        check_task_args(
            cluster, task, fv.cluster, commandline.train_args(passed_on, cluster, task), files_here=False
        )
    fixed = cluster if elastic else dataclasses.replace(cluster, min_trainers=None)
    if os.path.isfile(fv.pipeline) and not fv.fixed_replica_batch:  # a batch the trainers would refuse
        batch_split(fixed, fv.pipeline, fv.params_override, fv.num_clones)
    if warn_unresolved:
        config.warn(unchecked)  # once the input is accepted: refused input gets its one message
    if cluster.min_trainers and not elastic:
        print(
            f"od-dist {what}: warning: min_trainers {cluster.min_trainers} in {fv.cluster}: {what} does "
            f"not support elastic training; its job trains with all {len(cluster.members())} trainers "
            "or none (a lost one restarts the job); for elastic, use `od-dist scripts`",
            file=sys.stderr,
        )
    return cluster, passed_on


def _script_input(fv, what: str, out: str, warn_unresolved: bool = True, elastic: bool = False):
    """`scripts` and `slurm`: _render_input, --out required (`out`: what to pass), and the restart
    flags, which each task's own supervisor takes."""
    cluster, passed_on = _render_input(fv, what, warn_unresolved, elastic)
    require(fv, "out", fix=f"--out={out}")
    return cluster, passed_on + restart_args(fv)


def define_job_name(fv: flags.FlagValues) -> None:
    """`k8s` and `slurm`: the name the job gets on its scheduler."""
    flags.DEFINE_string("name", None, "The job's name. Default: od-dist-<cluster file name>.", flag_values=fv)


def define_scripts_flags(fv: flags.FlagValues) -> None:
    define_train_flags(fv)
    define_restart_flags(fv, LAUNCH_MAX_RESTARTS)  # written into every script: each machine heals itself
    define_out(fv, "Directory for the scripts and their README.md (created if missing).")
    flags.DEFINE_boolean(
        "at_boot",
        False,
        "Also what starts each machine's script at boot, without a person: a systemd unit "
        "(od-dist-<script>.service) per Linux machine, a Task Scheduler task file (od-dist-<script>.xml: "
        "no execution limit, no battery conditions) per Windows machine, and in the README the lines "
        "that install and remove them. Each machine needs an absolute hosts workdir (its script is "
        "copied there) and a user to run as: its hosts user, else --at_boot_user.",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "at_boot_user",
        None,
        "With --at_boot: the user the scripts run as at boot on every machine whose hosts entry in the "
        "cluster file names no user (systemd User=; schtasks /RU, which asks for the password). root "
        "or SYSTEM: the system account (root on Linux, SYSTEM on Windows). No default: --at_boot "
        "refuses a machine without a user.",
        flag_values=fv,
    )


@command(
    "scripts",
    "Write a launch script per machine (bash / cmd / PowerShell) and a README for the machines.",
    """
Writes, for every machine of the cluster, one script named after its tasks (<role>-<index>.sh,
ps-0_worker-0.sh for a machine holding two): .sh when its host is Linux, .cmd and .ps1 when it is
Windows, all three when its os is not declared (the cluster file's hosts: settings), plus
<out>/README.md: which machine runs which script and which tasks, the ports each machine opens to
which peers (firewall lines), that the pipeline's records must be on every trainer machine, the
`od-dist doctor` line that checks a machine, and that the order does not matter. Each script changes
to the host's workdir, activates its venv (or runs its python -m od_dist) and runs one
`od-dist train` with --cluster and the given train flags: with the task's --role/--index, or, on a
machine of several tasks, without them, so that it starts them all under one supervisor. Values are
quoted for each shell (spaces, &, %, ^, !, quotes, non-ASCII and Windows paths such as C:\\... and
\\\\server\\share\\... arrive intact); an absolute Linux path (--cluster, --pipeline, --model_dir)
for a Windows machine is refused (exit 2). A .cmd started by a double-click keeps its window open
after a failure. --at_boot also writes a systemd unit per Linux machine, a Task Scheduler task file
per Windows machine and, in the README, the lines that make each machine start its script at boot,
each run as the user its hosts entry names (user:), else --at_boot_user: never root or SYSTEM
unless named.

Example:
  od-dist scripts --cluster clusters/lan-example.yaml --pipeline pipelines/shapes_retinanet.yaml \\
      --model_dir runs/lan --out scripts/lan-example
""",
    define_scripts_flags,
    refused=ONE_TASK,
)
def cmd_scripts(fv) -> int:
    from od_dist.data import errors
    from od_dist.render import boot, quote, scripts

    if fv.at_boot_user is not None and not fv.at_boot:
        raise UsageError(f"--at_boot_user: {fv.at_boot_user}: given without --at_boot; pass --at_boot too")
    cluster, passed_on = _script_input(fv, "scripts", "DIR", elastic=True)
    at_boot = boot.AtBoot(fv.at_boot_user, fv.grace_period) if fv.at_boot else None
    boot_flags = ["--at_boot", *([f"--at_boot_user={fv.at_boot_user}"] if fv.at_boot_user else [])]
    try:
        command = " ".join(
            quote.sh(a)
            for a in [
                "od-dist",
                "scripts",
                f"--cluster={fv.cluster}",
                *passed_on,
                *(boot_flags if at_boot else []),
                f"--out={fv.out}",
            ]
        )
        written = scripts.write_scripts(
            cluster, fv.cluster, passed_on, fv.out, command, fv.wait_timeout, fv.max_restarts, at_boot
        )
    except (scripts.ScriptError, errors.DatasetError) as e:
        raise UsageError(str(e)) from None
    machines = len({t.address.host for t in cluster.tasks()})
    units = sum(p.endswith(".service") for p in written)
    tasks = sum(p.endswith(".xml") for p in written)
    count = len(written) - 1 - units - tasks
    print(
        f"wrote {count} script{'s' * (count != 1)}"
        f"{f', {units} systemd unit' + 's' * (units != 1) if units else ''}"
        f"{f', {tasks} Windows task file' + 's' * (tasks != 1) if tasks else ''} for {machines} "
        f"machine{'s' * (machines != 1)} and README.md to {fv.out}"
    )
    return exit_codes.OK


def define_k8s_flags(fv: flags.FlagValues) -> None:
    from od_dist.render import k8s

    define_train_flags(fv)
    flags.DEFINE_enum(
        "kind",
        k8s.KINDS[0],
        k8s.KINDS,
        "jobset: a JobSet (kubernetes-sigs/jobset), which Kueue can admit; tfjob: a Kubeflow TFJob "
        "(training-operator v1, no longer maintained).",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "image", None, "The container image, with od-dist installed (`od-dist` on PATH).", flag_values=fv
    )
    define_out(fv, "Write the manifest here instead of to stdout.")
    define_job_name(fv)
    flags.DEFINE_string(
        "namespace", None, "The Kubernetes namespace. Default: kubectl's current one.", flag_values=fv
    )
    flags.DEFINE_string(
        "queue",
        None,
        "Kueue's LocalQueue (label kueue.x-k8s.io/queue-name): the JobSet is created suspended and "
        "starts when Kueue admits it.",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "pvc",
        None,
        "The PersistentVolumeClaim, which you create (ReadWriteMany), that the pods mount for "
        "model_dir. Default: <name>-model-dir.",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "mount_path",
        "/mnt/od-dist",
        "Where the volume is mounted in the pods; a relative --model_dir is placed on it.",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "grace_period",
        120,
        "The pods' terminationGracePeriodSeconds: the time between "
        "SIGTERM and SIGKILL in which a trainer finishes its loop and saves a checkpoint "
        "(Kubernetes' default, 30 s, is often less than one loop plus a save); make it "
        "longer than one trainer.steps_per_loop loop plus a save.",
        lower_bound=1,
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "max_restarts",
        LAUNCH_MAX_RESTARTS,
        "Restarts after a task is lost (exit 130, 137, 138, 143), by TensorFlow's rules: a "
        "parameter_server worker (and the evaluator) alone, up to N times each; anything else every "
        "pod together, up to N times (JobSet failurePolicy.maxRestarts; a TFJob's backoffLimit).",
        lower_bound=0,
        flag_values=fv,
    )
    flags.DEFINE_string(
        "cpu",
        None,
        "CPU each pod requests: 4 (every role) or 2,worker=8 (every role 2, workers 8).",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "memory",
        None,
        "Memory each pod requests and is limited to: 16Gi, or 4Gi,worker=32Gi (as --cpu).",
        flag_values=fv,
    )
    flags.DEFINE_boolean(
        "gpus",
        False,
        "The trainers run on GPUs: each trainer pod asks for num_clones nvidia.com/gpu (without it, "
        "only when num_clones > 1 and not --clone_on_cpu).",
        flag_values=fv,
    )


@command(
    "k8s",
    "Write a Kubernetes JobSet (or a Kubeflow TFJob) for the cluster (stdout, or --out).",
    """
Writes a JobSet (jobset.x-k8s.io/v1alpha2): one replicated job per role of the cluster file, a pod
per task running `od-dist train --role R --index I`, the index being the pod's own (its Job's
completion index), the cluster of the pods' DNS names with the file's ports (TF_CONFIG), success
when the master (and the evaluator) is done, restarts after TensorFlow's failure rules within
--max_restarts, a permanent error failing it at once, and --model_dir on the PersistentVolumeClaim
--pvc, which you create (ReadWriteMany; od-dist does not write one).
--queue hands it to Kueue. --kind tfjob writes the Kubeflow TFJob (kubeflow.org/v1) instead.

Example:
  od-dist k8s --cluster clusters/lan-example.yaml --pipeline pipelines/shapes_retinanet.yaml \\
      --model_dir runs/lan --image registry.example/od-dist:latest --out jobset.yaml
""",
    define_k8s_flags,
    refused=ONE_TASK,
)
def cmd_k8s(fv) -> int:
    from od_dist.data import errors, writing
    from od_dist.render import k8s

    cluster, passed_on = _render_input(fv, "k8s")
    require(fv, "image", fix="--image=REGISTRY/IMAGE:TAG (od-dist installed in it)")

    roles = [r for r in k8s.ROLES if cluster.tasks_of(r)]
    restarts = k8s.Restarts.from_policy(fv.max_restarts, cluster.strategy, roles)
    try:
        resources = k8s.Resources(k8s.per_role("cpu", fv.cpu), k8s.per_role("memory", fv.memory), fv.gpus)
        text = k8s.render(
            cluster,
            fv.cluster,
            fv.image,
            passed_on,
            restarts,
            kind=fv.kind,
            name=fv.name,
            namespace=fv.namespace,
            pvc=fv.pvc,
            mount_path=fv.mount_path,
            grace_period=fv.grace_period,
            resources=resources,
            queue=fv.queue,
        )
        if fv.out:
            writing.write_file(fv.out, text)
    except (k8s.K8sError, errors.DatasetError) as e:
        raise UsageError(str(e)) from None
    missing = [f"--{n}" for n in ("cpu", "memory") if fv.queue and not fv[n].value]
    if missing:
        # Kueue charges a workload what its pods request: requesting none, it fits any quota.
        print(
            f"od-dist k8s: warning: --queue {fv.queue} without {' and '.join(missing)}: the pods request "
            "none, so Kueue admits the job against its quota as using none; pass "
            f"{' and '.join(m + '=...' for m in missing)}",
            file=sys.stderr,
        )
    if fv.out:
        print(f"wrote {fv.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return exit_codes.OK


def define_slurm_flags(fv: flags.FlagValues) -> None:
    define_train_flags(fv)
    # 0: Slurm's requeue (or sending the job again) restarts the whole job; N > 0 gives each task its
    # own supervisor inside the allocation.
    define_restart_flags(fv, 0)
    define_out(fv, "The batch script to write (e.g. job.sbatch).")
    define_job_name(fv)
    flags.DEFINE_string("partition", None, "#SBATCH --partition.", flag_values=fv)
    flags.DEFINE_string("time", None, "#SBATCH --time: the time limit, e.g. 2-00:00:00.", flag_values=fv)
    flags.DEFINE_integer(
        "cpus_per_task",
        None,
        "Cores per task: #SBATCH --cpus-per-task, and SRUN_CPUS_PER_TASK for the step (srun does not "
        "take sbatch's by itself). Default: Slurm's (one core on most clusters, where tasks are bound "
        "to their cores): give a trainer the cores its input pipeline needs.",
        lower_bound=1,
        flag_values=fv,
    )
    flags.DEFINE_string("mem", None, "#SBATCH --mem: memory per node, e.g. 64G.", flag_values=fv)
    flags.DEFINE_integer(
        "gpus_per_trainer",
        None,
        "GPUs each trainer (a task that runs replicas) is given; a ps, a parameter_server master and "
        "an evaluator get none. Default: its num_clones (none with --clone_on_cpu); 0 for nodes "
        "without GPUs. Each node is asked for the GPUs of its trainers (#SBATCH --gres=gpu:N).",
        lower_bound=0,
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "port_base",
        20000,
        "The job's tasks listen on ports of their own, J = port_base + (job id % S) x P + their "
        "place (P: the job's ports, S: how many such blocks fit below 65536), so that jobs sharing "
        "a node never share a port. 0: the cluster file's ports, and the job asks for whole nodes "
        "(--exclusive).",
        lower_bound=0,
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "nodes",
        None,
        "Without --cluster: the job's nodes, one trainer each under multi_worker_mirrored (workers "
        "on the first, the master on the last: what docs/scaling.md recommends for GPUs), "
        "written to a cluster file beside --out (<out>.cluster.yaml), said on the console.",
        lower_bound=1,
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "gpus_per_node",
        None,
        "With --nodes: the GPUs of each node, all its trainer's (num_clones); 0 trains on the CPU.",
        lower_bound=0,
        flag_values=fv,
    )
    flags.DEFINE_list(
        "then",
        [],
        "What the job runs after training, once the master finished (exit 0), on the first node: "
        "eval (the COCO line, `od-dist eval`), export (a SavedModel in <model_dir>/exported, "
        "`od-dist export`), or both: --then=eval,export.",
        flag_values=fv,
    )
    flags.DEFINE_boolean(
        "requeue",
        True,
        "At the warning before the time limit (--signal, 120 s ahead) the tasks save a checkpoint "
        "and the job requeues itself (scontrol requeue), going on from it until training is done; a "
        "job that finished or failed is never requeued. --norequeue: the job ends there, exit 143.",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "address",
        "{node}",
        "The address each task is reached at, {node} standing for its node's name: {node}-ib for a "
        "fast network with its own names. The public-address rule is checked on these addresses by "
        "each task before any TensorFlow server starts (--allow_public_addresses).",
        flag_values=fv,
    )
    flags.DEFINE_multi_string(
        "sbatch", None, "More #SBATCH lines, each an sbatch option: --sbatch=--account=lab.", flag_values=fv
    )


@command(
    "slurm",
    "Write a Slurm batch script for the cluster: one srun step, a task per entry.",
    """
Writes a batch script for sbatch: the cluster file's roles and counts as one srun step, a task per
entry (the file's machines become the nodes of the allocation, their entries the tasks per node),
each running `od-dist train --slurm` with the given train flags, which takes its role and index
from its rank and the hosts from the step's nodes (--address), on ports of the job's own
(--port_base; or the file's, on whole nodes). Each node is asked
for its machine's tasks and its trainers' GPUs (num_clones each; none for a ps, a parameter_server
master or an evaluator): a plain job when every machine asks the same, else a heterogeneous job
(a component per node). Each task's console says the cores and GPUs it was given. The job's exit
code is the master's; scancel or the time limit (--signal) makes the master save a checkpoint
while the other tasks serve on; at the time limit the job requeues itself and resumes from it
(--requeue); sent again it resumes likewise. Logs: the job's output file,
each line prefixed with its rank.

Example:
  od-dist slurm --cluster clusters/lan-example.yaml --pipeline pipelines/shapes_retinanet.yaml \\
      --model_dir runs/lan --partition gpu --time 12:00:00 --out job.sbatch
  sbatch job.sbatch
""",
    define_slurm_flags,
    refused=ONE_TASK,
)
def cmd_slurm(fv) -> int:
    made = _node_count_cluster(fv) if fv.nodes is not None or fv.gpus_per_node is not None else None
    try:
        _slurm_script(fv)
    except BaseException:
        if made:  # a refused job leaves no cluster file of its own behind
            os.remove(made)
        raise
    return exit_codes.OK


def _slurm_script(fv) -> None:
    from od_dist.data import errors, writing
    from od_dist.render import slurm

    cluster, passed_on = _script_input(fv, "slurm", "job.sbatch", warn_unresolved=False)
    try:
        text = slurm.render(
            cluster,
            fv.cluster,
            passed_on,
            fv.out,
            name=fv.name,
            partition=fv.partition,
            time=fv.time,
            cpus_per_task=fv.cpus_per_task,
            mem=fv.mem,
            gpus_per_trainer_given=fv.gpus_per_trainer,
            address=fv.address,
            port_base=fv.port_base,
            requeue=fv.requeue,
            then=tuple(fv.then),
            sbatch_lines=tuple(fv.sbatch or ()),
            grace_period=fv.grace_period,
        )
        writing.write_file(fv.out, text)
    except (slurm.SlurmError, errors.DatasetError) as e:
        raise UsageError(str(e)) from None
    os.chmod(fv.out, 0o755)
    late = slurm.time_limit_warning(fv.time, fv.grace_period)
    if late:
        print(f"od-dist slurm: warning: {late}", file=sys.stderr)
    print(f"wrote {fv.out} ({len(cluster.tasks())} tasks); send it with: sbatch {fv.out}", file=sys.stderr)


def _node_count_cluster(fv) -> str | None:
    """`--nodes N --gpus_per_node G`: the cluster file of the layout docs/scaling.md recommends,
    written beside --out and given as --cluster; the layout said on the console. Returns its path
    when it was not there before (removed again if the job is refused)."""
    from od_dist.data import errors, writing
    from od_dist.render import slurm

    if fv.nodes is None:
        raise UsageError("--gpus_per_node: given without --nodes; pass --nodes=N (the job's nodes)")
    if fv.cluster:
        raise UsageError(
            f"--nodes: {fv.nodes}: --cluster {fv.cluster} says the nodes already; give one of them"
        )
    require(fv, "out", fix="--out=job.sbatch")
    gpus = 1 if fv.gpus_per_node is None else fv.gpus_per_node
    path = os.path.splitext(fv.out)[0] + ".cluster.yaml"
    new = not os.path.exists(path)
    try:
        writing.write_file(
            path, slurm.node_count_cluster(fv.nodes, gpus, f"--nodes {fv.nodes} --gpus_per_node {gpus}")
        )
    except errors.DatasetError as e:
        raise UsageError(str(e)) from None
    fv.cluster = path
    if not gpus and fv.gpus_per_trainer is None:
        fv.gpus_per_trainer = 0
    print(
        f"od-dist slurm: {fv.nodes} node(s) x {gpus} GPU(s): multi_worker_mirrored, one trainer per node "
        f"({fv.nodes - 1} worker(s) on the first, the master on the last), num_clones {max(gpus, 1)} "
        f"(docs/scaling.md); the cluster file: {path}",
        file=sys.stderr,
    )
    return path if new else None
