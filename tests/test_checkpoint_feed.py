"""The lead's checkpoint feed (protocol/checkpoint_feed.py) on loopback, without TensorFlow: a
checkpoint fetched whole into another folder and named there, nothing else served, nothing
accepted, a file damaged on the way or another job's feed refused with nothing named; a follower
that outlives any error of one poll; pruning of what a fetcher brought only; another run's
checkpoints set aside before this run's are fetched. (tests/test_feed_on_a_lan.py: its limits.)"""

import json
import os
import time
import urllib.error
import urllib.request

import pytest

from od_dist.cluster import hostinfo
from od_dist.protocol import checkpoint_feed, lineage


def _free_port():
    s = hostinfo.bind_port("127.0.0.1", 0)
    port = s.getsockname()[1]
    s.close()
    return port


def _save(folder, step, data=b"weights"):
    """A checkpoint as TensorFlow leaves it: its shard, its index, then the state file names it."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"ckpt-{step}.data-00000-of-00001"), "wb") as f:
        f.write(data * 1000)
    with open(os.path.join(folder, f"ckpt-{step}.index"), "wb") as f:
        f.write(b"index %d" % step + bytes(48) + lineage.TABLE_MAGIC)  # a table's footer ends it
    with open(os.path.join(folder, "checkpoint"), "w") as f:
        f.write(f'model_checkpoint_path: "ckpt-{step}"\nall_model_checkpoint_paths: "ckpt-{step}"\n')


@pytest.fixture
def feed(tmp_path):
    port = _free_port()
    fetchers = [("evaluator", "127.0.0.1"), ("worker:0", "127.0.0.1")]
    with checkpoint_feed.Feed(str(tmp_path / "lead"), "127.0.0.1", port, "job1", fetchers) as served:
        served.port = port
        yield served


def test_fetched_whole_named_once_and_reported(feed, tmp_path):
    here = str(tmp_path / "evaluator")
    assert checkpoint_feed.fetch("127.0.0.1", feed.port, "job1", here) is None  # no checkpoint yet
    _save(feed.model_dir, 4)
    assert not feed.fetched(4)
    assert checkpoint_feed.fetch("127.0.0.1", feed.port, "job1", here) == 4
    for name in ("ckpt-4.index", "ckpt-4.data-00000-of-00001"):
        with open(os.path.join(here, name), "rb") as a, open(os.path.join(feed.model_dir, name), "rb") as b:
            assert a.read() == b.read()
    assert checkpoint_feed.newest(here) == (4, "ckpt-4")
    # The feed's thread counts a file once it wrote it all, which may be just after this side read it.
    assert feed.wait_fetched(4, 10)
    assert checkpoint_feed.fetch("127.0.0.1", feed.port, "job1", here) is None  # nothing newer
    _save(feed.model_dir, 6)
    # A worker of an elastic job keeps a copy: the feed's end waits for the evaluator's, not this.
    copy = str(tmp_path / "worker")
    assert checkpoint_feed.fetch("127.0.0.1", feed.port, "job1", copy, by="worker:0") == 6
    assert feed.wait_fetched(6, 10, by="worker:0") and not feed.fetched(6)
    assert checkpoint_feed.fetch("127.0.0.1", feed.port, "job1", here) == 6
    assert checkpoint_feed.newest(here) == (6, "ckpt-6")
    assert not [n for n in os.listdir(here) if checkpoint_feed.FETCH_PART in n]


def test_a_folder_that_has_it_fetches_nothing_and_says_so(feed):
    """A shared folder: the evaluator's folder is the lead's; its report ends the lead's wait."""
    _save(feed.model_dir, 8)
    before = sorted(os.listdir(feed.model_dir))
    assert checkpoint_feed.fetch("127.0.0.1", feed.port, "job1", feed.model_dir) is None
    assert sorted(os.listdir(feed.model_dir)) == before
    assert feed.fetched(8) and feed.wait_fetched(8, 0)


def test_damaged_on_the_way_or_another_job_is_not_named(feed, tmp_path):
    here = str(tmp_path / "evaluator")
    _save(feed.model_dir, 4)
    with pytest.raises(checkpoint_feed.FeedError, match="another job"):
        checkpoint_feed.fetch("127.0.0.1", feed.port, "job2", here)
    feed.listing()  # its sums are taken; then a shard changes without changing its size or time
    shard = os.path.join(feed.model_dir, "ckpt-4.data-00000-of-00001")
    stat = os.stat(shard)
    with open(shard, "r+b") as f:
        f.write(b"X")
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(checkpoint_feed.FeedError, match="SHA-256 .*not used"):
        checkpoint_feed.fetch("127.0.0.1", feed.port, "job1", here)
    assert checkpoint_feed.newest(here) is None and os.listdir(here) == []


