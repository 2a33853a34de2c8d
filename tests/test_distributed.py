"""Real distributed jobs on loopback: real TensorFlow servers, the real Model Garden trainer, a
tiny shapes dataset made here, a handful of steps. Each job runs as the user would run it."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
from loopback import PIPELINE, ROOT, checkpoint_step, clean_env, free_ports, od_dist, tiny, write_cluster

pytestmark = pytest.mark.slow


def run(*args, cwd=ROOT, timeout=300):
    return od_dist(*args, cwd=cwd, timeout=timeout)


def od_dist_processes():
    return [
        p
        for p in psutil.process_iter(["cmdline"])
        if p.info["cmdline"] and "od_dist" in " ".join(p.info["cmdline"]) and p.pid != os.getpid()
    ]


def test_parameter_server_job_then_eval(tmp_path, data_dir):
    """1 ps + 2 workers + master + evaluator via launch; the servers stop by themselves, the
    evaluator after the final checkpoint; eval prints AP."""
    cluster = write_cluster(tmp_path, evaluator=True)
    model_dir = str(tmp_path / "model")
    r = run(
        "launch",
        f"--cluster={cluster}",
        f"--pipeline={PIPELINE}",
        f"--model_dir={model_dir}",
        tiny(data_dir),
        "--wait_timeout=120",
        cwd=str(tmp_path),
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "ParameterServerStrategy" in out
    assert checkpoint_step(model_dir) == 10
    assert re.search(r"\[master:0\] od-dist train \| step 10/10 .* steps/s .* examples/s .* ETA", out), out[
        -3000:
    ]
    for name in ("ps:0", "worker:0", "worker:1"):
        assert f"[{name}] {name} serving on 127.0.0.1:" in out
        assert f"[{name}] {name}: the master finished training; stopping" in out
    assert sorted(os.listdir(os.path.join(model_dir, "logs"))) == [
        "evaluator-0.log",
        "master-0.log",
        "ps-0.log",
        "worker-0.log",
        "worker-1.log",
    ]
    assert re.search(r"\[evaluator:0\] od-dist eval \| step 10 \| AP \d\.\d{3} \| AP50 \d\.\d{3}", out), out[
        -3000:
    ]
    assert json.load(open(os.path.join(model_dir, "eval_metrics.json")))["step"] == 10
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".od-dist-stop")]  # markers cleaned up

    # A console people can read: TensorFlow's C++ lines, the SessionOptions dumps, pycocotools'
    # tables and Model Garden's metric dicts are in the per-task logs, not on the console.
    for noise in (
        "cuInit",
        "grpc_server_lib.cc",
        "SessionOptions",
        "Average Precision",
        "'AP50': np.float32",
    ):
        assert noise not in out, noise
    logs = {
        name: open(os.path.join(model_dir, "logs", name)).read() for name in ("ps-0.log", "evaluator-0.log")
    }
    assert "grpc_server_lib.cc" in logs["ps-0.log"] and "Average Precision" in logs["evaluator-0.log"]
    assert "[ps:0] ps:0 serving on" in out and "ps:0 serving on" in logs["ps-0.log"]

    r = run("eval", f"--pipeline={PIPELINE}", f"--model_dir={model_dir}", tiny(data_dir), cwd=str(tmp_path))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    # Its result once, and none of the metrics dict or table around it.
    assert (
        len(re.findall(r"^od-dist eval \| step 10 \| AP \d\.\d{3} \| AP50 \d\.\d{3} \| AP75", r.stdout, re.M))
        == 1
    ), r.stdout[-2000:]
    assert len([line for line in r.stdout.splitlines() if "AP" in line]) == 1, r.stdout[-2000:]
    assert "Average Precision" in open(os.path.join(model_dir, "logs", "eval.log")).read()


def test_multi_worker_mirrored_master_and_worker(tmp_path, data_dir):
    cluster = write_cluster(tmp_path, ps=0, workers=1)
    model_dir = str(tmp_path / "model")
    r = run(
        "launch",
        f"--cluster={cluster}",
        f"--pipeline={PIPELINE}",
        f"--model_dir={model_dir}",
        tiny(data_dir),
        "--wait_timeout=120",
        cwd=str(tmp_path),
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "[master:0] master:0: training with MultiWorkerMirroredStrategy, 2 replica(s) in sync" in out
    assert "[worker:0] worker:0: training with MultiWorkerMirroredStrategy, 2 replica(s) in sync" in out
    assert checkpoint_step(model_dir) == 10


def test_single_machine_two_cpu_clones_and_resume(tmp_path, data_dir):
    model_dir = str(tmp_path / "model")
    args = [f"--pipeline={PIPELINE}", f"--model_dir={model_dir}", "--num_clones=2", "--clone_on_cpu"]
    r = run("train", *args, tiny(data_dir, steps=5), cwd=str(tmp_path))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "single: training with MirroredStrategy, 2 replica(s) in sync" in r.stdout
    assert checkpoint_step(model_dir) == 5
    # The same command with more steps resumes from step 5 rather than starting over.
    r = run("train", *args, tiny(data_dir, steps=10), cwd=str(tmp_path))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "step 5/10" not in r.stdout and "step 10/10" in r.stdout
    assert re.search(r"train \| step:\s+5 \| training until step 10", r.stdout + r.stderr)
    assert checkpoint_step(model_dir) == 10


def test_master_names_the_peer_that_never_starts(tmp_path, data_dir):
    cluster = write_cluster(tmp_path, ps=1, workers=1)
    start = time.monotonic()
    r = run(
        "train",
        f"--cluster={cluster}",
        "--role=master",
        f"--pipeline={PIPELINE}",
        f"--model_dir={tmp_path / 'model'}",
        tiny(data_dir),
        "--wait_timeout=3",
        cwd=str(tmp_path),
    )
    assert r.returncode == 138, r.stdout + r.stderr  # retryable: a late peer is there at the next try
    assert re.search(
        r"timed out after 3 s waiting for ps:0 at 127\.0\.0\.1:\d+, worker:0 at 127\.0\.0\.1:\d+", r.stderr
    ), r.stderr
    assert "Traceback" not in r.stderr
    assert time.monotonic() - start < 60


def test_multi_worker_peer_that_never_starts(tmp_path, data_dir):
    cluster = write_cluster(tmp_path, ps=0, workers=1)
    r = run(
        "train",
        f"--cluster={cluster}",
        "--role=master",
        f"--pipeline={PIPELINE}",
        f"--model_dir={tmp_path / 'model'}",
        tiny(data_dir),
        "--wait_timeout=5",
        cwd=str(tmp_path),
    )
    assert r.returncode == 138, r.stdout + r.stderr
    assert re.search(r"timed out after 5 s waiting for worker:0 at 127\.0\.0\.1:\d+", r.stderr), r.stderr


def test_port_already_taken(tmp_path):
    cluster = write_cluster(tmp_path, ps=1, workers=1)
    port = int(open(cluster).read().split("ps: [127.0.0.1:")[1].split("]")[0])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        start = time.monotonic()
        r = run("train", f"--cluster={cluster}", "--role=ps", cwd=str(tmp_path), timeout=120)
    # The port is bound before TensorFlow's import (which alone takes 5 to 30 s here).
    assert time.monotonic() - start < 10
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"ps:0: port {port} is already in use" in r.stderr and "ps[0]" in r.stderr
    assert "Traceback" not in r.stderr


def test_server_stops_on_sigterm_and_when_master_never_comes(tmp_path):
    cluster = write_cluster(tmp_path, ps=1, workers=1)
    env = clean_env()
    proc = subprocess.Popen(
        [sys.executable, "-m", "od_dist", "train", f"--cluster={cluster}", "--role=ps"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=str(tmp_path),
        env=env,
    )
    line = ""
    while "serving on" not in line:
        line = proc.stdout.readline()
        assert line, "ps exited before serving"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    # No master ever comes: the server gives up after --wait_timeout instead of waiting forever.
    r = run("train", f"--cluster={cluster}", "--role=ps", "--wait_timeout=2", cwd=str(tmp_path), timeout=120)
    assert r.returncode == 138  # LOST_PEER: retryable
    assert re.search(r"ps:0: lost the master at 127\.0\.0\.1:\d+ \(unreachable for 2 s\)", r.stderr), r.stderr


def test_ps_starts_whatever_num_clones_says(tmp_path):
    """A ps holds variables and runs no replicas: num_clones 2 (file and flag, as one launch line
    passes it to every machine) must not make a CPU-only ps ask for 2 GPUs."""
    cluster = write_cluster(tmp_path, ps=1, workers=1)
    with open(cluster, "a") as f:
        f.write("num_clones: 2\n")
    env = clean_env()
    for extra in ([], ["--num_clones=2"]):
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "od_dist",
                "train",
                f"--cluster={cluster}",
                "--role=ps",
                f"--model_dir={tmp_path / 'model'}",
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=str(tmp_path),
            env=env,
        )
        try:
            lines = []
            while not lines or "serving on" not in lines[-1]:
                lines.append(proc.stdout.readline())
                assert lines[-1], "ps exited before serving:\n" + "".join(lines)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert "od-dist device policy: no GPU visible" in (tmp_path / "model" / "logs" / "ps-0.log").read_text()


def test_every_role_applies_the_device_policy(tmp_path, data_dir):
    """The same device policy (memory growth on every GPU) in every role that imports TensorFlow;
    each process writes what it applied to its log. Here: the evaluator, the parameter_server
    master (the coordinator) and `od-dist eval`; the ps is in the test above, the trainers in the
    other jobs' logs. (No GPU here: the memory-growth branch itself is not exercised.)"""
    cluster = write_cluster(tmp_path, ps=1, workers=1, evaluator=True)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    env = clean_env()
    common = [f"--pipeline={PIPELINE}", f"--model_dir={model_dir}", tiny(data_dir), "--wait_timeout=2"]
    commands = {
        "evaluator-0": ["train", f"--cluster={cluster}", "--role=evaluator", *common],
        "master-0": ["train", f"--cluster={cluster}", "--role=master", *common],
        "eval": ["eval", f"--pipeline={PIPELINE}", f"--model_dir={model_dir}"],
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "od_dist", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=str(tmp_path),
            env=env,
        )
        for name, args in commands.items()
    }
    try:
        for name, proc in procs.items():
            out = proc.communicate(timeout=240)[0]
            # No peers (the master: 138, retryable), no checkpoint (1): each gives up, after the policy.
            assert proc.returncode == (138 if name == "master-0" else 1), out
            log = (model_dir / "logs" / f"{name}.log").read_text()
            assert "od-dist device policy: no GPU visible" in log, name
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_launch_stops_everything_when_a_task_dies(tmp_path, data_dir):
    cluster = write_cluster(tmp_path)
    model_dir = str(tmp_path / "model")
    env = clean_env()
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "od_dist",
            "launch",
            f"--cluster={cluster}",
            f"--pipeline={PIPELINE}",
            f"--model_dir={model_dir}",
            tiny(data_dir, steps=100000),
            "--wait_timeout=120",
            "--max_restarts=0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=str(tmp_path),
        env=env,
    )
    lines = []
    try:
        while not any("[worker:1] worker:1 serving on" in line for line in lines):
            line = launcher.stdout.readline()
            assert line, "".join(lines[-50:])
            lines.append(line)
        children = psutil.Process(launcher.pid).children(recursive=True)
        assert len(children) == 4
        victim = next(c for c in children if "--role=worker" in c.cmdline() and "--index=1" in c.cmdline())
        victim.kill()
        rest, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    out = "".join(lines) + rest
    assert launcher.returncode == 1, out[-3000:]
    assert (
        "od-dist launch: worker:1 died (exit 137, killed); no restart left (--max_restarts 0); stopping "
        f"every task. Its log: {os.path.join(model_dir, 'logs', 'worker-1.log')}"
    ) in out
    gone = psutil.wait_procs(children, timeout=30)[1]
    assert not gone, f"left running: {gone}"


