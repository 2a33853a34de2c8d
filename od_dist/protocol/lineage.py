"""A run's identity, kept beside its checkpoints on every disk that holds a copy of them.

A cluster file's job id (Cluster.job_id) names the machines, not the run: every rerun of one file
has the same. So a run gets an id of its own when it first trains (no machine holding a checkpoint
of any run), written as RUN_FILE into each model_dir that takes its checkpoints (the trainers', a
fetcher's), and said wherever a checkpoint is offered: the feed's listing, the membership state.
A checkpoint of another run is never adopted, broadcast or evaluated without a word: trainers of
two runs refuse to start, a fetcher sets its copy of another run aside (moved, never deleted).
No TensorFlow here.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import struct
import time

RUN_FILE = "od-dist-run.json"
ROUNDS_FILE = "od-dist-rounds.json"  # an elastic job's rounds as this disk saw them (host/agreement.py)
SET_ASIDE = "set-aside-"  # + the time: where checkpoints no run of this folder resumes from go
STATE_FILE = "checkpoint"  # TensorFlow's: names the newest checkpoint of a folder
CHECKPOINT_FILE = re.compile(r"^ckpt-(\d+)(\.index|\.data-\d{5}-of-\d{5})$")
_NAMED = re.compile(r'^(?:model_checkpoint_path|all_model_checkpoint_paths):\s*"([^"]+)"', re.M)
# The last 8 bytes of every TensorFlow table, as a checkpoint's index is (lib/io/format.h): an
# index written only in part, or not an index at all, lacks them.
TABLE_MAGIC = struct.pack("<Q", 0xDB4775248B80FB57)
FRESH_HINT = (
    "start afresh with `od-dist train ... --new_run` on every machine (their checkpoints are set aside)"
)


def new_run() -> str:
    """A new run's id: 12 hex digits, so two runs of one cluster file never share one."""
    return secrets.token_hex(6)


def run_of(model_dir: str) -> str | None:
    """The run whose checkpoints `model_dir` holds, None when it names none (or is unreadable)."""
    try:
        with open(os.path.join(model_dir, RUN_FILE), encoding="utf-8") as f:
            run = json.load(f).get("run")
    except (OSError, ValueError, AttributeError):
        return None
    return run if is_run(run) else None


def is_run(value) -> bool:
    """Whether `value` is a run's id as new_run() makes them (a peer's word is checked with it)."""
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{1,32}", value) is not None


def write_run(model_dir: str, run: str) -> None:
    """Names `run` as the run of `model_dir`'s checkpoints (a temporary file renamed over it)."""
    if run_of(model_dir) == run:
        return
    os.makedirs(model_dir, exist_ok=True)
    tmp = os.path.join(model_dir, f".{RUN_FILE}.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"run": run, "since": time.strftime("%Y-%m-%d %H:%M:%S")}, f)
    os.replace(tmp, os.path.join(model_dir, RUN_FILE))


def rounds_kept(model_dir: str) -> dict | None:
    """What `keep_rounds` wrote into `model_dir`, None when nothing (or nothing readable)."""
    try:
        with open(os.path.join(model_dir, ROUNDS_FILE), encoding="utf-8") as f:
            kept = json.load(f)
    except (OSError, ValueError):
        return None
    return kept if isinstance(kept, dict) and all(isinstance(v, int) for v in kept.values()) else None


def keep_rounds(model_dir: str, kept: dict) -> None:
    """Keeps an elastic job's rounds as this machine saw them beside its checkpoints (a temporary
    file renamed over it): a reboot goes on counting from them. Best effort: a disk that refuses
    (full, held by another program) costs only what a reboot would remember."""
    tmp = os.path.join(model_dir, f".{ROUNDS_FILE}.{os.getpid()}")
    try:
        os.makedirs(model_dir, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(kept, f)
        os.replace(tmp, os.path.join(model_dir, ROUNDS_FILE))
    except OSError:
        pass


def intact(model_dir: str, prefix: str) -> bool:
    """Whether checkpoint `prefix` (`ckpt-N`) is on disk whole enough to restore: its index ends as
    a table does and every data shard it was written with is there. No TensorFlow: a quick check
    of what a save leaves, not a read of every tensor."""
    try:
        names = os.listdir(model_dir)
        with open(os.path.join(model_dir, prefix + ".index"), "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() < 48:  # a table's footer
                return False
            f.seek(-8, os.SEEK_END)
            if f.read(8) != TABLE_MAGIC:
                return False
    except OSError:
        return False
    shards = [re.fullmatch(re.escape(prefix) + r"\.data-(\d{5})-of-(\d{5})", n) for n in names]
    shards = [(int(m.group(1)), int(m.group(2))) for m in shards if m]
    return any(set(range(n)) <= {i for i, k in shards if k == n} for _, n in shards)


def newest(model_dir: str) -> tuple[int, str] | None:
    """(step, prefix) of the newest checkpoint the state file names that is on disk whole, or None:
    the step a machine reports is one it can restore, not a name left by a checkpoint gone."""
    try:
        with open(os.path.join(model_dir, STATE_FILE), encoding="utf-8") as f:
            named = _NAMED.findall(f.read())
    except (OSError, UnicodeDecodeError):
        return None
    steps = {}
    for path in named:
        m = re.fullmatch(r"ckpt-(\d+)", os.path.basename(path))
        if m:
            steps[int(m.group(1))] = m.group(0)
    for step in sorted(steps, reverse=True):
        if intact(model_dir, steps[step]):
            return step, steps[step]
    return None


def holds_checkpoints(model_dir: str) -> bool:
    """Any checkpoint file or state file in `model_dir` (whole or not)."""
    try:
        return any(n == STATE_FILE or CHECKPOINT_FILE.match(n) for n in os.listdir(model_dir))
    except OSError:
        return False


def set_aside(model_dir: str) -> str | None:
    """Moves `model_dir`'s checkpoints, its state file, its run and rounds files into
    `<model_dir>/set-aside-<time>/` (nothing deleted); returns that folder, None when there was
    nothing to move. Training summaries and evaluations stay."""
    try:
        names = [
            n
            for n in os.listdir(model_dir)
            if n in (STATE_FILE, RUN_FILE, ROUNDS_FILE) or CHECKPOINT_FILE.match(n)
        ]
    except OSError:
        return None
    if not names:
        return None
    aside = os.path.join(model_dir, SET_ASIDE + time.strftime("%Y%m%d-%H%M%S"))
    n = 1
    while os.path.exists(aside + (f"-{n}" if n > 1 else "")):
        n += 1
    aside += f"-{n}" if n > 1 else ""
    os.makedirs(aside)
    for name in names:
        os.replace(os.path.join(model_dir, name), os.path.join(aside, name))
    return aside
