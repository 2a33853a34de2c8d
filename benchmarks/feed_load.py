"""The lead's checkpoint feed under a LAN's load (issue 74): the serving process's threads, and the
evaluator's fetch times meanwhile.

    python benchmarks/feed_load.py [--tree DIR] [--seconds 20] [--mb 48] [--slowhttptest]

A feed of a `--mb` MB checkpoint runs in a process of its own (as in a trainer; its threads read
from /proc), with the default serving.Limits and the evaluator named at 127.0.0.2 (this process's fetches come
from there), on loopback. Two loads, from the stranger 127.0.0.66 (any 127.0.0.x is loopback on
Linux), and with --slowhttptest a third, Debian's tool as the issue ran it (`apt-get install
slowhttptest`; from 127.0.0.1):

- slow: 400 connections, opened at up to 200 a second and opened again when cut, each sending its
  request a byte a second (slowhttptest -c 400 -H -r 200 sends a header every few seconds); the
  feed's threads sampled each second, and the evaluator fetching the whole checkpoint every 2 s.
- stalled: 64 requests for the data shard, never read; the evaluator's fetches at +1, +4, +7,
  +10, +13 s (the issue's reproduction).

`--tree`: the od-dist checkout whose feed serves (e.g. an earlier commit's `git archive`), this
one's by default; the client side is always this checkout's. Linux only.
"""

from __future__ import annotations

import argparse
import http.client
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from od_dist.protocol import checkpoint_feed  # noqa: E402

STRANGER = "127.0.0.66"
EVALUATOR = "127.0.0.2"  # not 127.0.0.1, where slowhttptest's connections come from
SERVE = f"""
import sys
from od_dist.protocol import checkpoint_feed
with checkpoint_feed.Feed(sys.argv[1], "127.0.0.1", int(sys.argv[2]), "job1", [("evaluator", "{EVALUATOR}")]):
    print("serving", flush=True)
    sys.stdin.read()
"""


class _FromTheEvaluator(http.client.HTTPConnection):
    """This process's fetches come from EVALUATOR's address."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("source_address", (EVALUATOR, 0))
        super().__init__(*args, **kwargs)


urllib.request.HTTPHandler.http_open = lambda self, request: self.do_open(_FromTheEvaluator, request)


def _save(folder: str, mb: int) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "ckpt-4.data-00000-of-00001"), "wb") as f:
        for _ in range(mb):
            f.write(os.urandom(1 << 20))
    from od_dist.protocol import lineage

    with open(os.path.join(folder, "ckpt-4.index"), "wb") as f:
        f.write(b"index 4" + bytes(48) + lineage.TABLE_MAGIC)
    with open(os.path.join(folder, "checkpoint"), "w") as f:
        f.write('model_checkpoint_path: "ckpt-4"\nall_model_checkpoint_paths: "ckpt-4"\n')


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _connect(port: int, rcvbuf: int = 0) -> socket.socket:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.bind((STRANGER, 0))
    sock.settimeout(2)
    sock.connect(("127.0.0.1", port))
    sock.setblocking(False)
    return sock


def _fetch(port: int, work: str) -> str:
    here = tempfile.mkdtemp(dir=work)
    started = time.monotonic()
    try:
        step = checkpoint_feed.fetch("127.0.0.1", port, "job1", here)
        return f"{time.monotonic() - started:.2f} s" if step == 4 else f"nothing fetched ({step})"
    except checkpoint_feed.FeedError as e:
        return f"failed after {time.monotonic() - started:.2f} s: {str(e)[:70]}"
    finally:
        shutil.rmtree(here, ignore_errors=True)


def slowhttptest(pid: int, port: int, work: str, seconds: float) -> None:
    """Debian's slowhttptest, as the issue ran it (its connections come from 127.0.0.1)."""
    command = ["slowhttptest", "-c", "400", "-H", "-i", "5", "-r", "200", "-x", "24", "-p", "3"]
    command += ["-l", f"{seconds:.0f}", "-u", f"http://127.0.0.1:{port}/"]
    before = _threads(pid)
    tester = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    samples, fetches = [], []
    started = time.monotonic()
    while tester.poll() is None and time.monotonic() - started < seconds + 30:
        samples.append(_threads(pid))
        if len(samples) % 2 == 0:
            fetches.append(_fetch(port, work))
        time.sleep(max(0.0, len(samples) - (time.monotonic() - started)))
    tester.wait()
    print(f"{' '.join(command)}: threads {before} before, {min(samples)}-{max(samples)} during")
    print(f"  the evaluator's fetches meanwhile: {', '.join(fetches)}")


