"""A Slurm batch script from a cluster file: one srun step with a task per entry (the file's
grouping of entries on machines becomes the tasks per node: cluster/slurm.py), each running
`od-dist train --slurm`, which takes its role and index from its rank. No TensorFlow here.

Each machine of the file asks its node for its own tasks and its trainers' GPUs (requests()). When
every machine asks the same, a plain job (--nodes, --ntasks-per-node, --gres per node); otherwise a
heterogeneous job, a component of one node per machine, so that no node is asked for the fullest
machine's tasks and GPUs (which may fit no node at all). One step either way (srun --het-group
spans the components), so the tasks keep one rank order and one exit-code rule. Slurm gives a
node's GPUs to all its tasks; each keeps its own (cluster/slurm.py task_gpus).

The job's exit code is the lead's (the master, or worker 0 without one), as under `launch`: srun
returns the highest code of all tasks, so each task's code is written by a small bash wrapper into
a folder under model_dir and the script exits with the lead's. A lead that fails cancels the step,
so the servers do not wait for it until their --wait_timeout.
"""

from __future__ import annotations

import re

from od_dist.cluster import commandline
from od_dist.cluster import slurm as layout
from od_dist.cluster.spec import Cluster
from od_dist.protocol import exit_codes
from od_dist.render import quote

# The time limit's warning (--signal=...@N) comes N = --grace_period + this many seconds ahead: the
# trainers' loop and save take up to --grace_period; the servers stop 10 s after the trainers, and the
# script then requeues the job, inside the margin.
SIGNAL_MARGIN_S = 60
SIGNAL_MAX_S = 65535  # sbatch --signal's largest time


def signal_ahead(grace_period: int) -> int:
    """Seconds before the time limit that the job is warned (--signal=...@N)."""
    return grace_period + SIGNAL_MARGIN_S


def time_limit_s(time: str) -> int | None:
    """A Slurm --time in seconds (None: unlimited). MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS,
    DAYS-HOURS, DAYS-HOURS:MINUTES, DAYS-HOURS:MINUTES:SECONDS (sbatch's man page)."""
    if time.upper() in ("UNLIMITED", "INFINITE"):
        return None
    days, _, rest = time.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        h, m, sec = (parts + [0, 0])[:3]
        return ((int(days) * 24 + h) * 60 + m) * 60 + sec
    if len(parts) == 1:
        return parts[0] * 60
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]
    return (parts[0] * 60 + parts[1]) * 60 + parts[2]


def time_limit_warning(time: str | None, grace_period: int) -> str | None:
    """One line when --time leaves no training before the time limit's warning: the tasks would be
    asked to stop as they start (a requeued job then restarts without progress)."""
    limit = time_limit_s(time) if time else None
    ahead = signal_ahead(grace_period)
    if limit is None or limit > ahead:
        return None
    return (
        f"--time: '{time}' ({limit} s) is not longer than the {ahead} s ahead of it that the job is "
        f"warned (--grace_period {grace_period} + {SIGNAL_MARGIN_S}): the tasks are asked to stop as "
        "they start; give a longer --time or a shorter --grace_period"
    )


# Each task's wrapper: bash survives SIGTERM (a non-empty trap: its child gets the default
# handling back, which an ignored signal would not), writes the task's exit code, and a lead that
# ends otherwise than 0 or 143 (a SIGTERM, which Slurm sends every task at once) cancels the step.
WRAPPER = (
    'trap : TERM INT; "$@"; code=$?; echo "$code" > "$OD_DIST_RUN_DIR/$SLURM_PROCID"; '
    'if [ "$SLURM_PROCID" = "$OD_DIST_LEAD_RANK" ] && [ "$code" != 0 ] && [ "$code" != 143 ]; then '
    'echo "od-dist: the lead exited $code; stopping the other tasks" >&2; '
    'scancel "$SLURM_JOB_ID.$SLURM_STEP_ID"; fi; exit "$code"'
)
_TIME = re.compile(r"(\d+-)?\d+(:\d+){0,2}|\d+-\d+|UNLIMITED|INFINITE", re.I)
_MEM = re.compile(r"\d+[KMGT]?", re.I)
_NAME = re.compile(r"[A-Za-z0-9_.,-]+")


