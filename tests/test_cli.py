"""The validate / tf-config commands as a user runs them: real processes, this machine's real
addresses, TensorFlow's own TFConfigClusterResolver."""

import ipaddress
import json
import os
import subprocess
import sys

import pytest
from loopback import ROOT, od_dist

from od_dist.cluster import hostinfo


def own_private_ip():
    """A non-loopback address of this machine's own interfaces, or skip."""
    for ip in sorted(hostinfo.this_machine().ips):
        addr = ipaddress.ip_address(ip)
        if addr.version == 4 and not addr.is_loopback and not addr.is_link_local and not addr.is_global:
            return ip
    pytest.skip("this machine has no private IPv4 address")


def write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_examples_validate():
    r = od_dist("validate", "--cluster", "clusters/local.yaml")
    assert r.returncode == 0, r.stderr
    assert "parameter_server" in r.stdout and "worker:1" in r.stdout and "127.0.0.1:2232" in r.stdout
    # The LAN example is not this machine: the ordering check must say so, exit 2.
    r = od_dist("validate", "--cluster", "clusters/lan-example.yaml", "--role", "ps")
    assert r.returncode == 2
    assert "ps[0]: '192.168.1.116:2224': not an address of this machine" in r.stderr
    # tf-config prints any task's TF_CONFIG when --role names it, from any machine (another
    # orchestrator's configs are written from the file), and still checks that the task exists.
    r = od_dist("tf-config", "--cluster", "clusters/lan-example.yaml", "--role", "master")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["task"] == {"type": "chief", "index": 0}
    r = od_dist("tf-config", "--cluster", "clusters/lan-example.yaml", "--role", "worker", "--index", "1")
    assert r.returncode == 0 and json.loads(r.stdout)["task"] == {"type": "worker", "index": 1}, r.stderr
    r = od_dist("tf-config", "--cluster", "clusters/lan-example.yaml", "--role", "worker", "--index", "7")
    assert r.returncode == 2 and "--index: '7'" in r.stderr, r.stderr


def test_role_inferred_from_this_machines_real_address(tmp_path):
    ip = own_private_ip()
    path = write(
        tmp_path, f"master: 10.255.0.1:2222\nworker: [10.255.0.2:2222, {ip}:2222]\nps: [10.255.0.3:2222]\n"
    )
    r = od_dist("validate", "--cluster", path)
    assert r.returncode == 0, r.stderr
    assert "this machine: worker:1" in r.stdout
    r = od_dist("tf-config", "--cluster", path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["task"] == {"type": "worker", "index": 1}
    # The classic mistake: the workers listed in another order than the machines run them.
    r = od_dist("validate", "--cluster", path, "--role", "worker", "--index", "0")
    assert r.returncode == 2
    assert "worker[0]: '10.255.0.2:2222': not an address of this machine" in r.stderr
    assert "this machine is worker index 1, not 0" in r.stderr


def test_hostname_entry_matches_this_machine(tmp_path):
    import socket

    name = socket.gethostname().lower()
    path = write(tmp_path, f"master: {name}:2222\nworker: [10.255.0.2:2222]\nps: [10.255.0.3:2222]\n")
    r = od_dist("validate", "--cluster", path)
    assert r.returncode == 0, r.stderr
    assert "this machine: master:0" in r.stdout


def test_no_entry_matches(tmp_path):
    """A file is checked from a machine it does not list (validate: exit 0, saying so); a task
    cannot run there (train without --role: exit 2)."""
    path = write(tmp_path, "master: 10.255.0.1:2222\nworker: [10.255.0.2:2222]\nps: [10.255.0.3:2222]\n")
    r = od_dist("validate", "--cluster", path)
    assert r.returncode == 0, r.stderr
    assert (
        r.stdout.startswith(f"{path}: valid, strategy parameter_server") and "<- this machine" not in r.stdout
    )
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("this machine: ")]
    assert line.startswith("this machine: none of its entries (its addresses: ") and line.endswith(
        "); the tasks run on the machines the file lists"
    ), line
    r = od_dist(
        "train", "--cluster", path, "--pipeline=pipelines/shapes_retinanet.yaml", "--model_dir=runs/x"
    )
    assert r.returncode == 2 and "no entry of the cluster file is an address of this machine" in r.stderr
    # The README's example file, as its walkthrough copies it.
    r = od_dist("validate", "--cluster", "clusters/lan-example.yaml")
    assert r.returncode == 0 and "this machine: none of its entries" in r.stdout, r.stderr


