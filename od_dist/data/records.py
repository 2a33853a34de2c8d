"""What the converters share: which files a flag names, label maps, the train/val split, progress,
one-line reports of bad annotations, and writing sharded TFRecords into a staging directory moved
into place only when every record is written (a failed run leaves no half-written dataset; see
`writing.move_into_place`).

Records are Model Garden's detection layout (``TfExampleDecoder``): ``image/encoded``, numeric
``image/source_id``, normalized ``image/object/bbox/*``, ``image/object/class/label`` from 1,
``image/object/is_crowd``. Writing goes through ``official.vision.data.tfrecord_lib``
(``write_tf_record_dataset`` in its single-process, streaming mode: one image in memory at a time).
"""

from __future__ import annotations

import difflib
import glob
import math
import os
import random
import re
import shutil
import struct
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from od_dist.data import textproto, writing
from od_dist.data.errors import DatasetError, ProblemsReported

LABEL_MAP_FILE = "label_map.pbtxt"
SPLITS = ("train", "val")
IMAGES_PER_SHARD = 1000  # ~100 MB of JPEGs at 640x480: a size tf.data reads well in parallel
# What a converter writes into --out; an earlier run's are replaced, nothing else there.
_OWNED = re.compile(r"(train|val)-\d{5}-of-\d{5}\.tfrecord|" + re.escape(LABEL_MAP_FILE))


# ----- which files ----------------------------------------------------------------------------


def patterns(value) -> list[str]:
    """The patterns in a records flag or a pipeline's input_path: a file, a glob, a comma-separated
    list, or a list of those (the paths a shell expanded after the flag)."""
    values = value if isinstance(value, (list, tuple)) else [value or ""]
    return [p.strip() for v in values for p in str(v).split(",") if p.strip()]


def files_of(pattern: str) -> list[str]:
    """The files one pattern names on this machine: a glob's matches (sorted), else the file."""
    if glob.has_magic(pattern):
        return sorted(f for f in glob.glob(pattern) if os.path.isfile(f))
    return [pattern] if os.path.isfile(pattern) else []


def expand_paths(value) -> list[str]:
    """The paths in a flag that takes several files or folders (see ``patterns``), a glob replaced
    by its matches (sorted); a glob that matches nothing stays, for the caller to name it."""
    return [m for p in patterns(value) for m in (sorted(glob.glob(p)) if glob.has_magic(p) else []) or [p]]


def match_files(value) -> list[str]:
    """Every file `value` (see ``patterns``) names here, in order, each once."""
    return list(dict.fromkeys(f for p in patterns(value) for f in files_of(p)))


def first_record(path: str) -> bytes | None:
    """The first record of a TFRecord file (length, its CRC, the data; CRCs not checked), or None.
    Read here, not by TensorFlow: its non-deprecated reader (tf.data) initialises the runtime, which
    a trainer must configure first, and the deprecated one prints four lines on the console."""
    with open(path, "rb") as f:
        head = f.read(12)
        if len(head) < 12:
            return None
        length = struct.unpack("<Q", head[:8])[0]
        data = f.read(length)
    return data if len(data) == length else None


def file_name_source_id(files: Sequence[str]) -> str | None:
    """The first record's image/source_id when it is not a number (the Object Detection API's
    converters write the file name there, which Model Garden's COCO evaluation cannot read), else
    None. One record is read: a converter writes every record the same way."""
    import tensorflow as tf

    for path in files[:1]:
        try:
            data = first_record(path)
            example = tf.train.Example.FromString(data) if data else None
        except Exception:  # noqa: BLE001 - unreadable records are `data check`'s to report
            return None
        ids = example.features.feature["image/source_id"].bytes_list.value if example else []
        sid = ids[0].decode("utf-8", "replace") if ids else ""
        if sid and not sid.lstrip("-").isdigit():
            return sid
    return None


# ----- label maps -----------------------------------------------------------------------------


def _pbtxt_string(name: str) -> str:
    from google.protobuf import text_encoding

    return "'" + text_encoding.CEscape(name.encode("utf-8"), as_utf8=True) + "'"


