"""Where a recovery goes, from what a job's tasks and supervisors print (benchmarks/chaos.py).

For a fault: `detected`, the supervisor's first `restart ... in W s` line after it (its `backoff`:
W), or an elastic job's first `forming the next round` line; an elastic job's `proposed` (the
leading machine's `proposing round N` line) and `round formed` (the first `round N: ...` line,
every member took it); then, over every task process started after the fault, when the last of them started and
reached each start-up phase (od_dist/task/phases.py: the group waits for its slowest member);
`training`, the first progress after the fault. All in seconds after the fault.
"""

from __future__ import annotations

import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from od_dist.task.phases import LINE  # noqa: E402

BACKOFF = re.compile(r"; restart [^;]*? in (\d+) s")
FORMING = re.compile(r"\bforming the next round ")
PROPOSED = re.compile(r"\bproposing round \d+: ")
ROUND = re.compile(r"round (\d+): (.+?) train from step ([\d,]+)")  # chaos.py reads its groups
ORDER = (
    "detected",
    "backoff",
    "proposed",
    "round formed",
    "started",
    "TensorFlow imported",
    "Model Garden imported",
    "pipeline loaded",
    "group formed",
    "model built",
    "resumed",
    "first loop",
    "serving",
    "training",
)


def processes(lines: dict, wall0: float, start: float, end: float) -> dict:
    """{(log key, its start on the watch's clock): {phase: when}} for every task process started
    at or after `start`, its phase lines up to `end`; `lines`: {key: [(time seen, text)]}, `wall0`: time.time()
    at the watch's zero."""
    found: dict = {}
    for key, seq in list(lines.items()):
        for _, text in list(seq):
            m = LINE.search(text)
            if not m:
                continue
            at = float(m["at"]) - wall0
            began = round(at - float(m["since"]), 1)
            if start <= began and at <= end:  # started after the fault: a restart of it
                found.setdefault((key, began), {"started": began})[m["phase"].split(" at step")[0]] = at
    return found


def first(lines: dict, pattern: re.Pattern, injected: float, end: float):
    """The first line `pattern` finds seen between `injected` and `end`: (when, its match)."""
    found = [
        (t, m)
        for seq in list(lines.values())
        for t, text in list(seq)
        if injected <= t <= end
        for m in [pattern.search(text)]
        if m
    ]
    return min(found, key=lambda x: x[0], default=None)


def breakdown(lines: dict, wall0: float, injected: float, end: float) -> dict[str, float]:
    got: dict[str, float] = {}
    restart = first(lines, BACKOFF, injected, end)
    if restart:
        got["detected"] = restart[0] - injected
        got["backoff"] = float(restart[1].group(1))
    elif forming := first(lines, FORMING, injected, end):
        got["detected"] = forming[0] - injected
    for phase, pattern in (("proposed", PROPOSED), ("round formed", ROUND)):
        if said := first(lines, pattern, injected, end):
            got[phase] = said[0] - injected
    procs = processes(lines, wall0, injected, end).values()
    for phase in ORDER:
        when = [p[phase] for p in procs if phase in p]
        if when:
            got[phase] = max(when) - injected
    got["training"] = end - injected
    return got


def describe(got: dict[str, float]) -> str:
    return ", ".join(
        f"{p} {got[p]:.1f}" if p != "backoff" else f"(backoff {got[p]:.0f})" for p in ORDER if p in got
    )


def medians(all_got: list[dict[str, float]]) -> str:
    cells = []
    for p in ORDER:
        values = [g[p] for g in all_got if p in g]
        if values:
            cells.append(f"{p} {statistics.median(values):.1f} ({len(values)})")
    return ", ".join(cells)
