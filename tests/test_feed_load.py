"""The checkpoint feed under a LAN's load, on loopback with real sockets, without TensorFlow
(127.0.0.x are all loopback on Linux: 127.0.0.66 and on play strangers, 127.0.0.1 the evaluator):
slow clients (slowhttptest's headers a byte at a time) hold no threads while the evaluator fetches,
64 stalled downloads from strangers do not lock the evaluator out and a stranger then hears
"busy" until a stalled transfer is cut for it, and behind a proxy what was served stands for
a fetcher's claim. (tests/test_feed_on_a_lan.py: each limit alone.)"""

import os
import socket
import threading
import time

import pytest
from test_checkpoint_feed import _free_port, _save

from od_dist.protocol import checkpoint_feed, serving

# The defaults (request_s 5, idle_s 15, 64 shared connections, 16 an address, 8 of a fetcher's
# own), with a quick transfer floor so that nothing here waits on the file's deadline.
LIMITS = serving.Limits()
SHARD = "ckpt-4.data-00000-of-00001"


def _threads() -> int:
    """This process's threads, as the kernel counts them (the feed's are among them)."""
    return len(os.listdir("/proc/self/task"))


def _until(condition, within_s: float, every_s: float = 0.02) -> bool:
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(every_s)
    return True


@pytest.fixture
def feed(tmp_path):
    port = _free_port()
    fetchers = [("evaluator", "127.0.0.1")]
    with checkpoint_feed.Feed(str(tmp_path / "lead"), "127.0.0.1", port, "job1", fetchers, LIMITS) as served:
        served.port = port
        yield served


def _connect(port: int, source: str, rcvbuf: int = 0) -> socket.socket:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # the kernel takes little of it
    sock.bind((source, 0))
    sock.settimeout(5)
    sock.connect(("127.0.0.1", port))
    return sock


def _get(port: int, path: str, source: str) -> tuple[int, bytes]:
    """GET `path` from the address `source`: (status, body), read until the server closes."""
    with _connect(port, source) as sock:
        sock.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
        answer = b""
        while data := sock.recv(1 << 16):
            answer += data
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def test_slow_clients_hold_no_threads_while_the_evaluator_fetches(feed, tmp_path):
    """300 connections from 30 strangers, each sending its headers a byte at a time (slowhttptest
    -H): the process's threads stay within a few of what they were (a thread per connection made
    ~180), and the evaluator fetches a 16 MB checkpoint meanwhile."""
    _save(feed.model_dir, 4, data=os.urandom(16 * 1024))
    before = _threads()
    slow = [_connect(feed.port, f"127.0.0.{66 + n % 30}") for n in range(300)]
    request = b"GET / HTTP/1.1\r\nHost: feed\r\n" + b"X-a: b\r\n" * 200
    stop, most, rounds = threading.Event(), [before], [0]

    def trickle():  # a byte on every connection, over and over, until the test ends
        for at in range(len(request)):
            for sock in slow:
                try:
                    sock.send(request[at : at + 1])
                except OSError:  # cut by the server
                    pass
            most[0] = max(most[0], _threads())
            rounds[0] += 1
            if stop.wait(0.05):
                return

    trickler = threading.Thread(target=trickle, daemon=True)
    trickler.start()
    try:
        # A few bytes on each: the server has taken what it takes (the shared slots full, the
        # others displaced by newer ones).
        assert _until(lambda: rounds[0] >= 3, 5)
        started = time.monotonic()
        assert checkpoint_feed.fetch("127.0.0.1", feed.port, "job1", str(tmp_path / "e")) == 4
        took = time.monotonic() - started
        most[0] = max(most[0], _threads())
        assert time.monotonic() - started < LIMITS.request_s  # the load held on: none cut by its deadline
    finally:
        stop.set()
        trickler.join()
        for sock in slow:
            sock.close()
    print(f"threads: {before} before, at most {most[0]} with 300 slow connections; fetch {took:.2f} s")
    assert most[0] - before < 20, (before, most[0])
    assert took < LIMITS.request_s, took  # it waited for no slow one's deadline
    assert _until(lambda: _threads() <= before, 5)


def _stalled(port: int, source: str) -> socket.socket:
    """A download of the shard that is never read."""
    sock = _connect(port, source, rcvbuf=4096)
    sock.sendall(f"GET /{SHARD} HTTP/1.0\r\n\r\n".encode())
    return sock


def _answered(sock: socket.socket) -> bool:
    """Whether the server began its answer on `sock` (a byte of it waits there, left unread)."""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return False


