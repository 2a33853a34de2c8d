"""The lead's newest checkpoint, fetched whole by a machine that does not share its folder.

On a LAN of separate disks the checkpoints are on the trainers' machines only. With the cluster
file's `checkpoint_port`, the lead (the master, or worker 0 without one) serves its model_dir's
newest checkpoint on that port of its own address, read-only: a listing (`GET /`: the job, the
step, each file's size and SHA-256) and the listed files (`GET /<file>`), nothing else, and it
accepts no write. The evaluator on another machine fetches each new one into its own model_dir:
every file into a temporary name, checked against the listing's size and SHA-256, renamed into
place, then named in the `checkpoint` state file, as TensorFlow names a save it finished; a
reader sees a whole checkpoint or none. The listing names the run (protocol/lineage.py): a folder
holding another run's checkpoints has them set aside (moved, said in one line) before a fetch. No TensorFlow here: the evaluator's continuous evaluation
finds the checkpoint as it finds any other. In an elastic parameter_server job every worker fetches
them too (a copy, from which it may coordinate the next round); each fetch says who fetches, and
the step of this run it holds, which the feed believes only from that task's address (behind a
proxy, where none comes from there: Feed.proxied). The fetchers' addresses have connection slots
of their own (protocol/serving.py); a feed that refuses a connection answers "busy", which a
follower says in one line.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import socket
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
# In a fetcher's model_dir: the checkpoints it brought, {step: its index's SHA-256}. Pruning after a
# fetch removes only those, so never a checkpoint a trainer saved there (same step or not).
FETCHED_FILE = ".od-dist-fetched"
STALE_POLLS = 3  # a follower none of whose polls succeeded for this many periods is not reachable


EVALUATOR = "evaluator"  # the fetcher a feed waits for at the end (Feed.fetched)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


_address = serving.address  # an address as a peer's connection shows it


def _addresses(host: str) -> set:
    """Every address `host` resolves to here, once (none when it does not resolve)."""
    try:
        return {_address(info[4][0]) for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        return set()


class Feed:
    """Serves the newest checkpoint of `model_dir` on (host, port), in a thread of this process.
    `job`: the job's id (cluster.job_id()): a fetcher of another job refuses what it reads.
    `fetchers`: (name, host) of each task that fetches (topology.feed_readers): their addresses have
    slots of their own (serving.Server's `named`: a stranger's connections cannot lock them out);
    what a fetcher says it holds or took is believed from its host's address only, and of no other
    name, so that no one else on the LAN ends the lead's wait for the evaluator, nor grows the
    tables. Except behind a proxy (`proxied`), where no claim comes from a fetcher's own address:
    there every file of a step sent whole to requests naming the fetcher stands for its claim.
    `say`: the line saying so when the lead waits on that rule."""

    def __init__(
        self,
        model_dir: str,
        host: str,
        port: int,
        job: str,
        fetchers=(),
        limits=serving.Limits(),
        say=lambda line: print(line, flush=True),
    ):
        self.model_dir, self.job, self.say = model_dir, job, say
        self._sums: dict[tuple[str, int, int], str] = {}  # (name, size, mtime) -> SHA-256
        self._lock = threading.Lock()  # the sums
        self._changed = threading.Condition()  # the tables below, notified on each change
        self._from: dict[str, set] = {}  # fetcher -> the addresses its claims are believed from
        for name, at in fetchers:
            self._from.setdefault(name, set()).update(_addresses(at))
        self._sent: dict[str, tuple[int, set[str]]] = {}  # fetcher -> (step, the files of it taken)
        self._have: dict[str, int] = {}  # fetcher -> the newest step of this run it said it holds
        self._served: dict[str, tuple[int, set[str]]] = {}  # as _sent, from any address
        self._direct = False  # a request naming a fetcher came from its own address once
        named = set().union(*self._from.values())
        self._server = serving.Server(host, port, self._answer, "checkpoint-feed", limits, named)
        self.everywhere = self._server.everywhere

    def __enter__(self):
        self._server.__enter__()
        return self

    def __exit__(self, *exc):
        self._server.__exit__(*exc)

    @property
    def proxied(self) -> bool:
        """Whether the fetchers' claims are judged by what was served: the feed listens on every
        interface (behind a port proxy, as WSL2's), or no request naming a fetcher ever came from
        its own address (a NAT or proxy between them shows its own)."""
        return self.everywhere or not self._direct

    def listing(self) -> dict:
        """What `GET /` answers: the job, the run, the newest checkpoint's step and its files."""
        named = newest(self.model_dir)
        run = lineage.run_of(self.model_dir)
        if named is None:
            return {"job": self.job, "run": run, "step": 0, "files": []}
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
        return {"job": self.job, "run": run, "step": step, "files": files}

    def _answer(self, request: serving.Request) -> serving.Answer:
        path, _, query = request.path.partition("?")
        name = path.lstrip("/")
        said = dict(re.findall(r"(have|by|run)=([\w:.-]{1,64})", query))
        by = said.get("by", EVALUATOR)
        believed = _address(request.client_address[0]) in self._from.get(by, ())
        if believed and not self._direct:
            with self._changed:
                self._direct = True
                self._changed.notify_all()
        if not name:
            listing = self.listing()
            # The fetcher's newest step, a number, of this run (a copy of an earlier run's is none).
            if believed and said.get("have", "").isdigit() and said.get("run") == listing["run"]:
                with self._changed:
                    self._have[by] = max(self._have.get(by, 0), int(said["have"]))
                    self._changed.notify_all()
            return serving.json_answer(listing)
        m = _FILE.match(name)
        path = os.path.join(self.model_dir, name)
        if not m or not os.path.isfile(path):  # only checkpoint files, of this folder, by their name
            return serving.error(404)
        try:
            f = open(path, "rb")
        except FileNotFoundError:  # rotated away since
            return serving.error(404)
        # A fetcher's files, counted once each is sent whole; of no fetcher's name, nothing kept.
        table = self._sent if believed else self._served if by in self._from else None
        if table is None:
            return serving.file_answer(f)
        step = int(m.group(1))

        def sent():
            with self._changed:  # a fetcher takes the newest checkpoint's files: a newer starts anew
                if table.get(by, (None,))[0] != step:
                    table[by] = (step, set())
                table[by][1].add(name)
                self._changed.notify_all()

        return serving.file_answer(f, sent)

    def fetched(self, step: int, by: str = EVALUATOR) -> bool:
        """Whether the fetcher `by` holds checkpoint `step`: it said so, or took its every file (or,
        `proxied`, every file was sent whole to requests naming it)."""
        listed = {f["name"] for f in self.listing()["files"]}
        with self._changed:
            tables = [self._sent, self._served] if self.proxied else [self._sent]
            took = any(t.get(by, (None,))[0] == step and listed <= t[by][1] for t in tables)
            return self._have.get(by, 0) >= step or (bool(listed) and took)

    def wait_fetched(self, step: int, timeout_s: float, by: str = EVALUATOR) -> bool:
        """Waits up to `timeout_s` for the fetcher `by` to hold checkpoint `step`; says first, when
        `proxied`, why what was served stands for its word."""
        deadline = time.monotonic() + timeout_s
        if self.proxied and not self.fetched(step, by):
            why = (
                "it listens on every interface (its address is none of this machine's: behind a port "
                "proxy, as WSL2's, every fetcher shows the proxy's address)"
                if self.everywhere
                else "no request naming a fetcher has come from that fetcher's own address (a NAT or a "
                "port proxy between them shows its own)"
            )
            self.say(
                f"checkpoint feed: {why}, so the lead cannot tell {by}'s word from a stranger's: it waits "
                f"until every file of ckpt-{step} was sent whole to a request naming {by}"
            )
        while not self.fetched(step, by):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with self._changed:  # woken by each claim or file taken; the folder re-read each second
                self._changed.wait(min(left, 1.0))
        return True


class FeedError(Exception):
    """A fetch that failed: said in one line; the next poll tries again."""


class Busy(FeedError):
    """The feed refused the connection: it serves as many as it takes (serving.BUSY)."""


BUSY = (
    "busy: it serves as many connections as it takes, its fetchers' own slots aside (other hosts' "
    "requests, or stalled transfers)"
)


def _why(e: Exception) -> str:
    """What went wrong with one request, in one line."""
    if isinstance(e, urllib.error.HTTPError) and e.code == 503:
        return BUSY
    if isinstance(e, http.client.HTTPException):  # something else listens on the port
        return f"not an od-dist checkpoint feed ({type(e).__name__} {' '.join(str(e).split())[:80]!r})"
    return " ".join(str(getattr(e, "reason", None) or e).split()) or type(e).__name__


def _error(e: Exception, what: str = "") -> FeedError:
    """FeedError for `e`, of `what` (a file's name); Busy for a refusal, whatever was asked."""
    if isinstance(e, urllib.error.HTTPError) and e.code == 503:
        return Busy(BUSY)
    return FeedError(what + _why(e))


def read_listing(
    host: str,
    port: int,
    timeout: float = TIMEOUT_S,
    have: int = 0,
    by: str = EVALUATOR,
    run: str | None = None,
) -> dict:
    """The feed's listing (`have`: the newest step the caller, `by`, holds, of `run`); raises
    FeedError (not reachable, not a feed)."""
    url = serving.url(host, port, f"?have={have}&by={by}" + (f"&run={run}" if run else ""))
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            listing = json.loads(answer.read(1 << 20))
    except (OSError, ValueError, http.client.HTTPException) as e:
        raise _error(e) from None
    if (
        not isinstance(listing, dict)
        or not isinstance(listing.get("files"), list)
        or not (listing.get("run") is None or lineage.is_run(listing["run"]))
    ):
        raise FeedError("not an od-dist checkpoint listing")
    return listing


def fetch(
    host: str,
    port: int,
    job: str,
    model_dir: str,
    timeout: float = TIMEOUT_S,
    by: str = EVALUATOR,
    say=lambda line: None,
    on_data=lambda: None,
) -> int | None:
    """Fetches the feed's newest checkpoint into `model_dir` when it is newer than the one there;
    returns its step, or None when there was nothing newer. `by`: who fetches (the feed waits for
    the evaluator's fetch of the final checkpoint, not a worker's copy). Another run's checkpoints
    in `model_dir` are set aside first, said through `say`. `on_data`: called as data arrives.
    Raises FeedError: another job's feed, a file that did not arrive whole (nothing of it is then
    named; the next call tries again)."""
    mine = lineage.run_of(model_dir)
    listing = read_listing(host, port, timeout, (newest(model_dir) or (0,))[0], by, mine)
    on_data()
    if listing.get("job") != job:
        raise FeedError(
            f"it serves the checkpoints of another job ({listing.get('job')}, this one is {job}): "
            "give every machine the same cluster file"
        )
    run = listing.get("run")
    # Read again: a folder shared with the lead names its new run by now.
    if run is not None and run != lineage.run_of(model_dir) and lineage.holds_checkpoints(model_dir):
        _set_aside(model_dir, lineage.run_of(model_dir), run, say)
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
            arrived.append(_fetch_file(host, port, entry, model_dir, timeout, by, on_data))
        if run is not None:  # before the files: a folder holding them names their run
            lineage.write_run(model_dir, run)
        # The index last, as TensorFlow writes it: a reader that lists the folder meanwhile
        # finds shards without an index, which no restore reads.
        for name, part in sorted(arrived, key=lambda a: a[0].endswith(".index")):
            os.replace(part, os.path.join(model_dir, name))
        arrived = []
    finally:
        for _, part in arrived:
            _remove(part)
    _name_newest(model_dir, step, next(f["sha256"] for f in files if f["name"] == prefix + ".index"))
    return step


def _set_aside(model_dir: str, mine: str | None, run: str, say) -> None:
    """Moves another run's checkpoints (or checkpoints of no named run) out of the way, in a line."""
    named = newest(model_dir)
    held = f"ckpt-{named[0]}" if named else "checkpoints"
    aside = lineage.set_aside(model_dir)
    if aside is None:
        return
    try:  # the record of what was fetched goes with them: those files are no longer here
        os.replace(os.path.join(model_dir, FETCHED_FILE), os.path.join(aside, FETCHED_FILE))
    except OSError:
        pass
    of = f"run {mine}" if mine else "no named run"
    say(
        f"{model_dir} held {held} of {of}, not this run's ({run}): moved it to {aside}; "
        "fetching this run's checkpoints"
    )


def _fetch_file(
    host: str, port: int, entry: dict, model_dir: str, timeout: float, by: str, on_data
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
                on_data()
    except (OSError, http.client.HTTPException) as e:
        _remove(part)
        raise _error(e, f"{name}: ") from None
    if got != size or digest.hexdigest() != want:
        _remove(part)
        raise FeedError(
            f"{name}: {got} bytes with SHA-256 {digest.hexdigest()[:12]}..., the listing said "
            f"{size} bytes, {want[:12]}... (rotated away, or damaged on the way): not used"
        )
    return name, part


def _brought(model_dir: str) -> dict[int, str]:
    """FETCHED_FILE's record: the checkpoints fetched into `model_dir`, {step: index SHA-256}."""
    try:
        with open(os.path.join(model_dir, FETCHED_FILE), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(record, dict):
        return {}
    return {int(k): v for k, v in record.items() if k.isdigit() and isinstance(v, str)}


def _name_newest(model_dir: str, step: int, index_sha256: str, keep: int = 3) -> None:
    """Names ckpt-`step`, just fetched, the newest in the state file, as TensorFlow does (a
    temporary file renamed over it), and removes the checkpoints this fetcher brought past the
    newest `keep`, that one among them: never a checkpoint it did not bring, nor one whose index
    changed since (the same step saved here by a trainer)."""
    brought = _brought(model_dir)
    brought[step] = index_sha256
    kept = [step] + sorted((s for s in brought if s != step), reverse=True)[: keep - 1]
    for old in set(brought) - set(kept):
        index = os.path.join(model_dir, f"ckpt-{old}.index")
        if os.path.isfile(index) and _sha256(index) == brought[old]:
            for name in os.listdir(model_dir):
                m = _FILE.match(name)
                if m and int(m.group(1)) == old:
                    _remove(os.path.join(model_dir, name))
        del brought[old]
    _write(model_dir, FETCHED_FILE, json.dumps({str(s): brought[s] for s in sorted(brought)}))
    lines = [f'model_checkpoint_path: "ckpt-{step}"'] + [
        f'all_model_checkpoint_paths: "ckpt-{s}"' for s in sorted(kept[1:])
    ]
    lines.append(f'all_model_checkpoint_paths: "ckpt-{step}"')
    _write(model_dir, STATE_FILE, "\n".join(lines) + "\n")


def _write(model_dir: str, name: str, text: str) -> None:
    """`text` as `name` in `model_dir`, through a temporary file renamed over it."""
    tmp = os.path.join(model_dir, f"{name}.{FETCH_PART}{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, os.path.join(model_dir, name))


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


class Follower:
    """Fetches the lead's newest checkpoint into `model_dir` every `every_s` seconds, in a thread,
    saying each one (and each change between reachable and not) in one line through `say`.
    `feeds`: where a lead may serve, (host, port) each, the usual lead's first: an elastic job's
    lead moves to another trainer's machine when its own is lost (cluster.checkpoint_feeds()).
    `clock`: monotonic seconds, which `reachable` is judged by."""

    def __init__(
        self,
        feeds,
        job: str,
        model_dir: str,
        say,
        every_s: float = 2.0,
        by: str = EVALUATOR,
        clock=time.monotonic,
    ):
        self.feeds, self.job, self.model_dir, self.say, self.by = list(feeds), job, model_dir, say, by
        self.every_s, self._clock = every_s, clock
        self._up: bool | None = None  # what the last poll found: each change is said
        self._busy = False  # the last poll was refused as busy (said once)
        self._ok_at = 0.0  # when a poll last succeeded, or a fetch last received data
        self.answered = threading.Event()  # a poll succeeded once: the folder's run is known
        self._at = 0  # the feed asked now: the last that answered
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="checkpoint-follower", daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(TIMEOUT_S)

    @property
    def reachable(self) -> bool | None:
        """None before the first poll; then whether the last succeeded, within STALE_POLLS periods
        (a poll stuck in a read, or a thread gone, is not a feed that answers)."""
        if self._up is None:
            return None
        return self._up and self._clock() - self._ok_at <= STALE_POLLS * self.every_s

    def _alive(self) -> None:
        self._ok_at = self._clock()

    def _where(self, at: int) -> str:
        host, port = self.feeds[at]
        return f"the checkpoint feed at {host}:{port}"

    def poll(self) -> int | None:
        """One fetch; the step fetched, or None. A feed that fails hands over to the next. Any error
        is one failed poll: the thread goes on, and the next tries again."""
        at = self._at
        host, port = self.feeds[at]
        try:
            step = fetch(host, port, self.job, self.model_dir, by=self.by, say=self.say, on_data=self._alive)
        except Busy as e:  # the lead answered: it is up, and stays the feed asked
            if not self._busy:
                self.say(f"{self._where(at)} is {e}; trying again every {self.every_s:.0f} s")
            self._busy, self._up = True, True
            self._alive()
            return None
        except Exception as e:  # noqa: BLE001 - a file held by another program, a full disk, no HTTP
            self._busy = False
            e = e if isinstance(e, FeedError) else f"{type(e).__name__}: {_why(e)}"
            others = (
                f" (or {', '.join(f'{h}:{p}' for h, p in self.feeds[:at] + self.feeds[at + 1 :])}, "
                "where the lead moves)"
                if len(self.feeds) > 1
                else ""
            )
            if self._up is None:
                self.say(f"waiting for {self._where(at)}{others} ({e})")
            elif self._up:
                self.say(f"{self._where(at)}: {e}; trying again every {self.every_s:.0f} s{others}")
            self._up = False
            self._at = (at + 1) % len(self.feeds)
            return None
        if not self._up:
            self.say(f"{self._where(at)} is up")
        elif self._busy:
            self.say(f"{self._where(at)} serves again")
        self._up, self._busy = True, False
        self._alive()
        self.answered.set()
        if step is not None:
            self.say(f"fetched ckpt-{step} from {self._where(at)} into {self.model_dir}, checked whole")
        return step

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.poll()
            self._stop.wait(max(0.0, self.every_s - (time.monotonic() - started)))
