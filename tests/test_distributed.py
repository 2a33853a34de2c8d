"""Real distributed jobs on loopback: real TensorFlow servers, the real Model Garden trainer, a
tiny shapes dataset made here, a handful of steps. Each job runs as the user would run it; the
reference parameter_server job runs once for every test that reads it (the multi_worker_mirrored
pair under launch is in test_faults.py, where it also loses a trainer; one machine's two CPU
clones in test_faults_trainer.py, where SIGTERM stops them and they resume)."""

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
import typing

import psutil
import pytest
from loopback import (
    PIPELINE,
    ROOT,
    checkpoint_step,
    clean_env,
    free_ports,
    od_dist,
    site_hook,
    tiny,
    write_cluster,
)

from od_dist.host import cpu_budget
from od_dist.protocol import notes
from od_dist.task import phases

pytestmark = pytest.mark.slow


def run(*args, cwd=ROOT, timeout=300):
    return od_dist(*args, cwd=cwd, timeout=timeout)


class PsJob(typing.NamedTuple):
    workdir: pathlib.Path
    model_dir: str
    launched: subprocess.CompletedProcess
    logs: list  # the launch's log files, before the eval adds its own
    evaluated: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def ps_job(tmp_path_factory, data_dir):
    """The reference parameter_server job, run once for the tests that read its output and logs:
    `od-dist launch` of 1 ps, 2 workers, the master and an evaluator on this machine (with
    --data_threads 3, which every task must apply), then `od-dist eval` of its model_dir."""
    workdir = tmp_path_factory.mktemp("ps_job")
    cluster = write_cluster(workdir, evaluator=True)
    model_dir = str(workdir / "model")
    launched = od_dist(
        "launch",
        f"--cluster={cluster}",
        f"--pipeline={PIPELINE}",
        f"--model_dir={model_dir}",
        tiny(data_dir),
        "--data_threads=3",
        "--wait_timeout=120",
        cwd=str(workdir),
        timeout=600,
        env={"TF_NUM_INTRAOP_THREADS": None},
    )
    logs_dir = os.path.join(model_dir, "logs")
    logs = sorted(os.listdir(logs_dir)) if os.path.isdir(logs_dir) else []
    evaluated = od_dist(
        "eval",
        f"--pipeline={PIPELINE}",
        f"--model_dir={model_dir}",
        tiny(data_dir),
        cwd=str(workdir),
        timeout=300,
    )
    return PsJob(workdir, model_dir, launched, logs, evaluated)


def test_parameter_server_job_then_eval(ps_job):
    """1 ps + 2 workers + master + evaluator via launch; the servers stop by themselves, the
    evaluator after the final checkpoint; eval prints AP."""
    tmp_path, model_dir, r = ps_job.workdir, ps_job.model_dir, ps_job.launched
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
    assert ps_job.logs == [
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
        # TensorFlow's deprecation warning, four lines, for a reader od-dist does not use.
        "is deprecated",
    ):
        assert noise not in out, noise
    logs = {
        name: open(os.path.join(model_dir, "logs", name)).read() for name in ("ps-0.log", "evaluator-0.log")
    }
    assert "grpc_server_lib.cc" in logs["ps-0.log"] and "Average Precision" in logs["evaluator-0.log"]
    assert "[ps:0] ps:0 serving on" in out and "ps:0 serving on" in logs["ps-0.log"]
    # Each task's start-up, one line a phase, in order, in its log and not on the console
    # (benchmarks/startup.py and chaos.py read them there with phases.SHOW_ENV).
    assert not phases.LINE.search(out), out[-3000:]
    said = {
        name: [m["phase"] for m in phases.LINE.finditer(task_log(model_dir, name))]
        for name in ("ps:0", "worker:0", "worker:1", "master:0")
    }
    for name in ("ps:0", "worker:0", "worker:1"):
        assert said[name] == ["TensorFlow imported", "serving"], said
    assert said["master:0"] == [
        "TensorFlow imported",
        "Model Garden imported",
        "pipeline loaded",
        "group formed",
        "model built",
        "resumed at step 0",
        "first loop",
    ], said

    r = ps_job.evaluated
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "is deprecated" not in r.stdout + r.stderr, r.stderr
    # Its result once, and none of the metrics dict or table around it.
    assert (
        len(re.findall(r"^od-dist eval \| step 10 \| AP \d\.\d{3} \| AP50 \d\.\d{3} \| AP75", r.stdout, re.M))
        == 1
    ), r.stdout[-2000:]
    assert len([line for line in r.stdout.splitlines() if "AP" in line]) == 1, r.stdout[-2000:]
    assert "Average Precision" in open(os.path.join(model_dir, "logs", "eval.log")).read()


