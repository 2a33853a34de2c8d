"""A model_dir's checkpoints tidied before a run: leftovers of saves that did not finish removed,
complete checkpoints the state file does not name set aside or resumed from, each said in one line."""

from __future__ import annotations

import os
import re
import struct
import time
from dataclasses import dataclass, field

from od_dist import patches
from od_dist.protocol import lineage
from od_dist.task.errors import PREFIX as _PREFIX
from od_dist.task.errors import TrainerError

_CHECKPOINT_FILE = re.compile(r"^(ckpt-(\d+))(\.index|\.data-\d+-of-\d+|_temp)$")
SET_ASIDE = lineage.SET_ASIDE  # + the time: where complete checkpoints nobody named are moved


@dataclass
class Tidied:
    """What `tidy_checkpoints` did: each is said in one line (`tidy`)."""

    removed: list[str] = field(default_factory=list)  # leftovers of saves that did not finish
    set_aside: list[tuple[str, str]] = field(default_factory=list)  # (checkpoint, the folder it went to)
    resumed: str | None = None  # a complete checkpoint newer than any named, now named latest
    named: str | None = None  # the latest one the state file named before


# The last 8 bytes of every TensorFlow table, as a checkpoint's index is (lib/io/format.h): an
# index written only in part, or not an index at all, lacks them.
_TABLE_MAGIC = struct.pack("<Q", 0xDB4775248B80FB57)


def _complete(prefix: str, names: set[str]) -> bool:
    """True when the checkpoint at `prefix` reads back whole: its index, and every tensor it lists
    from the data shards (which is what a restore will need). False only when it is proven
    incomplete: no index among `names` (the folder's listing), an index that is not a checkpoint
    index (a save stopped while writing it), a data shard the folder does not hold, or one cut
    short. Any other error (permissions, a network file system's, a folder where a file should be)
    proves nothing: TrainerError naming the file, and nothing is removed."""
    import tensorflow as tf

    stem = os.path.basename(prefix)
    if stem + ".index" not in names:
        return False
    try:
        with tf.io.gfile.GFile(prefix + ".index", "rb") as f:
            index = f.read()
    except tf.errors.OpError as e:
        raise _unreadable(prefix + ".index", e) from None
    if len(index) < 48 or not index.endswith(_TABLE_MAGIC):  # 48: a table's footer
        return False
    shards = [re.fullmatch(re.escape(stem) + r"\.data-(\d+)-of-(\d+)", n) for n in names]
    shards = [(int(m.group(1)), int(m.group(2))) for m in shards if m]
    if not any(set(range(n)) <= {i for i, k in shards if k == n} for _, n in shards):
        return False  # every save writes shards 0..n-1 of n (n >= 1): no such whole set here
    try:
        reader = tf.train.load_checkpoint(prefix)
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)
    except IndexError:  # the reader met the end of a data shard before a tensor's last byte
        return False
    except (tf.errors.OpError, ValueError) as e:
        missing = re.search(r"(\S+); No such file or directory", str(e))
        if missing and os.path.basename(missing.group(1)) not in names:
            return False  # a shard the index names (of another count) that the folder does not hold
        raise _unreadable(prefix + ".data-*", e) from None
    return True


def _unreadable(path: str, error: Exception) -> TrainerError:
    message = (getattr(error, "message", None) or str(error)).strip().splitlines()
    return TrainerError(
        f"checkpoint file {path}: {type(error).__name__}: {message[0] if message else ''}; cannot tell "
        "whether that checkpoint is complete, so nothing in the model_dir was removed: fix the access "
        "to it (or move it out of the model_dir) and start again"
    )