def test_invalid_file_exits_2_with_every_problem(tmp_path):
    path = write(tmp_path, "master: 10.0.0.1:99999\nwrker: [10.0.0.2:1]\n")
    r = od_dist("validate", "--cluster", path)
    assert r.returncode == 2
    assert "port 99999 is out of range" in r.stderr and "did you mean 'worker'" in r.stderr
    assert "Traceback" not in r.stderr


def test_public_address_flag(tmp_path):
    ip = own_private_ip()
    path = write(tmp_path, f"master: {ip}:2222\nworker: [{ip}:2223]\nps: [8.8.8.8:2222]\n")
    r = od_dist("validate", "--cluster", path, "--role", "master")
    assert r.returncode == 2 and "--allow_public_addresses" in r.stderr
    r = od_dist("validate", "--cluster", path, "--role", "master", "--allow_public_addresses")
    # Accepted; the host check still runs (the master is this machine).
    assert r.returncode == 0, r.stderr


def test_bad_flags_and_commands():
    assert od_dist("validate", "--index", "x").returncode == 2
    r = od_dist("valdate")
    assert r.returncode == 2 and "did you mean 'validate'" in r.stderr
    r = od_dist("validate", "--cluster", "clusters/local.yaml", "--role", "worker", "--index", "7")
    assert r.returncode == 2 and "--index: '7'" in r.stderr
    r = od_dist("validate")
    assert r.returncode == 2 and "no cluster file given and TF_CONFIG is not set" in r.stderr


def test_help_says_what_and_shows_an_example():
    r = od_dist("--help")
    assert r.returncode == 0 and "validate" in r.stdout and "Example" in r.stdout
    for cmd in ("validate", "tf-config"):
        r = od_dist(cmd, "--help")
        assert r.returncode == 0 and "Example:" in r.stdout and "--cluster" in r.stdout, cmd


def test_help_matches_what_the_commands_do():
    """Each help says what the command does: every exit code (from protocol/exit_codes.py), AP75 in
    eval's line, no --role/--index where they are refused, the volume k8s mounts but does not write."""
    from od_dist.protocol import exit_codes

    r = od_dist("--help")
    assert r.returncode == 0
    (status,) = [line for line in r.stdout.splitlines() if line.startswith("Exit status:")]
    for code, meaning in exit_codes.MEANINGS.items():
        assert f"{code} {meaning}" in status, status
    assert "eval" in r.stdout and "print COCO AP, AP50 and AP75." in r.stdout
    for cmd in ("launch", "scripts", "k8s"):
        r = od_dist(cmd, "--help")
        assert r.returncode == 0 and "--cluster:" in r.stdout, cmd
        assert "--role:" not in r.stdout and "--index:" not in r.stdout, cmd
        assert "TFJob sets it" not in r.stdout and "as the pods `od-dist k8s` writes get" in r.stdout, cmd
        # Still refused in one line, not as an unknown flag.
        r = od_dist(cmd, "--cluster=clusters/local.yaml", "--role=ps")
        assert r.returncode == 2 and r.stderr.startswith(f"od-dist {cmd}: --role/--index: "), r.stderr
    r = od_dist("train", "--help")
    assert "--role:" in r.stdout and "--index:" in r.stdout
    r = od_dist("k8s", "--help")
    assert "and a PersistentVolumeClaim for" not in r.stdout
    assert "--model_dir on the PersistentVolumeClaim\n--pvc, which you create" in r.stdout


