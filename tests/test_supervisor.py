"""The restart policy (pure) and the supervisor loop on stand-in processes (plain Python children,
no TensorFlow): which tasks restart, when the job stops, what it says."""

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from loopback import checkpoint_code, write_checkpoint

from od_dist.cluster.spec import Address, Task
from od_dist.host import policy, processes, supervisor
from od_dist.host.policy import DONE, PERMANENT, RESTART_ALL, RESTART_TASK, decide, plan

PS, MWMS = "parameter_server", "multi_worker_mirrored"


def task(role, index=0):
    return Task(role, index, Address("127.0.0.1", 2000 + index))


MASTER, PS0, W0, W1, EVAL = (
    task("master"),
    task("ps"),
    task("worker", 0),
    task("worker", 1),
    task("evaluator"),
)
JOB = [PS0, W0, W1, MASTER, EVAL]


@pytest.mark.parametrize("code", [137, -9, 143, -15, 138])
def test_retryable_exits(code):
    assert decide(PS, "worker", code) == RESTART_TASK  # the coordinator re-queues; it rejoins alone
    assert decide(PS, "evaluator", code) == RESTART_TASK  # training goes on without it
    assert decide(MWMS, "evaluator", code) == RESTART_TASK
    assert decide(PS, "ps", code) == RESTART_ALL  # the variables are gone: from the checkpoint
    assert decide(PS, "master", code) == RESTART_ALL
    assert decide(MWMS, "master", code) == RESTART_ALL  # an all-reduce cannot lose a member
    assert decide(MWMS, "worker", code) == RESTART_ALL
    assert decide("mirrored", "single", code) == RESTART_ALL


@pytest.mark.parametrize("code", [130, -2])
def test_sigint_is_a_persons_stop_never_restarted(code):
    """SIGINT reaches a task only from a person: Ctrl+C, or a peer's Ctrl+C passed on through the
    job (every multi_worker_mirrored trainer saves and exits 130; the master tells the servers)."""
    for strategy, role in ((PS, "worker"), (PS, "ps"), (PS, "master"), (MWMS, "worker"), (MWMS, "master")):
        assert decide(strategy, role, code) == policy.STOPPED_BY_PERSON
    # The evaluator is stopped by no one else: its 130 says a person stopped the job it evaluates.
    assert decide(MWMS, "evaluator", code) == policy.STOPPED_BY_PERSON
    assert plan(MWMS, [MASTER, W0], [(W0, 138), (MASTER, 130)]) == policy.Plan(
        policy.STOPPED_BY_PERSON, (MASTER, 130)
    )


@pytest.mark.parametrize("code", [1, 2, 3, 42, 126, 127, 139, -11])
def test_permanent_exits_are_never_retried(code):
    for strategy, role in ((PS, "worker"), (PS, "ps"), (PS, "master"), (MWMS, "worker")):
        assert decide(strategy, role, code) == PERMANENT


def test_exit_0_is_done():
    assert decide(PS, "ps", 0) == DONE and decide(MWMS, "master", 0) == DONE


def test_plan_names_the_tasks():
    assert plan(PS, JOB, [(W1, -9)]) == policy.Plan(RESTART_TASK, (W1, -9), (W1,))
    assert plan(PS, JOB, [(PS0, -9)]) == policy.Plan(RESTART_ALL, (PS0, -9), tuple(JOB))
    assert plan(MWMS, [MASTER, W0], [(W0, 138)]).restart == (MASTER, W0)
    assert plan(PS, JOB, [(W0, -9), (W1, 137)]).restart == (W0, W1)
    assert plan(PS, JOB, [(MASTER, 2)]) == policy.Plan(PERMANENT, (MASTER, 2))
    # One fault seen twice (the ps killed, the master failing on it): restart all, cause the ps.
    assert plan(PS, JOB, [(MASTER, 1), (PS0, -9)]) == policy.Plan(RESTART_ALL, (PS0, -9), tuple(JOB))
    assert plan(PS, JOB, [(W0, -9), (EVAL, 1)]).action == RESTART_TASK  # the evaluator: a sidecar


def test_an_elastic_machines_own_failures_are_neither_a_lost_peer_nor_a_saved_stop():
    """Two in a row leave a machine out of the next rounds: a SIGTERM of another machine's trainer
    (every trainer saves and exits 143) followed by a kill here left a healthy machine out for 60 s
    (benchmarks/chaos.py --elastic)."""
    assert [policy.own_failure(c) for c in (137, -9, 1, 139)] == [True] * 4
    assert [policy.own_failure(c) for c in (138, 143, -15)] == [False] * 3


def test_describe_and_backoff():
    assert policy.describe(-9) == "exit 137, killed"
    assert policy.describe(138) == "exit 138, lost a peer"
    assert policy.describe(2) == "exit 2, invalid input"
    assert policy.describe(-11) == "exit 139, signal 11"
    assert [policy.backoff_s(n) for n in range(1, 7)] == [2, 4, 8, 16, 30, 30]


# ----- the loop, on stand-in tasks -------------------------------------------------------------


