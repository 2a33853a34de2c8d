"""Runs the Model Garden detection trainer: train, evaluate once, evaluate continuously.

All three go through ``official.core.train_lib.run_experiment`` (modes 'train', 'eval',
'continuous_eval'); od-dist adds only an ``orbit.Controller`` subclass that

- prints one progress line per loop: step, loss, steps/sec, examples/sec, ETA;
- after each evaluation prints the COCO metrics and writes them as JSON
  (``<model_dir>/eval_metrics.json``, latest, and ``<model_dir>/validation/metrics-STEP.json``);
  Model Garden writes the TensorBoard summaries (``<model_dir>/train``, ``<model_dir>/validation``);
- stops continuous evaluation right after the final checkpoint is evaluated.

Checkpoints live in ``model_dir``; a run resumes from the latest one there (Model Garden's
``CheckpointManager.restore_or_initialize``).

Evaluation (``evaluate_latest``, ``continuous_eval``) always runs in this process with the
default strategy and Python-side COCO metrics, whatever strategy trained the model: under
``parameter_server`` the coordinator cannot compute COCO metrics itself, so that is the
evaluator sidecar's job.
"""

from __future__ import annotations

import functools
import math
import re
import time
import typing

from od_dist import patches
from od_dist.model import metrics
from od_dist.protocol import checkpoint_feed
from od_dist.task.controller import _controller_cls
from od_dist.task.errors import PREFIX as _PREFIX
from od_dist.task.errors import TrainerError
from od_dist.task.group import several_trainers

_WORKER = re.compile(r"/job:worker/(?:replica:\d+/)?task:\d+")


def _num_ps_workers(strategy) -> int:
    """Workers of a ParameterServerStrategy (0 for any other strategy)."""
    import tensorflow as tf

    if not isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        return 0
    return patches.tensorflow.cluster_resolver(strategy).cluster_spec().num_tasks("worker")


# A loop whose closures end on a cancelled input iterator is run again this many times in a row
# with new iterators (SpreadTrainer.train); a dataset that truly ends fails again at once.
_ITERATOR_RETRIES = 2


def _ended_iterator(e) -> bool:
    """Whether `e` is a per-worker input iterator that gave End of sequence. The training data
    repeats forever (Model Garden's reader repeats it for training), so that is an iterator
    TensorFlow cancelled: IteratorResource::GetNext ties the iterator's own cancellation to the step
    reading it, and a step aborted while it waits for an element (a ps RPC that failed mid-step,
    which the coordinator retries as transient, on the same iterator) leaves the iterator's
    prefetch finished for good."""
    text = str(e)
    return "End of sequence" in text and "IteratorGetNext" in text


class _Loop(typing.NamedTuple):
    steps: int
    wall: float  # s, from its scheduling to the end of its join
    ran: float  # s the workers spent in its closures
    closures: int
    fetched: float  # s fetching their results
    pending: int  # closures in flight or queued as the master began to wait


class Occupancy:
    """How busy a parameter_server job's workers were kept, loop by loop, from TensorFlow's own
    coordinator metrics (patches.tensorflow.coordinator_metrics): the seconds the workers spent in
    the loop's closures against the loop's wall time, and how many closures were in flight or
    queued as the master began to wait (at fewer than one per worker, a worker had nothing to
    run). The first loop, with its tracing, is left out."""

    def __init__(self, workers: int):
        self.workers = workers
        self.loops: list[_Loop] = []
        self._start = None
        self._pending = 0

    def scheduling(self, steps: int, metrics: dict) -> None:
        self._start = (time.monotonic(), steps, metrics)

    def joining(self, metrics: dict) -> None:
        self._pending = metrics["inflight_closures"] + metrics["queued_closures"]

    def joined(self, metrics: dict) -> None:
        if self._start is None:
            return
        began, steps, before = self._start
        self._start = None
        ran, closures = (a - b for a, b in zip(metrics["closure_execution"], before["closure_execution"]))
        fetched = metrics["remote_value_fetch"][0] - before["remote_value_fetch"][0]
        self.loops.append(_Loop(steps, time.monotonic() - began, ran, closures, fetched, self._pending))

    def report(self) -> str | None:
        steady = self.loops[1:]
        if not steady:
            return None
        steps, wall, ran, closures, fetched, _ = (sum(column) for column in zip(*steady))
        # A loop of fewer steps than workers (the last, when train_steps ends it early) cannot
        # give each worker a closure: the others say whether each had one.
        full = [loop for loop in steady if loop.steps >= self.workers]
        pending = min(loop.pending for loop in full or steady)
        short = (
            f"; every loop had fewer steps than the {self.workers} workers: raise trainer.steps_per_loop to at "
            f"least {self.workers} so that every worker trains"
            if not full
            else ""
        )
        return (
            f"parameter_server, the {len(steady)} loop(s) after the first: {steps} steps in {closures} closures "
            f"on {self.workers} workers, {ran / max(steps, 1):.3f} s a step on a worker, the workers busy "
            f"{ran / max(wall * self.workers, 1e-9):.0%} of the loops' {wall:.1f} s (the rest waiting for the "
            f"slowest worker's closure and for the master between loops), results fetched in "
            f"{fetched / max(closures, 1):.3f} s a closure; at each join at least {pending} closure(s) in "
            f"flight or queued{short}"
        )


