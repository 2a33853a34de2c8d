"""A TensorFlow task's start-up, one line a phase: seconds since its process started, and when.

    od-dist: start-up | model built | 7.3 s since start (at 1764629009.94)

The phases, in order as a task passes them (a server: the first two and `serving`): TensorFlow
imported, Model Garden imported, pipeline loaded, group formed (its strategy made: every peer up,
a multi_worker_mirrored group joined), model built, resumed (restored, broadcast or initialised),
first loop (its first training loop done). benchmarks/startup.py and benchmarks/chaos.py read them
(LINE), the `at` to place a restarted task's phases on the clock of a fault."""

from __future__ import annotations

import re
import time

LINE = re.compile(
    r"od-dist: start-up \| (?P<phase>[^|]+?) \| (?P<since>[\d.]+) s since start \(at (?P<at>[\d.]+)\)"
)


def started_at() -> float:
    """This process's start (the kernel's), as time.time() counts: the interpreter's own start-up
    is in every figure, as a user waiting for the task sees it."""
    import psutil

    return psutil.Process().create_time()


def mark(phase: str) -> None:
    """Prints `phase`'s line."""
    now = time.time()
    print(f"od-dist: start-up | {phase} | {now - started_at():.1f} s since start (at {now:.2f})", flush=True)
