"""An elastic job's rounds as the supervisor steps them (host/agreement.py has the rules): forming
the next round when no trainer runs here, stopping the trainers for a newer round or a newcomer, and
what a lost trainer means. A part of Supervisor (host/supervisor.py), kept apart for its reader.
No TensorFlow here."""

from __future__ import annotations

import signal
import time

from od_dist.cluster.spec import MEMBER_ROLES, Task
from od_dist.host import elastic as elastic_mod
from od_dist.host.policy import describe, own_failure
from od_dist.host.processes import RESTART_STOP_GRACE_S, Running, kill_all, send, stop
from od_dist.protocol import exit_codes


class Rounds:
    """Supervisor's methods for an elastic job (its `elastic`, `tasks`, `running`, `say`...)."""

    def _members(self) -> list[Task]:
        """The members of the rounds here (Cluster.members): its master or workers."""
        return [t for t in self.tasks if t.role in MEMBER_ROLES]

    def _member_runs(self) -> list[Running]:
        return [r for r in self.running.values() if r.task.role in MEMBER_ROLES]

    def _elastic_step(self) -> int | None:
        """Forms the next round when no trainer runs here, or, while they train, stops them for a
        machine that wants in; returns the job's exit status when this machine is done with it."""
        e = self.elastic
        running = [t for t in self._members() if t.name in self.running]
        if e.phase == elastic_mod.TRAINING:
            if running and not self.regrouping:
                why = e.newcomer()
                if why:
                    names = ", ".join(t.name for t in running)
                    self.regrouping = e.stopping = True
                    self.regroup_asked_at = time.monotonic()
                    if e.lease_lost:
                        # Cut off, its save cannot reach the ps; healed, its steps and its save would
                        # race the round the others form meanwhile, whose newer checkpoint wins anyway.
                        self.say(f"{why}: killing {names} (a save now would race the round the others form)")
                        kill_all([r.proc for r in self._member_runs()])
                    else:
                        self.say(
                            f"{why}: asking {names} to save a checkpoint and stop, to go on in a new round"
                        )
                        for r in self._member_runs():
                            send(r, signal.SIGTERM)
            elif running and time.monotonic() - self.regroup_asked_at > self.grace_s:
                # A step that never ends (its peers cut off) never reaches the loop boundary where
                # the stop is taken: killed, as --grace_period says, so that this machine forms again.
                names = ", ".join(t.name for t in running)
                self.say(
                    f"{names} still running {self.grace_s:.0f} s after the stop (--grace_period); killing them"
                )
                kill_all([r.proc for r in self._member_runs()])
                # Its trainers did not stop as asked: this machine's failure (a hang, a step that never
                # ends), charged as a crash is, though the stop was planned; once (the kill is sent).
                self.regroup_asked_at = float("inf")
                were = "were" if len(running) > 1 else "was"
                e.charge(f"{names} overran --grace_period ({self.grace_s:.0f} s) and {were} killed")
            return None
        if e.phase == elastic_mod.DONE or running:
            return None
        try:
            group = e.form()
        except elastic_mod.RunConflict as conflict:
            self.say(f"{conflict}; exit {exit_codes.INVALID}")
            return exit_codes.INVALID
        if group is not None:
            for t in self._members():
                self.running[t.name] = self._start(t, group)
            # The budget's clock starts when a round trains, not at the regroup: a slow forming
            # is no time of the tasks running without a loss.
            self.budget.started(time.monotonic())
            return None
        finished = e.finished_elsewhere()
        if finished:
            self.say(
                f"the trainers of round {finished['round']} ({', '.join(finished['members'])}) finished the "
                "job without this machine's"
            )
            e.done(finished.get("run"))
            self.finished.update(t.name for t in self._members())
            return None
        # --wait_timeout, and the time a proposal then takes (the first round waits that long for
        # every trainer before it starts with those up).
        if time.monotonic() - e.forming_since > e.wait_timeout + e.confirm_s:
            self.say(
                f"no group of at least min_trainers ({e.cluster.min_trainers}) formed within "
                f"--wait_timeout ({e.wait_timeout:.0f} s); exit {exit_codes.LOST_PEER}"
            )
            return exit_codes.LOST_PEER
        return None

    def _regroup(self, cause: str, code: int, exits) -> int | None:
        """A trainer here stopped, lost a peer or was lost: the trainers here stop, and this machine
        forms the next round with the trainers up. A stop this supervisor asked for (a machine
        wants in) is no failure; any other counts against --max_restarts, as a restart does."""
        # Asked here, or by another member for the same newcomer (its stop reaches every trainer).
        planned = self.regrouping or self.elastic.newcomer(members=False) is not None
        self.regrouping = False
        # A peer lost (138) is another member's failure, charged on its machine, not on this one:
        # one machine that fails at every start must not use up every healthy machine's budget.
        others = exit_codes.normalize(code) == exit_codes.LOST_PEER
        how = "as asked"
        if planned:
            killed = exit_codes.normalize(code) == exit_codes.KILLED  # a lease lost, or --grace_period
            cause = f"{', '.join(t.name for t, _ in exits)} {'stopped' if killed else 'saved and stopped'} ({describe(code)})"
        elif others:
            how = "not counted against --max_restarts (another machine's loss)"
        else:
            count = self._take_restart(time.monotonic(), cause)
            if count is None:
                return self._out_of_restarts(cause, code)
            how = f"restart {count}"
        stop(self._member_runs(), RESTART_STOP_GRACE_S, lambda: len(self.signals) > 1)
        for t in self._members():
            if t.name in self.running:
                self._finish(self.running.pop(t.name))
        # A ps here lost (its variables with it): started again at once; the round's coordinator,
        # which lost them too, is in the next round.
        for t, _ in exits:
            if t.role == "ps" and t.name in self.running:
                self._finish(self.running.pop(t.name))
                self.pending[t.name] = time.monotonic()
        self.say(
            f"{cause}; {how}: forming the next round with the trainers up (min_trainers "
            f"{self.elastic.cluster.min_trainers}), from the newest checkpoint any of them holds"
        )
        # A 138 unasked: the next look says whether a peer was lost or the loss is this machine's.
        self.elastic.regroup(failed=not planned and own_failure(code), lost_peer=not planned and others)
        evaluators = [t for t, _ in exits if t.role == "evaluator" and t.name in self.running]
        return self._restart_evaluators(evaluators, exits) if evaluators else None
