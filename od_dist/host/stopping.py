"""How the job here stops when it is asked to, for Supervisor (host/supervisor.py): a signal to the
supervisor (Ctrl+C, Ctrl+Break, a SIGTERM: Slurm's scancel, its time limit), the stop file (a Windows
boot task's removal), or a person's stop passed on by a task (its exit 130). Trainers first, given
--grace_period to save a checkpoint while the servers still hold the variables, then the rest; a
second interrupt kills at once; a stop that killed trainers says what a restart resumes from. A part
of Supervisor, kept apart for its reader as host/rounds.py is. No TensorFlow here."""

from __future__ import annotations

import os
import signal

from od_dist.host.policy import is_trainer
from od_dist.host.processes import kill_all, send, stop, wait_all
from od_dist.protocol import exit_codes

SERVER_STOP_GRACE_S = 10.0  # servers and the evaluator hold no training state


class Stopping:
    """Supervisor's methods for stopping its tasks (its `running`, `signals`, `grace_s`, `say`...)."""

    def on_signal(self, signum, _frame=None) -> None:
        self.signals.append(signum)
        if len(self.signals) == 2:
            self.say("second interrupt: stopping every task now")

    def _stop_asked(self, started: float) -> bool:
        """The stop file appeared since the job started here (an older one is no word for this
        run): it is removed and the job stopped as a SIGTERM stops it."""
        if not self.stop_file or self._stop_why:
            return False
        try:
            if os.stat(self.stop_file).st_mtime < started - 1:
                return False
            os.remove(self.stop_file)
        except OSError:
            return False
        self._stop_why = f"{self.stop_file} appeared"
        return True

    def _interrupt(self, signum: int, why: str | None = None) -> int:
        """The job is stopped: by a signal to this supervisor, or (`why`) by a person elsewhere.
        Trainers first, so they save a checkpoint while the servers still hold the variables;
        then the rest."""
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        why = why or name
        # A person's stop (Ctrl+C, Ctrl+Break) is passed on as one; any other as the system's.
        person = exit_codes.for_signal(signum) == exit_codes.INTERRUPTED
        trainers = [
            r.task.name
            for r in self.running.values()
            if is_trainer(self.strategy, r.task.role) and r.proc.poll() is None
        ]
        killed: list[str] = []  # trainers killed before they exited: their save may be missing
        before = self._newest_step()
        if trainers:
            self.say(
                f"{why}: asking {', '.join(trainers)} to save a checkpoint and stop (up to "
                f"{self.grace_s:.0f} s; interrupt again to stop at once), then the other tasks"
            )
            for r in self._runs(trainers=True):
                send(r, signal.SIGINT if person else signal.SIGTERM)
            if not wait_all(self._procs(trainers=True), self.grace_s, lambda: len(self.signals) > 1):
                killed = [r.task.name for r in self._runs(trainers=True) if r.proc.poll() is None]
                if len(self.signals) <= 1:
                    self.say(
                        f"{', '.join(killed)} still running after {self.grace_s:.0f} s "
                        "(--grace_period); killing them"
                    )
                kill_all(self._procs(trainers=True))
        elif person and any(p.poll() is None for p in self._procs()):
            # Servers alone here (a ps's machine): Ctrl+C asks the master (elsewhere) to save and
            # end the job; they exit once it has answered (server.py).
            self.say(
                f"{why}: asking the master to save a checkpoint and end the job (up to {self.grace_s:.0f} s; "
                "interrupt again to stop at once)"
            )
            for r in self._runs():
                send(r, signal.SIGINT)
            wait_all(self._procs(), self.grace_s, lambda: len(self.signals) > 1)
        elif self.term_to_all and not person and any(p.poll() is None for p in self._procs()):
            # Stopped after SERVER_STOP_GRACE_S, they could die mid-save: the master's variables
            # are theirs (a ps), its steps their work (a parameter_server worker).
            self.say(
                f"{why}: serving on until the master has saved and exited (up to {self.grace_s:.0f} s, "
                "--grace_period), then stopping"
            )
            for r in self._runs():
                send(r, signal.SIGTERM)
            wait_all(self._procs(), self.grace_s, lambda: len(self.signals) > 1)
        else:
            self.say(f"{why}: stopping every task")
        self._stop_all(SERVER_STOP_GRACE_S, trainers_first=False)
        code = exit_codes.for_signal(signum)
        if killed:
            self.say(self._killed_line(killed, before, code))
        return code

    def _killed_line(self, killed: list[str], before: int | None, code: int) -> str:
        """The last line of a stop that killed trainers: 130/143 says a trainer saved a checkpoint
        first, which these may not have; so, from the state file, what a restart resumes from."""
        names, its = ", ".join(killed), "their" if len(killed) > 1 else "its"
        how = (
            "at the second interrupt"
            if len(self.signals) > 1
            else f"after --grace_period ({self.grace_s:.0f} s)"
        )
        newest = self._newest()
        if not self.model_dir:
            return f"{names} killed {how}, maybe before {its} save; exit {code}"
        if newest is None:
            where = (
                f"a restart resumes from the newest checkpoint in {self.model_dir} (not read from here)"
                if "://" in self.model_dir
                else f"no checkpoint in {self.model_dir}: a restart starts from step 0"
            )
            return f"{names} killed {how}, before {its} save; {where}; exit {code}"
        at = f"step {newest[0]} ({os.path.join(self.model_dir, newest[1])}), where a restart resumes"
        if before is None or newest[0] > before:
            # Saved during the stop: killed after it, in an export or TensorFlow's shutdown.
            return (
                f"{names} killed {how}, after a checkpoint was saved: the newest on disk is {at}; exit {code}"
            )
        return f"{names} killed {how}, before {its} save: the newest checkpoint on disk is {at}; exit {code}"

    def _stop_all(self, grace_s: float, trainers_first: bool) -> None:
        interrupted = lambda: len(self.signals) > 1  # noqa: E731 - a second Ctrl+C: kill at once
        if trainers_first:
            stop(self._runs(trainers=True), grace_s, interrupted)
        stop(self._runs(), SERVER_STOP_GRACE_S, interrupted)
        for r in self.running.values():
            self._finish(r)
        self.running.clear()