class Job:
    """Stand-in tasks: each child runs a small script chosen per (task, start number). Restarts
    come at once (no backoff): the backoff's values are test_describe_and_backoff's."""

    def __init__(self, strategy, tasks, scripts, max_restarts=3, grace_s=5.0, **kwargs):
        self.started = []  # (task name, start number)
        self.pids = {}  # (task name, start number) -> the PID to give that start (reuse_pid)
        self.procs = []
        self.lines = []
        self.scripts = scripts
        kwargs.setdefault("lead", "master:0" if MASTER in tasks else None)  # as launch and train say
        self.sup = supervisor.Supervisor(
            strategy,
            tasks,
            self.start,
            self.lines.append,
            max_restarts,
            grace_s,
            backoff=lambda n: 0.0,
            **kwargs,
        )

    def start(self, t):
        n = sum(1 for name, _ in self.started if name == t.name)
        self.started.append((t.name, n))
        code = self.scripts(t, n)
        pid = self.pids.get((t.name, n))
        if pid is not None:
            reuse_pid(pid)
        proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
        if pid is not None and proc.pid != pid:
            proc.kill()
            pytest.skip(f"another process took PID {pid} first")
        self.procs.append(proc)
        return supervisor.Running(t, proc, f"logs/{t.role}-{t.index}.log")

    def run(self, timeout=60):
        result, skipped = [], []

        def supervise():
            try:
                result.append(self.sup.run())
            except pytest.skip.Exception as e:  # start(): another process took the PID; a skip only here
                skipped.append(e)

        thread = threading.Thread(target=supervise, daemon=True)
        thread.start()
        thread.join(timeout)
        assert not thread.is_alive(), self.lines
        if skipped:
            for p in self.procs:
                p.kill()
            pytest.skip(str(skipped[0]))
        assert all(p.poll() is not None for p in self.procs), "a child outlived the supervisor"
        return result[0]


LAST_PID = "/proc/sys/kernel/ns_last_pid"


def reuse_pid(pid):
    """The next process started gets `pid` again, as Linux does once PIDs wrap around."""
    try:
        with open(LAST_PID, "w") as f:
            f.write(str(pid - 1))
    except OSError as e:
        pytest.skip(f"cannot set the next PID here ({LAST_PID}: {e.strerror})")


def wait_until(condition, timeout=30):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def in_background(fn):
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def exits(code, after=0.2):
    return f"import time, os; time.sleep({after}); os._exit({code})"


def kill_self(after=0.2):
    return f"import time, os, signal; time.sleep({after}); os.kill(os.getpid(), signal.SIGKILL)"


SERVE = "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\ntime.sleep(60)"


def test_a_lost_parameter_server_worker_restarts_alone_and_the_job_finishes():
    def scripts(t, n):
        if t.name == "worker:1" and n == 0:
            return kill_self(0.3)
        if t.name == "master:0":
            return exits(0, 2.0)
        return exits(0, 2.5)  # servers: stop by themselves after the master

    job = Job(PS, [PS0, W0, W1, MASTER], scripts)
    assert job.run() == 0, job.lines
    assert sorted(job.started) == [
        ("master:0", 0),
        ("ps:0", 0),
        ("worker:0", 0),
        ("worker:1", 0),
        ("worker:1", 1),
    ]
    assert "worker:1 died (exit 137, killed); restart 1/3 of worker:1 alone in 0 s" in job.lines


def test_a_parameter_server_worker_with_no_restart_left_ends_alone_and_the_job_goes_on():
    """One command per machine keeps the rules of separate commands: the lost worker ends alone,
    the ps, the master and the other worker go on, and the last line says what was lost."""

    def scripts(t, n):
        if t.name == "worker:1":
            return kill_self(0.3)
        return exits(0, 2.0 if t.role == "master" else 2.5)

    job = Job(PS, [PS0, W0, W1, MASTER], scripts, max_restarts=0)
    assert job.run() == 0, job.lines
    assert sorted(job.started) == [("master:0", 0), ("ps:0", 0), ("worker:0", 0), ("worker:1", 0)]
    assert job.lines == [
        "worker:1 died (exit 137, killed); no restart left (--max_restarts 0); it ends alone: the master "
        "trains on the workers left (ps:0, worker:0, master:0 go on here). Its log: logs/worker-1.log",
        "every task finished but worker:1 (exit 137, killed), lost with no restart left: the master "
        "trained on the workers left",
    ]


def test_a_machine_that_gives_up_on_a_retryable_loss_exits_with_its_code():
    """A worker's machine (`train --max_restarts 1`) whose worker is lost twice: nothing is left
    here, and its od-dist exits 137 as the worker alone would, for an outer restarter to retry.
    A ps lost past the restarts stops every task: exit 143, its code, not 1."""
    job = Job(PS, [W1], lambda t, n: kill_self(0.2), max_restarts=1)
    assert job.run() == 137, job.lines
    assert job.lines[-1] == (
        "nothing left here: worker:1 (exit 137, killed) ended with no restart left; exit 137"
    )
    job = Job(PS, [PS0, W0], lambda t, n: exits(143, 0.2) if t.role == "ps" else SERVE, max_restarts=0)
    assert job.run() == 143, job.lines
    assert job.lines == [
        "ps:0 died (exit 143, terminated); no restart left (--max_restarts 0); stopping every task. Its "
        "log: logs/ps-0.log"
    ]


def test_the_backoff_doubles_while_restarts_come_quickly_and_starts_over_after_a_long_run():
    def scripts(t, n):
        if t.name == "worker:1":
            return kill_self(1.5 if n == 2 else 0.1) if n < 3 else exits(0)
        return exits(0, 5.0 if t.role == "master" else 5.5)

    job = Job(PS, [PS0, W0, W1, MASTER], scripts)
    streaks = []
    job.sup.backoff = lambda n: streaks.append(n) or 0.0
    job.sup.backoff_reset_s = 1.0
    assert job.run() == 0, job.lines
    # The second restart backs off backoff(1); the third starts at once: the start before it lived
    # 1.5 s, longer than the reset.
    assert streaks == [1], job.lines


