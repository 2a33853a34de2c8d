"""Faults under the supervisor, with real TensorFlow tasks on loopback: a lost parameter_server
worker, a lost ps, a lost multi_worker_mirrored trainer, a final save that outlasts a finished
peer, a permanent error and Ctrl+C. (One machine's `train --max_restarts` is in
test_faults_trainer.py, with that machine's other faults.) Each job is a few steps long and
bounded in time; no process of a test outlives it. Recovery times are printed (pytest -s) for the
table of docs/faults.md."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from loopback import PIPELINE, checkpoint_step, clean_env, site_hook, tiny, write_cluster

from od_dist.task.group import BROADCAST, FOLDERS_COMPARED


def wait_for_checkpoint(model_dir, timeout=120):
    deadline = time.monotonic() + timeout
    while checkpoint_step(model_dir) is None:
        assert time.monotonic() < deadline, f"no checkpoint in {model_dir} after {timeout} s"
        time.sleep(0.2)
    return checkpoint_step(model_dir)


class Job:
    """An od-dist command in its own session, its output read line by line with arrival times;
    every process it ever started is remembered and must be gone at the end."""

    def __init__(self, *args, cwd, env=None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "od_dist", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=cwd,
            env=clean_env(**(env or {})),
            start_new_session=True,
        )
        self.lines = []  # (time, line)
        self.seen = {}  # pid -> psutil.Process: every descendant ever seen
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        threading.Thread(target=self._watch, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def _watch(self):
        while self.proc.poll() is None:
            self.track()
            time.sleep(0.5)

    @property
    def out(self):
        return "".join(line for _, line in self.lines)

    def track(self):
        try:
            for c in psutil.Process(self.proc.pid).children(recursive=True):
                self.seen.setdefault(c.pid, c)
        except psutil.NoSuchProcess:
            pass

    def wait_for(self, pattern, timeout=300, after=0):
        """The first line (from index `after`) matching pattern: (index, time, match)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.track()
            for i in range(after, len(self.lines)):
                m = re.search(pattern, self.lines[i][1])
                if m:
                    return i, self.lines[i][0], m
            if self.proc.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.2)
        raise AssertionError(f"no line matching {pattern!r}; output:\n{self.out[-5000:]}")

    def task(self, role, index):
        self.track()
        return next(
            p
            for p in psutil.Process(self.proc.pid).children(recursive=True)
            if f"--role={role}" in p.cmdline() and f"--index={index}" in p.cmdline()
        )

    def finish(self, timeout=300):
        """Waits for the command's exit; then every process it ever started must be gone."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.close()
            raise
        self.reader.join(10)
        alive = psutil.wait_procs(list(self.seen.values()), timeout=30)[1]
        self.close()
        assert not alive, f"left running: {alive}"
        return self.proc.returncode

    def close(self):
        """Kills whatever is left (a failed test): the command, then each process it started."""
        self.track()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for p in self.seen.values():
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(list(self.seen.values()), timeout=30)
        self.reader.join(10)


def cpu_seconds(process):
    times = process.cpu_times()
    return times.user + times.system


def wait_in_log(path, run, pattern, timeout=300):
    """The first match of pattern in the run-th run (1-based) of a launch log (runs are appended,
    each after a '----- ... started -----' line): the log has every line, the console may not."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            runs = re.split(r"^----- .* started -----$", open(path, errors="replace").read(), flags=re.M)
        except OSError:
            runs = []
        if len(runs) > run:
            m = re.search(pattern, runs[run], re.M)
            if m:
                return time.monotonic(), m
        time.sleep(0.5)
    raise AssertionError(f"no {pattern!r} in run {run} of {path}")


@pytest.fixture
def jobs():
    started = []
    yield lambda *args, cwd, env=None: started.append(Job(*args, cwd=cwd, env=env)) or started[-1]
    for job in started:
        job.close()


def launch_args(tmp_path, data_dir, cluster, steps, *extra):
    return [
        "launch",
        f"--cluster={cluster}",
        f"--pipeline={PIPELINE}",
        f"--model_dir={tmp_path / 'model'}",
        tiny(data_dir, steps=steps),
        "--wait_timeout=120",
        *extra,
    ]