def _spread_trainer_cls():
    """Model Garden's Trainer, scheduling each loop on every parameter-server worker.

    Under ParameterServerStrategy, Model Garden schedules a whole loop (steps_per_loop
    steps) as ONE closure, so one worker trains while the others wait. This subclass
    splits the loop's steps into one closure per worker; the coordinator still joins
    at the end of the loop, so global_step, summaries and checkpoints are unchanged.

    A loop that ends on a worker's cancelled input iterator (_ended_iterator) is not a failure
    of the job: TensorFlow's coordinator retries a closure a transient ps error aborted on the
    iterator that abort cancelled, and cancels the other workers' in-flight closures (their
    iterators with them) when it raises. The loop goes on with new iterators on every worker
    for the steps it has not done (global_step counts the ones it did).
    """
    import orbit
    import tensorflow as tf
    from official.core import base_trainer

    class SpreadTrainer(base_trainer.Trainer):
        def create_train_loop_fn(self):
            if not patches.model_garden.is_async(self):
                return super().create_train_loop_fn()
            patches.orbit.check_train_iterator(self)
            loop_fn = orbit.StandardTrainer.create_train_loop_fn(self)
            workers = max(1, _num_ps_workers(self.strategy))
            coordinator = self.coordinator_for_async()
            self.occupancy = Occupancy(workers)

            def spread_loop_fn(iterator, num_steps):
                total = int(num_steps.numpy() if hasattr(num_steps, "numpy") else num_steps)
                self.occupancy.scheduling(total, patches.tensorflow.coordinator_metrics())
                base, extra = divmod(total, workers)
                for i in range(workers):
                    n = base + (1 if i < extra else 0)
                    if n:
                        coordinator.schedule(loop_fn, args=(iterator, tf.constant(n, tf.int32)))

            return spread_loop_fn

        def train_loop_end(self):
            occupancy = getattr(self, "occupancy", None)
            if occupancy is None:
                return super().train_loop_end()
            occupancy.joining(patches.tensorflow.coordinator_metrics())
            logs = super().train_loop_end()  # joins the loop's closures
            occupancy.joined(patches.tensorflow.coordinator_metrics())
            return logs

        def train(self, num_steps):
            if not patches.model_garden.is_async(self):
                return super().train(num_steps)
            total = int(num_steps.numpy() if hasattr(num_steps, "numpy") else num_steps)
            step0 = int(self.global_step.numpy())
            for retry in range(_ITERATOR_RETRIES + 1):
                try:
                    return super().train(num_steps)
                except tf.errors.OutOfRangeError as e:
                    if retry == _ITERATOR_RETRIES or not _ended_iterator(e):
                        raise
                    done = int(self.global_step.numpy()) - step0
                    where = ", ".join(sorted(set(_WORKER.findall(str(e))))) or "a worker"
                    print(
                        f"{_PREFIX} train | the input iterator on {where} ended (TensorFlow cancelled "
                        f"it with a step it aborted): new iterators on every worker; the loop goes "
                        f"on from step {step0 + done} ({done} of its {total} steps done)",
                        flush=True,
                    )
                    patches.orbit.fresh_train_iterators(self)
                    num_steps = tf.constant(max(total - done, 0), tf.int32)

    return SpreadTrainer


def _prepare(params) -> None:
    from official.modeling import performance

    from od_dist.model.pipeline import import_model_garden

    import_model_garden()

    if params.runtime.mixed_precision_dtype:
        performance.set_mixed_precision_policy(params.runtime.mixed_precision_dtype)


