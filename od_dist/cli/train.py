"""`od-dist train` and `eval`: run a task of the cluster (or this machine's several, under one
supervisor: `run_here`, which `launch` shares), or evaluate a checkpoint. TensorFlow is imported
inside the commands."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

from absl import flags

from od_dist.cli.flags import (
    check_task_args,
    define_restart_flags,
    define_train_flags,
    define_trained_model_flags,
    define_verbose_flag,
    passed_on_args,
    require,
    select_task,
    train_config_of,
)
from od_dist.cli.registry import UsageError, command
from od_dist.cluster import commandline
from od_dist.cluster.spec import InvalidCluster
from od_dist.protocol import exit_codes, notes


def honour_ctrl_c() -> None:
    """`train` and `launch`: a command a script starts in the background inherits SIGINT ignored.
    od-dist's stop handlers take it during training anyway, so from the start too: Ctrl+C (kill
    -INT) stops the job at any moment, however the command was started."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _run_role(run, *args) -> int:
    """Runs a TensorFlow-side call, turning its user-facing errors into one line: exit 2 for invalid
    input (a pipeline, devices this machine lacks), 1 otherwise."""
    from od_dist.model.pipeline import PipelineError
    from od_dist.task.devices import DeviceError
    from od_dist.task.errors import TrainerError
    from od_dist.task.roles import RoleError

    try:
        return run(*args)
    except (PipelineError, DeviceError) as e:  # devices this machine does not have: invalid input
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
With --max_restarts N the task runs as a child that is restarted (up to N times in a row, 2 s
backoff, doubling; see the flag) when it is lost (a retryable exit: lost peer, signal), so a job whose machines each run
their generated script heals itself; the default 0 runs a single task in this process, as an
orchestrator (Kubernetes) that restarts pods itself expects (the evaluator always runs under a
supervisor of its own: its failures are never the job's). With min_trainers in the cluster file
the trainer machines' supervisors agree each round's group on membership_port: the trainers up go on
without a lost machine (under parameter_server, the master's: a worker then coordinates) and take it
back when it returns (docs/faults.md).
""",
    lambda fv: (
        define_train_flags(fv),
        define_restart_flags(fv, 0),
        define_slurm_task_flag(fv),
        define_new_run_flag(fv),
    ),
)
def cmd_train(fv) -> int:
    honour_ctrl_c()
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
    own = selected.task  # its name in the cluster file, whatever its place in an elastic round
    selected = _in_group(fv, selected)
    cfg = train_config_of(fv, selected)
    if fv.new_run:  # only once every flag is accepted: a refused command moves nothing aside
        start_afresh(fv.model_dir)
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
            model_dir=fv.model_dir,
            term_to_all=selected.term_to_all,
            elastic=elastic_for(fv, selected.cluster, [selected.task]),
        )
    from od_dist.host import console

    console.setup(
        console.task_log_path(cfg.model_dir, f"{own.role}-{own.index}" if own else "train"), fv.verbose
    )
    from od_dist.task import roles

    return _run_role(roles.run, cfg)


def _in_group(fv: flags.FlagValues, selected):
    """A trainer of an elastic job (the cluster file's min_trainers) trains in the round its
    supervisor agreed with the other trainer machines (host/elastic.py): the cluster of that round's
    members, in which its place may differ from the file's. Outside a supervisor there is no round
    to train in: refused."""
    import dataclasses

    from od_dist.cluster.messages import problem
    from od_dist.cluster.spec import MEMBER_ROLES, PARAMETER_SERVER
    from od_dist.protocol import membership

    cluster, task = selected.cluster, selected.task
    if cluster is None or task is None or not cluster.min_trainers or fv.slurm:
        return selected
    if task.role not in MEMBER_ROLES:
        return selected
    group = membership.group_from_env()
    if group is None:
        if fv.max_restarts:
            return selected  # its supervisor (this command) agrees the round
        raise UsageError(
            problem(
                "--max_restarts",
                0,
                f"min_trainers: {cluster.min_trainers} in the cluster file needs this machine's od-dist to "
                "agree each round with the other trainer machines",
                "pass --max_restarts 3 (the generated scripts do)",
            )
        )
    if task.name not in group.members:
        raise UsageError(f"{task.name} is not a member of round {group.round} ({', '.join(group.members)})")
    place = cluster.in_group(task, group.members)
    if place.role == "master" and cluster.strategy == PARAMETER_SERVER:
        here = "it coordinates the round"
    else:
        here = f"TensorFlow's {place.tf_job} {place.index} here"
    print(
        f"{task.name}: round {group.round} of an elastic job: {', '.join(group.members)} train; {here}",
        flush=True,
    )
    return dataclasses.replace(selected, cluster=cluster.group(group.members), task=place)


def elastic_for(fv: flags.FlagValues, cluster, tasks):
    """(say) -> the agreement of this machine's trainers of an elastic job (host/elastic.py), or
    None: no min_trainers, no trainer here, or a Slurm job (whose srun step is one fixed group)."""
    from od_dist.cluster.spec import MEMBER_ROLES

    trainers = tuple(t for t in tasks if t and t.role in MEMBER_ROLES) if cluster else ()
    if not trainers or not cluster.min_trainers or ("slurm" in fv and fv.slurm):
        return None
    if fv.pipeline and os.path.isfile(fv.pipeline) and not fv.fixed_replica_batch:
        # A batch some group cannot split is refused now (exit 2), not at the first lost machine.
        from od_dist.cli.checks import batch_split

        batch_split(cluster, fv.pipeline, fv.params_override, fv.num_clones)
    from od_dist.host import elastic, lease
    from od_dist.model import batch, pipeline
    from od_dist.protocol import checkpoint_feed, lineage

    def batch_problem(members) -> str | None:
        if fv.fixed_replica_batch:
            return None
        try:
            problem, _, _ = batch.check_batch_split(
                cluster.group(members), fv.pipeline, fv.params_override, fv.num_clones
            )
        except pipeline.PipelineError as e:
            return str(e)
        return problem

    def newest_step() -> int | None:
        newest = checkpoint_feed.newest(fv.model_dir) if fv.model_dir else None
        return newest[0] if newest else None

    def run_of() -> str | None:
        return lineage.run_of(fv.model_dir) if fv.model_dir else None

    return lambda say: elastic.Elastic(
        cluster,
        trainers,
        say,
        fv.wait_timeout,
        newest_step,
        batch_problem,
        run_of=run_of,
        set_aside=lambda: lineage.set_aside(fv.model_dir) if fv.model_dir else None,
        recall=lambda: lineage.rounds_kept(fv.model_dir) if fv.model_dir else None,
        record=lambda kept: lineage.keep_rounds(fv.model_dir, kept) if fv.model_dir else None,
        model_dir=fv.model_dir,
        # Shorter than the workers' patience with their coordinator (host/lease.py).
        lease_s=lease.lease_for(fv.lost_peer_timeout),
    )


def define_new_run_flag(fv: flags.FlagValues) -> None:
    """train's own: done once by the command a person runs, never passed on to a task (a restart
    must not start afresh again)."""
    flags.DEFINE_boolean(
        "new_run",
        False,
        "Start a new run instead of going on with the checkpoints in --model_dir: they are moved "
        "into <model_dir>/set-aside-<time>/ (nothing is deleted) before anything starts. Pass it on "
        "every machine of the job: a machine still holding the earlier run's checkpoints is refused "
        "by the others, never taken over.",
        flag_values=fv,
    )


def start_afresh(model_dir: str | None) -> None:
    """--new_run: this machine's checkpoints set aside, said in one line."""
    from od_dist.protocol import lineage

    aside = lineage.set_aside(model_dir) if model_dir else None
    if aside:
        print(f"od-dist: --new_run: the checkpoints of {model_dir} moved to {aside}", flush=True)
    else:
        print(f"od-dist: --new_run: no checkpoint in {model_dir or 'no --model_dir'}: a new run", flush=True)


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
    from od_dist.cluster.messages import problem
    from od_dist.cluster.validate import normalize_role
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
    _take_slurm_resources(cluster, task)
    where = f"rank {step.rank} of the Slurm step, on {step.nodename}"
    return config.TaskConfig(cluster, task, fv.cluster, where, term_to_all=True)


def _take_slurm_resources(cluster, task) -> None:
    """Keeps this task's share of the node's GPUs (before TensorFlow sees any) and says on its
    console what it was given: a ps on a GPU node would otherwise see every GPU of its node."""
    from od_dist.cluster import slurm
    from od_dist.host.cpu_budget import runnable_cores

    given = os.environ.setdefault(slurm.STEP_GPUS, os.environ.get(slurm.GPUS, "unset"))
    gpus = None if given == "unset" else slurm.task_gpus(cluster, task, given)
    if gpus is not None:
        os.environ[slurm.GPUS] = gpus
    if not os.environ.get(notes.NOTES_ENV):  # a supervised task's child: its supervisor said it
        try:
            cpus = sorted(os.sched_getaffinity(0))
        except AttributeError:
            cpus = list(range(runnable_cores()))
        print(slurm.given_line(task, cpus, gpus), flush=True)


def define_eval_flags(fv: flags.FlagValues) -> None:
    define_trained_model_flags(fv, "The model_dir holding the checkpoints.")
    flags.DEFINE_string(
        "model",
        None,
        "A .tflite written by `od-dist export --format tflite`: evaluated (through LiteRT's "
        "interpreter) instead of a checkpoint of --model_dir, on the same validation records.",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "checkpoint",
        None,
        "Evaluate this checkpoint (e.g. runs/x/ckpt-500, or a folder for its latest) instead of "
        "the latest of --model_dir; the metrics are still written into --model_dir.",
        flag_values=fv,
    )
    flags.DEFINE_boolean(
        "coco_summary",
        False,
        "Also print the twelve COCO figures (AP, AP50, AP75, APs, APm, APl, ARmax1, ARmax10, "
        "ARmax100, ARs, ARm, ARl), one line each with what it means.",
        flag_values=fv,
    )
    flags.DEFINE_boolean(
        "per_class",
        False,
        "Also print AP and AP50 of each class, under the label map's names (eval_metrics.json "
        "holds them either way).",
        flag_values=fv,
    )
    define_verbose_flag(fv)


@command(
    "eval",
    "Evaluate a checkpoint (the latest by default) once and print COCO AP, AP50 and AP75.",
    """
Evaluates the latest checkpoint in --model_dir (or --checkpoint) on the pipeline's validation
data, on this machine, and prints COCO AP, AP50 and AP75; --coco_summary prints all twelve COCO
figures, --per_class AP and AP50 of each class. All of them are written to
<model_dir>/eval_metrics.json (per class as "AP/<class name>", "AP50/<class name>").
Under parameter_server the master cannot compute COCO metrics in-process: this (or an evaluator
task) is how a parameter-server run gets them. With --model x.tflite it evaluates that .tflite
instead, the same way on the same records, and prints the same line (its step: the checkpoint it
was exported from), so a quantized model's cost in AP shows beside its checkpoint's.

Examples:
  od-dist eval --pipeline pipelines/shapes_retinanet.yaml --model_dir runs/demo
  od-dist eval --pipeline pipelines/shapes_retinanet.yaml --model_dir runs/demo --checkpoint runs/demo/ckpt-1000 --coco_summary --per_class
  od-dist eval --pipeline pipelines/shapes_retinanet.yaml --model exported/demo_int8.tflite
""",
    define_eval_flags,
)
def cmd_eval(fv) -> int:
    require(fv, "pipeline")
    if not fv.model:
        require(fv, "model_dir")
    if not os.path.isfile(fv.pipeline):
        raise UsageError(
            f"--pipeline: '{fv.pipeline}': no such file; pass a pipeline YAML, "
            "e.g. pipelines/shapes_retinanet.yaml"
        )
    if fv.model:
        return _eval_tflite(fv)
    ckpt = fv.checkpoint
    if ckpt and "://" not in ckpt and not (os.path.isfile(ckpt + ".index") or os.path.isdir(ckpt)):
        raise UsageError(
            f"--checkpoint: '{ckpt}': no such checkpoint; pass a path like {fv.model_dir}/ckpt-1000 "
            "(without .index), or a folder of checkpoints"
        )
    from od_dist.host import console
    from od_dist.task import params as task_params

    if os.path.isdir(fv.model_dir):  # no log directory in a mistyped model_dir
        console.setup(console.task_log_path(fv.model_dir, "eval"), fv.verbose)

    def evaluate():
        from od_dist.model import pipeline
        from od_dist.task import devices, trainer

        params = task_params.load_params(fv.pipeline, fv.params_override, "mirrored")
        pipeline.check_inputs(params, fv.pipeline, evaluate=True)
        devices.apply_policy()
        # Its result is the trainer's one line: od-dist eval | step N | AP ... | AP50 ... | AP75 ...
        found = trainer.evaluate_latest(params, fv.model_dir, fv.pipeline, fv.checkpoint)
        _print_details(fv, params, found)
        return exit_codes.OK

    return _run_role(evaluate)


def _eval_tflite(fv) -> int:
    if fv.model_dir:
        raise UsageError(
            f"--model_dir: '{fv.model_dir}': --model evaluates the .tflite; pass one of --model and --model_dir"
        )
    if fv.checkpoint:
        raise UsageError(
            f"--checkpoint: '{fv.checkpoint}': --model evaluates the .tflite; pass one of --model and --checkpoint"
        )
    if not (fv.model.endswith(".tflite") and os.path.isfile(fv.model)):
        raise UsageError(
            f"--model: '{fv.model}': no such .tflite; pass a file `od-dist export --format tflite` wrote"
        )
    from od_dist.host import console

    # pycocotools' tables and TensorFlow's lines to <the .tflite's folder>/logs/eval.log
    console.setup(console.task_log_path(os.path.dirname(os.path.abspath(fv.model)), "eval"), fv.verbose)

    def evaluate():
        from od_dist.model import export, pipeline, tflite
        from od_dist.task import controller
        from od_dist.task import params as task_params

        params = task_params.load_params(fv.pipeline, fv.params_override, "mirrored")
        pipeline.check_inputs(params, fv.pipeline, evaluate=True)
        try:
            metrics = tflite.evaluate(params, fv.model)
        except export.ExportError as e:
            print(f"od-dist eval: {e}", file=sys.stderr)
            return exit_codes.INVALID
        print(controller.eval_line(metrics["step"], metrics), flush=True)
        _print_details(fv, params, metrics)
        return exit_codes.OK

    return _run_role(evaluate)


def _print_details(fv, params, found: dict) -> None:
    """What --coco_summary and --per_class ask for, after the eval line."""
    from od_dist.model import metrics

    if fv.coco_summary:
        print("\n".join(["COCO summary:", *metrics.summary_lines(found)]), flush=True)
    if fv.per_class:
        lines = metrics.class_lines(found, metrics.class_names(params))
        print("\n".join(["per class:", *(lines or ["  no classes in the evaluation"])]), flush=True)


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
    if "new_run" in fv and fv.new_run:  # `train` on a machine of several entries: once all are checked
        start_afresh(fv.model_dir)
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
        elastic=elastic_for(fv, cluster, tasks),
    )


def eval_command(fv: flags.FlagValues) -> str:
    """The `od-dist eval` line that evaluates the job's final checkpoint (said when an evaluator
    gave up)."""
    import shlex

    args = ["od-dist", "eval", f"--pipeline={fv.pipeline}", f"--model_dir={fv.model_dir}"]
    if fv.params_override:
        args.append(f"--params_override={fv.params_override}")
    return shlex.join(args)
