"""`od-dist validate`, `tf-config` and `doctor`: check a cluster file and this machine's place in it
without starting anything (no TensorFlow)."""

from __future__ import annotations

from absl import flags

from od_dist.cli.flags import (
    define_model_dir,
    define_params_override,
    define_pipeline,
    define_task_flags,
    require,
    select_task,
)
from od_dist.cli.registry import UsageError, command
from od_dist.protocol import exit_codes


def _summary(selected, figures=None) -> str:
    from od_dist.cluster import advice
    from od_dist.task import local_sgd

    c = selected.cluster
    lines = [f"{selected.source}: valid, strategy {c.strategy}, num_clones {c.num_clones}"]
    for t in c.tasks():
        mark = "  <- this machine" if selected.task == t or t in selected.here else ""
        extra = " (runs no server)" if t.role == "evaluator" else ""
        lines.append(f"  {t.name:<12} {str(t.address):<28}{extra}{mark}")
    if c.min_trainers:
        lines.append(
            f"elastic: the trainers up go on while at least min_trainers {c.min_trainers} of "
            f"{len(c.members())} are, agreeing each round on membership_port {c.membership_port}"
        )
    meeting = local_sgd.of_cluster(c)
    if meeting:
        lines.append(f"sync_every: {local_sgd.describe(meeting)}; checkpoints are written after a meeting")
    lines += [f"{what}: {detail}" for what, detail in advice.advise(c, figures or advice.Figures())[1]]
    names = ", ".join(t.name for t in ((selected.task,) if selected.task else selected.here))
    lines.append(f"this machine: {names + ', ' if names else ''}{selected.machine_note}")
    return "\n".join(lines)


def batch_split(cluster, pipeline_path: str, params_override: str | None = None, num_clones=None) -> str:
    """Refuses (exit 2, one line) a global batch the cluster's trainers in sync cannot share, as
    every trainer would at start (batch.check_batch_split); else what was found ('' when no
    replicas step in sync)."""
    from od_dist.model import batch, pipeline

    if cluster is None:
        return ""
    try:
        problem, said, _ = batch.check_batch_split(cluster, pipeline_path, params_override, num_clones)
    except pipeline.PipelineError as e:
        raise UsageError(str(e)) from None
    if problem:
        raise UsageError(problem)
    return said


def define_figure_flags(fv: flags.FlagValues) -> None:
    """What the prediction of each strategy's speed-up is made from (cluster/advice.py)."""
    flags.DEFINE_float(
        "step_time",
        None,
        "Seconds of one training step on one machine at its batch (e.g. 0.05 for a GPU's step: the "
        "trainer's steps/s line alone), for the expected speed-up of each strategy.",
        lower_bound=0.0,
        flag_values=fv,
    )
    flags.DEFINE_float(
        "model_mb",
        None,
        "MB of the model's float variables in float32 (weights and batch-norm statistics; 4 x the "
        "parameters), for the bytes each strategy moves a step.",
        lower_bound=0.0,
        flag_values=fv,
    )
    flags.DEFINE_float(
        "gradient_mb",
        None,
        "MB of a step's gradients in float32 (the trainable weights; the master prints it at start); "
        "default: --model_mb.",
        lower_bound=0.0,
        flag_values=fv,
    )
    flags.DEFINE_float(
        "link_mbit",
        None,
        "The link's speed between the machines, Mbit/s each way (doctor measures it otherwise).",
        lower_bound=0.001,
        flag_values=fv,
    )


def figures_of(fv):
    """The advice's figures from the flags (cluster/advice.py)."""
    from od_dist.cluster import advice

    model = fv.model_mb
    gradients = fv.gradient_mb if fv.gradient_mb is not None else model
    return advice.Figures(
        weight_bytes=None if model is None else model * 1e6,
        grad_bytes=None if gradients is None else gradients * 1e6,
        step_s=fv.step_time,
        link_bytes_per_s=None if fv.link_mbit is None else fv.link_mbit * advice.MBIT,
    )


def define_validate_flags(fv: flags.FlagValues) -> None:
    define_task_flags(fv)
    define_figure_flags(fv)
    define_pipeline(
        fv,
        "Also check that the pipeline's global batch (task.train_data.global_batch_size, as the file "
        "and --params_override write it) can be shared by the cluster's trainers in sync.",
    )
    define_params_override(fv)


@command(
    "validate",
    "Check a cluster file (and this machine's place in it) without starting anything.",
    """
Checks the cluster file: YAML, keys, addresses and ports, duplicates, ps/strategy rules, and that
the entry at --role/--index is an address of this machine. Prints a summary, or every problem with
its fix (exit 2). Without --role it says which entry is this machine, or that none is (exit 0: a
file is checked on any machine before it is copied out).

With --pipeline, also that the trainers in sync can share its global batch evenly (exit 2 naming
the batches that divide), as every trainer checks at start.

For a file across machines, each strategy's expected speed-up over one machine, N x c / (c +
bytes / link) (docs/scaling.md, What od-dist predicts), and the one recommended when --step_time,
--model_mb and --link_mbit give the figures; else the arithmetic and what it lacks.

Example:
  od-dist validate --cluster clusters/lan-example.yaml --pipeline pipelines/shapes_retinanet.yaml
""",
    define_validate_flags,
)
def cmd_validate(fv) -> int:
    selected = select_task(fv, require_task=False, several=True)
    said = batch_split(selected.cluster, fv.pipeline, fv.params_override) if fv.pipeline else ""
    print(_summary(selected, figures_of(fv)) + (f"\npipeline {fv.pipeline}: {said}" if said else ""))
    return exit_codes.OK


