"""The checkpoint feed (and through protocol/serving.py the membership port) left on a LAN, on
loopback with real sockets, without TensorFlow: idle clients and a client sending its request a
byte at a time are cut off and hold no thread, a stalled download does not hold the checkpoint
file open, a client hanging up mid-file prints nothing, and what a fetcher
says it holds is believed from its own address only."""

import os
import socket
import threading
import time

import pytest
from test_checkpoint_feed import _free_port, _save

from od_dist.protocol import checkpoint_feed, lineage, membership, serving

# Short limits, so that a cut-off shows in a second (the defaults: serving.Limits).
LIMITS = serving.Limits(request_s=2.0, idle_s=1.0, connections=8, file_s=1.0, floor_bps=1e9)


@pytest.fixture
def feed(tmp_path):
    port = _free_port()
    fetchers = [("evaluator", "127.0.0.1"), ("worker:0", "localhost")]
    with checkpoint_feed.Feed(str(tmp_path / "lead"), "127.0.0.1", port, "job1", fetchers, LIMITS) as served:
        served.port = port
        yield served


def _closed_by_the_server(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_idle_connections_hold_few_threads_and_are_closed(feed, tmp_path):
    """300 connections that send nothing (from the evaluator's own address): no thread is started
    for them, a real fetch still goes through meanwhile, and every idle one is closed once the request deadline passes."""
    _save(feed.model_dir, 4)
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", feed.port), timeout=5) for _ in range(300)]
    last = time.monotonic()
    try:
        time.sleep(0.2)  # the server accepted what it will
        assert threading.active_count() <= before
        assert checkpoint_feed.fetch("127.0.0.1", feed.port, "job1", str(tmp_path / "e")) == 4
        # While the last idle ones still held every place: it displaced them, it did not wait.
        assert time.monotonic() - last < LIMITS.request_s
        assert all(_closed_by_the_server(s, LIMITS.request_s + 2) for s in idle)
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before


def test_a_request_sent_a_byte_at_a_time_is_cut_off(feed):
    """Each byte comes within the idle limit, but the request's deadline ends the connection."""
    sock = socket.create_connection(("127.0.0.1", feed.port), timeout=5)
    request = b"GET / HTTP/1.0\r\nX-Slow: " + b"a" * 100 + b"\r\n\r\n"
    started, cut = time.monotonic(), None
    try:
        for byte in request:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                cut = time.monotonic() - started
                break
            if _closed_by_the_server(sock, 0.1):  # also the wait between two bytes
                cut = time.monotonic() - started
                break
    finally:
        sock.close()
    assert cut is not None and LIMITS.request_s - 0.2 < cut < LIMITS.request_s + 1.0, cut


def _open_on(path: str) -> int:
    """How many descriptors of this process (the feed's threads are in it) have `path` open."""
    fds = os.listdir("/proc/self/fd")
    return sum(1 for fd in fds if os.path.realpath(f"/proc/self/fd/{fd}") == os.path.realpath(path))


def _stalled_download(port: int, name: str) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the kernel takes little of it
    sock.connect(("127.0.0.1", port))
    sock.sendall(f"GET /{name} HTTP/1.0\r\n\r\n".encode())
    return sock


def test_a_trickling_download_does_not_hold_the_file_open(feed):
    """A reader that takes a little at a time is never idle, but its transfer has a deadline
    from the file's size: the file is closed then (on Windows an open file cannot be deleted)."""
    _save(feed.model_dir, 4, data=os.urandom(32 * 1024))  # 32 MB: more than the sockets' buffers
    shard = os.path.join(feed.model_dir, "ckpt-4.data-00000-of-00001")
    sock = _stalled_download(feed.port, os.path.basename(shard))
    done = threading.Event()

    def trickle():
        while not done.wait(0.1):
            try:
                if not sock.recv(4096):
                    return
            except OSError:
                return

    threading.Thread(target=trickle, daemon=True).start()
    try:
        started = time.monotonic()
        while not _open_on(shard) and time.monotonic() - started < 5:
            time.sleep(0.02)
        assert _open_on(shard) == 1  # being sent
        while _open_on(shard) and time.monotonic() - started < 10:
            time.sleep(0.05)
        assert _open_on(shard) == 0
        assert time.monotonic() - started < LIMITS.transfer_s(os.path.getsize(shard)) + LIMITS.idle_s + 0.5
    finally:
        done.set()
        sock.close()


def test_a_client_hanging_up_mid_file_prints_nothing(feed, capfd):
    _save(feed.model_dir, 4, data=os.urandom(32 * 1024))
    sock = _stalled_download(feed.port, "ckpt-4.data-00000-of-00001")
    assert sock.recv(1024)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()  # a reset, as a killed process's
    time.sleep(0.5)
    assert checkpoint_feed.read_listing("127.0.0.1", feed.port)["step"] == 4  # it serves on
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception" not in err, err


def _get(port: int, path: str, source: str) -> int:
    """The status of GET `path` from the address `source`, once the server closed the connection
    (after the last byte of a file: the feed has counted it by then)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0)) as sock:
        sock.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
        answer = b""
        while data := sock.recv(1 << 16):
            answer += data
    return int(answer.split(b" ", 2)[1])


def test_what_a_fetcher_holds_is_believed_from_its_address_only(feed):
    """127.0.0.2 is on lo (Linux routes 127/8 there) but is not the evaluator's address. (Once the
    evaluator asked from its own: before that, test_feed_load's proxied rule holds.)"""
    _save(feed.model_dir, 4)
    lineage.write_run(feed.model_dir, "abc123")
    assert _get(feed.port, "/?by=evaluator", "127.0.0.1") == 200
    assert _get(feed.port, "/?have=999999&by=evaluator&run=abc123", "127.0.0.2") == 200
    for name in ("ckpt-4.index", "ckpt-4.data-00000-of-00001"):
        assert _get(feed.port, f"/{name}?by=evaluator", "127.0.0.2") == 200
    assert not feed.fetched(4)
    for n in range(100):  # names of no fetcher, from anywhere: no entry each
        assert _get(feed.port, f"/?have=5&by=made-up-{n}&run=abc123", "127.0.0.1") == 200
        assert _get(feed.port, f"/ckpt-4.index?by=made-up-{n}", "127.0.0.1") == 200
    # The tables a made-up name would grow (what was served as the evaluator's: its name only).
    assert feed._have == {} and feed._sent == {} and set(feed._served) == {"evaluator"}
    # The evaluator itself, and worker 0 (named `localhost`, resolved once): believed.
    assert _get(feed.port, "/?have=4&by=evaluator&run=abc123", "127.0.0.1") == 200
    assert _get(feed.port, "/?have=4&by=worker:0&run=abc123", "127.0.0.1") == 200
    assert feed.fetched(4) and feed.fetched(4, by="worker:0")


def test_a_membership_read_of_a_port_that_speaks_no_http_is_none(not_http):
    assert membership.read("127.0.0.1", not_http, timeout=5) is None
    assert membership.read_all([("127.0.0.1", not_http)], timeout=5) == [None]
