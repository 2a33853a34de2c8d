"""The lead's newest checkpoint, fetched whole by a machine that does not share its folder.

On a LAN of separate disks the checkpoints are on the trainers' machines only. With the cluster
file's `checkpoint_port`, the lead (the master, or worker 0 without one) serves its model_dir's
newest checkpoint on that port of its own address, read-only: a listing (`GET /`: the job, the
step, each file's size and SHA-256) and the listed files (`GET /<file>`), nothing else, and it
accepts no write. The evaluator on another machine fetches each new one into its own model_dir:
every file into a temporary name, checked against the listing's size and SHA-256, renamed into
place, then named in the `checkpoint` state file, as TensorFlow names a save it finished; a
reader sees a whole checkpoint or none. No TensorFlow here: the evaluator's continuous evaluation
finds the checkpoint as it finds any other. In an elastic parameter_server job every worker fetches
them too (a copy, from which it may coordinate the next round); each fetch says who fetches.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
import urllib.error
import urllib.request

from od_dist.protocol import lineage, serving

# Said by eval, export and report when a model_dir here holds nothing: where a LAN job without a
# shared folder left it.
ELSEWHERE = (
    "without a shared folder a job's checkpoints and training summaries are on the machines that "
    "trained (the master's --model_dir; under multi_worker_mirrored every trainer's too) and the "
    "evaluator's (the checkpoints it fetched, its evaluations): run this there, or copy that folder here"
)
STATE_FILE = lineage.STATE_FILE
_FILE = lineage.CHECKPOINT_FILE
newest = lineage.newest  # (step, prefix) of the newest checkpoint whole on disk, or None
_CHUNK = 1 << 20
TIMEOUT_S = 30.0  # a request, or a read of its answer, that takes longer is a lost peer
FETCH_PART = ".od-dist-fetching-"  # + the file's name: what a fetch writes before the rename


EVALUATOR = "evaluator"  # the fetcher a feed waits for at the end (Feed.fetched)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


class Feed:
    """Serves the newest checkpoint of `model_dir` on (host, port), in a thread of this process.
    `job`: the job's id (cluster.job_id()): a fetcher of another job refuses what it reads."""

    def __init__(self, model_dir: str, host: str, port: int, job: str):
        self.model_dir, self.job = model_dir, job
        self._sums: dict[tuple[str, int, int], str] = {}  # (name, size, mtime) -> SHA-256
        self._lock = threading.Lock()
        self._served: set[int] = set()  # steps whose every file went out whole
        self._sent: dict[tuple[str, int], set[str]] = {}  # (fetcher, step) -> the files it took
        self._have: dict[str, int] = {}  # fetcher -> the newest step it said it holds
        self._server = serving.Server(host, port, self._answer, "checkpoint-feed")
        self.everywhere = self._server.everywhere

    def __enter__(self):
        self._server.__enter__()
        return self

    def __exit__(self, *exc):
        self._server.__exit__(*exc)

    def listing(self) -> dict:
        """What `GET /` answers: the job, the newest checkpoint's step and its files."""
        named = newest(self.model_dir)
        if named is None:
            return {"job": self.job, "step": 0, "files": []}
        step, prefix = named
        files = []
        for name in sorted(os.listdir(self.model_dir)):
            if name.startswith(prefix + ".") and _FILE.match(name):
                path = os.path.join(self.model_dir, name)
                stat = os.stat(path)
                key = (name, stat.st_size, stat.st_mtime_ns)
                with self._lock:
                    if key not in self._sums:
                        self._sums[key] = _sha256(path)
                    files.append({"name": name, "size": stat.st_size, "sha256": self._sums[key]})
        return {"job": self.job, "step": step, "files": files}

    def _answer(self, request) -> None:
        path, _, query = request.path.partition("?")
        name = path.lstrip("/")
        said = dict(re.findall(r"(have|by)=([\w:.-]{1,64})", query))
        by = said.get("by", EVALUATOR)
        if not name:
            if said.get("have", "").isdigit():  # the fetcher's newest step: a number it reports
                with self._lock:
                    self._have[by] = max(self._have.get(by, 0), int(said["have"]))
            serving.send_json(request, self.listing())
            return
        m = _FILE.match(name)
        path = os.path.join(self.model_dir, name)
        if not m or not os.path.isfile(path):  # only checkpoint files, of this folder, by their name
            request.send_error(404)
            return
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            request.send_response(200)
            request.send_header("Content-Length", str(size))
            request.end_headers()
            for chunk in iter(lambda: f.read(_CHUNK), b""):
                request.wfile.write(chunk)
        step = int(m.group(1))
        with self._lock:
            self._sent.setdefault((by, step), set()).add(name)

    def fetched(self, step: int, by: str = EVALUATOR) -> bool:
        """Whether the fetcher `by` holds checkpoint `step`: it said so, or took its every file."""
        listed = {f["name"] for f in self.listing()["files"]}
        with self._lock:
            return self._have.get(by, 0) >= step or (
                bool(listed) and listed <= self._sent.get((by, step), set())
            )

    def wait_fetched(self, step: int, timeout_s: float, by: str = EVALUATOR) -> bool:
        """Waits up to `timeout_s` for the fetcher `by` to hold checkpoint `step`."""
        deadline = time.monotonic() + timeout_s
        while not self.fetched(step, by):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)
        return True


