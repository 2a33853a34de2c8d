"""Several machines on one box (tests/netns.py: one network namespace per machine, each with its
own address on one bridge; root only). The ordering check sees each machine's own interfaces, as on
a real LAN, and real jobs start on each machine from the script `od-dist scripts` wrote for it."""

import os
import re
import sys
import time

import netns
import psutil
import pytest
from lan_job import PORT, Job, job_cluster, write_cluster, write_scripts
from loopback import COCO_LINE, PIPELINE, TINY, checkpoint_step, write_checkpoint

from od_dist.protocol import exit_codes, lineage


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
    # Also every task's wait for its peers as the job starts.
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
def test_elastic_parameter_server_the_masters_link_cut_then_healed_one_coordinator_at_a_time(
    tmp_path, machines, data_dir
):
    """An elastic parameter_server job (min_trainers: 2): a master, two workers, a ps and an
    evaluator, each machine with its own disk, each started by its generated script (--wait_timeout
    at its default), the evaluator's disk holding an earlier run's checkpoint. The workers keep
    copies of the master's checkpoints (its feed). Worker 1's server killed: it rejoins the round
    the master trains (no new round). Then the master's link is cut until round 2 trains: its lease
    runs out and it stops before the workers, which lost it, form round 2 without it, coordinated by
    the worker whose copy is newest, with the same ps (never restarted). Healed, the master's machine
    sees the newer round; round 2's coordinator alone stops for it and saves, and round 3 goes on from that
    save with all three, the master as a worker. The job finishes, the evaluator evaluates the final
    checkpoint (it restores), never the earlier run's, which it set aside."""
    net = machines(5)
    roles = {0: "master", 1: "worker", 2: "worker", 3: "ps", 4: "evaluator"}
    cluster = job_cluster(
        tmp_path, net, roles, checkpoint_port=PORT + 1, min_trainers=2, membership_port=PORT + 2
    )
    # Enough steps that the job still trains when round 3 forms: the link comes back at round 2's
    # first progress line, and round 3 formed 110 steps after round 2 started in a run alone
    # (2026-12-02, then with a fixed 60 s cut); 600 steps had left round 3 about 480 to train, 55 s
    # of five processes. A checkpoint every 100: the evaluator scores each, which the job's end
    # waits for.
    steps = 300
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
    progress = re.compile(r"^od-dist train \| step \d+/", re.M)
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
        # Round 2 trains: its coordinator's first progress line (its machine's log has no earlier one).
        while not progress.search(job.output(lead)) and time.monotonic() < deadline:
            time.sleep(0.25)
        training_again = time.monotonic() - cut
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
