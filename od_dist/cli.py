"""The `od-dist` command line: flags -> calls. Subcommands live in a registry; each has its own absl
FlagValues, so `od-dist train --help` lists only train's flags. Modules that import TensorFlow are
imported inside the commands that train, so validate, tf-config and --help stay fast.

Exit status: protocol/exit_codes.py (`od-dist --help` lists it).
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from absl import flags

from od_dist.cluster import commandline
from od_dist.cluster.spec import InvalidCluster
from od_dist.cluster.validate import MAX_CLONES, SHOWN_MAX, shown
from od_dist.host.config import ALL_REDUCE_DTYPES, ALL_REDUCE_PACKS
from od_dist.protocol import exit_codes, notes
from od_dist.protocol.peers import LOST_PEER_TIMEOUT_S


class UsageError(Exception):
    """Bad flags or input found by a command; printed as is, exit 2."""


@dataclass(frozen=True)
class Command:
    name: str
    summary: str
    usage: str  # description and example, shown by --help
    define: Callable[[flags.FlagValues], None]
    run: Callable[[flags.FlagValues], int]
    # The flags that take several files (multi-string flags): each also takes the paths that follow
    # it, as a shell writes an unquoted glob (`--records data/*.tfrecord`).
    lists: tuple[str, ...] = ()
    rest: str | None = None  # the one of `lists` that also takes the paths left after the flags
    # Flags of the shared definitions that this command refuses with a reason (--role/--index for
    # the commands that cover every task): left out of its --help.
    refused: tuple[str, ...] = ()


COMMANDS: dict[str, Command] = {}


def command(
    name: str,
    summary: str,
    usage: str,
    define: Callable[[flags.FlagValues], None],
    lists: tuple[str, ...] = (),
    rest: str | None = None,
    refused: tuple[str, ...] = (),
):
    def register(fn):
        COMMANDS[name] = Command(name, summary, usage.strip("\n"), define, fn, lists, rest, refused)
        return fn

    return register


# The help of every flag that takes several files: one wording, as `records.expand_paths` reads them.
SEVERAL = (
    "Several: one after another after the flag (as a shell expands an unquoted glob), a glob, or a "
    "comma-separated list."
)


def _gather(args: list[str], lists: tuple[str, ...]) -> list[str]:
    """`--records a b c` -> `--records a --records=b --records=c`: the bare arguments that follow a
    flag of `lists` (and its value) are more of its values. Others are left for absl, and refused."""
    out, current, value_next = [], None, False
    for arg in args:
        if value_next:
            value_next = False
        elif arg.startswith("-") and arg != "-":
            name, eq, _ = arg.lstrip("-").partition("=")
            current = name if name in lists else None
            value_next = current is not None and not eq
        elif current is not None:
            arg = f"--{current}={arg}"
        out.append(arg)
    return out


def _stray(name: str, args: list[str], arg: str, lists: tuple[str, ...]) -> str:
    """Why `arg` is refused, and how to pass several files."""
    before = [a for a in args[: args.index(arg)] if a.startswith("--")] if arg in args else []
    after = before[-1].lstrip("-").partition("=")[0] if before else ""
    where = f" after --{after}, which takes one value" if after and after not in lists else ""
    several = (
        f"; several files go after {' or '.join('--' + n for n in lists)}: one after another, as a glob, "
        "or comma-separated"
        if lists
        else "; quote a path that holds spaces"
    )
    return (
        f"od-dist {name}: unexpected argument '{shown(arg)}'{where}; flags are written --name=value{several}"
    )


# ----- shared flags ---------------------------------------------------------------------------


def define_task_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string(
        "cluster",
        None,
        "The cluster YAML file (same on every machine). Without it, "
        "TF_CONFIG from the environment is used (as the pods `od-dist k8s` writes get it).",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "role",
        None,
        "This task's role: ps, master (alias chief), worker or evaluator. "
        "Omitted: inferred from the one cluster entry that is this machine.",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "index",
        None,
        "This task's index within its role (list order in the file; 0 for master). Default 0.",
        lower_bound=0,
        flag_values=fv,
    )
    flags.DEFINE_boolean(
        "allow_public_addresses",
        False,
        "Accept cluster addresses on the public internet. Off by default because the "
        "TensorFlow server has no authentication and executes whatever graph it is sent: "
        "anyone who reaches its port can run code on the machine.",
        flag_values=fv,
    )


def define_verbose_flag(fv: flags.FlagValues) -> None:
    flags.DEFINE_boolean(
        "verbose",
        False,
        "Show everything on the console: TensorFlow's log lines, library "
        "output and every warning. Without it they go to the task's log file "
        "(<model_dir>/logs/), and the console shows od-dist's lines and real warnings once.",
        flag_values=fv,
    )


def define_train_flags(fv: flags.FlagValues) -> None:
    """The flags of `od-dist train`; launch, scripts and k8s take the same ones and pass them on."""
    define_task_flags(fv)
    flags.DEFINE_string(
        "pipeline", None, "The pipeline: a Model Garden experiment YAML (see pipelines/).", flag_values=fv
    )
    flags.DEFINE_string(
        "model_dir",
        None,
        "Where checkpoints, summaries and logs go; a run resumes from the latest checkpoint found here.",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "num_clones",
        None,
        "Replicas per trainer process: the first N GPUs (or N logical "
        "CPU devices with --clone_on_cpu). Default: the cluster file's num_clones, else 1.",
        lower_bound=1,
        upper_bound=MAX_CLONES,
        flag_values=fv,
    )
    flags.DEFINE_boolean(
        "clone_on_cpu",
        False,
        "Make the --num_clones replicas logical CPU devices instead of GPUs.",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "params_override",
        None,
        "A YAML string or file overriding pipeline keys, e.g. "
        "'trainer.train_steps=2000' or 'trainer: {train_steps: 2000}'.",
        flag_values=fv,
    )
    define_verbose_flag(fv)
    flags.DEFINE_boolean(
        "fixed_replica_batch",
        False,
        "Treat the pipeline's global_batch_size as the batch of one replica: "
        "multiply it and the learning rate by the number of replicas (the linear scaling rule, "
        "with a warmup), so adding machines adds examples per step. Synchronous strategies only.",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "all_reduce_packs",
        ALL_REDUCE_PACKS,
        "multi_worker_mirrored: all-reduce the gradients in this many packs, each started as soon "
        "as its gradients are computed, so the network works during the backward pass (1: one "
        "all-reduce after it, TensorFlow's default).",
        lower_bound=1,
        flag_values=fv,
    )
    flags.DEFINE_enum(
        "all_reduce_dtype",
        "float32",
        ALL_REDUCE_DTYPES,
        "multi_worker_mirrored: the type each gradient is sent in across machines. bfloat16 halves "
        "the bytes of every all-reduce (float32's range, 8 significant bits); the variables and "
        "the optimizer stay float32.",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "lost_peer_timeout",
        LOST_PEER_TIMEOUT_S,
        "multi_worker_mirrored: seconds another trainer may stay unreachable (a network outage, "
        "a switch restarting) before this trainer takes it for lost and exits 138 to be restarted "
        "with every trainer from the last checkpoint.",
        lower_bound=1,
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "wait_timeout",
        300,
        "Seconds to wait for every peer (and for servers: for the "
        "master) before giving up with the names of the missing tasks.",
        lower_bound=1,
        flag_values=fv,
    )
    # Thread budgets: by default a task alone on its machine keeps TensorFlow's (all cores), and
    # tasks of the cluster that share a machine split its cores (see od_dist/host/cpu_budget.py).
    flags.DEFINE_integer(
        "intra_op_threads",
        None,
        "TensorFlow intra-op threads of this task (0: TensorFlow's "
        "default, all cores). Default: all cores when the task is alone on its machine, else "
        "its share (1 for a ps or a parameter_server master).",
        lower_bound=0,
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "inter_op_threads",
        None,
        "TensorFlow inter-op threads of this task (0: TensorFlow's "
        "default; at least 2 under parameter_server, 1 deadlocks its coordinator). Default: "
        "as --intra_op_threads, at least 2.",
        lower_bound=0,
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "data_threads",
        None,
        "tf.data threads of this task's input pipeline (0: tf.data's "
        "default, all cores). Default: tf.data's, in every task (capped at one thread it "
        "halved a local multi_worker_mirrored pair: BENCHMARKS.md).",
        lower_bound=0,
        flag_values=fv,
    )


# The flags that pick one task: launch, scripts and k8s cover every task and refuse them.
ONE_TASK = ("role", "index")


# launch's default: enough for the occasional lost process of a long run (an OOM kill, a preempted
# or rebooted task) while a task that dies at every start stops the job after 2 + 4 + 8 s of
# backoff instead of looping. `train` defaults to 0: see its help.
LAUNCH_MAX_RESTARTS = 3


def define_restart_flags(fv: flags.FlagValues, max_restarts: int) -> None:
    """The supervisor's flags (launch; train, whose default 0 runs the task in-process)."""
    flags.DEFINE_integer(
        "max_restarts",
        max_restarts,
        "Restarts after a task is lost (a retryable exit: "
        "lost peer, SIGTERM, SIGKILL), by TensorFlow's rules: a parameter_server worker or an "
        "evaluator alone, anything else every task together from the last checkpoint; "
        "2 s backoff, doubling. Permanent errors (exit 1, 2) and a person's stop (exit 130: "
        "Ctrl+C on any machine of the job) are never retried.",
        lower_bound=0,
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "grace_period",
        120,
        "Seconds the trainers get to save a checkpoint and exit after "
        "Ctrl+C/SIGTERM before they are killed; make it longer than one "
        "trainer.steps_per_loop loop plus a save.",
        lower_bound=1,
        flag_values=fv,
    )


