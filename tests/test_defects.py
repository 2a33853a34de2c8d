"""Defects a new user meets: shipped pipelines that must train, checkpoints that must survive,
exit codes that must say what happened, inputs and outputs that must be what they claim."""

import glob
import os

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PIPELINES = sorted(glob.glob(os.path.join(ROOT, "pipelines", "*.yaml")))


@pytest.fixture(scope="module")
def shapes_dir(tmp_path_factory):
    from od_dist.data import shapes

    out = str(tmp_path_factory.mktemp("shapes"))
    shapes.write_dataset(out, num_train=8, num_val=4, seed=1)
    return out


def small_override(data_dir: str) -> str:
    """What turns any shipped pipeline into a one-step CPU run on the shapes data: 128x128 (a
    multiple of 2^7, the largest max_level shipped), batch 2, no downloaded weights, float32."""
    return yaml.safe_dump(
        {
            "runtime": {"mixed_precision_dtype": "float32"},
            "task": {
                "init_checkpoint": None,
                "annotation_file": None,
                "model": {"input_size": [128, 128, 3]},
                "train_data": {
                    "input_path": f"{data_dir}/train.tfrecord",
                    "global_batch_size": 2,
                    "shuffle_buffer_size": 8,
                },
                "validation_data": {"input_path": f"{data_dir}/val.tfrecord", "global_batch_size": 2},
            },
            "trainer": {
                "train_steps": 1,
                "steps_per_loop": 1,
                "summary_interval": 1,
                "checkpoint_interval": 1,
                "validation_interval": 1,
            },
        },
        default_flow_style=True,
    )


# ----- 1: every shipped pipeline trains --------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("path", PIPELINES, ids=[os.path.basename(p) for p in PIPELINES])
def test_every_shipped_pipeline_trains_one_step(path, shapes_dir, tmp_path):
    tf = pytest.importorskip("tensorflow")
    from od_dist.job import trainer
    from od_dist.model.pipeline import load_pipeline

    params = load_pipeline(path, small_override(shapes_dir), strategy="mirrored")
    model_dir = str(tmp_path / "run")
    # Eagerly: the build, the input pipeline, loss, gradients and a checkpoint are all exercised,
    # in a third of the time tracing the step takes.
    tf.config.run_functions_eagerly(True)
    try:
        assert trainer.train(params, model_dir, tf.distribute.MirroredStrategy(["/cpu:0"])) == 1
    finally:
        tf.config.run_functions_eagerly(False)
    assert tf.train.latest_checkpoint(model_dir).endswith("ckpt-1")


# ----- 2: a model that cannot be built is invalid input, found before any task starts -----------


def run_od_dist(*args, cwd=ROOT, timeout=600, env=None):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "od_dist", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, **(env or {})),
    )


@pytest.fixture(scope="module")
def unbuildable(tmp_path_factory):
    """The template as it shipped before: a MobileNetV2 backbone straight into the head."""
    with open(os.path.join(ROOT, "pipelines", "custom_retinanet.yaml"), encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    del doc["task"]["model"]["decoder"], doc["task"]["model"]["head"]
    path = tmp_path_factory.mktemp("unbuildable") / "no_decoder.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def assert_model_problem(r, path):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stdout[-1500:] + r.stderr[-1500:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    line = lines[-1]
    assert f"pipeline '{path}': the model cannot be built" in line, r.stderr[-2000:]
    assert "classnet-conv_0" in line and "check task.model.decoder" in line, line


@pytest.mark.slow
def test_train_refuses_a_model_that_cannot_be_built(unbuildable, shapes_dir, tmp_path):
    model_dir = tmp_path / "run"
    r = run_od_dist(
        "train",
        f"--pipeline={unbuildable}",
        f"--model_dir={model_dir}",
        f"--params_override={small_override(shapes_dir)}",
    )
    assert_model_problem(r, unbuildable)
    assert not glob.glob(str(model_dir / "ckpt-*"))


@pytest.mark.slow
def test_launch_refuses_a_model_that_cannot_be_built_before_any_task_starts(
    unbuildable, shapes_dir, tmp_path
):
    model_dir = tmp_path / "run"
    r = run_od_dist(
        "launch",
        "--cluster=clusters/local.yaml",
        f"--pipeline={unbuildable}",
        f"--model_dir={model_dir}",
        f"--params_override={small_override(shapes_dir)}",
    )
    assert r.returncode == 2, r.stdout[-1500:] + r.stderr[-1500:]
    assert r.stderr.strip().startswith("od-dist launch: ") and len(r.stderr.strip().splitlines()) == 1, (
        r.stderr
    )
    assert_model_problem(r, unbuildable)
    assert not (model_dir / "logs").exists()  # no task was started


# ----- 5: without a readable checkpoint state, complete checkpoints stay -------------------------


@pytest.mark.parametrize("state", ["missing", "unreadable"])
def test_clean_keeps_complete_checkpoints_without_a_readable_state(tmp_path, state):
    tf = pytest.importorskip("tensorflow")
    from od_dist.job import trainer

    model_dir = tmp_path / "run"
    ckpt = tf.train.Checkpoint(v=tf.Variable(1.0))
    manager = tf.train.CheckpointManager(ckpt, str(model_dir), max_to_keep=5)
    manager.save(checkpoint_number=5)
    manager.save(checkpoint_number=10)
    # What a save killed midway leaves, beside them.
    (model_dir / "ckpt-15_temp").mkdir()
    (model_dir / "ckpt-15_temp" / "part-00000-of-00001.data-00000-of-00001.tempstate8411").write_bytes(b"x")
    (model_dir / "checkpoint.tempstate2207").write_text("")
    if state == "missing":  # ckpt-* files copied into a new model_dir to resume from
        (model_dir / "checkpoint").unlink()
    else:  # a network share's transient error, a torn write
        (model_dir / "checkpoint").write_bytes(b"\xff\x00 not a checkpoint state {")
    removed = sorted(os.path.basename(p) for p in trainer.clean_partial_checkpoints(str(model_dir)))
    assert removed == ["checkpoint.tempstate2207", "ckpt-15_temp"]
    left = sorted(os.listdir(model_dir))
    for step in (5, 10):
        assert f"ckpt-{step}.index" in left and f"ckpt-{step}.data-00000-of-00001" in left, left
    tf.train.Checkpoint(v=tf.Variable(0.0)).restore(str(model_dir / "ckpt-10")).assert_consumed()
