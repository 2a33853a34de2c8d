"""A read-only HTTP server in a thread of this process, for what od-dist serves its peers (the
lead's checkpoint feed, a trainer machine's membership state). No TensorFlow here.

It runs inside a training process on a LAN, where any host may connect, so its threads do not grow
with its connections: one thread runs an asyncio event loop that holds every connection (reading
requests, sending answers and files), and a pool of ANSWERING threads computes the answers (a
listing hashes a new checkpoint's files, which must not stop the loop). A thread per connection
(http.server's) grew to ~180 threads under slowhttptest. asyncio, not a library: it is in the
standard library of every Python od-dist runs on (no wheel to install on Windows or a cluster
node), and its streams and timeouts are all one HTTP/1.0 GET server needs.

No client may hold the server: each connection has a deadline for its request (a client sending
a byte at a time is cut off), an idle limit on every read and write, and a file sent on it a
deadline from the file's size (Limits). Connections are placed in slots (Limits): each `named`
address (the cluster file's tasks that read this port) has `reserved` slots of its own that no
other address can take, and every address shares `connections` more, at most `per_address` of
them each. A newcomer that finds its slots full displaces the connection there that has waited
longest for its request, else a transfer that moved nothing for `busy_idle_s` (a stalled
transfer is cut sooner once the server is full), else is refused with `503 busy` (said by
checkpoint_feed's followers in one line). A client that hangs up is no error of the server's:
nothing is printed for it.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import json
import os
import queue
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus
from typing import BinaryIO

ANSWERING = 2  # threads that compute answers (a listing, a state): the only threads besides the loop's
_HEAD_MAX = 16 << 10  # a request's line and headers (a fetcher's are ~200 bytes)
_CHUNK = 1 << 20  # a file is sent this much at a time
_REFUSING_S = 1.0  # a refused connection: its request is read (else the close resets the answer)


def url(host: str, port: int, path: str) -> str:
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}/{path}"


def address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An address as a peer's connection shows it (an IPv4 peer of an IPv6 socket: ::ffff:a.b.c.d)."""
    try:
        value = ipaddress.ip_address(text.partition("%")[0])
    except ValueError:
        return None
    return getattr(value, "ipv4_mapped", None) or value


@dataclass(frozen=True)
class Limits:
    request_s: float = 5.0  # the request line and headers, whole (a peer sends them in one packet)
    idle_s: float = 15.0  # no byte moves on a connection for this long: the peer is gone
    connections: int = 64  # shared by every address (a stranger, a fetcher behind a proxy)
    per_address: int = 16  # of the shared ones, held by one address at most
    reserved: int = 8  # each named address's own, besides (its fetches and looks are one or two)
    # Once a newcomer finds its slots full, a transfer that moved nothing for this long is cut for
    # it (before that, only after idle_s).
    busy_idle_s: float = 2.0
    # A file's transfer ends by file_s + size / floor_bps: 1 MB/s is 8 Mbit/s, a 100 Mbit/s link
    # shared by a dozen fetchers (a 2 GB shard: 35 min), so only a stalled or trickling client
    # is cut, and the file is not held open longer (on Windows an open file cannot be deleted,
    # so TensorFlow's rotation of the checkpoints would fail meanwhile).
    file_s: float = 60.0
    floor_bps: float = 1e6

    def transfer_s(self, size: int) -> float:
        return self.file_s + size / self.floor_bps


@dataclass(frozen=True)
class Request:
    """A request read whole: its method, its path as sent (`/name?query`), the peer's (host, port)."""

    method: str
    path: str
    client_address: tuple


@dataclass
class Answer:
    """What the server sends: `body`, or the open file `file` whole (then closed); `sent` is called
    once all of it was handed to the network (not when the file was cut short)."""

    status: int = 200
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    file: BinaryIO | None = None
    sent: Callable[[], None] | None = None


def json_answer(value) -> Answer:
    return Answer(body=json.dumps(value).encode(), content_type="application/json")


def error(status: int, text: str = "") -> Answer:
    return Answer(status=status, body=(text or HTTPStatus(status).phrase).encode() + b"\n")


def file_answer(f: BinaryIO, sent: Callable[[], None] | None = None) -> Answer:
    return Answer(file=f, content_type="application/octet-stream", sent=sent)


BUSY = (
    "busy: every connection this server takes is in use, and none has waited for its request or "
    "stalled long enough to be cut; try again in a few seconds"
)


_READING, _COMPUTING, _SENDING = "reading", "computing", "sending"


@dataclass(eq=False)
class _Connection:
    peer: ipaddress.IPv4Address | ipaddress.IPv6Address | None
    transport: asyncio.BaseTransport
    task: asyncio.Task
    opened: float
    state: str = _READING
    moved: float = 0.0  # when the last chunk of its answer was taken by the network
    pool: list = field(default_factory=list)  # the slots it holds one of