@pytest.mark.slow
def test_parameter_server_job_survives_a_lost_worker_and_a_lost_ps_then_ctrl_c(tmp_path, data_dir, jobs):
    """One parameter_server job under launch:

    1. kill -9 of worker:1: restarted alone, it rejoins (runs steps again) and training goes on.
    2. kill -9 of the ps: every task restarts and resumes from the last checkpoint (never below
       it); the restarted master appends to its log.
    3. Ctrl+C in a terminal reaches the launcher's whole process group; the tasks, in their own
       groups, hear only what the launcher sends: the master first (it saves a checkpoint), the
       servers after it; exit 130 and no process left.
    (That a job finishes with exit 0 after a restart of every task is proven end to end by the
    multi_worker_mirrored pair below, and with stand-in tasks in test_supervisor.py.)"""
    cluster = write_cluster(tmp_path, ps=1, workers=2)
    model_dir = str(tmp_path / "model")
    args = launch_args(tmp_path, data_dir, cluster, 100000, "--max_restarts=2")
    # A checkpoint every 25 steps, not every loop: the job trains on while its tasks restart, and
    # each save costs its coordinator more than the 5 steps (the test alone: 48 s and 65 s of CPU,
    # against 54 s and 71 s).
    args[4] = args[4].replace("checkpoint_interval=5", "checkpoint_interval=25")
    job = jobs(*args, cwd=str(tmp_path))
    i, _, _ = job.wait_for(r"\[master:0\] od-dist train \| step \d+/100000")
    job.task("worker", 1).kill()
    killed = time.monotonic()
    i, _, _ = job.wait_for(
        r"od-dist launch: worker:1 died \(exit 137, killed\); restart 1/2 of worker:1 alone "
        r"in 0 s",
        after=i,
    )
    i, back, _ = job.wait_for(r"\[worker:1\] worker:1 serving on", after=i)
    print(f"\nlost parameter_server worker: serving again {back - killed:.1f} s after kill -9")
    # Rejoined: it runs steps again, so it burns CPU like worker:0 (an idle server burns none).
    # Each progress line is a loop of 5 steps.
    w0, w1 = job.task("worker", 0), job.task("worker", 1)
    deadline = time.monotonic() + 240
    while True:
        cpu0, cpu1 = cpu_seconds(w0), cpu_seconds(w1)
        for _ in range(2):
            i, _, _ = job.wait_for(r"\[master:0\] od-dist train \| step \d+/100000", after=i + 1)
        d0, d1 = cpu_seconds(w0) - cpu0, cpu_seconds(w1) - cpu1
        if d1 > 0.25 * d0:
            break
        assert time.monotonic() < deadline, (
            f"worker:1 did not rejoin: {d1:.1f} s CPU vs {d0:.1f} s on worker:0"
        )
    print(
        f"lost parameter_server worker: running steps again {time.monotonic() - killed:.1f} s after kill -9 "
        f"(CPU over a loop: worker:0 {d0:.1f} s, worker:1 {d1:.1f} s)"
    )
    step = wait_for_checkpoint(model_dir)
    job.task("ps", 0).kill()
    killed = time.monotonic()
    # Training saved checkpoints since worker:1's restart: the count of restarts in a row starts
    # over, and the backoff's with it.
    i, _, _ = job.wait_for(
        r"od-dist launch: ps:0 died \(exit 137, killed\); restart 1/2 \(2 in all\) of every task in 0 s",
        after=i,
    )
    resumed_at, m = wait_in_log(
        os.path.join(model_dir, "logs", "master-0.log"),
        2,
        r"train \| step:\s+(\d+) \| training until step 100000",
    )
    assert int(m.group(1)) >= step, job.out[-5000:]
    i, first_step, m = job.wait_for(r"\[master:0\] od-dist train \| step (\d+)/100000", after=i)
    resumed = int(m.group(1))
    assert resumed > step
    print(
        f"lost ps: training resumed at step {resumed} (last checkpoint {step}) "
        f"{first_step - killed:.1f} s after kill -9 (restored {resumed_at - killed:.1f} s)"
    )
    log = open(os.path.join(model_dir, "logs", "master-0.log")).read()
    assert log.count(" master:0 started -----") == 2  # the restarted master appended to its log

    os.killpg(job.proc.pid, signal.SIGINT)
    start = time.monotonic()
    i, _, _ = job.wait_for(r"od-dist launch: SIGINT: asking master:0 to save a checkpoint and stop", after=i)
    assert job.finish(timeout=150) == 130, job.out[-5000:]
    print(f"Ctrl+C under launch: every task gone {time.monotonic() - start:.1f} s after SIGINT")
    assert checkpoint_step(model_dir) >= resumed, job.out[-5000:]  # the master saved where it stopped
    # The servers stopped after the master, not on the SIGINT (2): told by the master, which a
    # Ctrl+C ends the job for, or by the launcher's SIGTERM (15) if that came first.
    for name in ("ps:0", "worker:0", "worker:1"):
        job.wait_for(
            rf"\[{name}\] {name}: (the master was stopped \(Ctrl\+C\); stopping|stopped by signal 15)",
            after=i,
            timeout=1,
        )
    assert "stopped by signal 2" not in job.out, job.out[-5000:]


