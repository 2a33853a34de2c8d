"""Lost peers end a trainer with one line and exit 138 (LOST_PEER), instead of a wait on TensorFlow.

TensorFlow recovers on its own only from a lost parameter-server worker (the coordinator runs its
steps on the others and takes it back when it returns on the same address). Otherwise it waits:
a coordinator whose workers are all gone retries each for an hour, a multi_worker_mirrored trainer
may wait on a collective its peer will never join. A thread probing the peers' ports (every TF
server listens on its own) notices and exits; errors TensorFlow does raise are named the same way.
No TensorFlow here.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time

from od_dist.job import exit_codes
from od_dist.job.server import is_listening

PROBE_S = 2.0
# multi_worker_mirrored cannot go on without any trainer; a port closed this long is a lost peer
# (a peer that finished training stops this watch before it closes its port). --lost_peer_timeout.
# Measured (benchmarks/outage.py): TensorFlow's collectives ride out a 5 s outage and abort after a
# 10 s one (the coordination service's heartbeat), so od-dist ends no job that TensorFlow would
# carry on, and TensorFlow's own error names the loss of a longer one.
LOST_PEER_TIMEOUT_S = 10


def _names(tasks) -> str:
    return ", ".join(f"{t.name} at {t.address}" for t in tasks)


class Watch:
    """Probes groups of peers in a daemon thread. A group is (tasks, every, timeout_s, why,
    waited_out): lost when one of its tasks (every=False) or all of them (every=True) stayed
    unreachable for timeout_s; then prints one line and exits the process with LOST_PEER.
    `waited_out`: timeout_s is --wait_timeout, so a supervisor is told a restart would only wait
    again (exit_codes.WAITED_OUT)."""

    def __init__(self, who: str, groups):
        self.who = who
        self.groups = [g for g in groups if g[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="od-dist-peer-watch", daemon=True)

    def __enter__(self) -> Watch:
        if self.groups:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """No exit for a lost peer from now on."""
        self._stop.set()

    def _run(self) -> None:
        gone_since: dict = {}
        while not self._stop.wait(PROBE_S):
            now = time.monotonic()
            for tasks, every, timeout_s, why, waited_out in self.groups:
                for t in tasks:
                    if is_listening(t.address.host, t.address.port):
                        gone_since.pop(t.name, None)
                    else:
                        gone_since.setdefault(t.name, now)
                lost = [t for t in tasks if now - gone_since.get(t.name, now) >= timeout_s]
                if lost and (not every or len(lost) == len(tasks)) and not self._stop.is_set():
                    if waited_out:
                        exit_codes.tell_supervisor(exit_codes.WAITED_OUT)
                    exit_lost(self.who, f"lost {_names(lost)} (unreachable for {timeout_s:.0f} s); {why}")


def exit_now(code: int) -> None:
    """Ends the process at once with `code`, its output flushed, skipping interpreter shutdown
    (where TensorFlow may wait for peers that are gone)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_lost(who: str, message: str) -> None:
    """One line, then exit LOST_PEER at once (the main thread may be blocked inside TensorFlow)."""
    sys.stdout.flush()  # what it printed before, then this line
    print(f"od-dist: {who}: {message}; exit {exit_codes.LOST_PEER}", file=sys.stderr, flush=True)
    exit_now(exit_codes.LOST_PEER)


TF_TASK = re.compile(r"/job:(chief|worker|ps)/replica:\d+/task:(\d+)")


def lost_in_error(message: str, peers) -> list:
    """The peers a TensorFlow error is about: those unreachable now, else those it names."""
    lost = [t for t in peers if not is_listening(t.address.host, t.address.port)]
    if lost:
        return lost
    named = {(job, int(index)) for job, index in TF_TASK.findall(message)}
    return [t for t in peers if (t.tf_job, t.index) in named]
