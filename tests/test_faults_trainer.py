"""Faults on loopback with real TensorFlow processes: a trainer stopped by a signal saves a
checkpoint, a kill during a save is harmless, one machine's `train --max_restarts` restarts its
killed task, lost peers end the survivors with one line and exit 138 (LOST_PEER), a stopped
parameter_server master resumes and Ctrl+C on its ps ends the job.

Every process is started here and killed in `finally`; every wait is bounded."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
from loopback import PIPELINE, SMALL, checkpoint_step, clean_env, site_hook, write_cluster

from od_dist.protocol import lineage, spare
from od_dist.task import phases

OVERRIDE = (
    "trainer.train_steps={steps},trainer.steps_per_loop=5,trainer.summary_interval=5,"
    "trainer.checkpoint_interval={interval},"
    "task.train_data.input_path={data}/train.tfrecord,task.validation_data.input_path={data}/val.tfrecord,"
    + SMALL
)
PROGRESS = re.compile(r"od-dist train \| step (\d+)/")

pytestmark = pytest.mark.slow


class Proc:
    """One od-dist process whose output is collected in a file (no pipe to fill up)."""

    def __init__(self, tmp_path, name, args, env=None, background=False):
        """`background`: started as a script's `od-dist ... &` is, with SIGINT ignored."""
        self.name = name
        self.log = tmp_path / f"{name}.log"
        env = clean_env(PYTHONUNBUFFERED="1", **(env or {}))
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "od_dist", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=str(tmp_path),
                env=env,
                preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if background else None,
            )

    @property
    def out(self):
        return self.log.read_text(errors="replace")

    def wait_for(self, predicate, timeout, what):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.out
            if predicate(out):
                return out
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"{self.name} exited {self.proc.returncode} before {what}:\n{out[-3000:]}"
                )
            time.sleep(0.5)
        raise AssertionError(f"{self.name}: no {what} within {timeout} s:\n{self.out[-3000:]}")

    def step(self):
        steps = [int(s) for s in PROGRESS.findall(self.out)]
        return steps[-1] if steps else 0

    def wait_step(self, above, timeout):
        self.wait_for(
            lambda out: any(int(s) > above for s in PROGRESS.findall(out)), timeout, f"step > {above}"
        )
        return self.step()

    def wait(self, timeout):
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name} still running after {timeout} s:\n{self.out[-3000:]}"
            ) from None

    def kill(self):
        if self.proc.poll() is None:
            tasks = psutil.Process(self.proc.pid).children(recursive=True)  # under --max_restarts
            self.proc.kill()
            self.proc.wait()
            for task in tasks:
                with contextlib.suppress(psutil.NoSuchProcess):
                    task.kill()


@pytest.fixture
def procs():
    """Every process a test starts; all killed at the end, whatever happened."""
    started = []
    yield started
    for p in started:
        p.kill()


def train_args(cluster, role, index, model_dir, data, steps=100000, interval=1000, wait=60, extra=()):
    args = [
        "train",
        f"--pipeline={PIPELINE}",
        f"--model_dir={model_dir}",
        f"--wait_timeout={wait}",
        "--params_override=" + OVERRIDE.format(steps=steps, interval=interval, data=data),
        *extra,
    ]
    if cluster:
        args += [f"--cluster={cluster}", f"--role={role}", f"--index={index}"]
    return args


# A sitecustomize for every process of the run: the first to save ckpt-10 is killed during that
# save, after the shards and the index are written, before the `checkpoint` state file names it
# (the last step of TensorFlow's save). Before it dies it leaves what a kill at an earlier point of
# a save leaves, named as TensorFlow names them: shards still under ckpt-15_temp/ (each written as
# *.tempstate<random> first), a state file being replaced; and it tears ckpt-10's index, as a kill
# while TensorFlow writes it in place does (complete, ckpt-10 would be resumed from:
# tests/test_defects.py). The contents are garbage: reading any of them would fail the run.
KILL_DURING_SAVE = """
import os, signal

from od_dist.task import trainer as _trainer

_make = _trainer._controller_cls


def _record_or_die(record):
    def record_or_die(save_dir, model_checkpoint_path, *args, **kwargs):
        once = os.environ["OD_DIST_TEST_KILLED"]
        if model_checkpoint_path.endswith("ckpt-10") and not os.path.exists(once):
            open(once, "w").close()
            os.mkdir(os.path.join(save_dir, "ckpt-15_temp"))
            shard = "part-00000-of-00001.data-00000-of-00001.tempstate8411"
            with open(os.path.join(save_dir, "ckpt-15_temp", shard), "wb") as f:
                f.write(b"x" * 64)
            for name in ("ckpt-15_temp/part-00000-of-00001.index", "ckpt-10.index"):
                with open(os.path.join(save_dir, name), "wb") as f:
                    f.write(b"garbage")
            with open(os.path.join(save_dir, "checkpoint.tempstate2207"), "w") as f:
                f.write('model_checkpoint_path: "ckpt-15"\\n')
            os.kill(os.getpid(), signal.SIGKILL)
        return record(save_dir, model_checkpoint_path, *args, **kwargs)

    return record_or_die


def _killing_controller_cls():
    from tensorflow.python.checkpoint import checkpoint_management as cm

    cm.update_checkpoint_state_internal = _record_or_die(cm.update_checkpoint_state_internal)
    return _make()


_trainer._controller_cls = _killing_controller_cls
"""


