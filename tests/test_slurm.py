"""`od-dist slurm` and `od-dist train --slurm`: the step layout unit-tested, and the generated batch
script run by `sbatch` on a real Slurm cluster of three nodes started on this machine (root, the
Debian packages slurmd slurmctld slurm-client munge; skipped without them).

The cluster: its own munged (own key and socket), slurmctld and one slurmd per node, state in a
temp folder, free ports. Each node has its own loopback address (NodeAddr 127.0.0.11-13); the
node names resolve to them through an /etc/hosts bind-mounted in a private mount namespace of each
daemon, which their tasks inherit: this machine's /etc/hosts is never edited."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from loopback import ROOT, checkpoint_step, clean_env, free_ports, od_dist, tiny

from od_dist.cluster import slurm
from od_dist.cluster.spec import InvalidCluster

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "unshare")
NODES = ("odn1", "odn2", "odn3")


# ----- the step layout (no Slurm needed) ---------------------------------------------------------


def test_hostlist_forms():
    assert slurm.expand_hostlist("n[1-2]") == ["n1", "n2"]
    assert slurm.expand_hostlist("gpu[01-03,10]") == ["gpu01", "gpu02", "gpu03", "gpu10"]
    assert slurm.expand_hostlist("n9,n10") == ["n9", "n10"]  # Slurm's order, not sorted as text
    assert slurm.expand_hostlist("rack[1-2]-n[1-2],x") == [
        "rack1-n1",
        "rack1-n2",
        "rack2-n1",
        "rack2-n2",
        "x",
    ]
    assert slurm.expand_hostlist("n[8-10]") == ["n8", "n9", "n10"]
    assert slurm.expand_tasks_per_node("2(x2)") == [2, 2]
    assert slurm.expand_tasks_per_node("2(x2),1") == [2, 2, 1]
    for bad in ("n[1-2", "n[2-1]", "n[a]", "n1,,n2", ""):
        with pytest.raises(slurm.HostlistError):
            slurm.expand_hostlist(bad)
    with pytest.raises(slurm.HostlistError):
        slurm.expand_tasks_per_node("2(3)")


CLUSTER = """\
ps: [10.0.0.1:2222]
worker: [10.0.0.1:2223, 10.0.0.2:2224]
master: 10.0.0.1:2225
evaluator: 10.0.0.2
hosts:
  10.0.0.2: {num_clones: 1}
"""


def step_env(rank, node, nodes="n[9-10]", counts="4,2", total="6"):
    return {
        "SLURM_STEP_NODELIST": nodes,
        "SLURM_STEP_TASKS_PER_NODE": counts,
        "SLURM_STEP_NUM_TASKS": total,
        "SLURM_PROCID": str(rank),
        "SLURMD_NODENAME": node,
    }


def test_rank_to_address(tmp_path):
    """Ranks in block order over the file's machines (ps, worker, master, evaluator order), hosts
    replaced by the nodes in Slurm's order (n9 before n10), ports and hosts: settings kept."""
    path = tmp_path / "c.yaml"
    path.write_text(CLUSTER)
    expected = [
        ("ps:0", "n9:2222"),
        ("worker:0", "n9:2223"),
        ("master:0", "n9:2225"),
        ("worker:1", "n10:2224"),
        ("evaluator:0", "n10"),
    ]
    # The loopback machine ("10.0.0.1" here) holds 3 entries and the other 2: 3,2 per node.
    for rank, (name, address) in enumerate(expected):
        node = address.split(":")[0]
        cluster, task, _ = slurm.select(str(path), step_env(rank, node, counts="3,2", total="5"))
        assert (task.name, str(task.address)) == (name, address)
    assert cluster.cluster_spec() == {
        "ps": ["n9:2222"],
        "worker": ["n9:2223", "n10:2224"],
        "chief": ["n9:2225"],
    }
    assert cluster.clones_for("n10") == 1 and dict(cluster.hosts).keys() == {"n10"}