class SlurmError(ValueError):
    """Bad input for the script; the message names it and the fix."""


def job_name(cluster_path: str) -> str:
    from od_dist.render import k8s

    return k8s.job_name(cluster_path)


def check_options(partition, time, mem, sbatch_lines) -> None:
    if partition is not None and not _NAME.fullmatch(partition):
        raise SlurmError(f"--partition: '{partition}': not a partition name; write it like gpu or gpu,cpu")
    if time is not None and not _TIME.fullmatch(time):
        raise SlurmError(
            f"--time: '{time}': not a Slurm time limit; write MINUTES, HH:MM:SS or DAYS-HH:MM:SS"
        )
    if mem is not None and not _MEM.fullmatch(mem):
        raise SlurmError(f"--mem: '{mem}': not a Slurm memory size; write it like 16G or 64000M")
    for line in sbatch_lines:
        quote.check(line, "--sbatch")
        if not line.startswith("-"):
            raise SlurmError(
                f"--sbatch: '{line}': an sbatch option, as after #SBATCH; write it like --account=lab"
            )


def gpus_per_trainer(cluster: Cluster, passed_on: list[str], host: str, given: int | None) -> int:
    """The GPUs each trainer on `host` gets: `given` (--gpus_per_trainer), else its num_clones (the
    flag's, else the file's for that machine), none with --clone_on_cpu (its replicas are CPUs)."""
    if given is not None:
        return given
    if "--clone_on_cpu" in passed_on:
        return 0
    flag = [a.split("=", 1)[1] for a in passed_on if a.startswith(commandline.NUM_CLONES)]
    return int(flag[-1]) if flag else cluster.clones_for(host)


def requests(cluster: Cluster, passed_on: list[str], given: int | None) -> list[tuple[int, int]]:
    """(tasks, GPUs) each machine of the file asks of its node: a task per entry, and the GPUs of
    its trainers (duties: they run the replicas); a ps, a parameter_server master or an evaluator
    asks none."""
    return [
        (
            len(tasks),
            sum(
                gpus_per_trainer(cluster, passed_on, t.address.host, given)
                for t in tasks
                if cluster.runs_replicas(t.role)
            ),
        )
        for _, tasks in layout.machines(cluster)
    ]


NODE_PORT = 2222  # the generated file's port on each node (the job's own ports replace it: --port_base)
THEN = ("eval", "export")


def node_count_cluster(nodes: int, gpus: int, flags_given: str) -> str:
    """The cluster file of `od-dist slurm --nodes N --gpus_per_node G`: multi_worker_mirrored, one
    trainer per node (docs/scaling.md), its GPUs all the trainer's; the hosts stand for the job's
    nodes (node-i: the i-th; the workers' machines come first, the master's last)."""
    workers = ", ".join(f"node-{i}:{NODE_PORT}" for i in range(1, nodes))
    return (
        f"# Written by `od-dist slurm {flags_given}`: multi_worker_mirrored, one trainer per node\n"
        "# (docs/scaling.md). Each host stands for a node of the Slurm job.\n"
        "strategy: multi_worker_mirrored\n"
        + (f"worker: [{workers}]\n" if workers else "")
        + f"master: node-{nodes}:{NODE_PORT}\n"
        + f"num_clones: {max(gpus, 1)}\n"
    )


def run_dir(model_dir: str) -> str:
    """Where the tasks' exit codes (and the host file) go: shared storage under model_dir; a
    model_dir that is a URL is no folder here: the submit directory then."""
    base = "$SLURM_SUBMIT_DIR/od-dist-slurm" if "://" in model_dir else f"{quote.sh(model_dir)}/slurm"
    return f'{base}/"$SLURM_JOB_ID.${{SLURM_RESTART_COUNT:-0}}"'


