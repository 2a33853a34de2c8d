"""The training loop's driver: orbit.Controller plus a progress line per loop, the COCO metrics
after each evaluation (printed, and written as JSON), a checkpoint and a stop at the loop boundary
after a stop signal (every multi_worker_mirrored trainer at the same step), the same start on
every trainer, and a bounded continuous evaluation."""

from __future__ import annotations

import json
import math
import os
import time
import zlib
from typing import Any

from od_dist import patches
from od_dist.protocol import exit_codes
from od_dist.task.errors import PREFIX as _PREFIX
from od_dist.task.errors import StartMismatch, Stopped


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

    patches.quiet_orbit_log(logging.info)

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
                self.checkpoint_manager.save = patches.reading_batch_norm_once(
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
                    patches.count_saves_from(manager, int(self.global_step.numpy()))
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
                path = patches.save_now(self, step)
            else:
                patches.sync_saves(self)
            if not self.strategy.extended.should_checkpoint:
                path = None  # a multi_worker_mirrored worker's copy, in a temporary folder
            why = (
                self._od_stop.name
                if self._od_stop.requested
                else ", ".join(f"{name} was stopped by {exit_codes.asked_by(code)}" for name, code in asked)
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
        patches.create_optimizer_slots(optimizer, variables)


def _trainer_names(strategy) -> list:
    """multi_worker_mirrored trainers by TensorFlow's id in cluster (chief 0, worker i -> i+1)."""
    resolver = patches.cluster_resolver(strategy)
    spec = resolver.cluster_spec() if resolver else None
    if not spec or not spec.jobs:
        return ["single"]
    return ["master:0"] + [
        f"worker:{i}" for i in range(spec.num_tasks("worker") if "worker" in spec.jobs else 0)
    ]


def _trainer_id(strategy) -> int:
    resolver = patches.cluster_resolver(strategy)
    if not resolver or not resolver.cluster_spec().jobs:
        return 0
    return 0 if resolver.task_type == "chief" else int(resolver.task_id) + 1


def _trainer_name(strategy) -> str:
    return _trainer_names(strategy)[_trainer_id(strategy)]


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
