"""The trainer wrapper on one machine with real TensorFlow: train, resume, evaluate.

Tiny runs (a few steps on a few dozen images): they prove the wiring, not the accuracy;
benchmarks/demo_accuracy.py measures that."""

import contextlib
import glob
import io
import json
import os
import re
import subprocess
import sys
import typing

import pytest
import tensorflow as tf
from loopback import PIPELINE as DEMO
from loopback import ROOT, SMALL
from loopback import checkpoint_step as step_of

from od_dist.model.pipeline import load_pipeline
from od_dist.task import phases, trainer

pytestmark = pytest.mark.slow

PROGRESS = re.compile(
    r"^od-dist train \| step (\d+)/(\d+) \(\d+%\) \| loss ([\d.]+) \| "
    r"([\d.]+) steps/s \| ([\d.]+) examples/s \| ETA \S+$",
    re.M,
)


def override_for(data_dir, steps):
    return (
        f"trainer.train_steps={steps},trainer.steps_per_loop=5,"
        "trainer.summary_interval=5,trainer.checkpoint_interval=5,"
        f"task.train_data.input_path={data_dir}/train.tfrecord,"
        f"task.validation_data.input_path={data_dir}/val.tfrecord,{SMALL}"
    )


def params_for(data_dir, steps, extra=""):
    return load_pipeline(DEMO, override_for(data_dir, steps) + extra, strategy="mirrored")


# The evaluator sidecar: continuous_eval in its own process, following the trainer's checkpoints.
FOLLOWER = """
import json, sys
from od_dist.task import phases, trainer
from od_dist.model.pipeline import load_pipeline
p = load_pipeline(sys.argv[1], sys.argv[2], "mirrored")
m = trainer.continuous_eval(p, sys.argv[3], timeout_s=240)
print("RESULT " + json.dumps(m))
"""


