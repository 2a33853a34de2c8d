"""`od-dist slurm` and `od-dist train --slurm`: the step layout unit-tested, and the generated batch
script run by `sbatch` on a real Slurm cluster of three nodes started on this machine (root, the
Debian packages slurmd slurmctld slurm-client munge; skipped without them).

The cluster: its own munged (own key and socket), slurmctld and one slurmd per node, state in a
temp folder, free ports. Each node has its own loopback address (NodeAddr 127.0.0.11-13); the
node names resolve to them through an /etc/hosts bind-mounted in a private mount namespace of each
daemon, which their tasks inherit: this machine's /etc/hosts is never edited."""

import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest
from loopback import ROOT, checkpoint_step, clean_env, free_ports, od_dist, tiny

from od_dist.cluster import slurm
from od_dist.cluster.spec import InvalidCluster

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "unshare")
NODES = ("odn1", "odn2", "odn3")
CPUS, GPUS = 2, 4  # per node: the box's real cores (task/affinity binds to them), GPUs as on a 4-GPU node


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


def test_the_time_limit_warning_leaves_the_grace_period_and_a_margin(tmp_path):
    """--signal's warning is --grace_period + 60 s ahead of the time limit (the trainers' loop and
    save, then the servers' stop and the requeue), not a fixed 120 s; a --time that cannot hold it is
    said, and a grace period beyond what Slurm's --signal takes is refused before anything is written."""
    path = tmp_path / "c.yaml"
    path.write_text("master: a:2000\nworker: [b:2001]\n")
    out = tmp_path / "job.sbatch"
    pipeline = os.path.join(ROOT, "pipelines", "shapes_retinanet.yaml")
    args = (f"--cluster={path}", f"--pipeline={pipeline}", "--model_dir=m", f"--out={out}")
    r = od_dist("slurm", *args, "--grace_period=600", "--time=2:00:00")
    assert r.returncode == 0 and "od-dist slurm: warning" not in r.stderr, r.stderr
    text = out.read_text()
    assert "#SBATCH --signal=B:USR1@660\n" in text and "--grace_period=600" in text
    assert "# Time limit: 660 s before it (--signal, to this script: --grace_period 600 + 60)" in text
    r = od_dist("slurm", *args, "--grace_period=600", "--norequeue", "--time=10")
    assert r.returncode == 0, r.stderr
    assert "#SBATCH --signal=TERM@660\n" in out.read_text()
    assert r.stderr.splitlines()[0] == (
        "od-dist slurm: warning: --time: '10' (600 s) is not longer than the 660 s ahead of it that the "
        "job is warned (--grace_period 600 + 60): the tasks are asked to stop as they start; give a "
        "longer --time or a shorter --grace_period"
    ), r.stderr
    out.unlink()
    r = od_dist("slurm", *args, "--grace_period=70000")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "od-dist slurm: --grace_period: 70000: the time limit's warning would come 70060 s ahead "
        "(--grace_period + 60), more than Slurm's --signal takes (65535); give at most 65475"
    ], r.stderr
    assert not out.exists()