def test_64_stalled_downloads_do_not_lock_the_evaluator_out(feed, tmp_path):
    """Strangers (4 addresses, 16 each: every shared slot) ask for the shard and never read it:
    the evaluator, whose address has slots of its own, fetches at once; another stranger is told
    "busy" (503) until a transfer stalled for busy_idle_s is cut for it, long before idle_s."""
    _save(feed.model_dir, 4, data=os.urandom(32 * 1024))  # 32 MB: more than the sockets' buffers
    stalled = [_stalled(feed.port, f"127.0.0.{66 + n // 16}") for n in range(64)]
    try:
        assert _until(lambda: all(map(_answered, stalled)), 5)
        full = time.monotonic()
        assert checkpoint_feed.fetch("127.0.0.1", feed.port, "job1", str(tmp_path / "e")) == 4
        took = time.monotonic() - full
        status, body = _get(feed.port, "/", "127.0.0.70")
        assert status == 503 and body.decode().startswith("busy: "), (status, body)
        assert _until(lambda: _get(feed.port, "/", "127.0.0.70")[0] == 200, LIMITS.idle_s, every_s=0.1)
        waited = time.monotonic() - full
        print(
            f"64 stalled downloads: the evaluator fetched in {took:.2f} s, a stranger served after {waited:.2f} s"
        )
        assert waited < LIMITS.busy_idle_s + 2 < LIMITS.idle_s, waited
    finally:
        for sock in stalled:
            sock.close()


def test_a_follower_refused_says_busy(tmp_path):
    """A feed whose every slot holds a stalled download (2 here, 127.0.0.1 no fetcher's address):
    the follower says "busy" in one line, not "not an od-dist checkpoint feed", and counts the
    feed as up."""
    port = _free_port()
    limits = serving.Limits(connections=2)
    lines = []
    with checkpoint_feed.Feed(str(tmp_path / "lead"), "127.0.0.1", port, "job1", (), limits) as feed:
        _save(feed.model_dir, 4, data=os.urandom(8 * 1024))
        stalled = [_stalled(port, "127.0.0.1") for _ in range(2)]
        try:
            assert _until(lambda: all(map(_answered, stalled)), 5)
            follower = checkpoint_feed.Follower(
                [("127.0.0.1", port)], "job1", str(tmp_path / "e"), lines.append
            )
            assert follower.poll() is None and follower.reachable
        finally:
            for sock in stalled:
                sock.close()
        assert _until(lambda: follower.poll() == 4, 5)
    assert lines == [
        f"the checkpoint feed at 127.0.0.1:{port} is {checkpoint_feed.BUSY}; trying again every 2 s",
        f"the checkpoint feed at 127.0.0.1:{port} serves again",
        f"fetched ckpt-4 from the checkpoint feed at 127.0.0.1:{port} into {tmp_path / 'e'}, checked whole",
    ]


def _waiting(feed, step, said):
    """wait_fetched in a thread, once it said its line on the console: (the thread, its result)."""
    result = []
    waiter = threading.Thread(target=lambda: result.append(feed.wait_fetched(step, 10)), daemon=True)
    waiter.start()
    assert _until(lambda: "checkpoint feed: " in said(), 5), said()
    return waiter, result


def test_behind_a_proxy_every_file_served_stands_for_the_claim(tmp_path, capsys):
    """The evaluator is at 127.0.0.9, but its requests come from the proxy's address (127.0.0.1):
    the feed listening on every interface (WSL2's port proxy), or no request of a fetcher ever
    from its own address, its every file of the final step sent whole ends the lead's wait, said
    in one line. Once a fetcher asked from its own address, a proxy's claims are not believed."""
    out = []

    def said() -> str:
        out.append(capsys.readouterr().out)
        return "".join(out)

    port = _free_port()
    fetchers = [("evaluator", "127.0.0.9")]
    with checkpoint_feed.Feed(str(tmp_path / "lead"), "192.0.2.1", port, "job1", fetchers, LIMITS) as feed:
        assert feed.everywhere
        _save(feed.model_dir, 4)
        waiter, result = _waiting(feed, 4, said)
        assert checkpoint_feed.fetch("127.0.0.1", port, "job1", str(tmp_path / "e1")) == 4
        waiter.join()
        assert result == [True]
        assert said() == (
            "checkpoint feed: it listens on every interface (its address is none of this machine's: behind "
            "a port proxy, as WSL2's, every fetcher shows the proxy's address), so the lead cannot tell "
            "evaluator's word from a stranger's: it waits until every file of ckpt-4 was sent whole to a "
            "request naming evaluator\n"
        )
    out.clear()
    with checkpoint_feed.Feed(str(tmp_path / "lead"), "127.0.0.1", port, "job1", fetchers, LIMITS) as feed:
        _save(feed.model_dir, 6)
        waiter, result = _waiting(feed, 6, said)
        assert checkpoint_feed.fetch("127.0.0.1", port, "job1", str(tmp_path / "e2")) == 6
        waiter.join()
        assert result == [True] and said().startswith(
            "checkpoint feed: no request naming a fetcher has come from that fetcher's own address"
        )
        # The evaluator asks from its own address once: from then on only its own claims count.
        assert _get(port, "/?by=evaluator", "127.0.0.9")[0] == 200
        _save(feed.model_dir, 8)
        for name in ("ckpt-8.index", "ckpt-8.data-00000-of-00001"):
            assert _get(port, f"/{name}?by=evaluator", "127.0.0.1")[0] == 200
        assert not feed.fetched(8)
        for name in ("ckpt-8.index", "ckpt-8.data-00000-of-00001"):
            assert _get(port, f"/{name}?by=evaluator", "127.0.0.9")[0] == 200
        assert feed.fetched(8)