def variable_bytes(model, wire=None) -> tuple[int, list[int]]:
    """(bytes of all the model's variables, the bytes of each trainable one in order: a step's
    gradients, as they are all-reduced). `wire`: the dtype float32 gradients are all-reduced in
    (strategy.reduce_gradients_in)."""

    def sizes(variables, sent_as):
        return [
            v.shape.num_elements()
            * (sent_as.size if sent_as is not None and v.dtype == "float32" else v.dtype.size)
            for v in variables
        ]

    return sum(sizes(model.variables, None)), sizes(model.trainable_variables, wire)


def make_task(params, model_dir: str | None = None, data_threads: int = 0):
    """The pipeline's Model Garden task, its datasets built as od-dist runs them."""
    import tensorflow as tf
    from official.core import task_factory
    from official.vision.tasks import retinanet

    task = task_factory.get_task(params.task, logging_dir=model_dir)
    if type(task) is retinanet.RetinaNetTask:
        # Its model's build and its train step (every layer's call, the losses, the optimizer's
        # update) branch on Python values only: without autograph's rewrite of each they build the
        # same model and graph (the same weights, outputs and losses at a seed:
        # benchmarks/same_training.py), seconds sooner at every start. Other tasks keep the rewrite.
        task.build_model = tf.autograph.experimental.do_not_convert(task.build_model)
        task.train_step = tf.autograph.experimental.do_not_convert(task.train_step)
    # Model Garden's parsers branch on Python values only, so autograph's rewrite of their source
    # (about 150 functions: 5 s of CPU at every start, most of the input pipeline's set-up) gives
    # the graph they build as written. Its augmenters (parser.aug_type: ssd_random_crop, ...) branch
    # on tensors in Python and need the rewrite.
    as_written = tf.autograph.experimental.do_not_convert(task.build_inputs)
    converted = task.build_inputs
    if data_threads:
        from od_dist.task import threads

        as_written = threads.with_data_threads(as_written, data_threads)
        converted = threads.with_data_threads(converted, data_threads)

    # Orbit passes `input_context` (this replica's share of the global batch, this trainer's
    # shard of the data) only to a function whose own arguments name it: a wrapper's *args hide
    # it, and every replica would then read the whole global batch from unsharded data.
    def build_inputs(params, input_context=None):
        build = converted if _augments(params) else as_written
        return build(params, input_context=input_context)

    task.build_inputs = build_inputs
    return task


def _augments(data_params) -> bool:
    """Whether a data config's parser runs one of Model Garden's augmenters (``aug_type``)."""
    parser = getattr(data_params, "parser", None)
    aug = getattr(parser, "aug_type", None)
    return aug is not None and bool(getattr(aug, "type", None))


def _run(
    params,
    model_dir: str,
    strategy,
    mode: str,
    keep_waiting=None,
    data_threads: int = 0,
    stop=None,
    on_model=None,
    on_last_loop=None,
    pipeline_path: str = "the pipeline",
    on_loop_start=None,
    same_flags=None,
    checkpoint: str | None = None,
    local_init: bool = False,
):
    import tensorflow as tf
    from official.core import (
        train_lib,
        train_utils,
    )

    from od_dist.model import pipeline
    from od_dist.task import phases

    _prepare(params)
    strategy = strategy or tf.distribute.get_strategy()
    with strategy.scope():
        task = make_task(params, model_dir, data_threads)
        # Built once and checked (a model that cannot be built is one line naming the pipeline's
        # key, not a traceback at the first step), here rather than in Model Garden's
        # create_trainer, whose gin wrapper would add its own line to that error.
        with patches.tensorflow.replica_copies_read():
            model = pipeline.check_model(params, pipeline_path, task.build_model)
        task.build_model = lambda: model
        metrics.name_classes(task, metrics.class_names(params))
        phases.mark("model built")
        trainer_obj = None
        if mode == "train" and _num_ps_workers(strategy) > 1:
            trainer_obj = train_utils.create_trainer(
                params,
                task,
                train=True,
                evaluate=False,
                checkpoint_exporter=train_utils.maybe_create_best_ckpt_exporter(params, model_dir),
                trainer_cls=_spread_trainer_cls(),
            )
    controller_cls = functools.partial(
        _controller_cls(),
        od_model_dir=model_dir,
        od_batch_size=int(params.task.train_data.global_batch_size),
        od_train_steps=int(params.trainer.train_steps),
        od_keep_waiting=keep_waiting,
        od_stop=stop,
        od_on_model=on_model,
        od_on_last_loop=on_last_loop,
        od_on_loop_start=on_loop_start,
        od_same_flags=same_flags,
        od_max_to_keep=int(params.trainer.max_to_keep),
        od_local_init=local_init,
    )
    holder = {}

    def make_controller(**kwargs):
        manager = kwargs.get("checkpoint_manager")
        if checkpoint and manager is not None:
            # The Controller restores as it starts: this checkpoint, not the latest.
            patches.tensorflow.restore_from(manager, checkpoint)
        controller = holder["controller"] = controller_cls(**kwargs)
        patches.orbit.check_controller(controller)  # before the first step, not at a stop's save
        if controller.trainer is not None:
            # orbit's Controller restores (or initialises, or receives over the all-reduce) as it is made.
            phases.mark(f"resumed at step {int(controller.global_step.numpy())}")
            loops = []

            def first_loop(_output):
                if not loops:
                    phases.mark("first loop")
                loops.append(1)

            controller.train_actions = (first_loop,) + tuple(controller.train_actions)
        return controller

    train_lib.run_experiment(
        distribution_strategy=strategy,
        task=task,
        mode=mode,
        params=params,
        model_dir=model_dir,
        controller_cls=make_controller,
        trainer=trainer_obj,
    )
    return holder["controller"]


