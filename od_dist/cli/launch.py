"""`od-dist launch`: every task of the cluster that lives on this machine, as one job."""

from __future__ import annotations

from od_dist.cli.flags import LAUNCH_MAX_RESTARTS, ONE_TASK, define_restart_flags, define_train_flags, require
from od_dist.cli.registry import UsageError, command
from od_dist.cli.train import honour_ctrl_c, run_here


@command(
    "launch",
    "Start every task of the cluster that lives on this machine, as one job.",
    """
Starts the tasks of the cluster that run on this machine (all of them for a loopback cluster such
as clusters/local.yaml) as child processes with the given train flags. Their lines are prefixed
([worker:1] ...) and each writes <model_dir>/logs/<role>-<index>.log (./od-dist-logs/ for a remote
gs://... model_dir). Exits 0 when the master has
finished and the others have stopped. A lost task (a retryable exit: lost peer, signal) is
restarted by TensorFlow's rules, up to --max_restarts times in a row: a parameter_server worker or the
evaluator alone, a ps, the master or any multi_worker_mirrored trainer with every task, from the
last checkpoint. A permanent error (exit 1, 2) stops every task at once, exit 1 (2) naming it.
Ctrl+C (SIGTERM) asks the trainers to save and stop, then stops the rest: exit 130 (143); a second
Ctrl+C stops everything at once. A Ctrl+C on another machine of the job ends it here too (exit 130,
after the checkpoint it saved). It exits 0 only when the master exited 0. No task outlives the launcher.

Example:
  od-dist launch --cluster clusters/local.yaml --pipeline pipelines/shapes_retinanet.yaml --model_dir runs/demo
""",
    lambda fv: (define_train_flags(fv), define_restart_flags(fv, LAUNCH_MAX_RESTARTS)),
    refused=ONE_TASK,
)
def cmd_launch(fv) -> int:
    from od_dist.cluster import hostinfo
    from od_dist.host import config

    honour_ctrl_c()
    if fv.role is not None or fv.index is not None:
        raise UsageError(
            "--role/--index: launch starts every task of this machine; leave them out "
            "(or use 'od-dist train' for one task)"
        )
    require(fv, "cluster", fix="--cluster clusters/local.yaml")
    unchecked: list[str] = []
    cluster = config.load_cluster(fv.cluster, fv.allow_public_addresses, unchecked)
    tasks = cluster.tasks_on(hostinfo.this_machine().is_local)  # servers first: trainers find them up
    if not tasks:
        raise UsageError(
            f"--cluster: '{fv.cluster}': no task of this cluster is on this machine; "
            "run launch on the machines the file lists"
        )
    return run_here(fv, cluster, tasks, "launch", unchecked)
