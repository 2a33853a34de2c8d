"""Stop signals without TensorFlow: the first asks for a stop, one within a second of it is the
same request, a later one exits at once even while the main thread is busy in C code."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from loopback import ROOT, python_path

from od_dist.protocol import exit_codes
from od_dist.task import stop

# The main thread blocks in one long C call (as in a TensorFlow loop) until a stop is requested.
CHILD = """
import sys, time, select
from od_dist.task import stop
with stop.StopRequest("child") as s:
    print("ready", flush=True)
    while not s.requested:
        time.sleep(0.05)
    print("asked", s.name, s.code, flush=True)
    select.select([], [], [], 60)  # a 60 s C call: only the wakeup thread can act now
print("returned", flush=True)
"""


def start_child():
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=python_path(ROOT)),
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.skipif(os.name == "nt", reason="POSIX signals")
@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_first_signal_asks_second_exits_at_once(signum, code):
    proc = start_child()
    try:
        proc.send_signal(signum)
        # The handler's line and the child's own come from two threads. A print writes its text
        # whole, then its newline, but the child's print writes each word apart: its words can
        # land right after the handler's text, before that line's newline ("...without it)asked").
        text = proc.stdout.readline() + proc.stdout.readline()
        handler = re.search(rf"child: {signum.name} received; saving a checkpoint[^\n]*?without it\)", text)
        assert handler, text
        rest = text[: handler.start()] + " " + text[handler.end() :]
        assert rest.split() == ["asked", signum.name, str(code)], text
        proc.send_signal(signum)  # within SAME_REQUEST_S: the same request (a forwarded copy)
        time.sleep(stop.SAME_REQUEST_S + 0.5)
        assert proc.poll() is None
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=20)
        assert time.monotonic() - start < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == exit_codes.INTERRUPTED
    assert "SIGINT received again; exiting now without a checkpoint" in out
    assert "returned" not in out


def test_codes_and_restore():
    assert exit_codes.for_signal(signal.SIGTERM) == exit_codes.TERMINATED == 143
    assert exit_codes.for_signal(signal.SIGINT) == exit_codes.INTERRUPTED == 130
    before = signal.getsignal(signal.SIGINT)
    with stop.StopRequest() as s:
        assert signal.getsignal(signal.SIGINT) is not before
        assert not s.requested and s.code == 0
    assert signal.getsignal(signal.SIGINT) is before


def test_a_servers_stop_request_stops_the_master_as_a_ctrl_c_here():
    """Ctrl+C on a parameter_server server's machine: the master reads the server's request at a
    loop boundary and stops as for its own Ctrl+C (a checkpoint, exit 130), naming who asked."""
    from od_dist.task.stop import StopRequest

    asked = []
    stop = StopRequest("master:0", peer_requests=lambda: list(asked))
    stop.poll_peers()
    assert not stop.requested
    asked.append("ps:0 was stopped by Ctrl+C")
    stop.poll_peers()
    assert stop.requested and stop.code == 130 and stop.name == "ps:0 was stopped by Ctrl+C"


def test_a_server_told_of_a_persons_stop_exits_130_and_of_the_end_0(capsys):
    from od_dist.cluster.spec import Address, Task
    from od_dist.protocol import notes
    from od_dist.task import server

    ps = Task("ps", 0, Address("127.0.0.1", 2222))
    assert server._told(ps, notes.by_person()) == 130
    assert server._told(ps, notes.stopped_the_job("ps:0 was stopped by Ctrl+C")) == 130
    assert server._told(ps, notes.DONE) == 0
    assert server._told(ps, notes.word("failed (ResourceExhaustedError)", 1)) == 1  # the master's
    assert capsys.readouterr().out.splitlines() == [
        "ps:0: the master was stopped (Ctrl+C); stopping; exit 130",
        "ps:0: the master stopped the job: ps:0 was stopped by Ctrl+C; stopping; exit 130",
        "ps:0: the master finished training; stopping",
        "ps:0: the master failed (ResourceExhaustedError); exit 1; stopping",
    ]


def test_a_stop_its_supervisor_left_word_of_is_a_sigterm_whatever_carries_it(tmp_path, monkeypatch):
    """On Windows a supervisor can send a task only CTRL_BREAK, a person's Ctrl+Break by itself:
    for its own stops (a restart, the end of `launch`) it leaves a note first (host/processes.py
    send()), and the task, trainer or server, takes the signal for the SIGTERM it stands for."""
    from od_dist.protocol import notes

    monkeypatch.setenv(notes.NOTES_ENV, str(tmp_path))
    assert stop.meant(signal.SIGINT) == signal.SIGINT  # no note: a person's
    assert stop.shown(signal.SIGINT) == "SIGINT"
    for pid in (os.getpid(), os.getppid()):  # its own PID, or a Windows venv launcher's (its parent)
        note = tmp_path / f"{pid}.{notes.SYSTEM_STOP}"
        notes.leave_for_child(str(tmp_path), pid, notes.SYSTEM_STOP)
        assert note.exists()
        assert stop.meant(signal.SIGINT) == stop.meant(signal.SIGTERM) == signal.SIGTERM
        assert stop.shown(signal.SIGINT) == "SIGINT (its supervisor's stop, as SIGTERM)"
        s = stop.StopRequest("master:0")
        s.note(signal.SIGINT)
        assert (s.name, s.code) == ("SIGTERM", exit_codes.TERMINATED)
        note.unlink()
    monkeypatch.delenv(notes.NOTES_ENV)
    assert stop.meant(signal.SIGINT) == signal.SIGINT  # no supervisor