def test_the_backoff_starts_over_after_progress_and_the_first_restart_waits_nothing(tmp_path):
    """Faults a minute apart at most but each after a newer checkpoint (a chaos run's) each start
    at once, not after a doubling backoff; two in a row with no progress between them back off."""

    def scripts(t, n):
        term = "import os, signal, time\n" + (checkpoint_code(tmp_path, 40) if n == 3 else "")
        if n < 3:
            return saves_then_dies(tmp_path, 10 * (n + 1))
        if n < 5:
            return term + "os.kill(os.getpid(), signal.SIGTERM)"
        return exits(0)

    job = Job(MWMS, [MASTER], scripts, max_restarts=3, model_dir=str(tmp_path))
    streaks = []
    job.sup.backoff = lambda n: streaks.append(n) or 0.0
    assert job.run() == 0, job.lines
    # Each restart after progress waits nothing (the third after step 40 was saved); the fourth, with
    # no progress since the third, backoff(1).
    assert streaks == [1], job.lines
    assert job.lines[3] == "master:0 died (exit 143, terminated); restart 1/3 (4 in all) in 0 s"


def test_a_lost_ps_restarts_every_task_and_gives_up_naming_the_first_failure():
    def scripts(t, n):
        if t.name == "ps:0":
            return kill_self(0.3) if n == 0 else exits(138, 0.3)
        return SERVE

    job = Job(PS, [PS0, W0, MASTER], scripts, max_restarts=1)
    start = time.monotonic()
    assert job.run() == 138, job.lines  # the retryable code it gave up on: an outer restarter retries
    assert time.monotonic() - start < 15
    assert sorted(job.started) == [
        ("master:0", 0),
        ("master:0", 1),
        ("ps:0", 0),
        ("ps:0", 1),
        ("worker:0", 0),
        ("worker:0", 1),
    ]
    assert job.lines[0] == "ps:0 died (exit 137, killed); restart 1/1 of every task in 0 s"
    assert job.lines[1] == (
        "ps:0 died (exit 138, lost a peer); no restart left (--max_restarts 1); stopping every "
        "task; the first failure (root cause): ps:0 died (exit 137, killed). Its log: logs/ps-0.log"
    )


def test_the_restart_budget_counts_restarts_in_a_row():
    """--max_restarts is a budget of restarts in a row: a newer checkpoint since the last restart,
    or the tasks running healthy_s, starts the count over; nothing else does."""
    b = policy.Budget(2, since=0.0, step=10, healthy_s=600.0)
    assert [b.take(t, 10) for t in (5.0, 10.0)] == [True, True] and b.used == 2
    assert not b.take(15.0, 10)  # a third in a row, no progress: none left
    assert not b.take(16.0, None)  # a state file unreadable for a moment is no progress either
    assert b.take(20.0, 30) and b.used == 1  # training saved step 30 since: the count starts over
    b.started(25.0)
    assert b.take(30.0, 30) and b.used == 2
    b.started(35.0)
    assert b.take(35.0 + 600.0, 30) and b.used == 1  # the tasks ran 10 minutes without a loss
    assert not policy.Budget(0, since=0.0).take(1000.0, 5)  # 0: never a restart
    # A loop that ended past every earlier start's furthest step is progress too (a save killed
    # on this machine, the peers holding it); the same step again is not.
    b = policy.Budget(1, since=0.0, step=10)
    assert b.take(1.0, 10, reached=25) and b.take(2.0, 10, reached=50)
    assert not b.take(3.0, 10, reached=50)
    assert policy.HEALTHY_S == 600.0  # the help, the scripts' README and docs/commands.md say 10 minutes


def saves_then_dies(model_dir, step, after=0.2):
    """A trainer that saved `step` (TensorFlow's state file naming ckpt-<step>) and is then lost."""
    return "import time\n" + checkpoint_code(model_dir, step) + kill_self(after)


def test_restarts_that_each_follow_a_new_checkpoint_never_use_up_the_budget(tmp_path):
    """A long run's occasional faults: the trainer is lost five times with --max_restarts 1, each
    time after a checkpoint newer than at its last restart, and the job finishes (exit 0); the
    lines count the restarts in a row and in all. A trainer lost twice with no checkpoint between
    stops the job at once: restarts that bring no progress are what the budget counts."""

    def scripts(t, n):
        return saves_then_dies(tmp_path, 10 * (n + 1)) if n < 5 else exits(0)

    job = Job(MWMS, [MASTER], scripts, max_restarts=1, model_dir=str(tmp_path))
    assert job.run() == 0, job.lines
    assert len(job.started) == 6
    assert job.lines[0] == "master:0 died (exit 137, killed); restart 1/1 in 0 s"
    assert job.lines[1:5] == [
        f"master:0 died (exit 137, killed); restart 1/1 ({n} in all) in 0 s" for n in (2, 3, 4, 5)
    ]

    job = Job(
        MWMS, [MASTER], lambda t, n: saves_then_dies(tmp_path, 60), max_restarts=1, model_dir=str(tmp_path)
    )
    assert job.run() == 137, job.lines
    assert len(job.started) == 2
    assert job.lines[-1].startswith("master:0 died (exit 137, killed); no restart left (--max_restarts 1)")


def reaches_then_dies(step):
    """A trainer whose last loop ended at `step` (its note to the supervisor), killed before its
    save reached this machine's disk."""
    return f"from od_dist.protocol import notes\nnotes.leave_step_reached({step})\n" + kill_self()