def test_layout_refusals(tmp_path):
    """-m cyclic (rank 1 on the second node), another task count, outside a step: one line each."""
    path = tmp_path / "c.yaml"
    path.write_text(CLUSTER)
    with pytest.raises(InvalidCluster) as e:
        slurm.select(str(path), step_env(1, "n10", counts="3,2", total="5"))
    assert e.value.problems == [
        "SLURMD_NODENAME: 'n10': rank 1 (worker:0) runs here, but the job's layout puts it on n9 "
        "(block distribution; was the step started with -m cyclic?); run the task through the batch "
        "script `od-dist slurm` writes (sbatch job.sbatch): its srun line sets the distribution"
    ]
    with pytest.raises(InvalidCluster) as e:
        slurm.select(str(path), step_env(0, "n9", counts="3(x2)", total="6"))
    assert e.value.problems[0].startswith("SLURM_STEP_TASKS_PER_NODE: '3,3': ")
    r = od_dist("train", "--slurm", f"--cluster={path}", env={"SLURM_STEP_NODELIST": None})
    assert r.returncode == 2, r.stderr
    assert "SLURM_STEP_NODELIST is not set: this process is not a task of an srun step" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 2, r.stderr  # "invalid input:" and the one problem


def test_script_shape(tmp_path):
    """Even counts: block distribution with --ntasks-per-node; GPUs per task from num_clones."""
    path = tmp_path / "c.yaml"
    path.write_text("master: a:2000\nworker: [b:2001]\nnum_clones: 2\n")
    out = tmp_path / "job.sbatch"
    pipeline = os.path.join(ROOT, "pipelines", "shapes_retinanet.yaml")
    r = od_dist("slurm", f"--cluster={path}", f"--pipeline={pipeline}", "--model_dir=m", f"--out={out}")
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n" in text
    assert "#SBATCH --gpus-per-task=2\n" in text and "#SBATCH --signal=TERM@120\n" in text
    assert "srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --distribution=block" in text
    assert "SLURM_HOSTFILE" not in text
    # Uneven (3 entries on one machine, 1 on the other): a host file in block order.
    path.write_text("ps: [a:2002]\nmaster: a:2000\nworker: [a:2001, b:2003]\n")
    r = od_dist("slurm", f"--cluster={path}", f"--pipeline={pipeline}", "--model_dir=m", f"--out={out}")
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=3\n" in text and "--gpus-per-task" not in text
    assert "counts=(3 1)" in text and 'export SLURM_HOSTFILE="$OD_DIST_RUN_DIR/hosts"' in text
    assert "srun --nodes=2 --ntasks=4 --distribution=arbitrary" in text
    assert "#     2  master:0  node 1, port 2000\n#     3  worker:1  node 2, port 2003\n" in text
    assert "export OD_DIST_LEAD_RANK=2\n" in text
    r = od_dist(
        "slurm", f"--cluster={path}", f"--pipeline={pipeline}", "--model_dir=m", f"--out={out}", "--time=soon"
    )
    assert r.returncode == 2 and "--time: 'soon': not a Slurm time limit" in r.stderr, r.stderr


# ----- a real Slurm cluster ----------------------------------------------------------------------


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "not root"
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    gone = [d for d in DAEMONS if shutil.which(d, path=path) is None]
    if gone:
        return f"{', '.join(gone)} not installed (apt-get install slurmd slurmctld slurm-client munge)"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    return "no private mount namespace here (unshare --mount refused)" if probe.returncode else None


def _in_hosts(hosts_file, *argv):
    """argv in a private mount namespace where /etc/hosts is `hosts_file`."""
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "--",
        "sh",
        "-c",
        'mount --bind "$0" /etc/hosts && exec "$@"',
        str(hosts_file),
        *argv,
    ]


