"""Stop with a checkpoint: SIGTERM, SIGINT (Ctrl+C) and SIGBREAK (CTRL_BREAK on Windows) ask a
trainer to stop. The trainer finishes the loop it is in (at most steps_per_loop steps), saves a
checkpoint, and exits 143 (SIGTERM) or 130 (SIGINT, SIGBREAK). A second signal exits at once.
A stop its supervisor sends for the system (meant) is a SIGTERM whatever signal carried it.

Python runs signal handlers only in the main thread, between bytecodes, so a handler alone could
wait for a whole TensorFlow loop. The C-level handler also writes the signal number to a wakeup
socket at once; a thread reading it makes "a second Ctrl+C exits at once" hold even then.
No TensorFlow here.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

from od_dist.protocol import exit_codes, notes

SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGBREAK") if hasattr(signal, name))
# One Ctrl+C reaches every process of the terminal's process group, and a launcher may forward it
# as well: signals this close together are the same request, not "press again to exit at once".
SAME_REQUEST_S = 1.0


def meant(signum: int) -> int:
    """The stop a signal stands for: SIGTERM when this task's supervisor left word that the stop is
    its own (a restart, the end of `launch`: host/processes.py send()), whatever carried it (on
    Windows the CTRL_BREAK a process group can only be sent); else the signal itself. So a
    supervisor's stop exits 143 and is never passed on to the job as a person's Ctrl+C."""
    if signum != signal.SIGTERM and notes.from_supervisor(notes.SYSTEM_STOP):
        return signal.SIGTERM
    return signum


def shown(signum: int) -> str:
    """A signal's name as a line shows it, with what it stands for (meant) when that differs."""
    name = signal.Signals(signum).name
    return f"{name} (its supervisor's stop, as SIGTERM)" if meant(signum) != signum else name


class StopRequest:
    """Records the first stop signal; exits the process at once on a later one."""

    def __init__(self, who: str = "od-dist", peer_requests=None):
        self.who = who
        self.peer_requests = peer_requests  # () -> the stop requests of peers (parameter_server servers)
        self.why = ""  # a peer's request, taken as a Ctrl+C here
        self.signum: int | None = None
        self._first_at = 0.0
        self._lock = threading.Lock()
        self._previous: dict = {}
        self._wakeup = None  # (reader, writer) sockets while installed
        self._previous_fd = -1

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def code(self) -> int:
        """The exit status for the signal received, 0 if none."""
        return exit_codes.for_signal(self.signum) if self.signum is not None else 0

    @property
    def name(self) -> str:
        """The signal's name, or the peer's request that stopped it."""
        if self.why:
            return self.why
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def poll_peers(self) -> None:
        """At a loop boundary: a peer's stop request (a server stopped with Ctrl+C) counts as a
        Ctrl+C here, so the job ends with a checkpoint as it would for the master's own."""
        if self.signum is not None or self.peer_requests is None:
            return
        asked = self.peer_requests()
        if asked:
            with self._lock:
                if self.signum is None:
                    self.signum, self.why, self._first_at = signal.SIGINT, ", ".join(asked), time.monotonic()
            print(f"{self.who}: {', '.join(asked)}; saving a checkpoint and ending the job", flush=True)

    def note(self, received: int) -> None:
        signum = meant(received)
        with self._lock:
            now = time.monotonic()
            if self.signum is None:
                self.signum, self._first_at = signum, now
                print(
                    f"{self.who}: {shown(received)} received; saving a checkpoint at the end of "
                    "this loop, then exiting (press Ctrl+C again to exit at once, without it)",
                    flush=True,
                )
                return
            if now - self._first_at < SAME_REQUEST_S:
                return
        print(
            f"{self.who}: {shown(received)} received again; exiting now without a checkpoint",
            file=sys.stderr,
            flush=True,
        )
        os._exit(exit_codes.for_signal(signum))

    def install(self) -> StopRequest:
        """Installs the handlers (from the main thread)."""
        try:
            reader, writer = socket.socketpair()
            writer.setblocking(False)
            self._previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
            self._wakeup = (reader, writer)
            threading.Thread(
                target=self._read_wakeups, args=(reader,), name="od-dist-signals", daemon=True
            ).start()
            handler = lambda signum, frame: None  # the wakeup thread does the work  # noqa: E731
        except (OSError, ValueError):  # no wakeup socket here: note the signal from the handler
            handler = lambda signum, frame: self.note(signum)  # noqa: E731
        for s in SIGNALS:
            self._previous[s] = signal.signal(s, handler)
        return self

    def _read_wakeups(self, reader: socket.socket) -> None:
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in SIGNALS:
                    self.note(signum)

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._previous_fd)
            for sock in reversed(self._wakeup):  # the writer first: the reader thread sees EOF
                sock.close()
            self._wakeup = None

    def __enter__(self) -> StopRequest:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()
