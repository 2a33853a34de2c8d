"""`od-dist data odapi`: records in the Object Detection API's layout -> Model Garden's.

``generate_tfrecord.py`` (and the exports of many annotation tools) write the image's file name as
``image/source_id``; Model Garden's COCO evaluation turns the source id into an integer image id
(``tf.strings.to_number``) and fails on them. This rewrites the records once, as they are otherwise:
source ids numbered 1, 2, 3, ... (train, then validation: unique across both), the old source id
kept as ``image/filename`` when that is empty, and class ids taken as the Object Detection API takes
them: by name (``image/object/class/text``) through the label map when one is given, else
``class/label``. With a label map, a record naming a class the map does not have is refused (one
line each): the Object Detection API would drop that object, and its ``class/label`` kept as it
is would be an id beyond the label map's num_classes. ``difficult`` objects
become ``is_crowd`` (ignored in training and scoring), as ``od-dist data voc`` writes them.

Two passes: the first reads every record and collects every problem (nothing is written when there
is one); the second streams the records again into a staging folder renamed into place when
complete (``records.write_dataset``).
"""

from __future__ import annotations

from od_dist.data import records
from od_dist.data.errors import BadAnnotation, DatasetError

_TEXT = "image/object/class/text"
_LABEL = "image/object/class/label"


def _files(flag: str, pattern) -> list[str]:
    found = records.match_files(pattern)
    pattern = ",".join(records.patterns(pattern))
    if not found:
        raise DatasetError(
            f"--{flag}: '{pattern}': no file matches; pass the .record file(s) (a glob, quoted)"
        )
    return found


def _values(feature, kind: str) -> list:
    return list(getattr(feature, kind).value) if feature is not None else []


def class_ids(example, by_name: dict[str, int] | None) -> tuple[list[int], list[str], int, str | None]:
    """(ids, names, disagreements, problem) of one tf.train.Example's objects."""
    f = example.features.feature
    n = len(_values(f.get("image/object/bbox/xmin"), "float_list"))
    labels = _values(f.get(_LABEL), "int64_list")
    texts = [t.decode("utf-8", "replace") for t in _values(f.get(_TEXT), "bytes_list")]
    texts = texts if len(texts) == n else []
    labels = labels if len(labels) == n else []
    ids, disagree = [], 0
    if by_name is not None and texts:
        for i, name in enumerate(texts):
            if name not in by_name:
                # Its class/label would be an id the label map (and so num_classes) does not
                # have; the Object Detection API itself drops such an object without a word.
                label = f" (class/label {labels[i]})" if labels else ""
                return (
                    [],
                    texts,
                    0,
                    f"class '{name}'{label} is not in --labels; add it to the label map or fix the name",
                )
            ids.append(by_name[name])
            disagree += bool(labels) and labels[i] != by_name[name]
    elif labels:
        ids = labels
    elif n:
        if texts:
            return (
                [],
                texts,
                0,
                f"no {_LABEL}, only {_TEXT}; pass --labels label_map.pbtxt to number the classes",
            )
        return [], texts, 0, f"{n} boxes but no {_LABEL} nor {_TEXT}; the record names no classes"
    bad = [c for c in ids if c < 1]
    if bad:
        return [], texts, 0, f"class id {bad[0]}: ids start at 1 (0 is the background); fix the label map"
    return ids, texts, disagree, None


