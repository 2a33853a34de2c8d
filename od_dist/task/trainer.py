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

import contextlib
import functools
import json
import math
import os
import re
import struct
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

from od_dist.task.stop import request_of

_PREFIX = "od-dist"


class TrainerError(RuntimeError):
    """A run that cannot proceed; the message is one line, for the user."""


class StartMismatch(TrainerError):
    """multi_worker_mirrored trainers would start apart: from different steps (model_dir not
    shared) or with different settings of what they must do alike. One line per difference."""


class Stopped(Exception):
    """Training stopped on a signal after saving a checkpoint; ``code`` is the exit status."""

    def __init__(self, code: int, step: int, path: str | None, why: str):
        super().__init__(why)
        self.code, self.step, self.path, self.why = code, step, path, why


def _format_eta(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    if h:
        return f"{h}h{m:02d}m"
    if m:
        return f"{m}m{s:02d}s"
    return f"{s}s"


def _scalar(value) -> float | None:
    try:
        import orbit

        return float(orbit.utils.get_value(value))
    except (TypeError, ValueError):
        return None


COCO_KEYS = ("AP", "AP50", "AP75", "APs", "APm", "APl", "ARmax1", "ARmax10", "ARmax100", "ARs", "ARm", "ARl")


def _controller_cls():
    """Builds the Controller subclass lazily (orbit imports TensorFlow)."""
    import orbit
    import tensorflow as tf
    from absl import logging
    from orbit import controller as orbit_controller

    # orbit prints every loop's and every evaluation's whole output dict; the od-dist progress and
    # eval lines say it in one line, so those go to the absl INFO log only (orbit 2.20's module-level _log; its other messages,
    # checkpoint saves and restores, still print).
    printing_log = orbit_controller._log
    if not getattr(printing_log, "od_dist", False):

        def quiet_train_log(message: str):
            if "| output:" in message:  # train and eval dicts; the eval one is a screenful
                logging.info(message)
            else:
                printing_log(message)

        quiet_train_log.od_dist = True
        orbit_controller._log = quiet_train_log

    class OdController(orbit.Controller):
        """orbit.Controller plus progress lines, eval JSON, and a bounded continuous eval."""

        def __init__(
            self,
            *args,
            od_model_dir: str,
            od_batch_size: int,
            od_train_steps: int,
            od_keep_waiting=None,
            od_stop=None,
            od_on_model=None,
            od_on_last_loop=None,
            od_on_loop_start=None,
            od_same_flags=None,
            **kwargs,
        ):
            self._od_same_flags = od_same_flags or {}
            self._od_on_loop_start = od_on_loop_start
            self._od_keep_waiting = od_keep_waiting
            self._od_on_last_loop = od_on_last_loop
            self._od_stop = od_stop
            self._od_model_dir = od_model_dir
            self._od_batch = od_batch_size
            self._od_train_steps = od_train_steps
            self._od_last_train_output: dict = {}
            self.last_eval: dict | None = None
            if kwargs.get("trainer") is not None:
                _create_optimizer_slots(
                    kwargs["trainer"], kwargs.get("strategy") or tf.distribute.get_strategy()
                )
            super().__init__(*args, **kwargs)
            if self.trainer is not None and self.checkpoint_manager is not None:
                self.checkpoint_manager.save = _reading_batch_norm_once(
                    self.checkpoint_manager.save, self.strategy, self.trainer.model.variables
                )
            if self.trainer is not None:
                self.train_actions = tuple(self.train_actions) + (self._od_capture,)
                if od_on_model is not None:
                    od_on_model(self.trainer.model, self.trainer.optimizer)

        def restore_checkpoint(self, checkpoint_path=None):
            # Under multi_worker_mirrored, Model Garden points a non-chief worker's
            # CheckpointManager at a temporary directory; resume it from model_dir
            # (a shared filesystem) so every worker starts from the same step.
            manager = self.checkpoint_manager
            if self.trainer is not None and checkpoint_path is None:  # training starts here
                self._od_check_same_start(tf.train.latest_checkpoint(self._od_model_dir))
            if (
                checkpoint_path is None
                and manager is not None
                and os.path.abspath(manager.directory) != os.path.abspath(self._od_model_dir)
            ):
                checkpoint_path = tf.train.latest_checkpoint(self._od_model_dir)
            if checkpoint_path and self.trainer is not None and manager is not None:
                restored = super().restore_checkpoint(checkpoint_path)
                if manager.checkpoint_interval:
                    # The master's manager counts its next save from the step it restored; this
                    # one, restored from another folder, would save at its first loop boundary.
                    # Saving is collective: trainers that disagree fail the job (a collective
                    # "Shape mismatch", exit 1) at the first boundary after a mid-interval resume.
                    manager._last_checkpoint_step = int(self.global_step.numpy())
                return restored
            if self.trainer is None and manager is not None:
                # Evaluation only: the optimizer's slots are not needed; say so, rather
                # than let TensorFlow warn about each unrestored one at exit.
                named = checkpoint_path
                checkpoint_path = checkpoint_path or manager.latest_checkpoint
                if checkpoint_path:
                    with self.strategy.scope():
                        manager.checkpoint.restore(checkpoint_path).expect_partial()
                    if named:  # orbit says it of the restore it asks for at start, not of these
                        print(f"{_PREFIX} eval | restored {checkpoint_path}", flush=True)
                    return checkpoint_path
            return super().restore_checkpoint(checkpoint_path)

        def _od_capture(self, output):
            self._od_last_train_output = output or {}

        def _od_all_trainers(self, *values: int) -> list:
            """(trainer name, *values) of every trainer: one all-gather under
            multi_worker_mirrored (every trainer must call it at the same point), else ours."""
            me = _trainer_name(self.strategy)
            if not isinstance(self.strategy, tf.distribute.MultiWorkerMirroredStrategy):
                return [(me, *values)]
            row = [_trainer_id(self.strategy), *values]
            gathered = self.strategy.gather(self.strategy.run(lambda: tf.constant([row], tf.int64)), axis=0)
            rows = {tuple(int(v) for v in r) for r in gathered.numpy().tolist()}  # one per replica
            names = _trainer_names(self.strategy)
            return sorted((names[r[0]], *r[1:]) for r in rows)

        def _od_check_same_start(self, latest: str | None):
            """Before any restore (restoring is itself collective under multi_worker_mirrored,
            and trainers that restore different steps fail in it or train apart): every trainer
            must find the same latest checkpoint in model_dir, and have the same od_same_flags
            (their all-reduces would not match: a collective's error or a hang at the first step)."""
            step = int(latest.rsplit("-", 1)[1]) if latest else 0
            flags = sorted(self._od_same_flags.items())
            starts = self._od_all_trainers(step, *(zlib.crc32(value.encode()) for _, value in flags))
            problems = []
            if len({s[1] for s in starts}) > 1:
                shown = ", ".join(f"{s[0]} at step {s[1]}" for s in starts)
                problems.append(
                    f"--model_dir: {self._od_model_dir!r}: the trainers would resume from different steps "
                    f"({shown}; 0: no checkpoint): each must see the checkpoints the master writes there; "
                    "give every trainer the same shared folder (a network share) as --model_dir"
                )
            for column, (flag, value) in enumerate(flags, start=2):
                mine = zlib.crc32(value.encode())
                others = [s[0] for s in starts if s[column] != mine]
                if others:
                    problems.append(
                        f"{flag}: {value} here, another value on {', '.join(others)}: every trainer "
                        f"needs the same {flag}; start them all with one command line"
                    )
            if problems:
                raise StartMismatch("\n".join(problems))

        def _od_stop_if_asked(self):
            """At a loop boundary: if any trainer got a stop signal, every trainer saves a
            checkpoint at this same step, then raises Stopped."""
            if self._od_stop is None:
                return
            self._od_stop.poll_peers()
            asked = [(name, code) for name, code in self._od_all_trainers(self._od_stop.code) if code]
            if not asked:
                return
            step = int(self.global_step.numpy())
            path = None
            if self.checkpoint_manager is not None:
                path = self.checkpoint_manager.save(
                    checkpoint_number=step, check_interval=False, options=self._checkpoint_options
                )
            self._sync_on_async_checkpointing()
            if not self.strategy.extended.should_checkpoint:
                path = None  # a multi_worker_mirrored worker's copy, in a temporary folder
            why = (
                self._od_stop.name
                if self._od_stop.requested
                else ", ".join(f"{name} was stopped by {request_of(code)}" for name, code in asked)
            )
            raise Stopped(max(code for _, code in asked), step, path, why)

        def _train_n_steps(self, num_steps: int):
            step0 = int(self.global_step.numpy())
            if self._od_on_loop_start is not None:
                self._od_on_loop_start()
            t0 = time.time()
            super()._train_n_steps(num_steps)
            self._od_print_progress(step0, t0)
            self._od_stop_if_asked()
            if self._od_on_last_loop is not None and int(self.global_step.numpy()) >= self._od_train_steps:
                self._od_on_last_loop()  # every trainer is past its last collective; the final save follows

        def _od_print_progress(self, step0: int, t0: float):
            elapsed = max(time.time() - t0, 1e-9)
            step = int(self.global_step.numpy())
            rate = (step - step0) / elapsed
            out = self._od_last_train_output
            loss = _scalar(out.get("total_loss", out.get("training_loss")))
            target = self._od_train_steps
            pct = 100.0 * step / target if target else 0.0
            eta = (target - step) / rate if rate > 0 else float("inf")
            loss_s = f"{loss:.4f}" if loss is not None else "?"
            print(
                f"{_PREFIX} train | step {step}/{target} ({pct:.0f}%) | loss {loss_s} | "
                f"{rate:.2f} steps/s | {rate * self._od_batch:.1f} examples/s | "
                f"ETA {_format_eta(eta)}",
                flush=True,
            )

        def evaluate(self, steps: int = -1):
            output = super().evaluate(steps)
            step = int(self.global_step.numpy())
            metrics: dict[str, Any] = {"step": step}
            for k, v in (output or {}).items():
                f = _scalar(v)
                if f is not None:
                    metrics[k] = f
            _write_metrics(self._od_model_dir, metrics)
            shown = " | ".join(f"{k} {metrics[k]:.3f}" for k in ("AP", "AP50", "AP75") if k in metrics)
            print(f"{_PREFIX} eval | step {step} | {shown}", flush=True)
            self.last_eval = metrics
            return output

        def evaluate_continuously(self, steps=-1, timeout=None, timeout_fn=None):
            """Evaluates each new checkpoint; returns after the final one (or on timeout)."""
            del timeout_fn  # Model Garden's waits forever while training is unfinished.
            directory = self._od_model_dir
            output = None
            # No timeout_fn: the iterator then ends when `timeout` passes without a new
            # checkpoint. (A timeout_fn is also consulted after EVERY checkpoint.)
            keep_waiting = self._od_keep_waiting
            stop_fn = (lambda: not keep_waiting()) if keep_waiting else None
            for path in tf.train.checkpoints_iterator(directory, timeout=timeout, timeout_fn=stop_fn):
                try:
                    self.restore_checkpoint(path)
                except (tf.errors.NotFoundError, tf.errors.DataLossError) as e:
                    # Rotated away (max_to_keep) before we read it: wait for the next one.
                    print(f"{_PREFIX} eval | skipping {path}: {type(e).__name__}", flush=True)
                    continue
                output = self.evaluate(steps)
                if int(self.global_step.numpy()) >= self._od_train_steps:
                    return output
            print(f"{_PREFIX} eval | no new checkpoint in {directory} for {timeout} s; stopping", flush=True)
            return output

    return OdController


def _create_optimizer_slots(trainer, strategy) -> None:
    """Creates the optimizer's slot variables (momentum, ...) before the first step. Made inside
    the first step instead, they make tf.function trace the whole train loop twice (variables
    created while tracing force a second trace): the demo model's first loop took 14.6-15.9 s of
    CPU, 9.5-11.3 s with the slots made here. A slot still missing is made in the first step, as
    before."""
    optimizer = getattr(trainer, "optimizer", None)
    variables = trainer.model.trainable_variables
    with strategy.scope():
        if hasattr(optimizer, "_create_all_weights"):  # Keras 2's optimizers (Model Garden's default)
            optimizer._create_all_weights(variables)
        elif hasattr(optimizer, "build"):  # Keras 3's
            optimizer.build(variables)


@contextlib.contextmanager
def _replica_copies_read():
    """While the model is built (before any restore or step), a batch-norm statistic (a
    SyncOnReadVariable) read across replicas gives this replica's copy rather than all-reducing
    the copies: each replica holds the same initial value then, so the all-reduce gives the same
    tensor. Keras reads two per batch-norm layer as it builds; under multi_worker_mirrored each
    one is a collective op, 256 for the demo's model."""
    from tensorflow.python.distribute import values

    all_reduced = values.SyncOnReadVariable._get_cross_replica
    values.SyncOnReadVariable._get_cross_replica = lambda self: self._get_on_device_or_primary()
    try:
        yield
    finally:
        values.SyncOnReadVariable._get_cross_replica = all_reduced


def _reading_batch_norm_once(save, strategy, variables):
    """``save`` (a CheckpointManager's), reading the model's batch-norm statistics for the
    checkpoint in one batched all-reduce under multi_worker_mirrored. TensorFlow saves a
    SyncOnReadVariable's mean over the replicas, read eagerly one variable at a time: one collective
    and one new thread pool each, 3.3 s per save for the demo's 256 statistics (about 0.1 s on one
    machine). The values saved are the same means."""
    import tensorflow as tf
    from tensorflow.python.distribute import values

    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return save
    means = [
        v
        for v in variables
        if isinstance(v, values.SyncOnReadVariable) and v.aggregation == tf.VariableAggregation.MEAN
    ]
    if not means:
        return save

    ids = {id(v) for v in means}

    @functools.wraps(save)
    def saving(*args, **kwargs):
        reduced = {}
        read_one = values.SyncOnReadVariable._get_cross_replica

        def read(var):
            if id(var) not in ids or not tf.executing_eagerly():
                return read_one(var)
            if not reduced:  # the save's first read; every trainer reads in the same order
                pairs = [(v, v) for v in means]
                results = strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.MEAN, pairs)
                reduced.update(
                    {id(v): strategy.experimental_local_results(r)[0] for v, r in zip(means, results)}
                )
            return reduced[id(var)]

        values.SyncOnReadVariable._get_cross_replica = read
        try:
            return save(*args, **kwargs)
        finally:
            values.SyncOnReadVariable._get_cross_replica = read_one

    return saving