def test_training_past_every_earlier_start_is_progress_though_no_save_reached_this_disk(tmp_path):
    """Separate disks: a master killed in its saves while the peers' copies grow (a chaos run's
    four faults within one checkpoint interval ran the scripts' --max_restarts 3 out). Each start
    that trains past the furthest step of those before starts the count over; a start that fails
    at the same step as the one before counts, so a crash loop still stops."""

    def scripts(t, n):
        return reaches_then_dies(25 * (n + 1)) if n < 4 else exits(0)

    job = Job(MWMS, [MASTER], scripts, max_restarts=1, model_dir=str(tmp_path))
    assert job.run() == 0, job.lines
    assert len(job.started) == 5
    assert job.lines[1:4] == [
        f"master:0 died (exit 137, killed); restart 1/1 ({n} in all) in 0 s" for n in (2, 3, 4)
    ]

    job = Job(MWMS, [MASTER], lambda t, n: reaches_then_dies(25), max_restarts=1, model_dir=str(tmp_path))
    assert job.run() == 137, job.lines
    assert len(job.started) == 2
    assert job.lines[-1].startswith("master:0 died (exit 137, killed); no restart left (--max_restarts 1)")


def test_a_task_that_ran_the_healthy_period_starts_the_count_over_and_a_crash_loop_stops():
    """No checkpoint seen here (a ps's machine on its own disk): a task that ran healthy_s before
    each loss is restarted again and again within --max_restarts 1; one that dies at every start
    stops the job after one restart, naming the first failure of the streak."""

    def scripts(t, n):
        return kill_self(1.0) if n < 3 else exits(0, 2.0)

    job = Job(
        PS, [PS0, MASTER], lambda t, n: scripts(t, n) if t.role == "ps" else exits(0, 4.0), max_restarts=1
    )
    job.sup.healthy_s = 0.8
    assert job.run() == 0, job.lines
    assert [line for line in job.lines if "restart" in line] == [
        "ps:0 died (exit 137, killed); restart 1/1 of every task in 0 s",
        "ps:0 died (exit 137, killed); restart 1/1 (2 in all) of every task in 0 s",
        "ps:0 died (exit 137, killed); restart 1/1 (3 in all) of every task in 0 s",
    ]

    job = Job(PS, [PS0, MASTER], lambda t, n: kill_self(0.1) if t.role == "ps" else SERVE, max_restarts=1)
    job.sup.healthy_s = 5.0  # far longer than its life: no refill
    assert job.run() == 137, job.lines
    assert job.lines[-1] == (
        "ps:0 died (exit 137, killed); no restart left (--max_restarts 1); stopping every task; the first "
        "failure (root cause): ps:0 died (exit 137, killed). Its log: logs/ps-0.log"
    )


def test_the_evaluators_own_budget_starts_over_with_time_not_with_checkpoints(tmp_path):
    """An evaluator that fails at once whenever a newer checkpoint appears is not restarted once per
    checkpoint: a checkpoint is no sign that it evaluated one. With --max_restarts 1 it gives up at
    its second failure; training goes on."""

    def scripts(t, n):
        if t.role == "evaluator":
            return saves_then_dies(tmp_path, 10 * (n + 1), after=0.1)
        return exits(0, 3.0)

    job = Job(MWMS, [MASTER, EVAL], scripts, max_restarts=1, model_dir=str(tmp_path))
    assert job.run() == 0, job.lines
    assert [name for name, _ in job.started].count("evaluator:0") == 2
    assert any(
        line.startswith("evaluator:0 died (exit 137, killed); no restart left for it") for line in job.lines
    )


def test_a_killed_tasks_temporary_files_are_removed(tmp_path):
    """A task killed cannot remove its temporary files (TensorFlow's autograph sources, a
    multi_worker_mirrored worker's checkpoint copy), and each restart would leave more: each start
    gets a temporary folder of its own (TMPDIR), removed once it has exited."""
    made = tmp_path / "made.txt"

    def scripts(t, n):
        write = (
            "import tempfile\nf = tempfile.NamedTemporaryFile(delete=False)\nf.close()\n"
            f"open({str(made)!r}, 'a').write(f.name + '\\n')\n"
        )
        if n == 0:  # the worker is killed; the master runs until every task is restarted
            # The worker dies once the master's first start has written its file: 0.1 s after its
            # own start was too early for that under CI's load (3 files, not 4).
            master_wrote = (
                "import os, time\nend = time.time() + 60\n"
                f"while time.time() < end and {os.sep + 'master-0-'!r} not in open({str(made)!r}).read():\n"
                "    time.sleep(0.05)\n"
            )
            return write + (master_wrote + kill_self(0) if t.name == "worker:0" else SERVE)
        return write + exits(0, 0.5)

    job = Job(MWMS, [MASTER, W0], scripts)
    assert job.run() == 0, job.lines
    files = made.read_text().split()
    assert len(files) == 4  # each task twice: the worker killed, then every task restarted
    assert [f for f in files if os.path.exists(f)] == []
    assert all(f"{os.sep}{name}-0-" in f for f, name in zip(sorted(files), ["master"] * 2 + ["worker"] * 2))


def test_a_permanent_error_is_not_retried():
    job = Job(PS, [PS0, MASTER], lambda t, n: exits(2) if t.name == "master:0" else SERVE)
    assert job.run() == 2
    assert job.started == [("ps:0", 0), ("master:0", 0)]
    assert job.lines == [
        "master:0 died (exit 2, invalid input); a permanent error, not retried; stopping every task. "
        "Its log: logs/master-0.log"
    ]
    job = Job(MWMS, [MASTER, W0], lambda t, n: exits(1) if t.name == "worker:0" else SERVE)
    assert job.run() == 1 and len(job.started) == 2