def restart_args(fv: flags.FlagValues) -> list[str]:
    """--max_restarts (always, so a generated script says what it does) and --grace_period if set."""
    return [f"--max_restarts={fv.max_restarts}"] + (
        [f"--grace_period={fv.grace_period}"] if fv["grace_period"].present else []
    )


def _job_flag_names() -> tuple[str, ...]:
    """Every `od-dist train` flag but the task's own place (cluster/commandline.py's TASK_FLAGS): what
    `launch`, `scripts`, `k8s` and `train --max_restarts` pass on to each task. Taken from the
    definitions, so a new train flag is passed on without being listed anywhere else."""
    fv = flags.FlagValues()
    define_train_flags(fv)
    return tuple(name for name in fv if name not in commandline.TASK_FLAGS)


def passed_on_args(fv: flags.FlagValues) -> list[str]:
    """The job's train flags the user set, as `--name=value` arguments for each task's `train`."""
    args = []
    for name in _job_flag_names():
        flag = fv[name]
        if flag.present:
            if isinstance(flag.value, bool):
                args.append(f"--{'' if flag.value else 'no'}{name}")
            else:
                args.append(f"--{name}={flag.value}")
    return args


def train_config_of(fv: flags.FlagValues, selected, files_here: bool = True):
    """The task's TrainConfig from `od-dist train`'s flags: the one place they become one, for
    `train` itself and for the checks `launch`, `scripts` and `k8s` make before any task starts."""
    from od_dist.host import config

    return config.train_config(
        selected,
        fv.pipeline,
        fv.model_dir,
        fv.num_clones,
        fv.clone_on_cpu,
        fv.params_override,
        fv.wait_timeout,
        fv.intra_op_threads,
        fv.inter_op_threads,
        fv.data_threads,
        fixed_replica_batch=fv.fixed_replica_batch,
        all_reduce_packs=fv.all_reduce_packs,
        lost_peer_timeout=fv.lost_peer_timeout,
        files_here=files_here,
        all_reduce_dtype=fv.all_reduce_dtype,
    )


def check_task_args(cluster, task, cluster_path: str, args: list[str], files_here: bool = True):
    """What a task started with `args` (cluster/commandline.py's `train ...`) will check first, checked
    here from those very arguments: InvalidCluster (exit 2) before any task starts."""
    from od_dist.host import config

    fv = flags.FlagValues()
    define_train_flags(fv)
    fv(["od-dist train", *args[1:]])
    return train_config_of(fv, config.TaskConfig(cluster, task, cluster_path, ""), files_here)


def select_task(
    fv: flags.FlagValues, require_task: bool = True, allow_none: bool = False, several: bool = False
):
    from od_dist.host import config

    return config.select(
        fv.cluster,
        fv.role,
        fv.index,
        fv.allow_public_addresses,
        require_task=require_task,
        allow_none=allow_none,
        several=several,
    )


# ----- validate / tf-config -------------------------------------------------------------------


def _summary(selected) -> str:
    c = selected.cluster
    lines = [f"{selected.source}: valid, strategy {c.strategy}, num_clones {c.num_clones}"]
    for t in c.tasks():
        mark = "  <- this machine" if selected.task == t or t in selected.here else ""
        extra = " (runs no server)" if t.role == "evaluator" else ""
        lines.append(f"  {t.name:<12} {str(t.address):<28}{extra}{mark}")
    names = ", ".join(t.name for t in ((selected.task,) if selected.task else selected.here))
    lines.append(f"this machine: {names + ', ' if names else ''}{selected.machine_note}")
    return "\n".join(lines)


@command(
    "validate",
    "Check a cluster file (and this machine's place in it) without starting anything.",
    """
Checks the cluster file: YAML, keys, addresses and ports, duplicates, ps/strategy rules, and that
the entry at --role/--index is an address of this machine. Prints a summary, or every problem with
its fix (exit 2). Without --role it says which entry is this machine, or that none is (exit 0: a
file is checked on any machine before it is copied out).

Example:
  od-dist validate --cluster clusters/lan-example.yaml
""",
    define_task_flags,
)
def cmd_validate(fv) -> int:
    print(_summary(select_task(fv, require_task=False, several=True)))
    return exit_codes.OK


@command(
    "tf-config",
    "Print the TF_CONFIG JSON for one task of a cluster file.",
    """
Prints the TF_CONFIG that TensorFlow's TFConfigClusterResolver reads, for the task at
--role/--index (inferred from this machine when omitted). `master` becomes TensorFlow's `chief`;
the evaluator is left out of every other task's cluster (it runs no server).

Example:
  export TF_CONFIG=$(od-dist tf-config --cluster clusters/local.yaml --role worker --index 1)
""",
    define_task_flags,
)
def cmd_tf_config(fv) -> int:
    from od_dist.cluster.spec import tf_config_json

    selected = select_task(fv)
    print(tf_config_json(selected.cluster, selected.task.role, selected.task.index))
    return exit_codes.OK


def define_doctor_flags(fv: flags.FlagValues) -> None:
    define_task_flags(fv)
    flags.DEFINE_string(
        "pipeline",
        None,
        "Also check that the records this pipeline reads (task.train_data / "
        "task.validation_data input_path) exist here, for the tasks of this machine that read them.",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "model_dir",
        None,
        "Also check that the tasks of this machine that write the model_dir (all but the servers) "
        "can create and write it here.",
        flag_values=fv,
    )
    flags.DEFINE_float(
        "connect_timeout",
        3.0,
        "Seconds to wait for each peer's port to answer.",
        lower_bound=0.1,
        flag_values=fv,
    )