def _resolver(strategy):
    return getattr(strategy, "_cluster_resolver", None) or getattr(strategy, "cluster_resolver", None)


def _trainer_names(strategy) -> list:
    """multi_worker_mirrored trainers by TensorFlow's id in cluster (chief 0, worker i -> i+1)."""
    resolver = _resolver(strategy)
    spec = resolver.cluster_spec() if resolver else None
    if not spec or not spec.jobs:
        return ["single"]
    return ["master:0"] + [
        f"worker:{i}" for i in range(spec.num_tasks("worker") if "worker" in spec.jobs else 0)
    ]


def _trainer_id(strategy) -> int:
    resolver = _resolver(strategy)
    if not resolver or not resolver.cluster_spec().jobs:
        return 0
    return 0 if resolver.task_type == "chief" else int(resolver.task_id) + 1


def _trainer_name(strategy) -> str:
    return _trainer_names(strategy)[_trainer_id(strategy)]


def _num_ps_workers(strategy) -> int:
    """Workers of a ParameterServerStrategy (0 for any other strategy)."""
    import tensorflow as tf

    if not isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        return 0
    resolver = (
        getattr(strategy, "_cluster_resolver", None)  # set by TF 2.20
        or strategy.cluster_resolver
    )
    if resolver is None:
        return int(getattr(strategy, "_num_workers", 1))
    return resolver.cluster_spec().num_tasks("worker")