def test_script_shape(tmp_path):
    """Machines that ask the same: a plain job, --ntasks-per-node and GPUs per node (the trainers'
    num_clones); machines that differ: a heterogeneous job, a component of one node per machine,
    each asking its own tasks and its trainers' GPUs only."""
    path = tmp_path / "c.yaml"
    path.write_text("master: a:2000\nworker: [b:2001]\nnum_clones: 2\n")
    out = tmp_path / "job.sbatch"
    pipeline = os.path.join(ROOT, "pipelines", "shapes_retinanet.yaml")
    args = (f"--cluster={path}", f"--pipeline={pipeline}", "--model_dir=m", f"--out={out}")
    r = od_dist("slurm", *args, "--cpus_per_task=4")
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert (
        "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --cpus-per-task=4\n#SBATCH --gres=gpu:2\n"
        in text
    )
    assert "#SBATCH --signal=B:USR1@180\n" in text and "hetjob" not in text  # --grace_period 120 + 60
    assert (
        "export SRUN_CPUS_PER_TASK=4\nsrun --nodes=2 --ntasks=2 --ntasks-per-node=1 --distribution=block"
        in text
    )
    # The file: ps, master and worker 0 on one machine, worker 1 on another, num_clones 2:
    # the first node asks 3 tasks and worker 0's 2 GPUs, the second 1 task and 2 GPUs.
    path.write_text("ps: [a:2002]\nmaster: a:2000\nworker: [a:2001, b:2003]\nnum_clones: 2\n")
    r = od_dist("slurm", *args)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert (
        "#SBATCH --open-mode=append\n"
        "#SBATCH --nodes=1\n#SBATCH --ntasks=3\n#SBATCH --gres=gpu:2\n#SBATCH hetjob\n"
        "#SBATCH --nodes=1\n#SBATCH --ntasks=1\n#SBATCH --gres=gpu:2\n\n"
    ) in text
    assert "srun --het-group=0-1 --label" in text and "SRUN_CPUS_PER_TASK" not in text
    assert "#     2  master:0  node 1, port J+2\n#     3  worker:1  node 2, port J+3, 2 GPU(s)\n" in text
    assert "export OD_DIST_LEAD_RANK=2\n" in text
    # CPU-only nodes: --gpus_per_trainer=0 asks for no GPU.
    r = od_dist("slurm", *args, "--gpus_per_trainer=0")
    assert r.returncode == 0 and "--gres" not in out.read_text(), r.stderr
    r = od_dist("slurm", *args, "--time=soon")
    assert r.returncode == 2 and "--time: 'soon': not a Slurm time limit" in r.stderr, r.stderr


def test_task_gpus_and_given_line(tmp_path):
    """Of its node's GPUs each trainer keeps its num_clones, in its machine's order; a ps, a
    parameter_server master and an evaluator keep none. The console line says it."""
    path = tmp_path / "c.yaml"
    path.write_text("master: a:1\nworker: [a:2, b:3]\nevaluator: a\nnum_clones: 2\n")
    cluster, _, _ = slurm.select(str(path), step_env(0, "n9", counts="3,1", total="4"))
    shares = {t.name: slurm.task_gpus(cluster, t, "0,1,2,3") for t, n in slurm.ranks(cluster) if n == 0}
    assert shares == {"worker:0": "0,1", "master:0": "2,3", "evaluator:0": ""}
    assert slurm.task_gpus(cluster, cluster.tasks_of("worker")[1], "0,1") == "0,1"  # alone on its node
    path.write_text("ps: [a:1]\nmaster: a:2\nworker: [a:3]\n")
    cluster, _, _ = slurm.select(str(path), step_env(0, "n9", nodes="n9", counts="3", total="3"))
    assert [slurm.task_gpus(cluster, t, "0") for t, _ in slurm.ranks(cluster)] == ["", "0", ""]
    ps = cluster.tasks_of("ps")[0]
    assert (
        slurm.given_line(ps, [0, 1, 2, 5], "")
        == "ps:0: given 4 cores (CPU 0-2,5) and no GPU (CUDA_VISIBLE_DEVICES='')"
    )
    assert slurm.given_line(ps, [3], None).endswith(
        "1 core (CPU 3) and no GPU (CUDA_VISIBLE_DEVICES not set)"
    )


