"""Defects a new user meets: shipped pipelines that must train, checkpoints that must survive,
exit codes that must say what happened, inputs and outputs that must be what they claim."""

import glob
import os
import time

import labelimg
import pytest
import yaml
from loopback import ROOT, od_dist

PIPELINES = sorted(glob.glob(os.path.join(ROOT, "pipelines", "*.yaml")))


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
            },
        },
        default_flow_style=True,
    )


# ----- 1: every shipped pipeline trains --------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("path", PIPELINES, ids=[os.path.basename(p) for p in PIPELINES])
def test_every_shipped_pipeline_trains_one_step(path, data_dir, tmp_path):
    import tensorflow as tf

    from od_dist.model.pipeline import load_pipeline
    from od_dist.task import trainer

    params = load_pipeline(path, small_override(data_dir), strategy="mirrored")
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
def test_train_refuses_a_model_that_cannot_be_built(unbuildable, data_dir, tmp_path):
    model_dir = tmp_path / "run"
    r = od_dist(
        "train",
        f"--pipeline={unbuildable}",
        f"--model_dir={model_dir}",
        f"--params_override={small_override(data_dir)}",
        timeout=600,
    )
    assert_model_problem(r, unbuildable)
    assert not glob.glob(str(model_dir / "ckpt-*"))


@pytest.mark.slow
def test_launch_refuses_a_model_that_cannot_be_built_before_any_task_starts(unbuildable, data_dir, tmp_path):
    model_dir = tmp_path / "run"
    r = od_dist(
        "launch",
        "--cluster=clusters/local.yaml",
        f"--pipeline={unbuildable}",
        f"--model_dir={model_dir}",
        f"--params_override={small_override(data_dir)}",
        timeout=600,
    )
    assert r.returncode == 2, r.stdout[-1500:] + r.stderr[-1500:]
    assert r.stderr.strip().startswith("od-dist launch: ") and len(r.stderr.strip().splitlines()) == 1, (
        r.stderr
    )
    assert_model_problem(r, unbuildable)
    assert not (model_dir / "logs").exists()  # no task was started


# Every Python process of the run: building the RetinaNet runs out of memory, as on a small GPU.
OUT_OF_MEMORY = """
import importlib.abc, sys

class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "official.vision.modeling.factory":
            return None
        spec = next(s for f in sys.meta_path if f is not self for s in [f.find_spec(name, path, target)] if s)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)

            def build_retinanet(*args, **kwargs):
                import tensorflow as tf
                raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor with shape[2,64,64,256]")

            module.build_retinanet = build_retinanet

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _Hook())
"""


@pytest.mark.slow
def test_out_of_memory_building_the_model_is_no_invalid_pipeline(data_dir, tmp_path):
    """Only what a pipeline can get wrong is exit 2 (permanent, FailJobSet on Kubernetes): an
    out-of-memory, CUDA or library error while building a good pipeline's model is exit 1."""
    from loopback import site_hook

    pipeline = os.path.join(ROOT, "pipelines", "shapes_retinanet.yaml")
    r = od_dist(
        "launch",
        "--cluster=clusters/local.yaml",
        f"--pipeline={pipeline}",
        f"--model_dir={tmp_path / 'run'}",
        f"--params_override={small_override(data_dir)}",
        env={"PYTHONPATH": os.pathsep.join([site_hook(tmp_path, OUT_OF_MEMORY), ROOT])},
        timeout=600,
    )
    assert r.returncode == 1, r.stdout[-1500:] + r.stderr[-1500:]
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("od-dist launch: could not check the pipeline (exit 1): ") and "OOM" in line, line
    assert "cannot be built" not in line
    assert not (tmp_path / "run" / "logs").exists()  # no task was started


