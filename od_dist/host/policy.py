"""What each exit of a task means to its supervisor, and what follows: the restart rules, the backoff.
Read by host/supervisor.py (launch, train --max_restarts) and by the Kubernetes renderer (render/k8s.py),
so both restart alike. No TensorFlow here.

The rules (TensorFlow's fault tolerance for parameter-server and multi-worker training):
  - a lost parameter_server worker: restarted alone on its own port; the coordinator re-queues
    its steps meanwhile and takes it back when it returns. With no restart left it ends alone, as
    under a command of its own: the coordinator trains on the workers left.
  - a lost ps or master, or any lost multi_worker_mirrored trainer: every task is stopped and all
    are restarted together; the trainers resume from the last checkpoint.
  - "lost" means a retryable exit (exit_codes.RETRYABLE: a lost peer, a signal). A permanent exit
    (1: a bug, 2: invalid input, anything else) is never retried: it would only fail again.
  - the evaluator is a sidecar: whatever its exit (a pycocotools error, no checkpoint yet), it is
    restarted alone, within a --max_restarts budget of its own; past it training goes on without
    it. It never stops the trainers.
  - a person's stop (a trainer or server that exits 130, SIGINT: Ctrl+C on this machine or, passed
    on through the job, on another) is never restarted: every task here is stopped, trainers
    first, and the job exits 130.
The first restart of a streak starts at once; the ones that follow it with no progress between them
and within a minute wait a backoff (2 s, doubling). Every restart counts
against --max_restarts, a budget of restarts in a row (Budget): progress since the last restart (a
newer checkpoint, or training past every earlier start) starts both counts over. Past it (a
parameter_server worker aside) the job stops and exits with the retryable code it gave up on, for
an outer restarter, naming the first failure of the streak (the root cause, as torchrun reports it).
"""

from __future__ import annotations

from dataclasses import dataclass

from od_dist.cluster import duties
from od_dist.cluster.spec import Task
from od_dist.cluster.validate import PARAMETER_SERVER
from od_dist.protocol import exit_codes

DONE, PERMANENT, RESTART_TASK, RESTART_ALL = "done", "permanent", "restart the task", "restart all"
STOPPED_BY_PERSON = "stopped by a person"
BACKOFF_S = 2.0  # before the second restart of a streak; doubles each time, up to BACKOFF_MAX_S
BACKOFF_MAX_S = 30.0
# The backoff spaces restarts that come in quick succession (a peer not back yet). Tasks that ran
# this long since their last restart are not in such a loop: the next restart starts a new streak,
# rather than waiting BACKOFF_MAX_S at every fault of a long job.
BACKOFF_RESET_S = 2 * BACKOFF_MAX_S

# --max_restarts counts restarts in a row, not in a run: a long run's occasional losses (a
# preempted machine, an OOM kill days apart) must not use it up, while a task that fails at every
# start must stop the job. Progress since the last restart starts the count over: a newer
# checkpoint in --model_dir (the restart paid off), or, where none is seen (a ps's or a
# parameter_server worker's own disk, the evaluator), the tasks running this long without a loss,
# longer than any start-up (TensorFlow's, a wait for peers).
HEALTHY_S = 600.0

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
    if code == exit_codes.INTERRUPTED:  # SIGINT reaches a task only from a person (its own or a peer's)
        return (
            STOPPED_BY_PERSON  # the evaluator's 130 too: it says a person stopped the job (task/evaluator.py)
        )
    if role == "evaluator":  # a sidecar: its failure is never the job's
        return RESTART_TASK
    if code not in exit_codes.RETRYABLE:
        return PERMANENT
    if role == "worker" and strategy == PARAMETER_SERVER:
        return RESTART_TASK
    return RESTART_ALL


@dataclass(frozen=True)
class Plan:
    action: str  # DONE, STOPPED_BY_PERSON, PERMANENT, RESTART_TASK or RESTART_ALL
    cause: tuple[Task, int] | None  # the exit that decided it
    restart: tuple[Task, ...] = ()


def plan(strategy: str, tasks: list[Task], exits: list[tuple[Task, int]]) -> Plan:
    """Which tasks to restart, given the tasks that exited since the last look (in the order seen).

    Several exits at once are usually one fault seen twice (a ps killed, the master failing on it),
    so a restart of every task wins over a permanent failure seen at the same moment: if the
    permanent one was real it happens again and stops the job then."""
    decided = [(decide(strategy, task.role, code), task, code) for task, code in exits]
    for wanted in (STOPPED_BY_PERSON, RESTART_ALL, PERMANENT):
        for action, task, code in decided:
            if action == wanted:
                return Plan(action, (task, code), tuple(tasks) if action == RESTART_ALL else ())
    alone = [(task, code) for action, task, code in decided if action == RESTART_TASK]
    if alone:
        return Plan(RESTART_TASK, alone[0], tuple(task for task, _ in alone))
    return Plan(DONE, None)


def own_failure(code: int) -> bool:
    """An elastic round's end that counts against this machine (two in a row leave it out of the
    next rounds for a while): not a lost peer (138, another machine's loss), nor a saved stop
    (143, a SIGTERM here or on a peer: a drained node, not a machine that fails)."""
    return exit_codes.normalize(code) not in (exit_codes.LOST_PEER, exit_codes.TERMINATED)


def backoff_s(restart: int) -> float:
    """Seconds to wait before the restart that follows `restart` (1-based) others of its streak, or
    before restart number `restart` of an evaluator's budget: 2, 4, 8, 16, 30, 30, ..."""
    return min(BACKOFF_S * 2 ** (restart - 1), BACKOFF_MAX_S)


@dataclass
class Budget:
    """--max_restarts: at most `limit` restarts in a row. A restart starts the count over when
    training progressed since the one before (a newer checkpoint on disk: `take`'s `step`; or a loop
    that ended past the furthest step of every start before: `reached`) or the tasks then ran
    `healthy_s` without a loss. A task that fails at the same step every time still runs out."""

    limit: int
    since: float  # when the tasks last started (the job, or the last restart)
    step: int | None = None  # the newest checkpoint's step then, None for none
    healthy_s: float = HEALTHY_S
    used: int = 0  # restarts in a row so far
    reached: int | None = None  # the furthest step a loop of any start ended at, None for none

    def take(self, now: float, step: int | None = None, reached: int | None = None) -> bool:
        """One restart at `now`, the newest checkpoint on disk at `step` (None: none, or not seen
        here), the furthest step the lost start's loops ended at `reached` (None: none said);
        False when none is left. `started` says when the restarted tasks start."""
        saved = step is not None and (self.step is None or step > self.step)
        further = reached is not None and (self.reached is None or reached > self.reached)
        if saved or further or now - self.since >= self.healthy_s:
            self.used = 0
        if step is not None:
            self.step = step
        if further:
            self.reached = reached
        if self.used >= self.limit:
            return False
        self.used += 1
        return True

    def started(self, at: float) -> None:
        self.since = at


def k8s_rules(strategy: str, roles) -> tuple[frozenset[str], frozenset[str]]:
    """The rules above as a Kubernetes manifest needs them, for each of `roles`: (the roles whose
    lost task restarts alone, the sidecars: the roles whose failure is never the job's)."""
    alone = frozenset(r for r in roles if decide(strategy, r, exit_codes.LOST_PEER) == RESTART_TASK)
    sidecars = frozenset(r for r in roles if decide(strategy, r, exit_codes.FAILED) != PERMANENT)
    return alone, sidecars