def test_the_master_says_how_busy_its_workers_were_from_tensorflows_coordinator_metrics(ps_job):
    """The loops after the first (steps 2-5 and 6-10) ran as one closure on each of the 2 workers;
    TensorFlow's coordinator timed them, and the master read the figures: time on the workers, at
    most the loops' wall time on each, and both closures pending when it began to wait."""
    out = ps_job.launched.stdout
    m = re.search(
        r"\[master:0\] od-dist train \| parameter_server, the 2 loop\(s\) after the first: 9 steps in (\d+) "
        r"closures on 2 workers, ([\d.]+) s a step on a worker, the workers busy (\d+)% of the loops' ([\d.]+) s "
        r".* at each join at least (\d+) closure\(s\) in flight or queued$",
        out,
        re.M,
    )
    assert m, out[-3000:]
    closures, per_step, busy, wall, pending = int(m[1]), float(m[2]), int(m[3]), float(m[4]), int(m[5])
    assert closures == 4 and pending == 2, m[0]
    assert 0 < per_step * 9 <= 2 * wall and 0 < busy <= 100, m[0]


def task_log(model_dir: str, name: str) -> str:
    """The log of the task `name` ("worker:1") under launch."""
    with open(os.path.join(model_dir, "logs", f"{name.replace(':', '-')}.log"), errors="replace") as f:
        return f.read()


def test_each_launched_task_reports_the_threads_tensorflow_applied(ps_job):
    """Every child of the launch writes its budget as TensorFlow reports it after applying into its
    log (a measurement: not on the console); a flag given to launch (--data_threads 3) reaches every
    child."""
    out = ps_job.launched.stdout + ps_job.launched.stderr
    assert ps_job.launched.returncode == 0, out[-3000:]
    assert ": threads intra-op" not in out, out[-3000:]
    cores = cpu_budget.machine_cores()
    roles = ["ps", "master", "worker", "worker", "evaluator"]
    for name in ("ps:0", "master:0", "worker:0", "worker:1", "evaluator:0"):
        want = cpu_budget.budget(cores, name.split(":")[0], "parameter_server", roles)
        line = rf"^{name}: threads intra-op {want.intra_op}, inter-op {want.inter_op}, tf.data 3 "
        assert re.search(line, task_log(ps_job.model_dir, name), re.M), line


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
    # The device policy is applied (and logged) before the wait.
    log = (tmp_path / "model" / "logs" / "master-0.log").read_text()
    assert "od-dist device policy: no GPU visible" in log


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