def test_interrupt_stops_the_trainers_first_then_the_servers(tmp_path):
    order = tmp_path / "order"
    trainer = (
        f"import signal, sys, time\n"
        f"def stop(*a):\n    time.sleep(0.5); open({str(order)!r}, 'a').write('master\\n'); sys.exit(130)\n"
        f"signal.signal(signal.SIGINT, stop)\nopen({str(tmp_path / 'master')!r}, 'w').close()\ntime.sleep(60)"
    )
    server = (
        f"import signal, sys\n"
        f"def stop(*a):\n    open({str(order)!r}, 'a').write('ps\\n'); sys.exit(0)\n"
        f"signal.signal(signal.SIGTERM, stop)\nsignal.signal(signal.SIGINT, stop)\n"
        f"open({str(tmp_path / 'ps')!r}, 'w').close()\nimport time; time.sleep(60)"
    )
    job = Job(PS, [PS0, MASTER], lambda t, n: trainer if t.role == "master" else server)

    def interrupt_once_both_listen():
        wait_until(lambda: (tmp_path / "master").exists() and (tmp_path / "ps").exists())
        job.sup.on_signal(signal.SIGINT)

    in_background(interrupt_once_both_listen)
    assert job.run() == 130
    assert order.read_text() == "master\nps\n"


def test_a_second_interrupt_kills_at_once(tmp_path):
    def stubborn(t, n):
        ready = str(tmp_path / t.name)
        return f"import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nopen({ready!r}, 'w').close()\ntime.sleep(60)"

    job = Job(MWMS, [MASTER, W0], stubborn, grace_s=50)

    def interrupt_twice():
        wait_until(lambda: (tmp_path / "master:0").exists() and (tmp_path / "worker:0").exists())
        job.sup.on_signal(signal.SIGTERM)  # ignored by both: the second must not wait out grace_s
        wait_until(lambda: any("asking" in line for line in job.lines))
        job.sup.on_signal(signal.SIGTERM)

    in_background(interrupt_twice)
    start = time.monotonic()
    assert job.run() == 143
    assert time.monotonic() - start < 10
    assert "second interrupt: stopping every task now" in job.lines


def stubborn_trainer(ready, on_stop=""):
    """A trainer that overruns any grace period: SIGINT and SIGTERM run `on_stop`, then it goes on."""
    return (
        "import os, signal, time\n"
        f"def stop(*a):\n    {on_stop or 'pass'}\n"
        "signal.signal(signal.SIGTERM, stop)\nsignal.signal(signal.SIGINT, stop)\n"
        f"open({str(ready)!r}, 'w').close()\ntime.sleep(60)"
    )


def stop_once_started(job, signum, *ready):
    def go():
        wait_until(lambda: all(r.exists() for r in ready))
        job.sup.on_signal(signum)

    in_background(go)


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_trainer_killed_after_the_grace_period_is_said_with_the_newest_checkpoint(tmp_path, signum, code):
    """130/143 say a trainer saved a checkpoint first. One that overran --grace_period was killed
    before its save: the job's last line says so and names the step on disk a restart resumes from,
    read from the state file (no TensorFlow in the supervisor)."""
    model_dir, ready = tmp_path / "model", tmp_path / "ready"
    model_dir.mkdir()
    write_checkpoint(model_dir, 20)
    job = Job(MWMS, [MASTER], lambda t, n: stubborn_trainer(ready), grace_s=1.0, model_dir=str(model_dir))
    stop_once_started(job, signum, ready)
    assert job.run() == code, job.lines
    assert job.lines[-2] == "master:0 still running after 1 s (--grace_period); killing them"
    assert job.lines[-1] == (
        f"master:0 killed after --grace_period (1 s), before its save: the newest checkpoint on disk is step 20 "
        f"({model_dir / 'ckpt-20'}), where a restart resumes; exit {code}"
    )


def test_a_trainer_killed_after_saving_during_the_stop_or_with_no_checkpoint_says_so(tmp_path):
    """Killed later than its save (in an export, TensorFlow's shutdown): the line names the step
    saved during the stop. Killed before the first checkpoint: a restart starts from step 0."""
    model_dir, ready = tmp_path / "model", tmp_path / "ready"
    model_dir.mkdir()
    save = f"exec({checkpoint_code(model_dir, 35)!r})"
    job = Job(
        MWMS, [MASTER], lambda t, n: stubborn_trainer(ready, save), grace_s=1.0, model_dir=str(model_dir)
    )
    stop_once_started(job, signal.SIGTERM, ready)
    assert job.run() == 143, job.lines
    assert job.lines[-1] == (
        "master:0 killed after --grace_period (1 s), after a checkpoint was saved: the newest on disk is step 35 "
        f"({model_dir / 'ckpt-35'}), where a restart resumes; exit 143"
    )

    empty = tmp_path / "empty"
    empty.mkdir()
    job = Job(
        MWMS,
        [MASTER, W0],
        lambda t, n: stubborn_trainer(tmp_path / t.role),
        grace_s=1.0,
        model_dir=str(empty),
    )
    stop_once_started(job, signal.SIGTERM, tmp_path / "master", tmp_path / "worker")
    assert job.run() == 143, job.lines
    assert job.lines[-1] == (
        f"master:0, worker:0 killed after --grace_period (1 s), before their save; no checkpoint in {empty}: a "
        "restart starts from step 0; exit 143"
    )


def test_no_child_left_when_the_supervisor_fails():
    job = Job(PS, [PS0, MASTER], lambda t, n: SERVE)
    job.sup.start = lambda t: Job.start(job, t) if t.role == "ps" else (_ for _ in ()).throw(OSError("boom"))
    with pytest.raises(OSError):
        job.sup.run()
    assert all(p.poll() is not None for p in job.procs)
    assert not [c for c in psutil.Process().children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE]