def test_job_ports_and_address(tmp_path):
    """--port_base: each job a block of its own ports (jobs with nearby ids share none), tasks in
    rank order, then checkpoint_port; --address: the nodes' names in a format. Bad values: one line."""
    path = tmp_path / "c.yaml"
    path.write_text(CLUSTER + "checkpoint_port: 2230\n")
    env = {**step_env(3, "n10", counts="3,2", total="5"), "SLURM_JOB_ID": "41"}
    env.update({slurm.PORT_BASE_ENV: "20000", slurm.ADDRESS_ENV: "{node}-ib"})
    cluster, task, _ = slurm.select(str(path), env)
    first = 20000 + 41 * 5  # 5 ports: ps, 2 workers, the master, checkpoint_port
    assert cluster.cluster_spec() == {
        "ps": [f"n9-ib:{first}"],
        "worker": [f"n9-ib:{first + 1}", f"n10-ib:{first + 3}"],
        "chief": [f"n9-ib:{first + 2}"],
    }
    assert (task.name, cluster.checkpoint_port, cluster.clones_for("n10-ib")) == ("worker:1", first + 4, 1)
    filed = slurm.step_cluster(str(path), slurm.read_step(env))  # the same every time
    a, _ = slurm.job_ports(filed, 41, 20000)
    b, _ = slurm.job_ports(filed, 42, 20000)
    assert not set(a.values()) & set(b.values())
    for var, value, said in [
        (slurm.ADDRESS_ENV, "n-ib", "holds {node} 0 times, not once"),
        (slurm.ADDRESS_ENV, "{node}:1", "may add only letters, digits, '-' and '.'"),
        (slurm.PORT_BASE_ENV, "65534", "leaves no room for the job's 5 port(s)"),
    ]:
        with pytest.raises(InvalidCluster) as e:
            slurm.select(str(path), {**env, var: value})
        assert e.value.problems[0].startswith(f"{var}: '{value}': {said}"), e.value.problems
    pipeline = os.path.join(ROOT, "pipelines", "shapes_retinanet.yaml")
    args = ("slurm", f"--cluster={path}", f"--pipeline={pipeline}", "--model_dir=m", f"--out={tmp_path}/j")
    r = od_dist(*args, "--address=ib0")
    assert r.returncode == 2 and "--address: 'ib0': holds {node} 0 times, not once; write it like" in r.stderr
    r = od_dist(*args, "--port_base=0")
    assert r.returncode == 0 and "#SBATCH --exclusive\n" in (tmp_path / "j").read_text(), r.stderr
    assert "OD_DIST_SLURM_PORT_BASE" not in (tmp_path / "j").read_text()


def test_node_count_form(tmp_path):
    """--nodes N --gpus_per_node G: no cluster file to write by hand; the layout docs/scaling.md
    recommends (multi_worker_mirrored, a trainer per node, its GPUs all the trainer's), said."""
    pipeline = os.path.join(ROOT, "pipelines", "shapes_retinanet.yaml")
    out = tmp_path / "job.sbatch"
    args = ("slurm", f"--pipeline={pipeline}", "--model_dir=m", f"--out={out}", "--fixed_replica_batch")
    r = od_dist(*args, "--nodes=3", "--gpus_per_node=4")
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines()[0] == (
        "od-dist slurm: 3 node(s) x 4 GPU(s): multi_worker_mirrored, one trainer per node (2 worker(s) on "
        f"the first, the master on the last), num_clones 4 (docs/scaling.md); the cluster file: {tmp_path}/job.cluster.yaml"
    ), r.stderr
    assert "does not resolve" not in r.stderr
    text = out.read_text()
    assert "#SBATCH --nodes=3\n#SBATCH --ntasks-per-node=1\n#SBATCH --gres=gpu:4\n" in text
    assert f"--cluster={tmp_path}/job.cluster.yaml" in text
    assert (
        "worker: [node-1:2222, node-2:2222]\nmaster: node-3:2222\nnum_clones: 4\n"
        in (tmp_path / "job.cluster.yaml").read_text()
    )
    r = od_dist(*args, "--nodes=2", "--gpus_per_node=0", "--then=eval,export")
    assert r.returncode == 0 and "--gres" not in out.read_text(), r.stderr
    assert "  srun --nodes=1 --ntasks=1 --label od-dist export " in out.read_text()
    for bad, said in [
        (("--nodes=2", f"--cluster={tmp_path}/job.cluster.yaml"), "--nodes: 2: --cluster "),
        (("--gpus_per_node=2",), "--gpus_per_node: given without --nodes; pass --nodes=N"),
        (("--nodes=2", "--then=train"), "--then: 'train': not one of eval, export; write --then=eval,export"),
    ]:
        r = od_dist(*args, *bad)
        assert r.returncode == 2 and said in r.stderr, r.stderr