STOPPED = re.compile(
    r"(\S+): stopped at step (\d+) \(([^)]*)\); (saved (\S+)|the master saved it); exit (\d+)"
)


RESTARTED = re.compile(r"^od-dist train: single:0 died \(exit 137, killed\); restart 1/2 in 0 s$", re.M)
TAKEN = re.compile(r"^od-dist: a spare made ready \d+ s ago takes this start", re.M)


def children(pid):
    """A supervisor's children: (its task, its parked spare or None)."""
    procs = psutil.Process(pid).children()
    parked = [p for p in procs if p.name() == spare.PARKED_NAME]
    tasks = [p for p in procs if p not in parked]
    return (tasks[0] if tasks else None), (parked[0] if parked else None)


def test_single_machine_killed_during_a_save_is_restarted_and_resumes_then_sigterm_saves(
    tmp_path, data_dir, procs
):
    """One machine's trainer with two CPU clones (--num_clones 2 --clone_on_cpu: MirroredStrategy,
    2 replicas in sync) under `--max_restarts 2`, a checkpoint every 5 steps:

    1. SIGKILL during the save of ckpt-10 (leftovers of other unfinished saves beside it): the
       task is restarted, removes what the unfinished saves left (ckpt-10 with its index torn
       among them) and resumes from ckpt-5, which stayed the latest named.
    2. The restarted task trained a loop: a spare of it is made ready (TensorFlow imported,
       waiting); SIGKILL of the task: the restart takes the spare, which trains on.
    3. SIGTERM (to `od-dist train`, passed on to its task) then saves a checkpoint where it
       stopped, at most a loop after the signal, and exits 143; no process of it is left."""
    model_dir = tmp_path / "model"
    env = {
        "PYTHONPATH": site_hook(tmp_path, KILL_DURING_SAVE),
        "OD_DIST_TEST_KILLED": str(tmp_path / "killed"),
        phases.SHOW_ENV: "1",  # the spare's phase lines on the console, where this test reads them
    }
    args = train_args(None, None, None, model_dir, data_dir, interval=5)
    run = Proc(tmp_path, "train", [*args, "--num_clones=2", "--clone_on_cpu", "--max_restarts=2"], env=env)
    procs.append(run)

    # 1. Killed during a save, restarted, resumed from the previous checkpoint.
    out = run.wait_for(RESTARTED.search, 400, "the restart line")
    killed = time.monotonic()

    def restarted(out):
        return RESTARTED.split(out, maxsplit=1)[-1] if RESTARTED.search(out) else ""

    run.wait_for(lambda out: PROGRESS.search(restarted(out)), 400, "a step after the restart")
    resumed = restarted(run.out)
    assert re.search(r"restored (model )?from .*ckpt-5\b", resumed), resumed[-3000:]
    assert [int(s) for s in PROGRESS.findall(resumed)][0] == 6  # a start's first loop is one step
    for name in ("ckpt-10.index", "ckpt-10.data-00000-of-00001", "ckpt-15_temp", "checkpoint.tempstate2207"):
        assert re.search(rf"removed .*{re.escape(name)}, left by a save that did not finish", resumed), (
            resumed[-3000:]
        )
    print(f"\ntrain --max_restarts: resumed 5 steps back {time.monotonic() - killed:.1f} s after kill -9")

    # 2. A spare made ready, then taken by the next restart.
    deadline = time.monotonic() + 120
    while (parked := children(run.proc.pid))[1] is None:
        assert time.monotonic() < deadline, f"no spare within 120 s:\n{run.out[-3000:]}"
        time.sleep(0.5)
    task, ready = parked
    assert TAKEN.search(run.out) is None
    # Killed after a checkpoint past ckpt-5 (progress): the restart is then the first of a streak.
    # The spare is made at the restarted start's first loop, which can come before that save.
    run.wait_for(lambda out: (checkpoint_step(str(model_dir)) or 0) > 5, 120, "a checkpoint past ckpt-5")
    task.kill()
    run.wait_for(lambda out: TAKEN.search(out), 120, "the spare taking the start")
    run.wait_for(
        lambda out: "start-up | TensorFlow imported" in TAKEN.split(out, maxsplit=1)[-1],
        60,
        "the spare's TensorFlow imported line, after it took the start",
    )
    assert "od-dist train: single:0 died (exit 137, killed); restart 1/2 (2 in all) in 0 s" in run.out
    assert children(run.proc.pid)[0].pid == ready.pid  # the spare runs the task now
    run.wait_for(lambda out: PROGRESS.search(TAKEN.split(out, maxsplit=1)[-1]), 400, "a step in the spare")

    # 3. SIGTERM: a checkpoint where it stopped.
    before = run.step()
    run.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    left = psutil.Process(run.proc.pid).children()
    run.wait_for(lambda out: STOPPED.search(restarted(out)), 180, "the stopped line")
    saved = time.monotonic() - sent
    assert run.wait(180) == 143, run.out[-3000:]
    took = time.monotonic() - sent
    out = run.out
    assert "single: training with MirroredStrategy, 2 replica(s) in sync" in out, out[-3000:]
    assert "batch: global batch 2 split over 2 replicas, 1 each; learning rate and steps as written" in out
    assert "single: SIGTERM received; saving a checkpoint at the end of this loop" in out
    m = STOPPED.search(out)
    assert m and m.group(1) == "single" and m.group(3) == "SIGTERM" and m.group(6) == "143", out[-3000:]
    step = int(m.group(2))
    # Saved where it stopped, at most one loop (5 steps) after the signal.
    assert before <= step <= run.step() <= before + 10 and step == run.step()
    assert checkpoint_step(str(model_dir)) == step and m.group(5).endswith(f"ckpt-{step}")
    assert not [n for n in os.listdir(model_dir) if "temp" in n]
    assert not [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]  # a spare too
    print(f"single machine: SIGTERM to ckpt-{step} saved in {saved:.1f} s, exit 143 in {took:.1f} s")