def train(
    params,
    model_dir: str,
    strategy,
    data_threads: int = 0,
    who: str = "single",
    on_last_loop=None,
    on_model=None,
    peer_requests=None,
    pipeline_path: str = "the pipeline",
    on_loop_start=None,
    same_flags=None,
) -> int:
    """Trains ``params`` (an ExperimentConfig) with ``strategy`` into ``model_dir``; returns the
    final step.

    Resumes from the latest checkpoint in ``model_dir``; returns at once if that
    checkpoint is already at ``trainer.train_steps``. Saves ``params.yaml`` there as
    Model Garden does (on the chief only). ``data_threads`` > 0 caps the input pipeline's
    tf.data thread pool (--data_threads). SIGTERM/SIGINT/SIGBREAK stop it at the end of the
    current loop with a checkpoint: raises Stopped (see od_dist.task.stop). ``on_last_loop`` is
    called once no peer is needed: after the last loop, before the final checkpoint is saved; with
    multi_worker_mirrored trainers, once every one of them holds it (_all_saved). ``peer_requests``:
    () -> the stop requests of peers, read at each loop boundary (stop.StopRequest.poll_peers).
    ``pipeline_path`` names the pipeline when its model cannot be built (PipelineError).
    ``on_loop_start``: called as each training loop starts (watch.LoopGuard.loop_starts).
    ``same_flags``: {flag: value} every multi_worker_mirrored trainer must share (StartMismatch).
    """
    import tensorflow as tf
    from official.core import train_utils

    from od_dist.task import stop as stop_mod

    strategy = strategy or tf.distribute.get_strategy()
    tf.io.gfile.makedirs(model_dir)
    if strategy.extended.should_checkpoint:
        train_utils.serialize_config(params, model_dir)
    # Model Garden's own SIGTERM handler (SaveCheckpointIfPreempted, multi_worker_mirrored only)
    # saves one loop later and keeps training; od-dist's stop replaces it.
    params = params.replace()
    params.override({"trainer": {"preemption_on_demand_checkpoint": False}}, is_strict=True)
    start = time.time()
    # Several multi_worker_mirrored trainers: the variables made until training resumes take each
    # trainer's own initial values (the resume sets them all to one trainer's in one broadcast:
    # controller.py), and none exits before every one holds the final checkpoint (_all_saved).
    in_sync = several_trainers(strategy)
    with (
        stop_mod.StopRequest(who, peer_requests) as stop,
        patches.tensorflow.local_initial_values(strategy, in_sync),
    ):
        controller = _run(
            params,
            model_dir,
            strategy,
            "train",
            data_threads=data_threads,
            stop=stop,
            # Trainers in sync still need their peers through the final save (the barrier below).
            on_last_loop=None if in_sync else on_last_loop,
            on_model=on_model,
            pipeline_path=pipeline_path,
            on_loop_start=on_loop_start,
            same_flags=same_flags,
            local_init=in_sync,
        )
        step = int(controller.global_step.numpy())
        occupancy = getattr(controller.trainer, "occupancy", None)
        said = occupancy.report() if occupancy is not None else None
        if said:
            print(f"{_PREFIX} train | {said}", flush=True)
        if in_sync:
            _all_saved(controller, step)
            if on_last_loop is not None:
                on_last_loop()
    print(
        f"{_PREFIX} train | done at step {step} in {time.time() - start:.1f} s; checkpoints in {model_dir}",
        flush=True,
    )
    return step