def test_heterogeneous_step_layout(tmp_path):
    """In a heterogeneous job the step's node list is sorted; each machine's node is its
    component's (SLURM_JOB_NODELIST_HET_GROUP_i), its ranks after the earlier components'."""
    path = tmp_path / "c.yaml"
    path.write_text(CLUSTER)
    het = {
        "SLURM_HET_SIZE": "2",
        "SLURM_JOB_NODELIST_HET_GROUP_0": "n10",
        "SLURM_NTASKS_HET_GROUP_0": "3",
        "SLURM_JOB_NODELIST_HET_GROUP_1": "n9",
        "SLURM_NTASKS_HET_GROUP_1": "2",
    }
    cluster, task, _ = slurm.select(str(path), {**step_env(3, "n9", counts="2,3", total="5"), **het})
    assert (task.name, str(task.address)) == ("worker:1", "n9:2224")
    assert cluster.cluster_spec()["ps"] == ["n10:2222"]
    with pytest.raises(InvalidCluster) as e:
        slurm.select(str(path), {**step_env(0, "n9", counts="2,3", total="5"), **het})
    assert "rank 0 (ps:0) runs here, but the job's layout puts it on n10" in e.value.problems[0]


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
    def __init__(self, folder, cpus=CPUS, gpus=GPUS):
        self.folder = folder
        self.cpus, self.gpus = cpus, gpus
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
            # Each node also by a second name, as a fast network's (--address={node}-ib).
            hosts.write_text(
                src.read() + "".join(f"127.0.0.{11 + i} {n} {n}-ib\n" for i, n in enumerate(NODES))
            )
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
            "TaskPlugin=task/affinity",  # binds each task to its cores, as production clusters do
            "GresTypes=gpu",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "ReturnToService=2",
            "KillWait=60",
            "MinJobAge=600",
            # A heterogeneous job is scheduled by backfill only: every second rather than every 30 s.
            "SchedulerParameters=batch_sched_delay=0,bf_interval=1",
            "InactiveLimit=0",
            "SlurmdTimeout=300",
        ]
        lines += [
            f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.{11 + i} Port={p} CPUs={self.cpus} "
            f"RealMemory=4000 Gres=gpu:{self.gpus}"
            for i, (n, p) in enumerate(zip(NODES, ports))
        ]
        # GPUs without a driver: character devices of NVIDIA's major number (slurmd refuses regular
        # files); Slurm gives them out and sets CUDA_VISIBLE_DEVICES, which is what the tests check.
        (f / "dev").mkdir()
        gres = []
        for n in NODES:
            for g in range(self.gpus):
                os.mknod(f / "dev" / f"{n}gpu{g}", 0o600 | stat.S_IFCHR, os.makedev(195, g))
            gres.append(f"NodeName={n} Name=gpu File={f}/dev/{n}gpu[0-{self.gpus - 1}]")
        (f / "gres.conf").write_text("\n".join(gres) + "\n")
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


def _write_job(tmp_path, cluster_text, data_dir, steps, name, *more, restarts=0):
    (tmp_path / f"{name}.yaml").write_text(cluster_text)
    script = tmp_path / f"{name}.sbatch"
    r = od_dist(
        "slurm",
        f"--cluster={name}.yaml",
        f"--pipeline={os.path.join(ROOT, 'pipelines', 'shapes_retinanet.yaml')}",
        f"--model_dir={name}-model",
        tiny(data_dir, steps),
        f"--max_restarts={restarts}",
        *more,
        f"--out={script}",
        cwd=tmp_path,
        env=_shim(tmp_path),
    )
    assert r.returncode == 0, r.stderr
    return script


def _output(tmp_path, job_id):
    path = tmp_path / f"slurm-{job_id}.out"
    return path.read_text() if path.exists() else ""