def tidy_checkpoints(model_dir: str) -> Tidied:
    """Puts ``model_dir``'s checkpoints in order before a run restores one; returns what it did.

    TensorFlow writes a checkpoint's shards under ``ckpt-N_temp/`` (each first as a
    ``*.tempstate*`` file), renames them to ``ckpt-N.data-*``, writes ``ckpt-N.index`` (in place,
    not atomically), and only then names ``ckpt-N`` in the ``checkpoint`` state file (replaced
    atomically), which is what every reader (restore, the evaluator) goes by. So:

    - temporary shards and ``*.tempstate*`` files are leftovers of a save that did not finish:
      removed;
    - a ``ckpt-N`` the state file does not name is removed only when it is proven incomplete (no
      index, an index that is not a checkpoint index, a data shard missing or cut short: see
      `_complete`); one that fails to read for another reason (permissions, a network file
      system) stops the run in one line (TrainerError) before anything at all is removed;
    - a complete one it does not name (a save killed after its last byte and before the state file
      named it, or a checkpoint a user copied in to resume from) is never removed: the newest of
      them, when newer than every named one, is named the latest and the run resumes from it;
      any other is moved into ``<model_dir>/set-aside-<time>/``.

    Without a state file every complete ``ckpt-N`` is unnamed (files copied into a new model_dir).
    With one that does not read (a transient error of a network share) nothing says which
    checkpoint the run was at: only the temporary files go, the state file is left as it is.
    """
    import tensorflow as tf

    done = Tidied()
    if not tf.io.gfile.isdir(model_dir):
        return done
    try:
        state = tf.train.get_checkpoint_state(model_dir)
        readable = True
    except (tf.errors.OpError, ValueError):  # ValueError: bytes that are not text
        state, readable = None, False
    named = [state.model_checkpoint_path, *state.all_model_checkpoint_paths] if state else []
    named_steps = {
        int(m.group(2)) for m in (_CHECKPOINT_FILE.match(os.path.basename(p) + ".index") for p in named) if m
    }
    groups: dict[int, list[str]] = {}
    names = {name.rstrip("/") for name in tf.io.gfile.listdir(model_dir)}
    leftovers = []
    for name in sorted(names):
        path = os.path.join(model_dir, name)
        m = _CHECKPOINT_FILE.match(name)
        if ".tempstate" in name or (m and m.group(3) == "_temp"):
            leftovers.append(path)
        elif m and readable and int(m.group(2)) not in named_steps:
            groups.setdefault(int(m.group(2)), []).append(path)
    # Every checkpoint judged before anything is removed: one that cannot be judged stops it all.
    complete = {
        step: paths
        for step, paths in sorted(groups.items())
        if _complete(os.path.join(model_dir, f"ckpt-{step}"), names)
    }
    for path in leftovers + [
        p for step, paths in sorted(groups.items()) if step not in complete for p in paths
    ]:
        _remove(path)
        done.removed.append(path)
    newest = max(complete, default=-1)
    if complete and newest > max(named_steps, default=-1):
        prefix = os.path.join(model_dir, f"ckpt-{newest}")
        done.named = state.model_checkpoint_path if state else None
        kept = list(state.all_model_checkpoint_paths) if state else []
        stamps = list(state.all_model_checkpoint_timestamps) if state else []
        if len(stamps) != len(kept):
            stamps = [time.time()] * len(kept)
        patches.tensorflow.update_checkpoint_state(
            model_dir,
            prefix,
            [*kept, prefix],
            save_relative_paths=True,  # as TensorFlow's CheckpointManager writes it
            all_model_checkpoint_timestamps=[*stamps, tf.io.gfile.stat(prefix + ".index").mtime_nsec / 1e9],
            last_preserved_timestamp=state.last_preserved_timestamp if state else None,
        )
        done.resumed = prefix
        del complete[newest]
    if complete:
        aside = os.path.join(model_dir, SET_ASIDE + time.strftime("%Y%m%d-%H%M%S"))
        tf.io.gfile.makedirs(aside)
        for step, paths in complete.items():
            for path in paths:
                tf.io.gfile.rename(path, os.path.join(aside, os.path.basename(path)))
            done.set_aside.append((os.path.join(model_dir, f"ckpt-{step}"), aside))
    return done


def _remove(path: str) -> None:
    import tensorflow as tf

    if tf.io.gfile.isdir(path):
        tf.io.gfile.rmtree(path)
    else:
        tf.io.gfile.remove(path)


def tidy(model_dir: str) -> Tidied:
    """`tidy_checkpoints`, each thing done said in one line. Run by the task that writes the
    checkpoints, before any trainer restores one."""
    done = tidy_checkpoints(model_dir)
    for path in done.removed:
        print(f"{_PREFIX} train | removed {path}, left by a save that did not finish", flush=True)
    for prefix, aside in done.set_aside:
        print(
            f"{_PREFIX} train | {prefix} is complete but the checkpoint file does not name it and a newer "
            f"one is resumed from: moved it to {aside}",
            flush=True,
        )
    if done.resumed:
        before = (
            f"than {done.named}, the latest the checkpoint file named"
            if done.named
            else ("and the checkpoint file named none")
        )
        print(
            f"{_PREFIX} train | {done.resumed} is complete and newer {before} (a save stopped before "
            "naming it, or a checkpoint copied in): resuming from it",
            flush=True,
        )
    return done
