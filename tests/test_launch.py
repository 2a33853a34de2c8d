"""`od-dist launch` itself: copying the tasks' output, checking input before any task starts.
Real child processes; the TensorFlow jobs are in test_distributed.py and test_faults.py."""

import os
import subprocess
import sys
import threading

import pytest

from od_dist.host import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINES = 20000  # ~1.3 MB: far more than a pipe holds, so a child nobody drains would block


def chatty_child():
    return subprocess.Popen(
        [sys.executable, "-c", f"for i in range({LINES}): print('line', i, 'x' * 50)"],
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
    )


def pump(child, log_path):
    thread = threading.Thread(
        target=launch._pump, args=(child.stdout, "[worker:1]", str(log_path), threading.Lock()), daemon=True
    )
    thread.start()
    try:
        assert child.wait(timeout=60) == 0
    finally:
        child.kill()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_output_keeps_draining_when_the_console_is_gone(tmp_path, monkeypatch):
    """`od-dist launch ... | head`: the console pipe closes (EPIPE); the child must not block and
    the log still gets every line."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    console = open(write_end, "w")
    monkeypatch.setattr(sys, "stdout", console)
    log = tmp_path / "worker-1.log"
    pump(chatty_child(), log)
    lines = log.read_text().splitlines()
    assert lines[-1] == f"line {LINES - 1} " + "x" * 50 and len(lines) == LINES + 1
    monkeypatch.undo()
    console.close()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a disk that is always full)")
def test_output_keeps_draining_when_the_log_cannot_be_written(tmp_path, monkeypatch):
    console_path = tmp_path / "console.txt"
    with open(console_path, "w") as console:
        monkeypatch.setattr(sys, "stdout", console)
        pump(chatty_child(), "/dev/full")
        monkeypatch.undo()
    text = console_path.read_text()
    assert "od-dist launch: cannot write /dev/full (No space left on device)" in text
    assert text.count("[worker:1] line ") == LINES and f"[worker:1] line {LINES - 1} " in text


def test_a_resumed_run_appends_to_its_log(tmp_path):
    log = tmp_path / "worker-1.log"
    for word in ("first", "second"):
        child = subprocess.Popen(
            [sys.executable, "-c", f"print('{word} run')"], stdout=subprocess.PIPE, text=True, bufsize=1
        )
        pump(child, log)
    lines = log.read_text().splitlines()
    assert [x for x in lines if not x.startswith("-----")] == ["first run", "second run"]
    assert lines[0].startswith("----- ") and lines[0].endswith(" worker:1 started -----")


def test_launch_with_a_bad_pipeline_starts_nothing(tmp_path):
    pipeline = tmp_path / "bad.yaml"
    pipeline.write_text("experiment: retinanet_resnetfpn_coco\ntrainer: {train_stepz: 10}\n")
    model_dir = tmp_path / "model"
    cluster = tmp_path / "cluster.yaml"  # ports nobody uses: nothing may start anyway
    cluster.write_text("master: 127.0.0.1:1\nworker: [127.0.0.1:2]\nps: [127.0.0.1:3]\n")
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "od_dist",
            "launch",
            f"--cluster={cluster}",
            f"--pipeline={pipeline}",
            f"--model_dir={model_dir}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=180,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "trainer.train_stepz" in r.stderr and "did you mean 'train_steps'" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "started" not in r.stdout and not (model_dir / "logs").exists()


def test_a_batch_the_replicas_do_not_divide_is_refused_before_any_task_starts(tmp_path):
    """Three multi_worker_mirrored trainers cannot share the demo's batch of 8 (TensorFlow fails
    inside the first dataset): launch says so once, with the multiples to set, exit 2."""
    cluster = tmp_path / "cluster.yaml"  # ports nobody uses: nothing may start anyway
    cluster.write_text(
        "strategy: multi_worker_mirrored\nmaster: 127.0.0.1:1\nworker: [127.0.0.1:2, 127.0.0.1:3]\n"
    )
    model_dir = tmp_path / "model"
    r = od_dist_here(
        "launch",
        f"--cluster={cluster}",
        f"--pipeline={os.path.join(ROOT, 'pipelines', 'shapes_retinanet.yaml')}",
        f"--model_dir={model_dir}",
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        "od-dist launch: task.train_data.global_batch_size: 8 does not split evenly over 3 replicas in "
        "sync; set a multiple of 3 (6 or 9) with --params_override task.train_data.global_batch_size=N, "
        "or pass --fixed_replica_batch to make 8 each replica's batch"
    ], r.stderr
    assert "started" not in r.stdout and not (model_dir / "logs").exists()


def od_dist_here(*args, cwd=ROOT):
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    return subprocess.run(
        [sys.executable, "-m", "od_dist", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=180,
    )


@pytest.mark.parametrize("command", ["launch", "scripts", "k8s"])
def test_every_flag_is_checked_before_any_task_starts(tmp_path, command):
    """What each task is started with is what is checked up front: --fixed_replica_batch under
    parameter_server is refused once, exit 2, before any task starts (or any file is written),
    instead of by every task on its own."""
    model_dir = tmp_path / "model"
    cluster = tmp_path / "cluster.yaml"  # ports nobody uses: nothing may start anyway
    cluster.write_text("master: 127.0.0.1:1\nworker: [127.0.0.1:2]\nps: [127.0.0.1:3]\n")
    r = od_dist_here(
        command,
        f"--cluster={cluster}",
        f"--pipeline={os.path.join(ROOT, 'pipelines', 'shapes_retinanet.yaml')}",
        f"--model_dir={model_dir}",
        "--fixed_replica_batch",
        *([f"--out={tmp_path / 'out'}"] if command != "launch" else []),
        *(["--image=registry.example/od-dist:1"] if command == "k8s" else []),
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--fixed_replica_batch: 'True': parameter_server runs" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "started" not in r.stdout
    assert sorted(os.listdir(tmp_path)) == ["cluster.yaml"]  # no logs, no scripts


def test_the_tasks_get_every_train_flag_given():
    """launch, scripts, k8s and train --max_restarts build a task's command line in one place
    (cluster/commandline.py) from every `od-dist train` flag but the task's own place: each flag
    given reaches it, as `od-dist train` parses it back."""
    from absl import flags

    from od_dist.cli.flags import define_train_flags, passed_on_args
    from od_dist.cluster import commandline
    from od_dist.cluster import spec as cluster_mod

    fv = flags.FlagValues()
    define_train_flags(fv)
    given = {}
    for name in fv:
        if name not in commandline.TASK_FLAGS:  # each flag set to something other than its default
            default, parser = fv[name].default, fv[name].parser
            given[name] = (
                (not default)
                if isinstance(default, bool)
                else next(v for v in parser.enum_values if v != default)
                if hasattr(parser, "enum_values")
                else "x"
                if parser.flag_type() == "string"
                else 3
            )
    fv(
        [
            "od-dist train",
            *(f"--{'' if v else 'no'}{n}" if v in (True, False) else f"--{n}={v}" for n, v in given.items()),
        ]
    )
    cluster = cluster_mod.from_document({"master": "127.0.0.1:2222", "worker": ["127.0.0.1:2223"]})
    args = commandline.train_args(passed_on_args(fv), cluster, cluster.task("worker", 0), "c.yaml")
    child = flags.FlagValues()
    define_train_flags(child)
    child(["od-dist train", *args[1:]])
    assert (child.cluster, child.role, child.index) == ("c.yaml", "worker", 0)
    assert {name: child[name].value for name in given} == given
