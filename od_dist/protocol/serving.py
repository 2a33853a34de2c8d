"""A read-only HTTP server in a thread of this process, for what od-dist serves its peers (the
lead's checkpoint feed, a trainer machine's membership state). No TensorFlow here."""

from __future__ import annotations

import errno
import http.server
import json
import socket
import threading
from collections.abc import Callable


def url(host: str, port: int, path: str) -> str:
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}/{path}"


class Server:
    """Answers every GET with `answer(request)` (an http.server request handler) on (host, port),
    while entered. `everywhere`: `host` is no address of this machine, so it listens on every
    interface (a name that resolves to an address this machine does not hold: WSL2 behind a port
    proxy), as TensorFlow's server on a task's own port does."""

    def __init__(self, host: str, port: int, answer: Callable, name: str):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the name http.server calls
                answer(self)

            def log_message(self, *args):  # no line per request on the console
                pass

        family = socket.AF_INET6 if ":" in host else socket.AF_INET

        class Threading(http.server.ThreadingHTTPServer):
            address_family = family
            daemon_threads = True

        try:
            self._server = Threading((host, port), Handler)
            self.everywhere = False
        except OSError as e:
            if e.errno != errno.EADDRNOTAVAIL:
                raise
            self._server = Threading(("::" if family == socket.AF_INET6 else "0.0.0.0", port), Handler)
            self.everywhere = True
        self._thread = threading.Thread(target=self._server.serve_forever, name=name, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()


def send_json(request, value) -> None:
    body = json.dumps(value).encode()
    request.send_response(200)
    request.send_header("Content-Type", "application/json")
    request.send_header("Content-Length", str(len(body)))
    request.end_headers()
    request.wfile.write(body)
