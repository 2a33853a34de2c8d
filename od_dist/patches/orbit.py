"""Orbit's private names (Orbit ships with Model Garden, tf-models-official): the training loop's hook,
its saves, its log and its train iterator."""

from __future__ import annotations

import os

from od_dist.patches.base import MODEL_GARDEN, Patch, held

PATCHES = (
    Patch(
        "orbit-quiet-log",
        MODEL_GARDEN,
        ("orbit.controller:_log",),
        "rebinds orbit.controller's module-level _log (quiet_orbit_log)",
        "orbit prints each loop's and evaluation's whole output dict; od-dist's one-line progress and "
        "eval lines say it, so those dicts go to the absl INFO log only",
    ),
    Patch(
        "orbit-train-loop",
        MODEL_GARDEN,
        ("orbit:Controller._train_n_steps",),
        "overrides orbit.Controller._train_n_steps (task/controller.py)",
        "the one hook around each training loop: progress line, loop guard, stop with a checkpoint "
        "at the loop boundary, the last-loop callback",
    ),
    Patch(
        "orbit-save-now",
        MODEL_GARDEN,
        ("orbit:Controller._sync_on_async_checkpointing",),
        "reads and sets Controller._checkpoint_options, calls _sync_on_async_checkpointing (save_now, "
        "save_io_on, sync_saves)",
        "a stop saves a checkpoint at once, with the options and the async wait orbit's own save uses",
        held=("orbit:Controller._checkpoint_options",),
    ),
    Patch(
        "orbit-first-loop",
        MODEL_GARDEN,
        ("orbit:Controller._maybe_save_checkpoint",),
        "overrides orbit.Controller._maybe_save_checkpoint (task/controller.py)",
        "the one-step first loop of a start is not saved, as orbit would when nothing is saved yet: "
        "the saves fall on the steps_per_loop grid as before",
    ),
    Patch(
        "orbit-train-iterator",
        MODEL_GARDEN,
        (),
        "sets orbit.StandardTrainer._train_iter to None (fresh_train_iterators)",
        "parameter_server: a loop that ended on a worker's input iterator TensorFlow cancelled (a step "
        "aborted by a transient ps error, retried on that iterator) goes on with new iterators, which "
        "orbit makes from its train dataset when it holds none",
        held=("orbit:StandardTrainer._train_iter",),
    ),
)


_LOGGED_SAVES: list[str] = []  # folders whose saves orbit-quiet-log sends to the log only


def check_controller(controller) -> None:
    """orbit-save-now, checkpoint-next-save: an orbit.Controller just made holds what its saves read
    and set later (a stop's save comes mid-run): a renamed one ends the task now, before any step."""
    held("orbit-save-now", controller, "_checkpoint_options")
    manager = controller.checkpoint_manager
    if manager is not None and manager.checkpoint_interval:  # TensorFlow sets it only then
        held("checkpoint-next-save", manager, "_last_checkpoint_step")


def log_saves_into(folder: str) -> None:
    """orbit-quiet-log: orbit's "saved checkpoint to <folder>/..." goes to the log, not the console."""
    _LOGGED_SAVES.append(os.path.join(folder, ""))


def quiet_orbit_log(to_log) -> None:
    """orbit-quiet-log: orbit's messages that carry an output dict go to `to_log`; the others
    (checkpoint saves and restores) still print."""
    from orbit import controller as orbit_controller

    printing_log = orbit_controller._log
    if getattr(printing_log, "od_dist", False):
        return

    def quiet_train_log(message: str):
        if "| output:" in message:  # train and eval dicts; the eval one is a screenful
            to_log(message)
        elif any(message.startswith(f"saved checkpoint to {folder}") for folder in _LOGGED_SAVES):
            to_log(message)  # a worker's copy in a temporary folder, dropped: the master's line counts
        else:
            printing_log(message)

    quiet_train_log.od_dist = True
    orbit_controller._log = quiet_train_log


def save_now(controller, step: int):
    """orbit-save-now: a checkpoint at `step`, now, as orbit's own save makes it; its path."""
    path = controller.checkpoint_manager.save(
        checkpoint_number=step,
        check_interval=False,
        options=held("orbit-save-now", controller, "_checkpoint_options"),
    )
    controller._sync_on_async_checkpointing()
    return path


def save_io_on(controller, device: str):
    """orbit-save-now: orbit's saves read and write every file on `device` (its CheckpointOptions),
    and those options, for a restore."""
    import tensorflow as tf

    enable_async = held("orbit-save-now", controller, "_checkpoint_options").enable_async
    controller._checkpoint_options = tf.train.CheckpointOptions(
        experimental_io_device=device, enable_async=enable_async
    )
    return controller._checkpoint_options


def sync_saves(controller) -> None:
    """orbit-save-now: waits for an asynchronous save (none to save here)."""
    controller._sync_on_async_checkpointing()


def check_train_iterator(trainer) -> None:
    """orbit-train-iterator: the trainer holds what fresh_train_iterators sets (it is needed
    mid-run): a renamed one ends the task as its first loop is made, before any step."""
    held("orbit-train-iterator", trainer, "_train_iter")


def fresh_train_iterators(trainer) -> None:
    """orbit-train-iterator: the trainer's next loop iterates its train dataset anew (under
    parameter_server: a new iterator on every worker, each from its own dataset function)."""
    held("orbit-train-iterator", trainer, "_train_iter")
    trainer._train_iter = None