# Imported by every Python process of a job (PYTHONPATH): the master's final save is slow, as on a
# slow network share. Its write of the `checkpoint` state file that names the final checkpoint
# (after the shards and every collective of the save) lasts twice the window in which a watching
# trainer takes a closed port for a lost peer; the worker, its own save done, must still be waiting
# then (no trainer exits before every one holds the final checkpoint). TensorFlow writes that file
# twice in every save (before and after it removes the oldest checkpoints): the first write waits,
# the second follows at once.
SLOW_FINAL_SAVE = """
import os

from od_dist.task import trainer as _trainer

_make = _trainer._controller_cls


def _slow_state_write(write):
    waited = []

    def slow(save_dir, model_checkpoint_path, *args, **kwargs):
        final = model_checkpoint_path.endswith("ckpt-" + os.environ["OD_DIST_TEST_FINAL_STEP"])
        if os.path.abspath(save_dir) == os.environ["OD_DIST_TEST_MODEL_DIR"] and final and not waited:
            waited.append(True)
            import time

            from od_dist.protocol import peers
            from od_dist.task.server import is_listening

            print("test: the final save waits", flush=True)
            time.sleep(2 * (int(os.environ["OD_DIST_TEST_LOST_PEER_S"]) + peers.PROBE_S))
            port = int(os.environ["OD_DIST_TEST_WORKER_PORT"])
            worker = "waiting" if is_listening("127.0.0.1", port) else "gone"
            print(f"test: the final save goes on, the worker {worker}", flush=True)
        return write(save_dir, model_checkpoint_path, *args, **kwargs)

    return slow


def _slow_controller_cls():
    from tensorflow.python.checkpoint import checkpoint_management as cm

    if not getattr(cm.update_checkpoint_state_internal, "slow", False):
        cm.update_checkpoint_state_internal = _slow_state_write(cm.update_checkpoint_state_internal)
        cm.update_checkpoint_state_internal.slow = True
    return _make()


_trainer._controller_cls = _slow_controller_cls
"""