@command(
    "doctor",
    "Check what would stop a job on this machine: entry, peers, ports, versions, GPUs.",
    """
Run it on any machine of the cluster before starting the job. One line per check, each `ok`,
`warn` or `FIX` with what to do: this machine's entry in the file (--role/--index, or found by
its addresses), every peer's host name resolving, every peer's port reachable from here ("connection
refused" = nothing listening yet, fine before the job starts; no answer = a firewall drops it),
this machine's ports free (they listen on every interface: a public one is a warning), the od-dist /
TensorFlow / Model Garden versions installed here, and the GPUs here (nvidia-smi) against
num_clones, with --pipeline the records this machine's tasks read (paths resolve in the working
directory, as in training), and with --model_dir that they can write it; inside WSL2, NAT networking
(the machine's address on none of WSL's interfaces: the .wslconfig lines to set). Does not import TensorFlow. Exit 0 when nothing needs
fixing, 1 otherwise, 2 for an invalid cluster file.

Example:
  od-dist doctor --cluster clusters/lan-example.yaml --pipeline pipelines/shapes_retinanet.yaml \\
      --model_dir runs/lan
""",
    define_doctor_flags,
)
def cmd_doctor(fv) -> int:
    from od_dist.host import doctor

    if not fv.cluster:
        raise UsageError("--cluster: '': required; pass --cluster clusters/lan.yaml")
    checks, head = doctor.run(
        fv.cluster,
        fv.role,
        fv.index,
        fv.allow_public_addresses,
        fv.connect_timeout,
        pipeline=fv.pipeline,
        model_dir=fv.model_dir,
    )
    print(f"od-dist doctor: {head}")
    for check in checks:
        print(f"  {check}")
    fixes = sum(c.status == doctor.FIX for c in checks)
    print(
        f"od-dist doctor: {fixes} to fix (the FIX lines above)"
        if fixes
        else f"od-dist doctor: nothing to fix ({len(checks)} checks)",
        flush=True,
    )
    return exit_codes.FAILED if fixes else exit_codes.OK


# ----- train / eval / launch / data -----------------------------------------------------------


def _run_role(run, *args) -> int:
    """Runs a TensorFlow-side call, turning its user-facing errors into exit 1 with one line."""
    from od_dist.model.pipeline import PipelineError
    from od_dist.task.errors import TrainerError
    from od_dist.task.roles import RoleError

    try:
        return run(*args)
    except PipelineError as e:
        print(f"od-dist: {e}", file=sys.stderr)
        return exit_codes.INVALID
    except (RoleError, TrainerError) as e:
        print(f"od-dist: {e}", file=sys.stderr)
        return exit_codes.FAILED


@command(
    "train",
    "Run this machine's task (or tasks) of the cluster, or train on one machine.",
    """
Joins the cluster as --role/--index, or without them as the entry of the cluster file that is this
machine, and runs that task. The same flags work for every role, so one command line serves every
machine:
  ps, and workers under parameter_server: serve until the master finishes, then exit 0;
  master: wait for its peers (--wait_timeout), train, write checkpoints to --model_dir;
  workers under multi_worker_mirrored: train alongside the master (all-reduce);
  evaluator: evaluate each new checkpoint, exit after the final one.
A machine that holds several entries (a ps with its worker, a worker with the evaluator; every
task of a loopback cluster) runs them all when --role is left out: each as a child under one
supervisor, as `od-dist launch` does (prefixed lines, a log per task in <model_dir>/logs/, the
same restarts; Ctrl+C stops them all, exit 130; exit 0 when the master finished). A machine the
file does not list is refused. Without --cluster (and TF_CONFIG): train on this machine over
--num_clones devices.

Examples:
  od-dist train --cluster clusters/lan-example.yaml --pipeline pipelines/shapes_retinanet.yaml \\
      --model_dir runs/lan                                 # this machine's entries, found by its address
  od-dist train --cluster clusters/lan-example.yaml --role ps --index 0
  od-dist train --pipeline pipelines/shapes_retinanet.yaml --model_dir runs/one --num_clones 2 --clone_on_cpu
With --max_restarts N the task runs as a child that is restarted (up to N times, 2 s backoff,
doubling) when it is lost (a retryable exit: lost peer, signal), so a job whose machines each run
their generated script heals itself; the default 0 runs a single task in this process, as an
orchestrator (Kubernetes) that restarts pods itself expects (the evaluator always runs under a
supervisor of its own: its failures are never the job's).
""",
    lambda fv: (define_train_flags(fv), define_restart_flags(fv, 0), define_slurm_task_flag(fv)),
)
def cmd_train(fv) -> int:
    if fv.slurm:
        selected = select_slurm_task(fv)
    else:
        selected = select_task(fv, allow_none=True, several=True)
        if selected.here:  # several entries are this machine: all of them, as launch starts them
            return run_here(fv, selected.cluster, selected.here, "train")
    # From here on the task is known. A TF_CONFIG left in the environment would be read by parts of
    # TensorFlow on their own, and an orchestrator's lists the evaluator, which hangs a
    # parameter-server coordinator; every strategy here is built from the validated cluster instead.
    tf_config = os.environ.pop("TF_CONFIG", None)
    cfg = train_config_of(fv, selected)
    # The evaluator, a sidecar whose failures never stop the trainers, always runs under a
    # supervisor of its own (unless it is one's child already): without restarts too, its exit is
    # what happened to the job, never a permanent failure of its own (FailJobSet on Kubernetes).
    sidecar = cfg.role == "evaluator" and not os.environ.get(notes.NOTES_ENV)
    if fv.max_restarts or sidecar:
        from od_dist.cluster.spec import Address, Task
        from od_dist.host import launch

        args = commandline.train_args(
            passed_on_args(fv) + ["--max_restarts=0"],
            selected.cluster,
            selected.task,
            selected.source if selected.cluster and selected.source != "TF_CONFIG" else None,
        ) + (["--slurm"] if fv.slurm else [])
        task = selected.task or Task("single", 0, Address("localhost", None))
        return launch.run_task(
            task,
            cfg.strategy_name,
            launch.child_argv(args),
            fv.max_restarts,
            fv.grace_period,
            tf_config if selected.source == "TF_CONFIG" else None,
            lead=selected.cluster is None or selected.task == selected.cluster.lead_task(),
            eval_command=eval_command(fv),
        )
    from od_dist.host import console

    task = cfg.selected.task
    console.setup(
        console.task_log_path(cfg.model_dir, f"{task.role}-{task.index}" if task else "train"), fv.verbose
    )
    from od_dist.task import roles

    return _run_role(roles.run, cfg)


def define_slurm_task_flag(fv: flags.FlagValues) -> None:
    """train's own: a task's place, never passed on as a job flag (the script `od-dist slurm`
    writes adds it to its srun line)."""
    flags.DEFINE_boolean(
        "slurm",
        False,
        "A task of an srun step (the script `od-dist slurm` writes): the role and index come from "
        "the rank (SLURM_PROCID), the hosts from the step's nodes (SLURM_STEP_NODELIST) with the "
        "--cluster file's ports.",
        flag_values=fv,
    )


def select_slurm_task(fv: flags.FlagValues):
    """This srun task's place (cluster/slurm.py), with the checks select() makes: --role/--index,
    if given (a supervised child gets them), must be the rank's; the public-address rule."""
    from od_dist.cluster import slurm
    from od_dist.cluster.validate import normalize_role, problem
    from od_dist.host import config

    cluster, task, step = slurm.select(fv.cluster, os.environ)
    given = (normalize_role(fv.role), fv.index or 0)
    if fv.role is not None and given != (task.role, task.index):
        raise InvalidCluster(
            [
                problem(
                    "--role",
                    f"{given[0]} {given[1]}",
                    f"rank {step.rank} of the Slurm step is {task.name}",
                    "leave --role/--index out with --slurm",
                )
            ]
        )
    unchecked: list[str] = []
    problems = config.public_problems(cluster, fv.allow_public_addresses, unchecked)
    if problems:
        raise InvalidCluster(problems, fv.cluster)
    config.warn(unchecked)
    where = f"rank {step.rank} of the Slurm step, on {step.nodename}"
    return config.TaskConfig(cluster, task, fv.cluster, where, term_to_all=True)