def _given(out):
    """{rank: (task, cores, GPUs)} from the tasks' `given` lines."""
    found = {}
    for m in re.finditer(
        r"^(\d+): (\S+): given \d+ cores? \(CPU ([\d,-]+)\) and .*\((CUDA_VISIBLE_DEVICES.*)\)$", out, re.M
    ):
        found[int(m.group(1))] = (m.group(2), m.group(3), m.group(4))
    return found


def _no_training(tmp_path, more=""):
    """A folder for PYTHONPATH whose sitecustomize makes each task's training an exit 0 (after all
    that od-dist does before it: the task's selection, its GPUs, its console line), then `more`."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os, sys, types\n"
        "if os.environ.get('SLURM_STEP_ID'):  # a task of the job\n"
        "    fake = types.ModuleType('od_dist.task.roles')\n"
        "    fake.run = lambda cfg: 0\n"
        "    fake.RoleError = type('RoleError', (Exception,), {})\n"
        "    sys.modules['od_dist.task.roles'] = fake\n" + more
    )
    return hook


def test_resources_given(slurm_cluster, tmp_path):
    """What each task of a generated script is given on nodes of 2 bound cores and 4 GPUs, with
    --cpus_per_task=1 (the tasks' training replaced by an exit 0: what is checked is what Slurm
    gave them, which their real code says on its console).

    parameter_server, num_clones 3, ps and worker 0 on one machine, worker 1 and the master on the
    other: 3 GPUs per node, each worker all of its node's, the ps and the master none; the fullest
    machine's request (3 GPUs for every task) is refused on these nodes. multi_worker_mirrored,
    num_clones 2, worker 0 and the master on one machine, worker 1 and the evaluator on one each:
    a heterogeneous job (4 GPUs, 2 and none), the first node's GPUs split between its trainers.
    --nodes 2 --gpus_per_node 2, without a cluster file: a trainer per node, both GPUs its own."""
    started = time.monotonic()
    env = _shim(tmp_path, _no_training(tmp_path))
    ps = _write_job(
        tmp_path,
        "ps: [h1:2000]\nworker: [h1:2001, h2:2002]\nmaster: h2:2003\nnum_clones: 3\n",
        "data",
        1,
        "res-ps",
        "--cpus_per_task=1",
    )
    text = ps.read_text()
    assert "#SBATCH --ntasks-per-node=2\n#SBATCH --cpus-per-task=1\n#SBATCH --gres=gpu:3\n" in text
    # The fullest machine's request, as od-dist wrote it before: never schedulable on 4-GPU nodes.
    fullest = tmp_path / "fullest.sbatch"
    fullest.write_text(
        "#!/bin/sh\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2\n#SBATCH --gpus-per-task=3\ntrue\n"
    )
    r = slurm_cluster.run("sbatch", "--test-only", str(fullest), check=False)
    assert r.returncode != 0 and "Requested node configuration is not available" in r.stderr, r.stderr
    job = slurm_cluster.sbatch(ps, tmp_path, env)
    fields = slurm_cluster.wait_end(job, 60)
    out = _output(tmp_path, job)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), (fields, out)
    given = _given(out)
    assert {r: (t, g) for r, (t, _, g) in given.items()} == {
        0: ("ps:0", "CUDA_VISIBLE_DEVICES=''"),
        1: ("worker:0", "CUDA_VISIBLE_DEVICES='0,1,2'"),
        2: ("worker:1", "CUDA_VISIBLE_DEVICES='0,1,2'"),
        3: ("master:0", "CUDA_VISIBLE_DEVICES=''"),
    }, out
    # One core each, the two tasks of a node on different ones.
    assert {given[0][1], given[1][1]} == {given[2][1], given[3][1]} == {"0", "1"}, out

    mwm = _write_job(
        tmp_path,
        "master: h1:2010\nworker: [h1:2011, h2:2012]\nevaluator: h3\nnum_clones: 2\n",
        "data",
        1,
        "res-mwm",
        "--cpus_per_task=1",
        "--fixed_replica_batch",
    )
    assert "#SBATCH hetjob\n" in mwm.read_text()
    job = slurm_cluster.sbatch(mwm, tmp_path, env)
    fields = slurm_cluster.wait_end(job, 60)
    out = _output(tmp_path, job)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), (fields, out)
    given = _given(out)
    assert {r: (t, g) for r, (t, _, g) in given.items()} == {
        0: ("worker:0", "CUDA_VISIBLE_DEVICES='0,1'"),
        1: ("master:0", "CUDA_VISIBLE_DEVICES='2,3'"),
        2: ("worker:1", "CUDA_VISIBLE_DEVICES='0,1'"),
        3: ("evaluator:0", "CUDA_VISIBLE_DEVICES not set"),
    }, out
    assert {given[0][1], given[1][1]} == {"0", "1"} and given[2][1] in ("0", "1"), out
    # No cluster file: --nodes 2 --gpus_per_node 2, a trainer per node with both of its GPUs.
    r = od_dist(
        "slurm",
        "--nodes=2",
        "--gpus_per_node=2",
        f"--pipeline={os.path.join(ROOT, 'pipelines', 'shapes_retinanet.yaml')}",
        "--model_dir=res-nodes-model",
        "--fixed_replica_batch",
        "--out=res-nodes.sbatch",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    job = slurm_cluster.sbatch(tmp_path / "res-nodes.sbatch", tmp_path, env)
    fields = slurm_cluster.wait_end(job, 60)
    out = _output(tmp_path, job)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), (fields, out)
    assert {r: (t, g) for r, (t, _, g) in _given(out).items()} == {
        0: ("worker:0", "CUDA_VISIBLE_DEVICES='0,1'"),
        1: ("master:0", "CUDA_VISIBLE_DEVICES='0,1'"),
    }, out
    print(f"\nresources given on Slurm (3 jobs): {time.monotonic() - started:.0f} s")


def test_lead_never_ran(slurm_cluster, tmp_path):
    """A lead killed before its wrapper wrote its code (here its wrapper is SIGKILLed; likewise a
    task srun never started) leaves no code: the job's last line says so, and the job fails with
    srun's code rather than reporting another task's."""
    kill = (
        "    if os.environ.get('SLURM_PROCID') == '1':  # the master: its wrapper killed\n"
        "        import signal; os.kill(os.getppid(), signal.SIGKILL)\n"
    )
    env = _shim(tmp_path, _no_training(tmp_path, kill))
    script = _write_job(
        tmp_path, "master: h1:2020\nworker: [h2:2021]\n", "data", 1, "never", "--cpus_per_task=1"
    )
    job = slurm_cluster.sbatch(script, tmp_path, env)
    fields = slurm_cluster.wait_end(job, 60)
    out = _output(tmp_path, job)
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] not in ("0:0", "1:0"), (fields, out)
    code = fields["ExitCode"].split(":")[0]
    assert out.rstrip().endswith(
        "od-dist: master:0 (rank 1) never ran or was killed before it wrote its exit code "
        f"(srun exited {code}; the lines above say why); exit {code}"
    ), out
    assert not (tmp_path / "never-model" / "slurm" / f"{job}.0" / "1").exists()


# The requeue test's tasks: the first run waits for the SIGTERM, the restart ends at once.
REQUEUE_FAKE_RUN = (
    "    def run(cfg):\n"
    "        import signal, time\n"
    "        if os.environ.get('SLURM_RESTART_COUNT', '0') != '0':\n"
    "            print('training done', file=sys.stderr, flush=True)  # stdout: the task's log\n"
    "            return 0\n"
    "        got = []\n"
    "        signal.signal(signal.SIGTERM, lambda *a: got.append(1))\n"
    "        while not got:\n"
    "            time.sleep(0.1)\n"
    "        print('saved at the warning', file=sys.stderr, flush=True)\n"
    "        return 143\n"
    "    fake.run = run\n"
)


@pytest.fixture(scope="module")
def requeue_job(slurm_cluster, tmp_path_factory):
    """The requeue test's job, a master and a worker at --time=1: (job ID, its folder, its script).
    Slurm sends the time limit's warning at its next check of the limits, up to 30 s after the job
    starts: the parameter_server scancel test asks for this job first (it does not read it), so
    that wait runs while that test's job trains, not on its own."""
    tmp_path = tmp_path_factory.mktemp("requeue")
    env = _shim(tmp_path, _no_training(tmp_path, REQUEUE_FAKE_RUN))
    script = _write_job(tmp_path, "master: h1:2030\nworker: [h2:2031]\n", "data", 1, "rq", "--time=1")
    return slurm_cluster.sbatch(script, tmp_path, env), tmp_path, script