def _spread_trainer_cls():
    """Model Garden's Trainer, scheduling each loop on every parameter-server worker.

    Under ParameterServerStrategy, Model Garden schedules a whole loop (steps_per_loop
    steps) as ONE closure, so one worker trains while the others wait. This subclass
    splits the loop's steps into one closure per worker; the coordinator still joins
    at the end of the loop, so global_step, summaries and checkpoints are unchanged.
    """
    import orbit
    import tensorflow as tf
    from official.core import base_trainer

    class SpreadTrainer(base_trainer.Trainer):
        def create_train_loop_fn(self):
            if not getattr(self, "_is_async", False):
                return super().create_train_loop_fn()
            loop_fn = orbit.StandardTrainer.create_train_loop_fn(self)
            workers = max(1, _num_ps_workers(self.strategy))
            coordinator = self.coordinator_for_async()

            def spread_loop_fn(iterator, num_steps):
                total = int(num_steps.numpy() if hasattr(num_steps, "numpy") else num_steps)
                base, extra = divmod(total, workers)
                for i in range(workers):
                    n = base + (1 if i < extra else 0)
                    if n:
                        coordinator.schedule(loop_fn, args=(iterator, tf.constant(n, tf.int32)))

            return spread_loop_fn

    return SpreadTrainer