def define_eval_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("pipeline", None, "The pipeline the model was trained with.", flag_values=fv)
    flags.DEFINE_string("model_dir", None, "The model_dir holding the checkpoints.", flag_values=fv)
    flags.DEFINE_string("params_override", None, "Overrides of pipeline keys, as for train.", flag_values=fv)
    define_verbose_flag(fv)


@command(
    "eval",
    "Evaluate the latest checkpoint once and print COCO AP, AP50 and AP75.",
    """
Evaluates the latest checkpoint in --model_dir on the pipeline's validation data, on this
machine, and prints the COCO metrics (also written to <model_dir>/eval_metrics.json).
Under parameter_server the master cannot compute COCO metrics in-process: this (or an evaluator
task) is how a parameter-server run gets them.

Example:
  od-dist eval --pipeline pipelines/shapes_retinanet.yaml --model_dir runs/demo
""",
    define_eval_flags,
)
def cmd_eval(fv) -> int:
    for name in ("pipeline", "model_dir"):
        if not fv[name].value:
            raise UsageError(f"--{name}: '': required; pass --{name}=...")
    if not os.path.isfile(fv.pipeline):
        raise UsageError(
            f"--pipeline: '{fv.pipeline}': no such file; pass a pipeline YAML, "
            "e.g. pipelines/shapes_retinanet.yaml"
        )
    from od_dist.host import console
    from od_dist.task import roles

    if os.path.isdir(fv.model_dir):  # no log directory in a mistyped model_dir
        console.setup(console.task_log_path(fv.model_dir, "eval"), fv.verbose)

    def evaluate():
        from od_dist.model import pipeline
        from od_dist.task import devices, trainer

        params = roles.load_params(fv.pipeline, fv.params_override, "mirrored")
        pipeline.check_inputs(params, fv.pipeline, evaluate=True)
        devices.apply_policy()
        # Its result is the trainer's one line: od-dist eval | step N | AP ... | AP50 ... | AP75 ...
        trainer.evaluate_latest(params, fv.model_dir, fv.pipeline)
        return exit_codes.OK

    return _run_role(evaluate)


@command(
    "launch",
    "Start every task of the cluster that lives on this machine, as one job.",
    """
Starts the tasks of the cluster that run on this machine (all of them for a loopback cluster such
as clusters/local.yaml) as child processes with the given train flags. Their lines are prefixed
([worker:1] ...) and each writes <model_dir>/logs/<role>-<index>.log (./od-dist-logs/ for a remote
gs://... model_dir). Exits 0 when the master has
finished and the others have stopped. A lost task (a retryable exit: lost peer, signal) is
restarted by TensorFlow's rules, up to --max_restarts times: a parameter_server worker or the
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

    if fv.role is not None or fv.index is not None:
        raise UsageError(
            "--role/--index: launch starts every task of this machine; leave them out "
            "(or use 'od-dist train' for one task)"
        )
    if not fv.cluster:
        raise UsageError("--cluster: '': required; pass --cluster clusters/local.yaml")
    unchecked: list[str] = []
    cluster = config.load_cluster(fv.cluster, fv.allow_public_addresses, unchecked)
    tasks = cluster.tasks_on(hostinfo.this_machine().is_local)  # servers first: trainers find them up
    if not tasks:
        raise UsageError(
            f"--cluster: '{fv.cluster}': no task of this cluster is on this machine; "
            "run launch on the machines the file lists"
        )
    return run_here(fv, cluster, tasks, "launch", unchecked)


def run_here(fv: flags.FlagValues, cluster, tasks, who: str, unchecked: Sequence[str] = ()) -> int:
    """Runs `tasks` (entries of this machine) as children under one supervisor, each with the train
    flags given: `launch`, and `train` without --role on a machine that holds several entries.
    What each task will be started with is checked first (exit 2 before any starts)."""
    from od_dist.host import config, launch

    # Check what every task will be started with now, rather than have each child fail on its own.
    args = {task: commandline.train_args(passed_on_args(fv), cluster, task, fv.cluster) for task in tasks}
    configs = [check_task_args(cluster, task, fv.cluster, args[task]) for task in tasks]
    if not fv.model_dir:
        raise UsageError("--model_dir: '': required (logs go to <model_dir>/logs); pass --model_dir=...")
    config.warn(list(unchecked))
    if any(not c.is_server for c in configs):
        # As `train` does, but once and before any task starts: a bad pipeline is exit 2, not a
        # job whose servers start and whose master then fails.
        in_sync = [c.replicas for c in configs if c.in_sync and not c.fixed_replica_batch]
        code, problem = launch.check_pipeline(
            fv.pipeline,
            fv.params_override,
            cluster.strategy,
            train=any(c.duties.is_trainer for c in configs),
            evaluate=any(c.role == "evaluator" for c in configs),
            split=max(in_sync, default=1),
        )
        if code == exit_codes.INVALID:
            raise UsageError(problem)
        if code:
            print(f"od-dist {who}: {problem}", file=sys.stderr)
            return exit_codes.FAILED
    lead = cluster.lead_task()
    return launch.run(
        cluster.strategy,
        list(tasks),
        args,
        fv.model_dir,
        fv.max_restarts,
        fv.grace_period,
        lead=lead.name if lead in tasks else None,
        eval_command=eval_command(fv),
        who=who,
    )


def eval_command(fv: flags.FlagValues) -> str:
    """The `od-dist eval` line that evaluates the job's final checkpoint (said when an evaluator
    gave up)."""
    import shlex

    args = ["od-dist", "eval", f"--pipeline={fv.pipeline}", f"--model_dir={fv.model_dir}"]
    if fv.params_override:
        args.append(f"--params_override={fv.params_override}")
    return shlex.join(args)


def define_shapes_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string(
        "out", "data/shapes", "Output directory (the demo pipeline reads data/shapes).", flag_values=fv
    )
    flags.DEFINE_integer("num_train", 2000, "Training images.", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("num_val", 200, "Validation images.", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("image_size", 128, "Image side in pixels.", lower_bound=32, flag_values=fv)
    flags.DEFINE_integer("seed", 0, "Random seed: the same seed writes the same records.", flag_values=fv)


@command(
    "data shapes",
    "Write the synthetic shapes detection dataset (train/val TFRecords, label map).",
    """
Writes coloured circles, squares and triangles with exact boxes as standard detection
tf.train.Example TFRecords (train and validation splits) plus label_map.pbtxt. Reproducible
from --seed. The default --out is where pipelines/shapes_retinanet.yaml reads.

Example:
  od-dist data shapes