# TensorFlow cannot be imported on this machine (a broken install), in every process of the test.
BROKEN_TENSORFLOW = """
import importlib.abc, sys

class _Broken(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "tensorflow":
            raise ModuleNotFoundError("No module named 'tensorflow' (broken by a test)", name="tensorflow")
        return None

sys.meta_path.insert(0, _Broken())
"""


def test_a_spare_whose_import_failed_leaves_it_to_the_start_that_takes_it(tmp_path, capfd, monkeypatch):
    """A spare (host/spare.py) whose import of TensorFlow fails still waits for its start: taken, it
    runs the task, which imports again and ends as a start from nothing does, with its line and exit
    code. (An exit of the spare's own, unexplained, would read to its supervisor as the task's
    permanent failure.)"""
    from od_dist.host.spare import Spare

    monkeypatch.setenv("PYTHONPATH", site_hook(tmp_path, BROKEN_TENSORFLOW))
    argv = [
        sys.executable,
        "-m",
        "od_dist",
        "train",
        f"--pipeline={PIPELINE}",
        f"--model_dir={tmp_path / 'm'}",
    ]
    cold = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=clean_env())
    assert cold.returncode == 1 and "No module named 'tensorflow' (broken by a test)" in cold.stderr, cold
    warm = Spare(argv)
    warm.prime()
    parked = warm.proc
    try:
        taken = warm.start()
        assert taken is parked and taken.wait(120) == cold.returncode
    finally:
        warm.close()
        parked.kill()
    out, err = capfd.readouterr()
    assert re.search(TAKEN, out), out + err
    assert cold.stderr.strip() in err, err