def _write_metrics(model_dir: str, metrics: dict) -> None:
    import tensorflow as tf

    text = json.dumps(metrics, indent=2, sort_keys=True) + "\n"
    vdir = os.path.join(model_dir, "validation")
    tf.io.gfile.makedirs(vdir)
    for path in (
        os.path.join(vdir, f"metrics-{metrics['step']}.json"),
        os.path.join(model_dir, "eval_metrics.json"),
    ):
        tmp = path + ".tmp"
        with tf.io.gfile.GFile(tmp, "w") as f:
            f.write(text)
        tf.io.gfile.rename(tmp, path, overwrite=True)


def _prepare(params) -> None:
    from official.modeling import performance

    from od_dist.model.pipeline import import_model_garden

    import_model_garden()

    if params.runtime.mixed_precision_dtype:
        performance.set_mixed_precision_policy(params.runtime.mixed_precision_dtype)


def variable_bytes(model, wire=None) -> tuple[int, int]:
    """(bytes of all the model's variables, bytes of its trainable ones: a step's gradients).
    `wire`: the dtype float32 gradients are all-reduced in (strategy.reduce_gradients_in)."""

    def size(variables, sent_as):
        return sum(
            v.shape.num_elements()
            * (sent_as.size if sent_as is not None and v.dtype == "float32" else v.dtype.size)
            for v in variables
        )

    return size(model.variables, None), size(model.trainable_variables, wire)