def test_serves_checkpoint_files_only_and_accepts_nothing(feed):
    _save(feed.model_dir, 4)
    with open(os.path.join(os.path.dirname(feed.model_dir), "secret"), "w") as f:
        f.write("x")
    url = f"http://127.0.0.1:{feed.port}"
    for path in ("/checkpoint", "/../secret", "/%2e%2e/secret", "/ckpt-4.index/../../secret", "/params.yaml"):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url + path, timeout=10)
        assert e.value.code == 404, path
    for method in ("PUT", "POST", "DELETE"):
        request = urllib.request.Request(url + "/ckpt-4.index", data=b"x", method=method)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=10)
        assert e.value.code == 501, method
    with open(os.path.join(feed.model_dir, "ckpt-4.index"), "rb") as f:
        assert f.read().startswith(b"index 4")


def test_follower_says_each_fetch_in_one_line(feed, tmp_path):
    lines = []
    follower = checkpoint_feed.Follower([("127.0.0.1", feed.port)], "job1", str(tmp_path / "e"), lines.append)
    assert follower.poll() is None and follower.reachable
    _save(feed.model_dir, 2)
    assert follower.poll() == 2
    assert lines == [
        f"the checkpoint feed at 127.0.0.1:{feed.port} is up",
        f"fetched ckpt-2 from the checkpoint feed at 127.0.0.1:{feed.port} into {tmp_path / 'e'}, checked whole",
    ]


def test_follower_moves_to_the_feed_of_the_new_lead(feed, tmp_path):
    """An elastic job's lead moves to another trainer's machine: the follower asks the next feed
    when one fails, and keeps the one that answers."""
    lines = []
    gone = _free_port()  # the lost lead's: nothing listens there
    feeds = [("127.0.0.1", gone), ("127.0.0.1", feed.port)]
    follower = checkpoint_feed.Follower(feeds, "job1", str(tmp_path / "e"), lines.append)
    _save(feed.model_dir, 3)
    assert follower.poll() is None and follower.reachable is False
    assert lines[0].startswith(
        f"waiting for the checkpoint feed at 127.0.0.1:{gone} (or 127.0.0.1:{feed.port}, "
    )
    assert follower.poll() == 3 and follower.poll() is None and follower.reachable
    assert lines[1:] == [
        f"the checkpoint feed at 127.0.0.1:{feed.port} is up",
        f"fetched ckpt-3 from the checkpoint feed at 127.0.0.1:{feed.port} into {tmp_path / 'e'}, checked whole",
    ]


def test_a_name_of_no_address_here_listens_everywhere(tmp_path):
    """192.0.2.1 (TEST-NET-1) is none of this machine's addresses, as a WSL2 machine's LAN name
    behind a port proxy: the feed listens on every interface, as TensorFlow's server does."""
    port = _free_port()
    with checkpoint_feed.Feed(str(tmp_path / "lead"), "192.0.2.1", port, "job1") as feed:
        assert feed.everywhere
        _save(feed.model_dir, 2)
        assert checkpoint_feed.fetch("127.0.0.1", port, "job1", str(tmp_path / "e")) == 2
    with checkpoint_feed.Feed(str(tmp_path / "lead"), "127.0.0.1", port, "job1") as feed:
        assert not feed.everywhere


def test_follower_outlives_any_error_of_one_poll(feed, not_http, tmp_path):
    """No HTTP on the port (BadStatusLine), then a rename that fails (a file held by another
    program on Windows; here a folder in the way): each is one line and a poll not reachable, the
    thread goes on, and the next poll that can fetch does."""
    lines, here = [], str(tmp_path / "e")
    follower = checkpoint_feed.Follower([("127.0.0.1", not_http)], "job1", here, lines.append, every_s=0.05)
    with follower:
        deadline = time.monotonic() + 10
        while not lines and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # several polls more
        assert follower._thread.is_alive() and follower.reachable is False
    assert lines == [
        f"waiting for the checkpoint feed at 127.0.0.1:{not_http} (not an od-dist checkpoint feed "
        "(BadStatusLine 'SSH-2.0-OpenSSH_9.6'))"
    ]
    lines.clear()
    _save(feed.model_dir, 2)
    os.makedirs(os.path.join(here, "ckpt-2.index", "in-the-way"))
    follower = checkpoint_feed.Follower([("127.0.0.1", feed.port)], "job1", here, lines.append)
    assert follower.poll() is None and follower.reachable is False
    assert len(lines) == 1 and lines[0].startswith(
        f"waiting for the checkpoint feed at 127.0.0.1:{feed.port} (IsADirectoryError: "
    ), lines
    assert not [n for n in os.listdir(here) if checkpoint_feed.FETCH_PART in n]
    os.rmdir(os.path.join(here, "ckpt-2.index", "in-the-way"))
    os.rmdir(os.path.join(here, "ckpt-2.index"))
    assert follower.poll() == 2 and follower.reachable