""",
    define_shapes_flags,
)
def cmd_data_shapes(fv) -> int:
    from od_dist.data import shapes

    summary = shapes.write_dataset(
        fv.out, num_train=fv.num_train, num_val=fv.num_val, image_size=fv.image_size, seed=fv.seed
    )
    print(
        f"wrote {fv.num_train} train and {fv.num_val} validation images to {fv.out} "
        f"in {summary.get('seconds', 0):.1f} s",
        flush=True,
    )
    return exit_codes.OK


def define_convert_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("images", None, "The folder of images.", flag_values=fv)
    flags.DEFINE_string(
        "out",
        None,
        "Output folder: train-*.tfrecord, val-*.tfrecord, label_map.pbtxt. "
        "Written under a temporary name and renamed when complete.",
        flag_values=fv,
    )
    flags.DEFINE_float(
        "val_fraction",
        0.1,
        "Share of the images held out for validation (a fixed-seed "
        "shuffle: the same files give the same split).",
        lower_bound=0.0,
        upper_bound=0.99,
        flag_values=fv,
    )
    flags.DEFINE_integer("seed", 0, "Seed of the train/val shuffle.", flag_values=fv)
    flags.DEFINE_boolean(
        "skip_bad",
        False,
        "Convert without the annotation files that have problems "
        "(and say how many) instead of stopping with exit 2.",
        flag_values=fv,
    )


def define_voc_flags(fv: flags.FlagValues) -> None:
    define_convert_flags(fv)
    flags.DEFINE_multi_string(
        "annotations",
        None,
        "The folder of Pascal VOC / labelImg .xml files (searched recursively), or .xml files. " + SEVERAL,
        flag_values=fv,
    )
    flags.DEFINE_string(
        "labels",
        None,
        "The classes, as an Object Detection API label_map.pbtxt or one "
        "name per line (ids from 1 in that order); any other class is an error. "
        "Default: every class found, sorted by name.",
        flag_values=fv,
    )


def _convert(what: str, run, unit: str = "annotation file(s)") -> int:
    from od_dist.data import records

    try:
        written, skipped = run()
    except records.DatasetError as e:
        raise UsageError(str(e)) from None
    except records.ProblemsReported:
        return exit_codes.INVALID  # already printed, one line per problem
    except records.BadAnnotation as e:  # found while writing (a file changed since it was checked)
        print(f"od-dist {what}: {e}; nothing written", file=sys.stderr)
        return exit_codes.INVALID
    records.print_summary(written, skipped, unit=unit)
    return exit_codes.OK


def _require(fv, *names: str) -> None:
    for name in names:
        if not fv[name].value:
            raise UsageError(f"--{name}: '': required; pass --{name}=...")


@command(
    "data voc",
    "Convert Pascal VOC / labelImg XML to TFRecords (train/val) and label_map.pbtxt.",
    """
Reads every .xml under --annotations (Pascal VOC, as labelImg saves it) and its image from
--images, checks each against its image (readable XML, image present, boxes inside, known classes),
and writes Model Garden detection records: sharded train-*.tfrecord and val-*.tfrecord (normalized
boxes, class ids from 1, numeric source ids) and label_map.pbtxt. VOC's 1-based pixel coordinates
are converted exactly; `difficult` objects are kept as is_crowd=1, which Model Garden leaves out of
training and COCO evaluation ignores. Any problem: one line per file and exit 2, nothing written
(or --skip_bad). Prints the num_classes and input paths a pipeline needs.

Example:
  od-dist data voc --images my_data/images --annotations my_data/annotations --out data/my_data
""",
    define_voc_flags,
    lists=("annotations",),
)
def cmd_data_voc(fv) -> int:
    from od_dist.data import voc

    _require(fv, "images", "annotations", "out")
    return _convert(
        "data voc",
        lambda: voc.convert(
            fv.images, fv.annotations, fv.out, fv.val_fraction, fv.labels, fv.skip_bad, fv.seed
        ),
    )


def define_coco_flags(fv: flags.FlagValues) -> None:
    define_convert_flags(fv)
    flags.DEFINE_string(
        "annotations",
        None,
        "The COCO JSON (images, annotations with bbox [x, y, w, h] in pixels, categories).",
        flag_values=fv,
    )


@command(
    "data coco",
    "Convert COCO JSON to TFRecords (train/val) and label_map.pbtxt.",
    """
Reads the COCO detection JSON and its images (file_name relative to --images), checks every image
and box (image present and of the stated size, boxes inside and not empty, known category and
image ids) and writes the records with Model Garden's create_coco_tf_record: sharded
train-*.tfrecord and val-*.tfrecord, image and category ids kept as in the JSON, iscrowd kept
(ignored in training and scoring), plus label_map.pbtxt. Any problem: one line each and exit 2,
nothing written (or --skip_bad to leave those images out). Prints what a pipeline needs.

Example:
  od-dist data coco --images my_data/images --annotations my_data/instances.json --out data/my_data
""",
    define_coco_flags,
)
def cmd_data_coco(fv) -> int:
    from od_dist.data import coco

    _require(fv, "images", "annotations", "out")
    return _convert(
        "data coco",
        lambda: coco.convert(fv.images, fv.annotations, fv.out, fv.val_fraction, fv.skip_bad, fv.seed),
        unit="image(s)",
    )


def define_odapi_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string(
        "config",
        None,
        "The Object Detection API pipeline.config whose train_input_reader / eval_input_reader "
        "input paths and label_map_path to read (instead of --train, --val, --labels).",
        flag_values=fv,
    )
    flags.DEFINE_multi_string("train", None, "The training records. " + SEVERAL, flag_values=fv)
    flags.DEFINE_multi_string("val", None, "The validation records, as --train.", flag_values=fv)
    flags.DEFINE_string(
        "labels",
        None,
        "The label_map.pbtxt: class ids by class name, as the Object Detection API reads them. "
        "Needed when records hold only class/text.",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "out",
        None,
        "Output folder: train-*.tfrecord, val-*.tfrecord, label_map.pbtxt. "
        "Written under a temporary name and renamed when complete.",
        flag_values=fv,
    )


@command(
    "data odapi",
    "Rewrite Object Detection API records (file names as source ids) for Model Garden.",
    """
Reads records written for the Object Detection API (generate_tfrecord.py and annotation tools'
exports: image/source_id holds the file name, class/text beside class/label) and writes them in
Model Garden's layout: source ids numbered 1, 2, 3, ... (COCO evaluation needs numbers), the file
name kept in image/filename, class ids by class name through --labels as the Object Detection API
takes them (a class the label map does not have is a problem), difficult objects as is_crowd.
Images and boxes are copied unchanged. Any problem: one line per record and exit 2, nothing written.

Examples:
  od-dist data odapi --config my_model/pipeline.config --out data/my_data
  od-dist data odapi --train annotations/train.record --val annotations/test.record \\
      --labels annotations/label_map.pbtxt --out data/my_data
""",
    define_odapi_flags,
    lists=("train", "val"),
)
def cmd_data_odapi(fv) -> int:
    from od_dist.data import odapi

    train, val, labels = fv.train, fv.val, fv.labels
    if fv.config:
        from od_dist.data import textproto
        from od_dist.model import odapi as config_import

        if not os.path.isfile(fv.config):
            raise UsageError(f"--config: '{fv.config}': no such file; pass the model's pipeline.config")
        with open(fv.config, encoding="utf-8", errors="replace") as f:
            try:
                found = config_import.input_paths(f.read())
            except textproto.TextFormatError as e:
                raise UsageError(f"--config: '{fv.config}': {e}") from None
        train, val, labels = train or found[0], val or found[1], labels or found[2]
    _require(fv, "out")
    for name, value in (("train", train), ("val", val)):
        if not value:
            raise UsageError(
                f"--{name}: '': required; pass --{name}=FILE.record (or --config pipeline.config)"
            )
    code = _convert("data odapi", lambda: odapi.convert(train, val, fv.out, labels), unit="record(s)")
    if code == exit_codes.OK:
        print(
            f"next: od-dist pipeline import --config {fv.config or 'pipeline.config'} --data {fv.out} "
            "--out pipelines/my_model.yaml",
            flush=True,
        )
    return code


def define_check_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string(
        "pipeline",
        None,
        "Check the train and validation records of this pipeline "
        "(task.train_data / task.validation_data input_path, task.model.num_classes).",
        flag_values=fv,
    )
    flags.DEFINE_multi_string("records", None, "Or check these records. " + SEVERAL, flag_values=fv)
    flags.DEFINE_integer(
        "num_classes",
        None,
        "With --records: the model's num_classes (largest class id + 1), to check the ids against.",
        lower_bound=2,
        flag_values=fv,
    )
    flags.DEFINE_string("params_override", None, "Overrides of pipeline keys, as for train.", flag_values=fv)


@command(
    "data check",
    "Read every record a pipeline would use; check images, boxes, ids; count per class.",
    """