def make_task(params, model_dir: str | None = None, data_threads: int = 0):
    """The pipeline's Model Garden task, its datasets built as od-dist runs them."""
    import tensorflow as tf
    from official.core import task_factory

    task = task_factory.get_task(params.task, logging_dir=model_dir)
    # Model Garden's parsers branch on Python values only, so autograph's rewrite of their source
    # (about 150 functions: 5 s of CPU at every start, most of the input pipeline's set-up) gives
    # the graph they build as written. Its augmenters (parser.aug_type: ssd_random_crop, ...) branch
    # on tensors in Python and need the rewrite.
    as_written = tf.autograph.experimental.do_not_convert(task.build_inputs)
    converted = task.build_inputs
    if data_threads:
        from od_dist.host import cpu_budget as threads

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
):
    import tensorflow as tf
    from official.core import (
        train_lib,
        train_utils,
    )

    from od_dist.model import pipeline

    _prepare(params)
    strategy = strategy or tf.distribute.get_strategy()
    with strategy.scope():
        task = make_task(params, model_dir, data_threads)
        # Built once and checked (a model that cannot be built is one line naming the pipeline's
        # key, not a traceback at the first step), here rather than in Model Garden's
        # create_trainer, whose gin wrapper would add its own line to that error.
        with _replica_copies_read():
            model = pipeline.check_model(params, pipeline_path, task.build_model)
        task.build_model = lambda: model
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
    )
    holder = {}

    def make_controller(**kwargs):
        holder["controller"] = controller_cls(**kwargs)
        return holder["controller"]

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
    called once the last loop has run, before the final checkpoint is saved. ``peer_requests``:
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
    with stop_mod.StopRequest(who, peer_requests) as stop:
        controller = _run(
            params,
            model_dir,
            strategy,
            "train",
            data_threads=data_threads,
            stop=stop,
            on_last_loop=on_last_loop,
            on_model=on_model,
            pipeline_path=pipeline_path,
            on_loop_start=on_loop_start,
            same_flags=same_flags,
        )
    step = int(controller.global_step.numpy())
    print(
        f"{_PREFIX} train | done at step {step} in {time.time() - start:.1f} s; checkpoints in {model_dir}",
        flush=True,
    )
    return step


_CHECKPOINT_FILE = re.compile(r"^(ckpt-(\d+))(\.index|\.data-\d+-of-\d+|_temp)$")
SET_ASIDE = "set-aside-"  # + the time: where complete checkpoints nobody named are moved


@dataclass
class Tidied:
    """What `tidy_checkpoints` did: each is said in one line (`tidy`)."""

    removed: list[str] = field(default_factory=list)  # leftovers of saves that did not finish
    set_aside: list[tuple[str, str]] = field(default_factory=list)  # (checkpoint, the folder it went to)
    resumed: str | None = None  # a complete checkpoint newer than any named, now named latest
    named: str | None = None  # the latest one the state file named before


# The last 8 bytes of every TensorFlow table, as a checkpoint's index is (lib/io/format.h): an
# index written only in part, or not an index at all, lacks them.
_TABLE_MAGIC = struct.pack("<Q", 0xDB4775248B80FB57)