def render(
    cluster: Cluster,
    cluster_path: str,
    passed_on: list[str],
    out: str,
    name: str | None = None,
    partition: str | None = None,
    time: str | None = None,
    cpus_per_task: int | None = None,
    mem: str | None = None,
    gpus_per_trainer_given: int | None = None,
    sbatch_lines: tuple[str, ...] = (),
    address: str = layout.NODE,
    port_base: int = 0,
    requeue: bool = True,
    then: tuple[str, ...] = (),
    grace_period: int = 120,
) -> str:
    """The batch script's text. `passed_on`: the train flags (with --max_restarts) every task gets;
    `grace_period`: theirs (--grace_period), which the time limit's warning leaves them."""
    check_options(partition, time, mem, sbatch_lines)
    ahead = signal_ahead(grace_period)
    if ahead > SIGNAL_MAX_S:
        raise SlurmError(
            f"--grace_period: {grace_period}: the time limit's warning would come {ahead} s ahead "
            f"(--grace_period + {SIGNAL_MARGIN_S}), more than Slurm's --signal takes ({SIGNAL_MAX_S}); "
            f"give at most {SIGNAL_MAX_S - SIGNAL_MARGIN_S}"
        )
    for step in then:
        if step not in THEN:
            raise SlurmError(f"--then: '{step}': not one of {', '.join(THEN)}; write --then=eval,export")
    why = layout.address_problem(address)
    if why:
        raise SlurmError(f"--address: '{address}': {why}; write it like {{node}} or {{node}}-ib")
    why = port_base and layout.port_base_problem(port_base, cluster)
    if why:
        raise SlurmError(f"--port_base: {port_base}: {why}; give a lower one, or 0 for the file's ports")
    name = name or job_name(cluster_path)
    if not _NAME.fullmatch(name):
        raise SlurmError(f"--name: '{name}': use letters, digits, '-', '_' and '.'")
    try:
        for value, what in [(cluster_path, "--cluster"), (out, "--out")] + [(a, a) for a in passed_on]:
            quote.check(value, what.split("=", 1)[0])
    except quote.QuoteError as e:
        raise SlurmError(str(e)) from None
    asks = requests(cluster, passed_on, gpus_per_trainer_given)
    placed = layout.ranks(cluster)
    nodes, total = len(asks), sum(k for k, _ in asks)
    same = len(set(asks)) == 1
    lead = cluster.lead_task()
    lead_rank = next(r for r, (t, _) in enumerate(placed) if t == lead)
    model_dir = next(a.split("=", 1)[1] for a in passed_on if a.startswith("--model_dir="))

    task_line = [
        "od-dist",
        *commandline.train_args(passed_on)[:1],
        "--slurm",
        f"--cluster={cluster_path}",
        *commandline.train_args(passed_on)[1:],
    ]
    width = max(len(t.name) for t, _ in placed)
    ports = layout.job_ports(cluster, 0, 0)[0] if port_base else {}
    rank_lines = "\n".join(
        f"#   {r:>3}  {t.name:<{width}}  node {n + 1}, "
        + (
            ("port" if not port_base else "port J+") + str(ports[t.name] if port_base else t.address.port)
            if t.address.port
            else "no port"
        )
        + (
            f", {gpus_per_trainer(cluster, passed_on, t.address.host, gpus_per_trainer_given)} GPU(s)"
            if cluster.runs_replicas(t.role)
            else ""
        )
        for r, (t, n) in enumerate(placed)
    )
    asked = ", ".join(f"{k} task(s) and {g} GPU(s)" for k, g in asks)
    layout_note = (
        f"# Each node: {asked.split(', ')[0]}, block distribution.\n"
        if same
        else f"# A heterogeneous job: a component per node, each asking its machine's own: {asked}.\n"
        "# (A plain job asks every node for the fullest machine's tasks and GPUs.)\n"
    )
    cores = (
        f"{cpus_per_task} core(s) per task (--cpus-per-task; srun gets it by SRUN_CPUS_PER_TASK)"
        if cpus_per_task
        else "Slurm's default cores per task (one on most clusters: --cpus_per_task)"
    )
    hosts = "by their names" if address == layout.NODE else f"at {address}"
    if port_base:
        count = layout.port_count(cluster)
        slots = (layout.LAST_PORT + 1 - port_base) // count
        ports_note = (
            f"ports: the job's\n# own, J = {port_base} + (job id % {slots}) x {count}: no other job with a nearby id"
            " holds them (--port_base)."
        )
    else:
        ports_note = f"the ports of\n# {cluster_path}, on nodes of this job alone (--exclusive)."
    limit_note = (
        f"Time limit: {ahead} s before it (--signal, to this script: --grace_period {grace_period} + "
        f"{SIGNAL_MARGIN_S}) the tasks are asked the same,\n"
        "# then the job requeues itself (scontrol requeue) and goes on from that checkpoint, until training\n"
        "# is done; a job that finished or failed is never requeued. Sent again, it resumes likewise."
        if requeue
        else f"Time limit: {ahead} s before it (--signal: --grace_period {grace_period} + {SIGNAL_MARGIN_S}) "
        "the tasks are asked the same, and the job\n"
        "# ends (exit 143). Sent again, or requeued, it resumes from the last checkpoint."
    )
    header = f"""#!/bin/bash
# Slurm batch script for {cluster_path}, generated by `od-dist slurm`. Send it with: sbatch {out}
# One srun step runs a task per entry of {cluster_path} on {nodes} node(s).
{layout_note}# Resources: {cores}.
# GPUs: the trainers' only, num_clones each; of its node's GPUs (CUDA_VISIBLE_DEVICES) each trainer
# keeps its share, the other tasks none. Each task's console says the cores and GPUs it was given.
# Each task runs `od-dist train --slurm`: its rank (SLURM_PROCID) says which entry it is, below.
# Hosts: the allocation's nodes, {hosts}, not the addresses of {cluster_path}; {ports_note}
# Ranks (each output line starts with its rank, `N:`; the output file is slurm-<job id>.out
# unless an --output line says otherwise; each task also logs to <model_dir>/logs/):
{rank_lines}
# Exit: the job's code is the lead's, {lead.name} (rank {lead_rank}), as under `od-dist launch`; a
# lead that fails stops the other tasks. Each task's code is written under <model_dir>/slurm/.
# Stop: scancel sends SIGTERM to every task: the trainers save a checkpoint and exit 143 (KillWait
# must leave them a loop and a save), the other tasks serving until the master has saved.
# {limit_note}
"""
    # The job's own options, first: a heterogeneous job's later components take them from the first.
    # Requeue: the warning goes to this script alone (B:USR1), which tells the tasks (SIGTERM, as
    # scancel does) and knows then, unlike after a scancel, that the job is to go on.
    warning = f"--signal=B:USR1@{ahead}" if requeue else f"--signal=TERM@{ahead}"
    job = [f"--job-name={name}", warning, "--requeue", "--open-mode=append"]
    if not port_base:  # the file's fixed ports: no other job may hold them on these nodes
        job.append("--exclusive")
    if time:
        job.append(f"--time={time}")
    if partition:
        job.append(f"--partition={partition}")
    job += list(sbatch_lines)

    def node_options(k: int, g: int) -> list[str]:
        out = [f"--cpus-per-task={cpus_per_task}"] if cpus_per_task else []
        out += [f"--mem={mem}"] if mem else []
        return out + ([f"--gres=gpu:{g}"] if g else [])  # per node: every Slurm with GPUs has --gres

    if same:
        directives = job + [f"--nodes={nodes}", f"--ntasks-per-node={asks[0][0]}", *node_options(*asks[0])]
        sbatch = "".join(f"#SBATCH {d}\n" for d in directives)
    else:
        sbatch = "".join(f"#SBATCH {d}\n" for d in job) + "#SBATCH hetjob\n".join(
            "".join(f"#SBATCH {d}\n" for d in ["--nodes=1", f"--ntasks={k}", *node_options(k, g)])
            for k, g in asks
        )
    body = [
        "",
        "set -u",
        "trap : TERM  # the tasks get scancel's SIGTERM too: wait for them, then exit with the lead's code",
        *(
            [
                "requeue=",
                "trap 'requeue=1; echo \"od-dist: the time limit is near: the tasks save a checkpoint, then the job "
                'requeues itself"; scancel --signal=TERM "$SLURM_JOB_ID"\' USR1',
            ]
            if requeue
            else []
        ),
        f"export OD_DIST_RUN_DIR={run_dir(model_dir)}",
        f"export OD_DIST_LEAD_RANK={lead_rank}",
        'mkdir -p "$OD_DIST_RUN_DIR"',
    ]
    if port_base:
        body.append(f"export {layout.PORT_BASE_ENV}={port_base}")
    if address != layout.NODE:
        body.append(f"export {layout.ADDRESS_ENV}={quote.sh(address)}")
    if cpus_per_task:
        # srun does not take sbatch's --cpus-per-task by itself (srun(1) of 22.05): without this a
        # task bound to its cores (task/affinity, task/cgroup) gets one.
        body.append(f"export SRUN_CPUS_PER_TASK={cpus_per_task}")
    if same:
        srun = ["srun", f"--nodes={nodes}", f"--ntasks={total}", f"--ntasks-per-node={asks[0][0]}"]
        srun += ["--distribution=block"]
    else:
        srun = ["srun", f"--het-group=0-{nodes - 1}"]
    srun += ["--label", "--kill-on-bad-exit=0", "bash -c", quote.sh(WRAPPER), "od-dist-task"]
    srun += [quote.sh(a) for a in task_line]
    if requeue:  # in the background: bash runs a trap only once the command it waits for is done
        body += [
            " \\\n    ".join(_wrap(srun)) + " &",
            "srun_pid=$!",
            'while :; do wait "$srun_pid"; srun_code=$?; kill -0 "$srun_pid" 2>/dev/null || break; done',
        ]
    else:
        body += [" \\\n    ".join(_wrap(srun)), "srun_code=$?"]
    body += [
        'if code=$(cat "$OD_DIST_RUN_DIR/$OD_DIST_LEAD_RANK" 2>/dev/null); then',
        f'  echo "od-dist: {lead.name} (rank {lead_rank}) exited $code: the job\'s exit code"',
        "else  # it never ran (srun failed to start it), or was killed before its wrapper wrote a code",
        f'  code=$srun_code; [ "$code" = 0 ] && code={exit_codes.FAILED}',
        f'  echo "od-dist: {lead.name} (rank {lead_rank}) never ran or was killed before it wrote its exit code '
        '(srun exited $srun_code; the lines above say why); exit $code"',
        "fi",
        *(
            [
                f'if [ -n "$requeue" ] && [ "$code" = {exit_codes.TERMINATED} ]; then  # saved at the warning',
                '  echo "od-dist: requeued: restart $((${SLURM_RESTART_COUNT:-0} + 1)) goes on from the checkpoint"',
                '  scontrol requeue "$SLURM_JOB_ID" && exit 0',
                '  echo "od-dist: scontrol requeue failed; send the job again to go on"',
                "fi",
            ]
            if requeue
            else []
        ),
        *_then_lines(then, passed_on, model_dir),
        'exit "$code"',
    ]
    return header + sbatch + "\n".join(body) + "\n"


