"""CPU thread budgets: the pure rule (cores, tasks on this machine -> threads) and the flags over
it. The threads TensorFlow applied in each task of a real launch: test_distributed.py."""

import pytest
from loopback import PIPELINE

from od_dist.cli import main
from od_dist.cluster import spec
from od_dist.cluster.spec import InvalidCluster
from od_dist.host import config, cpu_budget
from od_dist.host.cpu_budget import Threads

PS_LOCAL = ["ps", "master", "worker", "worker"]


def test_a_task_alone_on_its_machine_keeps_tensorflow_defaults():
    assert cpu_budget.budget(2, "single", "mirrored", ["single"]) == Threads(0, 0, 0)
    assert cpu_budget.budget(16, "worker", "parameter_server", ["worker"]) == Threads(0, 0, 0)
    assert cpu_budget.budget(8, "master", "multi_worker_mirrored", ["master"]) == Threads(0, 0, 0)
    # Bound to one core (a Slurm task under task/affinity): TensorFlow's inter-op pool would be 1
    # thread, which deadlocks the parameter_server coordinator.
    assert cpu_budget.budget(1, "master", "parameter_server", ["master"]) == Threads(1, 2, 0)


def test_local_parameter_server_cluster_on_two_cores():
    # The two workers compute; the ps and the coordinator mostly wait.
    assert cpu_budget.budget(2, "worker", "parameter_server", PS_LOCAL) == Threads(1, 2, 0)
    for role in ("ps", "master"):
        assert cpu_budget.budget(2, role, "parameter_server", PS_LOCAL) == Threads(1, 2, 0)


def test_workers_split_the_cores_and_light_tasks_take_one():
    assert cpu_budget.budget(8, "worker", "parameter_server", PS_LOCAL) == Threads(4, 4, 0)
    assert cpu_budget.budget(8, "ps", "parameter_server", PS_LOCAL) == Threads(1, 2, 0)
    assert cpu_budget.budget(8, "master", "parameter_server", PS_LOCAL) == Threads(1, 2, 0)
    # Under multi_worker_mirrored the master trains too.
    mwm = ["master", "worker"]
    assert cpu_budget.budget(8, "master", "multi_worker_mirrored", mwm) == Threads(4, 4, 0)
    assert cpu_budget.budget(2, "worker", "multi_worker_mirrored", mwm) == Threads(1, 2, 0)
    assert cpu_budget.budget(2, "evaluator", "multi_worker_mirrored", mwm + ["evaluator"]) == Threads(1, 2, 0)
    assert cpu_budget.budget(2, "master", "multi_worker_mirrored", mwm + ["evaluator"]) == Threads(1, 2, 0)


def fake_system(tmp_path, cgroup: str, mountinfo: str, files: dict) -> str:
    """A folder laid out as / is: /proc/self/cgroup, /proc/self/mountinfo and cgroup files."""
    for path, text in {"proc/self/cgroup": cgroup, "proc/self/mountinfo": mountinfo, **files}.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    return str(tmp_path)


V1_MOUNTS = (
    "24 23 0:21 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"
    "25 24 0:22 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
    "26 24 0:23 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory\n"
)


V2_MOUNTS = "30 29 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n"


def test_a_cpu_limit_is_read_from_the_process_cgroup_and_its_parents(tmp_path):
    # cgroup v1, a Kubernetes pod: the pod's limit (1.5 cores) caps its container, which has none.
    cpu = "sys/fs/cgroup/cpu,cpuacct/kubepods/pod1"
    v1 = fake_system(
        tmp_path / "v1",
        "4:memory:/kubepods/pod1/c1\n3:cpu,cpuacct:/kubepods/pod1/c1\n",
        V1_MOUNTS,
        {
            f"{cpu}/c1/cpu.cfs_quota_us": "-1\n",
            f"{cpu}/c1/cpu.cfs_period_us": "100000\n",
            f"{cpu}/cpu.cfs_quota_us": "150000\n",
            f"{cpu}/cpu.cfs_period_us": "100000\n",
        },
    )
    assert cpu_budget.cpu_limit(v1) == 1.5
    # cgroup v2: in a container with its own cgroup namespace (its cgroup is "/"), docker --cpus
    # 0.6; then a desktop session's cgroup, which has no limit.
    for name, cgroup, files, limit in (
        ("v2", "/", {"sys/fs/cgroup/cpu.max": "60000 100000\n"}, 0.6),
        ("none", "/user.slice", {"sys/fs/cgroup/user.slice/cpu.max": "max 100000\n"}, None),
    ):
        root = fake_system(tmp_path / name, f"0::{cgroup}\n", V2_MOUNTS, files)
        assert cpu_budget.cpu_limit(root) == limit, name
    assert cpu_budget.cpu_limit(str(tmp_path / "no-such-system")) is None


def test_a_task_alone_under_a_cpu_limit_sizes_its_pools_by_the_limit():
    # TensorFlow would size them by the cores it may run on, and its threads would spin waiting
    # for CPU time the limit does not give them.
    assert cpu_budget.budget(1, "single", "mirrored", ["single"], limited=True) == Threads(1, 2, 0)
    assert cpu_budget.budget(4, "master", "multi_worker_mirrored", ["master"], limited=True) == Threads(
        4, 4, 0
    )
    assert cpu_budget.budget(4, "master", "multi_worker_mirrored", ["master"]) == Threads(0, 0, 0)