def test_nothing_restarts_once_training_is_over():
    """Under multi_worker_mirrored a trainer left behind by the one that finished may exit 138
    (or hang in TensorFlow's shutdown): the job is done, exit 0, no restart."""
    job = Job(MWMS, [MASTER, W0], lambda t, n: exits(0, 0.3) if t.role == "master" else exits(138, 1.0))
    assert job.run() == 0, job.lines
    assert len(job.started) == 2
    assert "worker:0 exited after training finished (exit 138, lost a peer); not restarted" in job.lines


def test_a_worker_failing_after_the_master_finished_is_a_line():
    job = Job(MWMS, [MASTER, W0], lambda t, n: exits(0, 0.3) if t.role == "master" else exits(1, 1.0))
    assert job.run() == 0, job.lines
    assert "worker:0 exited after training finished (exit 1, a permanent failure); not restarted" in job.lines


def test_a_master_failing_after_the_worker_finished_fails_the_job():
    """The master writes the final checkpoint: once worker 0 finished, its failure (a final save or
    export that failed) is the job's, named with its log."""
    job = Job(MWMS, [MASTER, W0], lambda t, n: exits(1, 1.0) if t.role == "master" else exits(0, 0.2))
    assert job.run() == 1, job.lines
    assert job.lines[-1] == (
        "master:0 died after worker:0 finished training (exit 1, a permanent failure); a permanent "
        "error, not retried; its final checkpoint or export may be missing; stopping every task. "
        "Its log: logs/master-0.log"
    )
    assert len(job.started) == 2


def writes_slowly(seconds, done):
    """A master writing its final checkpoint to a slow share: a few bytes at a time, then done."""
    return (
        f"import os, time\nend = time.monotonic() + {seconds}\n"
        f"with open({str(done)!r} + '.part', 'w') as f:\n"
        "    while time.monotonic() < end:\n        f.write('x' * 100); f.flush(); time.sleep(0.05)\n"
        f"os.rename({str(done)!r} + '.part', {str(done)!r})"
    )


def test_a_master_still_writing_after_the_worker_finished_is_waited_for(tmp_path, monkeypatch):
    monkeypatch.setattr(supervisor, "SERVER_GRACE_S", 1.0)  # what others get; the master gets longer
    done = tmp_path / "ckpt"
    job = Job(
        MWMS,
        [MASTER, W0],
        lambda t, n: writes_slowly(4.0, done) if t.role == "master" else exits(0, 0.2),
        progress_every_s=1.0,
        stalled_s=2.0,
    )
    assert job.run() == 0, job.lines
    assert done.exists(), "the master was stopped before it finished writing"
    assert any(
        line.startswith("master:0 still finishing")
        and "after worker:0 finished training" in line
        and "MB written" in line
        for line in job.lines
    ), job.lines
    assert job.lines[-1] == "every task finished"


def test_a_master_stalled_after_the_worker_finished_fails_the_job(monkeypatch):
    monkeypatch.setattr(supervisor, "SERVER_GRACE_S", 1.0)
    job = Job(
        MWMS,
        [MASTER, W0],
        lambda t, n: "import time; time.sleep(60)" if t.role == "master" else exits(0, 0.2),
        progress_every_s=0.5,
        stalled_s=1.5,
    )
    start = time.monotonic()
    assert job.run() == 1, job.lines
    assert time.monotonic() - start < 15
    assert job.lines[-1].startswith("master:0 made no progress for ")
    assert "after worker:0 finished training" in job.lines[-1]
    assert job.lines[-1].endswith("its final checkpoint or export may be missing. Its log: logs/master-0.log")


def test_a_stuck_worker_after_the_master_finished_is_stopped_and_the_job_succeeds(monkeypatch):
    monkeypatch.setattr(supervisor, "SERVER_GRACE_S", 1.0)
    job = Job(MWMS, [MASTER, W0], lambda t, n: exits(0, 0.2) if t.role == "master" else SERVE)
    assert job.run() == 0, job.lines
    assert (
        "worker:0 still running 1 s after training finished; stopping it (nothing of it is needed)"
        in job.lines
    )


def test_a_server_that_missed_the_masters_stop_is_stopped_and_the_job_succeeds(monkeypatch):
    """parameter_server: a worker restarted alone near the end misses the master's stop marker
    and serves on. The master exited 0: the job is done; the straggler is a line, not a failure."""
    monkeypatch.setattr(supervisor, "SERVER_GRACE_S", 1.0)

    def scripts(t, n):
        if t.name == "worker:1":
            return kill_self(0.2) if n == 0 else SERVE
        return exits(0, 1.0 if t.role == "master" else 1.5)

    job = Job(PS, [PS0, W0, W1, MASTER], scripts)
    assert job.run() == 0, job.lines
    assert "worker:1 still running 1 s after training finished; stopping it (nothing of it is needed)" in (
        job.lines
    )
    assert job.lines[-1] == "every task finished"


def test_an_evaluator_out_of_restarts_is_the_last_line_with_the_command():
    command = "od-dist eval --pipeline=p.yaml --model_dir=runs/x"
    job = Job(
        PS,
        [PS0, MASTER, EVAL],
        lambda t, n: exits(1, 0.1) if t.role == "evaluator" else exits(0, 1.5 if t.role == "master" else 2.0),
        max_restarts=1,
        eval_command=command,
    )
    assert job.run() == 0, job.lines
    assert job.lines[-1] == (
        "training finished; evaluation is missing (evaluator:0 used up its restarts); evaluate the "
        f"final checkpoint with: {command}"
    )