@command(
    "tf-config",
    "Print the TF_CONFIG JSON for one task of a cluster file.",
    """
Prints the TF_CONFIG that TensorFlow's TFConfigClusterResolver reads, for the task at
--role/--index: any task of the file, on any machine (to write another orchestrator's configs from
it, e.g. `--cluster clusters/lan-example.yaml --role master`). Without --role, this machine's task,
inferred from its addresses. `master` becomes TensorFlow's `chief`; the evaluator is left out of
every other task's cluster (it runs no server).

Example:
  export TF_CONFIG=$(od-dist tf-config --cluster clusters/local.yaml --role worker --index 1)
""",
    define_task_flags,
)
def cmd_tf_config(fv) -> int:
    from od_dist.cluster import placement, validate
    from od_dist.cluster.spec import InvalidCluster, tf_config_json
    from od_dist.host import config

    if not (fv.role and fv.cluster):  # this machine's task (or TF_CONFIG's)
        selected = select_task(fv)
        print(tf_config_json(selected.cluster, selected.task.role, selected.task.index))
        return exit_codes.OK
    # The task named, whichever machine runs it: no check that it is this one.
    unchecked: list[str] = []
    cluster = config.load_cluster(fv.cluster, fv.allow_public_addresses, unchecked)
    role, index = validate.normalize_role(fv.role), fv.index or 0
    problems = placement.check_task(cluster, role, index)
    if problems:
        raise InvalidCluster(problems, fv.cluster)
    config.warn(unchecked)
    print(tf_config_json(cluster, role, index))
    return exit_codes.OK


def define_doctor_flags(fv: flags.FlagValues) -> None:
    define_task_flags(fv)
    define_pipeline(
        fv,
        "Also check that the records this pipeline reads (task.train_data / "
        "task.validation_data input_path) exist here, for the tasks of this machine that read them.",
    )
    define_model_dir(
        fv,
        "Also check that the tasks of this machine that write the model_dir (all but the servers) "
        "can create and write it here.",
    )
    define_params_override(
        fv,
        "With --pipeline: overrides of its keys, as for train (the global batch is checked as they set it).",
    )
    flags.DEFINE_float(
        "connect_timeout",
        3.0,
        "Seconds to wait for each peer's port to answer.",
        lower_bound=0.1,
        flag_values=fv,
    )
    define_figure_flags(fv)
    flags.DEFINE_float(
        "link_test",
        0.5,
        "Seconds each way of the link test with each peer machine whose od-dist doctor answers (0: none).",
        lower_bound=0.0,
        upper_bound=3.0,
        flag_values=fv,
    )
    flags.DEFINE_float(
        "link_wait",
        0.0,
        "Seconds to wait for the doctors of the peer machines, to measure the link to each: run "
        "doctor with it on every machine within that time.",
        lower_bound=0.0,
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
TensorFlow / Model Garden versions installed here, and the GPUs here against num_clones: the
driver's (nvidia-smi) and, where it shows some, those TensorFlow lists (asked in a child process;
FIX with the GPU install when it lists none), with --pipeline the records this machine's tasks read
(paths resolve in the working directory, as in training) and the global batch against the trainers
in sync, and with --model_dir that they can write it, whether it must be shared, and on which
machine the newest checkpoint is (the lead's checkpoint feed, when it answers); inside WSL2, NAT networking
(the machine's address on none of WSL's interfaces: the .wslconfig lines to set); the link to each
peer machine whose doctor answers (bytes/s each way, over the task ports; --link_wait waits for
them), and from it, --step_time and --model_mb each strategy's expected speed-up over one machine
and the one recommended. Does not import
TensorFlow itself. Exit 0 when nothing needs
fixing, 1 otherwise, 2 for an invalid cluster file.

Example:
  od-dist doctor --cluster clusters/lan-example.yaml --pipeline pipelines/shapes_retinanet.yaml \\
      --model_dir runs/lan --step_time 0.05 --model_mb 10.6 --gradient_mb 10.4 --link_wait 30
""",
    define_doctor_flags,
)
def cmd_doctor(fv) -> int:
    from od_dist.host import doctor

    require(fv, "cluster", fix="--cluster clusters/lan.yaml")
    checks, head = doctor.run(
        fv.cluster,
        fv.role,
        fv.index,
        fv.allow_public_addresses,
        fv.connect_timeout,
        pipeline=fv.pipeline,
        model_dir=fv.model_dir,
        params_override=fv.params_override,
        figures=figures_of(fv),
        link_test=fv.link_test,
        link_wait=fv.link_wait,
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
