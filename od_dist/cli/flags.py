"""The flags several commands define, defined once, and what they become: the arguments a job's
tasks are started with, the task's configuration. No TensorFlow: imported by every command."""

from __future__ import annotations

from absl import flags

from od_dist.cli.registry import UsageError
from od_dist.cluster import commandline
from od_dist.cluster.validate import MAX_CLONES
from od_dist.host.config import ALL_REDUCE_DTYPES, ALL_REDUCE_PACKS
from od_dist.host.policy import HEALTHY_S
from od_dist.protocol.peers import LOST_PEER_TIMEOUT_S

# The help of every flag that takes several files: one wording, as `records.expand_paths` reads them.
SEVERAL = (
    "Several: one after another after the flag (as a shell expands an unquoted glob), a glob, or a "
    "comma-separated list."
)


def require(fv: flags.FlagValues, *names: str, fix: str = "") -> None:
    """Bad input (exit 2) unless each flag of `names` is given; `fix` says how (default --NAME=...)."""
    for name in names:
        if not fv[name].value:
            raise UsageError(f"--{name}: '': required; pass {fix or f'--{name}=...'}")


# ----- the flags several commands take: name, type and default here, the help each command's own ----


def define_pipeline(fv: flags.FlagValues, help: str) -> None:
    flags.DEFINE_string("pipeline", None, help, flag_values=fv)


def define_model_dir(fv: flags.FlagValues, help: str) -> None:
    flags.DEFINE_string("model_dir", None, help, flag_values=fv)


def define_params_override(
    fv: flags.FlagValues, help: str = "Overrides of pipeline keys, as for train."
) -> None:
    flags.DEFINE_string("params_override", None, help, flag_values=fv)


def define_out(fv: flags.FlagValues, help: str, default: str | None = None) -> None:
    flags.DEFINE_string("out", default, help, flag_values=fv)


def define_trained_model_flags(fv: flags.FlagValues, model_dir_help: str) -> None:
    """`eval` and `export`: the pipeline a model was trained with, its model_dir, the overrides."""
    define_pipeline(fv, "The pipeline the model was trained with.")
    define_model_dir(fv, model_dir_help)
    define_params_override(fv)


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
    define_pipeline(fv, "The pipeline: a Model Garden experiment YAML (see pipelines/).")
    define_model_dir(
        fv, "Where checkpoints, summaries and logs go; a run resumes from the latest checkpoint found here."
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
    define_params_override(
        fv,
        "A YAML string or file overriding pipeline keys, e.g. "
        "'trainer.train_steps=2000' or 'trainer: {train_steps: 2000}'.",
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
        "multi_worker_mirrored: all-reduce the gradients in at most this many packs (the master says "
        "how many), each started as soon as its gradients are computed, so the network works during the backward pass (1: one "
        "all-reduce after it, TensorFlow's default).",
        lower_bound=1,
        flag_values=fv,
    )
    flags.DEFINE_boolean(
        "ps_pack_gradients",
        True,
        "parameter_server: send each step's gradients to each ps as one tensor, cut back into each "
        "variable's there (the same values), rather than one transfer per variable as TensorFlow "
        "does; --nops_pack_gradients for TensorFlow's way.",
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
        "with every trainer from the last checkpoint. In an elastic parameter_server job "
        "(min_trainers): the same for a worker and its round's coordinator, whose lease is 0.6 x it and "
        "at least two looks at the other machines (6 s): 10 or more there.",
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


# launch's and the scripts' default, in a row (host/policy.py's Budget): the occasional lost
# process of a long run (an OOM kill, a preempted or rebooted task) never uses it up, while a task
# that dies at every start stops the job after 0 + 2 + 4 s of backoff instead of looping. `train`
# defaults to 0: see its help.
LAUNCH_MAX_RESTARTS = 3


def define_restart_flags(fv: flags.FlagValues, max_restarts: int) -> None:
    """The supervisor's flags (launch; train, whose default 0 runs the task in-process)."""
    flags.DEFINE_integer(
        "max_restarts",
        max_restarts,
        "Restarts in a row after a task is lost (a retryable exit: "
        "lost peer, SIGTERM, SIGKILL), by TensorFlow's rules: a parameter_server worker or an "
        "evaluator alone, anything else every task together from the last checkpoint; "
        "the first of them at once, the ones that follow it with no progress 2 s later, doubling. The count starts over when the job progressed since the last "
        "restart: a newer checkpoint in --model_dir, a loop that trained past every earlier start's "
        f"furthest step, or {HEALTHY_S / 60:.0f} minutes without a "
        "loss (the evaluator's own count: those minutes only), so a long run's occasional faults "
        "never use it up, while a task that fails at every start stops after that many. Permanent errors "
        "(exit 1, 2) and a person's stop (exit 130: Ctrl+C on any machine of the job) are never "
        "retried.",
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
        ps_pack_gradients=fv.ps_pack_gradients,
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