@pytest.mark.slow
@pytest.mark.usefixtures("requeue_job")  # sent first, for the requeue test (see requeue_job)
def test_parameter_server_scancel_resume(slurm_cluster, data_dir, tmp_path):
    """A ps, a worker and the master, uneven over 2 nodes (the ps and the worker on one, the master
    alone: a heterogeneous job), each task under its supervisor (--max_restarts 1):
    scancel (of every process: the batch shell and srun too) mid-training leaves a checkpoint,
    though the master's save, through the ps, is made to take 12 s (more than a supervisor's 10 s
    for stopping a server); the job sent again resumes from it and ends COMPLETED, exit 0."""
    p = free_ports(3)
    text = f"ps: [h1:{p[0]}]\nworker: [h1:{p[1]}]\nmaster: h2:{p[2]}\n"
    master_rank = 2  # ranks go by node: h1's ps and worker, then the master
    started = time.monotonic()
    script = _write_job(tmp_path, text, data_dir, 15, "ps", "--address={node}-ib", restarts=1)
    env = _shim(tmp_path)
    slow = tmp_path / "slow-save"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(
        "import os, time\n"
        f"if os.environ.get('SLURM_PROCID') == '{master_rank}' and os.environ.get('OD_DIST_SUPERVISOR_NOTES'):\n"
        "    from od_dist import patches  # the master's trainer: its save at a stop takes 12 s more\n"
        "    save_now = patches.orbit.save_now\n"
        "    def slow(*args):\n"
        "        time.sleep(12)\n"
        "        return save_now(*args)\n"
        "    patches.orbit.save_now = slow\n"
    )
    job = slurm_cluster.sbatch(script, tmp_path, _shim(tmp_path, slow))
    model_dir = tmp_path / "ps-model"
    deadline = time.monotonic() + 120
    while checkpoint_step(model_dir) is None or checkpoint_step(model_dir) < 5:
        fields = slurm_cluster.job(job)
        assert fields["JobState"] in ("PENDING", "RUNNING"), (fields, _output(tmp_path, job))
        assert time.monotonic() < deadline, _output(tmp_path, job)
        time.sleep(0.3)
    # --full: the batch shell and srun get the SIGTERM too, as at the time limit; srun's handling of
    # it must not cut the save short.
    slurm_cluster.run("scancel", "--full", job)
    fields = slurm_cluster.wait_end(job)
    out = first = _output(tmp_path, job)
    assert (fields["JobState"], fields["Restarts"]) == ("CANCELLED", "0"), (fields, out)  # not requeued
    saved = checkpoint_step(model_dir)
    # The master saved where SIGTERM stopped it (the end of its loop), through the ps, and exited 143.
    assert f"{master_rank}: master:0: stopped at step {saved} (SIGTERM); saved " in out, out[-4000:]
    rank_code = model_dir / "slurm" / f"{job}.0" / str(master_rank)
    assert saved > 5 and rank_code.read_text().strip() == "143", out
    # Sent again: resumes at the checkpoint and finishes.
    job = slurm_cluster.sbatch(script, tmp_path, env)
    fields = slurm_cluster.wait_end(job)
    out = _output(tmp_path, job)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), (fields, out)
    assert checkpoint_step(model_dir) == 15, out
    assert f"restored from checkpoint: ps-model/ckpt-{saved}" in out, out[-4000:]
    assert "0: ps:0: SIGTERM; serving until the master has saved and exited" in first, first[-4000:]
    assert re.search(r"^0: ps:0 serving on odn\d-ib:\d+$", first, re.M), first[-4000:]
    assert "0: od-dist train: SIGTERM: serving on until the master has saved and exited" in first, first[
        -4000:
    ]
    print(
        f"\nparameter_server on Slurm: scancel at ckpt-{saved}, resumed to 15: {time.monotonic() - started:.0f} s"
    )