class Server:
    """Answers every GET with `answer(request)` (a Request -> an Answer, in one of ANSWERING
    threads) on (host, port), while entered. `named`: the addresses given slots of their own (the
    module's words). `everywhere`: `host` is no address of this machine, so it listens on every
    interface (a name that resolves to an address this machine does not hold: WSL2 behind a port
    proxy), as TensorFlow's server on a task's own port does."""

    def __init__(
        self,
        host: str,
        port: int,
        answer: Callable[[Request], Answer],
        name: str,
        limits: Limits = Limits(),
        named: Iterable = (),
    ):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._socket = _listen((host, port), family)
            self.everywhere = False
        except OSError as e:
            if e.errno != errno.EADDRNOTAVAIL:
                raise
            self._socket = _listen(("::" if family == socket.AF_INET6 else "0.0.0.0", port), family)
            self.everywhere = True
        self.limits, self.name, self._answer = limits, name, answer
        self._named: dict = {a: [] for a in named if a is not None}  # named address -> its own slots
        self._shared: list[_Connection] = []
        self._refusing = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._pool = _Answering(ANSWERING, name)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def __enter__(self):
        self._pool.start()
        self._thread.start()
        self._ready.wait()
        if self._failed is not None:  # the loop could not start serving: said here, not lost
            self._pool.stop()
            self._socket.close()
            raise self._failed
        return self

    def __exit__(self, *exc):
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        self._pool.stop()
        self._socket.close()

    def open_connections(self) -> Counter:
        """The connections holding a slot now, by state (reading its request, computing or sending
        its answer): a glance from another thread."""
        held = list(self._shared) + [c for slots in list(self._named.values()) for c in list(slots)]
        return Counter(c.state for c in held)

    # The loop's thread: everything below runs in it, so the slots need no lock.

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._serve(loop))
        except BaseException as e:  # noqa: BLE001 - before serving: raised by __enter__
            if self._ready.is_set():
                raise
            self._failed = e
        finally:
            self._ready.set()
            loop.close()

    async def _serve(self, loop) -> None:
        self._loop, self._stop = loop, asyncio.Event()
        handlers: set[asyncio.Task] = set()

        def connected(reader, writer):
            task = loop.create_task(self._connection(reader, writer))
            handlers.add(task)
            task.add_done_callback(handlers.discard)

        server = await asyncio.start_server(connected, sock=self._socket, limit=_HEAD_MAX)
        self._ready.set()
        async with server:
            await self._stop.wait()
        for task in list(handlers):
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peername = writer.get_extra_info("peername") or ("", 0)
        now = time.monotonic()
        conn = _Connection(
            address(str(peername[0])), writer.transport, asyncio.current_task(), now, moved=now
        )
        answer, whole = None, False
        try:
            if not self._admit(conn):
                whole = await self._refuse(reader, writer)
                return
            request = await self._read(reader, conn)
            if isinstance(request, Answer):
                answer = request
            else:
                conn.state = _COMPUTING
                answer = await asyncio.wrap_future(self._pool.submit(self._answered, request))
            conn.state, conn.moved = _SENDING, time.monotonic()
            await self._send(writer, answer, conn)
            if answer.sent is not None:
                answer.sent()
            writer.write_eof()
            await _within(writer.drain(), self.limits.idle_s)
            whole = True
        except (
            OSError,
            EOFError,
            RuntimeError,  # the transport closed under a sendfile: cut
            TimeoutError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ValueError,
        ):
            pass  # a client that hung up, stalled or was cut: its own end, nothing said
        finally:
            if answer is not None and answer.file is not None:
                answer.file.close()
            if conn in conn.pool:
                conn.pool.remove(conn)
            # Sent whole: closed after the last byte; else dropped at once, whatever is unsent.
            writer.close() if whole else writer.transport.abort()

    def _answered(self, request: Request) -> Answer:
        try:
            return self._answer(request)
        except Exception as e:  # noqa: BLE001 - a bug of the answer: said, and a 500 for this request
            print(
                f"od-dist: {self.name}: a request from {request.client_address[0]} failed: "
                f"{type(e).__name__}: {e}",
                file=sys.stderr,
                flush=True,
            )
            return error(500)

    def _admit(self, conn: _Connection) -> bool:
        """Gives `conn` a slot: its address's own, a shared one, or one made free (module's words)."""
        limits, now = self.limits, time.monotonic()
        own = self._named.get(conn.peer)
        mine = sum(1 for c in self._shared if c.peer == conn.peer)
        if own is not None and len(own) < limits.reserved:
            return self._place(conn, own)
        if len(self._shared) < limits.connections and mine < limits.per_address:
            return self._place(conn, self._shared)
        shared = (
            [c for c in self._shared if c.peer == conn.peer] if mine >= limits.per_address else self._shared
        )
        for slots in ([own] if own is not None else []) + [shared]:
            victim = _victim(slots, now, limits.busy_idle_s)
            if victim is not None:
                victim.pool.remove(victim)
                victim.transport.abort()
                victim.task.cancel()  # whatever it waits for ends at once, and its file is closed
                return self._place(conn, victim.pool)
        return False

    @staticmethod
    def _place(conn: _Connection, slots: list) -> bool:
        conn.pool = slots
        slots.append(conn)
        return True

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """`503 busy`, once the request is read (briefly: a client that sends nothing is closed);
        whether it was sent."""
        if self._refusing >= self.limits.connections:
            return False  # refusals are bounded too: past them, a connection is closed at once
        self._refusing += 1
        try:
            try:
                await _within(reader.readuntil(b"\r\n\r\n"), min(_REFUSING_S, self.limits.request_s))
            except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                pass
            writer.write(_head(error(503, BUSY), len(BUSY) + 1, retry=True) + BUSY.encode() + b"\n")
            writer.write_eof()
            await _within(writer.drain(), _REFUSING_S)
            return True
        finally:
            self._refusing -= 1

    async def _read(self, reader: asyncio.StreamReader, conn: _Connection) -> Request | Answer:
        """The request line and headers, within the request's deadline, no byte later than the idle
        limit; an error Answer for a request that is no GET."""
        limits = self.limits
        deadline = conn.opened + limits.request_s
        head = b""
        while b"\r\n\r\n" not in head and b"\n\n" not in head:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the request took longer than its deadline")
            data = await _within(reader.read(_HEAD_MAX), min(limits.idle_s, left))
            if not data:
                raise asyncio.IncompleteReadError(head, None)
            head += data
            if len(head) > _HEAD_MAX:
                return error(431)
        words = head.split(b"\n", 1)[0].decode("latin-1").split()
        if len(words) != 3 or not words[2].startswith("HTTP/") or not words[1].startswith("/"):
            return error(400)
        if words[0] != "GET":
            return error(501, f"Unsupported method ({words[0]!r})")
        return Request(words[0], words[1], conn.transport.get_extra_info("peername"))

    async def _send(self, writer: asyncio.StreamWriter, answer: Answer, conn: _Connection) -> None:
        """The answer; a file chunk by chunk, each handed to the network within the idle limit, all
        within the transfer's deadline from its size (then the connection is dropped)."""
        limits = self.limits
        if answer.file is None:
            writer.write(_head(answer, len(answer.body)) + answer.body)
            return
        size = os.fstat(answer.file.fileno()).st_size
        deadline = time.monotonic() + limits.transfer_s(size)
        writer.write(_head(answer, size))
        # sendfile(2) where the loop has it (zero-copy from the page cache, where a checkpoint just
        # written is), else read and written; a slice at a time, each a step of progress.
        loop, offset = asyncio.get_running_loop(), 0
        while offset < size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"not sent within {limits.transfer_s(size):.0f} s")
            count = min(_CHUNK, size - offset)
            sent = await _within(
                loop.sendfile(writer.transport, answer.file, offset, count), min(limits.idle_s, left)
            )
            if not sent:
                raise EOFError("the file is shorter than it was")  # the peer is told by a short answer
            offset += sent
            conn.moved = time.monotonic()


