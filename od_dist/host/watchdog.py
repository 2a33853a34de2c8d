"""The watchdog: a separate process that ends the process it watches, with one line and exit 138,
when that one does not re-arm or disarm it in time. A thread cannot: none runs while the process is
stuck in TensorFlow's C++ holding the GIL. No TensorFlow here."""

from __future__ import annotations

import os
import subprocess
import sys

# The watchdog: a separate process, because no thread of a process stuck in TensorFlow's C++
# (holding the GIL) runs. Each line on its stdin arms it ("SECONDS MESSAGE": with no other line
# within SECONDS it prints MESSAGE and ends the process with SIGUSR1, whose status a shell and an
# orchestrator read as 138; on Windows exit code 138) or disarms it ("0"). It ends quietly when
# its stdin closes (the watched process is done with it, or died).
_WATCHDOG = """
import os, queue, signal, sys, threading
for name in ("SIGINT", "SIGTERM", "SIGBREAK"):  # the watched process handles those itself
    if hasattr(signal, name):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
parent, lines = int(sys.argv[1]), queue.Queue()
threading.Thread(target=lambda: [lines.put(x) for x in sys.stdin] + [lines.put(None)], daemon=True).start()
armed, message = None, ""
while True:
    try:
        line = lines.get(timeout=armed)
    except queue.Empty:
        print(message, file=sys.stderr, flush=True)
        os.kill(parent, getattr(signal, "SIGUSR1", 138))
        break
    if line is None:
        break
    seconds, _, message = line.rstrip("\\n").partition(" ")
    armed = float(seconds) or None
"""


class Watchdog:
    """Ends this process with one line and exit 138 when it is armed and not re-armed or disarmed
    in time (see _WATCHDOG). The line goes to the console (sys.stderr), not only to the log."""

    def __init__(self):
        try:
            console = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):  # a captured stderr: inherit file descriptor 2
            console = None
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, str(os.getpid())],
            stdin=subprocess.PIPE,
            stderr=console,
            text=True,
        )

    def arm(self, seconds: float, message: str) -> None:
        self._send(f"{max(seconds, 0.001):.3f} {message}")

    def disarm(self) -> None:
        self._send("0")

    def _send(self, line: str) -> None:
        self._proc.stdin.write(line.replace("\n", " ") + "\n")
        self._proc.stdin.flush()

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait()

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
