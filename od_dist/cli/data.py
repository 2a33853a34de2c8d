"""`od-dist data ...`: write the demo dataset, convert VOC / COCO / Object Detection API data to
Model Garden's records, check records."""

from __future__ import annotations

import contextlib
import os
import sys

from absl import flags

from od_dist.cli.flags import SEVERAL, define_out, define_params_override, define_pipeline, require
from od_dist.cli.registry import UsageError, command
from od_dist.protocol import exit_codes

# --out of the commands that write records.
RECORDS_OUT = (
    "Output folder: train-*.tfrecord, val-*.tfrecord, label_map.pbtxt. "
    "Written under a temporary name and renamed when complete."
)


def define_shapes_flags(fv: flags.FlagValues) -> None:
    define_out(fv, "Output directory (the demo pipeline reads data/shapes).", "data/shapes")
    flags.DEFINE_integer("num_train", 2000, "Training images.", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("num_val", 200, "Validation images.", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("image_size", 128, "Image side in pixels.", lower_bound=32, flag_values=fv)
    flags.DEFINE_integer("seed", 0, "Random seed: the same seed writes the same records.", flag_values=fv)


@command(
    "data shapes",
    "Write the synthetic shapes detection dataset (train/val TFRecords, label map).",
    """
Writes coloured circles, squares and triangles with exact boxes as standard detection
tf.train.Example TFRecords (train and validation splits) plus label_map.pbtxt. Reproducible
from --seed. The default --out is where pipelines/shapes_retinanet.yaml reads.

Example:
  od-dist data shapes
""",
    define_shapes_flags,
)
def cmd_data_shapes(fv) -> int:
    from od_dist.data import shapes

    summary = shapes.write_dataset(
        fv.out, num_train=fv.num_train, num_val=fv.num_val, image_size=fv.image_size, seed=fv.seed
    )
    print(
        f"wrote {fv.num_train} train and {fv.num_val} validation images to {fv.out} "
        f"in {summary.get('seconds', 0):.1f} s",
        flush=True,
    )
    return exit_codes.OK


def define_convert_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("images", None, "The folder of images.", flag_values=fv)
    define_out(fv, RECORDS_OUT)
    flags.DEFINE_float(
        "val_fraction",
        0.1,
        "Share of the images held out for validation (a fixed-seed "
        "shuffle: the same files give the same split).",
        lower_bound=0.0,
        upper_bound=0.99,
        flag_values=fv,
    )
    flags.DEFINE_integer("seed", 0, "Seed of the train/val shuffle.", flag_values=fv)
    flags.DEFINE_boolean(
        "skip_bad",
        False,
        "Convert without the annotation files that have problems "
        "(and say how many) instead of stopping with exit 2.",
        flag_values=fv,
    )


def define_voc_flags(fv: flags.FlagValues) -> None:
    define_convert_flags(fv)
    flags.DEFINE_multi_string(
        "annotations",
        None,
        "The folder of Pascal VOC / labelImg .xml files (searched recursively), or .xml files. " + SEVERAL,
        flag_values=fv,
    )
    flags.DEFINE_string(
        "labels",
        None,
        "The classes, as an Object Detection API label_map.pbtxt or one "
        "name per line (ids from 1 in that order); any other class is an error. "
        "Default: every class found, sorted by name.",
        flag_values=fv,
    )


def _convert(what: str, run, unit: str = "annotation file(s)") -> int:
    from od_dist.data import errors, records

    try:
        written, skipped = run()
    except errors.DatasetError as e:
        raise UsageError(str(e)) from None
    except errors.ProblemsReported:
        return exit_codes.INVALID  # already printed, one line per problem
    except errors.BadAnnotation as e:  # found while writing (a file changed since it was checked)
        print(f"od-dist {what}: {e}; nothing written", file=sys.stderr)
        return exit_codes.INVALID
    records.print_summary(written, skipped, unit=unit)
    return exit_codes.OK


@command(
    "data voc",
    "Convert Pascal VOC / labelImg XML to TFRecords (train/val) and label_map.pbtxt.",
    """
Reads every .xml under --annotations (Pascal VOC, as labelImg saves it) and its image from
--images, checks each against its image (readable XML, image present, boxes inside, known classes),
and writes Model Garden detection records: sharded train-*.tfrecord and val-*.tfrecord (normalized
boxes, class ids from 1, numeric source ids) and label_map.pbtxt. VOC's 1-based pixel coordinates
are converted exactly; `difficult` objects are kept as is_crowd=1, which Model Garden leaves out of
training and COCO evaluation ignores. Any problem: one line per file and exit 2, nothing written
(or --skip_bad). Prints the num_classes and input paths a pipeline needs.

Example:
  od-dist data voc --images my_data/images --annotations my_data/annotations --out data/my_data
""",
    define_voc_flags,
    lists=("annotations",),
)
def cmd_data_voc(fv) -> int:
    from od_dist.data import voc

    require(fv, "images", "annotations", "out")
    return _convert(
        "data voc",
        lambda: voc.convert(
            fv.images, fv.annotations, fv.out, fv.val_fraction, fv.labels, fv.skip_bad, fv.seed
        ),
    )


def define_coco_flags(fv: flags.FlagValues) -> None:
    define_convert_flags(fv)
    flags.DEFINE_string(
        "annotations",
        None,
        "The COCO JSON (images, annotations with bbox [x, y, w, h] in pixels, categories).",
        flag_values=fv,
    )


@command(
    "data coco",
    "Convert COCO JSON to TFRecords (train/val) and label_map.pbtxt.",
    """
Reads the COCO detection JSON and its images (file_name relative to --images), checks every image
and box (image present and of the stated size, boxes inside and not empty, known category and
image ids) and writes the records with Model Garden's create_coco_tf_record: sharded
train-*.tfrecord and val-*.tfrecord, image and category ids kept as in the JSON, iscrowd kept
(ignored in training and scoring), plus label_map.pbtxt. Any problem: one line each and exit 2,
nothing written (or --skip_bad to leave those images out). Prints what a pipeline needs.

Example:
  od-dist data coco --images my_data/images --annotations my_data/instances.json --out data/my_data
""",
    define_coco_flags,
)
def cmd_data_coco(fv) -> int:
    from od_dist.data import coco

    require(fv, "images", "annotations", "out")
    return _convert(
        "data coco",
        lambda: coco.convert(fv.images, fv.annotations, fv.out, fv.val_fraction, fv.skip_bad, fv.seed),
        unit="image(s)",
    )


def define_odapi_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string(
        "config",
        None,
        "The Object Detection API pipeline.config whose train_input_reader / eval_input_reader "
        "input paths and label_map_path to read (instead of --train, --val, --labels).",
        flag_values=fv,
    )
    flags.DEFINE_multi_string("train", None, "The training records. " + SEVERAL, flag_values=fv)
    flags.DEFINE_multi_string("val", None, "The validation records, as --train.", flag_values=fv)
    flags.DEFINE_string(
        "labels",
        None,
        "The label_map.pbtxt: class ids by class name, as the Object Detection API reads them. "
        "Needed when records hold only class/text.",
        flag_values=fv,
    )
    define_out(fv, RECORDS_OUT)


@command(
    "data odapi",
    "Rewrite Object Detection API records (file names as source ids) for Model Garden.",
    """
Reads records written for the Object Detection API (generate_tfrecord.py and annotation tools'
exports: image/source_id holds the file name, class/text beside class/label) and writes them in
Model Garden's layout: source ids numbered 1, 2, 3, ... (COCO evaluation needs numbers), the file
name kept in image/filename, class ids by class name through --labels as the Object Detection API
takes them (a class the label map does not have is a problem), difficult objects as is_crowd.
Images and boxes are copied unchanged. Any problem: one line per record and exit 2, nothing written.

Examples:
  od-dist data odapi --config my_model/pipeline.config --out data/my_data
  od-dist data odapi --train annotations/train.record --val annotations/test.record \\
      --labels annotations/label_map.pbtxt --out data/my_data
""",
    define_odapi_flags,
    lists=("train", "val"),
)
def cmd_data_odapi(fv) -> int:
    from od_dist.data import odapi

    train, val, labels = fv.train, fv.val, fv.labels
    if fv.config:
        from od_dist.data import textproto
        from od_dist.model import odapi as config_import

        if not os.path.isfile(fv.config):
            raise UsageError(f"--config: '{fv.config}': no such file; pass the model's pipeline.config")
        with open(fv.config, encoding="utf-8", errors="replace") as f:
            try:
                found = config_import.input_paths(f.read())
            except textproto.TextFormatError as e:
                raise UsageError(f"--config: '{fv.config}': {e}") from None
        train, val, labels = train or found[0], val or found[1], labels or found[2]
    require(fv, "out")
    for name, value in (("train", train), ("val", val)):
        if not value:
            raise UsageError(
                f"--{name}: '': required; pass --{name}=FILE.record (or --config pipeline.config)"
            )
    with quiet_tensorflow_errors():  # TensorFlow reads and writes the records, on no device
        code = _convert("data odapi", lambda: odapi.convert(train, val, fv.out, labels), unit="record(s)")
    if code == exit_codes.OK:
        print(
            f"next: od-dist pipeline import --config {fv.config or 'pipeline.config'} --data {fv.out} "
            "--out pipelines/my_model.yaml",
            flush=True,
        )
    return code


def define_check_flags(fv: flags.FlagValues) -> None:
    define_pipeline(
        fv,
        "Check the train and validation records of this pipeline "
        "(task.train_data / task.validation_data input_path, task.model.num_classes).",
    )
    flags.DEFINE_multi_string("records", None, "Or check these records. " + SEVERAL, flag_values=fv)
    flags.DEFINE_integer(
        "num_classes",
        None,
        "With --records: the model's num_classes (largest class id + 1), to check the ids against.",
        lower_bound=2,
        flag_values=fv,
    )
    define_params_override(fv)


# The user's own TensorFlow C++ log level, read as od-dist starts (od_dist.cli imports this module
# before its run() sets its default).
_USERS_TF_LOG_LEVEL = os.environ.get("TF_CPP_MIN_LOG_LEVEL")


@contextlib.contextmanager
def quiet_tensorflow_errors():
    """For a command whose TensorFlow runs nothing on a device (`data check`): TensorFlow's C++ ERROR
    lines too, such as the `failed call to cuInit` of a machine without a GPU, which say nothing
    about its work. Around TensorFlow's import and the command's work; a user's own level wins,
    but for the device probe's line, which no level short of 3 hides and which is no error of the
    command's (console.DEVICE_PROBE). The environment is as it was after: a program that runs the
    command in its own process (cli.main) keeps its level for what it starts next."""
    from od_dist.host import console

    before = os.environ.get("TF_CPP_MIN_LOG_LEVEL")
    if _USERS_TF_LOG_LEVEL is None:
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    try:
        with console.without_lines(console.DEVICE_PROBE):
            yield
    finally:
        if before is None:
            os.environ.pop("TF_CPP_MIN_LOG_LEVEL", None)
        else:
            os.environ["TF_CPP_MIN_LOG_LEVEL"] = before


@command(
    "data check",
    "Read every record a pipeline would use; check images, boxes, ids; count per class.",
    """
Reads every record of the pipeline's training and validation data (or --records), decodes each
image with TensorFlow as training will, and checks: the stored size matches the image, boxes are
normalized, inside the image and not empty, class ids are in 1..num_classes-1, source ids are
numeric and unique within a split (--records: the files whose names differ only in a shard number,
e.g. val-00000-of-00004, are one split; each other file is its own). Each problem names the file,
the record index and source id. Then prints images and objects per split and per class. Exit 2
when any problem is found.

Examples:
  od-dist data check --pipeline pipelines/custom_retinanet.yaml
  od-dist data check --records 'data/my_data/val-*.tfrecord' --num_classes 4
""",
    define_check_flags,
    lists=("records",),
    rest="records",
)
def cmd_data_check(fv) -> int:
    if bool(fv.pipeline) == bool(fv.records):
        raise UsageError(
            "--pipeline/--records: pass exactly one: the pipeline whose data to check, or a records glob"
        )
    with quiet_tensorflow_errors():  # TensorFlow is imported below
        return _data_check(fv)


def _data_check(fv) -> int:
    if fv.pipeline:
        from od_dist.model.pipeline import PipelineError, load_pipeline

        try:
            params = load_pipeline(fv.pipeline, fv.params_override)
        except PipelineError as e:
            raise UsageError(str(e)) from None
        splits = {
            "train": params.task.train_data.input_path,
            "validation": params.task.validation_data.input_path,
        }
        num_classes = params.task.model.num_classes
    from od_dist.data import check

    if not fv.pipeline:
        splits, num_classes = check.splits_of(fv.records), fv.num_classes

    return exit_codes.INVALID if check.check(splits, num_classes, sys.stdout) else exit_codes.OK