def label_map_text(names: dict[int, str]) -> str:
    """The Object Detection API's ``.pbtxt`` label map, ids from 1; names escaped as the text
    format wants (a labelImg class may hold quotes or backslashes)."""
    return "".join(f"item {{\n  id: {i}\n  name: {_pbtxt_string(n)}\n}}\n" for i, n in sorted(names.items()))


def _label_map_items(text: str, path: str) -> list[dict]:
    """The top-level scalar fields of each ``item { ... }`` of a label map (the first value of
    each, as text), strings unescaped."""
    try:
        doc = textproto.parse(text)
    except textproto.TextFormatError as e:
        raise DatasetError(f"--labels: '{path}': {e}; write item {{ id: 1 name: 'cat' }} entries") from None
    return [
        {k: str(v[0]) for k, v in item.fields.items() if not isinstance(v[0], textproto.Message)}
        for item in doc.all("item")
        if isinstance(item, textproto.Message)
    ]


def read_labels(path: str) -> dict[int, str]:
    """``--labels FILE``: an Object Detection API ``label_map.pbtxt`` (``item { id: 1 name: 'cat' }``)
    or a text file with one class name per line (ids 1, 2, ... in file order). Returns {id: name}."""
    if not os.path.isfile(path):
        raise DatasetError(
            f"--labels: '{path}': no such file; pass a label_map.pbtxt or a text file "
            "with one class name per line"
        )
    with open(path, encoding="utf-8") as f:
        text = f.read()
    names: dict[int, str] = {}
    if "item" in text and "{" in text:
        for n, fields in enumerate(_label_map_items(text, path), start=1):
            if "id" not in fields or "name" not in fields or not fields["id"].lstrip("-").isdigit():
                raise DatasetError(
                    f"--labels: '{path}': item {n} needs both id and name; write "
                    "item {{ id: 1 name: 'cat' }}"
                )
            i = int(fields["id"])
            if i < 1:
                raise DatasetError(
                    f"--labels: '{path}': item {n}: id {i}: ids start at 1 (0 is the "
                    "background); renumber from 1"
                )
            if i in names:
                raise DatasetError(f"--labels: '{path}': id {i} is used twice; give each class its own id")
            names[i] = fields["name"]
    else:
        lines = [ln.strip() for ln in text.splitlines()]
        names = {i: n for i, n in enumerate([ln for ln in lines if ln and not ln.startswith("#")], 1)}
    if not names:
        raise DatasetError(
            f"--labels: '{path}': no classes found; write one name per line or "
            "item { id: 1 name: 'cat' } entries"
        )
    dup = [n for n in set(names.values()) if list(names.values()).count(n) > 1]
    if dup:
        raise DatasetError(f"--labels: '{path}': class '{dup[0]}' is listed twice; list it once")
    return names


def unknown_class(name: str, known: Iterable[str], labels_path: str) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"class '{name}' is not in --labels '{labels_path}'{hint}; add it there or fix the name"


# ----- split, shards, progress ----------------------------------------------------------------


def split(count: int, val_fraction: float, seed: int = 0) -> list[str]:
    """'train' or 'val' for each of ``count`` items: a fixed-seed shuffle, so a rerun on the same
    files gives the same split. At least one validation item when a fraction is asked for."""
    if not 0.0 <= val_fraction < 1.0:
        raise DatasetError(f"--val_fraction: '{val_fraction}': must be in [0, 1); e.g. 0.1")
    n_val = int(round(count * val_fraction))
    if val_fraction > 0 and count >= 2:
        n_val = min(max(n_val, 1), count - 1)
    order = list(range(count))
    random.Random(seed).shuffle(order)
    val = set(order[:n_val])
    return ["val" if i in val else "train" for i in range(count)]


def num_shards(count: int) -> int:
    return max(1, math.ceil(count / IMAGES_PER_SHARD))


