"""A warm spare: a trainer's next start, made ready before it is needed. Its supervisor starts it with
the task's own command line and SPARE_ENV; it imports TensorFlow and Model Garden, then waits on its
stdin. The supervisor's next start of that task writes one line there, the environment
a start from nothing would have been given (its temporary folder, its notes, its group), and the
spare runs the task with it; end of input instead: it exits 0, never having run anything.

Why: a restarted trainer's import of TensorFlow and Model Garden is about 5 s of every recovery on a
2-core machine, and the same for every restart (benchmarks/chaos.py's "TensorFlow imported" column).
"""

from __future__ import annotations

import json

SPARE_ENV = "OD_DIST_SPARE"  # "1" in a spare's environment
# The parked spare's process name (Linux: `ps`, /proc/PID/comm) until a start takes it, so a person
# or a benchmark looking for the task tells the two apart.
PARKED_NAME = "od-dist-spare"


def encode(env: dict[str, str]) -> bytes:
    return (json.dumps(env) + "\n").encode("utf-8")


def decode(line: bytes) -> dict[str, str] | None:
    """The start's environment, None for end of input (no start: the spare exits)."""
    return json.loads(line.decode("utf-8")) if line.strip() else None
