"""`od-dist data check`: reads every record a pipeline would train and validate on, as Model Garden
will, and reports what would fail minutes into a run (or silently spoil it): images that do not
decode or disagree with their stored size, boxes outside the image or of no size, class ids outside
1..num_classes-1, non-numeric or repeated source ids (COCO evaluation uses them as image ids).

Each problem names the record (file, index, source id) and what is wrong; the counts per class and
per split follow. TensorFlow decodes the images, exactly as the training input pipeline does.
"""

from __future__ import annotations

import collections
import math
import os
import re
from dataclasses import dataclass, field

from od_dist.data import records

MAX_INSTANCES = 100  # Model Garden's Parser.max_num_instances default: later boxes are dropped
_EPS = 1e-6
# A shard's number at the end of a records file's name (train-00000-of-00004, val_1).
_SHARD = re.compile(r"[-_]\d+(-of-\d+)?$")


def splits_of(value) -> dict[str, str]:
    """The records of a --records flag grouped as the splits one evaluation (or one training) reads:
    files whose names differ only in a shard number are one split, each other file its own (a
    training and a validation split may share source ids; within one they must differ). Split name
    -> its files, comma-joined; a pattern that names no file here is kept as given (reported)."""
    groups: dict[str, list[str]] = {}
    for pattern in records.patterns(value):
        files = records.files_of(pattern)
        if not files:
            groups.setdefault(pattern, []).append(pattern)
        for f in files:
            folder, name = os.path.split(f)
            stem, ext = os.path.splitext(name)
            base = _SHARD.sub("", stem)
            groups.setdefault(os.path.join(folder, base + ("-*" if base != stem else "") + ext), []).append(f)
    if len(groups) <= 1:
        return {"records": ",".join(records.patterns(value))}
    return {name: ",".join(dict.fromkeys(files)) for name, files in groups.items()}


@dataclass
class SplitStats:
    pattern: str
    files: int = 0
    images: int = 0
    objects: int = 0
    crowd: int = 0
    per_class: collections.Counter = field(default_factory=collections.Counter)
    names: dict = field(default_factory=dict)
    over_limit: int = 0


def _list(feature, kind: str) -> list:
    if feature is None:
        return []
    return list(getattr(feature, kind).value)


def check_record(data: bytes, num_classes: int | None, tf) -> tuple[dict, list[str]]:
    """One serialized record -> (facts, problems)."""
    problems = []
    try:
        example = tf.train.Example.FromString(data)
    except Exception:  # a protobuf DecodeError
        return {}, ["not a tf.train.Example; write it with a detection converter"]
    f = example.features.feature
    sid_list = _list(f.get("image/source_id"), "bytes_list")
    sid = sid_list[0].decode("utf-8", "replace") if sid_list else ""
    facts = {"source_id": sid, "labels": [], "texts": [], "crowd": []}
    if not sid:
        problems.append("no image/source_id; write a numeric id per image (COCO evaluation needs it)")
    else:
        try:
            int(sid)
        except ValueError:
            problems.append(
                f"image/source_id '{sid}' is not a number (Object Detection API records hold the "
                "file name there); COCO evaluation needs integer image ids: rewrite the records "
                "once with 'od-dist data odapi' (see its --help)"
            )
    encoded = _list(f.get("image/encoded"), "bytes_list")
    if not encoded:
        problems.append("no image/encoded; the record holds no image")
        return facts, problems
    try:
        shape = tf.io.decode_image(encoded[0], channels=3, expand_animations=False).shape
        height, width = int(shape[0]), int(shape[1])
    except (tf.errors.InvalidArgumentError, tf.errors.UnknownError, ValueError) as e:
        msg = str(getattr(e, "message", e)).splitlines()[0][:120]
        problems.append(f"image does not decode ({msg}); re-encode it as JPEG or PNG")
        return facts, problems
    for key, actual in (("image/height", height), ("image/width", width)):
        stored = _list(f.get(key), "int64_list")
        if stored and stored[0] != actual:
            problems.append(f"{key} is {stored[0]} but the image is {width}x{height}; fix {key}")
    coords = {
        k: _list(f.get(f"image/object/bbox/{k}"), "float_list") for k in ("ymin", "xmin", "ymax", "xmax")
    }
    labels = _list(f.get("image/object/class/label"), "int64_list")
    texts = [t.decode("utf-8", "replace") for t in _list(f.get("image/object/class/text"), "bytes_list")]
    crowd = _list(f.get("image/object/is_crowd"), "int64_list")
    n = len(labels)
    lengths = {k: len(v) for k, v in coords.items()}
    if any(v != n for v in lengths.values()) or (crowd and len(crowd) != n):
        problems.append(
            f"{n} labels but box lists of lengths {lengths} and {len(crowd)} is_crowd; "
            "write one entry per object in each list"
        )
        return facts, problems
    for i in range(n):
        y0, x0, y1, x1 = (coords[k][i] for k in ("ymin", "xmin", "ymax", "xmax"))
        box = f"box {i + 1} (ymin {y0:.4g}, xmin {x0:.4g}, ymax {y1:.4g}, xmax {x1:.4g})"
        if not all(math.isfinite(v) for v in (y0, x0, y1, x1)):
            problems.append(f"{box} is not finite (NaN or infinity); fix or drop the box and convert again")
        elif min(y0, x0) < -_EPS or max(y1, x1) > 1 + _EPS:
            problems.append(
                f"{box} outside the image: boxes are normalized to 0..1; divide pixels by the width/height"
            )
        elif x1 <= x0 or y1 <= y0:
            problems.append(f"{box} has no area (max <= min); fix or drop the box")
        c = labels[i]
        if c < 1 or (num_classes is not None and c > num_classes - 1):
            top = f"1..{num_classes - 1}" if num_classes is not None else "1 or more"
            problems.append(
                f"object {i + 1}: class id {c} outside {top} (0 is the background"
                + (f"; num_classes {num_classes} = largest id + 1" if num_classes else "")
                + "); fix the id or task.model.num_classes"
            )
    facts.update(labels=labels, texts=texts if len(texts) == n else [], crowd=crowd or [0] * n)
    return facts, problems


