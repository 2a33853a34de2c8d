"""A Slurm batch script from a cluster file: one srun step with a task per entry (the file's
grouping of entries on machines becomes the tasks per node: cluster/slurm.py), each running
`od-dist train --slurm`, which takes its role and index from its rank. No TensorFlow here.

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
from od_dist.render import quote

SIGNAL_AHEAD_S = 120  # --signal=TERM@N: the trainers' loop and save before the time limit
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


def gpus_default(cluster: Cluster, passed_on: list[str]) -> int:
    """GPUs per task when --gpus_per_task is not given: the trainers' num_clones when they run
    several replicas on GPUs, else none (a single replica may run on a CPU-only node)."""
    if "--clone_on_cpu" in passed_on:
        return 0
    given = [a.split("=", 1)[1] for a in passed_on if a.startswith(commandline.NUM_CLONES)]
    trainers = [t for t in cluster.tasks() if cluster.runs_replicas(t.role)]
    clones = (
        int(given[-1]) if given else max((cluster.clones_for(t.address.host) for t in trainers), default=1)
    )
    return clones if clones > 1 else 0


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
    gpus_per_task: int | None = None,
    sbatch_lines: tuple[str, ...] = (),
) -> str:
    """The batch script's text. `passed_on`: the train flags (with --max_restarts) every task gets."""
    check_options(partition, time, mem, sbatch_lines)
    name = name or job_name(cluster_path)
    if not _NAME.fullmatch(name):
        raise SlurmError(f"--name: '{name}': use letters, digits, '-', '_' and '.'")
    try:
        for value, what in [(cluster_path, "--cluster"), (out, "--out")] + [(a, a) for a in passed_on]:
            quote.check(value, what.split("=", 1)[0])
    except quote.QuoteError as e:
        raise SlurmError(str(e)) from None
    counts = layout.tasks_per_node(cluster)
    placed = layout.ranks(cluster)
    nodes, total, most = len(counts), sum(counts), max(counts)
    even = len(set(counts)) == 1
    lead = cluster.lead_task()
    lead_rank = next(r for r, (t, _) in enumerate(placed) if t == lead)
    gpus = gpus_default(cluster, passed_on) if gpus_per_task is None else gpus_per_task
    model_dir = next(a.split("=", 1)[1] for a in passed_on if a.startswith("--model_dir="))

    task_line = [
        "od-dist",
        *commandline.train_args(passed_on)[:1],
        "--slurm",
        f"--cluster={cluster_path}",
        *commandline.train_args(passed_on)[1:],
    ]
    width = max(len(t.name) for t, _ in placed)
    rank_lines = "\n".join(
        f"#   {r:>3}  {t.name:<{width}}  node {n + 1}, "
        + (f"port {t.address.port}" if t.address.port else "no port")
        for r, (t, n) in enumerate(placed)
    )
    layout_note = (
        f"# {most} task(s) on each node: block distribution.\n"
        if even
        else f"# {','.join(map(str, counts))} tasks on the nodes in the order `scontrol show hostnames` gives them, set\n"
        "# by SLURM_HOSTFILE (distribution arbitrary): Slurm's block distribution keeps no uneven counts.\n"
    )
    header = f"""#!/bin/bash
# Slurm batch script for {cluster_path}, generated by `od-dist slurm`. Send it with: sbatch {out}
# One srun step runs a task per entry of {cluster_path} on {nodes} node(s).
{layout_note}# Each task runs `od-dist train --slurm`: its rank (SLURM_PROCID) says which entry it is, below.
# Hosts: the allocation's nodes with the ports of {cluster_path}, not its addresses.
# Ranks (each output line starts with its rank, `N:`; the output file is slurm-<job id>.out
# unless an --output line says otherwise; each task also logs to <model_dir>/logs/):
{rank_lines}
# Exit: the job's code is the lead's, {lead.name} (rank {lead_rank}), as under `od-dist launch`; a
# lead that fails stops the other tasks. Each task's code is written under <model_dir>/slurm/.
# Stop: scancel sends SIGTERM to every task: the trainers save a checkpoint and exit 143 (KillWait
# must leave them a loop and a save). --signal asks for the same {SIGNAL_AHEAD_S} s before the time
# limit. Sending the job again, or a requeue (--requeue), resumes from the last checkpoint.
"""
    directives = [f"--job-name={name}", f"--nodes={nodes}", f"--ntasks-per-node={most}"]
    directives += [f"--signal=TERM@{SIGNAL_AHEAD_S}", "--requeue", "--open-mode=append"]
    if cpus_per_task:
        directives.append(f"--cpus-per-task={cpus_per_task}")
    if mem:
        directives.append(f"--mem={mem}")
    if gpus:
        directives.append(f"--gpus-per-task={gpus}")
    if time:
        directives.append(f"--time={time}")
    if partition:
        directives.append(f"--partition={partition}")
    directives += list(sbatch_lines)
    body = [
        "",
        "set -u",
        "trap : TERM  # the tasks get scancel's SIGTERM too: wait for them, then exit with the lead's code",
        f"export OD_DIST_RUN_DIR={run_dir(model_dir)}",
        f"export OD_DIST_LEAD_RANK={lead_rank}",
        'mkdir -p "$OD_DIST_RUN_DIR"',
    ]
    srun = ["srun", f"--nodes={nodes}", f"--ntasks={total}"]
    if even:
        srun += [f"--ntasks-per-node={most}", "--distribution=block"]
    else:
        body += [
            "unset SLURM_NTASKS_PER_NODE  # the allocation's, for the fullest node: the host file places the tasks",
            f"counts=({' '.join(map(str, counts))})",
            "i=0",
            'for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do',
            '  for ((k = 0; k < ${counts[i]:-0}; k++)); do echo "$node"; done',
            "  i=$((i + 1))",
            'done > "$OD_DIST_RUN_DIR/hosts"',
            'export SLURM_HOSTFILE="$OD_DIST_RUN_DIR/hosts"',
        ]
        srun += ["--distribution=arbitrary"]
    srun += ["--label", "--kill-on-bad-exit=0", "bash -c", quote.sh(WRAPPER), "od-dist-task"]
    srun += [quote.sh(a) for a in task_line]
    body += [
        " \\\n    ".join(_wrap(srun)),
        "srun_code=$?",
        'code=$(cat "$OD_DIST_RUN_DIR/$OD_DIST_LEAD_RANK" 2>/dev/null) || code=$srun_code',
        f'echo "od-dist: {lead.name} (rank {lead_rank}) exited $code: the job\'s exit code"',
        'exit "$code"',
    ]
    return header + "".join(f"#SBATCH {d}\n" for d in directives) + "\n".join(body) + "\n"


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
