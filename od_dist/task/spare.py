"""The spare's side of protocol/spare.py: import, wait for a start, take its environment."""

from __future__ import annotations

import os
import sys
import tempfile
import time

from od_dist.protocol import spare


def park() -> None:
    """Imports what a trainer imports first, then waits for its start; returns with the start's
    environment in place (the caller runs the task), or exits 0 at end of input. An import that fails
    is left to the start: it imports again and says what is wrong, as a start from nothing does
    (an exit of the spare's own, unexplained, would read as a permanent failure of the task)."""
    own_name = _name(spare.PARKED_NAME)
    try:
        from od_dist import patches

        patches.imports.import_tensorflow()
        patches.problems()  # imports every module a patch touches: Model Garden's, orbit's
        from od_dist.task import trainer  # noqa: F401
    except Exception:
        pass
    parked_at = time.time()
    env = spare.decode(sys.stdin.buffer.readline())
    if env is None:
        os._exit(0)  # nothing ran: no atexit handler or TensorFlow shutdown to wait for
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # the start's TMPDIR, not the one the spare was made with
    _name(own_name)
    from od_dist.task import phases

    phases.restart_clock()
    print(
        f"od-dist: a spare made ready {time.time() - parked_at:.0f} s ago takes this start "
        "(its TensorFlow already imported)",
        flush=True,
    )


def _name(name: str | None) -> str | None:
    """Sets this process's name (Linux), returning the one before; None where it cannot."""
    if name is None:
        return None
    try:
        with open("/proc/self/comm", encoding="utf-8") as f:
            before = f.read().strip()
        with open("/proc/self/comm", "w", encoding="utf-8") as f:
            f.write(name)
        return before
    except OSError:
        return None