class SlurmCluster:
    def __init__(self, folder):
        self.folder = folder
        self.procs = []
        self.conf = folder / "slurm.conf"
        self.env = clean_env(SLURM_CONF=str(self.conf), PATH=os.environ["PATH"] + ":/usr/sbin")

    def run(self, *argv, check=True):
        r = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=30)
        assert not check or r.returncode == 0, f"{argv}: {r.stdout}{r.stderr}"
        return r

    def start(self):
        f = self.folder
        key = f / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = f / "munge" / "munge.sock"
        sock.parent.mkdir(mode=0o755)
        self.procs.append(
            subprocess.Popen(
                [
                    "munged",
                    "-F",
                    "--force",
                    f"--socket={sock}",
                    f"--key-file={key}",
                    f"--pid-file={f}/munged.pid",
                    f"--log-file={f}/munged.log",
                    f"--seed-file={f}/munged.seed",
                ],
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        ctld, *ports = free_ports(1 + len(NODES))
        host = socket.gethostname()
        hosts = f / "hosts"
        with open("/etc/hosts") as src:
            hosts.write_text(src.read() + "".join(f"127.0.0.{11 + i} {n}\n" for i, n in enumerate(NODES)))
        for d in ("state", "spool"):
            (f / d).mkdir()
        lines = [
            "ClusterName=odtest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            f"AuthInfo=socket={sock}",
            "CredType=cred/munge",
            f"StateSaveLocation={f}/state",
            f"SlurmdSpoolDir={f}/spool/%n",
            f"SlurmctldPidFile={f}/slurmctld.pid",
            f"SlurmdPidFile={f}/slurmd-%n.pid",
            f"SlurmctldLogFile={f}/slurmctld.log",
            f"SlurmdLogFile={f}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "ReturnToService=2",
            "KillWait=60",
            "MinJobAge=600",
            "SchedulerParameters=batch_sched_delay=0",
            "InactiveLimit=0",
            "SlurmdTimeout=300",
        ]
        lines += [
            f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.{11 + i} Port={p} CPUs=8 RealMemory=4000"
            for i, (n, p) in enumerate(zip(NODES, ports))
        ]
        lines.append("PartitionName=od Nodes=ALL Default=YES OverSubscribe=FORCE:4 MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        (f / "cgroup.conf").write_text(
            "CgroupPlugin=autodetect\nIgnoreSystemdOnFailure=yes\nCgroupAutomount=yes\n"
        )
        deadline = time.monotonic() + 10
        while not sock.exists():
            assert time.monotonic() < deadline, (f / "munged.log").read_text()
            time.sleep(0.05)
        daemons = [["slurmctld", "-D", "-i", "-f", str(self.conf)]]
        daemons += [["slurmd", "-D", "-f", str(self.conf), "-N", n] for n in NODES]
        for argv in daemons:
            self.procs.append(
                subprocess.Popen(
                    _in_hosts(hosts, *argv),
                    env=self.env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        deadline = time.monotonic() + 30
        while True:
            r = self.run("sinfo", "-h", "-N", "-o", "%T", check=False)
            if r.returncode == 0 and r.stdout.split() == ["idle"] * len(NODES):
                return
            assert time.monotonic() < deadline, f"Slurm not idle: {r.stdout}{r.stderr}"
            time.sleep(0.2)

    def stop(self):
        self.run("scancel", "--user=root", check=False)
        deadline = time.monotonic() + 90
        while self.run("squeue", "-h", check=False).stdout.strip() and time.monotonic() < deadline:
            time.sleep(0.5)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def job(self, job_id):
        """scontrol's fields of a job (kept MinJobAge after its end)."""
        r = self.run("scontrol", "show", "job", "-o", str(job_id))
        return dict(w.split("=", 1) for w in r.stdout.split() if "=" in w)

    def sbatch(self, script, cwd, env=None):
        r = subprocess.run(
            ["sbatch", "--parsable", str(script)],
            capture_output=True,
            text=True,
            cwd=cwd,
            env={**self.env, **(env or {})},
            timeout=30,
        )
        assert r.returncode == 0, r.stderr
        return r.stdout.strip().split(";")[0]

    def wait_end(self, job_id, timeout=150):
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields["JobState"] not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED"):
                return fields
            assert time.monotonic() < deadline, fields
            time.sleep(0.3)


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    why = _missing()
    if why:
        pytest.skip(f"no Slurm here: {why}")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _shim(folder, *first):
    """`od-dist` on the tasks' PATH: this checkout's code, by this Python (`first`: folders before
    it on PYTHONPATH)."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "od-dist"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m od_dist "$@"\n')
    shim.chmod(0o755)
    return {
        "PATH": f"{bin_dir}:{os.environ['PATH']}:/usr/sbin",
        "PYTHONPATH": os.pathsep.join(
            [*map(str, first), ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
    }


def _write_job(tmp_path, cluster_text, data_dir, steps, name):
    (tmp_path / f"{name}.yaml").write_text(cluster_text)
    script = tmp_path / f"{name}.sbatch"
    r = od_dist(
        "slurm",
        f"--cluster={name}.yaml",
        f"--pipeline={os.path.join(ROOT, 'pipelines', 'shapes_retinanet.yaml')}",
        f"--model_dir={name}-model",
        tiny(data_dir, steps),
        "--max_restarts=0",
        f"--out={script}",
        cwd=tmp_path,
        env=_shim(tmp_path),
    )
    assert r.returncode == 0, r.stderr
    return script


def _output(tmp_path, job_id):
    path = tmp_path / f"slurm-{job_id}.out"
    return path.read_text() if path.exists() else ""


@pytest.mark.slow
def test_parameter_server_scancel_resume(slurm_cluster, data_dir, tmp_path):
    """ps, master and 2 workers, uneven over 2 nodes (ps, worker 0 and the master on one, worker 1
    alone): scancel mid-training leaves a checkpoint; the job sent again resumes from it and ends
    COMPLETED, exit 0."""
    p = free_ports(4)
    text = f"ps: [h1:{p[0]}]\nworker: [h1:{p[1]}, h2:{p[2]}]\nmaster: h1:{p[3]}\n"
    started = time.monotonic()
    script = _write_job(tmp_path, text, data_dir, 15, "ps")
    env = _shim(tmp_path)
    job = slurm_cluster.sbatch(script, tmp_path, env)
    model_dir = tmp_path / "ps-model"
    deadline = time.monotonic() + 120
    while checkpoint_step(model_dir) is None or checkpoint_step(model_dir) < 5:
        fields = slurm_cluster.job(job)
        assert fields["JobState"] in ("PENDING", "RUNNING"), (fields, _output(tmp_path, job))
        assert time.monotonic() < deadline, _output(tmp_path, job)
        time.sleep(0.3)
    slurm_cluster.run("scancel", job)
    fields = slurm_cluster.wait_end(job)
    out = first = _output(tmp_path, job)
    assert fields["JobState"] == "CANCELLED", (fields, out)
    saved = checkpoint_step(model_dir)
    # The master saved where SIGTERM stopped it (the end of its loop), through the ps, and exited 143.
    assert f"2: master:0: stopped at step {saved} (SIGTERM); saved " in out, out[-4000:]
    assert saved > 5 and (model_dir / "slurm" / f"{job}.0" / "2").read_text().strip() == "143", out
    # Sent again: resumes at the checkpoint and finishes.
    job = slurm_cluster.sbatch(script, tmp_path, env)
    fields = slurm_cluster.wait_end(job)
    out = _output(tmp_path, job)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), (fields, out)
    assert checkpoint_step(model_dir) == 15, out
    assert f"restored from checkpoint: ps-model/ckpt-{saved}" in out, out[-4000:]
    assert "0: ps:0: SIGTERM; serving until the master has saved and exited" in first, first[-4000:]
    print(
        f"\nparameter_server on Slurm: scancel at ckpt-{saved}, resumed to 15: {time.monotonic() - started:.0f} s"
    )


@pytest.mark.slow
def test_multi_worker_mirrored_and_failed_master(slurm_cluster, data_dir, tmp_path):
    """Two jobs at once: master and worker under multi_worker_mirrored on 2 nodes train 10 steps,
    COMPLETED with exit 0; the same cluster with a master that fails (exit 1, a fault injected
    into its process) is FAILED with exit 1, its worker stopped rather than waiting for it."""
    started = time.monotonic()
    p = free_ports(4)
    good = _write_job(tmp_path, f"master: a:{p[0]}\nworker: [b:{p[1]}]\n", data_dir, 10, "mwm")
    bad = _write_job(tmp_path, f"master: a:{p[2]}\nworker: [b:{p[3]}]\n", data_dir, 10, "bad")
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('SLURM_PROCID') == '1' and os.environ.get('SLURM_STEP_ID'):\n"
        "    os._exit(1)  # the master (rank 1: the worker's machine comes first)\n"
    )
    good_job = slurm_cluster.sbatch(good, tmp_path, _shim(tmp_path))
    bad_job = slurm_cluster.sbatch(bad, tmp_path, _shim(tmp_path, hook))
    fields = slurm_cluster.wait_end(bad_job)
    out = _output(tmp_path, bad_job)
    assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", "1:0"), (fields, out)
    assert "od-dist: the lead exited 1; stopping the other tasks" in out, out
    assert "od-dist: master:0 (rank 1) exited 1: the job's exit code" in out, out
    fields = slurm_cluster.wait_end(good_job)
    out = _output(tmp_path, good_job)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), (fields, out)
    assert checkpoint_step(tmp_path / "mwm-model") == 10, out
    print(f"\nmulti_worker_mirrored and a failed master on Slurm: {time.monotonic() - started:.0f} s")
