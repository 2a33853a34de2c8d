"""The training loop's driver: orbit.Controller plus a progress line per loop, the COCO metrics
after each evaluation (printed, and written as JSON), a checkpoint and a stop at the loop boundary
after a stop signal (every multi_worker_mirrored trainer at the same step), the same start on
every trainer, and a bounded continuous evaluation."""

from __future__ import annotations

import functools
import json
import math
import os
import time
import zlib
from typing import Any

from od_dist import patches
from od_dist.cluster.spec import TF_JOB
from od_dist.protocol import exit_codes, lineage, notes
from od_dist.task import group
from od_dist.task.errors import PREFIX as _PREFIX
from od_dist.task.errors import StartMismatch, Stopped


def eval_line(step: int | None, metrics: dict) -> str:
    """The line an evaluation ends with, of a checkpoint or of a .tflite (`od-dist eval --model`)."""
    shown = " | ".join(f"{k} {metrics[k]:.3f}" for k in ("AP", "AP50", "AP75") if k in metrics)
    return f"{_PREFIX} eval | step {'?' if step is None else step} | {shown}"


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

    patches.orbit.quiet_orbit_log(logging.info)

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
            od_max_to_keep: int = 5,
            od_local_init: bool = False,
            **kwargs,
        ):
            # patches.tensorflow.local_initial_values: the resume broadcasts
            self._od_local_init = od_local_init
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
            self._od_max_to_keep = od_max_to_keep
            self._od_own_copy = False
            # What od_on_model returned: (steps, seconds) -> None, run by every trainer at each loop's
            # end, before a save (the meeting of sync_every, the network's share of a step).
            self._od_after_loop = None
            if kwargs.get("trainer") is not None:
                strategy = kwargs.get("strategy") or tf.distribute.get_strategy()
                _create_optimizer_slots(kwargs["trainer"], strategy)
                if kwargs.get("checkpoint_manager") is not None and isinstance(
                    strategy, tf.distribute.MultiWorkerMirroredStrategy
                ):
                    kwargs["checkpoint_manager"] = self._od_own_manager(
                        strategy, kwargs["trainer"], kwargs["checkpoint_manager"]
                    )
            self._od_io_options = None
            self._od_loops = 0  # training loops run by this process
            every = kwargs.get("steps_per_loop")
            self._od_step_first = kwargs.get("trainer") is not None and isinstance(every, int) and every > 1
            if self._od_step_first:
                kwargs["steps_per_loop"] = functools.partial(self._od_loop_steps, every)
            super().__init__(*args, **kwargs)
            manager = self.checkpoint_manager
            if manager is not None and os.path.abspath(manager.directory) != os.path.abspath(od_model_dir):
                # A shared folder's worker: its copy is dropped.
                patches.orbit.log_saves_into(manager.directory)
            if self.trainer is not None and self.checkpoint_manager is not None:
                self.checkpoint_manager.save = patches.tensorflow.reading_batch_norm_once(
                    self.checkpoint_manager.save, self.strategy, self.trainer.model.variables
                )
            if self.trainer is not None:
                self.train_actions = tuple(self.train_actions) + (self._od_capture,)
                if od_on_model is not None:
                    self._od_after_loop = od_on_model(self.trainer)

        def _od_own_manager(self, strategy, trainer, manager):
            """A multi_worker_mirrored worker's CheckpointManager. Model Garden points it at a
            temporary folder (every trainer takes part in every save, only the master's copy was
            kept): it saves into its own model_dir instead, so that a LAN of separate disks holds
            the newest checkpoint on every trainer machine. Not where a trainer of a lower id
            writes into the same folder (a shared folder): nothing is written there twice."""
            writer = group.folder_writer(strategy, self._od_model_dir)  # collective: every trainer asks
            if writer != group.trainer_id(strategy) or strategy.extended.should_checkpoint:
                return manager  # the master's, in model_dir; or a shared folder's other writer
            from od_dist.task import checkpoints

            checkpoints.tidy(self._od_model_dir)  # as the master tidies its own, before any restore
            self._od_own_copy = True
            if not tf.io.gfile.listdir(manager.directory):
                tf.io.gfile.rmtree(manager.directory)  # Model Garden's temporary folder, unused now
            return tf.train.CheckpointManager(
                manager.checkpoint,
                directory=self._od_model_dir,
                max_to_keep=self._od_max_to_keep,
                step_counter=trainer.global_step,
                checkpoint_interval=manager.checkpoint_interval,
                init_fn=trainer.initialize,
            )

        def restore_checkpoint(self, checkpoint_path=None):
            manager = self.checkpoint_manager
            if self.trainer is not None and checkpoint_path is None and manager is not None:
                return self._od_resume(_whole_latest(self._od_model_dir))
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

        def _od_coordinator_io(self):
            """Under parameter_server TensorFlow saves each ps's variables on that ps (into its
            machine's folder) and restores them there: on machines of separate disks the save's
            shards end up on other disks and the master cannot merge them. Every checkpoint file is
            read and written by the master instead, on its own disk (CheckpointOptions'
            experimental_io_device), for its saves and its restore."""
            if self._od_io_options is None:
                self._od_io_options = patches.orbit.save_io_on(self, _COORDINATOR_CPU)
            return self._od_io_options

        def _od_resume(self, latest: str | None):
            """Training starts: every trainer resumes from the newest checkpoint any of them holds
            in its model_dir. Under multi_worker_mirrored a trainer whose model_dir is behind (a
            new disk, a machine that was down at a save) restores nothing and receives the
            variables from the lowest trainer that holds it, in one all-reduce, as Horovod
            broadcasts rank 0's state: no shared folder is needed."""
            if isinstance(self.strategy, tf.distribute.experimental.ParameterServerStrategy):
                options = self._od_coordinator_io()
                # The coordinator alone writes: its folder's run goes on, or a run starts here.
                _name_run(self._od_model_dir, (lineage.run_of(self._od_model_dir) if latest else None))
                if not latest and self.checkpoint_manager.latest_checkpoint:  # named, but cut short
                    self.trainer.initialize()  # the manager's init_fn: nothing whole to restore
                    return None
                if not latest:
                    return super().restore_checkpoint(None)  # nothing to read: initialise
                with self.strategy.scope():
                    self.checkpoint_manager.checkpoint.restore(latest, options=options)
                print(f"restored model from {latest}.", flush=True)
                self._od_count_saves_from(self._od_step(latest))
                return latest
            starts = self._od_check_same_start(latest)
            run = self._od_agree_run(starts)
            # Created now on every trainer, in the same order: a restore creates it otherwise, and
            # creating a variable is collective under multi_worker_mirrored (the master's initial
            # value) where patches.tensorflow.local_initial_values is not on.
            self.checkpoint_manager.checkpoint.save_counter  # noqa: B018
            newest = max(s[1] for s in starts)
            names = group.trainer_names(self.strategy)
            source = min(names.index(s[0]) for s in starts if s[1] == newest)
            if len({s[1] for s in starts}) == 1:
                restored = self._od_restore_alike(latest, newest)
                if self._od_local_init:
                    if not newest:
                        # Each trainer took its own initial values: the first trainer's for all.
                        # At a step each restored the same values, its copy of one collective
                        # save of one run: the broadcast (3.5 s of a restart, its trace) is spared.
                        group.broadcast(self.strategy, group.checkpointed_variables(self.trainer), source)
                    patches.tensorflow.end_local_initial_values(self.strategy)
                return restored
            restored = super().restore_checkpoint(latest) if self._od_step(latest) == newest else None
            group.broadcast(self.strategy, group.checkpointed_variables(self.trainer), source)
            patches.tensorflow.end_local_initial_values(self.strategy)
            self._od_count_saves_from(newest)
            behind = ", ".join(f"{s[0]}'s at step {s[1]}" for s in starts if s[1] != newest)
            print(
                f"{_PREFIX} train | resuming run {run} at step {newest} from {names[source]}'s checkpoint, its "
                f"variables sent over the all-reduce to the trainers whose --model_dir is behind ({behind}; "
                "0: no checkpoint)",
                flush=True,
            )
            return restored

        def _od_restore_alike(self, latest: str | None, step: int):
            """Every trainer at `step`: each restores its own copy (or initialises, at 0)."""
            if latest and os.path.abspath(self.checkpoint_manager.directory) != os.path.abspath(
                self._od_model_dir
            ):
                restored = super().restore_checkpoint(latest)  # a shared folder, read by a worker
                self._od_count_saves_from(step)
                return restored
            if latest != self.checkpoint_manager.latest_checkpoint:  # the named one was cut short
                if latest is None:
                    self.trainer.initialize()  # the manager's init_fn: nothing whole to restore
                    return None
                restored = super().restore_checkpoint(latest)
                self._od_count_saves_from(step)
                return restored
            return super().restore_checkpoint(None)

        @staticmethod
        def _od_step(latest: str | None) -> int:
            return int(latest.rsplit("-", 1)[1]) if latest else 0

        def _od_count_saves_from(self, step: int):
            # A manager restored from another folder, or given the variables by another trainer,
            # would save at its first loop boundary, the master's not: saving is collective, and
            # trainers that disagree fail the job (a collective "Shape mismatch", exit 1) at the
            # first boundary after a mid-interval resume.
            if self.checkpoint_manager.checkpoint_interval:
                patches.tensorflow.count_saves_from(self.checkpoint_manager, step)

        def _od_capture(self, output):
            self._od_last_train_output = output or {}

        def _od_all_trainers(self, *values: int) -> list:
            """(trainer name, *values) of every trainer, by name (see _gather)."""
            names = group.trainer_names(self.strategy)
            return sorted((names[i], *row) for i, row in group.gather(self.strategy, *values).items())

        def _od_check_same_start(self, latest: str | None) -> list:
            """Before any restore (restoring is itself collective under multi_worker_mirrored):
            every trainer's latest step in its model_dir, gathered (trainer name, step, ...); and
            every trainer must have the same od_same_flags (their all-reduces would not match: a
            collective's error or a hang at the first step)."""
            flags = sorted(self._od_same_flags.items())
            # Its run (0: none named, or no checkpoint to go on) and a new run's id it proposes:
            # the last two columns, read by _od_agree_run.
            held = lineage.run_of(self._od_model_dir) if latest else None
            starts = self._od_all_trainers(
                self._od_step(latest),
                *(zlib.crc32(value.encode()) for _, value in flags),
                int(held or "0", 16),
                int(lineage.new_run(), 16),
            )
            problems = []
            for column, (flag, value) in enumerate(flags, start=2):
                mine = zlib.crc32(value.encode())
                others = [s[0] for s in starts if s[column] != mine]
                if others:
                    problems.append(
                        f"{flag}: {value} here, another value on {', '.join(others)}: every trainer "
                        f"needs the same {flag}; start them all with one command line"
                    )
            if len(_runs_held(starts)) > 1:
                held = ", ".join(
                    f"{s[0]} holds run {s[-2]:012x} at step {s[1]:,}" for s in starts if s[1] > 0
                )
                problems.append(
                    f"checkpoints of two runs: {held} (this trainer's --model_dir: {self._od_model_dir}); "
                    "no trainer takes over another run's: go on with one run by moving the other's "
                    f"checkpoints out of its --model_dir, or {lineage.FRESH_HINT}"
                )
            if problems:
                raise StartMismatch("\n".join(problems))
            return starts

        def _od_agree_run(self, starts: list) -> str:
            """The run every trainer goes on with, from the gathered starts (_od_check_same_start
            refused checkpoints of two runs): the one run their checkpoints belong to, or (none
            holds one) a new run, the first trainer's proposal."""
            runs = _runs_held(starts)
            run = f"{runs.pop():012x}" if runs else f"{starts[0][-1]:012x}"
            _name_run(self._od_model_dir, run)
            return run

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
                path = patches.orbit.save_now(self, step)
            else:
                patches.orbit.sync_saves(self)
            if not self.strategy.extended.should_checkpoint and not self._od_own_copy:
                path = None  # a worker's copy, in a temporary folder: the master's is in the shared one
            why = (
                self._od_stop.name
                if self._od_stop.requested
                else ", ".join(f"{name} was stopped by {exit_codes.asked_by(code)}" for name, code in asked)
            )
            raise Stopped(max(code for _, code in asked), step, path, why)

        def _od_loop_steps(self, every: int, step: int) -> int:
            """orbit's steps_per_loop: the first loop of every start is one step, so that the
            first progress line (training again, after a restart) comes after the trace and one
            step rather than a whole loop; the next loop ends on the grid of `every` again, where
            the saves, summaries and stops fall as before. One loop function, its step count a
            tensor: no second trace."""
            return 1 if not self._od_loops else every - int(step) % every

        def _maybe_save_checkpoint(self, check_interval: bool = True):
            if check_interval and self._od_loops == 1 and self._od_step_first:
                return False  # the one-step loop: orbit would save it when none is saved yet
            return super()._maybe_save_checkpoint(check_interval)

        def _train_n_steps(self, num_steps: int):
            step0 = int(self.global_step.numpy())
            self._od_loops += 1
            if self._od_on_loop_start is not None:
                self._od_on_loop_start()
            t0 = time.time()
            super()._train_n_steps(num_steps)
            if self._od_after_loop is not None:
                self._od_after_loop(int(self.global_step.numpy()) - step0, time.time() - t0)
            self._od_print_progress(step0, t0)
            notes.leave_step_reached(int(self.global_step.numpy()))
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
            first = self._od_loops == 1 and self._od_step_first  # its rate holds the trace
            loss_s = f"{loss:.4f}" if loss is not None else "?"
            print(
                f"{_PREFIX} train | step {step}/{target} ({pct:.0f}%) | loss {loss_s} | "
                f"{rate:.2f} steps/s | {rate * self._od_batch:.1f} examples/s | "
                f"ETA {'?' if first else _format_eta(eta)}",
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
            print(eval_line(step, metrics), flush=True)
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
        patches.tf_keras.create_optimizer_slots(optimizer, variables)


def _whole_latest(model_dir: str) -> str | None:
    """The newest checkpoint of `model_dir` that is whole on disk: the one the state file names, or,
    when a power loss cut its save short, the newest whole one before it (None: none; under
    multi_worker_mirrored this trainer is then behind and gets the variables from another)."""
    import tensorflow as tf

    latest = tf.train.latest_checkpoint(model_dir)
    if latest is None or "://" in model_dir:  # a remote folder: TensorFlow's word
        return latest
    whole = lineage.newest(model_dir)
    found = os.path.join(model_dir, whole[1]) if whole else None
    if found != latest:
        then = f"resuming from {found}" if found else "no whole checkpoint here: this trainer starts behind"
        print(f"{_PREFIX} train | {latest} is not whole on disk (a save cut short); {then}", flush=True)
    return found


def _runs_held(starts: list) -> set[int]:
    """The runs of the trainers' checkpoints, from the gathered starts (the step second, the run
    second to last: 0 for a folder that names none)."""
    return {s[-2] for s in starts if s[1] > 0 and s[-2]}


def _name_run(model_dir: str, run: str | None) -> None:
    """Names the run this folder's checkpoints belong to (a new one when `run` is None), said in
    one line when it changes: every copy of a run's checkpoints carries its id (protocol/lineage.py)."""
    if run is None:
        run = lineage.new_run()
    if lineage.run_of(model_dir) != run:
        before = lineage.run_of(model_dir)
        lineage.write_run(model_dir, run)
        how = (
            f"it held run {before}'s" if before else "new" if not lineage.holds_checkpoints(model_dir) else ""
        )
        print(f"{_PREFIX} train | run {run} in {model_dir}{f' ({how})' if how else ''}", flush=True)


# The parameter_server master's CPU: it connects to the cluster as TensorFlow's chief (task/strategy.py).
_COORDINATOR_CPU = f"/job:{TF_JOB['master']}/replica:0/task:0/device:CPU:0"


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