def test_every_parameter_server_worker_lost_then_the_master(tmp_path, data_dir, procs):
    """With no worker left for --wait_timeout the master exits 138 naming them (TensorFlow alone
    would wait an hour); the ps, its master gone for --wait_timeout, exits 138 naming it. The
    servers first: the master's port answers (its beacon) before it imports TensorFlow, so a short
    --wait_timeout covers the servers' wait for it."""
    wait = 10
    cluster = write_cluster(tmp_path, ps=1, workers=1)
    model_dir = tmp_path / "model"
    ps, w0 = (
        Proc(tmp_path, role, train_args(cluster, role, 0, model_dir, data_dir, wait=wait))
        for role in ("ps", "worker")
    )
    procs.extend([ps, w0])
    for p in (ps, w0):
        p.wait_for(lambda out: "serving on" in out, 400, "serving")
    master = Proc(tmp_path, "master", train_args(cluster, "master", 0, model_dir, data_dir, wait=wait))
    procs.append(master)
    master.wait_step(0, 400)
    w0.proc.kill()
    killed = time.monotonic()
    assert master.wait(wait + 60) == 138, master.out[-3000:]
    took = time.monotonic() - killed
    assert wait <= took <= wait + 30
    assert re.search(
        rf"od-dist: master:0: lost worker:0 at 127\.0\.0\.1:\d+ \(unreachable for {wait} s\); "
        r"every worker is gone.*; exit 138$",
        master.out,
        re.M,
    ), master.out[-3000:]
    master_gone = time.monotonic()
    assert ps.wait(wait + 60) == 138, ps.out[-3000:]
    assert re.search(rf"ps:0: lost the master at 127\.0\.0\.1:\d+ \(unreachable for {wait} s\)", ps.out)
    print(
        f"\nparameter_server: master exit 138 {took:.1f} s after kill -9 of its only worker "
        f"(--wait_timeout {wait}); ps exit 138 {time.monotonic() - master_gone:.1f} s after the master"
    )


def servers_up(tmp_path, procs, cluster, model_dir, data_dir, wait, workers=1):
    """The ps and the first `workers` workers, started by hand and serving."""
    started = [Proc(tmp_path, "ps", train_args(cluster, "ps", 0, model_dir, data_dir, wait=wait))]
    started += [
        Proc(tmp_path, f"worker{i}", train_args(cluster, "worker", i, model_dir, data_dir, wait=wait))
        for i in range(workers)
    ]
    procs.extend(started)
    for p in started:
        p.wait_for(lambda out: "serving on" in out, 400, "serving")
    return started


def test_a_master_stopping_at_its_records_check_tells_its_servers(tmp_path, data_dir, procs):
    """Every machine's train_data.input_path matches nothing: the master exits 2 at its records
    check, before it connects to anyone, and says so on its port; the ps and the worker exit 2 with
    its reason within seconds, not after --wait_timeout with a retryable 138."""
    wait = 120
    cluster = write_cluster(tmp_path, ps=1, workers=1)
    model_dir = tmp_path / "model"
    missing = tmp_path / "nowhere"
    servers = servers_up(tmp_path, procs, cluster, model_dir, missing, wait)
    master = Proc(tmp_path, "master", train_args(cluster, "master", 0, model_dir, missing, wait=wait))
    procs.append(master)
    assert master.wait(300) == 2, master.out[-3000:]
    gone = time.monotonic()
    assert f"{missing}/train.tfrecord" in master.out.strip().splitlines()[-1], master.out[-3000:]
    for p in servers:
        assert p.wait(30) == 2, p.out[-3000:]
        assert re.search(
            r"the master stopped before training \(pipeline .*nowhere.*; exit 2; stopping$", p.out, re.M
        ), p.out[-3000:]
    print(f"\nmaster exit 2 at its records check: servers gone {time.monotonic() - gone:.1f} s after it")


def test_ctrl_c_on_a_master_waiting_for_its_peers_ends_the_job_everywhere(tmp_path, data_dir, procs):
    """Ctrl+C on the master while it waits for a worker that is late (before TensorFlow connects,
    before the stop handler of training): every machine exits 130, at once. The master was started
    in the background of a script (SIGINT ignored), which od-dist overrides as its stop handler does."""
    cluster = write_cluster(tmp_path, ps=1, workers=2)
    model_dir = tmp_path / "model"
    servers = servers_up(tmp_path, procs, cluster, model_dir, data_dir, 120)  # worker:1 never comes
    master = Proc(
        tmp_path, "master", train_args(cluster, "master", 0, model_dir, data_dir, wait=120), background=True
    )
    procs.append(master)
    master.wait_for(lambda out: "waiting for worker:1" in out, 300, "its wait for worker:1")
    master.proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    assert master.wait(30) == 130, master.out[-3000:]
    for p in servers:
        assert p.wait(30) == 130, p.out[-3000:]
        assert "the master was stopped (Ctrl+C); stopping; exit 130" in p.out, p.out[-3000:]
    print(
        f"\nCtrl+C on a master waiting for its peers: every process gone {time.monotonic() - sent:.1f} s after it"
    )