class FeedError(Exception):
    """A fetch that failed: said in one line; the next poll tries again."""


def read_listing(
    host: str, port: int, timeout: float = TIMEOUT_S, have: int = 0, by: str = EVALUATOR
) -> dict:
    """The feed's listing (`have`: the newest step the caller, `by`, holds); raises FeedError (not
    reachable, not a feed)."""
    url = serving.url(host, port, f"?have={have}&by={by}")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            listing = json.loads(answer.read(1 << 20))
    except (OSError, ValueError) as e:
        raise FeedError(str(getattr(e, "reason", None) or e)) from None
    if not isinstance(listing, dict) or not isinstance(listing.get("files"), list):
        raise FeedError("not an od-dist checkpoint listing")
    return listing


def fetch(
    host: str, port: int, job: str, model_dir: str, timeout: float = TIMEOUT_S, by: str = EVALUATOR
) -> int | None:
    """Fetches the feed's newest checkpoint into `model_dir` when it is newer than the one there;
    returns its step, or None when there was nothing newer. `by`: who fetches (the feed waits for
    the evaluator's fetch of the final checkpoint, not a worker's copy). Raises FeedError: another
    job's feed, a file that did not arrive whole (nothing of it is then named; the next call tries
    again)."""
    listing = read_listing(host, port, timeout, (newest(model_dir) or (0,))[0], by)
    if listing.get("job") != job:
        raise FeedError(
            f"it serves the checkpoints of another job ({listing.get('job')}, this one is {job}): "
            "give every machine the same cluster file"
        )
    step = int(listing.get("step") or 0)
    if not step or step <= (newest(model_dir) or (0,))[0]:
        return None
    prefix = f"ckpt-{step}"
    files = listing["files"]
    names = [f.get("name") for f in files]
    if not any(n == prefix + ".index" for n in names) or not all(
        isinstance(n, str) and n.startswith(prefix + ".") and _FILE.match(n) for n in names
    ):
        raise FeedError(f"the listing of step {step} is not a checkpoint's files: {names}")
    os.makedirs(model_dir, exist_ok=True)
    arrived = []
    try:
        for entry in files:
            arrived.append(_fetch_file(host, port, entry, model_dir, timeout, by))
        # The index last, as TensorFlow writes it: a reader that lists the folder meanwhile
        # finds shards without an index, which no restore reads.
        for name, part in sorted(arrived, key=lambda a: a[0].endswith(".index")):
            os.replace(part, os.path.join(model_dir, name))
        arrived = []
    finally:
        for _, part in arrived:
            _remove(part)
    _name_newest(model_dir, prefix)
    return step


