"""Several machines on one box (tests/netns.py: one network namespace per machine, each with its
own address on one bridge; root only). The ordering check sees each machine's own interfaces, as on
a real LAN, and real jobs start on each machine from the script `od-dist scripts` wrote for it."""

import os
import re
import shutil
import subprocess
import sys
import time

import netns
import psutil
import pytest
from loopback import COCO_LINE, PIPELINE, ROOT, TINY, checkpoint_step, write_checkpoint

from od_dist.protocol import exit_codes, lineage

PORT = 2222  # every machine has its own address, so every task can use the same port, as on a LAN


def write_cluster(tmp_path, text, name="cluster.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def ps_cluster(tmp_path, net, workers=(1, 2), **extra):
    """master on machine 0, workers on the given machines (list order = index), ps on machine 3."""
    lines = [
        f"master: {net[0].ip}:{PORT}",
        "worker: [" + ", ".join(f"{net[i].ip}:{PORT}" for i in workers) + "]",
        f"ps: [{net[3].ip}:{PORT}]",
    ]
    lines += [f"{k}: {v}" for k, v in extra.items()]
    return write_cluster(tmp_path, "\n".join(lines) + "\n")


def test_the_harness_says_why_it_cannot_run(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert netns.unavailable() == "simulated machines need root (ip netns add); CI runs as root"
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda name: None)
    assert netns.unavailable() == "the `ip` command (iproute2) is missing: apt-get install iproute2"


# ----- the ordering check (no TensorFlow: fast) --------------------------------------------------


def test_each_machine_infers_its_own_entry(tmp_path, machines):
    net = machines(5)
    expected = {0: "master:0", 1: "worker:0", 2: "worker:1", 3: "ps:0"}
    by_ip = ps_cluster(tmp_path, net)
    # The same machines written by host name (each machine's /etc/hosts knows node1..node5).
    by_name = write_cluster(
        tmp_path,
        f"master: node1:{PORT}\nworker: [node2:{PORT}, node3:{PORT}]\nps: [node4:{PORT}]\n",
        "named.yaml",
    )
    for i, task in expected.items():
        for cluster in (by_ip, by_name):
            r = net[i].od_dist("validate", f"--cluster={cluster}")
            assert r.returncode == 0, r.stderr
            assert f"this machine: {task}, inferred from this machine's addresses" in r.stdout, r.stdout
            assert re.search(rf"{task}\s+\S+:{PORT}\s+<- this machine", r.stdout), r.stdout
        r = net[i].od_dist("tf-config", f"--cluster={by_ip}")
        assert r.returncode == 0, r.stderr
        role, index = task.split(":")
        assert f'"task": {{"index": {index}, "type": "{"chief" if role == "master" else role}"}}' in r.stdout


def test_swapped_workers_are_refused_naming_the_right_index(tmp_path, machines):
    net = machines(4)
    # Machine 1 is started as worker 0 and machine 2 as worker 1, but the file lists them the other
    # way round: each must refuse and say which index it really is.
    cluster = ps_cluster(tmp_path, net, workers=(2, 1))
    for machine, started_as, really in ((net[1], 0, 1), (net[2], 1, 0)):
        for command in ("validate", "train"):
            start = time.monotonic()
            r = (
                machine.od_dist(
                    command,
                    f"--cluster={cluster}",
                    "--role=worker",
                    f"--index={started_as}",
                    f"--pipeline={PIPELINE}",
                    "--model_dir=unused",
                )
                if command == "train"
                else machine.od_dist(
                    command, f"--cluster={cluster}", "--role=worker", f"--index={started_as}"
                )
            )
            assert r.returncode == 2, r.stdout + r.stderr
            wrong = net[2].ip if started_as == 0 else net[1].ip
            assert (
                f"worker[{started_as}]: '{wrong}:{PORT}': not an address of this machine; this machine is "
                f"worker index {really}, not {started_as}: run with --role worker --index {really}"
            ) in r.stderr
            assert time.monotonic() - start < 30  # refused before TensorFlow is imported


def test_a_machine_in_no_entry_is_refused(tmp_path, machines):
    net = machines(5)
    cluster = ps_cluster(tmp_path, net)
    stranger = net[4]
    r = stranger.od_dist("validate", f"--cluster={cluster}")  # checks the file, says so
    assert r.returncode == 0 and "this machine: none of its entries (its addresses: " in r.stdout, r.stderr
    r = stranger.od_dist("train", f"--cluster={cluster}", f"--pipeline={PIPELINE}", "--model_dir=unused")
    assert "--role: '': no entry of the cluster file is an address of this machine" in r.stderr
    for command in ("validate", "train"):
        r = stranger.od_dist(command, f"--cluster={cluster}", "--role=worker", "--index=0")
        assert r.returncode == 2, r.stdout + r.stderr
        assert (
            f"worker[0]: '{net[1].ip}:{PORT}': not an address of this machine; no entry of the cluster "
            "file is an address of this machine"
        ) in r.stderr
    r = stranger.od_dist("train", f"--cluster={cluster}", f"--pipeline={PIPELINE}", "--model_dir=unused")
    assert r.returncode == 2 and "no entry of the cluster file is an address of this machine" in r.stderr


def test_a_missing_ps_is_refused_on_every_machine(tmp_path, machines):
    net = machines(3)
    cluster = write_cluster(
        tmp_path,
        f"strategy: parameter_server\nmaster: {net[0].ip}:{PORT}\n"
        f"worker: [{net[1].ip}:{PORT}, {net[2].ip}:{PORT}]\n",
    )
    roles = {0: ("master", 0), 1: ("worker", 0), 2: ("worker", 1)}
    for machine in net:
        role, index = roles[machine.index]
        for args in ([], [f"--role={role}", f"--index={index}"]):
            for command in ("validate", "train"):
                more = [f"--pipeline={PIPELINE}", "--model_dir=unused"] if command == "train" else []
                r = machine.od_dist(command, f"--cluster={cluster}", *args, *more)
                assert r.returncode == 2, r.stdout + r.stderr
                assert "ps: '': parameter_server needs at least one ps; add 'ps: [host:port]'" in r.stderr


# ----- od-dist doctor on the simulated machines (no TensorFlow: fast) ----------------------------


def doctor_lines(r):
    return [line.strip() for line in r.stdout.splitlines()]


def test_doctor_tells_listening_not_yet_listening_and_firewalled_peers_apart(tmp_path, machines):
    if not netns.firewall_tool():
        pytest.skip("neither nft nor iptables is installed (apt-get install nftables)")
    net = machines(4)
    cluster = ps_cluster(tmp_path, net)  # master 0, workers 1 and 2, ps 3; doctor runs on the master
    worker_up = net[1].listen(PORT)  # worker 0 is up; worker 1 is not started yet
    net[3].drop_tcp(PORT)  # the ps machine's firewall drops the port
    try:
        r = net[0].od_dist("doctor", f"--cluster={cluster}", "--connect_timeout=2")
        lines = doctor_lines(r)
        assert r.returncode == 1, r.stdout + r.stderr
        assert f"ok    this machine: master:0 at {net[0].ip}:{PORT} (found by its addresses)" in lines
        assert (
            f"ok    worker:0 at {net[1].ip}:{PORT}: accepts connections (its task's server, or whatever else holds the port)"
            in lines
        )
        assert any(
            line.startswith(
                f"warn  worker:1 at {net[2].ip}:{PORT}: connection refused: the machine answers "
                "and nothing listens on the port yet"
            )
            for line in lines
        ), r.stdout
        assert any(
            line.startswith(
                f"FIX   ps:0 at {net[3].ip}:{PORT}: no answer within 2 s: a firewall drops TCP "
                f"port {PORT} on {net[3].ip}"
            )
            for line in lines
        ), r.stdout
        assert f"ok    port {PORT} here: free for master:0" in lines
        assert any(
            line.startswith("ok    versions: od-dist ") and "TensorFlow 2.20" in line for line in lines
        )
        assert any(line.startswith("ok    GPUs: ") for line in lines)
        assert lines[-1] == "od-dist doctor: 1 to fix (the FIX lines above)"

        # A worker under parameter_server reaches the ps and the master, never the other worker
        # (whose firewall may rightly be closed to it).
        r = net[1].od_dist(
            "doctor", f"--cluster={cluster}", "--connect_timeout=2", "--role=worker", "--index=0"
        )
        peers = [line.split(" at ")[0].split()[-1] for line in doctor_lines(r) if f":{PORT}: " in line]
        assert sorted(peers) == ["master:0", "ps:0"], r.stdout

        net[3].clear_firewall()  # fixed: now the ps machine only has nothing listening yet
        r = net[0].od_dist("doctor", f"--cluster={cluster}", "--connect_timeout=2")
        assert r.returncode == 0, r.stdout + r.stderr
        assert any(
            line.startswith(f"warn  ps:0 at {net[3].ip}:{PORT}: connection refused")
            for line in doctor_lines(r)
        )
        assert doctor_lines(r)[-1].startswith("od-dist doctor: nothing to fix")
    finally:
        worker_up.kill()
        worker_up.wait(timeout=30)


def test_doctor_names_what_is_wrong_on_this_machine(tmp_path, machines):
    net = machines(4)
    cluster = ps_cluster(tmp_path, net)
    # This machine's own port is taken by another program.
    taken = net[3].listen(PORT)
    try:
        r = net[3].od_dist("doctor", f"--cluster={cluster}", "--connect_timeout=1")
    finally:
        taken.kill()
        taken.wait(timeout=30)
    assert r.returncode == 1
    assert any(
        line.startswith(f"FIX   port {PORT} here: in use") and "ps:0 cannot start" in line
        for line in doctor_lines(r)
    ), r.stdout
    # Started as the wrong task: the fix names the right one.
    r = net[1].od_dist("doctor", f"--cluster={cluster}", "--role=worker", "--index=1", "--connect_timeout=1")
    assert r.returncode == 1
    assert (
        f"FIX   this machine: worker[1]: '{net[2].ip}:{PORT}': not an address of this machine; this machine "
        "is worker index 0, not 1: run with --role worker --index 0"
    ) in doctor_lines(r)
    # A peer written by a name nobody resolves (each machine knows node1..node4 only).
    ghost = write_cluster(
        tmp_path,
        f"master: node1:{PORT}\nworker: [node2:{PORT}, ghost.invalid:{PORT}]\nps: [node4:{PORT}]\n",
        "ghost.yaml",
    )
    r = net[1].od_dist("doctor", f"--cluster={ghost}", "--connect_timeout=1")
    assert r.returncode == 1
    lines = doctor_lines(r)
    assert f"ok    name node1: resolves to {net[0].ip} (master:0)" in lines, r.stdout
    assert any(
        line.startswith("FIX   name ghost.invalid: does not resolve from this machine (worker:1)")
        for line in lines
    ), r.stdout
    # A machine that is in no entry, and an invalid file.
    stranger = machines(1)[0]
    r = stranger.od_dist("doctor", f"--cluster={cluster}", "--connect_timeout=1")
    assert r.returncode == 1
    assert any(
        line.startswith("FIX   this machine: no entry of the cluster file is an address of this machine")
        for line in doctor_lines(r)
    ), r.stdout
    bad = write_cluster(
        tmp_path,
        f"master: {net[0].ip}:{PORT}\nworker: [{net[1].ip}:{PORT}]\nstrategy: parameter_server\n",
        "bad.yaml",
    )
    r = net[1].od_dist("doctor", f"--cluster={bad}")
    assert r.returncode == 2 and "ps: '': parameter_server needs at least one ps" in r.stderr


# ----- real jobs, each machine started by its own generated script (slow) ----------------------


def job_cluster(tmp_path, net, roles, **extra):
    """A cluster file for `roles` ({machine index: 'master' | 'worker' | 'ps'}), whose hosts run
    this test's interpreter from a working directory of their own (the namespaces share the file
    system, as machines with the same install would)."""
    by_role = {
        r: [f"{net[i].ip}:{PORT}" for i, role in sorted(roles.items()) if role == r]
        for r in ("master", "worker", "ps")
    }
    lines = [f"master: {by_role['master'][0]}", f"worker: [{', '.join(by_role['worker'])}]"]
    if by_role["ps"]:
        lines.append(f"ps: [{', '.join(by_role['ps'])}]")
    evaluators = [i for i, role in roles.items() if role == "evaluator"]
    if evaluators:
        lines.append(f"evaluator: {net[evaluators[0]].ip}")
    lines += [f"{k}: {v}" for k, v in extra.items()]
    lines.append("hosts:")
    for i in sorted(roles):
        workdir = tmp_path / net[i].hostname
        workdir.mkdir()
        lines.append(f"  {net[i].ip}: {{python: '{sys.executable}', workdir: '{workdir}'}}")
    return write_cluster(tmp_path, "\n".join(lines) + "\n")


def write_scripts(tmp_path, cluster, data_dir, steps, wait_timeout, override=None, flags=(), model_dir=None):
    """`od-dist scripts` for `cluster`: a tiny run of `steps` steps, or `override` (--params_override).
    `model_dir`: default one folder that every machine shares; a relative one is each machine's own
    (under its workdir), as on a LAN of separate disks."""
    out = tmp_path / "scripts"
    model_dir = model_dir or tmp_path / "model"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "od_dist",
            "scripts",
            f"--cluster={cluster}",
            f"--pipeline={PIPELINE}",
            f"--model_dir={model_dir}",
            "--params_override=" + (override or TINY.format(steps=steps, data=data_dir)),
            f"--wait_timeout={wait_timeout}",
            f"--out={out}",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    return out, model_dir


class Job:
    """Tasks started inside their machines ({name: (machine, argv)}); output to one log per task."""

    def __init__(self, tmp_path, commands, cwd=None):
        """`cwd`: one working directory for all, or {name: its own} (a machine's own disk)."""
        self.procs, self.logs = {}, {}
        for name, (machine, argv) in commands.items():
            self.logs[name] = tmp_path / f"{name.replace(':', '-')}.log"
            here = cwd.get(name) if isinstance(cwd, dict) else cwd
            with open(self.logs[name], "w") as log:
                self.procs[name] = machine.popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=here)

    @classmethod
    def from_scripts(cls, tmp_path, net, roles, scripts):
        """Each machine runs the .sh that `od-dist scripts` wrote for its task."""
        commands, counters = {}, {}
        for i, role in sorted(
            roles.items(), key=lambda kv: kv[1] == "master"
        ):  # servers first: any order works
            index = counters.get(role, 0)
            counters[role] = index + 1
            commands[f"{role}:{index}"] = (net[i], ["bash", str(scripts / f"{role}-{index}.sh")])
        return cls(tmp_path, commands)

    def output(self, name):
        return self.logs[name].read_text(errors="replace")

    def all_output(self):
        return "\n".join(f"----- {n}\n{self.output(n)[-3000:]}" for n in self.procs)

    def wait(self, names, timeout):
        """Waits for the named tasks to end, at most `timeout` seconds; returns {name: rc or None}."""
        deadline = time.monotonic() + timeout
        for name in names:
            try:
                self.procs[name].wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return {n: self.procs[n].poll() for n in names}

    def wait_for_line(self, name, pattern, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if re.search(pattern, self.output(name)):
                return True
            if self.procs[name].poll() is not None:
                return False
            time.sleep(0.5)
        return False

    def kill(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


@pytest.mark.slow
def test_the_same_train_line_on_three_machines_trains_with_a_ps_on_each_worker_machine(
    tmp_path, machines, data_dir
):
    """The same `od-dist train` line on each machine, no --role, each machine its own disk (the
    same relative --model_dir in its own working directory): the master's machine finds its one
    entry and trains in its own process; each worker machine holds a ps and a worker and starts both
    under one supervisor, as launch does. Worker 1 is killed for good (kill -9, no restart left)
    once the master trains: it ends alone, ps 1 and the master go on, the job trains to the final
    step, and every machine's od-dist exits 0, the third naming what it lost."""
    net = machines(3)
    workers = [f"{net[i].ip}:{PORT}" for i in (1, 2)]
    servers = [f"{net[i].ip}:{PORT + 1}" for i in (1, 2)]
    cluster = write_cluster(
        tmp_path,
        f"master: {net[0].ip}:{PORT}\nworker: [{', '.join(workers)}]\nps: [{', '.join(servers)}]\n",
    )
    steps = 20
    train = [
        sys.executable,
        "-m",
        "od_dist",
        "train",
        f"--cluster={cluster}",
        f"--pipeline={PIPELINE}",
        "--model_dir=runs/lan",
        "--params_override=" + TINY.format(steps=steps, data=data_dir),
        "--wait_timeout=120",
    ]
    disks = {name: tmp_path / name for name in ("master:0", "node2", "node3")}
    for disk in disks.values():
        disk.mkdir()
    job = Job(
        tmp_path,
        {"master:0": (net[0], train), "node2": (net[1], train), "node3": (net[2], train)},
        cwd={name: str(disk) for name, disk in disks.items()},
    )
    try:
        assert job.wait_for_line("master:0", r"od-dist train \| step \d+/", timeout=300), job.all_output()
        (victim,) = [
            c
            for c in psutil.Process(job.procs["node3"].pid).children(recursive=True)
            if "--role=worker" in c.cmdline() and "--index=1" in c.cmdline()
        ]
        victim.kill()
        codes = job.wait(list(job.procs), timeout=480)
    finally:
        job.kill()
    out = job.all_output()
    assert codes == {"master:0": 0, "node2": 0, "node3": 0}, out
    assert "master:0: training with ParameterServerStrategy" in job.output("master:0"), out
    assert re.search(rf"od-dist train \| step {steps}/{steps} ", job.output("master:0")), out
    for i, machine in enumerate(("node2", "node3")):
        text = job.output(machine)
        assert f"od-dist train: starting ps:{i}, worker:{i}; logs in " in text, out
        assert f"[ps:{i}] ps:{i} serving on {servers[i]}\n" in text, out
        assert f"[worker:{i}] worker:{i} serving on {workers[i]}\n" in text, out
    assert job.output("node2").rstrip().endswith("od-dist train: every task finished"), out
    # One command per machine keeps the rules of separate commands: the lost worker ends alone.
    assert (
        "od-dist train: worker:1 died (exit 137, killed); no restart left (--max_restarts 0); it ends alone: "
        "the master trains on the workers left (ps:1 goes on here). Its log: runs/lan/logs/worker-1.log"
    ) in job.output("node3"), out
    assert (
        job.output("node3")
        .rstrip()
        .endswith(
            "od-dist train: every task finished but worker:1 (exit 137, killed), lost with no restart left: "
            "the master trained on the workers left"
        )
    ), out
    assert checkpoint_step(str(disks["master:0"] / "runs" / "lan")) == steps  # on the master's own disk


@pytest.mark.slow
def test_parameter_server_job_on_four_machines_then_the_masters_machine_cut_off(tmp_path, machines, data_dir):
    """Each machine runs the script `od-dist scripts` wrote for it (`train --max_restarts 3`); every
    server serves on its own machine's address. Then the master's machine loses its link mid-run:
    the ps and the workers must not wait forever; each machine's od-dist ends within --wait_timeout
    (plus a probe), exit 138 (a lost peer, not restarted: it already waited in vain), naming the
    lost master."""
    net = machines(4)
    roles = {0: "master", 1: "worker", 2: "worker", 3: "ps"}
    cluster = job_cluster(tmp_path, net, roles)
    # Also every task's wait for its peers as the job starts, and (x watch.FIRST_LOOP_WAITS, 60 s)
    # the master's bound on its first training loop: its start to that loop's end took 16 s at load 5.
    wait_timeout = 20
    scripts, _ = write_scripts(tmp_path, cluster, data_dir, steps=100000, wait_timeout=wait_timeout)
    job = Job.from_scripts(tmp_path, net, roles, scripts)
    expected = {"ps:0": net[3], "worker:0": net[1], "worker:1": net[2]}
    survivors = list(expected)
    bound = wait_timeout + 60  # a probe every 5 s, and slack for a loaded machine
    try:
        assert job.wait_for_line("master:0", r"od-dist train \| step \d+/100000", timeout=300), (
            job.all_output()
        )
        net[0].cut_off()
        cut = time.monotonic()
        codes = job.wait(survivors, timeout=bound)
        took = time.monotonic() - cut
    finally:
        job.kill()
    out = job.all_output()
    for name, machine in expected.items():
        assert f"{name} serving on {machine.ip}:{PORT}\n" in job.output(name), out
    assert "master:0: training with ParameterServerStrategy" in job.output("master:0"), out
    assert None not in codes.values(), (
        f"still running {bound} s after the master's machine was cut off: {codes}\n{out}"
    )
    print(f"the others ended {took:.0f} s after the cut: {codes}")
    for name in survivors:  # a lost peer: retryable, naming the master and its address
        assert codes[name] == exit_codes.LOST_PEER, out
        lost = f"{name}: lost the master at {net[0].ip}:{PORT} (unreachable for {wait_timeout} s)"
        assert lost in job.output(name), out


@pytest.mark.slow
def test_multi_worker_mirrored_on_separate_disks_a_machine_lost_and_its_disk_replaced(
    tmp_path, machines, data_dir
):
    """A LAN as it is: three multi_worker_mirrored trainer machines and an evaluator's machine, each
    with its own --model_dir (no shared folder), each started by the script `od-dist scripts` wrote
    for it. Mid-run every process of worker 1's machine is killed (kill -9) and its model_dir wiped
    (a new disk); the other trainers exit 138 and their scripts restart them; its script started
    again, it joins with the newest checkpoint the others hold, and the job finishes. The
    evaluator, on its own disk, fetches the checkpoints from the master's checkpoint_port and prints
    the COCO line of the final one."""
    net = machines(4)
    roles = {0: "master", 1: "worker", 2: "worker", 3: "evaluator"}
    cluster = job_cluster(tmp_path, net, roles, strategy="multi_worker_mirrored", checkpoint_port=PORT + 1)
    steps = 20
    override = TINY.format(steps=steps, data=data_dir) + ",task.train_data.global_batch_size=3"  # 3 trainers
    scripts, _ = write_scripts(
        tmp_path, cluster, data_dir, steps, wait_timeout=240, override=override, model_dir="runs/lan"
    )
    own = {i: tmp_path / net[i].hostname / "runs" / "lan" for i in roles}
    job = Job.from_scripts(tmp_path, net, roles, scripts)
    try:
        # Killed once worker 1 holds a checkpoint of its own: a copy it would lose with its disk.
        deadline = time.monotonic() + 420
        while checkpoint_step(str(own[2])) is None and time.monotonic() < deadline:
            assert job.procs["worker:1"].poll() is None, job.all_output()
            time.sleep(0.5)
        assert checkpoint_step(str(own[2])) is not None, job.all_output()
        net[2].power_off()
        killed = time.monotonic()
        lost_at = checkpoint_step(str(own[1]))
        shutil.rmtree(own[2])
        again = Job(tmp_path, {"worker:1 again": (net[2], ["bash", str(scripts / "worker-1.sh")])})
        job.procs.update(again.procs)
        job.logs.update(again.logs)
        assert job.wait_for_line("master:0", r"restart 1/", timeout=120), job.all_output()
        assert job.wait_for_line("worker:1 again", r"od-dist train \| step \d+/", 300), job.all_output()
        training_again = time.monotonic() - killed  # loss to the rejoined machine's first loop
        codes = job.wait(["master:0", "worker:0", "worker:1 again", "evaluator:0"], timeout=600)
    finally:
        job.kill()
    out = job.all_output()
    assert codes == {"master:0": 0, "worker:0": 0, "worker:1 again": 0, "evaluator:0": 0}, out
    resumed = re.search(
        r"od-dist train \| resuming run [0-9a-f]{12} at step (\d+) from (master|worker):0's checkpoint, its variables "
        r"sent over "
        r"the all-reduce to the trainers whose --model_dir is behind \(worker:1's at step 0; 0: no checkpoint\)",
        job.output("worker:1 again"),
    )
    assert resumed and int(resumed.group(1)) >= (lost_at or 0), out
    # The master names the machine lost, at once rather than at a collective's timeout, and tells
    # its supervisor to restart it; it resumes with the same variables as the new disk.
    assert re.search(
        rf"^od-dist: master:0: lost worker:1 at {re.escape(net[2].ip)}:{PORT} .*restart all of them.*; exit 138$",
        job.output("master:0"),
        re.M,
    ), out
    assert resumed.group(0) in job.output("master:0"), out
    back = re.search(r"od-dist train \| step (\d+)/", job.output("worker:1 again"))
    print(
        f"\nworker 1's machine killed at step >= {lost_at}; the job resumed at step {resumed.group(1)} "
        f"with a new disk there; training again {training_again:.0f} s after the kill, done after "
        f"{time.monotonic() - killed:.0f} s"
    )
    assert back and int(back.group(1)) > int(resumed.group(1)), out
    for i in (0, 1, 2):  # every trainer machine holds the final checkpoint on its own disk
        assert checkpoint_step(str(own[i])) == steps, (i, out)
    final = [m for m in COCO_LINE.finditer(job.output("evaluator:0")) if int(m["step"]) == steps]
    assert final, out
    assert checkpoint_step(str(own[3])) == steps, out  # fetched, named on the evaluator's own disk
    assert re.search(rf"fetched ckpt-{steps} from the checkpoint feed at {net[0].ip}:{PORT + 1}", out), out


@pytest.mark.slow
def test_elastic_three_machines_go_on_without_a_lost_one_take_it_back_and_lose_the_master(
    tmp_path, machines, data_dir
):
    """An elastic multi_worker_mirrored job (min_trainers: 2) on three trainer machines and an
    evaluator's, each with its own disk, each started by its generated script. Worker 1's machine
    is powered off: the two others go on as a group of 2 with the same global batch. Its script
    started again on an empty disk, the group saves and goes on with it, as 3. Then the master's
    machine is powered off for good: worker 0 leads the last group of 2, writes the final
    checkpoint, gives the job's line of who trained when, and the evaluator follows its feed."""
    net = machines(4)
    roles = {0: "master", 1: "worker", 2: "worker", 3: "evaluator"}
    cluster = job_cluster(
        tmp_path,
        net,
        roles,
        strategy="multi_worker_mirrored",
        checkpoint_port=PORT + 1,
        min_trainers=2,
        membership_port=PORT + 2,
    )
    # A checkpoint every 10 steps, not 5: each trainer saves to its own disk, and a save costs more
    # CPU than the steps. The master is lost at about step 40 alone, 60-65 in the suite: 100 leaves
    # the last group of 2 a stretch of its own (150 had cost about 15 s alone, 30 s in the suite).
    steps = 100
    # 6 splits over 3 trainers and over 2: every group keeps the same arithmetic.
    override = (
        TINY.format(steps=steps, data=data_dir).replace("checkpoint_interval=5", "checkpoint_interval=10")
        + ",task.train_data.global_batch_size=6"
    )
    scripts, _ = write_scripts(
        tmp_path, cluster, data_dir, steps, wait_timeout=240, override=override, model_dir="runs/lan"
    )
    own = {i: tmp_path / net[i].hostname / "runs" / "lan" for i in roles}
    job = Job.from_scripts(tmp_path, net, roles, scripts)
    figures = {}

    def training_again(name, after_step, since, what):
        """Waits until `name`'s disk holds a checkpoint past `after_step`: the new group trains."""
        deadline = time.monotonic() + 240
        while (checkpoint_step(str(own[name])) or 0) <= after_step and time.monotonic() < deadline:
            time.sleep(0.25)
        assert (checkpoint_step(str(own[name])) or 0) > after_step, job.all_output()
        figures[what] = time.monotonic() - since

    try:
        deadline = time.monotonic() + 420
        while checkpoint_step(str(own[2])) is None and time.monotonic() < deadline:
            assert job.procs["worker:1"].poll() is None, job.all_output()
            time.sleep(0.5)
        # 1. Worker 1's machine lost: master and worker 0 go on as a group of 2.
        net[2].power_off()
        lost = time.monotonic()
        lost_at = checkpoint_step(str(own[0])) or 0
        assert job.wait_for_line("master:0", r"round \d+: master:0, worker:0 train from step", 120), (
            job.all_output()
        )
        training_again(0, lost_at, lost, "loss to a checkpoint of the group of 2")
        # 2. Back on an empty disk: the group saves, and goes on as 3.
        shutil.rmtree(own[2])
        again = Job(tmp_path, {"worker:1 again": (net[2], ["bash", str(scripts / "worker-1.sh")])})
        job.procs.update(again.procs)
        job.logs.update(again.logs)
        back = time.monotonic()
        assert job.wait_for_line(
            "worker:1 again", r"round \d+: master:0, worker:0, worker:1 train from step", 180
        ), job.all_output()
        training_again(2, 0, back, "return to a checkpoint of the group of 3")
        # 3. The master's machine lost for good: worker 0 leads.
        net[0].power_off()
        lost_master = time.monotonic()
        assert job.wait_for_line("worker:0", r"round \d+: worker:0, worker:1 train from step", 120), (
            job.all_output()
        )
        codes = job.wait(["worker:0", "worker:1 again", "evaluator:0"], timeout=600)
        figures["master lost to the job's end"] = time.monotonic() - lost_master
    finally:
        job.kill()
    out = job.all_output()
    assert codes == {"worker:0": 0, "worker:1 again": 0, "evaluator:0": 0}, out
    for i in (1, 2):  # the last group's members hold the final checkpoint
        assert checkpoint_step(str(own[i])) == steps, (i, out)
    # The stop for the machine back was asked for, not a failure: no restart counted for it.
    assert re.search(
        r"worker:0 saved and stopped \(exit 143, terminated\); as asked: forming the next round",
        job.output("worker:0"),
    ), out
    trained = re.search(r"od-dist train: (trained steps .*)", job.output("worker:0"))
    assert trained, out
    assert re.fullmatch(
        r"trained steps 0-[\d,]+ on 3 of 3 trainers, [\d,]+-[\d,]+ on 2 of 3 trainers \(without worker:1\), "
        r"[\d,]+-[\d,]+ on 3 of 3 trainers, [\d,]+-"
        + f"{steps}"
        + r" on 2 of 3 trainers \(without master:0\)",
        trained.group(1),
    ), trained.group(1)
    # The evaluator, on its own disk, followed the lead from the master's machine to worker 0's.
    assert re.search(rf"fetched ckpt-{steps} from the checkpoint feed at {net[1].ip}:{PORT + 1}", out), out
    final = [m for m in COCO_LINE.finditer(job.output("evaluator:0")) if int(m["step"]) == steps]
    assert final, out
    print("\n" + trained.group(1) + "; " + "; ".join(f"{k}: {v:.0f} s" for k, v in figures.items()))


@pytest.mark.slow
def test_elastic_parameter_server_the_masters_link_cut_60_s_then_healed_one_coordinator_at_a_time(
    tmp_path, machines, data_dir
):
    """An elastic parameter_server job (min_trainers: 2): a master, two workers, a ps and an
    evaluator, each machine with its own disk, each started by its generated script (--wait_timeout
    at its default), the evaluator's disk holding an earlier run's checkpoint. The workers keep
    copies of the master's checkpoints (its feed). Worker 1's server killed: it rejoins the round
    the master trains (no new round). Then the master's link is cut for 60 s: its lease runs out and
    it stops before the workers, which lost it, form round 2 without it, coordinated by the worker
    whose copy is newest, with the same ps (never restarted). Healed, the master's machine sees the
    newer round; round 2's coordinator alone stops for it and saves, and round 3 goes on from that
    save with all three, the master as a worker. The job finishes, the evaluator evaluates the final
    checkpoint (it restores), never the earlier run's, which it set aside."""
    net = machines(5)
    roles = {0: "master", 1: "worker", 2: "worker", 3: "ps", 4: "evaluator"}
    cluster = job_cluster(
        tmp_path, net, roles, checkpoint_port=PORT + 1, min_trainers=2, membership_port=PORT + 2
    )
    # Enough steps that the job still trains when the link comes back (round 2 trained 175 steps in
    # the 60 s of a quiet run's cut, and finished); a checkpoint every 100: the evaluator scores
    # each, which the job's end waits for.
    steps = 900
    override = TINY.format(steps=steps, data=data_dir).replace(
        "checkpoint_interval=5", "checkpoint_interval=100"
    )
    scripts, _ = write_scripts(
        tmp_path, cluster, data_dir, steps, wait_timeout=300, override=override, model_dir="runs/lan"
    )
    own = {i: tmp_path / net[i].hostname / "runs" / "lan" for i in roles}
    write_checkpoint(own[4], 5000)  # an earlier run of this file, on the evaluator's disk
    lineage.write_run(str(own[4]), "0123456789ab")
    job = Job.from_scripts(tmp_path, net, roles, scripts)
    round_line = re.compile(r"round 2: (worker:\d), worker:\d train from step ([\d,]+), \1 coordinating")
    try:
        deadline = time.monotonic() + 420
        while not any(checkpoint_step(str(own[i])) for i in (1, 2)) and time.monotonic() < deadline:
            assert job.procs["master:0"].poll() is None, job.all_output()
            time.sleep(0.5)
        (server,) = [
            c
            for c in psutil.Process(job.procs["worker:1"].pid).children(recursive=True)
            if "--role=worker" in c.cmdline()
        ]
        server.kill()
        # Back in the round once its server sees the master again.
        rejoined = r"(?s)rejoining round 1 .*worker:1: the round's coordinator at \S+ is up"
        assert job.wait_for_line("worker:1", rejoined, 120), job.all_output()
        assert job.procs["master:0"].poll() is None and checkpoint_step(str(own[0])) < steps, job.all_output()
        net[0].cut_off()
        cut = time.monotonic()
        held = max(checkpoint_step(str(own[i])) or 0 for i in (1, 2))
        deadline = time.monotonic() + 120
        while not round_line.search(job.output("worker:0")) and time.monotonic() < deadline:
            time.sleep(0.5)
        lead, resumed = round_line.search(job.output("worker:0")).groups()
        lead_disk = own[1 + int(lead[-1])]
        while (checkpoint_step(str(lead_disk)) or 0) <= held and time.monotonic() < deadline:
            time.sleep(0.25)
        training_again = time.monotonic() - cut
        time.sleep(max(0.0, 60 - (time.monotonic() - cut)))
        net[0].reconnect()
        healed = time.monotonic()
        assert job.wait_for_line("worker:0", r"round 3: .*\(3 of 3 trainers\)", 180), job.all_output()
        back = time.monotonic() - healed
        codes = job.wait(["master:0", "worker:0", "worker:1", "ps:0", "evaluator:0"], timeout=600)
    finally:
        job.kill()
    out = job.all_output()
    assert codes == {"master:0": 0, "worker:0": 0, "worker:1": 0, "ps:0": 0, "evaluator:0": 0}, out
    master = job.output("master:0")
    # One coordinator at a time: the master's lease ran out and it stopped while cut off.
    assert "the coordinator of round 1 has not reached min_trainers (2) of its round" in master, out
    assert int(resumed.replace(",", "")) >= held > 0, out  # from its copy, not from scratch
    assert f"{lead}: round 2 of an elastic job: {lead}, worker:" in job.output(lead), out
    # Cut off, the master was stopped at once (its save would race round 2), not after --grace_period.
    assert "killing master:0 (a save now would race the round the others form)" in master, out
    assert "still running" not in master, out
    # Healed: one round more, of all three, from round 2's coordinator's save, the master a worker.
    rounds = re.findall(
        r"round (\d+): (\S+), (\S+), (\S+) train from step [\d,]+, (\S+) coordinating", job.output(lead)
    )
    assert [int(r[0]) for r in rounds] == [1, 3], out  # no round was formed again for nothing
    assert rounds[-1][4] == lead and "master:0" in rounds[-1][2:4], out
    assert job.output("ps:0").count("ps:0 serving on") == 1, out  # the variables' server stayed up
    assert checkpoint_step(str(lead_disk)) == steps, out
    # The evaluator set the earlier run's folder aside and evaluated this run's final checkpoint only.
    evaluator = job.output("evaluator:0")
    assert "runs/lan held ckpt-5000 of run 0123456789ab, not this run's" in evaluator, evaluator[-3000:]
    evaluated = [int(m["step"]) for m in COCO_LINE.finditer(evaluator)]
    assert steps in evaluated and 5000 not in evaluated, evaluator[-3000:]
    print(
        f"\nmaster cut off to training again without it: {training_again:.0f} s; healed to round 3: {back:.0f} s; "
        f"{lead} coordinated round 2 from step {resumed}"
    )