# The ps's machine is slow to load TensorFlow: the Ctrl+C comes while it still starts. (It says
# so in a file: od-dist keeps lines that are not its own off the console.)
SLOW_START = """
import importlib.abc, os, sys, time

class _Slow(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "tensorflow":
            sys.meta_path.remove(self)
            open(os.path.join(os.getcwd(), "loading-tensorflow"), "w").close()
            time.sleep(30)
        return None

sys.meta_path.insert(0, _Slow())
"""


def test_ctrl_c_on_a_ps_still_starting_ends_the_job_everywhere(tmp_path, data_dir, procs):
    """Ctrl+C on the ps while it starts (before it serves, so before its stop handler), the master
    waiting for it: the ps says so on its port, the master ends with 130 and tells the worker,
    which ends with 130 too; no machine waits --wait_timeout. The ps runs as a script's background
    job (SIGINT ignored)."""
    cluster = write_cluster(tmp_path, ps=1, workers=1)
    model_dir = tmp_path / "model"
    w0 = Proc(tmp_path, "worker0", train_args(cluster, "worker", 0, model_dir, data_dir, wait=120))
    master = Proc(tmp_path, "master", train_args(cluster, "master", 0, model_dir, data_dir, wait=120))
    procs.extend([w0, master])
    w0.wait_for(lambda out: "serving on" in out, 400, "serving")
    master.wait_for(lambda out: "waiting for ps:0" in out, 400, "its wait for ps:0")
    hook = site_hook(tmp_path, SLOW_START)
    path = os.pathsep.join(p for p in (hook, os.environ.get("PYTHONPATH")) if p)
    ps = Proc(
        tmp_path,
        "ps",
        train_args(cluster, "ps", 0, model_dir, data_dir, wait=120),
        {"PYTHONPATH": path},
        background=True,
    )
    procs.append(ps)
    ps.wait_for(lambda out: (tmp_path / "loading-tensorflow").exists(), 300, "its start")
    ps.proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    assert ps.wait(60) == 130, ps.out[-3000:]
    assert "ps:0: Ctrl+C before the job started; telling the peers waiting for it" in ps.out, ps.out[-3000:]
    assert "serving on" not in ps.out, ps.out[-3000:]  # it was still starting
    assert master.wait(30) == 130, master.out[-3000:]
    assert "master:0: ps:0 was stopped (Ctrl+C); stopping before training (exit 130)" in master.out, (
        master.out[-3000:]
    )
    assert w0.wait(30) == 130, w0.out[-3000:]
    assert "worker:0: the master stopped the job: ps:0 was stopped (Ctrl+C); stopping; exit 130" in w0.out, (
        w0.out[-3000:]
    )
    print(f"\nCtrl+C on a ps still starting: every process gone {time.monotonic() - sent:.1f} s after it")