class Progress:
    """One line per ~2 s on stderr while converting: done/total, images/s, ETA; and a final one."""

    def __init__(self, what: str, total: int, every_s: float = 2.0, stream=None):
        self.what, self.total, self.every_s = what, total, every_s
        self.stream = stream or sys.stderr
        self.done = 0
        self.start = self.last = time.monotonic()

    def step(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= self.every_s and (not self.total or self.done < self.total):
            self.last = now
            self._print(now)

    def finish(self) -> float:
        now = time.monotonic()
        self._print(now)
        return now - self.start

    def _print(self, now: float) -> None:
        elapsed = max(now - self.start, 1e-6)
        rate = self.done / elapsed
        if not self.total:  # total unknown (records being read)
            print(
                f"od-dist {self.what} | {self.done} images | {rate:.0f} images/s | {elapsed:.1f} s",
                file=self.stream,
                flush=True,
            )
            return
        pct = 100 * self.done // max(self.total, 1)
        eta = (self.total - self.done) / rate if rate > 0 else 0
        print(
            f"od-dist {self.what} | {self.done}/{self.total} images ({pct}%) | {rate:.0f} images/s | "
            f"{f'ETA {round(eta)}s' if self.done < self.total else f'{elapsed:.1f} s'}",
            file=self.stream,
            flush=True,
        )


# ----- writing --------------------------------------------------------------------------------


@dataclass
class Written:
    out_dir: str
    label_map: str
    num_classes: int
    images: dict[str, int] = field(default_factory=dict)  # split -> images
    objects: dict[str, int] = field(default_factory=dict)  # split -> objects (incl. crowd/difficult)
    ignored: dict[str, int] = field(default_factory=dict)  # split -> is_crowd objects
    seconds: float = 0.0

    def pattern(self, split_name: str) -> str:
        return os.path.join(self.out_dir, f"{split_name}-*.tfrecord")


def write_dataset(
    out_dir: str,
    items: Sequence,
    splits: Sequence[str],
    make_example: Callable,
    names: dict[int, str],
    what: str,
    progress_stream=None,
) -> Written:
    """Writes ``items`` (in order) as sharded ``train-*.tfrecord`` / ``val-*.tfrecord`` plus
    ``label_map.pbtxt`` into ``out_dir``, through a staging directory renamed into place at the end.

    ``make_example(item, source_id)`` returns ``(tf.train.Example, num_objects, num_crowd)`` and may
    raise ``BadAnnotation``; source ids are 1..len(items) in ``items`` order. On any error the
    staging directory is removed and ``out_dir`` is left as it was.
    """
    out_dir = os.path.normpath(out_dir)
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):  # now, not after an hour of writing
        raise DatasetError(f"--out: '{out_dir}': exists and is not a directory; choose another --out")
    from official.vision.data import tfrecord_lib

    staging = writing.staging_dir(out_dir)
    result = Written(out_dir, os.path.join(out_dir, LABEL_MAP_FILE), max(names) + 1 if names else 1)
    progress = Progress(what + ": writing", len(items), stream=progress_stream)
    try:
        for split_name in SPLITS:
            chosen = [
                (item, sid) for sid, (item, s) in enumerate(zip(items, splits), start=1) if s == split_name
            ]
            result.images[split_name] = len(chosen)
            result.objects[split_name] = result.ignored[split_name] = 0
            if not chosen:
                continue
            counts = result.objects, result.ignored

            def example(item, sid, split_name=split_name, counts=counts):
                ex, n_obj, n_crowd = make_example(item, sid)
                counts[0][split_name] += n_obj
                counts[1][split_name] += n_crowd
                progress.step()
                return ex, 0

            # Single-process and lazy: one image in memory at a time, whatever the dataset's size.
            tfrecord_lib.write_tf_record_dataset(
                os.path.join(staging, split_name),
                iter(chosen),
                example,
                num_shards(len(chosen)),
                multiple_processes=0,
            )
        with open(os.path.join(staging, LABEL_MAP_FILE), "w", encoding="utf-8") as f:
            f.write(label_map_text(names))
        result.seconds = progress.finish()
        writing.move_into_place(staging, out_dir, _OWNED.fullmatch)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return result


