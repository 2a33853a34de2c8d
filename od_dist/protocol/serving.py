"""A read-only HTTP server in a thread of this process, for what od-dist serves its peers (the
lead's checkpoint feed, a trainer machine's membership state). No TensorFlow here.

It runs inside a training process on a LAN, so no client may hold it: each connection has a
deadline for its request (a client sending a byte at a time is cut off), an idle limit on every
read and write of it, and a file sent on it a deadline from the file's size (Limits). At most
`connections` are open at once: past them a new one displaces the one that has waited longest
for its request, or is closed at once when every open one is being answered. A client that hangs
up is no error of the server's: nothing is printed for it.
"""

from __future__ import annotations

import errno
import http.server
import io
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


def url(host: str, port: int, path: str) -> str:
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}/{path}"


@dataclass(frozen=True)
class Limits:
    request_s: float = 5.0  # the request line and headers, whole (a peer sends them in one packet)
    idle_s: float = 15.0  # no byte moves on a connection for this long: the peer is gone
    connections: int = 64  # open at once (a thread each): a feed's fetchers, every machine's look
    # A file's transfer ends by file_s + size / floor_bps: 1 MB/s is 8 Mbit/s, a 100 Mbit/s link
    # shared by a dozen fetchers (a 2 GB shard: 35 min), so only a stalled or trickling client
    # is cut, and the file is not held open longer (on Windows an open file cannot be deleted,
    # so TensorFlow's rotation of the checkpoints would fail meanwhile).
    file_s: float = 60.0
    floor_bps: float = 1e6

    def transfer_s(self, size: int) -> float:
        return self.file_s + size / self.floor_bps


class _Reading(io.RawIOBase):
    """A connection's reads, each bounded by the idle limit and all by the request's deadline."""

    def __init__(self, sock: socket.socket, deadline: float, idle_s: float):
        self._sock, self._deadline, self._idle_s = sock, deadline, idle_s

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request took longer than its deadline")
        self._sock.settimeout(min(self._idle_s, left))
        return self._sock.recv_into(buffer)


class Server:
    """Answers every GET with `answer(request)` (an http.server request handler) on (host, port),
    while entered. `everywhere`: `host` is no address of this machine, so it listens on every
    interface (a name that resolves to an address this machine does not hold: WSL2 behind a port
    proxy), as TensorFlow's server on a task's own port does."""

    def __init__(self, host: str, port: int, answer: Callable, name: str, limits: Limits = Limits()):
        class Handler(http.server.BaseHTTPRequestHandler):
            def setup(self):
                super().setup()
                self.rfile.close()  # read through _Reading instead
                deadline = time.monotonic() + limits.request_s
                self.rfile = io.BufferedReader(_Reading(self.connection, deadline, limits.idle_s))

            def do_GET(self):  # noqa: N802 - the name http.server calls
                self.server.answering(self.request)
                self.connection.settimeout(limits.idle_s)
                answer(self)

            def log_message(self, *args):  # no line per request on the console
                pass

        family = socket.AF_INET6 if ":" in host else socket.AF_INET

        class Threading(_Bounded):
            address_family = family

        try:
            self._server = Threading((host, port), Handler, limits)
            self.everywhere = False
        except OSError as e:
            if e.errno != errno.EADDRNOTAVAIL:
                raise
            everywhere = ("::" if family == socket.AF_INET6 else "0.0.0.0", port)
            self._server = Threading(everywhere, Handler, limits)
            self.everywhere = True
        self.limits = limits
        self._thread = threading.Thread(target=self._server.serve_forever, name=name, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()


class _Bounded(http.server.ThreadingHTTPServer):
    """A thread per connection, at most `limits.connections` of them (see the module's words)."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = 128  # a burst of connections waits for accept() instead of a SYN retry

    def __init__(self, address, handler, limits: Limits):
        super().__init__(address, handler)
        self.limits = limits
        self._lock = threading.Lock()
        self._open: dict[socket.socket, bool] = {}  # each open connection: still reading its request

    def process_request(self, request, client_address):
        with self._lock:
            if len(self._open) >= self.limits.connections:
                waiting = next((s for s, reading in self._open.items() if reading), None)
                if waiting is None:
                    self.shutdown_request(request)
                    return
                del self._open[waiting]
                _cut(waiting)  # its thread's read ends at once, and the thread with it
            self._open[request] = True
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._open.pop(request, None)

    def answering(self, request) -> None:
        """`request` was read whole: it is answered, and no newcomer displaces it."""
        with self._lock:
            if request in self._open:
                self._open[request] = False

    def handle_error(self, request, client_address):
        error = sys.exc_info()[1]
        if isinstance(error, OSError):  # a client that hung up or stalled: its own end
            return
        print(
            f"od-dist: {type(self).__name__}: a request from {client_address[0]} failed: "
            f"{type(error).__name__}: {error}",
            file=sys.stderr,
            flush=True,
        )


def _cut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def send_json(request, value) -> None:
    body = json.dumps(value).encode()
    request.send_response(200)
    request.send_header("Content-Type", "application/json")
    request.send_header("Content-Length", str(len(body)))
    request.end_headers()
    request.wfile.write(body)


def send_file(request, f, chunk: int = 1 << 20) -> None:
    """Sends the open file `f` whole, within the server's transfer deadline for its size (then the
    connection is dropped, TimeoutError, and the caller closes the file)."""
    limits = request.server.limits
    size = os.fstat(f.fileno()).st_size
    deadline = time.monotonic() + limits.transfer_s(size)
    request.send_response(200)
    request.send_header("Content-Length", str(size))
    request.end_headers()
    for data in iter(lambda: f.read(chunk), b""):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"not sent within {limits.transfer_s(size):.0f} s")
        request.connection.settimeout(min(limits.idle_s, left))
        request.wfile.write(data)
