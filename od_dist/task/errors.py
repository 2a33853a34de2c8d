"""How the trainer ends a run it cannot go on with: the prefix of its lines, its errors."""

from __future__ import annotations

PREFIX = "od-dist"  # every line the trainer prints starts with it


class TrainerError(RuntimeError):
    """A run that cannot proceed; the message is one line, for the user."""


class StartMismatch(TrainerError):
    """multi_worker_mirrored trainers would start apart: with different settings of what they must
    do alike (--all_reduce_dtype, --all_reduce_packs). One line per difference. (Different steps
    are no mismatch: a trainer whose model_dir is behind gets the newest state from the others.)"""


class Stopped(Exception):
    """Training stopped on a signal after saving a checkpoint; ``code`` is the exit status."""

    def __init__(self, code: int, step: int, path: str | None, why: str):
        super().__init__(why)
        self.code, self.step, self.path, self.why = code, step, path, why