def test_ps_starts_whatever_num_clones_says_stops_on_sigterm_and_when_master_never_comes(tmp_path):
    """A ps holds variables and runs no replicas: num_clones 2 (file and flag, as one launch line
    passes it to every machine) must not make a CPU-only ps ask for 2 GPUs. SIGTERM stops it with
    a retryable 143, SIGINT with 130 (no master said the job is over), and a SIGINT its supervisor
    left word of (standing in for the CTRL_BREAK a Windows supervisor stops it with: Linux has
    none) with 143, the system's stop; a master that never comes, after --wait_timeout, with 138."""
    cluster = write_cluster(tmp_path, ps=1, workers=1)
    with open(cluster, "a") as f:
        f.write("num_clones: 2\n")
    # TensorFlow's teardown of a server at interpreter exit can crash (SIGSEGV, exit 139), which a
    # supervisor takes for a permanent failure: made to crash there every time, the server must
    # still end with its own code.
    crash_at_exit = (
        "import atexit, os, signal\natexit.register(lambda: os.kill(os.getpid(), signal.SIGSEGV))\n"
    )
    env = clean_env(PYTHONPATH=site_hook(tmp_path, crash_at_exit))
    notes_dir = tmp_path / "notes"
    notes_dir.mkdir()
    for extra, sent, code, supervised in (
        ([], signal.SIGTERM, 143, False),
        (["--num_clones=2"], signal.SIGINT, 130, False),
        ([], signal.SIGINT, 143, True),
    ):
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
            env=dict(env, **{notes.NOTES_ENV: str(notes_dir)}) if supervised else env,
        )
        try:
            lines = []
            while not lines or "serving on" not in lines[-1]:
                lines.append(proc.stdout.readline())
                assert lines[-1], "ps exited before serving:\n" + "".join(lines)
            # Its address in the file is 127.0.0.1, yet TensorFlow's server listens on every
            # interface (docs/security.md and doctor say so).
            port = int(lines[-1].rsplit(":", 1)[1])
            bound = {
                c.laddr.ip for c in psutil.Process(proc.pid).net_connections("tcp") if c.laddr.port == port
            }
            assert bound and bound <= {"0.0.0.0", "::"}, bound
            if supervised:  # as host/processes.py send() does on Windows, just before its stop
                notes.leave_for_child(str(notes_dir), proc.pid, notes.SYSTEM_STOP)
            proc.send_signal(sent)
            # Stopped without the master's word (a drained node): retryable, for a supervisor to restart.
            assert proc.wait(timeout=30) == code
            out = proc.stdout.read()
            assert f"ps:0: stopped by signal {15 if supervised else int(sent)}; exit {code}" in out, out
            assert "asking the master" not in out
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert "od-dist device policy: no GPU visible" in (tmp_path / "model" / "logs" / "ps-0.log").read_text()
    # No master ever comes: the server gives up after --wait_timeout instead of waiting forever.
    r = run("train", f"--cluster={cluster}", "--role=ps", "--wait_timeout=2", cwd=str(tmp_path), timeout=120)
    assert r.returncode == 138  # LOST_PEER: retryable
    assert re.search(r"ps:0: lost the master at 127\.0\.0\.1:\d+ \(unreachable for 2 s\)", r.stderr), r.stderr


def test_every_role_applies_the_device_policy(ps_job, tmp_path, data_dir):
    """The same device policy (memory growth on every GPU) in every role that imports TensorFlow;
    each process writes what it applied to its log: every task of the reference job and its
    `od-dist eval`. `od-dist eval` without a checkpoint gives up (1) after applying it too. (No GPU
    here: the memory-growth branch itself is not exercised.)"""
    logs = os.path.join(ps_job.model_dir, "logs")
    for name in ("ps-0", "worker-0", "worker-1", "master-0", "evaluator-0", "eval"):
        with open(os.path.join(logs, f"{name}.log")) as f:
            assert "od-dist device policy: no GPU visible" in f.read(), name
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    r = run("eval", f"--pipeline={PIPELINE}", f"--model_dir={model_dir}", tiny(data_dir), cwd=str(tmp_path))
    assert r.returncode == 1 and "no checkpoint" in r.stderr, r.stdout + r.stderr
    assert "od-dist device policy: no GPU visible" in (model_dir / "logs" / "eval.log").read_text()


