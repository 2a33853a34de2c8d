"""What a task tells the others as it ends, typed here and text only on the way: the master's word to
its servers (why the job ends, and the exit code they take from it), and the notes a task leaves its
supervisor (a file named for its pid: its exit code stays the table's, for Kubernetes)."""

from __future__ import annotations

import os
import re

from od_dist.protocol import exit_codes

# A file in a supervisor's working directory whose appearance stops its job as a SIGTERM does (the
# trainers save first): what a Windows boot task's removal writes, as Windows sends a task no signal.
STOP_FILE = "od-dist.stop"

# ----- the master's word to its servers (a stop marker, or said on its port before training) -----

DONE = "finished training"  # the end of the job: the servers exit 0
PERSON = "was stopped (Ctrl+C)"  # the master's own person's stop
_CODE = re.compile(r"; exit (\d+)$")


def word(why: str, code: int) -> str:
    """The master's word: why the job ends, and the exit code its servers take from it."""
    return f"{why}; exit {code}"


def by_person(why: str = PERSON) -> str:
    """A person's stop (130): the servers exit 130 as the master does, and no supervisor restarts
    them (policy.STOPPED_BY_PERSON)."""
    return word(why, exit_codes.INTERRUPTED)


def stopped_the_job(why: str) -> str:
    """The master's word when it stopped for a server's request (a person's stop there)."""
    return by_person(f"stopped the job: {why}")


def read(text: str) -> tuple[str, int]:
    """(why, the exit code it gives the servers): 0 for the end of the job (DONE)."""
    said = _CODE.search(text)
    return (text[: said.start()], int(said.group(1))) if said else (text, exit_codes.OK)


def shown(text: str) -> str:
    """The word as a line shows it: a person's stop without its code (the line says exit 130)."""
    why, code = read(text)
    return why if code == exit_codes.INTERRUPTED else text


# ----- notes between a task and its supervisor --------------------------------------------------
# A task run by od-dist's own supervisor (launch, train --max_restarts) can say more than its exit
# code, which stays the table's for Kubernetes, and hear more than a signal: a file named
# <its pid>.<word> in this folder (one folder per start of a task, removed once it exited: a PID is
# reused).
NOTES_ENV = "OD_DIST_SUPERVISOR_NOTES"
WAITED_OUT = "waited-out"  # exit 138 after --wait_timeout without a peer: a restart would wait again
# An elastic parameter_server job's coordinator waited --wait_timeout for a ps: the variables were there,
# so no round of any members can go on.
PS_LOST = "ps-lost"
# From the supervisor, just before it sends a stop of its own (a restart, the end of `launch`, a
# SIGTERM to it): the signal that follows is the system's (143), not a person's. Windows can send a
# process group only CTRL_BREAK, which alone reads as a person's Ctrl+Break (130).
SYSTEM_STOP = "system-stop"
# The step a trainer's last loop ended at (the file holds the number, rewritten each loop): training
# past every earlier start's furthest step is progress for --max_restarts even when a killed save kept
# it off this machine's disk, the peers holding it (policy.Budget).
REACHED = "reached"


def _started_as() -> tuple[int, int]:
    """The PIDs the supervisor may know this process by: its own, or on Windows its parent's, as a
    venv's python.exe is a launcher that runs the interpreter as its child. The notes folder is
    this start's alone, so the parent's PID there can mean nothing else."""
    return os.getpid(), os.getppid()


def leave_for_supervisor(note: str, text: str = "") -> None:
    """Leaves `note` (holding `text`) for this process's supervisor, if it has one."""
    folder = os.environ.get(NOTES_ENV)
    if folder:
        for pid in _started_as():
            _write(folder, pid, note, text)  # unwritten, the supervisor restarts it, as for any 138


def leave_step_reached(step: int) -> None:
    """Tells this process's supervisor, if it has one, that a loop of training ended at `step`."""
    leave_for_supervisor(REACHED, str(step))


def step_reached(notes_dir: str, pid: int) -> int | None:
    """The step the child `pid` last said a loop ended at (leave_step_reached), None for none."""
    try:
        with open(os.path.join(notes_dir, f"{pid}.{REACHED}")) as f:
            return int(f.read())
    except (OSError, ValueError):  # none yet, or read while being rewritten
        return None


def leave_for_child(notes_dir: str, pid: int, note: str) -> None:
    """Leaves `note` for the child `pid` in its notes folder (the supervisor's side)."""
    _write(notes_dir, pid, note)  # unwritten, the child takes the signal as it comes


def _write(notes_dir: str, pid: int, note: str, text: str = "") -> None:
    try:
        with open(os.path.join(notes_dir, f"{pid}.{note}"), "w") as f:
            f.write(text)
    except OSError:
        pass


def from_supervisor(note: str) -> bool:
    """Whether this process's supervisor left it `note` (leave_for_child)."""
    folder = os.environ.get(NOTES_ENV)
    return bool(folder) and any(left(folder, pid, note) for pid in _started_as())


def left(notes_dir: str, pid: int, note: str) -> bool:
    """Whether the child `pid` left `note` in `notes_dir` (leave_for_supervisor)."""
    return os.path.exists(os.path.join(notes_dir, f"{pid}.{note}"))