def test_a_persons_stop_on_another_machine_ends_this_one_with_130_and_no_restart():
    """`train --max_restarts 3` on the worker's machine: Ctrl+C on the master's machine makes both
    trainers save and exit 130; this machine's od-dist ends too, not restarting its worker."""
    job = Job(MWMS, [W0], lambda t, n: exits(130, 0.3))
    start = time.monotonic()
    assert job.run() == 130, job.lines
    assert time.monotonic() - start < 10
    assert job.started == [("worker:0", 0)]
    assert job.lines == [
        "worker:0 was stopped by a person (exit 130, interrupted: Ctrl+C, on this machine or another "
        "of the job); not restarted: stopping every task"
    ]


def test_a_persons_stop_of_one_task_stops_the_others_trainers_first(tmp_path):
    """Under launch, SIGINT sent to the master alone: the other trainer is asked to save (SIGINT),
    then the servers are stopped; nothing restarts."""
    got = tmp_path / "got"
    worker = (
        f"import signal, sys, time\n"
        f"def stop(signum, frame):\n    open({str(got)!r}, 'w').write(str(signum)); sys.exit(130)\n"
        f"signal.signal(signal.SIGINT, stop)\ntime.sleep(60)"
    )
    job = Job(MWMS, [MASTER, W0], lambda t, n: exits(130, 0.5) if t.role == "master" else worker)
    assert job.run() == 130, job.lines
    assert got.read_text() == str(int(signal.SIGINT))
    assert sorted(job.started) == [("master:0", 0), ("worker:0", 0)]


WAITED_OUT = (
    "import os\nfrom od_dist.protocol import notes\n"
    "notes.leave_for_supervisor(notes.WAITED_OUT)\nos._exit(138)"
)


def test_a_pause_elsewhere_is_waited_for_once_within_wait_timeout():
    """SIGTERM to the master's machine (a drained node): the worker saves and exits 143 with it,
    is restarted to wait --wait_timeout for the master (one wait: a restart after that would only
    wait again), then this machine's od-dist ends, 138, naming why."""
    job = Job(MWMS, [W0], lambda t, n: exits(143, 0.2) if n == 0 else WAITED_OUT)
    assert job.run() == 138, job.lines
    assert job.started == [("worker:0", 0), ("worker:0", 1)]
    assert job.lines[-1] == (
        "worker:0 waited --wait_timeout for peers that did not come (exit 138, lost a peer); not "
        "restarted: it would only wait again; stopping every task"
    )


def test_a_server_that_waited_out_its_master_is_not_restarted():
    job = Job(PS, [PS0, W0], lambda t, n: WAITED_OUT if t.role == "ps" else SERVE)
    assert job.run() == 138, job.lines
    assert sorted(job.started) == [("ps:0", 0), ("worker:0", 0)]


def test_a_ps_lost_for_good_in_an_elastic_job_ends_it_with_no_new_round():
    """An elastic parameter_server round's coordinator (here worker 0, coordinating) waited
    --wait_timeout for a ps: the variables were there, so neither a restart nor another round could
    go on: this machine's od-dist ends, 138, at once."""
    lost = WAITED_OUT.replace(
        "notes.WAITED_OUT)", "notes.WAITED_OUT)\nnotes.leave_for_supervisor(notes.PS_LOST)"
    )
    job = Job(PS, [W0], lambda t, n: lost, max_restarts=3)
    assert job.run() == 138, job.lines
    assert job.started == [("worker:0", 0)]
    assert job.lines[-1] == (
        "worker:0 waited --wait_timeout for a ps (its line above names it): the variables were there, so "
        "no round can go on without it; stopping every task"
    )


def test_a_task_behind_a_launcher_is_heard():
    """On Windows a venv's python.exe is a launcher that runs the interpreter as its child: the
    supervisor knows the task by the launcher's PID. A server that waited out its master behind
    one is heard all the same, and not restarted. (The other way, its supervisor's word reaching
    it: test_stop.py.)"""
    launcher = f"import subprocess, sys\nsys.exit(subprocess.call([sys.executable, '-c', {WAITED_OUT!r}]))"
    job = Job(PS, [PS0], lambda t, n: launcher)
    assert job.run() == 138, job.lines
    assert job.started == [("ps:0", 0)]


def test_a_reused_pid_does_not_make_a_restarted_task_look_waited_out():
    """A child's word to its supervisor outlives it no longer than its exit: the evaluator that
    left "waited out" and failed, then a worker given its PID again (Linux reuses PIDs) and lost
    to a peer, is restarted, not taken for one that waited --wait_timeout."""
    if not os.path.exists(LAST_PID):
        pytest.skip("no settable PIDs on this system")
    told = "import os\nfrom od_dist.protocol import notes\nnotes.leave_for_supervisor(notes.WAITED_OUT)\n"

    def scripts(t, n):
        if t.role == "evaluator":
            return told + "os._exit(1)" if n == 0 else exits(0, 1.0)
        return [exits(143, 1.5), exits(138, 0.3), exits(0, 0.3)][n]

    job = Job(MWMS, [W0, EVAL], scripts)
    original = job.start

    def start(t):
        running = original(t)
        if job.started[-1] == ("evaluator:0", 0):
            job.pids[("worker:0", 1)] = running.proc.pid
        return running

    job.sup.start = start
    assert job.run() == 0, job.lines
    assert [s for s in job.started if s[0] == "worker:0"] == [
        ("worker:0", 0),
        ("worker:0", 1),
        ("worker:0", 2),
    ]
    assert any(line.startswith("worker:0 died (exit 138, lost a peer); restart 2/3") for line in job.lines)