Reads every record of the pipeline's training and validation data (or --records), decodes each
image with TensorFlow as training will, and checks: the stored size matches the image, boxes are
normalized, inside the image and not empty, class ids are in 1..num_classes-1, source ids are
numeric and unique within a split (--records: the files whose names differ only in a shard number,
e.g. val-00000-of-00004, are one split; each other file is its own). Each problem names the file,
the record index and source id. Then prints images and objects per split and per class. Exit 2
when any problem is found.

Examples:
  od-dist data check --pipeline pipelines/custom_retinanet.yaml
  od-dist data check --records 'data/my_data/val-*.tfrecord' --num_classes 4
""",
    define_check_flags,
    lists=("records",),
    rest="records",
)
def cmd_data_check(fv) -> int:
    if bool(fv.pipeline) == bool(fv.records):
        raise UsageError(
            "--pipeline/--records: pass exactly one: the pipeline whose data to check, or a records glob"
        )
    if fv.pipeline:
        from od_dist.model.pipeline import PipelineError, load_pipeline

        try:
            params = load_pipeline(fv.pipeline, fv.params_override)
        except PipelineError as e:
            raise UsageError(str(e)) from None
        splits = {
            "train": params.task.train_data.input_path,
            "validation": params.task.validation_data.input_path,
        }
        num_classes = params.task.model.num_classes
    from od_dist.data import check

    if not fv.pipeline:
        splits, num_classes = check.splits_of(fv.records), fv.num_classes

    return exit_codes.INVALID if check.check(splits, num_classes, sys.stdout) else exit_codes.OK


def define_pipeline_import_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string(
        "config", None, "The Object Detection API pipeline.config (protobuf text format).", flag_values=fv
    )
    flags.DEFINE_string("out", None, "The od-dist pipeline YAML to write.", flag_values=fv)
    flags.DEFINE_string(
        "data",
        None,
        "The folder `od-dist data odapi` wrote the records to: the pipeline reads its "
        "train-*.tfrecord and val-*.tfrecord. Default: the config's own input paths.",
        flag_values=fv,
    )
    flags.DEFINE_boolean("force", False, "Replace --out if it exists.", flag_values=fv)


@command(
    "pipeline import",
    "Turn an Object Detection API pipeline.config into an od-dist pipeline YAML.",
    """
Reads an Object Detection API pipeline.config and writes the pipeline for the closest Model Garden
experiment: SSD with a MobileNet feature extractor -> retinanet_mobile_coco with a MobileNet
backbone and FPN; SSD with a ResNet FPN -> retinanet_resnetfpn_coco; EfficientDet -> RetinaNet with
an EfficientNet backbone and an FPN for its BiFPN; Faster R-CNN with a ResNet ->
fasterrcnn_resnetfpn_coco; CenterNet (Hourglass, ResNet; boxes) -> Model Garden's CenterNet project,
centernet_hourglass_coco. Carries num_classes (+1 for the background), image size, batch size,
steps, learning-rate schedule and warmup, optimizer, the augmentations Model Garden has, anchors,
NMS, input paths and label map; prints every setting that does not carry over, one line each, with
why. The YAML is checked with the pipeline loader before it is put in place.

Example:
  od-dist pipeline import --config my_model/pipeline.config --data data/my_data --out pipelines/my_model.yaml
""",
    define_pipeline_import_flags,
)
def cmd_pipeline_import(fv) -> int:
    _require(fv, "config", "out")
    from od_dist.data import textproto
    from od_dist.model import odapi

    if not os.path.isfile(fv.config):
        raise UsageError(f"--config: '{fv.config}': no such file; pass the model's pipeline.config")
    if os.path.exists(fv.out) and not fv.force:
        raise UsageError(f"--out: '{fv.out}': exists; choose another --out or pass --force to replace it")
    with open(fv.config, encoding="utf-8", errors="replace") as f:
        text = f.read()
    try:
        imported = odapi.convert(text, fv.data)
    except textproto.TextFormatError as e:
        raise UsageError(f"--config: '{fv.config}': {e}") from None
    except odapi.ImportProblem as e:
        raise UsageError(f"--config: '{fv.config}': {e}") from None

    def check(path):
        from od_dist.model.pipeline import PipelineError, load_pipeline

        try:
            load_pipeline(path)
        except PipelineError as e:
            raise odapi.ImportProblem(f"the written pipeline does not load ({e}); nothing written") from None

    try:
        odapi.write(odapi.render(imported, fv.config), fv.out, fv.force, check)
    except odapi.ImportProblem as e:
        raise UsageError(str(e)) from None
    for note in imported.notes:
        print(f"not carried over: {note}")
    for warning in imported.warnings:
        print(f"warning: {warning}")
    print(
        f"wrote {fv.out}: experiment {imported.experiment}, {len(imported.notes)} setting(s) not carried over"
    )
    if not fv.data:
        print(_records_layout_note(fv.config, text, fv.out))
    print(f"next: od-dist data check --pipeline {fv.out}", flush=True)
    return exit_codes.OK


def _records_layout_note(config: str, text: str, out: str) -> str:
    """What `pipeline import` without --data says of the config's own records: when they are here
    and hold file names as source ids, the exact commands that rewrite them and import again."""
    from od_dist.data import records
    from od_dist.model import odapi

    rewrite = f"od-dist data odapi --config {config} --out DIR"
    val = odapi.input_paths(text)[1]
    files = records.match_files(val)
    sid = records.file_name_source_id(files)
    if sid is None:
        state = "numeric source ids" if files else "not found on this machine"
        return (
            f"input paths: as in the config ({state}); records in the Object Detection API's layout "
            f"(file names as image/source_id) are rewritten once with: {rewrite}, then import again "
            "with --data DIR"
        )
    data = os.path.join("data", os.path.splitext(os.path.basename(out))[0])
    return (
        f"records: {files[0]} holds file names as image/source_id ('{sid}'), the Object Detection API's "
        "layout, which Model Garden's COCO evaluation cannot read (training can); rewrite them once "
        f"and import again: od-dist data odapi --config {config} --out {data} && od-dist pipeline "
        f"import --config {config} --data {data} --out {out} --force"
    )


# ----- export / predict / report --------------------------------------------------------------


def define_export_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("pipeline", None, "The pipeline the model was trained with.", flag_values=fv)
    flags.DEFINE_string(
        "model_dir", None, "The run's model_dir; its latest checkpoint is exported.", flag_values=fv
    )
    flags.DEFINE_string(
        "out",
        None,
        "The SavedModel folder to write (an earlier export there is replaced; other files stay).",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "checkpoint",
        None,
        "Export this checkpoint (e.g. runs/x/ckpt-500) instead of the latest.",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "labels",
        None,
        "The label_map.pbtxt to ship with the model. Default: the one "
        "beside the pipeline's training records.",
        flag_values=fv,
    )
    flags.DEFINE_string("params_override", None, "Overrides of pipeline keys, as for train.", flag_values=fv)
    flags.DEFINE_float(
        "min_score",
        None,
        "The model drops detections scored below this (its NMS never sees them); `od-dist predict "
        "--min_score` can only raise it. Default: the pipeline's "
        "task.model.detection_generator.pre_nms_score_threshold (0.05 in Model Garden's detectors).",
        lower_bound=0.0,
        upper_bound=1.0,
        flag_values=fv,
    )


@command(
    "export",
    "Export a trained checkpoint as a SavedModel for serving (image-tensor input).",
    """