@pytest.mark.slow
def test_a_multi_worker_mirrored_pair_says_what_it_moves_and_a_lost_trainer_restarts_both(
    tmp_path, data_dir, jobs
):
    """The multi_worker_mirrored pair under launch trains with 2 replicas in sync:

    1. The master says how many bytes each step all-reduces, and in how many packs (the ring
       all-reduce, --fixed_replica_batch); TensorFlow's own log on each trainer agrees.
    2. kill -9 of the worker restarts both trainers, which resume from the last checkpoint and
       finish.
    3. The master's final save, made slow (SLOW_FINAL_SAVE), outlasts the worker's, which then
       waits for it: neither trainer's watch takes the other for a lost peer (no exit 138) and the
       job ends with exit 0."""
    cluster = write_cluster(tmp_path, ps=0, workers=1)
    model_dir = str(tmp_path / "model")
    slow_final_save = {
        "PYTHONPATH": site_hook(tmp_path, SLOW_FINAL_SAVE),
        "OD_DIST_TEST_WORKER_PORT": open(cluster).read().split("worker: [127.0.0.1:")[1].split("]")[0],
        "OD_DIST_TEST_MODEL_DIR": model_dir,
        "OD_DIST_TEST_FINAL_STEP": "20",
        "OD_DIST_TEST_LOST_PEER_S": "4",  # --lost_peer_timeout: shorter than the default, a faster test
    }
    # Model Garden's own preemption handler restores the chief alone before training, which puts
    # the two trainers' collectives out of step after a resume; od-dist's trainer turns it off.
    # 20 steps: the kill follows the first checkpoint, so the resumed pair still trains a loop or more.
    args = launch_args(
        tmp_path,
        data_dir,
        cluster,
        20,
        "--max_restarts=1",
        "--fixed_replica_batch",
        f"--lost_peer_timeout={slow_final_save['OD_DIST_TEST_LOST_PEER_S']}",
    )
    args[4] += ",trainer.preemption_on_demand_checkpoint=false,runtime.all_reduce_alg=ring"
    job = jobs(*args, cwd=str(tmp_path), env=slow_final_save)
    i, _, _ = job.wait_for(r"\[master:0\] od-dist train \| step \d+/20")
    step = wait_for_checkpoint(model_dir)  # a kill during the save would leave none to resume from
    job.task("worker", 0).kill()
    killed = time.monotonic()
    i, _, _ = job.wait_for(
        r"od-dist launch: worker:0 died \(exit 137, killed\); restart 1/1 of every task in 0 s", after=i
    )
    _, m = wait_in_log(
        os.path.join(model_dir, "logs", "master-0.log"),
        2,
        r"train \| step:\s+(\d+) \| training until step 20",
    )
    assert int(m.group(1)) >= step
    _, first_step, m = job.wait_for(r"\[master:0\] od-dist train \| step (\d+)/20", after=i)
    print(
        f"\nlost multi_worker_mirrored trainer: training again at step {m.group(1)} (last checkpoint {step}) "
        f"{first_step - killed:.1f} s after kill -9"
    )
    assert job.finish() == 0, job.out[-5000:]
    assert checkpoint_step(model_dir) == 20
    out = job.out
    # The restarted pair's run, from the master's log (every line, in order, after its second start).
    log = open(os.path.join(model_dir, "logs", "master-0.log"), errors="replace").read()
    restarted = re.split(r"^----- .* started -----$", log, flags=re.M)[2]
    assert "od-dist train | done at step 20" in restarted, restarted[-5000:]
    assert "test: the final save goes on, the worker waiting" in restarted, restarted[-5000:]
    assert "exit 138" not in restarted, restarted[-5000:]
    assert out.count("[worker:0] worker:0: training with MultiWorkerMirroredStrategy") == 2
    # On one shared model_dir the worker's copy goes to a temporary folder and is dropped: its save
    # lines stay in its log, off the console (the master's say where the checkpoint is).
    assert "[master:0] saved checkpoint to " in out and "[worker:0] saved checkpoint to" not in out, out[
        -3000:
    ]
    worker_log = open(os.path.join(model_dir, "logs", "worker-0.log"), errors="replace").read()
    assert "saved checkpoint to " in worker_log, worker_log[-3000:]
    for name in ("master:0", "worker:0"):
        assert f"[{name}] {name}: training with MultiWorkerMirroredStrategy, 2 replica(s) in sync" in out

    # What each step moves: the same line in each of the two runs.
    m = re.search(
        r"master:0: network: each step all-reduces ([\d.]+) MB of gradients; each of the 2 trainers "
        r"sends and receives ([\d.]+) MB per step \(ring\)",
        out,
    )
    assert m, out[-4000:]
    # The tests' model (loopback.SMALL), about 1.4 MB: its weights, so the bytes, do not depend on the
    # input size.
    assert 1.0 < float(m.group(1)) < 3.0 and m.group(1) == m.group(2)
    assert "--fixed_replica_batch: global batch 2 x 2 replicas = 4, learning rate x2" in out
    # The gradients go in at most 4 packs (--all_reduce_packs' default), each all-reduced as the
    # backward pass computes it: the master says how many, as TensorFlow's own log line on every
    # trainer does.
    packs = re.search(
        r"all-reduced in ([1-4]) packs of [\d.]+( to [\d.]+)? MB as the backward pass computes", out
    )
    assert packs, out[-4000:]
    for task in ("master-0", "worker-0"):
        log = open(os.path.join(model_dir, "logs", f"{task}.log"), errors="replace").read()
        launched = re.findall(r"Collective all_reduce tensors: (\d+) all_reduces, .*num_packs = (\d+)", log)
        # The large ones: each start's gradients, a tensor per trainable variable (96 in the tests'
        # model), as its first step is traced. The others carry one tensor each.
        large = [(int(n), p) for n, p in launched if int(n) > 50]
        assert len(large) == 2 and large[0] == large[1] and large[0][1] == packs.group(1), launched
        # At step 0 the first start set every checkpointed variable to the master's in one
        # all-reduce a dtype (each trainer took its own initial values:
        # patches.tensorflow.local_initial_values); the restart restored one save on both: none.
        first, again = re.split(r"^----- .* started -----$", log, flags=re.M)[1:]
        sent = re.search(rf"{re.escape(BROADCAST)}: (\d+) variables in 2 all-reduces", first)
        assert sent and int(sent.group(1)) > 96 and BROADCAST not in again, first[-3000:]
        # Each start builds the model once (its check is the trained model's own build), and
        # Keras' reads of the batch-norm statistics as it builds all-reduce nothing (up to the
        # trainers' own start-up exchange, the first all-reduce they mean to make).
        for run in re.split(r"^----- .* started -----$", log, flags=re.M)[1:]:
            assert FOLDERS_COMPARED in run, run[-3000:]
            built = run.split(FOLDERS_COMPARED)[0]
            assert built.count("FPN input_specs") == 1 and "Collective all_reduce" not in built, built[-3000:]