def test_parameter_server_master_stops_and_resumes_then_ctrl_c_on_the_ps(tmp_path, data_dir, procs):
    """SIGTERM to the master mid-loop saves a checkpoint (exit 143) while the servers wait; the
    master restarted resumes from it; Ctrl+C to the ps stops every process, the master after a
    checkpoint. (A lost worker that rejoins is in test_faults.py's parameter_server job.)"""
    cluster = write_cluster(tmp_path, ps=1, workers=1, evaluator=True)
    model_dir = tmp_path / "model"

    def task(role, index, name=None, **kw):
        # --wait_timeout 180: the servers wait that long for the master's restart (a TensorFlow
        # process can take a minute to start on a loaded machine).
        p = Proc(
            tmp_path,
            name or f"{role}{index}",
            train_args(cluster, role, index, model_dir, data_dir, wait=180, **kw),
        )
        procs.append(p)
        return p

    ps, w0, master = task("ps", 0), task("worker", 0), task("master", 0)
    # The evaluator's machine as its generated script runs it: a pause of the master is waited
    # for; a person's stop ends it with 130, not a wait of --wait_timeout and an exit 0.
    evaluator = task("evaluator", 0, extra=["--max_restarts=2"])
    master.wait_step(5, 400)

    master.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    master.wait_for(lambda out: STOPPED.search(out), 180, "the stopped line")
    saved = time.monotonic() - sent
    assert master.wait(180) == 143, master.out[-3000:]
    print(
        f"parameter_server: SIGTERM to master saved in {saved:.1f} s, exit 143 in {time.monotonic() - sent:.1f} s"
    )
    m = STOPPED.search(master.out)
    assert m and m.group(1) == "master:0" and m.group(3) == "SIGTERM", master.out[-3000:]
    stopped = int(m.group(2))
    assert stopped == master.step() and checkpoint_step(str(model_dir)) == stopped
    assert all(p.proc.poll() is None for p in (ps, w0, evaluator))  # they wait for the master's restart

    # Restarted, it resumes there. Ctrl+C on the ps's machine is a person ending the job: the ps
    # asks the master, which saves, tells the servers, and every process exits 130 (no supervisor
    # restarts them), instead of the master losing the ps and every machine waiting --wait_timeout.
    master = task("master", 0, name="master-restarted")
    master.wait_step(stopped, 400)
    assert re.search(rf"restored (model )?from .*ckpt-{stopped}\b", master.out), master.out[-3000:]
    assert [int(s) for s in PROGRESS.findall(master.out)][0] == stopped + 1  # a start's first loop: a step
    ps.proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    assert master.wait(180) == 130, master.out[-3000:]
    m = STOPPED.search(master.out)
    assert m and m.group(3) == "ps:0 was stopped by Ctrl+C", master.out[-3000:]
    assert checkpoint_step(str(model_dir)) == int(m.group(2)), master.out[-3000:]
    assert "master:0: stopped the job: ps:0 was stopped by Ctrl+C; told ps:0, worker:0 to stop" in (
        master.out
    ), master.out[-3000:]
    assert "ps:0: Ctrl+C: asking the master to save a checkpoint and end the job" in ps.out, ps.out[-2000:]
    for p in (ps, w0):  # told: their --wait_timeout is 180 s
        assert p.wait(90) == 130, p.out[-2000:]
        assert "the master stopped the job: ps:0 was stopped by Ctrl+C; stopping; exit 130" in p.out, p.out[
            -2000:
        ]
    assert evaluator.wait(150) == 130, evaluator.out[-3000:]  # its --wait_timeout is 180 s
    assert (
        f"evaluator: master:0 was stopped by a person (ps:0 was stopped by Ctrl+C) at step {m.group(2)}; exit 130"
        in (evaluator.out)
    ), evaluator.out[-3000:]
    assert "training finished" not in evaluator.out and "restart 1/" not in evaluator.out, evaluator.out[
        -3000:
    ]
    print(f"parameter_server: Ctrl+C to the ps: every process gone {time.monotonic() - sent:.1f} s after it")