def _then_lines(then: tuple[str, ...], passed_on: list[str], model_dir: str) -> list[str]:
    """After a training that finished (the lead's 0): `od-dist eval` and `export` as steps of one
    task on the first node, the job's code theirs if they fail."""
    if not then:
        return []
    model = [a for a in passed_on if a.split("=", 1)[0] in ("--pipeline", "--model_dir", "--params_override")]
    lines = ['if [ "$code" = 0 ]; then  # training finished: what --then asks for']
    for step in then:
        args = ["od-dist", step, *model]
        if step == "export":
            args.append(f"--out={model_dir.rstrip('/')}/exported")
        command = " ".join(quote.sh(a) for a in args)
        lines += [
            f"  srun --nodes=1 --ntasks=1 --label {command}",
            f'  code=$?; [ "$code" = 0 ] || {{ echo "od-dist: {step} exited $code: the job\'s exit code"; exit "$code"; }}',
        ]
    return lines + ["fi"]


def _wrap(words: list[str], width: int = 100) -> list[str]:
    """The words on lines of about `width` characters (continued with a backslash)."""
    lines, line = [], ""
    for w in words:
        if line and len(line) + 1 + len(w) > width:
            lines.append(line)
            line = w
        else:
            line = f"{line} {w}" if line else w
    return lines + [line]