@pytest.mark.slow
def test_sync_every_a_trainer_lost_between_meetings_resumes_from_weights_the_trainers_met_on(
    tmp_path, data_dir, jobs
):
    """Trainers that meet every 10 steps (the cluster file's sync_every): kill -9 of the worker
    once the first checkpoint is written, so between meetings. Both restart from the last
    checkpoint, which was written after a meeting (every checkpoint's step is a meeting's), and
    finish; after the restart the trainers' weights are again the same at every meeting (the
    digests each logs). What is lost is the steps since that checkpoint, as without sync_every."""
    from od_dist.task import local_sgd

    cluster = write_cluster(tmp_path, ps=0, workers=1)
    with open(cluster, "a") as f:
        f.write("sync_every: 10\n")
    model_dir = str(tmp_path / "model")
    args = launch_args(tmp_path, data_dir, cluster, 30, "--max_restarts=1", "--lost_peer_timeout=4")
    job = jobs(*args, cwd=str(tmp_path))
    i, _, _ = job.wait_for(r"\[master:0\] od-dist train \| step \d+/30")
    step = wait_for_checkpoint(model_dir)
    job.task("worker", 0).kill()
    job.wait_for(r"od-dist launch: worker:0 died \(exit 137, killed\); restart 1/1 of every task", after=i)
    assert job.finish() == 0, job.out[-5000:]
    assert checkpoint_step(model_dir) == 30
    saved = sorted(int(p.split("-")[1].split(".")[0]) for p in os.listdir(model_dir) if p.endswith(".index"))
    assert saved and all(s == 1 or s % 10 == 0 for s in saved), saved
    met = re.compile(re.escape(local_sgd.MET) + r" (\d+): weights ([0-9a-f]{16})")
    again = {}
    for task in ("master-0", "worker-0"):
        log = open(os.path.join(model_dir, "logs", f"{task}.log"), errors="replace").read()
        runs = re.split(r"^----- .* started -----$", log, flags=re.M)[1:]
        assert len(runs) == 2, log[-3000:]
        again[task] = met.findall(runs[1])
    assert again["master-0"] and again["master-0"] == again["worker-0"], again
    resumed = re.search(r"train \| step:\s+(\d+) \| training until step 30", runs[1])
    assert resumed and int(resumed.group(1)) >= step, runs[1][-3000:]
    assert int(resumed.group(1)) in saved, (resumed.group(1), saved)


def test_a_permanent_error_is_not_retried(tmp_path, jobs):
    pipeline = tmp_path / "bad.yaml"
    pipeline.write_text("experiment: retinanet_resnetfpn_coco\ntrainer: {train_stepz: 10}\n")
    job = jobs(
        "train",
        f"--pipeline={pipeline}",
        f"--model_dir={tmp_path / 'model'}",
        "--max_restarts=3",
        cwd=str(tmp_path),
    )
    assert job.finish(timeout=180) == 2, job.out
    assert "od-dist train: single:0 died (exit 2, invalid input); a permanent error, not retried" in job.out
    assert job.out.count("train_stepz") == 1  # one attempt only