def box_features(
    boxes: Sequence[Sequence[float]],
    labels: Sequence[int],
    names: dict[int, str],
    crowd: Sequence[int],
    areas: Sequence[float],
) -> dict:
    """Feature dict for normalized ``[ymin, xmin, ymax, xmax]`` boxes."""
    from official.vision.data import tfrecord_lib

    conv = tfrecord_lib.convert_to_feature
    return {
        "image/object/bbox/ymin": conv([float(b[0]) for b in boxes], "float_list"),
        "image/object/bbox/xmin": conv([float(b[1]) for b in boxes], "float_list"),
        "image/object/bbox/ymax": conv([float(b[2]) for b in boxes], "float_list"),
        "image/object/bbox/xmax": conv([float(b[3]) for b in boxes], "float_list"),
        "image/object/class/label": conv([int(c) for c in labels], "int64_list"),
        "image/object/class/text": conv([names[int(c)].encode("utf-8") for c in labels], "bytes_list"),
        "image/object/is_crowd": conv([int(c) for c in crowd], "int64_list"),
        # The Object Detection API's name for the same thing; Model Garden ignores it.
        "image/object/difficult": conv([int(c) for c in crowd], "int64_list"),
        "image/object/area": conv([float(a) for a in areas], "float_list"),
    }


def print_summary(written: Written, skipped: int, out=None, unit: str = "annotation file(s)") -> None:
    """What a pipeline needs: the paths and num_classes."""
    out = out or sys.stdout  # looked up now: a default bound at import would outlive a redirection
    w = written
    print(
        f"wrote {w.images['train']} train and {w.images['val']} validation images "
        f"({w.objects['train']} + {w.objects['val']} objects, "
        f"{w.ignored['train'] + w.ignored['val']} difficult/crowd kept as is_crowd) "
        f"to {w.out_dir} in {w.seconds:.1f} s" + (f"; skipped {skipped} bad {unit}" if skipped else ""),
        file=out,
    )
    print("for your pipeline (see pipelines/custom_retinanet.yaml):", file=out)
    print(
        f"  task.model.num_classes: {w.num_classes}        # background + {len(_names(w))} classes", file=out
    )
    print(f"  task.train_data.input_path: {w.pattern('train')}", file=out)
    print(f"  task.validation_data.input_path: {w.pattern('val')}", file=out)
    print(f"  label map: {w.label_map}", file=out)
    sys.stdout.flush()


def _names(w: Written) -> list:
    path = os.path.join(w.out_dir, LABEL_MAP_FILE)
    with open(path, encoding="utf-8") as f:
        return _label_map_items(f.read(), path)


def report_problems(
    problems: list[str], what: str, skip_bad: bool, limit: int = 20, unit: str = "annotation file(s)"
) -> None:
    """Prints each problem on its own line (at most ``limit``) to stderr; without ``skip_bad`` and
    with problems, raises ProblemsReported (nothing is written)."""
    for p in problems[:limit]:
        print(f"od-dist {what}: {p}", file=sys.stderr)
    if len(problems) > limit:
        print(f"od-dist {what}: ... and {len(problems) - limit} more", file=sys.stderr)
    if not skip_bad and problems:
        print(
            f"od-dist {what}: {len(problems)} bad {unit}, nothing written; fix them, or "
            "pass --skip_bad to convert without them",
            file=sys.stderr,
        )
        raise ProblemsReported(f"{len(problems)} bad {unit}")


def matching_files(directory: str, suffix: str) -> Iterator[str]:
    """The files under `directory` whose names end in `suffix`, sorted. Directory symlinks are not
    followed: a link to a parent would list the same files over and over."""
    found = []
    for root, _, files in os.walk(directory):
        found += [os.path.join(root, f) for f in files if f.lower().endswith(suffix)]
    yield from (path for path in sorted(found) if os.path.isfile(path))