def _all_saved(controller, step: int) -> None:
    """A barrier after the final save: no trainer exits 0 before every trainer holds the final
    checkpoint. A trainer exits 0 for good (its supervisor restarts it no more), so one that exited
    while a peer died in its final save left that peer, restarted, waiting for a group that never
    came. A peer lost here fails this collective with TensorFlow's peer error (exit 138): every
    trainer restarts and resumes at the final step (from the newest copy, over the all-reduce)."""
    behind = [name for name, at in controller._od_all_trainers(_saved_step(controller)) if at != step]
    if behind:
        # A group resumed at the final step trains no loop, and orbit's final save is skipped: the
        # manager counts saves from the resumed step. Every trainer saves it (a save is collective).
        patches.tensorflow.count_saves_from(controller.checkpoint_manager, step - 1)
        patches.orbit.save_now(controller, step)
        print(f"{_PREFIX} train | ckpt-{step} saved again: {', '.join(behind)} did not hold it", flush=True)
        behind = [name for name, at in controller._od_all_trainers(_saved_step(controller)) if at != step]
    if behind:  # the trainers step in sync: a difference is a defect, never to be taken for done
        raise TrainerError(f"the final save: {', '.join(behind)} still without ckpt-{step}")


def _saved_step(controller) -> int:
    """The step of the checkpoint this trainer saved last (or resumed from); 0 for none."""
    latest = controller.checkpoint_manager.latest_checkpoint
    return int(latest.rsplit("-", 1)[1]) if latest else 0


def _eval_params(params):
    """A copy for in-process evaluation: plain loop, whole validation split allowed."""
    params = params.replace()
    params.override(
        {"trainer": {"eval_tf_while_loop": False}, "runtime": {"distribution_strategy": "mirrored"}},
        is_strict=True,
    )
    return params


def evaluate_latest(
    params, model_dir: str, pipeline_path: str = "the pipeline", checkpoint: str | None = None
) -> dict:
    """Evaluates the latest checkpoint in ``model_dir`` (or ``checkpoint``: a checkpoint path, or
    a folder of checkpoints for its latest) once on the validation split.

    Returns the metrics (``step``, COCO ``AP``, ``AP50``, ``AP75``, ``APs`` ... ``ARl``,
    ``AP/<class>`` and ``AP50/<class>`` of each class in the validation records, validation
    losses) as floats, and writes them to ``<model_dir>/eval_metrics.json``,
    ``<model_dir>/validation/metrics-STEP.json`` and TensorBoard (``validation/``).
    """
    import tensorflow as tf

    patches.check()  # `od-dist eval`: a library upgrade that breaks a patch is one line now

    if checkpoint:
        latest = tf.train.latest_checkpoint(checkpoint) if tf.io.gfile.isdir(checkpoint) else checkpoint
        if not (latest and tf.io.gfile.exists(latest + ".index")):
            raise TrainerError(
                f"--checkpoint: '{checkpoint}': no such checkpoint; pass a path like "
                f"{model_dir}/ckpt-1000 (without .index), or a folder of checkpoints"
            )
    else:
        latest = tf.train.latest_checkpoint(model_dir)
    if not latest:
        raise TrainerError(
            f"model_dir '{model_dir}': no checkpoint to evaluate; train first "
            f"(or pass the model_dir the trainer writes); {checkpoint_feed.ELSEWHERE}"
        )
    controller = _run(
        _eval_params(params),
        model_dir,
        None,
        "eval",
        pipeline_path=pipeline_path,
        checkpoint=checkpoint and latest,
    )
    if controller.last_eval is None:
        raise TrainerError(f"model_dir '{model_dir}': evaluation produced no metrics")
    return controller.last_eval


def continuous_eval(
    params, model_dir: str, timeout_s: float, keep_waiting=None, pipeline_path: str = "the pipeline"
) -> dict | None:
    """Evaluator sidecar: evaluates each new checkpoint in ``model_dir``.

    Returns the metrics of the last evaluation right after the checkpoint at
    ``trainer.train_steps`` is evaluated, or when no new checkpoint appeared for
    ``timeout_s`` seconds (None if none was ever evaluated). With ``keep_waiting``
    (a callable), it is asked every ``timeout_s`` seconds without a new checkpoint,
    and evaluation goes on waiting while it returns True.
    """
    import tensorflow as tf

    tf.io.gfile.makedirs(model_dir)
    params = _eval_params(params)
    params.override({"trainer": {"continuous_eval_timeout": int(math.ceil(timeout_s))}}, is_strict=True)
    controller = _run(params, model_dir, None, "continuous_eval", keep_waiting, pipeline_path=pipeline_path)
    return controller.last_eval