# The same gradients applied by two legacy Keras SGD-momentum optimizers (Model Garden's default)
# on two copies of three variables on a ps: one sends each step's gradients whole
# (strategy.gradients_to_ps_whole), one per variable. Servers in this process, free loopback ports.
PACKED = """
import sys
import numpy as np
import tensorflow as tf
import tf_keras
from od_dist import patches
from od_dist.task import strategy
chief, worker, ps = (f"127.0.0.1:{port}" for port in sys.argv[1:4])
spec = tf.train.ClusterSpec({"chief": [chief], "worker": [worker], "ps": [ps]})
for job in ("worker", "ps"):
    tf.distribute.Server(spec, job_name=job, task_index=0, protocol="grpc", start=True)
dist = tf.distribute.experimental.ParameterServerStrategy(
    tf.distribute.cluster_resolver.SimpleClusterResolver(spec, task_type="chief", task_id=0, rpc_layer="grpc")
)
coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(dist)
shapes = [(3, 3, 2, 4), (4,), (5, 7)]
runs = {}
for whole in (True, False):
    with dist.scope():
        variables = [tf.Variable(np.linspace(-1, 1, int(np.prod(s)), dtype=np.float32).reshape(s)) for s in shapes]
        optimizer = tf_keras.optimizers.legacy.SGD(0.1, momentum=0.9)
        patches.tf_keras.create_optimizer_slots(optimizer, variables)
    print("packs", whole, strategy.gradients_to_ps_whole(dist, optimizer) if whole else 0)

    @tf.function
    def step():
        def replica():
            with tf.GradientTape() as tape:
                loss = tf.add_n([tf.reduce_sum(tf.sin(3.0 * v) * v) for v in variables])
            optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        dist.run(replica)

    for _ in range(3):
        coordinator.schedule(step)
    coordinator.join()
    graph = step.get_concrete_function().graph
    cuts = [op for op in graph.get_operations() if op.type == "SplitV"]
    print("cut on the ps", whole, len(cuts), all("/job:ps" in op.device for op in cuts))
    pieces = [c for op in cuts for out in op.outputs for c in out.consumers()]
    users = [u for p in pieces for out in p.outputs for u in out.consumers()]
    print("used on the ps", whole, [u.type for u in users], all("/job:ps" in u.device for u in users))
    runs[whole] = [v.numpy() for v in variables]
print("same values", all(np.array_equal(a, b) for a, b in zip(runs[True], runs[False])))
print("moved", not np.array_equal(runs[True][0], np.linspace(-1, 1, 72, dtype=np.float32).reshape(shapes[0])))
sys.stdout.flush()
import os
os._exit(0)
"""


def test_gradients_sent_to_the_ps_whole_apply_the_same_values_as_one_per_variable():
    r = subprocess.run(
        [sys.executable, "-c", PACKED, *map(str, free_ports(3))],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=clean_env(),
        timeout=180,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    said = r.stdout.splitlines()
    assert said == [
        "packs True 1",
        "cut on the ps True 1 True",  # one tensor a step, cut into the three gradients on the ps
        # and each piece goes to its update there, not back to the worker
        "used on the ps True ['ResourceApplyKerasMomentum', 'ResourceApplyKerasMomentum', "
        "'ResourceApplyKerasMomentum'] True",
        "packs False 0",
        "cut on the ps False 0 True",
        "used on the ps False [] True",
        "same values True",  # bit for bit, after three steps of momentum
        "moved True",
    ], r.stdout + r.stderr[-3000:]


STOP_FROM_MASTER = """
import json, sys
import tensorflow as tf
from od_dist.cluster import spec
from od_dist.task import server
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
        # TensorFlow logs "Waiting for new checkpoint" when the evaluator starts polling and again
        # after each --wait_timeout without one: at the third it has outlasted --wait_timeout twice.
        log = model_dir / "logs" / "evaluator-0.log"
        deadline = time.monotonic() + 240
        while not (log.exists() and log.read_text().count("Waiting for new checkpoint") >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.5)
        assert "od-dist device policy" in log.read_text()
        assert proc.poll() is None, proc.stdout.read()
        lead.close()
        # Its failure is the evaluation's, never the job's (the evaluator runs under a supervisor of
        # its own): exit 0, saying evaluation is missing and why.
        assert proc.wait(timeout=120) == 0
        out = proc.stdout.read()
        assert "no checkpoint appeared" in out and "evaluation is missing" in out, out[-3000:]
    finally:
        lead.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
