"""The trainer wrapper on one machine with real TensorFlow: train, resume, evaluate.

Tiny runs (a few steps on a few dozen images): they prove the wiring, not the accuracy;
benchmarks/demo_accuracy.py measures that."""

import glob
import json
import os
import re

import pytest
from loopback import PIPELINE as DEMO
from loopback import ROOT
from loopback import checkpoint_step as step_of

tf = pytest.importorskip("tensorflow")

from od_dist.job import trainer  # noqa: E402
from od_dist.model.pipeline import load_pipeline  # noqa: E402

pytestmark = pytest.mark.slow

PROGRESS = re.compile(
    r"^od-dist train \| step (\d+)/(\d+) \(\d+%\) \| loss ([\d.]+) \| "
    r"([\d.]+) steps/s \| ([\d.]+) examples/s \| ETA \S+$",
    re.M,
)


def params_for(data_dir, steps, extra=""):
    override = (
        f"trainer.train_steps={steps},trainer.steps_per_loop=5,"
        "trainer.summary_interval=5,trainer.checkpoint_interval=5,"
        f"task.train_data.input_path={data_dir}/train.tfrecord,"
        f"task.validation_data.input_path={data_dir}/val.tfrecord"
    )
    return load_pipeline(DEMO, override + extra, strategy="mirrored")


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    """A model_dir trained for 10 steps (two loops) under MirroredStrategy."""
    model_dir = str(tmp_path_factory.mktemp("run"))
    trainer.train(params_for(data_dir, 10), model_dir, tf.distribute.MirroredStrategy())
    return model_dir


def test_train_writes_checkpoints_params_summaries(data_dir, tmp_path, capsys):
    model_dir = str(tmp_path / "run")
    trainer.train(params_for(data_dir, 10), model_dir, tf.distribute.MirroredStrategy())
    out = capsys.readouterr().out
    lines = PROGRESS.findall(out)
    assert [(int(s), int(t)) for s, t, *_ in lines] == [(5, 10), (10, 10)], out[-2000:]
    for _, _, loss, rate, examples in lines:
        assert float(loss) > 0 and float(rate) > 0
        assert float(examples) == pytest.approx(8 * float(rate), rel=0.02, abs=0.1)
    assert step_of(model_dir) == 10
    assert os.path.exists(os.path.join(model_dir, "params.yaml"))
    assert glob.glob(os.path.join(model_dir, "train", "events.out.tfevents.*"))
    saved = load_pipeline(DEMO)  # params.yaml is Model Garden's own format
    from official.modeling import hyperparams

    hyperparams.override_params_dict(saved, os.path.join(model_dir, "params.yaml"), is_strict=True)
    assert saved.trainer.train_steps == 10


def test_resume_continues_from_the_latest_checkpoint(data_dir, trained, capsys):
    assert step_of(trained) == 10
    trainer.train(params_for(data_dir, 15), trained, tf.distribute.MirroredStrategy())
    out = capsys.readouterr().out
    assert (
        f"restored model from {trained}/ckpt-10" in out
        or f"restored from checkpoint: {trained}/ckpt-10" in out
    ), out[-2000:]
    # One loop of 5 steps, from 10 to 15: nothing trained twice.
    assert [int(s) for s, *_ in PROGRESS.findall(out)] == [15]
    assert step_of(trained) == 15
    # Already at train_steps: returns without training.
    trainer.train(params_for(data_dir, 15), trained, tf.distribute.MirroredStrategy())
    assert PROGRESS.findall(capsys.readouterr().out) == []


def test_evaluate_latest_returns_and_writes_coco_metrics(data_dir, trained, capsys):
    step = step_of(trained)
    metrics = trainer.evaluate_latest(params_for(data_dir, 15), trained)
    out = capsys.readouterr().out
    assert re.search(rf"^od-dist eval \| step {step} \| AP [-\d.]+ \| AP50 [-\d.]+", out, re.M), out[-2000:]
    assert metrics["step"] == step
    for key in ("AP", "AP50", "AP75", "ARmax100", "validation_loss"):
        assert isinstance(metrics[key], float)
    assert -1.0 <= metrics["AP"] <= 1.0 and -1.0 <= metrics["AP50"] <= 1.0
    with open(os.path.join(trained, "eval_metrics.json")) as f:
        assert json.load(f) == pytest.approx(metrics)
    assert os.path.exists(os.path.join(trained, "validation", f"metrics-{step}.json"))
    assert glob.glob(os.path.join(trained, "validation", "events.out.tfevents.*"))


def test_continuous_eval_returns_after_the_final_checkpoint(data_dir, trained):
    # The run is complete (train_steps reached): one evaluation, then return at once
    # rather than wait for the timeout.
    import time

    params = params_for(data_dir, step_of(trained))
    start = time.time()
    metrics = trainer.continuous_eval(params, trained, timeout_s=600)
    assert metrics["step"] == step_of(trained)
    assert time.time() - start < 300


def test_continuous_eval_times_out_without_checkpoints(data_dir, tmp_path):
    assert trainer.continuous_eval(params_for(data_dir, 10), str(tmp_path / "empty"), timeout_s=2) is None


def test_evaluate_latest_without_checkpoint_is_a_clear_error(data_dir, tmp_path):
    with pytest.raises(trainer.TrainerError, match="no checkpoint"):
        trainer.evaluate_latest(params_for(data_dir, 10), str(tmp_path))


def test_continuous_eval_follows_a_running_trainer(data_dir, tmp_path):
    """The evaluator sidecar (its own process) evaluates each checkpoint as the trainer
    writes it, and returns right after the final one."""
    import subprocess
    import sys

    model_dir = str(tmp_path / "run")
    os.makedirs(model_dir)
    override = (
        f"trainer.train_steps=10,trainer.steps_per_loop=5,trainer.summary_interval=5,"
        f"trainer.checkpoint_interval=5,task.train_data.input_path={data_dir}/train.tfrecord,"
        f"task.validation_data.input_path={data_dir}/val.tfrecord"
    )
    code = (
        "import json, sys\n"
        "from od_dist.job import trainer\n"
        "from od_dist.model.pipeline import load_pipeline\n"
        f"p = load_pipeline({DEMO!r}, {override!r}, 'mirrored')\n"
        f"m = trainer.continuous_eval(p, {model_dir!r}, timeout_s=240)\n"
        "print('RESULT ' + json.dumps(m))\n"
    )
    evaluator = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        trainer.train(params_for(data_dir, 10), model_dir, tf.distribute.MirroredStrategy())
        out, _ = evaluator.communicate(timeout=280)
    finally:
        if evaluator.poll() is None:
            evaluator.kill()
            evaluator.wait()
    assert evaluator.returncode == 0, out[-3000:]
    result = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    assert result["step"] == 10
    steps = [int(s) for s in re.findall(r"^od-dist eval \| step (\d+) \|", out, re.M)]
    assert steps[-1] == 10 and steps == sorted(set(steps)), out[-3000:]
    assert os.path.exists(os.path.join(model_dir, "validation", "metrics-10.json"))


def test_continuous_eval_waits_while_asked(tmp_path, data_dir):
    """With keep_waiting, an evaluator outlasts gaps between checkpoints while the master lives."""
    asked = []

    def keep_waiting():
        asked.append(1)
        return len(asked) < 3

    empty = str(tmp_path / "empty")
    assert (
        trainer.continuous_eval(params_for(data_dir, 10), empty, timeout_s=1, keep_waiting=keep_waiting)
        is None
    )
    assert len(asked) == 3
