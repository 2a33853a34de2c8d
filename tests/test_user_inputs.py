"""A user's slips with paths: records that are not there, a model_dir that cannot be written, several
files after one flag. Each is one line naming the flag or key, the value and the fix, exit 2, before
anything is built or started."""

import os

import loopback
import pytest
from loopback import PIPELINE, od_dist, tiny

MISSING = "/nonexistent/od-dist-records/train-*.tfrecord"


def missing_records_line(key, pattern, cwd):
    return (
        f"od-dist: pipeline '{PIPELINE}': {key}: '{pattern}': matches no file on this machine (working "
        f"directory {cwd}); fix the path or copy the records here, then 'od-dist data check --pipeline "
        f"{PIPELINE}' reads every record"
    )


@pytest.mark.slow
def test_records_that_match_no_file_are_one_line_before_the_model_is_built(data_dir, tmp_path):
    """One machine's trainer, and `launch` of a cluster whose records are missing everywhere (its
    check runs before any task starts): one line each, exit 2, nothing trained."""
    override = tiny(data_dir) + f",task.train_data.input_path={MISSING}"
    r = od_dist("train", f"--pipeline={PIPELINE}", f"--model_dir={tmp_path / 'one'}", override, cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.splitlines() == [missing_records_line("task.train_data.input_path", MISSING, tmp_path)]
    assert "training with" not in r.stdout and not os.path.exists(tmp_path / "one" / "checkpoint")

    cluster = loopback.write_cluster(tmp_path, ps=1, workers=1)
    r = od_dist(
        "launch",
        f"--cluster={cluster}",
        f"--pipeline={PIPELINE}",
        f"--model_dir={tmp_path / 'job'}",
        override,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    line = missing_records_line("task.train_data.input_path", MISSING, loopback.ROOT)
    assert r.stderr.splitlines() == [f"od-dist launch: {line.removeprefix('od-dist: ')}"], r.stderr
    assert not os.path.exists(tmp_path / "job" / "logs"), "a task started"


@pytest.mark.slow
def test_validation_records_that_match_no_file_are_named_at_the_start(data_dir, tmp_path):
    """A typo in task.validation_data.input_path: `train` (which does not evaluate) says so in one
    warning line before training, trains and exits 0; `eval` (which does) refuses it in one line,
    exit 2."""
    missing = MISSING.replace("train-", "val-")
    override = tiny(data_dir, steps=5).replace(f"{data_dir}/val.tfrecord", missing)
    r = od_dist("train", f"--pipeline={PIPELINE}", f"--model_dir={tmp_path / 'run'}", override)
    assert r.returncode == 0, r.stdout + r.stderr
    line = missing_records_line("task.validation_data.input_path", missing, loopback.ROOT)
    warning = f"od-dist: warning: {line.removeprefix('od-dist: ')}; training goes on, evaluation would fail"
    lines = r.stdout.splitlines()
    assert warning in lines, r.stdout
    assert lines.index(warning) < next(i for i, ln in enumerate(lines) if "training with" in ln), r.stdout
    assert loopback.checkpoint_step(str(tmp_path / "run")) == 5
    r = od_dist("eval", f"--pipeline={PIPELINE}", f"--model_dir={tmp_path / 'run'}", override)
    assert r.returncode == 2 and r.stderr.splitlines() == [line], r.stdout + r.stderr


def test_an_input_size_the_model_cannot_take_is_one_line_with_the_sizes_that_work(data_dir, tmp_path):
    """The OD API's 300x300 or a 96 on the demo (levels 3-6): refused before the model is built, one
    line naming the key and the nearest sizes, rounded as `pipeline import` rounds them; exit 2."""
    from od_dist.model.pipeline import PipelineError, load_pipeline

    override = tiny(data_dir).replace("input_size=[64,64,3]", "input_size=[96,96,3]")
    r = od_dist("train", f"--pipeline={PIPELINE}", f"--model_dir={tmp_path / 'run'}", override)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.splitlines() == [
        f"od-dist: pipeline '{PIPELINE}' with params_override: task.model.input_size: '[96, 96, 3]': height "
        "and width must be multiples of 64 (2^task.model.max_level, the model's largest stride); the nearest "
        "that work: [64, 64, 3] or [128, 128, 3]"
    ], r.stderr
    assert "training with" not in r.stdout and not os.path.exists(tmp_path / "run" / "checkpoint")
    with pytest.raises(PipelineError) as e:
        load_pipeline(PIPELINE, "task.model.input_size=[300,40,3]")
    assert str(e.value).endswith("the nearest that work: [320, 64, 3]")  # no side of 0


@pytest.mark.parametrize(
    "model_dir, why",
    [
        ("/proc/od-dist-run", "'/proc' takes no new files (a virtual file system)"),
        ("/sys/od-dist/run", "permission denied: this user may not write in '/sys'"),
        # A long path is echoed whole (not cut like other values): the one to fix must be read.
        (
            "{tmp}/a-file-in-the-way-of-the-run/run",
            "'{tmp}/a-file-in-the-way-of-the-run' is a file, not a folder",
        ),
    ],
)
def test_a_model_dir_that_cannot_be_written_is_one_line_not_a_records_problem(tmp_path, model_dir, why):
    (tmp_path / "a-file-in-the-way-of-the-run").write_text("")
    model_dir, why = model_dir.format(tmp=tmp_path), why.format(tmp=tmp_path)
    if model_dir.startswith("/sys") and os.access("/sys", os.W_OK) and os.geteuid() != 0:
        pytest.skip("/sys is writable here")
    line = (
        f"--model_dir: '{model_dir}': cannot be created or written: {why}; pass a folder this user can "
        "write (on every machine whose task writes it)"
    )
    r = od_dist("train", f"--pipeline={PIPELINE}", f"--model_dir={model_dir}")
    assert r.returncode == 2 and r.stderr.splitlines() == ["od-dist train: invalid input:", f"  {line}"], (
        r.stdout + r.stderr
    )
    cluster = loopback.write_cluster(tmp_path, ps=1, workers=1)
    r = od_dist("launch", f"--cluster={cluster}", f"--pipeline={PIPELINE}", f"--model_dir={model_dir}")
    assert r.returncode == 2 and f"  {line}" in r.stderr.splitlines(), r.stdout + r.stderr
    # The ps serves without one: the same line for every role would stop a CPU-only ps machine.
    r = od_dist(
        "doctor", f"--cluster={cluster}", f"--model_dir={model_dir}", "--role=ps", "--connect_timeout=0.2"
    )
    assert "ok    model_dir: no task here writes it" in r.stdout, r.stdout
    r = od_dist(
        "doctor", f"--cluster={cluster}", f"--model_dir={model_dir}", "--role=master", "--connect_timeout=0.2"
    )
    assert r.returncode == 1
    assert (
        f"FIX   model_dir: {model_dir}: cannot be created or written: {why} (for master:0); pass a folder "
        "this user can write" in r.stdout
    ), r.stdout
    r = od_dist(
        "doctor",
        f"--cluster={cluster}",
        f"--model_dir={tmp_path / 'new' / 'run'}",
        "--role=master",
        "--connect_timeout=0.2",
    )
    assert f"ok    model_dir: {tmp_path / 'new' / 'run'}: writable here, for master:0" in r.stdout, r.stdout
    assert not os.path.exists(tmp_path / "new"), "doctor created the folder"


# ----- several files after one flag -------------------------------------------------------------


def run_cli(capsys, *args):
    from od_dist import cli

    code = cli.main(["od-dist", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "form",
    [
        lambda a, b: [a, b],  # what a shell makes of --annotations ann/photo_00*.xml
        lambda a, b: [f"{a},{b}"],
        lambda a, b: [os.path.join(os.path.dirname(a), "*" + os.path.splitext(a)[1])],
    ],
    ids=["expanded", "comma", "glob"],
)
def test_file_flags_take_several_paths_a_glob_or_a_comma_list(tmp_path, capsys, form):
    from labelimg import make_voc

    images, anns, _ = make_voc(str(tmp_path / "src"), count=2)
    picked = [os.path.join(anns, "photo_000.xml"), os.path.join(anns, "photo_001.xml")]
    out = tmp_path / "data"
    args = ["data", "voc", f"--images={images}", "--val_fraction=0.5", f"--out={out}", "--annotations"]
    code, stdout, err = run_cli(capsys, *args, *form(*picked))
    assert code == 0, err
    assert "wrote 1 train and 1 validation images" in stdout, stdout
    # `data check` and `data odapi` read their records flags the same way.
    shards = sorted(str(p) for p in out.glob("*.tfrecord"))
    code, stdout, err = run_cli(capsys, "data", "check", "--num_classes=4", "--records", *form(*shards))
    assert code == 0 and "unexpected" not in err, stdout + err
    # A training and a validation split: one line each, every file read.
    for shard in shards:
        split = shard.replace("-00000-of-00001", "-*")
        assert f"{split}: 1 file(s) matching '{shard}', 1 images" in stdout, stdout


def test_a_stray_argument_says_how_to_pass_several_files(capsys):
    code, _, err = run_cli(capsys, "data", "coco", "--images", "a", "b", "--annotations=c.json", "--out=o")
    assert code == 2 and err.splitlines() == [
        "od-dist data coco: unexpected argument 'b' after --images, which takes one value; flags are written "
        "--name=value; quote a path that holds spaces"
    ], err
    code, _, err = run_cli(capsys, "data", "voc", "--images", "i", "j.jpg", "--annotations=a", "--out=o")
    assert code == 2 and err.splitlines() == [
        "od-dist data voc: unexpected argument 'j.jpg' after --images, which takes one value; flags are "
        "written --name=value; several files go after --annotations: one after another, as a glob, or "
        "comma-separated"
    ], err
    code, _, err = run_cli(capsys, "data", "odapi", "--train", "a", "b", "--val=c", "--out", "o", "x")
    assert code == 2 and err.splitlines() == [
        "od-dist data odapi: unexpected argument 'x' after --out, which takes one value; flags are written "
        "--name=value; several files go after --train or --val: one after another, as a glob, or "
        "comma-separated"
    ], err


def test_a_refused_new_run_moves_no_checkpoint_aside(tmp_path):
    """`train --new_run` with a flag the checks refuse (here a pipeline that does not exist) exits 2
    and leaves the folder as it was: the checkpoints are set aside only once the command is accepted."""
    model_dir = tmp_path / "run"
    loopback.write_checkpoint(str(model_dir), 8)
    done = od_dist(
        "train", "--new_run", f"--model_dir={model_dir}", f"--pipeline={tmp_path / 'none.yaml'}", timeout=120
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--pipeline" in done.stderr and "no such file" in done.stderr, done.stderr
    assert loopback.checkpoint_step(str(model_dir)) == 8
    assert not [p for p in os.listdir(model_dir) if p.startswith("set-aside")], os.listdir(model_dir)
    assert "moved to" not in done.stdout