def test_multi_worker_mirrored_pair_stop_and_mismatch(tmp_path, data_dir, procs):
    """One multi_worker_mirrored pair, its gradients all-reduced in bfloat16, each trainer its own
    model_dir (two machines without a shared folder), started twice:

    1. SIGTERM to the worker only: at the next loop boundary both trainers save the same step,
       each into its own model_dir, and exit 143.
    2. The worker with float32 all-reduces: both exit 2 naming the flag, before any restore
       (which is collective and would fail inside TensorFlow).

    (A trainer on a new disk resuming from the others' checkpoint, and the survivors of a lost
    trainer exiting 138 naming it: test_lan_mirrored.py's separate disks, and test_faults.py's pair.)"""
    cluster = write_cluster(tmp_path, ps=0, workers=1, strategy="multi_worker_mirrored")
    model_dir, own = tmp_path / "model", tmp_path / "worker-own"

    def pair(name, worker_dir=own, worker_dtype="bfloat16", steps=100000):
        bf16 = ("--all_reduce_dtype=bfloat16",)
        started = (
            Proc(
                tmp_path,
                f"master-{name}",
                train_args(cluster, "master", 0, model_dir, data_dir, steps, extra=bf16),
            ),
            Proc(
                tmp_path,
                f"worker-{name}",
                train_args(
                    cluster,
                    "worker",
                    0,
                    worker_dir,
                    data_dir,
                    steps,
                    extra=(f"--all_reduce_dtype={worker_dtype}",),
                ),
            ),
        )
        procs.extend(started)
        return started

    # 1. The stop saves the same step on every trainer, each into its own model_dir.
    master, worker = pair("stop")
    worker.wait_step(0, 600)
    worker.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    assert worker.wait(240) == 143, worker.out[-3000:]
    assert master.wait(60) == 143, master.out[-3000:]
    print(f"\nmulti_worker_mirrored: SIGTERM to the worker to both exit 143: {time.monotonic() - sent:.1f} s")
    m, w = STOPPED.search(master.out), STOPPED.search(worker.out)
    assert m and w, master.out[-2000:] + worker.out[-2000:]
    assert (
        m.group(2) == w.group(2)
        and m.group(3) == "worker:0 was stopped by SIGTERM"
        and w.group(3) == "SIGTERM"
    )
    stopped = int(m.group(2))
    assert checkpoint_step(str(model_dir)) == stopped and checkpoint_step(str(own)) == stopped
    assert w.group(5) == f"{own}/ckpt-{stopped}", worker.out[-2000:]
    # One model on both: each trainer's variables took its own initial values, then the master's in
    # one broadcast (patches.tensorflow.local_initial_values), and every step changed them alike.
    import numpy as np
    import tensorflow as tf

    def differ(step):
        saved = [tf.train.load_checkpoint(f"{d}/ckpt-{step}") for d in (model_dir, own)]
        names = sorted(n for n in saved[0].get_variable_to_shape_map() if n != "_CHECKPOINTABLE_OBJECT_GRAPH")
        assert len(names) > 100 and set(names) < set(saved[1].get_variable_to_shape_map())
        return [n for n in names if not np.array_equal(saved[0].get_tensor(n), saved[1].get_tensor(n))]

    assert differ(stopped) == []
    # Started again, each restores its own copy of that save, with no broadcast: still one model.
    resumed = pair("resume", steps=stopped + 2)
    for p in resumed:
        assert p.wait(600) == 0, p.out[-3000:]
    assert checkpoint_step(str(model_dir)) == checkpoint_step(str(own)) == stopped + 2
    assert "sent over the all-reduce" not in resumed[0].out, resumed[0].out[-3000:]
    assert differ(stopped + 2) == []
    assert re.search(
        r"master:0: .*; all-reduced in bfloat16 in [1-4] packs of 0\.\d+( to 0\.\d+)? MB", master.out
    ), master.out[-3000:]

    # 2. The trainers must all-reduce alike, and go on with one run: the worker's folder now holds
    # another run's checkpoint at the same step (a folder of an earlier training of this file).
    run = lineage.run_of(str(model_dir))
    assert run and lineage.run_of(str(own)) == run, (master.out[-2000:], worker.out[-2000:])
    lineage.write_run(str(own), "0123456789ab")
    for p, here, other in zip(
        pair("mismatch", own, "float32"), ("bfloat16", "float32"), ("worker", "master")
    ):
        assert p.wait(600) == 2, p.out[-3000:]
        assert (
            f"--all_reduce_dtype: {here} here, another value on {other}:0: every trainer needs the same "
            "--all_reduce_dtype; start them all with one command line" in p.out
        ), p.out[-3000:]
        assert (
            f"checkpoints of two runs: master:0 holds run {run} at step {stopped + 2:,}, worker:0 holds run "
            f"0123456789ab at step {stopped + 2:,}" in p.out
        ), p.out[-3000:]
        assert "different steps" not in p.out, p.out[-3000:]
    assert lineage.run_of(str(own)) == "0123456789ab"  # nothing taken over


# For every process of the run: the master's final save (ckpt-<OD_DIST_TEST_FINAL_STEP> in
# OD_DIST_TEST_MODEL_DIR) waits once, its shards written under ckpt-N_temp/ and not yet merged,
# until the test kills it: a kill during the final save's writes, after its collectives.
SLOW_FINAL_MERGE = """
import os, time

from od_dist.task import trainer as _trainer

_make = _trainer._controller_cls


def _slow(merge):
    def slow_merge(prefixes, destination, *args, **kwargs):
        to = destination.numpy().decode() if hasattr(destination, "numpy") else str(destination)
        folder, step = os.environ["OD_DIST_TEST_MODEL_DIR"], os.environ["OD_DIST_TEST_FINAL_STEP"]
        once = os.environ["OD_DIST_TEST_SLOWED"]
        if to == os.path.join(folder, "ckpt-" + step) and not os.path.exists(once):
            open(once, "w").close()
            print("test: the final save is being written", flush=True)
            time.sleep(300)
        return merge(prefixes, destination, *args, **kwargs)

    return slow_merge


def _slow_controller_cls():
    from tensorflow.python.ops import gen_io_ops

    if not hasattr(gen_io_ops.merge_v2_checkpoints, "slow"):
        gen_io_ops.merge_v2_checkpoints = _slow(gen_io_ops.merge_v2_checkpoints)
        gen_io_ops.merge_v2_checkpoints.slow = True
    return _make()


_trainer._controller_cls = _slow_controller_cls
"""