@pytest.fixture(scope="module")
def first_run(data_dir, tmp_path_factory):
    """One run for the module: 10 steps (two loops) under MirroredStrategy, an evaluator process
    following it. Returns the model_dir, the trainer's output, its step when it returned, and the
    evaluator's exit status and output."""
    model_dir = str(tmp_path_factory.mktemp("run"))
    evaluator = subprocess.Popen(
        [sys.executable, "-c", FOLLOWER, DEMO, override_for(data_dir, 10), model_dir],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            trainer.train(params_for(data_dir, 10), model_dir, tf.distribute.MirroredStrategy())
        step = step_of(model_dir)
        evaluated, _ = evaluator.communicate(timeout=280)
    finally:
        if evaluator.poll() is None:
            evaluator.kill()
            evaluator.wait()
    return Run(model_dir, out.getvalue(), step, evaluator.returncode, evaluated)


class Run(typing.NamedTuple):
    model_dir: str
    out: str
    step: int
    eval_code: int
    eval_out: str


@pytest.fixture(scope="module")
def trained(first_run):
    """The first run's model_dir (the tests below train it further)."""
    return first_run.model_dir


def test_train_writes_checkpoints_params_summaries(first_run):
    model_dir, out = first_run.model_dir, first_run.out
    lines = PROGRESS.findall(out)
    # The first loop of a start is one step (its line: training runs), the next ends on the grid.
    assert [(int(s), int(t)) for s, t, *_ in lines] == [(1, 10), (5, 10), (10, 10)], out[-2000:]
    assert re.search(r"step 1/10 .*\| ETA \?$", out, re.M), out[-2000:]  # its rate holds the trace
    # Saved where they were before the one-step loop: at 5 and 10, none at 1.
    saved = sorted(int(p.rsplit("-", 1)[1][: -len(".index")]) for p in glob.glob(f"{model_dir}/ckpt-*.index"))
    assert saved == [5, 10], saved
    for _, _, loss, rate, examples in lines:
        assert float(loss) > 0 and float(rate) > 0
        assert float(examples) == pytest.approx(2 * float(rate), rel=0.02, abs=0.1)  # batch 2
    assert first_run.step == 10
    # The start-up's phases, in order, each once (benchmarks/startup.py reads them): the first
    # loop's before its progress line.
    said = [m["phase"] for m in phases.LINE.finditer(out)]
    assert said == ["model built", "resumed at step 0", "first loop"], out[-2000:]
    assert out.index("first loop") < out.index("step 5/10")
    assert os.path.exists(os.path.join(model_dir, "params.yaml"))
    assert glob.glob(os.path.join(model_dir, "train", "events.out.tfevents.*"))
    saved = load_pipeline(DEMO)  # params.yaml is Model Garden's own format
    from official.modeling import hyperparams

    hyperparams.override_params_dict(saved, os.path.join(model_dir, "params.yaml"), is_strict=True)
    assert saved.trainer.train_steps == 10


def test_continuous_eval_follows_a_running_trainer(first_run):
    """The evaluator sidecar (its own process) evaluates each checkpoint as the trainer
    writes it, and returns right after the final one."""
    out = first_run.eval_out
    assert first_run.eval_code == 0, out[-3000:]
    result = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    assert result["step"] == 10
    steps = [int(s) for s in re.findall(r"^od-dist eval \| step (\d+) \|", out, re.M)]
    assert steps[-1] == 10 and steps == sorted(set(steps)), out[-3000:]
    assert os.path.exists(os.path.join(first_run.model_dir, "validation", "metrics-10.json"))


def test_resume_continues_from_the_latest_checkpoint(data_dir, trained, capsys, monkeypatch):
    from orbit.utils import loop_fns

    # How often tf.function traces the train step inside the loop: once. The optimizer's slots,
    # made in the first step, forced a second trace (about 5 s of CPU at every start).
    traces = []

    def counting_loop(step_fn, make=loop_fns.create_tf_while_loop_fn):
        return make(lambda iterator: (traces.append(1), step_fn(iterator))[1])

    monkeypatch.setattr(loop_fns, "create_tf_while_loop_fn", counting_loop)
    assert step_of(trained) == 10
    trainer.train(params_for(data_dir, 15), trained, tf.distribute.MirroredStrategy())
    assert len(traces) == 1
    out = capsys.readouterr().out
    assert (
        f"restored model from {trained}/ckpt-10" in out
        or f"restored from checkpoint: {trained}/ckpt-10" in out
    ), out[-2000:]
    # From 10 to 15, a step then the rest of the loop: nothing trained twice.
    assert [int(s) for s, *_ in PROGRESS.findall(out)] == [11, 15]
    assert step_of(trained) == 15
    # Already at train_steps: returns without training.
    trainer.train(params_for(data_dir, 15), trained, tf.distribute.MirroredStrategy())
    assert PROGRESS.findall(capsys.readouterr().out) == []
    # The named newest cut short (a power loss during its save): resumed from the whole one before.
    with open(os.path.join(trained, "ckpt-15.index"), "r+b") as f:
        f.truncate(20)
    trainer.train(params_for(data_dir, 20), trained, tf.distribute.MirroredStrategy())
    out = capsys.readouterr().out
    assert (
        f"{trained}/ckpt-15 is not whole on disk (a save cut short); resuming from {trained}/ckpt-10" in out
    )
    assert [int(s) for s, *_ in PROGRESS.findall(out)] == [11, 15, 20] and step_of(trained) == 20, out[-2000:]


def test_evaluate_latest_returns_and_writes_coco_metrics(data_dir, trained, capsys):
    step = step_of(trained)
    metrics = trainer.evaluate_latest(params_for(data_dir, 15), trained)
    out = capsys.readouterr().out
    assert re.search(rf"^od-dist eval \| step {step} \| AP [-\d.]+ \| AP50 [-\d.]+", out, re.M), out[-2000:]
    assert [line for line in out.splitlines() if "restored" in line] == [
        f"restored from checkpoint: {trained}/ckpt-{step}"
    ], out[-2000:]
    assert metrics["step"] == step
    for key in ("AP", "AP50", "AP75", "ARmax100", "validation_loss"):
        assert isinstance(metrics[key], float)
    # COCO's -1 means no ground truth reached the evaluation; AP (over IoU 0.5 to 0.95) and AP75
    # are at most AP50, every recall and AP within [0, 1].
    assert 0.0 <= metrics["AP"] <= metrics["AP50"] <= 1.0, metrics
    assert 0.0 <= metrics["AP75"] <= metrics["AP50"] and 0.0 <= metrics["ARmax100"] <= 1.0, metrics
    assert metrics["validation_loss"] > 0, metrics
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


def test_the_input_pipeline_is_not_rewritten_by_autograph_and_reads_the_same(data_dir, monkeypatch):
    """The task od-dist trains with builds its datasets without autograph converting Model
    Garden's parser (about 150 functions, seconds of CPU at every start), and the held-out batches
    are the same as those of Model Garden's own task, whose parser autograph converts."""
    from official.core import task_factory
    from tensorflow.python.autograph.impl import api

    params = params_for(data_dir, 5)
    config = params.task.validation_data
    converted = []
    convert = api._convert_actual
    monkeypatch.setattr(api, "_convert_actual", lambda f, ctx: converted.append(f) or convert(f, ctx))
    ours = list(trainer.make_task(params).build_inputs(config).take(2))
    assert converted == []
    theirs = list(task_factory.get_task(params.task).build_inputs(config).take(2))
    assert converted, "Model Garden's own task no longer converts its parser: this test proves nothing"
    for a, b in zip(tf.nest.flatten(ours), tf.nest.flatten(theirs), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and bool(tf.reduce_all(a == b)), (a, b)


def test_each_replica_reads_its_share_of_the_batch_from_its_shard(data_dir):
    """The datasets as Orbit builds them for 2 replicas on 2 trainers: its
    make_distributed_dataset passes `input_context` only to a function whose own arguments name
    it, so each trainer must get its share of the global batch (2 of 4 images) and records of its
    own, with or without --data_threads. (Hidden by a wrapper, each read the whole batch, unsharded.)"""
    import orbit

    class Strategy:  # hands back the dataset function Orbit made, to call as each trainer does
        def distribute_datasets_from_function(self, dataset_fn, options=None):
            return dataset_fn

    params = params_for(data_dir, 5)
    config = params.task.validation_data  # not shuffled: the shards can be compared
    config.global_batch_size = 4
    for data_threads in (0, 1):
        task = trainer.make_task(params, data_threads=data_threads)
        dataset_fn = orbit.utils.make_distributed_dataset(Strategy(), task.build_inputs, config)
        ids = []
        for pipeline in (0, 1):
            context = tf.distribute.InputContext(2, pipeline, 2)
            images, labels = next(iter(dataset_fn(context)))
            assert images.shape[0] == 2, (data_threads, images.shape)
            ids.append(set(labels["groundtruths"]["source_id"].numpy().tolist()))
        assert not ids[0] & ids[1], ids


def test_a_worker_resumed_from_the_masters_checkpoint_saves_when_the_master_does(tmp_path):
    """A multi_worker_mirrored worker's checkpoint manager writes to a folder of its own (Model
    Garden's) and restores from model_dir: it must count its next save from the step it restored,
    as the master's does. Saving is collective; a worker that saved at the first loop boundary after
    a resume at step 125 (the master: at 175) failed the job with a collective "Shape mismatch"."""
    import orbit

    class Steps(orbit.AbstractTrainer):
        model = tf.Module()

        def train(self, num_steps):
            step.assign_add(int(num_steps))

    model_dir = str(tmp_path / "model")
    step = tf.Variable(125, dtype=tf.int64)
    checkpoint = tf.train.Checkpoint(step=step)
    tf.train.CheckpointManager(checkpoint, model_dir, max_to_keep=2).save(checkpoint_number=125)
    step.assign(0)
    savers = {}
    for who, folder in (("worker", str(tmp_path / "worker-own")), ("master", model_dir)):
        manager = tf.train.CheckpointManager(
            checkpoint, folder, max_to_keep=2, step_counter=step, checkpoint_interval=50
        )
        controller = trainer._controller_cls()(
            trainer=Steps(),
            global_step=step,
            steps_per_loop=25,
            checkpoint_manager=manager,
            od_model_dir=model_dir,
            od_batch_size=1,
            od_train_steps=200,
        )
        assert int(step.numpy()) == 125, who  # both resumed from the master's checkpoint
        controller.train(200)
        savers[who] = sorted(int(p.rsplit("-", 1)[1]) for p in manager.checkpoints)
        step.assign(0)
    assert savers["worker"] == savers["master"] == [175, 200]


# The closure error TensorFlow's coordinator raised in a parameter_server round (a per-worker
# iterator a step's abort cancelled: tests/test_multihost.py's healed master, once in a while).
ENDED = (
    "Graph execution error:\n\nEnd of sequence\n\t [[{{node cond/IteratorGetNext}}]]\n"
    "Additional GRPC error information from remote target /job:worker/replica:0/task:0 while calling "
    "/tensorflow.eager.EagerService/Enqueue"
)


def _spread_trainer(step):
    t = object.__new__(trainer._spread_trainer_cls())
    t._is_async = True
    t._global_step = tf.Variable(step, dtype=tf.int64)
    t._train_iter = "the cancelled iterators"
    return t


def test_a_loop_ending_on_a_cancelled_input_iterator_goes_on_with_new_iterators(monkeypatch, capsys):
    import orbit

    t = _spread_trainer(225)
    calls = []

    def train(self, num_steps):
        calls.append((int(num_steps), self._train_iter))
        if len(calls) == 1:
            self._global_step.assign_add(3)  # the closures that finished before the error
            raise tf.errors.OutOfRangeError(None, None, ENDED)
        self._global_step.assign_add(int(num_steps))
        return {"training_loss": 1.0}

    monkeypatch.setattr(orbit.StandardTrainer, "train", train)
    assert t.train(tf.constant(5, tf.int32)) == {"training_loss": 1.0}
    # Again with new iterators (orbit makes them when it holds none), for the steps not done.
    assert calls == [(5, "the cancelled iterators"), (2, None)]
    assert int(t.global_step.numpy()) == 230
    out = capsys.readouterr().out
    assert "the input iterator on /job:worker/replica:0/task:0 ended" in out, out
    assert "goes on from step 228 (3 of its 5 steps done)" in out, out


def test_an_input_that_keeps_ending_or_another_out_of_range_still_fails(monkeypatch):
    import orbit

    raised = []

    def train(self, num_steps):
        raised.append(int(num_steps))
        raise tf.errors.OutOfRangeError(
            None, None, ENDED if self._od_ends else "Read less bytes than requested"
        )

    monkeypatch.setattr(orbit.StandardTrainer, "train", train)
    t = _spread_trainer(0)
    t._od_ends = True
    with pytest.raises(tf.errors.OutOfRangeError, match="End of sequence"):
        t.train(tf.constant(5, tf.int32))
    assert raised == [5, 5, 5]  # a dataset that truly ends: twice again, then the error as before
    raised.clear()
    t._od_ends = False
    with pytest.raises(tf.errors.OutOfRangeError, match="Read less bytes"):
        t.train(tf.constant(5, tf.int32))
    assert raised == [5]


def _metrics(ran=0.0, closures=0, fetched=0.0, inflight=0, queued=0):
    return {
        "closure_execution": (ran, closures),
        "remote_value_fetch": (fetched, closures),
        "inflight_closures": inflight,
        "queued_closures": queued,
    }


def test_the_workers_occupancy_is_read_from_the_coordinators_figures_after_the_first_loop(monkeypatch):
    clock = iter([0.0, 10.0, 10.0, 12.0, 12.0, 14.0, 14.0, 15.0])
    monkeypatch.setattr(trainer.time, "monotonic", lambda: next(clock))
    occupancy = trainer.Occupancy(2)
    assert occupancy.report() is None  # no loop yet
    for steps, before, at_join, after in (
        (1, _metrics(), _metrics(inflight=1), _metrics(9.0, 1, 0.5)),  # the first loop: tracing
        (4, _metrics(9.0, 1, 0.5), _metrics(9.0, 1, 0.5, 2), _metrics(12.0, 3, 0.7)),
        (4, _metrics(12.0, 3, 0.7), _metrics(12.0, 3, 0.7, 1, 1), _metrics(15.0, 5, 0.9)),
        # the last loop, cut short by train_steps: one closure, for one of the two workers
        (1, _metrics(15.0, 5, 0.9), _metrics(15.0, 5, 0.9, 1), _metrics(15.5, 6, 1.0)),
    ):
        occupancy.scheduling(steps, before)
        occupancy.joining(at_join)
        occupancy.joined(after)
    said = occupancy.report()
    # The three loops after the first: 9 steps, 5 closures, 6.5 s of closures over 2 x 5 s of wall.
    assert said.startswith(
        "parameter_server, the 3 loop(s) after the first: 9 steps in 5 closures on 2 workers, "
    ), said
    assert "0.722 s a step on a worker, the workers busy 65% of the loops' 5.0 s" in said, said
    assert (
        "results fetched in 0.100 s a closure; at each join at least 2 closure(s) in flight or queued" in said
    )
    assert said.endswith("queued"), said  # the short last loop is no sign of too short loops


def test_a_loop_of_fewer_steps_than_workers_is_said_to_leave_a_worker_idle(monkeypatch):
    clock = iter([0.0, 1.0, 1.0, 2.0])
    monkeypatch.setattr(trainer.time, "monotonic", lambda: next(clock))
    occupancy = trainer.Occupancy(3)
    for ran in (0.0, 0.5):
        occupancy.scheduling(1, _metrics(ran, int(ran * 2)))
        occupancy.joining(_metrics(ran, int(ran * 2), inflight=1))
        occupancy.joined(_metrics(ran + 0.5, int(ran * 2) + 1))
    said = occupancy.report()
    assert (
        "at each join at least 1 closure(s) in flight or queued; every loop had fewer steps than the 3 workers: "
        in said
    )
    assert said.endswith("raise trainer.steps_per_loop to at least 3 so that every worker trains"), said
    assert "the workers busy 17%" in said, said  # 0.5 s of closures over 3 workers x 1 s