Writes a TensorFlow SavedModel of the latest checkpoint in --model_dir (or --checkpoint) with
Model Garden's exporter. Its serving_default signature takes uint8 images [1, H, W, 3] of any size
and returns detection_boxes ([ymin, xmin, ymax, xmax], normalized to the original image),
detection_scores, detection_classes (ids from 1) and num_detections. The training data's
label_map.pbtxt is copied beside it for `od-dist predict`.

Example:
  od-dist export --pipeline pipelines/shapes_retinanet.yaml --model_dir runs/demo --out exported/demo
""",
    define_export_flags,
)
def cmd_export(fv) -> int:
    _require(fv, "pipeline", "model_dir", "out")
    from od_dist.model import export
    from od_dist.model.pipeline import PipelineError, load_pipeline

    try:
        params = load_pipeline(fv.pipeline, fv.params_override)
        done = export.export(params, fv.model_dir, fv.out, fv.checkpoint, fv.labels, fv.min_score)
    except PipelineError as e:
        raise UsageError(str(e)) from None
    except export.ExportError as e:
        print(f"od-dist export: {e}", file=sys.stderr)
        return exit_codes.FAILED if "no checkpoint" in str(e) else exit_codes.INVALID
    print(
        f"exported {done['checkpoint']} to {done['out']} (input: uint8 images of any size, resized to "
        f"{done['input_size'][0]}x{done['input_size'][1]} inside; detections scored from "
        f"{done['min_score']:g}; label map: "
        f"{done['label_map'] or 'none found, classes will show as ids'})",
        flush=True,
    )
    return exit_codes.OK


def define_predict_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("model", None, "The SavedModel folder written by `od-dist export`.", flag_values=fv)
    flags.DEFINE_multi_string("images", None, "Image files or folders of images. " + SEVERAL, flag_values=fv)
    flags.DEFINE_string("out", None, "Folder for the drawn PNGs and detections.json.", flag_values=fv)
    flags.DEFINE_float(
        "min_score",
        0.3,
        "Detections below this score are left out. The exported model has already dropped those "
        "below the score it was exported with (`od-dist export --min_score`, default 0.05): a lower "
        "value here shows nothing more, and says so.",
        lower_bound=0.0,
        upper_bound=1.0,
        flag_values=fv,
    )


@command(
    "predict",
    "Run an exported model on images: a PNG per image with boxes drawn, and a JSON.",
    """
Runs the SavedModel on each image (files, or every .jpg/.png/.bmp/.gif of a folder) and writes
<out>/<image name>.png, the image with each detection's box, class name and score drawn, and
<out>/detections.json: per image its path, size and detections, each a box [xmin, ymin, xmax,
ymax] in pixels of the original image, a class name and id, and a score.

