"""A TensorFlow task's start-up, one line a phase: seconds since its process started, and when.

    od-dist: start-up | model built | 7.3 s since start, 6.1 s of CPU (at 1764629009.94)

The phases, in order as a task passes them (a server: the first two and `serving`): TensorFlow
imported, Model Garden imported, pipeline loaded, group formed (its strategy made: every peer up,
a multi_worker_mirrored group joined), model built, resumed (restored, broadcast or initialised),
first loop (its first training loop done). benchmarks/startup.py and benchmarks/chaos.py read them
(LINE), the `at` to place a restarted task's phases on the clock of a fault.

They are measurements, not news for the person at the console: they go to the task's log only
(host/console.py), and to the console as well where SHOW_ENV is set (the benchmarks set it)."""

from __future__ import annotations

import os
import re
import time

LINE = re.compile(
    r"od-dist: start-up \| (?P<phase>[^|]+?) \| (?P<since>[\d.]+) s since start, (?P<cpu>[\d.]+) s of CPU \(at (?P<at>[\d.]+)\)"
)


# Set (to anything but "" or "0") by the benchmarks that read the start-up lines from consoles:
# then each task prints its phase and threads lines as any other line.
SHOW_ENV = "OD_DIST_STARTUP_LINES"

# A spare's start (protocol/spare.py): when a start took it, and its CPU seconds then.
_taken: tuple[float, float] | None = None


def restart_clock() -> None:
    """A spare taken by a start: its phases count from now, not from the spare's own start."""
    global _taken
    _taken = (time.monotonic(), time.process_time())


def since_start() -> float:
    """Seconds since the kernel started this process (or a start took this spare): the interpreter's
    own start-up is in every figure, as a user waiting for the task sees it. Linux: both clocks
    since boot, in ticks of 10 ms (psutil's create_time adds the boot time in whole seconds: up to
    1 s off)."""
    if _taken is not None:
        return time.monotonic() - _taken[0]
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, AttributeError, ValueError, IndexError):  # not Linux
        import psutil

        return time.time() - psutil.Process().create_time()


def cpu_since_start() -> float:
    return time.process_time() - (_taken[1] if _taken is not None else 0.0)


def shown() -> bool:
    """Whether the start-up's lines go to the console too (SHOW_ENV), not to the task's log only."""
    return os.environ.get(SHOW_ENV, "") not in ("", "0")


def say(line: str) -> None:
    """A line of the start-up's measurements: the task's log only, unless SHOW_ENV is set."""
    if shown():
        print(line, flush=True)
    else:
        from od_dist.host import console

        console.to_log(line)


def mark(phase: str) -> None:
    """Says `phase`'s line; its CPU seconds (every thread of the process) vary less than its
    wall time on a loaded machine."""
    say(
        f"od-dist: start-up | {phase} | {since_start():.1f} s since start, {cpu_since_start():.1f} s of "
        f"CPU (at {time.time():.2f})"
    )