def test_tf_config_from_environment(tmp_path):
    tf_config = {
        "cluster": {
            "chief": ["trainer-chief-0.ns.svc:2222"],
            "worker": ["trainer-worker-0.ns.svc:2222"],
            "ps": ["trainer-ps-0.ns.svc:2222"],
            "evaluator": ["trainer-evaluator-0.ns.svc:2222"],
        },
        "task": {"type": "worker", "index": 0},
    }
    r = od_dist("validate", env={"TF_CONFIG": json.dumps(tf_config)})
    assert r.returncode == 0, r.stderr
    assert "TF_CONFIG: valid, strategy parameter_server" in r.stdout and "this machine: worker:0" in r.stdout
    # Round trip: what od-dist renders for that task is the orchestrator's cluster without the evaluator.
    r = od_dist("tf-config", env={"TF_CONFIG": json.dumps(tf_config)})
    rendered = json.loads(r.stdout)
    assert rendered["task"] == {"type": "worker", "index": 0}
    assert "evaluator" not in rendered["cluster"] and rendered["cluster"]["ps"] == tf_config["cluster"]["ps"]
    # The same validation applies to TF_CONFIG.
    bad = dict(tf_config, cluster=dict(tf_config["cluster"], ps=["trainer-ps-0:99999"]))
    r = od_dist("validate", env={"TF_CONFIG": json.dumps(bad)})
    assert r.returncode == 2 and "ps[0]: 'trainer-ps-0:99999': port 99999 is out of range" in r.stderr
    r = od_dist("validate", env={"TF_CONFIG": "{not json"})
    assert r.returncode == 2 and "TF_CONFIG: not valid JSON" in r.stderr
    r = od_dist("validate", "--role", "ps", env={"TF_CONFIG": json.dumps(tf_config)})
    assert r.returncode == 2 and "TF_CONFIG says this task is worker 0" in r.stderr