def test_requeue_at_the_time_limit(slurm_cluster, requeue_job):
    """A job at --signal's warning before its time limit (--time=1: at once) has its tasks stop as
    at scancel (SIGTERM, exit 143 once saved), requeues itself, and its restart goes on until done
    (the tasks' training replaced: the first run waits for the SIGTERM, the restart ends at once)."""
    job, tmp_path, script = requeue_job
    assert "#SBATCH --signal=B:USR1@180\n" in script.read_text()
    deadline = time.monotonic() + 120
    while (fields := slurm_cluster.job(job))["Restarts"] == "0" or fields["JobState"] in (
        "REQUEUED",
        "COMPLETING",
    ):
        assert time.monotonic() < deadline, (fields, _output(tmp_path, job))
        time.sleep(0.3)
    # Slurm holds a requeued job a while (Reason=BeginTime): let it start sooner, though not within
    # the second of the requeue: slurmd refuses a credential made in the second it revoked the job's
    # last one ("Job credential revoked", the restart FAILED; seen in a CI run with StartTime=now
    # given at once). So StartTime=now 3 s after it is pending again: the update schedules it then
    # and there (StartTime=now+3 left it to slurmctld's next periodic pass, about 30 s later). A
    # job Slurm started meanwhile refuses the update.
    if fields["JobState"] == "PENDING":
        time.sleep(3)
        slurm_cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now", check=False)
    fields = slurm_cluster.wait_end(job, 60)
    out = _output(tmp_path, job)
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "1"), (
        fields,
        out,
    )
    assert (
        "od-dist: the time limit is near: the tasks save a checkpoint, then the job requeues itself\n" in out
    ), out
    assert (
        "1: saved at the warning\n" in out
        and "od-dist: master:0 (rank 1) exited 143: the job's exit code\n" in out
    )
    assert "od-dist: requeued: restart 1 goes on from the checkpoint\n" in out, out
    assert out.rstrip().endswith("od-dist: master:0 (rank 1) exited 0: the job's exit code"), out
    assert "1: training done\n" in out, out
    assert (tmp_path / "rq-model" / "slurm" / f"{job}.1" / "1").read_text().strip() == "0"