STOP_FROM_MASTER = """
import json, sys
import tensorflow as tf
from od_dist.cluster import spec
from od_dist.job import server
cluster = spec.load(sys.argv[1])
resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
    tf.train.ClusterSpec(cluster.cluster_spec()), task_type="chief", task_id=0, rpc_layer="grpc")
tf.config.experimental_connect_to_cluster(resolver, job_name="chief", make_master_device_default=False)
print("RESULT " + json.dumps(server.send_stop(cluster, [t for t in cluster.tasks() if t.role != "master"])))
"""


def test_a_server_that_cannot_write_its_stop_marker_is_reported_as_such(tmp_path):
    """The ps runs in a read-only directory: it says so when it starts, and the master reports
    the marker it could not write, not "could not reach"; the worker, in a writable one, stops."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("needs root to mount a read-only directory (root can write into any chmod-ed one)")
    cluster = write_cluster(tmp_path, ps=1, workers=1)
    env = clean_env()
    procs = {}
    try:
        for role, cwd in (("ps", ro), ("worker", tmp_path)):
            procs[role] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "od_dist",
                    "train",
                    f"--cluster={cluster}",
                    f"--role={role}",
                    f"--model_dir={tmp_path / 'model'}",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=str(cwd),
                env=env,
            )
        lines = {}
        for role, proc in procs.items():
            lines[role] = []
            while not lines[role] or "serving on" not in lines[role][-1]:
                lines[role].append(proc.stdout.readline())
                assert lines[role][-1], "".join(lines[role])
        assert any(
            "ps:0: cannot write in its working directory" in line and "Read-only file system" in line
            for line in lines["ps"]
        ), lines["ps"]
        r = subprocess.run(
            [sys.executable, "-c", STOP_FROM_MASTER, cluster],
            capture_output=True,
            text=True,
            env=dict(env, GRPC_FAIL_FAST="use_caller"),
            timeout=240,
        )
        result = json.loads(r.stdout.split("RESULT ", 1)[1]) if "RESULT " in r.stdout else None
        assert result is not None, r.stdout[-2000:] + r.stderr[-3000:]
        assert list(result) == ["ps:0"], result
        assert "could not write its stop marker" in result["ps:0"] and "could not reach" not in result["ps:0"]
        assert procs["worker"].wait(timeout=60) == 0  # told: it stopped by itself
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        subprocess.run(["umount", str(ro)], capture_output=True)


def test_evaluator_without_a_master_watches_worker_0(tmp_path, data_dir):
    """A multi_worker_mirrored cluster without a master: the evaluator keeps waiting for
    checkpoints while worker 0 (TensorFlow's chief) is up, and stops once it has been gone for
    --wait_timeout. (Worker 0 here is its open port; the evaluator only probes the port.)"""
    w0, w1 = free_ports(2)
    cluster = tmp_path / "c.yaml"
    cluster.write_text(f"worker: [127.0.0.1:{w0}, 127.0.0.1:{w1}]\nevaluator: 127.0.0.1\n")
    model_dir = tmp_path / "model"
    env = clean_env()
    lead = socket.socket()
    lead.bind(("127.0.0.1", w0))
    lead.listen()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "od_dist",
            "train",
            f"--cluster={cluster}",
            "--role=evaluator",
            f"--pipeline={PIPELINE}",
            f"--model_dir={model_dir}",
            tiny(data_dir),
            "--wait_timeout=3",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        log = model_dir / "logs" / "evaluator-0.log"
        deadline = time.monotonic() + 240
        while not (log.exists() and "od-dist device policy" in log.read_text()):  # then it polls
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(1)
        time.sleep(15)  # five times --wait_timeout: it must still be waiting
        assert proc.poll() is None, proc.stdout.read()
        lead.close()
        assert proc.wait(timeout=120) == 1
        assert "no checkpoint appeared" in proc.stdout.read()
    finally:
        lead.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
