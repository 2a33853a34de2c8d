"""A supervisor's children: how one is started, signalled, waited for, killed, and whether it still
makes progress. No TensorFlow here."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from od_dist.cluster.spec import Task
from od_dist.protocol import exit_codes, notes, spare

# Stopping every task for a restart: the lost task held the variables (ps), was the one that saves
# (master) or blocks every all-reduce, so the survivors have nothing consistent to save; they get
# this long to exit on SIGTERM before SIGKILL. The same for trainers stopped for a new round.
RESTART_STOP_GRACE_S = 10.0
MIN_CPU_SHARE = 0.02  # less CPU than this (and no byte written) is no progress: an idle process
POLL_S = 0.2

# ----- processes --------------------------------------------------------------------------------


def _die_with_parent_hook():
    """A pre-exec hook: the kernel sends the child SIGTERM when the launcher dies. libc is loaded
    here, in the parent (loading a library in a forked child of a threaded parent can deadlock),
    and the child exits at once if the launcher died before the hook ran."""
    try:
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:
        return None
    parent = os.getpid()

    def hook():
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)

    return hook


def child_env(tf_config: str | None = None, task_log: str | None = None) -> dict[str, str]:
    """A task's environment: this process's, as it is now."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TF_CONFIG", None)  # the child gets its task from --cluster/--role/--index...
    if tf_config:
        env["TF_CONFIG"] = tf_config  # ...or from the TF_CONFIG its supervisor was given
    if task_log:
        env["OD_DIST_TASK_LOG"] = task_log  # the task appends its own detail there: host/console.py
    return env


def start_child(
    argv: list[str],
    stdout=None,
    tf_config: str | None = None,
    task_log: str | None = None,
    as_spare: bool = False,
) -> subprocess.Popen:
    """A task as a child process in its own process group: a Ctrl+C in the terminal reaches only
    the supervisor, which then stops the trainers before the servers. The child also dies with the
    supervisor, so even a supervisor killed with SIGKILL (or terminated, on Windows) leaves none: on
    Linux by PR_SET_PDEATHSIG, on Windows by a kill-on-close job object (host/winjob.py).
    `as_spare`: the child is a spare (protocol/spare.py), its stdin a pipe."""
    env = child_env(tf_config, task_log)
    if as_spare:
        env[spare.SPARE_ENV] = "1"
    kwargs = {}
    if os.name == "nt":
        kwargs["creationflags"] = subprocess.CREATE_NEW_PROCESS_GROUP
    else:
        kwargs["start_new_session"] = True
        if sys.platform.startswith("linux"):
            kwargs["preexec_fn"] = _die_with_parent_hook()
    if stdout is not None:
        kwargs.update(
            stdout=stdout, stderr=subprocess.STDOUT, text=True, encoding="utf-8", errors="replace", bufsize=1
        )
    stdin = subprocess.PIPE if as_spare else subprocess.DEVNULL
    proc = subprocess.Popen(argv, stdin=stdin, env=env, **kwargs)
    if os.name == "nt":
        from od_dist.host import winjob

        winjob.hold(proc)
    return proc


# Windows can send a process group no signal but CTRL_BREAK (and CTRL_C only to a whole console).
# Switches, so that tests on Linux run the Windows branch.
WINDOWS = os.name == "nt"
CTRL_BREAK = getattr(signal, "CTRL_BREAK_EVENT", None)


def send(r: Running, signum: int) -> None:
    """SIGINT (a person's stop, passed on) or SIGTERM (the system's: a restart, the end of
    `launch`, a SIGTERM to the supervisor) to a child in its own process group. On Windows both
    go as CTRL_BREAK, a person's Ctrl+Break to the task (130, passed on to the whole job), so the
    system's stop leaves a note first: the task reads it when the signal arrives and takes the stop
    for a SIGTERM (task/stop.py meant): 143, and restarted as a lost peer where the rules say so."""
    if r.proc.poll() is not None:
        return
    if WINDOWS and exit_codes.for_signal(signum) == exit_codes.TERMINATED and r.notes_dir:
        notes.leave_for_child(r.notes_dir, r.proc.pid, notes.SYSTEM_STOP)
    try:
        r.proc.send_signal(CTRL_BREAK if WINDOWS else signum)
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


def stop(runs: list[Running], grace_s: float, interrupted: Callable[[], bool] = lambda: False) -> None:
    """SIGTERM, then SIGKILL whatever is left after grace_s (or at once when interrupted() says so)."""
    for r in runs:
        send(r, signal.SIGTERM)
    procs = [r.proc for r in runs]
    if not wait_all(procs, grace_s, interrupted):
        kill_all(procs)


@dataclass
class Running:
    task: Task
    proc: subprocess.Popen
    log_path: str | None = None  # where its output goes, for the messages
    tmpdir: str | None = None  # its temporary folder (TMPDIR), removed once it has exited
    notes_dir: str | None = None  # where it leaves notes (notes.leave_for_supervisor), removed likewise


def _work_done(proc: subprocess.Popen) -> tuple[float, int]:
    """(CPU seconds, bytes written) so far by a child and its own children; (0, 0) once gone."""
    import psutil

    cpu, written = 0.0, 0
    try:
        root = psutil.Process(proc.pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                cpu += t.user + t.system
                io = p.io_counters()
                written += getattr(io, "write_chars", 0) or io.write_bytes
            except (psutil.Error, AttributeError, NotImplementedError):
                pass
    except psutil.Error:
        pass
    return cpu, written


@dataclass
class Progress:
    """Whether a child still does something: CPU used or bytes written since the last look."""

    proc: subprocess.Popen
    last: tuple[float, int] = (0.0, 0)
    last_at: float = 0.0
    last_progress_at: float = 0.0

    def __post_init__(self):
        self.last, self.last_at = _work_done(self.proc), time.monotonic()
        self.last_progress_at = self.last_at

    def look(self) -> tuple[float, int]:
        """The CPU seconds and bytes written since the last look."""
        now, work = time.monotonic(), _work_done(self.proc)
        cpu, written = work[0] - self.last[0], work[1] - self.last[1]
        if written > 0 or cpu >= MIN_CPU_SHARE * (now - self.last_at):
            self.last_progress_at = now
        self.last, self.last_at = work, now
        return cpu, written