Examples:
  od-dist predict --model exported/demo --images my_data/test --out predictions --min_score 0.5
  od-dist predict --model exported/demo --out predictions --images photos/*.jpg
""",
    define_predict_flags,
    lists=("images",),
    rest="images",
)
def cmd_predict(fv) -> int:
    _require(fv, "model", "images", "out")
    from od_dist.model import predict

    try:
        done = predict.predict(fv.model, list(fv.images), fv.out, fv.min_score)
    except predict.PredictError as e:
        raise UsageError(str(e)) from None
    count = sum(len(r["detections"]) for r in done["results"])
    if done["note"]:
        print(f"od-dist predict: {done['note']}", flush=True)
    print(
        f"{len(done['images'])} image(s), {count} detection(s) with score >= {fv.min_score}: "
        f"{fv.out}/*.png and {done['json']}",
        flush=True,
    )
    return exit_codes.OK


def define_report_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string(
        "model_dir", None, "The run's model_dir (its train/ and validation/ event files).", flag_values=fv
    )
    flags.DEFINE_string("out", None, "The PNG to write. Default: <model_dir>/report.png.", flag_values=fv)
    flags.DEFINE_string("title", None, "The picture's title. Default: the model_dir.", flag_values=fv)


@command(
    "report",
    "Draw a run as one PNG: loss, learning rate, steps/s, AP/AP50 over steps.",
    """
Reads the TensorBoard event files Model Garden wrote in --model_dir (train/ and validation/) and
draws training loss (total, classification, box; validation loss), learning rate, steps/s, and
COCO AP and AP50 over steps when evaluations exist, into one PNG.

Example:
  od-dist report --model_dir runs/demo            # writes runs/demo/report.png
""",
    define_report_flags,
)
def cmd_report(fv) -> int:
    _require(fv, "model_dir")
    from od_dist.model import report

    try:
        done = report.report(fv.model_dir, fv.out, fv.title)
    except report.ReportError as e:
        raise UsageError(str(e)) from None
    print(f"wrote {done['out']}", flush=True)
    return exit_codes.OK


# ----- scripts / k8s (renderers; no TensorFlow) ------------------------------------------------


def _render_input(fv, what: str):
    """The cluster and the passed-on train flags for a renderer; checks what every task will need."""
    from od_dist.host import config

    if fv.role is not None or fv.index is not None:
        raise UsageError(f"--role/--index: {what} covers every task of the cluster; leave them out")
    for name in ("cluster", "pipeline", "model_dir"):
        if not fv[name].value:
            raise UsageError(f"--{name}: '': required; pass --{name}=...")
    unchecked: list[str] = []
    cluster = config.load_cluster(fv.cluster, fv.allow_public_addresses, unchecked)
    passed_on = passed_on_args(fv)
    for task in cluster.tasks():  # as launch checks them; the pipeline is looked for on each machine
        check_task_args(
            cluster, task, fv.cluster, commandline.train_args(passed_on, cluster, task), files_here=False
        )
    config.warn(unchecked)  # once the input is accepted: refused input gets its one message
    return cluster, passed_on


def define_scripts_flags(fv: flags.FlagValues) -> None:
    define_train_flags(fv)
    define_restart_flags(fv, LAUNCH_MAX_RESTARTS)  # written into every script: each machine heals itself
    flags.DEFINE_string(
        "out", None, "Directory for the scripts and their README.md (created if missing).", flag_values=fv
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
after a failure.

Example:
  od-dist scripts --cluster clusters/lan-example.yaml --pipeline pipelines/shapes_retinanet.yaml \\
      --model_dir runs/lan --out scripts/lan-example
""",
    define_scripts_flags,
    refused=ONE_TASK,
)
def cmd_scripts(fv) -> int:
    from od_dist.data import records
    from od_dist.render import quote, scripts

    cluster, passed_on = _render_input(fv, "scripts")
    if not fv.out:
        raise UsageError("--out: '': required; pass --out=DIR")
    passed_on += restart_args(fv)
    try:
        command = " ".join(
            quote.sh(a)
            for a in ["od-dist", "scripts", f"--cluster={fv.cluster}", *passed_on, f"--out={fv.out}"]
        )
        written = scripts.write_scripts(
            cluster, fv.cluster, passed_on, fv.out, command, fv.wait_timeout, fv.max_restarts
        )
    except (scripts.ScriptError, records.DatasetError) as e:
        raise UsageError(str(e)) from None
    machines = len({t.address.host for t in cluster.tasks()})
    print(f"wrote {len(written) - 1} scripts for {machines} machines and README.md to {fv.out}")
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
    flags.DEFINE_string("out", None, "Write the manifest here instead of to stdout.", flag_values=fv)
    flags.DEFINE_string("name", None, "The job's name. Default: od-dist-<cluster file name>.", flag_values=fv)
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
    from od_dist.data import records
    from od_dist.render import k8s

    cluster, passed_on = _render_input(fv, "k8s")
    if not fv.image:
        raise UsageError("--image: '': required; pass --image=REGISTRY/IMAGE:TAG (od-dist installed in it)")

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
            records.write_file(fv.out, text)
    except (k8s.K8sError, records.DatasetError) as e:
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
    flags.DEFINE_string("out", None, "The batch script to write (e.g. job.sbatch).", flag_values=fv)
    flags.DEFINE_string("name", None, "The job's name. Default: od-dist-<cluster file name>.", flag_values=fv)
    flags.DEFINE_string("partition", None, "#SBATCH --partition.", flag_values=fv)
    flags.DEFINE_string("time", None, "#SBATCH --time: the time limit, e.g. 2-00:00:00.", flag_values=fv)
    flags.DEFINE_integer("cpus_per_task", None, "#SBATCH --cpus-per-task.", lower_bound=1, flag_values=fv)
    flags.DEFINE_string("mem", None, "#SBATCH --mem: memory per node, e.g. 64G.", flag_values=fv)
    flags.DEFINE_integer(
        "gpus_per_task",
        None,
        "#SBATCH --gpus-per-task; Slurm sets each task's CUDA_VISIBLE_DEVICES to them. Default: the "
        "trainers' num_clones when above 1 (and not --clone_on_cpu), else none.",
        lower_bound=0,
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
from its rank and the hosts from the step's nodes (the file's ports are kept). The job's exit code
is the master's; scancel or the time limit (--signal) saves a checkpoint; sent again (or
requeued) it resumes. Logs: the job's output file, each line prefixed with its rank.

Example:
  od-dist slurm --cluster clusters/lan-example.yaml --pipeline pipelines/shapes_retinanet.yaml \\
      --model_dir runs/lan --partition gpu --time 12:00:00 --out job.sbatch
  sbatch job.sbatch
""",
    define_slurm_flags,
    refused=ONE_TASK,
)
def cmd_slurm(fv) -> int:
    from od_dist.data import records
    from od_dist.render import slurm

    cluster, passed_on = _render_input(fv, "slurm")
    if not fv.out:
        raise UsageError("--out: '': required; pass --out=job.sbatch")
    passed_on += restart_args(fv)
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
            gpus_per_task=fv.gpus_per_task,
            sbatch_lines=tuple(fv.sbatch or ()),
        )
        records.write_file(fv.out, text)
    except (slurm.SlurmError, records.DatasetError) as e:
        raise UsageError(str(e)) from None
    os.chmod(fv.out, 0o755)
    print(f"wrote {fv.out} ({len(cluster.tasks())} tasks); send it with: sbatch {fv.out}", file=sys.stderr)
    return exit_codes.OK


# ----- entry point ----------------------------------------------------------------------------


def _overview() -> str:
    width = max(len(n) for n in COMMANDS)
    rows = "\n".join(f"  {c.name:<{width}}  {c.summary}" for c in COMMANDS.values())
    return f"""od-dist: one cluster file -> a distributed TensorFlow object-detection training job.

Usage: od-dist COMMAND [--flag=value ...]    (od-dist COMMAND --help for its flags)

Commands:
{rows}

Example (the whole cluster on this machine):
  od-dist data shapes
  od-dist launch --cluster clusters/local.yaml --pipeline pipelines/shapes_retinanet.yaml --model_dir runs/demo

Exit status: {exit_codes.summary()}"""


def _help(cmd: Command, fv: flags.FlagValues) -> str:
    for name in cmd.refused:
        delattr(fv, name)
    flag_help = (
        "\n".join(
            "  " + line
            for line in fv.module_help(fv.find_module_defining_flag(next(iter(fv)))).splitlines()[1:]
        )
        if list(fv)
        else ""
    )
    return f"od-dist {cmd.name}: {cmd.summary}\n\n{cmd.usage}\n\nFlags:\n{flag_help}"


def main(argv: list[str]) -> int:
    args = argv[1:]
    if not args or args[0] in ("-h", "--help", "help"):
        print(_overview())
        return exit_codes.OK if args else exit_codes.INVALID
    for n, arg in enumerate(args, start=1):
        if "\x00" in arg:  # no operating system passes one; a caller in Python might
            print(f"od-dist: argument {n}: '{shown(arg)}' holds a NUL byte; remove it", file=sys.stderr)
            return exit_codes.INVALID
    name, rest = args[0], args[1:]
    if rest and f"{name} {rest[0]}" in COMMANDS:  # e.g. `od-dist data shapes`
        name, rest = f"{name} {rest[0]}", rest[1:]
    cmd = COMMANDS.get(name)
    if cmd is None:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"did you mean '{close[0]}'?" if close else "run 'od-dist --help' for the list"
        print(f"od-dist: unknown command '{shown(name)}'; {hint}", file=sys.stderr)
        return exit_codes.INVALID
    fv = flags.FlagValues()
    cmd.define(fv)
    if any(a in ("-h", "--help", "-help", "--helpfull") for a in rest):
        print(_help(cmd, fv))
        return exit_codes.OK
    try:
        extra = fv([f"od-dist {name}"] + _gather(rest, cmd.lists))[1:]
    except flags.Error as e:
        text = re.sub(rf"\S{{{SHOWN_MAX},}}", lambda m: shown(m.group()), str(e))  # a long value, cut
        print(f"od-dist {name}: {shown(text, 1000)}; see 'od-dist {name} --help'", file=sys.stderr)
        return exit_codes.INVALID
    if extra and cmd.rest:  # `predict --model m --out o a.jpg b.jpg`: the images
        fv[cmd.rest].value = [*(fv[cmd.rest].value or []), *extra]
        extra = []
    if extra:
        print(_stray(name, rest, extra[0], cmd.lists), file=sys.stderr)
        return exit_codes.INVALID
    try:
        return cmd.run(fv)
    except InvalidCluster as e:
        where = f" ({e.source})" if e.source else ""
        print(f"od-dist {name}: invalid input{where}:", file=sys.stderr)
        for p in e.problems:
            print(f"  {p}", file=sys.stderr)
        return exit_codes.INVALID
    except UsageError as e:
        print(f"od-dist {name}: {e}", file=sys.stderr)
        return exit_codes.INVALID
    except OSError as e:  # e.g. an --out or --model_dir that cannot be written
        where = f" '{e.filename}'" if e.filename else ""
        print(f"od-dist {name}: cannot use{where}: {e.strerror or e}", file=sys.stderr)
        return exit_codes.FAILED
    except KeyboardInterrupt:
        print(f"od-dist {name}: interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as e:  # an install that missed a step, e.g. Windows' second one
        from od_dist.host.doctor import model_garden_install

        fix = model_garden_install() if (e.name or "").split(".")[0] == "official" else "reinstall od-dist"
        print(f"od-dist {name}: {e} in this Python ({sys.executable}); {fix}", file=sys.stderr)
        return exit_codes.FAILED


def run() -> None:
    # TensorFlow's C++ INFO/WARNING lines (CUDA probing, oneDNN notes) drown the progress lines;
    # set before any command imports TensorFlow. A user's own setting wins.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # Model Garden builds its models with tf_keras (Keras 2), never `tf.keras`; without this,
    # `import tensorflow` also loads Keras 3 (and scikit-learn and matplotlib with it): about
    # 1.5 s of CPU at every TensorFlow process start, for nothing od-dist uses.
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    sys.exit(main(sys.argv))
