"""Several machines on one box (tests/netns.py: one network namespace per machine, each with its
own address on one bridge; root only). The ordering check sees each machine's own interfaces, as on
a real LAN, and real jobs start on each machine from the script `od-dist scripts` wrote for it."""

import os
import re
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PIPELINE = os.path.join(ROOT, "pipelines", "shapes_retinanet.yaml")
PORT = 2222  # every machine has its own address, so every task can use the same port, as on a LAN
TINY = ("trainer.train_steps={steps},trainer.steps_per_loop=5,trainer.summary_interval=5,"
        "trainer.checkpoint_interval=5,trainer.validation_interval=5,"
        "task.train_data.input_path={data}/train.tfrecord,task.validation_data.input_path={data}/val.tfrecord")


def write_cluster(tmp_path, text, name="cluster.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def ps_cluster(tmp_path, net, workers=(1, 2), **extra):
    """master on machine 0, workers on the given machines (list order = index), ps on machine 3."""
    lines = [f"master: {net[0].ip}:{PORT}",
             "worker: [" + ", ".join(f"{net[i].ip}:{PORT}" for i in workers) + "]",
             f"ps: [{net[3].ip}:{PORT}]"]
    lines += [f"{k}: {v}" for k, v in extra.items()]
    return write_cluster(tmp_path, "\n".join(lines) + "\n")


# ----- the ordering check (no TensorFlow: fast) --------------------------------------------------


def test_each_machine_infers_its_own_entry(tmp_path, machines):
    net = machines(5)
    expected = {0: "master:0", 1: "worker:0", 2: "worker:1", 3: "ps:0"}
    by_ip = ps_cluster(tmp_path, net)
    # The same machines written by host name (each machine's /etc/hosts knows node1..node5).
    by_name = write_cluster(tmp_path, f"master: node1:{PORT}\nworker: [node2:{PORT}, node3:{PORT}]\n"
                            f"ps: [node4:{PORT}]\n", "named.yaml")
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
            r = machine.od_dist(command, f"--cluster={cluster}", "--role=worker", f"--index={started_as}",
                                f"--pipeline={PIPELINE}", "--model_dir=unused") if command == "train" else \
                machine.od_dist(command, f"--cluster={cluster}", "--role=worker", f"--index={started_as}")
            assert r.returncode == 2, r.stdout + r.stderr
            wrong = net[2].ip if started_as == 0 else net[1].ip
            assert (f"worker[{started_as}]: '{wrong}:{PORT}': not an address of this machine; this machine is "
                    f"worker index {really}, not {started_as}: run with --role worker --index {really}") in r.stderr
            assert time.monotonic() - start < 30  # refused before TensorFlow is imported


def test_a_machine_in_no_entry_is_refused(tmp_path, machines):
    net = machines(5)
    cluster = ps_cluster(tmp_path, net)
    stranger = net[4]
    r = stranger.od_dist("validate", f"--cluster={cluster}")
    assert r.returncode == 2
    assert "--role: '': no entry of the cluster file is an address of this machine" in r.stderr
    for command in ("validate", "train"):
        r = stranger.od_dist(command, f"--cluster={cluster}", "--role=worker", "--index=0")
        assert r.returncode == 2, r.stdout + r.stderr
        assert (f"worker[0]: '{net[1].ip}:{PORT}': not an address of this machine; no entry of the cluster "
                "file is an address of this machine") in r.stderr
    r = stranger.od_dist("train", f"--cluster={cluster}", f"--pipeline={PIPELINE}", "--model_dir=unused")
    assert r.returncode == 2 and "no entry of the cluster file is an address of this machine" in r.stderr


def test_a_missing_ps_is_refused_on_every_machine(tmp_path, machines):
    net = machines(3)
    cluster = write_cluster(tmp_path, f"strategy: parameter_server\nmaster: {net[0].ip}:{PORT}\n"
                            f"worker: [{net[1].ip}:{PORT}, {net[2].ip}:{PORT}]\n")
    roles = {0: ("master", 0), 1: ("worker", 0), 2: ("worker", 1)}
    for machine in net:
        role, index = roles[machine.index]
        for args in ([], [f"--role={role}", f"--index={index}"]):
            for command in ("validate", "train"):
                more = [f"--pipeline={PIPELINE}", "--model_dir=unused"] if command == "train" else []
                r = machine.od_dist(command, f"--cluster={cluster}", *args, *more)
                assert r.returncode == 2, r.stdout + r.stderr
                assert "ps: '': parameter_server needs at least one ps; add 'ps: [host:port]'" in r.stderr
