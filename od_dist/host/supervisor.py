"""Restarts after TensorFlow's recovery rules, for `od-dist launch` (every task of this machine) and
`od-dist train --max_restarts` (this machine's one task). No TensorFlow here.

The rules: host/policy.py. Its stops (a signal, the stop file): host/stopping.py; an elastic job's
rounds: host/rounds.py.

The job succeeded only if the lead (the task that writes the final checkpoint: the master, or
worker 0 without one) exited 0. Once it has, a task that exits otherwise is a line, not a failure;
while it still runs after another trainer finished (its final save or export, maybe to a slow
share), it is waited for as long as it makes progress (CPU or bytes written), with a line a minute.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from od_dist.cluster.spec import MEMBER_ROLES, Task
from od_dist.host import elastic as elastic_mod
from od_dist.host.policy import (
    BACKOFF_RESET_S,
    HEALTHY_S,
    PERMANENT,
    RESTART_ALL,
    RESTART_TASK,
    STOPPED_BY_PERSON,
    Budget,
    backoff_s,
    describe,
    is_trainer,
    plan,
)
from od_dist.host.processes import (
    POLL_S,
    RESTART_STOP_GRACE_S,
    Progress,
    Running,
)
from od_dist.host.rounds import Rounds
from od_dist.host.spare import Spare
from od_dist.host.stopping import SERVER_STOP_GRACE_S, Stopping
from od_dist.protocol import checkpoint_feed, exit_codes, membership, notes

SERVER_GRACE_S = 60.0  # servers stop by themselves within this after the master is done
PROGRESS_EVERY_S = 60.0  # a lead still finishing after the others: a line this often
# ...and stopped after this long without progress: long enough for TensorFlow's shutdown, which
# may wait about a minute for the heartbeats of a peer that is gone.
STALLED_S = 180.0


@dataclass
class Supervisor(Rounds, Stopping):
    """Runs tasks as children, restarting them by the rules above until the job is done.

    `start(task)` starts one task and returns its Running; `finish(running)` is called once each
    child has exited (e.g. to let its output reader finish). `say` prints one line for the user.
    `lead`: the name of the task here that writes the final checkpoint (the master, or worker 0
    without one), if it runs here. `eval_command`: the `od-dist eval` line that evaluates the
    final checkpoint, said when an evaluator gave up. `model_dir`: the tasks' --model_dir on this
    machine, whose newest checkpoint tells progress (policy.Budget) and, after a stop that killed a
    trainer, where a restart resumes."""

    strategy: str
    tasks: list[Task]
    start: Callable[[Task], Running]
    say: Callable[[str], None]
    max_restarts: int  # in a row: policy.Budget
    grace_s: float  # how long trainers get to save a checkpoint after SIGINT/SIGTERM
    finish: Callable[[Running], None] = lambda r: None
    # Seconds before restart number n + 1 (n >= 1) of a streak; the first waits nothing.
    backoff: Callable[[int], float] = backoff_s
    backoff_reset_s: float = BACKOFF_RESET_S
    lead: str | None = None
    eval_command: str | None = None
    model_dir: str | None = None
    # A SIGTERM reaches the master too (Slurm's scancel, its time limit): servers here serve on
    # until it has saved through them, then exit by themselves (server.py), within grace_s.
    term_to_all: bool = False
    healthy_s: float = HEALTHY_S
    progress_every_s: float = PROGRESS_EVERY_S
    stalled_s: float = STALLED_S
    running: dict[str, Running] = field(default_factory=dict)
    pending: dict[str, float] = field(default_factory=dict)  # task name -> when to start it
    signals: list[int] = field(default_factory=list)
    restarts: int = 0  # in all, this run
    budget: Budget | None = None  # the tasks', made by run()
    streak: int = 0  # restarts since training last progressed or the tasks ran backoff_reset_s
    restarted_at: float = float("-inf")  # when the last restart started the tasks
    first_failure: str | None = None  # of the budget's restarts in a row
    evaluator_budgets: dict[str, Budget] = field(default_factory=dict)  # its own, per evaluator
    no_evaluation: list[str] = field(default_factory=list)  # evaluators that gave up
    lost: list[tuple[str, int]] = field(
        default_factory=list
    )  # workers ended alone, no restart left: (name, code)
    finished: set[str] = field(default_factory=set)  # tasks done for good (exit 0, or after training)
    first_done: tuple[str, float] | None = None  # the first trainer that finished training, and when
    lead_progress: Progress | None = None
    notes_root: str = ""  # the folders of the children's notes, one per start (notes.leave_for_supervisor)
    scratch: str = ""  # the children's temporary folders, one per start
    # An elastic job (min_trainers): the trainers here start in the group the trainer machines agree
    # (host/elastic.py), and a lost trainer means a new round rather than a restart of the same one.
    elastic: elastic_mod.Elastic | None = None
    # A file whose appearance stops the job as a SIGTERM does (the trainers save first): how a
    # Windows boot task's removal stops it gracefully, as Windows sends a task no signal.
    stop_file: str | None = None
    regrouping: bool = False  # the trainers here were asked to stop for a new round
    regroup_asked_at: float = float("inf")  # when
    # The trainer's warm spare (host/spare.py; `train --max_restarts`, one task here): its start
    # (`start`) takes it when one is ready.
    spare: Spare | None = None
    starts: int = 0  # of tasks, this run
    spare_for: int | None = None  # the pid of the start that last made the spare ready
    _stop_why: str | None = None  # the stop file appeared: the stop's cause (_stop_asked)

    def run(self) -> int:
        """Starts every task and supervises them; returns the job's exit status."""
        self.notes_root = tempfile.mkdtemp(prefix="od-dist-notes-")
        self.scratch = tempfile.mkdtemp(prefix="od-dist-tasks-")
        self.budget = Budget(self.max_restarts, time.monotonic(), self._newest_step(), self.healthy_s)
        try:
            with self._membership():
                for task in self.tasks:
                    if self.elastic is None or task.role not in MEMBER_ROLES:
                        self.running[task.name] = self._start(task)
                return self._loop()
        except MembershipPortTaken:
            return exit_codes.FAILED
        finally:
            # Whatever happened (an exception included), no child outlives the supervisor.
            self._stop_all(SERVER_STOP_GRACE_S, trainers_first=False)
            if self.spare is not None:
                self.spare.close()
            shutil.rmtree(self.notes_root, ignore_errors=True)
            shutil.rmtree(self.scratch, ignore_errors=True)

    def _membership(self):
        """This machine's membership state, served while the job runs here (an elastic job)."""
        if self.elastic is None:
            return contextlib.nullcontext()
        host, port = self.elastic.address()
        try:
            return self.elastic.serving()
        except OSError as e:
            self.say(
                f"membership_port: {port}: cannot serve on {host}:{port} ({e.strerror or e}); free the "
                "port, or give membership_port another one in the cluster file"
            )
            raise MembershipPortTaken() from None

    def _newest(self) -> tuple[int, str] | None:
        """(step, prefix) of the newest checkpoint in --model_dir here, None for none (or none
        readable from here: a remote model_dir)."""
        return checkpoint_feed.newest(self.model_dir) if self.model_dir else None

    def _newest_step(self) -> int | None:
        newest = self._newest()
        return newest[0] if newest else None

    def _reached(self) -> int | None:
        """The furthest step the tasks of this start said a loop of theirs ended at (notes.REACHED)."""
        steps = [notes.step_reached(r.notes_dir, r.proc.pid) for r in self.running.values() if r.notes_dir]
        return max((s for s in steps if s is not None), default=None)

    def _start(self, task: Task, group: membership.Group | None = None) -> Running:
        """Starts `task` with a temporary folder of its own (TMPDIR), removed once it exits: a task
        killed or lost cannot remove its temporary files (autograph's sources, a
        multi_worker_mirrored worker's checkpoint copy), and each restart would add more. `group`:
        the round of an elastic job it trains in."""
        folder = tempfile.mkdtemp(prefix=f"{task.role}-{task.index}-", dir=self.scratch)
        # Its words in a folder of this start alone: a PID is reused once the child is gone, and
        # a word left by an earlier child must not speak for a later one.
        notes_dir = tempfile.mkdtemp(prefix=f"{task.role}-{task.index}-", dir=self.notes_root)
        env = {"TMPDIR": folder, notes.NOTES_ENV: notes_dir}
        if group is not None:
            env[membership.GROUP_ENV] = group.to_env()
        previous = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            running = self.start(task)
        finally:
            for name, value in previous.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        running.tmpdir, running.notes_dir = folder, notes_dir
        self.starts += 1
        return running

    def _finish(self, r: Running) -> None:
        self.finish(r)
        for folder in (r.tmpdir, r.notes_dir):
            if folder:
                shutil.rmtree(folder, ignore_errors=True)

    def _runs(self, trainers: bool | None = None) -> list[Running]:
        return [
            r
            for r in self.running.values()
            if trainers is None or is_trainer(self.strategy, r.task.role) == trainers
        ]

    def _procs(self, trainers: bool | None = None) -> list[subprocess.Popen]:
        return [r.proc for r in self._runs(trainers)]

    def _waited_out(self, task: Task, note: str = notes.WAITED_OUT) -> bool:
        """The task said it exits 138 after --wait_timeout without its peers (a pause elsewhere
        that did not end, a machine that never came): one wait, not one per restart. notes.PS_LOST:
        the peer was a ps of an elastic job, without which no round can go on."""
        r = self.running.get(task.name)
        return r is not None and bool(r.notes_dir) and notes.left(r.notes_dir, r.proc.pid, note)

    def _log_note(self, task: Task) -> str:
        log = self.running[task.name].log_path if task.name in self.running else None
        return f". Its log: {log}" if log else ""

    def _succeeded(self) -> int:
        """The job's end when the lead finished: exit 0, and a last line when evaluation is missing
        (0 all the same, as JobSet's success policy on the master has it: the model is trained)
        or a worker was lost for good. Only workers lost, and no task here finished (a worker's
        machine), this machine's `od-dist` exits with the loss's code, as that task alone would:
        retryable, for an outer restarter."""
        ended = ", ".join(f"{name} ({describe(code)})" for name, code in self.lost)
        if self.lost and not set(self.finished) - set(self.no_evaluation):
            code = self.lost[0][1]
            self.say(f"nothing left here: {ended} ended with no restart left; exit {code}")
            return code
        if self.elastic is not None and self.elastic.history:
            trained = self.elastic.trained(self._newest_step())
            if trained:
                self.say(trained)
        if self.lost:
            missing = (
                f"; evaluation is missing ({', '.join(self.no_evaluation)})" if self.no_evaluation else ""
            )
            self.say(
                f"every task finished but {ended}, lost with no restart left: the master trained on "
                f"the workers left{missing}"
            )
        elif self.no_evaluation:
            # Only a trainer here tells that training finished; an evaluator alone on its machine
            # knows only that its own evaluation is missing.
            self.say(
                f"{'training finished; ' if self.first_done else ''}evaluation is missing "
                f"({', '.join(self.no_evaluation)} used up its restarts)"
                f"{'' if self.first_done else '; training is not affected'}; evaluate the final "
                f"checkpoint with: {self.eval_command or 'od-dist eval'}"
            )
        else:
            self.say("every task finished")
        return exit_codes.OK

    def _training_over(self) -> bool:
        """Every trainer reaches the last step together: once one finished, nothing restarts."""
        return self.first_done is not None

    def _lead_done(self) -> bool:
        """The lead exited 0, or no lead runs here and a trainer here finished."""
        return self.lead in self.finished if self.lead is not None else self._training_over()

    def _loop(self) -> int:
        started = time.time()
        while True:
            if self._stop_asked(started):
                self.signals.append(signal.SIGTERM)
            if self.signals:
                return self._interrupt(self.signals[0], self._stop_why)
            now = time.monotonic()
            for name, due in list(self.pending.items()):
                if now >= due:
                    del self.pending[name]
                    task = next(t for t in self.tasks if t.name == name)
                    self.running[name] = self._start(task)
            exits = []
            for name, r in list(self.running.items()):
                code = r.proc.poll()
                if code is not None:
                    exits.append((r.task, code))
            if exits:
                result = self._handle(exits)
                if result is not None:
                    return result
            if self.elastic is not None:
                result = self._elastic_step()
                if result is not None:
                    return result
            if (
                not self.running
                and not self.pending
                and (self.elastic is None or self.elastic.phase == elastic_mod.DONE)
            ):
                return self._succeeded()
            if self.first_done is not None:
                result = self._after_training()
                if result is not None:
                    return result
            self._spare_step()
            time.sleep(POLL_S)

    def _spare_step(self) -> None:
        """Once a trainer here was restarted (this job sees faults), the first of its starts to say it
        trained a loop makes the next start's spare ready: never beside a start's own import, and
        once per start (a spare that died is not made again and again). Training over,
        nothing restarts: the spare is ended."""
        if self.spare is None:
            return
        if self.first_done is not None:
            self.spare.close()
            return
        if self.starts <= len(self.tasks) or self.spare.ready():
            return
        for r in self._runs(trainers=True):
            if r.proc.pid != self.spare_for and notes.step_reached(r.notes_dir, r.proc.pid) is not None:
                self.spare_for = r.proc.pid
                self.spare.prime()

    def _after_training(self) -> int | None:
        """Once a trainer finished: the lead, if still running, is waited for while it makes
        progress; the other tasks (not the evaluator, which evaluates the final checkpoint) get
        SERVER_GRACE_S to stop by themselves."""
        first, done_at = self.first_done
        now = time.monotonic()
        lead = self.running.get(self.lead) if self.lead is not None else None
        if lead is not None:
            if self.lead_progress is None:
                self.lead_progress = Progress(lead.proc)
            progress = self.lead_progress
            if now - progress.last_at < self.progress_every_s:
                return None
            cpu, written = progress.look()
            if now - progress.last_progress_at >= self.stalled_s:
                self.say(
                    f"{lead.task.name} made no progress for {now - progress.last_progress_at:.0f} s after "
                    f"{first} finished training (no CPU, no byte written); stopping every task; its final "
                    f"checkpoint or export may be missing{self._log_note(lead.task)}"
                )
                return exit_codes.FAILED
            self.say(
                f"{lead.task.name} still finishing {now - done_at:.0f} s after {first} finished training "
                f"(its final checkpoint and export): {cpu:.1f} s CPU, {written / 1e6:.1f} MB written in the "
                f"last {self.progress_every_s:.0f} s; waiting for it while it makes progress"
            )
            return None
        if now - done_at <= SERVER_GRACE_S:
            return None
        stuck = [r.task for r in self.running.values() if r.task.role != "evaluator"]
        if not stuck or len(stuck) != len(self.running):
            return None
        # The lead finished (a failed one ended the job in _handle): the job is done whatever
        # is left, a server that missed the master's stop marker (restarted alone near the end)
        # included.
        names = ", ".join(t.name for t in stuck)
        self.say(
            f"{names} still running {SERVER_GRACE_S:.0f} s after training finished; stopping "
            f"{'them (nothing of theirs' if len(stuck) > 1 else 'it (nothing of it'} is needed)"
        )
        self._stop_all(SERVER_STOP_GRACE_S, trainers_first=False)
        return self._succeeded()

    def _restart_evaluators(self, evaluators, exits) -> int | None:
        """Restarts each evaluator alone within its own --max_restarts; past them, training goes on
        without it (and the job's last line says so). One whose master never came is not restarted
        (it would only wait again): alone here, its 138 is this machine's exit."""
        codes = dict((t.name, c) for t, c in exits)
        for t in evaluators:
            cause = f"{t.name} died ({describe(codes[t.name])})"
            if self._waited_out(t):
                self.say(
                    f"{t.name} waited --wait_timeout for its master, which never came "
                    f"({describe(codes[t.name])}): the job did not start; not restarted"
                )
                self._finish(self.running.pop(t.name))
                if not self.running and not self.pending:
                    return exit_codes.LOST_PEER
                self.no_evaluation.append(t.name)
                self.finished.add(t.name)
                continue
            now = time.monotonic()
            budget = self.evaluator_budgets.setdefault(
                t.name, Budget(self.max_restarts, self.budget.since, healthy_s=self.healthy_s)
            )
            # Time alone starts its count over: a newer checkpoint is no sign that it evaluated one.
            if not budget.take(now):
                self.say(
                    f"{cause}; no restart left for it (--max_restarts {self.max_restarts}); training "
                    f"goes on without evaluation{self._log_note(t)}"
                )
                self.no_evaluation.append(t.name)
                self.finished.add(t.name)
                self._finish(self.running.pop(t.name))
                continue
            wait = self.backoff(budget.used)
            self.say(
                f"{cause}; restart {budget.used}/{self.max_restarts} of {t.name} alone in {wait:.0f} s; "
                f"training goes on{self._log_note(t)}"
            )
            self._finish(self.running.pop(t.name))
            self.pending[t.name] = now + wait
            budget.started(now + wait)
        return None

    def _end_alone(self, tasks, exits, root: str) -> int | None:
        """No restart left for parameter_server workers (lost alone): each ends alone, as it would
        under a command of its own; the coordinator trains on the workers left, and the other tasks
        here go on (a ps, the master). An evaluator among them keeps its own budget."""
        evaluators = [t for t in tasks if t.role == "evaluator"]
        codes = {t.name: exit_codes.normalize(c) for t, c in exits}
        for t in tasks:
            if t.role == "evaluator":
                continue
            log = self._log_note(t)
            self._finish(self.running.pop(t.name))
            self.lost.append((t.name, codes[t.name]))
            going_on = list(self.running)
            here = (
                f" ({', '.join(going_on)} {'go' if len(going_on) > 1 else 'goes'} on here)"
                if going_on
                else ""
            )
            self.say(
                f"{t.name} died ({describe(codes[t.name])}); no restart left (--max_restarts "
                f"{self.max_restarts}); it ends alone: the master trains on the workers left{here}{root}{log}"
            )
        if evaluators:
            return self._restart_evaluators(evaluators, exits)
        return None

    def _done(self, task: Task) -> None:
        self.finished.add(task.name)
        self._finish(self.running.pop(task.name))
        if self.elastic is not None and task.role in MEMBER_ROLES:
            self.elastic.done()
        if self.first_done is None and is_trainer(self.strategy, task.role):
            self.first_done = (task.name, time.monotonic())
            for t in self.tasks:  # a task lost meanwhile has nothing left to do
                if t.role != "evaluator" and self.pending.pop(t.name, None) is not None:
                    self.finished.add(t.name)

    def _handle(self, exits: list[tuple[Task, int]]) -> int | None:
        """Acts on the tasks that just exited; returns the job's exit status when it is over."""
        for task, code in exits:
            if code == 0:
                self._done(task)
        for task, code in exits:
            if task.name not in self.running or task.role == "evaluator" or task.name == self.lead:
                continue
            # Nothing of it is needed once the lead is done; a trainer's, once training is over.
            if self._lead_done() or (self._training_over() and is_trainer(self.strategy, task.role)):
                self.say(f"{task.name} exited after training finished ({describe(code)}); not restarted")
                self._done(task)
        exits = [(t, c) for t, c in exits if t.name in self.running]
        if not exits:
            return None
        p = plan(self.strategy, self.tasks, exits)
        task, code = p.cause
        after = f" after {self.first_done[0]} finished training" if self.first_done else ""
        cause = f"{task.name} died{after} ({describe(code)})"
        if p.action == RESTART_TASK and all(t.role == "evaluator" for t in p.restart):
            return self._restart_evaluators(p.restart, exits)
        if p.action == STOPPED_BY_PERSON:
            return self._interrupt(
                signal.SIGINT,
                f"{task.name} was stopped by a person ({describe(code)}: Ctrl+C, on this machine or "
                "another of the job); not restarted",
            )
        lost_ps = [t for t, _ in exits if self._waited_out(t, notes.PS_LOST)]
        if lost_ps:
            self.say(
                f"{lost_ps[0].name} waited --wait_timeout for a ps (its line above names it): the variables "
                "were there, so no round can go on without it; stopping every task"
            )
            return exit_codes.LOST_PEER
        if self.elastic is not None and p.action in (RESTART_ALL, RESTART_TASK):
            return self._regroup(cause, code, exits)
        waited = [(t, c) for t, c in exits if self._waited_out(t)]
        if waited and p.action in (RESTART_ALL, RESTART_TASK):
            task, code = waited[0]
            self.say(
                f"{task.name} waited --wait_timeout for peers that did not come ({describe(code)}); not "
                "restarted: it would only wait again; stopping every task"
            )
            return exit_codes.LOST_PEER
        if p.action == PERMANENT:
            lost = (
                "; its final checkpoint or export may be missing" if after and task.name == self.lead else ""
            )
            self.say(
                f"{cause}; a permanent error, not retried{lost}; stopping every task{self._log_note(task)}"
            )
            return (
                exit_codes.INVALID if exit_codes.normalize(code) == exit_codes.INVALID else exit_codes.FAILED
            )
        now = time.monotonic()
        count = self._take_restart(now, cause)
        if count is None:
            if p.action == RESTART_TASK:
                return self._end_alone(p.restart, exits, self._root_cause())
            return self._out_of_restarts(cause, code, self._log_note(task))
        # The backoff spaces restarts that bring nothing (a peer not back yet). The first of a streak
        # (training progressed since the last restart, the budget's count started over, or the tasks
        # ran backoff_reset_s) starts at once: its fault is over, and a restarted trainer waits for
        # its peers anyway. The ones after it wait backoff(1), backoff(2), ...
        fresh = self.budget.used == 1 or now - self.restarted_at >= self.backoff_reset_s
        self.streak = 1 if fresh else self.streak + 1
        wait = 0.0 if self.streak == 1 else self.backoff(self.streak - 1)
        if p.action == RESTART_ALL:
            # The restart-all message names the lost task first: the others die of it.
            which = " of every task" if len(self.tasks) > 1 else ""
            self.say(f"{cause}; restart {count}{which} in {wait:.0f} s")
            self._stop_all(RESTART_STOP_GRACE_S, trainers_first=False)
            restart = list(self.tasks)
            self.finished.clear()
            self.first_done, self.lead_progress = None, None
        else:
            names = ", ".join(t.name for t in p.restart)
            which = f" of {names} alone" if len(self.tasks) > 1 else ""
            self.say(f"{cause}; restart {count}{which} in {wait:.0f} s")
            for t in p.restart:
                self._finish(self.running.pop(t.name))
            restart = list(p.restart)
        due = now + wait
        self.restarted_at = due
        self.budget.started(due)
        for t in restart:
            self.pending[t.name] = due
        return None

    def _take_restart(self, now: float, cause: str) -> str | None:
        """One restart of --max_restarts for `cause`: the count to show ('2/3', '1/3 (7 in all)'),
        None when none is left."""
        if not self.budget.take(now, self._newest_step(), self._reached()):
            return None
        if self.budget.used == 1:  # the first of a streak: the root cause if the budget runs out
            self.first_failure = cause
        self.restarts += 1
        return f"{self.budget.used}/{self.max_restarts}" + (
            f" ({self.restarts} in all)" if self.restarts != self.budget.used else ""
        )

    def _root_cause(self) -> str:
        return f"; the first failure (root cause): {self.first_failure}" if self.budget.used else ""

    def _out_of_restarts(self, cause: str, code: int, log_note: str = "") -> int:
        self.say(
            f"{cause}; no restart left (--max_restarts {self.max_restarts}); stopping every task"
            f"{self._root_cause()}{log_note}"
        )
        # Retryable all the same: an outer restarter (systemd, a loop of the user's) may try again.
        return exit_codes.normalize(code)


class MembershipPortTaken(Exception):
    """The membership port could not be served; said in one line."""