@pytest.mark.slow
def test_an_evaluator_whose_job_never_started_says_so(data_dir, tmp_path):
    """`train --role evaluator`, as a Kubernetes pod without a budget runs it (under its own
    supervisor all the same, as every generated script's `--max_restarts N`: test_supervisor.py
    has the restarts), and no master ever comes: exit 138 (the job did not start, a later try may
    find it), once, never "training finished" and never a permanent failure of its own."""
    from loopback import tiny, write_cluster

    cluster = write_cluster(tmp_path, workers=1, evaluator=True)
    r = od_dist(
        "train",
        f"--cluster={cluster}",
        "--role=evaluator",
        f"--pipeline={os.path.join(ROOT, 'pipelines', 'shapes_retinanet.yaml')}",
        f"--model_dir={tmp_path / 'run'}",
        tiny(data_dir),
        "--wait_timeout=3",
        timeout=300,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 138, out[-3000:]
    assert "the job did not start" in out and "training finished" not in out, out[-3000:]
    assert out.count("never came within --wait_timeout (3 s)") == 1, out[-3000:]  # not restarted


def _evaluators_first_word(data_dir, tmp_path, master_up: bool) -> tuple[str, str]:
    """An evaluator of a two-trainer file without checkpoint_port, its --model_dir empty, its master's
    port listening (`master_up`) or not: (its line saying no checkpoint came, the master's address).
    Read until that line, at most 120 s."""
    import socket
    import subprocess
    import sys
    import threading

    from loopback import tiny, write_cluster

    cluster = write_cluster(tmp_path, ps=0, workers=1, strategy="multi_worker_mirrored", evaluator=True)
    master = next(ln.split()[1] for ln in open(cluster) if ln.startswith("master:"))
    listener = socket.create_server(("127.0.0.1", int(master.rsplit(":", 1)[1]))) if master_up else None
    args = [f"--cluster={cluster}", "--role=evaluator", f"--model_dir={tmp_path / 'run'}", "--wait_timeout=4"]
    args += [f"--pipeline={os.path.join(ROOT, 'pipelines', 'shapes_retinanet.yaml')}", tiny(data_dir)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "od_dist", "train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    seen = []
    deadline = threading.Timer(120, proc.kill)  # silence: the output ends there
    deadline.start()
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("evaluator: no checkpoint in"):
                break
    finally:
        deadline.cancel()
        proc.kill()
        proc.wait()
        if listener is not None:
            listener.close()
    assert seen and seen[-1].startswith(f"evaluator: no checkpoint in {tmp_path / 'run'} after "), "".join(
        seen
    )[-3000:]
    return seen[-1], master


@pytest.mark.slow
def test_an_evaluator_that_gets_no_checkpoint_says_who_writes_them(data_dir, tmp_path):
    """An evaluator whose master is up (here a port that listens) but whose --model_dir gets no
    checkpoint, in a file without checkpoint_port: at its first poll (--wait_timeout, at most 30 s)
    one line names who writes the checkpoints and what brings them here, rather than silence."""
    said, master = _evaluators_first_word(data_dir, tmp_path, master_up=True)
    assert said.split(" s; ", 1)[1].rstrip() == (
        f"master:0 at {master} writes them into its --model_dir on its machine: unless that is this "
        "folder (one machine, or a shared folder), give the cluster file a checkpoint_port (it then "
        "serves them here)"
    )


# ----- 5: a complete checkpoint is never deleted; only leftovers of unfinished saves are ------------


def saved_steps(model_dir, *steps):
    """Checkpoints as Model Garden's CheckpointManager writes them, each holding its step."""
    import tensorflow as tf

    v = tf.Variable(0.0)
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(v=v), str(model_dir), max_to_keep=10)
    for step in steps:
        v.assign(float(step))
        manager.save(checkpoint_number=step)


def restored_step(prefix):
    import tensorflow as tf

    v = tf.Variable(-1.0)
    tf.train.Checkpoint(v=v).restore(str(prefix)).assert_consumed()
    return int(v.numpy())


def leftovers(model_dir):
    """What a save killed midway leaves, as TensorFlow names it: shards still under ckpt-N_temp/
    (each written as *.tempstate<random> first), a state file being replaced."""
    (model_dir / "ckpt-15_temp").mkdir()
    (model_dir / "ckpt-15_temp" / "part-00000-of-00001.data-00000-of-00001.tempstate8411").write_bytes(b"x")
    (model_dir / "checkpoint.tempstate2207").write_text("")


@pytest.mark.parametrize("state", ["missing", "unreadable"])
def test_clean_keeps_complete_checkpoints_without_a_readable_state(tmp_path, state):
    import tensorflow as tf

    from od_dist.task import checkpoints

    model_dir = tmp_path / "run"
    saved_steps(model_dir, 5, 10)
    leftovers(model_dir)
    if state == "missing":  # ckpt-* files copied into a new model_dir to resume from
        (model_dir / "checkpoint").unlink()
    else:  # a network share's transient error, a torn write
        (model_dir / "checkpoint").write_bytes(b"\xff\x00 not a checkpoint state {")
    done = checkpoints.tidy_checkpoints(str(model_dir))
    assert sorted(os.path.basename(p) for p in done.removed) == ["checkpoint.tempstate2207", "ckpt-15_temp"]
    found = {
        os.path.basename(p): p for p in glob.glob(str(model_dir / "**" / "ckpt-*.index"), recursive=True)
    }
    assert sorted(found) == ["ckpt-10.index", "ckpt-5.index"]  # both complete ones kept...
    for step in (5, 10):  # ...and readable
        assert restored_step(found[f"ckpt-{step}.index"][: -len(".index")]) == step
    if state == "missing":  # the newest is resumed from; the other is set aside, not in the way
        assert done.resumed == str(model_dir / "ckpt-10") and done.named is None
        assert tf.train.latest_checkpoint(str(model_dir)) == str(model_dir / "ckpt-10")
        (aside,) = glob.glob(str(model_dir / (checkpoints.SET_ASIDE + "*")))
        assert done.set_aside == [(str(model_dir / "ckpt-5"), aside)]
        assert sorted(os.listdir(aside)) == ["ckpt-5.data-00000-of-00001", "ckpt-5.index"]
    else:  # nothing says where the run was: nothing but the temporaries is touched
        assert done.resumed is None and not done.set_aside
        assert (model_dir / "checkpoint").read_bytes() == b"\xff\x00 not a checkpoint state {"


def test_an_unnamed_complete_checkpoint_is_resumed_from_or_set_aside_never_deleted(tmp_path, capsys):
    """The checkpoint file names 5 and 10. Beside them: 20, complete (a later checkpoint a user
    copied in, or a save killed after its last byte: the run resumes from it, said in one line);
    7 and 15, complete but not the newest (moved aside, said where); and what saves killed at
    other points leave: 25's index without its data, 30's data without an index, 35's data cut
    short, 40's index cut short (incomplete: removed), and the temporary files."""
    import shutil

    import tensorflow as tf

    from od_dist.task import checkpoints

    model_dir = tmp_path / "run"
    other = tmp_path / "other"
    saved_steps(other, 7, 15, 20, 25, 30, 35, 40)
    saved_steps(model_dir, 5, 10)
    state = (model_dir / "checkpoint").read_text()
    for step in (7, 15, 20):
        for f in glob.glob(str(other / f"ckpt-{step}.*")):
            shutil.copy(f, model_dir)
    shutil.copy(other / "ckpt-25.index", model_dir)
    shutil.copy(other / "ckpt-30.data-00000-of-00001", model_dir)
    shutil.copy(other / "ckpt-35.index", model_dir)
    data = (other / "ckpt-35.data-00000-of-00001").read_bytes()
    (model_dir / "ckpt-35.data-00000-of-00001").write_bytes(data[: len(data) // 2])
    shutil.copy(other / "ckpt-40.data-00000-of-00001", model_dir)
    index = (other / "ckpt-40.index").read_bytes()
    (model_dir / "ckpt-40.index").write_bytes(index[: len(index) // 2])
    leftovers(model_dir)

    done = checkpoints.tidy(str(model_dir))
    out = capsys.readouterr().out
    removed = sorted(os.path.basename(p) for p in done.removed)
    assert removed == [
        "checkpoint.tempstate2207",
        "ckpt-15_temp",
        "ckpt-25.index",
        "ckpt-30.data-00000-of-00001",
        "ckpt-35.data-00000-of-00001",
        "ckpt-35.index",
        "ckpt-40.data-00000-of-00001",
        "ckpt-40.index",
    ]
    for name in removed:
        assert f"removed {model_dir / name}, left by a save that did not finish" in out
    # 20 is the latest now, for the restore and the evaluator alike; 5 and 10 are still named.
    assert done.resumed == str(model_dir / "ckpt-20") and done.named == str(model_dir / "ckpt-10")
    assert f"{model_dir / 'ckpt-20'} is complete and newer than {model_dir / 'ckpt-10'}" in out
    assert "resuming from it" in out
    assert tf.train.latest_checkpoint(str(model_dir)) == str(model_dir / "ckpt-20")
    after = tf.train.get_checkpoint_state(str(model_dir))
    assert [os.path.basename(p) for p in after.all_model_checkpoint_paths] == ["ckpt-5", "ckpt-10", "ckpt-20"]
    assert (
        len(after.all_model_checkpoint_timestamps) == 3
        and 'model_checkpoint_path: "ckpt-20"' in (model_dir / "checkpoint").read_text()
    )  # relative, as TensorFlow writes it: the model_dir can still be moved
    assert state != (model_dir / "checkpoint").read_text()
    for step in (5, 10, 20):
        assert restored_step(model_dir / f"ckpt-{step}") == step
    (aside,) = glob.glob(str(model_dir / (checkpoints.SET_ASIDE + "*")))
    assert done.set_aside == [(str(model_dir / "ckpt-7"), aside), (str(model_dir / "ckpt-15"), aside)]
    for step in (7, 15):
        assert f"{model_dir / f'ckpt-{step}'} is complete but the checkpoint file does not name it" in out
        assert f"moved it to {aside}" in out
        assert restored_step(os.path.join(aside, f"ckpt-{step}")) == step
    assert not glob.glob(str(model_dir / "ckpt-7.*")) and not glob.glob(str(model_dir / "ckpt-15.*"))
    # A second start finds everything in order.
    again = checkpoints.tidy_checkpoints(str(model_dir))
    assert not again.removed and not again.set_aside and again.resumed is None


# The file system fails to read a complete checkpoint's data (a network share's stale handle),
# injected into `od-dist train`'s own process where TensorFlow's checkpoint reader is called.
UNAVAILABLE_READ = """
from od_dist.task import checkpoints as _checkpoints

_tidy = _checkpoints.tidy_checkpoints


def _flaky_tidy(model_dir):
    import tensorflow as tf

    load = tf.train.load_checkpoint

    class Flaky:
        def __init__(self, reader):
            self.reader = reader

        def get_variable_to_shape_map(self):
            return self.reader.get_variable_to_shape_map()

        def get_tensor(self, name):
            raise tf.errors.UnavailableError(None, None, "Stale file handle")

    tf.train.load_checkpoint = lambda prefix: Flaky(load(prefix)) if prefix.endswith("ckpt-20") else load(prefix)
    return _tidy(model_dir)


_checkpoints.tidy_checkpoints = _flaky_tidy
"""


def unnamed_beside_named(tmp_path):
    """A model_dir whose state file names 5 and 10, with a complete ckpt-20 copied in beside them
    (unnamed: tidying reads it to judge it) and a save's leftovers; returns it and its files."""
    import shutil

    model_dir, other = tmp_path / "run", tmp_path / "other"
    saved_steps(model_dir, 5, 10)
    saved_steps(other, 20)
    for f in glob.glob(str(other / "ckpt-20.*")):
        shutil.copy(f, model_dir)
    leftovers(model_dir)
    files = {
        os.path.relpath(os.path.join(root, n), model_dir): os.path.getsize(os.path.join(root, n))
        for root, _, names in os.walk(model_dir)
        for n in names
    }
    return model_dir, files


@pytest.mark.slow
def test_a_checkpoint_that_fails_to_read_for_another_reason_stops_the_run_and_nothing_is_removed(
    data_dir, tmp_path
):
    """Only a checkpoint proven incomplete is removed; a read error that proves nothing (here the
    file system's Unavailable, in the real `od-dist train` process) ends the run in one line
    naming the checkpoint and the error, exit 1, with every file of the model_dir in place."""
    from loopback import PIPELINE, site_hook, tiny

    model_dir, files = unnamed_beside_named(tmp_path)
    env = {"PYTHONPATH": site_hook(tmp_path, UNAVAILABLE_READ) + os.pathsep + ROOT}
    r = od_dist("train", f"--pipeline={PIPELINE}", f"--model_dir={model_dir}", tiny(data_dir), env=env)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("od-dist: ")]
    assert str(model_dir / "ckpt-20") in line and "UnavailableError: Stale file handle" in line, line
    assert "nothing in the model_dir was removed" in line, line
    assert "removed" not in r.stdout and "resuming" not in r.stdout, r.stdout[-2000:]
    after = {
        os.path.relpath(os.path.join(root, n), model_dir): os.path.getsize(os.path.join(root, n))
        for root, _, names in os.walk(model_dir)
        for n in names
    }
    assert {f: size for f, size in after.items() if not f.startswith("logs")} == files


def test_a_folder_where_a_shard_should_be_stops_tidying_before_anything_is_removed(tmp_path):
    from od_dist.task import checkpoints, errors

    model_dir, files = unnamed_beside_named(tmp_path)
    shard = model_dir / "ckpt-20.data-00000-of-00001"
    shard.rename(tmp_path / "shard")
    shard.mkdir()
    with pytest.raises(
        errors.TrainerError, match=r"ckpt-20.*Is a directory.*nothing in the model_dir was removed"
    ):
        checkpoints.tidy_checkpoints(str(model_dir))
    assert shard.is_dir() and (model_dir / "ckpt-20.index").is_file()
    assert (model_dir / "ckpt-15_temp").is_dir() and (model_dir / "checkpoint.tempstate2207").is_file()


# ----- 7: transient faults exit with a retryable code -------------------------------------------


def test_hang_guard_ends_a_call_stuck_holding_the_gil_with_138():
    """A regular expression that backtracks for ages holds the GIL as TensorFlow's join does."""
    import subprocess
    import sys

    stuck = (
        "import re\n"
        "from od_dist.task.strategy import hang_guard\n"
        "with hang_guard(1, 'master:0: every peer is up; joining the all-reduce group'):\n"
        "    re.match(r'(a+)+$', 'a' * 64 + 'b')\n"
    )
    r = subprocess.run([sys.executable, "-c", stuck], capture_output=True, text=True, timeout=120)
    from od_dist.protocol import exit_codes

    assert exit_codes.normalize(r.returncode) == exit_codes.LOST_PEER == 138, (r.returncode, r.stderr)
    assert exit_codes.is_retryable(r.returncode)
    assert (
        "od-dist: master:0: TensorFlow's cluster set-up did not finish in 1 s: a peer was lost after it "
        "answered (or raise --wait_timeout); exit 138"
    ) in r.stderr, r.stderr


def test_hang_guard_lets_a_call_that_returns_go_on():
    import subprocess
    import sys

    quick = "from od_dist.task.strategy import hang_guard\nwith hang_guard(5, 'x: joining'):\n    pass\nprint('after')"
    r = subprocess.run([sys.executable, "-c", quick], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.splitlines() == ["x: joining (giving up after 5 s)", "after"], r


LOOPS = """
import sys, time
from od_dist.task import watch
with watch.LoopGuard("master:0", 1, "restart the job") as guard:
    for seconds in map(float, sys.argv[1:]):
        guard.loop_starts()
        print(f"loop of {seconds:g} s, bound {guard.limit():.0f} s", flush=True)
        time.sleep(seconds)
"""


def test_a_parameter_server_loop_far_slower_than_any_before_ends_the_master_with_138():
    """TensorFlow's coordinator waits for a loop's steps without a timeout, and one stayed stuck
    for good after a worker's link was cut for a minute (benchmarks/chaos.py --seed 1): every
    process idle. A loop that takes far longer than the slowest before ends the master."""
    import subprocess
    import sys

    from od_dist.protocol import exit_codes

    start = time.monotonic()
    r = subprocess.run([sys.executable, "-c", LOOPS, "0.4", "30"], capture_output=True, text=True, timeout=60)
    assert exit_codes.normalize(r.returncode) == exit_codes.LOST_PEER, (r.returncode, r.stderr)
    # Into the second loop: --wait_timeout and the watch's two probes (4 s), not its 30 s.
    assert time.monotonic() - start < 20
    assert r.stdout.splitlines() == ["loop of 0.4 s, bound 120 s", "loop of 30 s, bound 5 s"], r.stdout
    assert r.stderr.splitlines()[-1] == (
        "od-dist: master:0: a training loop did not end in 5 s (the slowest before took 0.4 s) while every "
        "peer answered: TensorFlow is stuck on a peer; restart the job; exit 138"
    ), r.stderr


def test_loops_within_their_bound_go_on_and_the_first_gets_longer():
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", LOOPS, "2", "1.5", "0.1"], capture_output=True, text=True, timeout=60
    )
    # The first loop may take --wait_timeout x 3, at least 120 s; later ones 5 x the slowest before.
    assert r.returncode == 0 and r.stdout.splitlines() == [
        "loop of 2 s, bound 120 s",
        "loop of 1.5 s, bound 10 s",
        "loop of 0.1 s, bound 10 s",
    ], r


# ----- 8: the evaluator is a sidecar: its failure never stops training ---------------------------


def test_a_failing_evaluator_is_restarted_then_left_out_while_training_goes_on(tmp_path):
    """Stand-in tasks: the evaluator exits 1 at every start (a pycocotools error); the master
    trains until the evaluator has been started 1 + --max_restarts times, then finishes."""
    import subprocess
    import sys
    import threading

    from od_dist.cluster.spec import Address, Task
    from od_dist.host import supervisor

    starts = tmp_path / "evaluator-starts"
    starts.write_text("")
    master, ps, evaluator = (
        Task(r, 0, Address("127.0.0.1", p)) for r, p in (("master", 1), ("ps", 2), ("evaluator", None))
    )
    until_evaluator_gone = (
        "import os, time\n"
        f"while len(open({str(starts)!r}).read()) < 3 or not os.path.exists({str(starts)!r} + '.gone'):\n"
        "    time.sleep(0.1)\n"
    )
    scripts = {
        "evaluator:0": f"open({str(starts)!r}, 'a').write('x'); raise SystemExit(1)",
        "master:0": until_evaluator_gone,
        "ps:0": until_evaluator_gone,
    }
    lines = []

    def say(line):
        lines.append(line)
        if "training goes on without evaluation" in line:
            open(str(starts) + ".gone", "w").close()

    sup = supervisor.Supervisor(
        "parameter_server",
        [ps, master, evaluator],
        lambda t: supervisor.Running(t, subprocess.Popen([sys.executable, "-c", scripts[t.name]])),
        say,
        max_restarts=2,
        grace_s=5,
    )
    result = []
    thread = threading.Thread(target=lambda: result.append(sup.run()), daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), lines
    assert result == [0], lines
    assert starts.read_text() == "xxx"
    assert (
        lines[0]
        == "evaluator:0 died (exit 1, a permanent failure); restart 1/2 of evaluator:0 alone in 2 s; training goes on"
    )
    assert (
        lines[1]
        == "evaluator:0 died (exit 1, a permanent failure); restart 2/2 of evaluator:0 alone in 4 s; training goes on"
    )
    assert lines[2] == (
        "evaluator:0 died (exit 1, a permanent failure); no restart left for it (--max_restarts 2); "
        "training goes on without evaluation"
    )
    assert lines[-1] == (
        "training finished; evaluation is missing (evaluator:0 used up its restarts); evaluate the final "
        "checkpoint with: od-dist eval"
    )
    assert not any("stopping every task" in line for line in lines)


def test_a_heartbeat_missed_over_a_network_outage_is_a_lost_peer():
    """benchmarks/outage.py: after a 15 s outage a multi_worker_mirrored worker's collective fails
    with DeadlineExceededError (the coordination service's heartbeat), naming only its own device:
    a lost peer (exit 138, restarted with the others), not a crash (exit 1, never retried)."""
    import tensorflow as tf

    from od_dist.task import roles

    message = (
        "{{function_node __wrapped__CollectiveReduceV2_device_/job:worker/replica:0/task:0/device:CPU:0}} "
        "Collective ops is aborted by: Deadline Exceeded\nRPC: /tensorflow.CoordinationService/Heartbeat"
    )
    assert roles._is_peer_error(tf.errors.DeadlineExceededError(None, None, message))
    assert not roles._is_peer_error(tf.errors.InvalidArgumentError(None, None, "a bug"))


def test_a_lost_peer_is_the_unreachable_one_the_error_names_not_another_that_ended_of_it():
    """Three multi_worker_mirrored trainers, worker:1's machine powered off: worker:0's task ends of
    the same collective error at once, so its port is closed too when the master looks; the error
    names worker:1 (its RecvBuf failed), and the master's line names worker:1 alone. With no named
    peer unreachable, every unreachable one; with none unreachable, the named ones."""
    import socket

    from loopback import free_ports

    from od_dist.cluster.spec import Address, Task
    from od_dist.task import watch

    with socket.socket() as up:
        up.bind(("127.0.0.1", 0))
        up.listen()
        down = free_ports(2)
        w0, w1 = (Task("worker", i, Address("127.0.0.1", port)) for i, port in enumerate(down))
        w2 = Task("worker", 2, Address("127.0.0.1", up.getsockname()[1]))
        about_w1 = (
            "Additional GRPC error information from remote target /job:worker/replica:0/task:1 while calling"
        )
        assert watch.lost_in_error(about_w1, [w0, w1, w2]) == [w1]
        about_w2 = about_w1.replace("task:1", "task:2")
        assert watch.lost_in_error(about_w2, [w0, w1, w2]) == [w0, w1]
        assert watch.lost_in_error(about_w2, [w2]) == [w2]


# ----- 9: --params_override takes a file, as its help and Model Garden's flag say ----------------


def test_params_override_reads_a_yaml_file(tmp_path):
    from od_dist.model.pipeline import PipelineError, load_pipeline

    override = tmp_path / "override.yaml"
    override.write_text("trainer:\n  train_steps: 123\ntask:\n  train_data:\n    global_batch_size: 4\n")
    params = load_pipeline(os.path.join(ROOT, "pipelines", "shapes_retinanet.yaml"), str(override))
    assert params.trainer.train_steps == 123 and params.task.train_data.global_batch_size == 4
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(PipelineError, match=r"params_override: file '.*bad.yaml': not a YAML mapping"):
        load_pipeline(os.path.join(ROOT, "pipelines", "shapes_retinanet.yaml"), str(bad))


# ----- 10: class names with quotes survive the label map ----------------------------------------


def make_labelimg(root, classes, count=4):
    """A labelImg folder: count PNGs, each with one box of each class."""
    from PIL import Image

    images, annotations = root / "images", root / "annotations"
    images.mkdir(parents=True)
    annotations.mkdir()
    for i in range(count):
        name = f"img{i}.png"
        Image.new("RGB", (64, 48), (i * 40, 90, 160)).save(images / name)
        objects = [(c, 5 + 10 * k, 5, 14 + 10 * k, 30, False) for k, c in enumerate(classes)]
        labelimg.write_xml(str(annotations / f"img{i}.xml"), name, 64, 48, objects)
    return str(images), str(annotations)


@pytest.mark.slow
def test_class_names_with_quotes_and_backslashes_survive_the_label_map(tmp_path):
    from od_dist.data import records

    classes = ["cat's toy", 'say "hi"', "back\\slash", "}{ brace", "é"]
    images, annotations = make_labelimg(tmp_path / "my_data", classes)
    out = tmp_path / "data"
    r = od_dist("data", "voc", f"--images={images}", f"--annotations={annotations}", f"--out={out}")
    assert r.returncode == 0, r.stderr
    by_name = {name: i for i, name in enumerate(sorted(classes), start=1)}
    assert records.read_labels(str(out / "label_map.pbtxt")) == {i: n for n, i in by_name.items()}
    # The file is valid protocol-buffer text: each name is one string, as a text-format reader sees it.
    from google.protobuf import text_encoding

    text = (out / "label_map.pbtxt").read_text(encoding="utf-8")
    for name in classes:
        assert f"name: '{text_encoding.CEscape(name.encode(), as_utf8=True)}'" in text


# ----- 3: predict takes several paths after one --images, or after the flags --------------------


@pytest.mark.parametrize(
    "form",
    [
        lambda a, b: ["--images", a, b],  # what a shell makes of --images photos/*.jpg
        lambda a, b: ["--images", a, "--images", b],
        lambda a, b: [a, b],  # paths after the flags
    ],
    ids=["one-flag", "repeated", "positional"],
)
def test_predict_takes_every_path_given(tmp_path, form):
    from PIL import Image

    model = tmp_path / "model"
    model.mkdir()
    (model / "saved_model.pb").write_bytes(b"")  # the images are checked before the model is read
    present = tmp_path / "a.png"
    Image.new("RGB", (8, 8)).save(present)
    missing = tmp_path / "b.png"  # the second path: named in the error only if it was taken
    r = od_dist("predict", f"--model={model}", f"--out={tmp_path / 'out'}", *form(str(present), str(missing)))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (
        f"od-dist predict: --images: '{missing}': no such file or folder; pass image files or a folder of images"
    )


# ----- 11: replacing a dataset is all or nothing ------------------------------------------------


@pytest.mark.parametrize("interrupted_at", [1, 2])
def test_an_interrupted_replacement_leaves_the_old_dataset_whole(tmp_path, monkeypatch, interrupted_at):
    from od_dist.data import voc

    images, annotations = make_labelimg(tmp_path / "my_data", ["cat", "dog"], count=6)
    out = str(tmp_path / "data")
    voc.convert(images, annotations, out, val_fraction=0.5)
    # A folder of nothing but the dataset is swapped whole. (With the user's files in it too, each
    # file is renamed in on its own: the folder is never moved from under them.)

    def contents():
        return {n: open(os.path.join(out, n), "rb").read() for n in sorted(os.listdir(out))}

    before = contents()
    # The new conversion differs (another split), so a mix would show.
    calls = []
    real_rename, real_replace = os.rename, os.replace

    def interrupting(real):
        def move(src, dst, *a, **k):
            calls.append((src, dst))
            if len(calls) == interrupted_at:
                raise KeyboardInterrupt
            return real(src, dst, *a, **k)

        return move

    monkeypatch.setattr(os, "rename", interrupting(real_rename))
    monkeypatch.setattr(os, "replace", interrupting(real_replace))
    with pytest.raises(KeyboardInterrupt):
        voc.convert(images, annotations, out, val_fraction=0.2, seed=7)
    monkeypatch.undo()
    assert contents() == before
    assert sorted(os.listdir(tmp_path)) == ["data", "my_data"]  # no staging or old folder left
    (tmp_path / "data" / "notes.txt").write_text("mine")  # not the dataset's: kept
    voc.convert(images, annotations, out, val_fraction=0.2, seed=7)
    after = contents()
    assert after != before and after["notes.txt"] == b"mine"


# ----- 12: firewall lines go before a final REJECT rule -----------------------------------------


def test_firewall_lines_insert_before_a_final_reject_rule(tmp_path):
    cluster = tmp_path / "c.yaml"
    cluster.write_text(
        "strategy: parameter_server\nmaster: 10.0.0.1:2222\nworker: [10.0.0.2:2222]\nps: [10.0.0.3:2222]\n"
    )
    r = od_dist(
        "scripts",
        f"--cluster={cluster}",
        "--pipeline=pipelines/shapes_retinanet.yaml",
        "--model_dir=runs/x",
        f"--out={tmp_path / 'out'}",
    )
    assert r.returncode == 0, r.stderr
    readme = (tmp_path / "out" / "README.md").read_text()
    rules = [ln for ln in readme.splitlines() if "iptables" in ln and "INPUT" in ln]
    assert rules and all(" -I INPUT -p tcp " in ln for ln in rules), rules
    assert "sudo iptables -I INPUT -p tcp -s 10.0.0.1 --dport 2222 -j ACCEPT" in rules


# ----- 13: a remote model_dir makes no local folder named after its scheme -----------------------


def test_launch_with_a_remote_model_dir_logs_locally(tmp_path, monkeypatch):
    from od_dist.host import launch

    monkeypatch.chdir(tmp_path)
    assert launch.run("parameter_server", [], {}, "gs://bucket/runs/x", 0, 1) == 0
    assert sorted(os.listdir(tmp_path)) == [launch.REMOTE_LOG_DIR]
    assert launch.log_dir_for("gs://bucket/runs/x") == str(tmp_path / launch.REMOTE_LOG_DIR)
    assert launch.log_dir_for("runs/x") == os.path.join("runs/x", "logs")


# ----- 14: the docs point only at what the repository holds -------------------------------------


def test_readme_and_code_cite_no_file_outside_the_repository():
    cited = []
    paths = [os.path.join(ROOT, "README.md")] + glob.glob(
        os.path.join(ROOT, "od_dist", "**", "*.py"), recursive=True
    )
    paths += glob.glob(os.path.join(ROOT, "docs", "*.md"))
    for path in paths:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for name in ("DESIGN.md", "FAULTS.md", "DATA.md", "PERF.md", "SCALING.md", "LAYOUT.md"):
            if name in text and not glob.glob(os.path.join(ROOT, "**", name), recursive=True):
                cited.append(f"{os.path.relpath(path, ROOT)}: {name}")
    assert not cited


# ----- 4: a worker without its data: one line, and the servers are told -------------------------


@pytest.mark.slow
def test_a_worker_without_the_records_is_one_line_and_the_servers_stop(data_dir, tmp_path):
    """parameter_server: the master's machine has the records (its working directory), the
    worker's does not. The master names the worker, its address and the path, exits 1 and tells
    the ps and the worker to stop, which they do at once, not after --wait_timeout."""
    import shutil
    import subprocess
    import sys

    import loopback

    cluster = loopback.write_cluster(tmp_path, ps=1, workers=1)
    worker_address = yaml.safe_load(open(cluster))["worker"][0]
    with_data, without_data = tmp_path / "master-machine", tmp_path / "worker-machine"
    shutil.copytree(data_dir, with_data / "data")
    without_data.mkdir()
    override = yaml.safe_load(small_override(data_dir))
    override["task"]["train_data"]["input_path"] = "data/train.tfrecord"
    override["task"]["validation_data"]["input_path"] = "data/val.tfrecord"
    override["trainer"].update(train_steps=2, steps_per_loop=1)
    common = [
        "--pipeline=" + os.path.join(ROOT, "pipelines", "shapes_retinanet.yaml"),
        f"--model_dir={tmp_path / 'run'}",
        f"--params_override={yaml.safe_dump(override, default_flow_style=True)}",
        "--wait_timeout=900",  # the servers stop because they are told, long before this
    ]
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    procs = {}
    try:
        for role, cwd in (("ps", without_data), ("worker", without_data), ("master", with_data)):
            procs[role] = subprocess.Popen(
                [sys.executable, "-m", "od_dist", "train", f"--cluster={cluster}", f"--role={role}", *common],
                cwd=str(cwd),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        out, err = procs["master"].communicate(timeout=900)
        assert procs["master"].returncode == 1, out[-2000:] + err[-3000:]
        line = err.strip().splitlines()[-1]
        assert line == (
            f"od-dist: worker:0 at {worker_address} cannot read data/train.tfrecord: no such file on that "
            "machine; every machine whose task reads data needs the records at that path (copy them "
            "there, or put them on a shared folder), then start the job again ('od-dist doctor "
            "--pipeline' checks it)"
        ), err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        assert "told ps:0, worker:0 to stop" in out, out[-2000:]
        for role in ("ps", "worker"):
            sout, _ = procs[role].communicate(timeout=120)
            assert procs[role].returncode == 1, sout[-2000:]  # the master's reason, and its code
            assert f"{role}:0: the master failed (worker:0 at {worker_address} cannot read" in sout
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_doctor_checks_the_records_this_machines_tasks_read(data_dir, tmp_path):
    import shutil

    import loopback

    cluster = loopback.write_cluster(tmp_path, ps=1, workers=1)
    pipeline = tmp_path / "p.yaml"
    doc = yaml.safe_load(open(os.path.join(ROOT, "pipelines", "shapes_retinanet.yaml")))
    doc["task"]["train_data"]["input_path"] = "data/train.tfrecord"
    doc["task"]["validation_data"]["input_path"] = "data/val.tfrecord"
    pipeline.write_text(yaml.safe_dump(doc))
    machine = tmp_path / "machine"
    machine.mkdir()
    args = ("doctor", f"--cluster={cluster}", f"--pipeline={pipeline}", "--connect_timeout=0.5")
    r = od_dist(*args, cwd=str(machine))
    assert r.returncode == 1, r.stdout + r.stderr
    assert (
        f"FIX   task.train_data.input_path: data/train.tfrecord: no such file here (working directory "
        f"{machine}), and worker:0, master:0 read it on this machine" in r.stdout
    ), r.stdout
    # No evaluator here, and training reads no validation records: nothing to say of them.
    assert "task.validation_data" not in r.stdout, r.stdout
    shutil.copytree(data_dir, machine / "data")
    r = od_dist(*args, cwd=str(machine))
    assert (
        "ok    task.train_data.input_path: data/train.tfrecord: 1 file(s) here, for worker:0, master:0"
        in r.stdout
    )
    assert "task.validation_data" not in r.stdout, r.stdout
    assert "FIX   task." not in r.stdout, r.stdout


def test_a_named_checkpoint_cut_short_resumes_from_the_newest_whole_one(tmp_path, capsys):
    """A power loss during a save can leave the checkpoint the state file names without a whole
    index: the trainer resumes from the newest whole one before it, said in one line, rather than
    failing its restore for good; with none whole it starts behind (under multi_worker_mirrored the
    others then send it the variables)."""
    from loopback import write_checkpoint

    from od_dist.task import controller

    folder = tmp_path / "model"
    write_checkpoint(folder, 5)
    write_checkpoint(folder, 10)
    (folder / "checkpoint").write_text(
        'model_checkpoint_path: "ckpt-10"\nall_model_checkpoint_paths: "ckpt-5"\nall_model_checkpoint_paths: "ckpt-10"\n'
    )
    (folder / "ckpt-10.index").write_bytes(b"torn")
    assert controller._whole_latest(str(folder)) == str(folder / "ckpt-5")
    assert (
        f"{folder / 'ckpt-10'} is not whole on disk (a save cut short); resuming from {folder / 'ckpt-5'}"
        in (capsys.readouterr().out)
    )
    (folder / "ckpt-5.index").write_bytes(b"torn")
    assert controller._whole_latest(str(folder)) is None
    assert "no whole checkpoint here: this trainer starts behind" in capsys.readouterr().out


@pytest.mark.slow
def test_an_evaluator_whose_master_is_not_up_yet_still_says_where_checkpoints_come_from(data_dir, tmp_path):
    """An evaluator started before its master (a folder of its own, no checkpoint_port): its first
    poll (--wait_timeout, at most 30 s) already names who writes the checkpoints, rather than
    silence until the master comes."""
    said, master = _evaluators_first_word(data_dir, tmp_path, master_up=False)
    assert said.split(" s; ", 1)[1].startswith(f"master:0 at {master} (not up now) writes them"), said
