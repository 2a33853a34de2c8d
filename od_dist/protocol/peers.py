"""How long a peer may stay unreachable before a task counts it lost, and how often it looks."""

from __future__ import annotations

PROBE_S = 2.0
# multi_worker_mirrored cannot go on without any trainer; a port closed this long is a lost peer
# (a peer that finished training stops this watch before it closes its port). --lost_peer_timeout.
# Measured (benchmarks/outage.py): TensorFlow's collectives ride out a 5 s outage and abort after a
# 10 s one (the coordination service's heartbeat), so od-dist ends no job that TensorFlow would
# carry on, and TensorFlow's own error names the loss of a longer one.
LOST_PEER_TIMEOUT_S = 10


class Unreachable:
    """Since when each peer has been unreachable (its port closed): the one rule "a peer unreachable
    for N s is lost", for a trainer's watch of its peers (task/watch.py), a server's watch of its
    master (task/server.py) and the evaluator's (task/roles.py). `never_seen_since`: a peer not
    seen yet counts as unreachable from then (a start: the master never came); None, from the first
    look that finds it unreachable."""

    def __init__(self, never_seen_since: float | None = None):
        self._since: dict[str, float] = {}
        self._seen: set[str] = set()
        self._start = never_seen_since

    def look(self, name: str, listening: bool, now: float) -> None:
        if listening:
            self._since.pop(name, None)
            self._seen.add(name)
        else:
            first = self._start if self._start is not None and name not in self._seen else now
            self._since.setdefault(name, first)

    def seen(self, name: str) -> bool:
        return name in self._seen

    def lost(self, name: str, now: float, timeout_s: float) -> bool:
        return name in self._since and now - self._since[name] >= timeout_s


def lost_line(what: str, timeout_s: float) -> str:
    return f"lost {what} (unreachable for {timeout_s:.0f} s)"