def slow(pid: int, port: int, work: str, seconds: float) -> None:
    request = b"GET / HTTP/1.1\r\nHost: feed\r\n" + b"X-a: b\r\n" * 1000
    open_: dict[socket.socket, int] = {}
    stop = threading.Event()

    def load():
        while not stop.is_set():
            for sock, at in list(open_.items()):  # a byte each
                try:
                    sock.send(request[at : at + 1])
                    open_[sock] = at + 1
                except OSError:
                    sock.close()
                    del open_[sock]
            for _ in range(min(200, 400 - len(open_))):  # up to 200 new ones a second
                try:
                    open_[_connect(port)] = 0
                except OSError:
                    break
            stop.wait(1.0)

    before = _threads(pid)
    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    samples, fetches = [], []
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        samples.append(_threads(pid))
        if len(samples) % 2 == 0:
            fetches.append(_fetch(port, work))
        time.sleep(max(0.0, len(samples) - (time.monotonic() - started)))
    stop.set()
    loader.join()
    for sock in open_:
        sock.close()
    print(f"slow clients: threads {before} before, {min(samples)}-{max(samples)} during {seconds:.0f} s")
    print(f"  the evaluator's fetches meanwhile: {', '.join(fetches)}")


def stalled(pid: int, port: int, work: str) -> None:
    before = _threads(pid)
    socks = []
    for _ in range(64):
        sock = _connect(port, rcvbuf=4096)
        sock.send(b"GET /ckpt-4.data-00000-of-00001 HTTP/1.0\r\n\r\n")
        socks.append(sock)
    started, lines, most = time.monotonic(), [], before
    for at in (1, 4, 7, 10, 13):
        while time.monotonic() - started < at:
            most = max(most, _threads(pid))
            time.sleep(0.1)
        lines.append(f"+{at} s: {_fetch(port, work)}")
    for sock in socks:
        sock.close()
    print(f"64 stalled downloads: threads {before} before, at most {most}")
    print(f"  the evaluator's fetches: {'; '.join(lines)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", default=REPO, help="the checkout whose feed serves")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--mb", type=int, default=48)
    parser.add_argument("--slowhttptest", action="store_true", help="also run Debian's slowhttptest")
    args = parser.parse_args(argv)
    work = tempfile.mkdtemp(prefix="feed-load-")
    try:
        lead = os.path.join(work, "lead")
        _save(lead, args.mb)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ, PYTHONPATH=os.path.abspath(args.tree))
        server = subprocess.Popen(
            [sys.executable, "-c", SERVE, lead, str(port)],
            cwd=args.tree,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout.readline().strip() == "serving"
            print(f"feed of {args.tree} ({args.mb} MB checkpoint), pid {server.pid}")
            alone = [_fetch(port, work) for _ in range(3)]
            print(f"the evaluator's fetches without load: {', '.join(alone)}")
            slow(server.pid, port, work, args.seconds)
            if args.slowhttptest:
                time.sleep(6)
                slowhttptest(server.pid, port, work, args.seconds)
            time.sleep(6)  # the slow ones' request deadline passes
            stalled(server.pid, port, work)
        finally:
            server.stdin.close()
            server.wait(30)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