def _fetch_file(
    host: str, port: int, entry: dict, model_dir: str, timeout: float, by: str
) -> tuple[str, str]:
    name, size, want = entry["name"], int(entry["size"]), entry["sha256"]
    part = os.path.join(model_dir, FETCH_PART + name)
    url = serving.url(host, port, f"{name}?by={by}")
    digest, got = hashlib.sha256(), 0
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer, open(part, "wb") as out:
            while got <= size:
                chunk = answer.read(_CHUNK)
                if not chunk:
                    break
                digest.update(chunk)
                out.write(chunk)
                got += len(chunk)
    except (OSError, urllib.error.URLError) as e:
        _remove(part)
        raise FeedError(f"{name}: {getattr(e, 'reason', None) or e}") from None
    if got != size or digest.hexdigest() != want:
        _remove(part)
        raise FeedError(
            f"{name}: {got} bytes with SHA-256 {digest.hexdigest()[:12]}..., the listing said "
            f"{size} bytes, {want[:12]}... (rotated away, or damaged on the way): not used"
        )
    return name, part


def _name_newest(model_dir: str, prefix: str, keep: int = 3) -> None:
    """Names `prefix` the newest in the state file, as TensorFlow does (a temporary file renamed
    over it), and removes the fetched checkpoints past the newest `keep`."""
    steps = sorted({int(m.group(1)) for m in map(_FILE.match, os.listdir(model_dir)) if m}, reverse=True)
    kept = [f"ckpt-{s}" for s in steps[:keep]]
    for step in steps[keep:]:
        for name in os.listdir(model_dir):
            m = _FILE.match(name)
            if m and int(m.group(1)) == step:
                _remove(os.path.join(model_dir, name))
    lines = [f'model_checkpoint_path: "{prefix}"'] + [
        f'all_model_checkpoint_paths: "{p}"' for p in reversed(kept) if p != prefix
    ]
    lines.append(f'all_model_checkpoint_paths: "{prefix}"')
    tmp = os.path.join(model_dir, f"{STATE_FILE}.{FETCH_PART}{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, os.path.join(model_dir, STATE_FILE))


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


class Follower:
    """Fetches the lead's newest checkpoint into `model_dir` every `every_s` seconds, in a thread,
    saying each one (and each change between reachable and not) in one line through `say`.
    `feeds`: where a lead may serve, (host, port) each, the usual lead's first: an elastic job's
    lead moves to another trainer's machine when its own is lost (cluster.checkpoint_feeds())."""

    def __init__(self, feeds, job: str, model_dir: str, say, every_s: float = 2.0, by: str = EVALUATOR):
        self.feeds, self.job, self.model_dir, self.say, self.by = list(feeds), job, model_dir, say, by
        self.every_s = every_s
        self.reachable: bool | None = None
        self._at = 0  # the feed asked now: the last that answered
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="checkpoint-follower", daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(TIMEOUT_S)

    def _where(self, at: int) -> str:
        host, port = self.feeds[at]
        return f"the checkpoint feed at {host}:{port}"

    def poll(self) -> int | None:
        """One fetch; the step fetched, or None. A feed that fails hands over to the next."""
        at = self._at
        host, port = self.feeds[at]
        try:
            step = fetch(host, port, self.job, self.model_dir, by=self.by)
        except FeedError as e:
            others = (
                f" (or {', '.join(f'{h}:{p}' for h, p in self.feeds[:at] + self.feeds[at + 1 :])}, "
                "where the lead moves)"
                if len(self.feeds) > 1
                else ""
            )
            if self.reachable is None:
                self.say(f"waiting for {self._where(at)}{others} ({e})")
            elif self.reachable:
                self.say(f"{self._where(at)}: {e}; trying again every {self.every_s:.0f} s{others}")
            self.reachable = False
            self._at = (at + 1) % len(self.feeds)
            return None
        if not self.reachable:
            self.say(f"{self._where(at)} is up")
        self.reachable = True
        if step is not None:
            self.say(f"fetched ckpt-{step} from {self._where(at)} into {self.model_dir}, checked whole")
        return step

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.poll()
            self._stop.wait(max(0.0, self.every_s - (time.monotonic() - started)))