def _scan(splits: dict[str, list[str]], by_name: dict[str, int] | None, tf):
    """Pass 1: (items, item splits, problems, {id: name} of the ids seen, disagreements)."""
    items, item_splits, problems, seen, named, disagree = [], [], [], set(), {}, 0
    progress = records.Progress("data odapi: checking", 0)
    for split_name, paths in splits.items():
        for path in paths:
            index = -1
            try:
                for index, data in enumerate(tf.data.TFRecordDataset(path).as_numpy_iterator()):
                    progress.step()
                    where = f"{path}: record {index}"
                    try:
                        example = tf.train.Example.FromString(data)
                    except Exception:  # a protobuf DecodeError
                        problems.append(
                            f"{where}: not a tf.train.Example; write it with a detection converter"
                        )
                        continue
                    if not _values(example.features.feature.get("image/encoded"), "bytes_list"):
                        problems.append(f"{where}: no image/encoded; the record holds no image")
                        continue
                    ids, texts, n, problem = class_ids(example, by_name)
                    if problem:
                        problems.append(f"{where}: {problem}")
                        continue
                    disagree += n
                    for c, t in zip(ids, texts):
                        if by_name is None and named.setdefault(c, t) != t:
                            problems.append(
                                f"{where}: class id {c} is '{t}' here but '{named[c]}' elsewhere; pass "
                                "--labels label_map.pbtxt to number the classes by name"
                            )
                    seen.update(ids)
                    items.append((path, index))
                    item_splits.append(split_name)
            except tf.errors.OpError as e:
                problems.append(
                    f"{path}: record {index + 1}: unreadable ({e.__class__.__name__}); the file is "
                    "truncated or not a TFRecord"
                )
    progress.finish()
    return items, item_splits, problems, {c: named.get(c, f"class_{c}") for c in sorted(seen)}, disagree


def convert(train: str, val: str, out: str, labels_path: str | None):
    """Returns (records.Written, 0). Raises DatasetError, ProblemsReported."""
    import tensorflow as tf

    splits = {"train": _files("train", train), "val": _files("val", val)}
    names = records.read_labels(labels_path) if labels_path else None
    by_name = {n: i for i, n in names.items()} if names else None
    items, item_splits, problems, seen, disagree = _scan(splits, by_name, tf)
    if not items and not problems:
        raise DatasetError(
            f"--train/--val: '{train}', '{val}': no records in the files; pass the right files"
        )
    records.report_problems(problems, "data odapi", skip_bad=False, unit="record(s)")
    if disagree:
        print(
            f"od-dist data odapi: {disagree} object(s) had a class/label that disagrees with --labels "
            "for its class/text; the label map's id is written (as the Object Detection API reads them)",
            flush=True,
        )
    names = names or seen
    reader = {"path": None, "it": None, "next": 0}

    def record(path: str, index: int) -> bytes:
        if reader["path"] != path or reader["next"] > index:
            reader.update(path=path, it=tf.data.TFRecordDataset(path).as_numpy_iterator(), next=0)
        while True:  # items come in file order: this only steps forward
            data = next(reader["it"])
            reader["next"] += 1
            if reader["next"] - 1 == index:
                return data

    def make_example(item, source_id):
        example = tf.train.Example.FromString(record(*item))
        ids, texts, _, problem = class_ids(example, by_name)
        if problem:  # the file changed since the first pass
            raise BadAnnotation(f"{item[0]}: record {item[1]}: {problem}")
        f = example.features.feature
        old = _values(f.get("image/source_id"), "bytes_list")
        if not _values(f.get("image/filename"), "bytes_list") and old:
            f["image/filename"].bytes_list.value[:] = old[:1]
        f["image/source_id"].bytes_list.value[:] = [str(source_id).encode()]
        f[_LABEL].int64_list.value[:] = ids
        f[_TEXT].bytes_list.value[:] = [
            names.get(c, t).encode("utf-8") for c, t in zip(ids, texts or [""] * len(ids))
        ]
        crowd = _values(f.get("image/object/is_crowd"), "int64_list")
        difficult = _values(f.get("image/object/difficult"), "int64_list")
        if len(crowd) != len(ids):
            crowd = difficult if len(difficult) == len(ids) else [0] * len(ids)
            f["image/object/is_crowd"].int64_list.value[:] = crowd
        return example, len(ids), sum(1 for c in crowd if c)

    written = records.write_dataset(out, items, item_splits, make_example, names, "data odapi")
    return written, 0