def test_a_lone_evaluators_exit_says_what_happened_to_the_job():
    """`train --role evaluator` (every generated script, a Kubernetes pod): the evaluator's own
    supervisor, alone on its machine, says no more than it knows. Its master never came: exit
    138, not restarted. The job stopped by a person: 130. Evaluation failing past its restarts:
    exit 0 (it never stops the trainers) without claiming that training finished."""
    job = Job(PS, [EVAL], lambda t, n: WAITED_OUT)
    assert job.run() == 138, job.lines
    assert job.started == [("evaluator:0", 0)]
    assert job.lines == [
        "evaluator:0 waited --wait_timeout for its master, which never came (exit 138, lost a peer): the "
        "job did not start; not restarted"
    ]
    job = Job(PS, [EVAL], lambda t, n: exits(130, 0.1))
    assert job.run() == 130, job.lines
    assert job.started == [("evaluator:0", 0)]
    job = Job(PS, [EVAL], lambda t, n: exits(1, 0.1), max_restarts=1, eval_command="od-dist eval x")
    assert job.run() == 0, job.lines
    assert len(job.started) == 2
    assert job.lines[-1] == (
        "evaluation is missing (evaluator:0 used up its restarts); training is not affected; evaluate "
        "the final checkpoint with: od-dist eval x"
    )


# ----- a supervisor's own stop on Windows (its branch run here) ---------------------------------

# A trainer's stop handling as the task has it (task/stop.py), recording the signal that reached it
# and the code it exits with.
STOPPABLE = """
import sys, time
from od_dist.task import stop
with stop.StopRequest({name!r}) as s:
    open({ready!r}, "w").close()
    while not s.requested:
        time.sleep(0.05)
    s.restore()
with open({record!r}, "a") as f:
    f.write({name!r} + " " + s.name + " " + str(s.code) + "\\n")
sys.exit(s.code)
"""


@pytest.fixture
def windows(monkeypatch):
    """The supervisor's Windows branch: every stop it sends goes as CTRL_BREAK. Linux has no
    CTRL_BREAK: SIGINT stands in for it, which the task handles alike (task/stop.py: a person's
    Ctrl+C or Ctrl+Break, 130, unless its supervisor left word that the stop is its own)."""
    monkeypatch.setattr(processes, "WINDOWS", True)
    monkeypatch.setattr(processes, "CTRL_BREAK", signal.SIGINT)


def stoppable(tmp_path, name):
    return STOPPABLE.format(name=name, ready=str(tmp_path / name), record=str(tmp_path / "record"))


def test_a_windows_supervisors_restart_is_a_system_stop_not_a_persons(tmp_path, windows):
    """multi_worker_mirrored, worker:0 killed: the supervisor stops the master to restart both.
    On Windows its stop is a CTRL_BREAK; the master takes it for the system's (SIGTERM, 143), not a
    person's Ctrl+Break (130, which it would pass on to the whole job as a person's stop)."""

    def scripts(t, n):
        if n == 1:
            return exits(0, 0.3)
        if t.role == "master":
            return stoppable(tmp_path, "master:0")
        ready = str(tmp_path / "master:0")
        return f"import os, time\nwhile not os.path.exists({ready!r}):\n    time.sleep(0.05)\nos._exit(137)"

    job = Job(MWMS, [MASTER, W0], scripts)
    assert job.run() == 0, job.lines
    assert job.lines[0] == "worker:0 died (exit 137, killed); restart 1/3 of every task in 0 s"
    assert (tmp_path / "record").read_text() == "master:0 SIGTERM 143\n"
    assert sorted(job.started) == [("master:0", 0), ("master:0", 1), ("worker:0", 0), ("worker:0", 1)]


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_windows_supervisor_passes_a_stop_on_as_what_it_is(tmp_path, windows, signum, code):
    """`launch` stopped gracefully by the system (SIGTERM) or by a person (Ctrl+C): both reach the
    trainers as CTRL_BREAK on Windows, and each trainer exits with the code of who asked."""
    job = Job(PS, [PS0, MASTER], lambda t, n: stoppable(tmp_path, t.name))

    def stop_once_both_listen():
        wait_until(lambda: (tmp_path / "master:0").exists() and (tmp_path / "ps:0").exists())
        job.sup.on_signal(signum)

    in_background(stop_once_both_listen)
    assert job.run() == code, job.lines
    what = "SIGTERM" if code == 143 else "SIGINT"
    assert sorted((tmp_path / "record").read_text().splitlines()) == [
        f"master:0 {what} {code}",
        "ps:0 SIGTERM 143",  # then the servers: the system's stop, once the trainers are done
    ]


def test_the_stop_file_stops_the_job_as_a_sigterm_does_and_an_older_one_is_no_word(tmp_path):
    """Windows sends a scheduled task no signal: the boot task's removal writes od-dist.stop in the
    working directory, and the supervisor stops the job as a SIGTERM does, the trainer first (it
    saves), exit 143, the file taken away. One left over from before this start stops nothing."""
    stop_file, ready = tmp_path / "od-dist.stop", tmp_path / "ready"
    stop_file.write_text("")
    os.utime(stop_file, (time.time() - 60, time.time() - 60))  # an earlier run's
    trainer = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))\n"
        f"open({str(ready)!r}, 'w').close()\ntime.sleep(60)"
    )
    job = Job(MWMS, [MASTER], lambda t, n: trainer, stop_file=str(stop_file))

    def stop_once_started():
        wait_until(ready.exists)
        time.sleep(1)
        assert job.sup.running, job.lines  # the old file stopped nothing
        stop_file.write_text("")

    in_background(stop_once_started)
    assert job.run() == 143, job.lines
    assert any(f"{stop_file} appeared: asking master:0 to save a checkpoint" in line for line in job.lines), (
        job.lines
    )
    assert not stop_file.exists()
