"""Restarts after TensorFlow's recovery rules, for `od-dist launch` (every task of this machine) and
`od-dist train --max_restarts` (this machine's one task). No TensorFlow here.

The rules (TensorFlow's fault tolerance for parameter-server and multi-worker training):
  - a lost parameter_server worker: restarted alone on its own port; the coordinator re-queues
    its steps meanwhile and takes it back when it returns.
  - a lost ps or master, or any lost multi_worker_mirrored trainer: every task is stopped and all
    are restarted together; the trainers resume from the last checkpoint.
  - "lost" means a retryable exit (exit_codes.RETRYABLE: a lost peer, a signal). A permanent exit
    (1: a bug, 2: invalid input, anything else) is never retried: it would only fail again.
  - the evaluator is a sidecar: whatever its exit (a pycocotools error, no checkpoint yet), it is
    restarted alone, up to --max_restarts times of its own; past them training goes on without
    it. It never stops the trainers.
Each restart waits a backoff and counts against --max_restarts; past it the job stops and exits 1
naming the first failure (the root cause, as torchrun reports it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from od_dist.cluster import duties
from od_dist.cluster.spec import Task
from od_dist.cluster.validate import PARAMETER_SERVER
from od_dist.job import exit_codes

DONE, PERMANENT, RESTART_TASK, RESTART_ALL = "done", "permanent", "restart the task", "restart all"
BACKOFF_S = 2.0  # before the first restart; doubles each time, up to BACKOFF_MAX_S
BACKOFF_MAX_S = 30.0
# Stopping every task for a restart: the lost task held the variables (ps), was the one that saves
# (master) or blocks every all-reduce, so the survivors have nothing consistent to save; they get
# this long to exit on SIGTERM before SIGKILL.
RESTART_STOP_GRACE_S = 10.0
SERVER_STOP_GRACE_S = 10.0  # servers and the evaluator hold no training state
SERVER_GRACE_S = 60.0  # servers stop by themselves within this after the master is done
POLL_S = 0.2

MEANINGS = {
    exit_codes.FAILED: "a permanent failure",
    exit_codes.INVALID: "invalid input",
    exit_codes.LOST_PEER: "lost a peer",
    exit_codes.INTERRUPTED: "interrupted",
    exit_codes.KILLED: "killed",
    exit_codes.TERMINATED: "terminated",
}


def describe(returncode: int) -> str:
    """'exit 137, killed': the code as a shell reports it, and what it means here."""
    code = exit_codes.normalize(returncode)
    meaning = MEANINGS.get(code) or (f"signal {code - 128}" if code > 128 else "a permanent failure")
    return f"exit {code}, {meaning}"


def is_trainer(strategy: str, role: str) -> bool:
    """The tasks that train and save (cluster/duties.py)."""
    return duties.of(strategy, role).is_trainer


def decide(strategy: str, role: str, returncode: int) -> str:
    """What to do when a task of `role` exits with `returncode` (Popen's, or a shell's)."""
    code = exit_codes.normalize(returncode)
    if code == exit_codes.OK:
        return DONE
    if role == "evaluator":  # a sidecar: its failure is never the job's
        return RESTART_TASK
    if code not in exit_codes.RETRYABLE:
        return PERMANENT
    if role == "worker" and strategy == PARAMETER_SERVER:
        return RESTART_TASK
    return RESTART_ALL


@dataclass(frozen=True)
class Plan:
    action: str  # DONE, PERMANENT, RESTART_TASK or RESTART_ALL
    cause: tuple[Task, int] | None  # the exit that decided it
    restart: tuple[Task, ...] = ()


def plan(strategy: str, tasks: list[Task], exits: list[tuple[Task, int]]) -> Plan:
    """Which tasks to restart, given the tasks that exited since the last look (in the order seen).

    Several exits at once are usually one fault seen twice (a ps killed, the master failing on it),
    so a restart of every task wins over a permanent failure seen at the same moment: if the
    permanent one was real it happens again and stops the job then."""
    decided = [(decide(strategy, task.role, code), task, code) for task, code in exits]
    for wanted in (RESTART_ALL, PERMANENT):
        for action, task, code in decided:
            if action == wanted:
                return Plan(action, (task, code), tuple(tasks) if action == RESTART_ALL else ())
    alone = [(task, code) for action, task, code in decided if action == RESTART_TASK]
    if alone:
        return Plan(RESTART_TASK, alone[0], tuple(task for task, _ in alone))
    return Plan(DONE, None)


def backoff_s(restart: int) -> float:
    """Seconds to wait before restart number `restart` (1-based): 2, 4, 8, 16, 30, 30, ..."""
    return min(BACKOFF_S * 2 ** (restart - 1), BACKOFF_MAX_S)


# ----- processes --------------------------------------------------------------------------------


def send(proc: subprocess.Popen, signum: int) -> None:
    """SIGINT/SIGTERM to a child in its own process group; CTRL_BREAK on Windows (the one console
    event a process group can be sent), which a trainer handles as Ctrl+C: checkpoint, exit 130
    (job/stop.py)."""
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.CTRL_BREAK_EVENT if os.name == "nt" else signum)
    except OSError:
        pass


def wait_all(
    procs: list[subprocess.Popen], timeout_s: float, interrupted: Callable[[], bool] = lambda: False
) -> bool:
    """Waits until every process has exited (True), the timeout passes or `interrupted()` (False)."""
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        if time.monotonic() >= deadline or interrupted():
            return False
        time.sleep(POLL_S)
    return True


def kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                p.kill()
            except OSError:
                pass
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            pass


def stop(
    procs: list[subprocess.Popen], grace_s: float, interrupted: Callable[[], bool] = lambda: False
) -> None:
    """SIGTERM, then SIGKILL whatever is left after grace_s (or at once when interrupted() says so)."""
    for p in procs:
        send(p, signal.SIGTERM)
    if not wait_all(procs, grace_s, interrupted):
        kill_all(procs)


# ----- the loop ---------------------------------------------------------------------------------


@dataclass
class Running:
    task: Task
    proc: subprocess.Popen
    log_path: str | None = None  # where its output goes, for the messages


@dataclass
class Supervisor:
    """Runs tasks as children, restarting them by the rules above until the job is done.

    `start(task)` starts one task and returns its Running; `finish(running)` is called once each
    child has exited (e.g. to let its output reader finish). `say` prints one line for the user."""

    strategy: str
    tasks: list[Task]
    start: Callable[[Task], Running]
    say: Callable[[str], None]
    max_restarts: int
    grace_s: float  # how long trainers get to save a checkpoint after SIGINT/SIGTERM
    finish: Callable[[Running], None] = lambda r: None
    backoff: Callable[[int], float] = backoff_s  # seconds before restart number n (1-based)
    running: dict[str, Running] = field(default_factory=dict)
    pending: dict[str, float] = field(default_factory=dict)  # task name -> when to start it
    signals: list[int] = field(default_factory=list)
    restarts: int = 0
    first_failure: str | None = None
    evaluator_restarts: dict[str, int] = field(default_factory=dict)  # its own budget, per evaluator

    def on_signal(self, signum, _frame=None) -> None:
        self.signals.append(signum)
        if len(self.signals) == 2:
            self.say("second interrupt: stopping every task now")

    def run(self) -> int:
        """Starts every task and supervises them; returns the job's exit status."""
        try:
            for task in self.tasks:
                self.running[task.name] = self.start(task)
            return self._loop()
        finally:
            # Whatever happened (an exception included), no child outlives the supervisor.
            self._stop_all(SERVER_STOP_GRACE_S, trainers_first=False)

    def _procs(self, trainers: bool | None = None) -> list[subprocess.Popen]:
        return [
            r.proc
            for r in self.running.values()
            if trainers is None or is_trainer(self.strategy, r.task.role) == trainers
        ]

    def _stop_all(self, grace_s: float, trainers_first: bool) -> None:
        interrupted = lambda: len(self.signals) > 1  # noqa: E731 - a second Ctrl+C: kill at once
        if trainers_first:
            stop(self._procs(trainers=True), grace_s, interrupted)
        stop(self._procs(), SERVER_STOP_GRACE_S, interrupted)
        for r in self.running.values():
            self.finish(r)
        self.running.clear()

    def _interrupt(self) -> int:
        """The user (or the system) stops the job: trainers first, so they save a checkpoint while
        the servers still hold the variables; then the rest."""
        signum = self.signals[0]
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        trainers = [
            r.task.name
            for r in self.running.values()
            if is_trainer(self.strategy, r.task.role) and r.proc.poll() is None
        ]
        if trainers:
            self.say(
                f"{name}: asking {', '.join(trainers)} to save a checkpoint and stop (up to "
                f"{self.grace_s:.0f} s; interrupt again to stop at once), then the other tasks"
            )
            for p in self._procs(trainers=True):
                send(p, signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)
            if not wait_all(self._procs(trainers=True), self.grace_s, lambda: len(self.signals) > 1):
                if len(self.signals) == 1:
                    self.say(
                        f"{', '.join(trainers)} still running after {self.grace_s:.0f} s "
                        "(--grace_period); killing them"
                    )
                kill_all(self._procs(trainers=True))
        else:
            self.say(f"{name}: stopping every task")
        self._stop_all(SERVER_STOP_GRACE_S, trainers_first=False)
        return exit_codes.INTERRUPTED if signum == signal.SIGINT else exit_codes.TERMINATED

    def _log_note(self, task: Task) -> str:
        log = self.running[task.name].log_path if task.name in self.running else None
        return f". Its log: {log}" if log else ""

    def _loop(self) -> int:
        trainers = [t for t in self.tasks if is_trainer(self.strategy, t.role)]
        finished: set[str] = set()  # tasks done for good (exit 0, or any exit after training)
        trainers_done_at = None
        while True:
            if self.signals:
                return self._interrupt()
            now = time.monotonic()
            for name, due in list(self.pending.items()):
                if now >= due:
                    del self.pending[name]
                    task = next(t for t in self.tasks if t.name == name)
                    self.running[name] = self.start(task)
            exits = []
            for name, r in list(self.running.items()):
                code = r.proc.poll()
                if code is not None:
                    exits.append((r.task, code))
            # Training is over once a trainer finished (exit 0): under multi_worker_mirrored they
            # all reach the last step together, and a trainer left behind may hang in TensorFlow's
            # shutdown or exit 138 for the one that finished first; nothing is restarted then.
            training_over = any(t.name in finished for t in trainers)
            if exits:
                result = self._handle(exits, finished, training_over)
                if result is not None:
                    return result
                training_over = any(t.name in finished for t in trainers)
            if not self.running and not self.pending:
                self.say("every task finished")
                return exit_codes.OK
            # Once training is over the servers must stop by themselves soon (the master's stop
            # marker), the other trainers too; the evaluator after the final checkpoint.
            if training_over and trainers_done_at is None:
                trainers_done_at = time.monotonic()
                for t in self.tasks:  # a task lost meanwhile has nothing left to do
                    if t.role != "evaluator" and self.pending.pop(t.name, None) is not None:
                        finished.add(t.name)
            if trainers_done_at is not None and time.monotonic() - trainers_done_at > SERVER_GRACE_S:
                stuck = [r.task for r in self.running.values() if r.task.role != "evaluator"]
                if stuck and len(stuck) == len(self.running):
                    self.say(
                        f"{', '.join(t.name for t in stuck)} still running {SERVER_GRACE_S:.0f} s after "
                        "training finished; stopping them"
                    )
                    servers = [t for t in stuck if not is_trainer(self.strategy, t.role)]
                    return exit_codes.FAILED if servers else exit_codes.OK
            time.sleep(POLL_S)

    def _restart_evaluators(self, evaluators, exits, finished: set[str]) -> None:
        """Restarts each evaluator alone within its own --max_restarts; past them, training goes on
        without it."""
        codes = dict((t.name, c) for t, c in exits)
        for t in evaluators:
            cause = f"{t.name} died ({describe(codes[t.name])})"
            n = self.evaluator_restarts.get(t.name, 0)
            if n >= self.max_restarts:
                self.say(
                    f"{cause}; no restart left for it (--max_restarts {self.max_restarts}); training "
                    f"goes on without evaluation (run od-dist eval afterwards){self._log_note(t)}"
                )
                finished.add(t.name)
                self.finish(self.running.pop(t.name))
                continue
            self.evaluator_restarts[t.name] = n + 1
            wait = backoff_s(n + 1)
            self.say(
                f"{cause}; restart {n + 1}/{self.max_restarts} of {t.name} alone in {wait:.0f} s; "
                f"training goes on{self._log_note(t)}"
            )
            self.finish(self.running.pop(t.name))
            self.pending[t.name] = time.monotonic() + wait

    def _handle(self, exits: list[tuple[Task, int]], finished: set[str], training_over: bool) -> int | None:
        """Acts on the tasks that just exited; returns the job's exit status when it is over."""
        for task, code in exits:
            r = self.running[task.name]
            if code == 0 or (training_over and task.role != "evaluator"):
                # Done; or lost after training: nothing left for it to do.
                if code != 0:
                    self.say(f"{task.name} exited after training finished ({describe(code)}); not restarted")
                finished.add(task.name)
                self.finish(r)
                del self.running[task.name]
        exits = [(t, c) for t, c in exits if t.name in self.running]
        if not exits:
            return None
        p = plan(self.strategy, self.tasks, exits)
        task, code = p.cause
        cause = f"{task.name} died ({describe(code)})"
        if p.action == RESTART_TASK and all(t.role == "evaluator" for t in p.restart):
            self._restart_evaluators(p.restart, exits, finished)
            return None
        if p.action == PERMANENT:
            self.say(f"{cause}; a permanent error, not retried; stopping every task{self._log_note(task)}")
            return (
                exit_codes.INVALID if exit_codes.normalize(code) == exit_codes.INVALID else exit_codes.FAILED
            )
        if self.first_failure is None:
            self.first_failure = cause
        if self.restarts >= self.max_restarts:
            root = "" if self.restarts == 0 else f"; the first failure (root cause): {self.first_failure}"
            self.say(
                f"{cause}; no restart left (--max_restarts {self.max_restarts}); stopping every task{root}"
                f"{self._log_note(task)}"
            )
            return exit_codes.FAILED
        self.restarts += 1
        wait = self.backoff(self.restarts)
        if p.action == RESTART_ALL:
            # The restart-all message names the lost task first: the others die of it.
            which = " of every task" if len(self.tasks) > 1 else ""
            self.say(f"{cause}; restart {self.restarts}/{self.max_restarts}{which} in {wait:.0f} s")
            self._stop_all(RESTART_STOP_GRACE_S, trainers_first=False)
            restart = list(self.tasks)
            finished.clear()
        else:
            names = ", ".join(t.name for t in p.restart)
            which = f" of {names} alone" if len(self.tasks) > 1 else ""
            self.say(f"{cause}; restart {self.restarts}/{self.max_restarts}{which} in {wait:.0f} s")
            for t in p.restart:
                self.finish(self.running.pop(t.name))
            restart = list(p.restart)
        due = time.monotonic() + wait
        for t in restart:
            self.pending[t.name] = due
        return None