def test_validate_imports_no_tensorflow():
    code = (
        "import sys; from od_dist import cli; rc = cli.main(['od-dist', 'validate', '--cluster', "
        "'clusters/local.yaml']); rc |= cli.main(['od-dist', 'tf-config', '--cluster', 'clusters/local.yaml', "
        "'--role', 'ps']); heavy = [m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'official', "
        "'keras', 'tf_keras')]; print('HEAVY', heavy); sys.exit(rc or bool(heavy))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "HEAVY []" in r.stdout


def test_tf_config_accepted_by_tensorflow_resolver(monkeypatch):
    import tensorflow as tf

    from od_dist.cluster import spec as cluster_mod

    c = cluster_mod.load(os.path.join(ROOT, "clusters", "local.yaml"))
    for task in c.tasks():
        monkeypatch.setenv("TF_CONFIG", cluster_mod.tf_config_json(c, task.role, task.index))
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        assert resolver.task_type == task.tf_job and resolver.task_id == task.index
        spec = resolver.cluster_spec().as_dict()
        assert spec == c.cluster_spec()
        assert spec["chief"] == ["127.0.0.1:2230"] and len(spec["worker"]) == 2 and "evaluator" not in spec


def test_launch_picks_every_task_of_this_machine_in_a_lan_cluster(tmp_path):
    ip = own_private_ip()
    path = write(tmp_path, f"master: {ip}:2222\nworker: [{ip}:2223]\nps: [{ip}:2224]\n")
    # Several tasks are this machine: launch takes them all (train would need --role) and then
    # checks the flags each will get, before starting anything.
    r = od_dist("launch", "--cluster", path, "--model_dir", str(tmp_path / "m"))
    assert r.returncode == 2
    assert "--pipeline: '': required for the master role" in r.stderr
    assert "several entries" not in r.stderr
    r = od_dist(
        "launch",
        "--cluster",
        "clusters/lan-example.yaml",
        "--pipeline",
        "pipelines/shapes_retinanet.yaml",
        "--model_dir",
        str(tmp_path / "m"),
    )
    assert r.returncode == 2 and "no task of this cluster is on this machine" in r.stderr


def test_train_without_role_runs_every_entry_of_this_machine(tmp_path):
    """A machine that holds several entries (every one of a loopback cluster): `train` without --role
    takes them all, as launch does, checking the flags each will get before any starts; validate
    names them; tf-config, which prints one task's, still needs --role."""
    ip = own_private_ip()
    path = write(tmp_path, f"master: {ip}:2222\nworker: [{ip}:2223]\nps: [{ip}:2224]\n")
    for cluster in (path, "clusters/local.yaml"):
        r = od_dist("train", "--cluster", cluster, "--model_dir", str(tmp_path / "m"))
        assert r.returncode == 2, r.stderr
        assert "--pipeline: '': required for the master role" in r.stderr
        assert "several entries" not in r.stderr and "pass --role" not in r.stderr
    r = od_dist("validate", "--cluster", path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("<- this machine") == 3
    assert r.stdout.splitlines()[-1].startswith("this machine: ps:0, worker:0, master:0, inferred from")
    assert r.stdout.rstrip().endswith("`od-dist train` without --role starts them all")
    r = od_dist("tf-config", "--cluster", path)
    assert r.returncode == 2 and "several entries are this machine: ps:0, worker:0, master:0" in r.stderr


def test_role_without_a_cluster_is_an_error(tmp_path):
    """Without --cluster and TF_CONFIG, a role would silently train alone into the job's model_dir."""
    for role in (["--role", "worker", "--index", "1"], ["--role", "master"]):
        r = od_dist("train", *role, "--pipeline=pipelines/shapes_retinanet.yaml", f"--model_dir={tmp_path}/m")
        assert r.returncode == 2, r.stderr
        assert "--role" in r.stderr and "without --cluster" in r.stderr and "pass --cluster" in r.stderr
        assert not os.path.exists(tmp_path / "m")


def test_unresolvable_host_names_give_one_message_and_no_traceback(tmp_path):
    path = write(
        tmp_path,
        "master: box-a.invalid:2222\nworker: [box-b.invalid:2222, box-c.invalid:2222]\n"
        "ps: [box-d.invalid:2222]\n",
    )
    # validate checks the file on a machine it does not list: one warning per name it cannot check.
    r = od_dist("validate", "--cluster", path)
    assert r.returncode == 0 and "this machine: none of its entries" in r.stdout, r.stderr
    assert "Traceback" not in r.stderr and "Exception in thread" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 4 and r.stderr.count(": does not resolve on this machine") == 4, r.stderr
    # A task cannot run here.
    r = od_dist("train", "--cluster", path, "--pipeline=pipelines/shapes_retinanet.yaml", "--model_dir=m")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "Exception in thread" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 2, r.stderr  # the 'invalid input' header and one problem


def test_export_help_says_tflite_too_and_scripts_count_in_the_singular(tmp_path):
    """`od-dist --help` and `export --out`'s help name the .tflite export too; `scripts` counts one
    machine as one (three scripts for a machine of undeclared OS: .sh, .cmd, .ps1), and its README
    says the evaluator reads records as the trainers do, not that it is a trainer."""
    r = od_dist("--help")
    (line,) = [ln for ln in r.stdout.splitlines() if ln.strip().startswith("export ")]
    assert ".tflite" in line, line
    r = od_dist("export", "--help")
    out_help = r.stdout.split("--out:", 1)[1].split("--params_override", 1)[0]
    assert "SavedModel folder" in out_help and "--format tflite the .tflite file" in " ".join(
        out_help.split()
    )
    cluster = write(tmp_path, "master: 10.0.0.1:2222\nevaluator: 10.0.0.1\n")
    r = od_dist(
        "scripts",
        f"--cluster={cluster}",
        "--pipeline=pipelines/shapes_retinanet.yaml",
        "--model_dir=runs/a",
        f"--out={tmp_path / 'out'}",
    )
    assert r.returncode == 0 and r.stdout.startswith("wrote 3 scripts for 1 machine and README.md"), r.stdout
    readme = (tmp_path / "out" / "README.md").read_text()
    assert "on every machine that reads them, the trainers' and the evaluator's (10.0.0.1)" in readme
    assert "trainer machine" not in readme