@pytest.mark.slow
def test_multi_worker_mirrored_and_failed_master(slurm_cluster, data_dir, tmp_path):
    """Two jobs of one file's ports at once: master and worker under multi_worker_mirrored on 2
    nodes train 10 steps, then evaluate (--then),
    COMPLETED with exit 0; the same cluster with a master that fails (exit 1, a fault injected
    into its process) is FAILED with exit 1, its worker stopped rather than waiting for it."""
    started = time.monotonic()
    # One file's ports for both (sent at once, on the same nodes: each job listens on its own).
    good = _write_job(tmp_path, "master: a:2222\nworker: [b:2223]\n", data_dir, 10, "mwm", "--then=eval")
    bad = _write_job(tmp_path, "master: a:2222\nworker: [b:2223]\n", data_dir, 10, "bad")
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
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("FAILED", "1:0", "0"), (
        fields,
        out,
    )
    assert "od-dist: the lead exited 1; stopping the other tasks" in out, out
    assert "od-dist: master:0 (rank 1) exited 1: the job's exit code" in out, out
    fields = slurm_cluster.wait_end(good_job)
    out = _output(tmp_path, good_job)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), (fields, out)
    assert checkpoint_step(tmp_path / "mwm-model") == 10, out
    # --then: the COCO line in the same job after training (export's step: test_node_count_form).
    assert re.search(r"^0: od-dist eval \| step 10 \| AP ", out, re.M), out[-3000:]
    print(f"\nmulti_worker_mirrored and a failed master on Slurm: {time.monotonic() - started:.0f} s")