def _complete(prefix: str, names: set[str]) -> bool:
    """True when the checkpoint at `prefix` reads back whole: its index, and every tensor it lists
    from the data shards (which is what a restore will need). False only when it is proven
    incomplete: no index among `names` (the folder's listing), an index that is not a checkpoint
    index (a save stopped while writing it), a data shard the folder does not hold, or one cut
    short. Any other error (permissions, a network file system's, a folder where a file should be)
    proves nothing: TrainerError naming the file, and nothing is removed."""
    import tensorflow as tf

    stem = os.path.basename(prefix)
    if stem + ".index" not in names:
        return False
    try:
        with tf.io.gfile.GFile(prefix + ".index", "rb") as f:
            index = f.read()
    except tf.errors.OpError as e:
        raise _unreadable(prefix + ".index", e) from None
    if len(index) < 48 or not index.endswith(_TABLE_MAGIC):  # 48: a table's footer
        return False
    shards = [re.fullmatch(re.escape(stem) + r"\.data-(\d+)-of-(\d+)", n) for n in names]
    shards = [(int(m.group(1)), int(m.group(2))) for m in shards if m]
    if not any(set(range(n)) <= {i for i, k in shards if k == n} for _, n in shards):
        return False  # every save writes shards 0..n-1 of n (n >= 1): no such whole set here
    try:
        reader = tf.train.load_checkpoint(prefix)
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)
    except IndexError:  # the reader met the end of a data shard before a tensor's last byte
        return False
    except (tf.errors.OpError, ValueError) as e:
        missing = re.search(r"(\S+); No such file or directory", str(e))
        if missing and os.path.basename(missing.group(1)) not in names:
            return False  # a shard the index names (of another count) that the folder does not hold
        raise _unreadable(prefix + ".data-*", e) from None
    return True


def _unreadable(path: str, error: Exception) -> TrainerError:
    message = (getattr(error, "message", None) or str(error)).strip().splitlines()
    return TrainerError(
        f"checkpoint file {path}: {type(error).__name__}: {message[0] if message else ''}; cannot tell "
        "whether that checkpoint is complete, so nothing in the model_dir was removed: fix the access "
        "to it (or move it out of the model_dir) and start again"
    )


def tidy_checkpoints(model_dir: str) -> Tidied:
    """Puts ``model_dir``'s checkpoints in order before a run restores one; returns what it did.

    TensorFlow writes a checkpoint's shards under ``ckpt-N_temp/`` (each first as a
    ``*.tempstate*`` file), renames them to ``ckpt-N.data-*``, writes ``ckpt-N.index`` (in place,
    not atomically), and only then names ``ckpt-N`` in the ``checkpoint`` state file (replaced
    atomically), which is what every reader (restore, the evaluator) goes by. So:

    - temporary shards and ``*.tempstate*`` files are leftovers of a save that did not finish:
      removed;
    - a ``ckpt-N`` the state file does not name is removed only when it is proven incomplete (no
      index, an index that is not a checkpoint index, a data shard missing or cut short: see
      `_complete`); one that fails to read for another reason (permissions, a network file
      system) stops the run in one line (TrainerError) before anything at all is removed;
    - a complete one it does not name (a save killed after its last byte and before the state file
      named it, or a checkpoint a user copied in to resume from) is never removed: the newest of
      them, when newer than every named one, is named the latest and the run resumes from it;
      any other is moved into ``<model_dir>/set-aside-<time>/``.

    Without a state file every complete ``ckpt-N`` is unnamed (files copied into a new model_dir).
    With one that does not read (a transient error of a network share) nothing says which
    checkpoint the run was at: only the temporary files go, the state file is left as it is.
    """
    import tensorflow as tf

    done = Tidied()
    if not tf.io.gfile.isdir(model_dir):
        return done
    try:
        state = tf.train.get_checkpoint_state(model_dir)
        readable = True
    except (tf.errors.OpError, ValueError):  # ValueError: bytes that are not text
        state, readable = None, False
    named = [state.model_checkpoint_path, *state.all_model_checkpoint_paths] if state else []
    named_steps = {
        int(m.group(2)) for m in (_CHECKPOINT_FILE.match(os.path.basename(p) + ".index") for p in named) if m
    }
    groups: dict[int, list[str]] = {}
    names = {name.rstrip("/") for name in tf.io.gfile.listdir(model_dir)}
    leftovers = []
    for name in sorted(names):
        path = os.path.join(model_dir, name)
        m = _CHECKPOINT_FILE.match(name)
        if ".tempstate" in name or (m and m.group(3) == "_temp"):
            leftovers.append(path)
        elif m and readable and int(m.group(2)) not in named_steps:
            groups.setdefault(int(m.group(2)), []).append(path)
    # Every checkpoint judged before anything is removed: one that cannot be judged stops it all.
    complete = {
        step: paths
        for step, paths in sorted(groups.items())
        if _complete(os.path.join(model_dir, f"ckpt-{step}"), names)
    }
    for path in leftovers + [
        p for step, paths in sorted(groups.items()) if step not in complete for p in paths
    ]:
        _remove(path)
        done.removed.append(path)
    newest = max(complete, default=-1)
    if complete and newest > max(named_steps, default=-1):
        prefix = os.path.join(model_dir, f"ckpt-{newest}")
        done.named = state.model_checkpoint_path if state else None
        kept = list(state.all_model_checkpoint_paths) if state else []
        stamps = list(state.all_model_checkpoint_timestamps) if state else []
        if len(stamps) != len(kept):
            stamps = [time.time()] * len(kept)
        tf.__internal__.train.update_checkpoint_state(
            model_dir,
            prefix,
            [*kept, prefix],
            save_relative_paths=True,  # as TensorFlow's CheckpointManager writes it
            all_model_checkpoint_timestamps=[*stamps, tf.io.gfile.stat(prefix + ".index").mtime_nsec / 1e9],
            last_preserved_timestamp=state.last_preserved_timestamp if state else None,
        )
        done.resumed = prefix
        del complete[newest]
    if complete:
        aside = os.path.join(model_dir, SET_ASIDE + time.strftime("%Y%m%d-%H%M%S"))
        tf.io.gfile.makedirs(aside)
        for step, paths in complete.items():
            for path in paths:
                tf.io.gfile.rename(path, os.path.join(aside, os.path.basename(path)))
            done.set_aside.append((os.path.join(model_dir, f"ckpt-{step}"), aside))
    return done