def test_reachable_goes_stale_without_a_poll_that_succeeds(feed, tmp_path):
    now = [100.0]
    follower = checkpoint_feed.Follower(
        [("127.0.0.1", feed.port)], "job1", str(tmp_path / "e"), lambda line: None, clock=lambda: now[0]
    )
    assert follower.reachable is None
    assert follower.poll() is None and follower.reachable
    now[0] += checkpoint_feed.STALE_POLLS * follower.every_s  # a few periods: still fresh
    assert follower.reachable
    now[0] += 0.1  # no poll came back since (a read stuck, a thread gone): not reachable
    assert follower.reachable is False
    assert follower.poll() is None and follower.reachable


def _steps(folder):
    return sorted({int(m.group(1)) for m in map(lineage.CHECKPOINT_FILE.match, os.listdir(folder)) if m})


def test_pruning_removes_only_what_the_fetcher_brought(feed, tmp_path):
    """A folder holding checkpoints of higher steps that no state file names (a trainer's, left
    there): the fetched one is kept and named, theirs stay, and of the fetched only the newest
    three are kept."""
    here = str(tmp_path / "e")
    for step in (100, 200, 300):
        _save(here, step)
    os.remove(os.path.join(here, "checkpoint"))
    for step in (6, 8, 10, 12):
        _save(feed.model_dir, step)
        assert checkpoint_feed.fetch("127.0.0.1", feed.port, "job1", here) == step
        assert checkpoint_feed.newest(here) == (step, f"ckpt-{step}")
    assert _steps(here) == [8, 10, 12, 100, 200, 300]
    with open(os.path.join(here, checkpoint_feed.FETCHED_FILE)) as f:
        assert sorted(json.load(f)) == ["10", "12", "8"]


def _run_folder(folder, run, step):
    _save(folder, step)
    if run:
        lineage.write_run(folder, run)


@pytest.mark.parametrize("old_run", ["abc123", None])
def test_another_runs_checkpoints_are_set_aside_then_this_runs_fetched(feed, tmp_path, old_run):
    """The evaluator's folder holds ckpt-5000 of an earlier run (or of no named run); the lead's
    feed serves ckpt-100 of run def456. The evaluator's report of ckpt-5000 is not taken for this
    run's; its fetch moves the old checkpoints aside (nothing deleted), says so, fetches ckpt-100
    and names the run."""
    here = str(tmp_path / "e")
    _run_folder(here, old_run, 5000)
    _run_folder(feed.model_dir, "def456", 100)
    # What the fetch's listing request says first: it holds 5000, of its own run.
    checkpoint_feed.read_listing("127.0.0.1", feed.port, have=5000, run=old_run)
    assert not feed.fetched(100)
    lines = []
    follower = checkpoint_feed.Follower([("127.0.0.1", feed.port)], "job1", here, lines.append)
    assert follower.poll() == 100
    (aside,) = [n for n in os.listdir(here) if n.startswith(lineage.SET_ASIDE)]
    aside = os.path.join(here, aside)
    assert lines == [
        f"{here} held ckpt-5000 of {'run ' + old_run if old_run else 'no named run'}, not this run's "
        f"(def456): moved it to {aside}; fetching this run's checkpoints",
        f"the checkpoint feed at 127.0.0.1:{feed.port} is up",
        f"fetched ckpt-100 from the checkpoint feed at 127.0.0.1:{feed.port} into {here}, checked whole",
    ]
    assert _steps(aside) == [5000] and lineage.run_of(aside) == old_run
    assert _steps(here) == [100] and lineage.run_of(here) == "def456"
    assert checkpoint_feed.newest(here) == (100, "ckpt-100")
    assert feed.wait_fetched(100, 10)
    _save(feed.model_dir, 200)
    assert follower.poll() == 200 and len(lines) == 4  # its own run's now: nothing more set aside


def test_the_evaluator_evaluates_its_folder_only_once_the_feed_said_the_run(feed, tmp_path):
    """evaluator.own_run_only, before continuous evaluation: a folder holding checkpoints (maybe an
    earlier run's) waits for the lead's feed to answer once, while the job is alive; an empty
    folder waits for nothing."""
    from od_dist.task import evaluator

    here = str(tmp_path / "e")
    _run_folder(here, "abc123", 5000)
    _run_folder(feed.model_dir, "def456", 100)
    gone = _free_port()
    asked = []
    never = checkpoint_feed.Follower([("127.0.0.1", gone)], "job1", here, lambda line: None, every_s=0.05)
    with never:  # no feed answers: nothing is evaluated once the job is given up
        assert not evaluator.own_run_only(never, here, lambda: asked.append(1) or len(asked) < 2)
    assert _steps(here) == [5000] and len(asked) == 2
    follower = checkpoint_feed.Follower([("127.0.0.1", feed.port)], "job1", here, lambda line: None)
    with follower:
        assert evaluator.own_run_only(follower, here, lambda: True)
    assert _steps(here) == [100] and lineage.run_of(here) == "def456"  # ckpt-5000 set aside first
    empty = str(tmp_path / "empty")
    assert evaluator.own_run_only(never, empty, lambda: False)