def test_multi_worker_mirrored_master_killed_in_its_final_save_restarts_both(tmp_path, data_dir, procs):
    """A multi_worker_mirrored pair, each trainer its own model_dir and its own `train
    --max_restarts 1` (two machines' scripts), 10 steps: the master's task is killed while it
    writes the final checkpoint (ckpt-10_temp/ in its folder), after the worker wrote its own
    ckpt-10. The worker does not exit 0 before every trainer holds the final checkpoint: it exits
    138 (a lost peer) and both are restarted; they resume at step 10 from the worker's copy (the
    master's folder ends at ckpt-5), save ckpt-10 again and both machines exit 0, each folder ending
    at a whole ckpt-10. (Before, the worker's machine exited 0 and the restarted master waited for
    it until --wait_timeout: exit 138.)"""
    import tensorflow as tf

    cluster = write_cluster(tmp_path, ps=0, workers=1, strategy="multi_worker_mirrored")
    model_dir, own = tmp_path / "model", tmp_path / "worker-own"
    env = {
        "PYTHONPATH": site_hook(tmp_path, SLOW_FINAL_MERGE),
        "OD_DIST_TEST_MODEL_DIR": str(model_dir),
        "OD_DIST_TEST_FINAL_STEP": "10",
        "OD_DIST_TEST_SLOWED": str(tmp_path / "slowed"),
    }
    restarts = ("--max_restarts=1",)
    master, worker = (
        Proc(tmp_path, role, train_args(cluster, role, 0, folder, data_dir, 10, 5, 120, restarts), env=env)
        for role, folder in (("master", model_dir), ("worker", own))
    )
    procs.extend([master, worker])
    log = model_dir / "logs" / "master-0.log"  # the task's every line (the console has od-dist's)
    master.wait_for(
        lambda _: log.exists() and "the final save is being written" in log.read_text(), 600, "the final save"
    )
    worker.wait_for(lambda out: checkpoint_step(str(own)) == 10, 60, "the worker's ckpt-10")
    assert os.path.isdir(model_dir / "ckpt-10_temp") and checkpoint_step(str(model_dir)) == 5
    (task,) = psutil.Process(master.proc.pid).children()  # the master's task, not its supervisor
    task.kill()
    killed = time.monotonic()
    assert master.wait(600) == 0, master.out[-3000:]
    assert worker.wait(120) == 0, worker.out[-3000:]
    took = time.monotonic() - killed
    print(
        f"\nmulti_worker_mirrored: master killed in its final save; both machines exit 0 {took:.1f} s later"
    )
    restarted = "od-dist train: master:0 died (exit 137, killed); restart 1/1 in 0 s"
    assert restarted in master.out, master.out[-3000:]
    lost = r"od-dist train: worker:0 died \(exit 138, lost a peer\); restart 1/1 in \d+ s"
    assert re.search(lost, worker.out), worker.out[-3000:]
    for out in (master.out, worker.out):
        assert re.search(r"resuming run \w+ at step 10 from worker:0's checkpoint", out), out[-3000:]
        # Resumed at the final step, no loop to train: the final save, made anew on every trainer.
        assert "od-dist train | ckpt-10 saved again: master:0 did not hold it" in out, out[-3000:]
        assert out.count("od-dist train | done at step 10") == 1, out[-3000:]
    for folder in (model_dir, own):
        assert checkpoint_step(str(folder)) == 10 and lineage.newest(str(folder)) == (10, "ckpt-10")
        reader = tf.train.load_checkpoint(str(folder / "ckpt-10"))
        assert all(reader.get_tensor(name) is not None for name in reader.get_variable_to_shape_map())
        assert not [n for n in os.listdir(folder) if "temp" in n], os.listdir(folder)