def _remove(path: str) -> None:
    import tensorflow as tf

    if tf.io.gfile.isdir(path):
        tf.io.gfile.rmtree(path)
    else:
        tf.io.gfile.remove(path)


def tidy(model_dir: str) -> Tidied:
    """`tidy_checkpoints`, each thing done said in one line. Run by the task that writes the
    checkpoints, before any trainer restores one."""
    done = tidy_checkpoints(model_dir)
    for path in done.removed:
        print(f"{_PREFIX} train | removed {path}, left by a save that did not finish", flush=True)
    for prefix, aside in done.set_aside:
        print(
            f"{_PREFIX} train | {prefix} is complete but the checkpoint file does not name it and a newer "
            f"one is resumed from: moved it to {aside}",
            flush=True,
        )
    if done.resumed:
        before = (
            f"than {done.named}, the latest the checkpoint file named"
            if done.named
            else ("and the checkpoint file named none")
        )
        print(
            f"{_PREFIX} train | {done.resumed} is complete and newer {before} (a save stopped before "
            "naming it, or a checkpoint copied in): resuming from it",
            flush=True,
        )
    return done


def _eval_params(params):
    """A copy for in-process evaluation: plain loop, whole validation split allowed."""
    params = params.replace()
    params.override(
        {"trainer": {"eval_tf_while_loop": False}, "runtime": {"distribution_strategy": "mirrored"}},
        is_strict=True,
    )
    return params


def evaluate_latest(params, model_dir: str, pipeline_path: str = "the pipeline") -> dict:
    """Evaluates the latest checkpoint in ``model_dir`` once on the validation split.

    Returns the metrics (``step``, COCO ``AP``, ``AP50``, ``AP75``, ``APs`` ... ``ARl``,
    validation losses) as floats, and writes them to ``<model_dir>/eval_metrics.json``,
    ``<model_dir>/validation/metrics-STEP.json`` and TensorBoard (``validation/``).
    """
    import tensorflow as tf

    latest = tf.train.latest_checkpoint(model_dir)
    if not latest:
        raise TrainerError(
            f"model_dir '{model_dir}': no checkpoint to evaluate; train first "
            "(or pass the model_dir the trainer writes)"
        )
    controller = _run(_eval_params(params), model_dir, None, "eval", pipeline_path=pipeline_path)
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
