"""A trainer's warm spare (protocol/spare.py), for `od-dist train --max_restarts`: made ready once
the trainer has been restarted and its new start trained a loop (a job that sees faults; one that
sees none pays nothing), taken by the next start, which would otherwise import TensorFlow anew. No TensorFlow
here."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

from od_dist.host.processes import child_env, start_child
from od_dist.protocol import spare


@dataclass
class Spare:
    """`start()` starts the task, in the spare when one is ready; `prime()` makes one ready;
    `close()` ends it unused."""

    argv: list[str]
    tf_config: str | None = None
    proc: subprocess.Popen | None = None

    def start(self) -> subprocess.Popen:
        ready, proc, self.proc = self.ready(), self.proc, None
        if ready:
            try:
                proc.stdin.write(spare.encode(child_env(self.tf_config)))
                proc.stdin.close()
                return proc
            except OSError:  # it died meanwhile
                _end(proc)
        return start_child(self.argv, tf_config=self.tf_config)

    def ready(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def prime(self) -> None:
        if not self.ready():
            self.proc = start_child(self.argv, tf_config=self.tf_config, as_spare=True)

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            _end(proc)


def _end(proc: subprocess.Popen) -> None:
    """A spare has run nothing: killed at once, nothing to save."""
    try:
        proc.kill()
        proc.wait(10)
    except (OSError, subprocess.TimeoutExpired):
        pass
    if proc.stdin is not None:
        try:
            proc.stdin.close()
        except OSError:
            pass