class _Answering:
    """`n` threads, started and stopped with the server (their number never changes), that run
    what they are handed in turn."""

    def __init__(self, n: int, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-answer-{i}", daemon=True) for i in range(n)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        for _ in self._threads:
            self._queue.put(None)

    def submit(self, fn, arg) -> Future:
        future: Future = Future()
        self._queue.put((fn, arg, future))
        return future

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, arg, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(arg))
                except BaseException as e:  # noqa: BLE001 - handed to the loop's side, which raises it
                    future.set_exception(e)


def _victim(slots: list, now: float, stalled_s: float) -> _Connection | None:
    """In `slots`: the connection waiting longest for its request, else the transfer stalled
    longest past `stalled_s`, else None (every one is being answered, and moves)."""
    reading = [c for c in slots if c.state == _READING]
    if reading:
        return min(reading, key=lambda c: c.opened)
    stalled = [c for c in slots if c.state == _SENDING and now - c.moved > stalled_s]
    return min(stalled, key=lambda c: c.moved) if stalled else None


async def _within(awaitable, seconds: float):
    async with asyncio.timeout(seconds):
        return await awaitable


def _head(answer: Answer, length: int, retry: bool = False) -> bytes:
    status = HTTPStatus(answer.status)
    lines = [
        f"HTTP/1.0 {status.value} {status.phrase}",
        "Server: od-dist",
        f"Date: {formatdate(usegmt=True)}",
        f"Content-Type: {answer.content_type}",
        f"Content-Length: {length}",
        "Connection: close",
    ]
    if retry:
        lines.append("Retry-After: 2")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _listen(at: tuple, family: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if os.name != "nt":  # a port in TIME_WAIT is free again; on Windows the option lets others share it
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(at)
        sock.listen(128)  # a burst of connections waits for accept() instead of a SYN retry
    except OSError:
        sock.close()
        raise
    return sock
