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

from od_dist.host.watchdog import Watchdog
from od_dist.protocol import exit_codes, notes, peers
from od_dist.task.server import is_listening

# parameter_server: TensorFlow's coordinator waits for the steps of a loop with no timeout, and a
# step (or the master's read of a peer) can wait for good while every peer's port answers. LoopGuard
# ends the master then: when the first loop of a start (it traces the step on every worker) has not
# come round after --wait_timeout x FIRST_LOOP_WAITS, and at least FIRST_LOOP_S (that first loop took
# 16 s at load 5, and over 30 s in CI's suite on 2 cores, a --wait_timeout of 10 then too short), a
# later one after SLOW_LOOP_TIMES the slowest before, and never before the watch of the peers (Watch)
# has named one unreachable for --wait_timeout: GUARD_AFTER_WATCH_S later (it probes every
# peers.PROBE_S).
FIRST_LOOP_WAITS = 3
FIRST_LOOP_S = 120
SLOW_LOOP_TIMES = 5
GUARD_AFTER_WATCH_S = 2 * peers.PROBE_S


class LoopGuard:
    """The parameter_server master's training loops, each bounded (see FIRST_LOOP_WAITS) from its
    start to the next one's: its steps, the peers' stop requests read after it, a checkpoint save.
    One stuck (seen after a worker's link was cut for a minute, and with a worker stopped by
    SIGSTOP: every process idle, the master waiting for good) ends the master with one line and
    exit 138, and its supervisor restarts the job from the last checkpoint. `then`: what the line
    says happens next."""

    def __init__(self, who: str, wait_timeout_s: float, then: str):
        self.who, self.wait_timeout_s, self.then = who, wait_timeout_s, then
        self.slowest: float | None = None
        self._started: float | None = None
        self._dog: Watchdog | None = None

    def __enter__(self) -> LoopGuard:
        self._dog = Watchdog()
        return self

    def __exit__(self, *exc) -> None:
        self._dog.close()

    def limit(self) -> float:
        if self.slowest is None:
            return max(self.wait_timeout_s * FIRST_LOOP_WAITS, FIRST_LOOP_S)
        return max(self.wait_timeout_s + GUARD_AFTER_WATCH_S, SLOW_LOOP_TIMES * self.slowest)

    def loop_starts(self) -> None:
        now = time.monotonic()
        if self._started is not None:
            self.slowest = max(self.slowest or 0.0, now - self._started)
        self._started = now
        limit = self.limit()
        before = (
            f"the slowest before took {self.slowest:.1f} s"
            if self.slowest is not None
            else f"the first of this start: --wait_timeout x {FIRST_LOOP_WAITS}, at least {FIRST_LOOP_S} s"
        )
        self._dog.arm(
            limit,
            f"od-dist: {self.who}: a training loop did not end in {limit:.0f} s ({before}) while every "
            f"peer answered: TensorFlow is stuck on a peer; {self.then}; exit {exit_codes.LOST_PEER}",
        )


def _names(tasks) -> str:
    return ", ".join(f"{t.name} at {t.address}" for t in tasks)


class Watch:
    """Probes groups of peers in a daemon thread. A group is (tasks, every, timeout_s, why, told):
    lost when one of its tasks (every=False) or all of them (every=True) stayed unreachable for
    timeout_s; then prints one line and exits the process with LOST_PEER, leaving the notes `told`
    for a supervisor (notes.WAITED_OUT: timeout_s is --wait_timeout, a restart would only wait
    again)."""

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
        absent = peers.Unreachable()
        while not self._stop.wait(peers.PROBE_S):
            now = time.monotonic()
            for tasks, every, timeout_s, why, told in self.groups:
                for t in tasks:
                    absent.look(t.name, is_listening(t.address.host, t.address.port), now)
                lost = [t for t in tasks if absent.lost(t.name, now, timeout_s)]
                if lost and (not every or len(lost) == len(tasks)) and not self._stop.is_set():
                    for note in told:
                        notes.leave_for_supervisor(note)
                    exit_lost(self.who, f"{peers.lost_line(_names(lost), timeout_s)}; {why}")


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
    """The peers a TensorFlow error is about: those it names that are unreachable now, else those
    unreachable now, else those it names. A peer that the same loss ended is unreachable too for a
    moment (its task exits at once, its supervisor restarts it), but the error names the one whose
    link failed: three machines, one powered off, the other trainer named with it otherwise."""
    named = {(job, int(index)) for job, index in TF_TASK.findall(message)}
    unreachable = [t for t in peers if not is_listening(t.address.host, t.address.port)]
    return (
        [t for t in unreachable if (t.tf_job, t.index) in named]
        or unreachable
        or [t for t in peers if (t.tf_job, t.index) in named]
    )