def check(splits: dict[str, str], num_classes: int | None, out, limit: int = 50) -> int:
    """Checks each split's records (split name -> file pattern). Prints problems (at most ``limit``)
    then the counts to ``out``. Returns the number of problems."""
    import tensorflow as tf

    problems: list[str] = []

    def problem(text):
        problems.append(text)
        if len(problems) <= limit:
            print(f"problem: {text}", file=out, flush=True)

    stats = {}
    for split_name, value in splits.items():
        pattern = ",".join(records.patterns(value))
        s = stats[split_name] = SplitStats(pattern)
        files = records.match_files(pattern)
        s.files = len(files)
        if not files:
            problem(f"{split_name}: no file matches '{pattern}'; fix the path (relative to {os.getcwd()})")
            continue
        seen: dict[str, str] = {}
        progress = records.Progress(f"data check {split_name}", 0)
        for path in files:
            index = -1
            try:
                for index, data in enumerate(tf.data.TFRecordDataset(path).as_numpy_iterator()):
                    facts, found = check_record(data, num_classes, tf)
                    sid = facts.get("source_id", "")
                    where = f"{path}: record {index} (source_id {sid or '-'})"
                    for text in found:
                        problem(f"{where}: {text}")
                    if sid:
                        if sid in seen:
                            problem(
                                f"{where}: source_id {sid} also used by {seen[sid]}; give each image "
                                "its own id (COCO evaluation merges images with the same id)"
                            )
                        else:
                            seen[sid] = f"{os.path.basename(path)} record {index}"
                    s.images += 1
                    labels = facts.get("labels", [])
                    s.objects += len(labels)
                    s.crowd += sum(1 for c in facts.get("crowd", []) if c)
                    s.over_limit += len(labels) > MAX_INSTANCES
                    s.per_class.update(labels)
                    for c, t in zip(labels, facts.get("texts", [])):
                        s.names.setdefault(c, t)
                    progress.step()
            except tf.errors.OpError as e:
                problem(
                    f"{path}: record {index + 1}: unreadable ({e.__class__.__name__}: "
                    f"{str(e.message).splitlines()[0][:100]}); the file is truncated or not a "
                    "TFRecord: write it again"
                )
        if s.images == 0 and s.files:
            problem(f"{split_name}: '{pattern}' holds no records; convert your data again")
    if len(problems) > limit:
        print(f"problem: ... and {len(problems) - limit} more", file=out)
    _print_counts(stats, num_classes, out)
    word = "problem" if len(problems) == 1 else "problems"
    print(
        f"{len(problems)} {word}" if problems else "ok: every record decodes, boxes and ids are valid",
        file=out,
        flush=True,
    )
    return len(problems)


def _print_counts(stats: dict[str, SplitStats], num_classes: int | None, out) -> None:
    for name, s in stats.items():
        matching = "" if name == s.pattern else f" {s.files} file(s) matching '{s.pattern}',"
        print(
            f"{name}:{matching} {s.images} images, {s.objects} objects"
            f" ({s.crowd} is_crowd/difficult, ignored in training and scoring)",
            file=out,
        )
        if s.over_limit:
            print(
                f"  note: {s.over_limit} image(s) hold more than {MAX_INSTANCES} objects; Model Garden "
                "keeps the first 100 (task.train_data.parser.max_num_instances)",
                file=out,
            )
    ids = sorted(
        set().union(*(s.per_class for s in stats.values()))
        | (set(range(1, num_classes)) if num_classes else set())
    )
    if not ids:
        return
    names = {}
    for s in stats.values():
        for c, t in s.names.items():
            names.setdefault(c, t)
    width = max([len("class")] + [len(f"{c} {names.get(c, '')}") for c in ids])
    # A column per split, as wide as its name (a file's name when the splits are files).
    heads = [os.path.basename(n) if os.sep in n else n for n in stats]
    if len(set(heads)) < len(heads):
        heads = list(stats)
    cols = [max(7, len(h)) for h in heads]
    print(f"{'class':<{width}}  " + "  ".join(f"{h:>{w}}" for h, w in zip(heads, cols)), file=out)
    for c in ids:
        label = f"{c} {names.get(c, '')}".strip()
        counts = [f"{s.per_class.get(c, 0):>{w}}" for s, w in zip(stats.values(), cols)]
        print(f"{label:<{width}}  " + "  ".join(counts), file=out)