def test_a_process_in_a_capped_cgroup_takes_the_limits_threads(tmp_path):
    """A real cgroup capped at 0.6 cores (tests/capped.py), as a container's CPU limit is: the
    process started in it reads the limit and takes 1 intra-op thread."""
    import subprocess
    import sys

    import capped

    why = capped.unavailable()
    if why:
        pytest.skip(why)
    cap = capped.CpuCap(f"od-dist-threads-{tmp_path.name}", cores=0.6)
    try:
        r = subprocess.run(
            [sys.executable, "-c", READ_THE_LIMIT],
            preexec_fn=cap.enter,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        cap.close()
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout == f"0.6 1 {Threads(1, 2, 0)}\n", r.stdout


READ_THE_LIMIT = """
from od_dist.host import cpu_budget
print(cpu_budget.cpu_limit(), cpu_budget.machine_cores(), cpu_budget.resolve(None, None, "mirrored"))
"""


def test_inter_op_is_never_below_two_and_tf_data_keeps_its_default():
    for cores in (1, 2, 3, 64):
        for role in ("ps", "master", "worker", "evaluator"):
            for n in (2, 3, 9):
                t = cpu_budget.budget(cores, role, "parameter_server", ["worker"] * n + [role])
                # tf.data capped at 1 thread halved a multi_worker_mirrored pair (BENCHMARKS.md).
                assert t.inter_op >= cpu_budget.MIN_INTER_OP and t.intra_op >= 1 and t.data == 0


def test_tasks_sharing_a_machine_come_from_the_cluster_hosts():
    lan = spec.from_document(
        {"master": "10.0.0.1:2222", "worker": ["10.0.0.2:2222", "10.0.0.2:2223"], "ps": ["10.0.0.1:2224"]}
    )
    assert cpu_budget.roles_sharing(lan, lan.task("worker", 1)) == ["worker", "worker"]
    assert sorted(cpu_budget.roles_sharing(lan, lan.task("ps", 0))) == ["master", "ps"]
    local = spec.from_document(
        {"master": "127.0.0.1:2230", "worker": ["localhost:2231", "127.0.0.1:2232"], "ps": ["127.0.0.1:2233"]}
    )
    assert sorted(cpu_budget.roles_sharing(local, local.task("worker", 0))) == sorted(PS_LOCAL)
    assert cpu_budget.roles_sharing(None, None) == ["single"]
    one_each = spec.from_document(
        {"master": "10.0.0.1:2222", "worker": ["10.0.0.2:2222"], "ps": ["10.0.0.3:1"]}
    )
    assert cpu_budget.resolve(one_each, one_each.task("worker", 0), "parameter_server", cores=8) == Threads()


def test_flags_override_each_setting_of_the_budget():
    local = spec.from_document(
        {"master": "127.0.0.1:2230", "worker": ["127.0.0.1:2231"], "ps": ["127.0.0.1:2233"]}
    )
    worker = local.task("worker", 0)
    assert cpu_budget.resolve(local, worker, "parameter_server", cores=2) == Threads(2, 2, 0)
    assert cpu_budget.resolve(local, worker, "parameter_server", intra_op=4, data=2, cores=2) == Threads(
        4, 2, 2
    )
    assert cpu_budget.resolve(local, worker, "parameter_server", 0, 0, 0, cores=2) == Threads(0, 0, 0)
    assert cpu_budget.resolve(None, None, "mirrored", data=3, cores=2) == Threads(0, 0, 3)


def test_train_config_carries_the_budget_and_refuses_inter_op_one_under_ps(tmp_path):
    cluster = tmp_path / "c.yaml"
    cluster.write_text(
        "master: 127.0.0.1:2230\nworker: [127.0.0.1:2231, 127.0.0.1:2232]\nps: [127.0.0.1:2233]\n"
    )
    selected = config.select(str(cluster), "ps", 0, False)
    cfg = config.train_config(selected, None, None, None, False, None, 10, None, None, None)
    assert cfg.threads == Threads(1, 2, 0)
    cfg = config.train_config(selected, None, None, None, False, None, 10, 3, None, 1)
    assert cfg.threads == Threads(3, 2, 1)
    with pytest.raises(
        InvalidCluster, match=r"--inter_op_threads: '1': deadlocks the parameter_server coordinator"
    ):
        config.train_config(selected, None, None, None, False, None, 10, None, 1, None)


def test_inter_op_one_is_invalid_input_before_anything_starts(tmp_path, capsys):
    cluster = tmp_path / "c.yaml"
    cluster.write_text("master: 127.0.0.1:2230\nworker: [127.0.0.1:2231]\nps: [127.0.0.1:2233]\n")
    code = main(
        [
            "od-dist",
            "launch",
            f"--cluster={cluster}",
            f"--pipeline={PIPELINE}",
            f"--model_dir={tmp_path}/m",
            "--inter_op_threads=1",
        ]
    )
    assert code == 2
    assert (
        "--inter_op_threads: '1': deadlocks the parameter_server coordinator; use 2 or more"
        in capsys.readouterr().err
    )


def test_launch_passes_the_thread_flags_on(tmp_path):
    from absl import flags

    from od_dist.cli.flags import define_train_flags, passed_on_args

    fv = flags.FlagValues()
    define_train_flags(fv)
    fv(["x", "--intra_op_threads=2", "--data_threads=0"])
    assert passed_on_args(fv) == ["--intra_op_threads=2", "--data_threads=0"]
