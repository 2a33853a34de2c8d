"""What od-dist tells a user choosing a layout, and the refusals that go with it: each strategy's
expected speed-up from this LAN's figures and the one recommended (validate, doctor; the arithmetic
by hand, and two doctors measuring the link between them), a batch that some elastic group could not split
(validate, doctor, scripts, train), k8s and slurm on a file that asks for elastic, the scripts'
README on healing, and doctor on records a machine's tasks never read. No TensorFlow: each
command here is refused or answers before any task starts."""

import os
import re
import socket
import subprocess
import sys

import pytest
from loopback import PIPELINE, ROOT

from od_dist.cluster import advice, safe_yaml
from od_dist.cluster import spec as cluster_mod
from od_dist.render import readme

THREE = os.path.join(ROOT, "clusters", "three-machines.yaml")
BATCH = "task.train_data.global_batch_size"


def od_dist(*args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, "-m", "od_dist", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def cluster_of(text):
    return cluster_mod.from_document(safe_yaml.loads(text))


MB = 1e6
MBIT100 = 100e6 / 8  # 100 Mbit/s in bytes/s, one way
THREE_LAN = "master: 10.0.0.1:2222\nworker: [10.0.0.2:2222, 10.0.0.3:2222]\n"
ONE_PS = "master: 10.0.0.1:2222\nworker: [10.0.0.2:2222, 10.0.0.3:2222]\nps: [10.0.0.4:2222]\n"


def by_name(predictions):
    return {p.name: p for p in predictions}


def test_the_arithmetic_by_hand_3_trainers_100_mbit_a_gpu_step():
    """3 trainers, 10.4 MB of gradients, 10.6 MB of weights and statistics, 100 Mbit/s (12.5 MB/s),
    a step's compute 0.05 s: speed-up = 3 x 0.05 / (0.05 + bytes / 12.5e6)."""
    got = by_name(advice.predict(cluster_of(THREE_LAN), 10.6 * MB, 10.4 * MB, 0.05, MBIT100))
    assert list(got) == [
        "multi_worker_mirrored",
        "multi_worker_mirrored bfloat16",
        "sync_every 10",
        "sync_every 50",
        "parameter_server",
    ]
    # Every step: 2(N-1)/N x 10.4 MB = 13.867 MB each way, 1.1093 s at 12.5 MB/s.
    mwm = got["multi_worker_mirrored"]
    assert mwm.step_bytes == pytest.approx(4 / 3 * 10.4 * MB)
    assert mwm.link_s == pytest.approx(1.109333, abs=1e-5)
    assert mwm.speedup == pytest.approx(0.15 / 1.159333, abs=1e-5)  # 0.129
    assert got["multi_worker_mirrored bfloat16"].speedup == pytest.approx(0.15 / 0.604667, abs=1e-5)  # 0.248
    # Every H steps: 2(N-1)/N x 10.6 MB / H.
    assert got["sync_every 10"].link_s == pytest.approx(0.1130667, abs=1e-6)
    assert got["sync_every 10"].speedup == pytest.approx(0.15 / 0.1630667, abs=1e-5)  # 0.920
    assert got["sync_every 50"].speedup == pytest.approx(0.15 / 0.0726133, abs=1e-5)  # 2.066
    # parameter_server, a worker and a ps on each of the 3: each link carries 2(N-1)/N x (10.6 + 10.4)
    # MB a round both ways, 14 MB one way: 1.12 s.
    ps = got["parameter_server"]
    assert (ps.machines, ps.step_bytes) == (3, pytest.approx(14 * MB))
    assert ps.speedup == pytest.approx(0.15 / 1.17, abs=1e-5)
    choice, why = advice.recommend(list(got.values()))
    assert choice.name == "sync_every 50" and why == "the best expected"


def test_the_file_s_own_layout_and_h():
    # One ps machine serves both workers: its link carries 2 x 21 MB a round, 21 MB each way.
    ps = by_name(advice.predict(cluster_of(ONE_PS), 10.6 * MB, 10.4 * MB, 0.05, MBIT100))["parameter_server"]
    assert (ps.machines, ps.step_bytes, ps.link_s) == (2, pytest.approx(21 * MB), pytest.approx(1.68))
    assert ps.speedup == pytest.approx(0.1 / 1.73)
    got = by_name(advice.predict(cluster_of(THREE_LAN + "sync_every: 25\n"), 10 * MB, 10 * MB, 0.05, MBIT100))
    assert [n for n in got if n.startswith("sync_every")] == [
        "sync_every 10",
        "sync_every 25",
        "sync_every 50",
    ]
    assert got["sync_every 25"].step_bytes == pytest.approx(4 / 3 * 10 * MB / 25)
    bf = by_name(advice.predict(3, 10 * MB, 10 * MB, 0.05, MBIT100, sync_every=25, wire_bytes_per_value=2))
    assert bf["sync_every 25 bfloat16"].step_bytes == pytest.approx(4 / 3 * 5 * MB / 25)


def test_the_recommendation_prefers_the_training_least_changed_within_10_percent():
    # 10 Gbit/s, 0.5 s steps: every step in sync is within 10% of the best: it is recommended.
    fast = advice.predict(cluster_of(THREE_LAN), 10.6 * MB, 10.4 * MB, 0.5, 10e9 / 8)
    choice, why = advice.recommend(fast)
    assert choice.name == "multi_worker_mirrored"
    assert choice.speedup == pytest.approx(1.5 / (0.5 + 4 / 3 * 10.4 * MB / 1.25e9))
    assert why.startswith("within 10% of the best (sync_every 50, 3.00x)")
    # Nothing beats one machine: one machine.
    slow = advice.predict(2, 10 * MB, 10 * MB, 0.01, 1e6 / 8)
    assert advice.recommend(slow)[0] is None


def test_validate_and_doctor_print_one_line_per_strategy_and_the_one_recommended():
    ok, lines = advice.advise(cluster_of(THREE_LAN), advice.Figures(10.6 * MB, 10.4 * MB, 0.05, MBIT100))
    assert ok is False  # the file syncs every step: 0.13x
    said = dict(lines)
    assert said["expect multi_worker_mirrored"].startswith(
        "0.13x one machine: 3 machines x 0.050 s / (0.050 s + 1.109 s for 13.87 MB a step through the busiest "
        "link: 2(N-1)/N x 10.40 MB of gradients in float32, at 12.50 MB/s)"
    )
    assert said["strategy"] == (
        "recommends sync_every 50 (sync_every: 50 in the cluster file): 2.07x one machine, the best expected; "
        "this file asks for multi_worker_mirrored: 0.13x"
    )
    assert "no overlap with the backward pass, no latency" in said["figures"]
    r = od_dist("validate", f"--cluster={THREE}")
    assert r.returncode == 0, r.stderr
    assert (
        "expect multi_worker_mirrored: 3 machines x c / (c + b / link), b a step through the busiest link: "
        in r.stdout
    )
    assert "strategy: no recommendation without the model's bytes (--model_mb)" in r.stdout, r.stdout
    r = od_dist(
        "validate",
        f"--cluster={THREE}",
        "--step_time=0.05",
        "--model_mb=10.6",
        "--gradient_mb=10.4",
        "--link_mbit=100",
    )
    assert "strategy: recommends sync_every 50" in r.stdout, r.stdout
    lan = os.path.join(ROOT, "clusters", "lan-example.yaml")
    r = od_dist(
        "doctor",
        f"--cluster={lan}",
        "--role=ps",
        "--index=0",
        "--connect_timeout=0.2",
        "--step_time=0.5",
        "--model_mb=10.6",
        "--gradient_mb=10.4",
        "--link_mbit=1000",
    )
    # parameter_server: 2 workers, 21 MB a round through the ps machine's link at 125 MB/s: 0.168 s,
    # 2 x 0.5 / 0.668 = 1.50x. Every step in sync on the master's and the workers' 3 machines: 2.46x
    # (0.111 s), in bfloat16 2.70x, within 10% of sync_every 50's 2.99x: recommended.
    assert (
        "  ok    expect parameter_server: 1.50x one machine: 2 machines x 0.500 s / (0.500 s + 0.168 s"
        in r.stdout
    )
    assert "  ok    expect multi_worker_mirrored: 2.46x one machine" in r.stdout
    assert (
        "  warn  strategy: recommends multi_worker_mirrored bfloat16 (the same with --all_reduce_dtype bfloat16): "
        "2.70x one machine, within 10% of the best (sync_every 50, 2.99x) and closer to training as one machine "
        "does; this file asks for parameter_server: 1.50x\n"
    ) in r.stdout, r.stdout


def test_no_cpu_benchmark_figure_is_quoted_as_a_prediction():
    assert not hasattr(advice, "MWM_100MBIT") and not hasattr(advice, "PS_100MBIT")
    for cluster in (THREE_LAN, ONE_PS):
        for figures in (advice.Figures(), advice.Figures(10.6 * MB, 10.4 * MB, 0.05, MBIT100)):
            text = "\n".join(d for _, d in advice.advise(cluster_of(cluster), figures)[1])
            for quoted in (
                "1.63x",
                "1.87x",
                "2.67x",
                "1.96x",
                "0.81x",
                "0.99x",
                "BENCHMARKS.md",
                "measurements",
            ):
                assert quoted not in text, (quoted, text)
    ok, lines = advice.advise(cluster_of("master: 127.0.0.1:2222\nworker: [127.0.0.1:2223]\n"))
    assert ok and lines == [("strategy", advice.ONE_MACHINE)]


def test_the_benchmark_s_prediction_beside_its_measurement():
    p = advice.predict_case(3, "multi_worker_mirrored", 1.45 * MB, 1.45 * MB, 0.241, 4e6 / 8)
    # 2(N-1)/N x 1.45 MB = 1.933 MB at 0.5 MB/s: 3.867 s; 3 x 0.241 / 4.108.
    assert p.speedup == pytest.approx(0.723 / (0.241 + 4 / 3 * 1.45 / 0.5), abs=1e-6)
    line = advice.against_measured(p, 0.15)
    assert line.startswith(
        "predicted 0.18x (3 machines x c / (c + 3.867 s for 1.93 MB a step: 2(N-1)/N x 1.45 MB"
    )
    assert line.endswith("measured 0.15x: measured/predicted 0.85")
    h = advice.predict_case(
        3,
        "multi_worker_mirrored",
        1.45 * MB,
        1.45 * MB,
        0.241,
        4e6 / 8,
        sync_every=25,
        wire_bytes_per_value=2,
    )
    assert h.name == "sync_every 25 bfloat16" and h.step_bytes == pytest.approx(4 / 3 * 0.725 * MB / 25)
    assert advice.predict_case(2, "parameter_server", 2 * MB, 2 * MB, 0.1, 1e6).machines == 2


def test_doctors_on_two_ports_measure_the_link_and_predict_from_it(tmp_path):
    """Two doctors, real processes on loopback (each task as if on a machine of its own, --role):
    each answers the link test on its task's port and measures the other's; both print the link and
    every strategy's expected speed-up from it."""
    from loopback import free_ports

    a, b = free_ports(2)
    path = tmp_path / "c.yaml"
    path.write_text(f"strategy: multi_worker_mirrored\nmaster: 127.0.0.1:{a}\nworker: [127.0.0.1:{b}]\n")
    figures = ["--step_time=0.05", "--model_mb=1.45", "--link_wait=30", "--link_test=0.3"]
    cmd = [sys.executable, "-m", "od_dist", "doctor", f"--cluster={path}", *figures]
    first = subprocess.Popen([*cmd, "--role=master"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    second = od_dist("doctor", f"--cluster={path}", "--role=worker", *figures)
    out = first.communicate(timeout=120)[0]
    assert first.returncode == 0 and second.returncode == 0, out + second.stdout + second.stderr
    for text in (out, second.stdout):
        (link,) = [line for line in text.splitlines() if line.startswith("  ok    link to 127.0.0.1: ")]
        to_it, from_it = (float(x) for x in re.findall(r"([\d.]+) MB/s", link))
        rate = min(to_it, from_it) * MB
        assert "(measured, the slowest of 1 of 1 peer(s))" in text, text
        expected = advice.predict(2, 1.45 * MB, 1.45 * MB, 0.05, rate)[0]
        # 2 machines: each step sends 1.45 MB each way (2(N-1)/N = 1).
        said = re.search(
            r"  ok    expect multi_worker_mirrored: ([\d.]+)x one machine: 2 machines x 0.050 s", text
        )
        assert said and float(said.group(1)) == pytest.approx(expected.speedup, abs=0.011), text
        assert "for 1.45 MB a step through the busiest link" in text
        assert "  ok    strategy: recommends " in text
    # The link test leaves the ports free for the job.
    for port in (a, b):
        socket.create_server(("127.0.0.1", port)).close()


def test_every_group_min_trainers_allows_counts():
    from od_dist.model import batch

    assert batch.group_replicas([1, 1, 1], 2) == [2, 3]
    assert batch.group_replicas([1, 1, 1], None) == [3]
    assert batch.group_replicas([2, 1, 1], 2) == [2, 3, 4]  # a machine of two clones
    assert batch.groups_problem(12, [2, 3], 2) is None


@pytest.mark.parametrize("batch, not_over", [(8, "3"), (9, "2")])
def test_a_batch_that_some_group_cannot_split_is_refused_before_anything_starts(tmp_path, batch, not_over):
    expected = (
        f"{BATCH}: {batch} does not split evenly over every group min_trainers 2 allows (2 and 3 replicas "
        f"in sync; not over {not_over}), so a lost machine would leave a group that cannot train; set a "
        f"multiple of 6 (6 or 12) with --params_override {BATCH}=N"
    )
    override = f"--params_override={BATCH}={batch}"
    r = od_dist("validate", f"--cluster={THREE}", f"--pipeline={PIPELINE}", override)
    assert r.returncode == 2 and expected in r.stderr, r.stderr
    r = od_dist(
        "scripts",
        f"--cluster={THREE}",
        f"--pipeline={PIPELINE}",
        "--model_dir=runs/lan",
        override,
        f"--out={tmp_path / 's'}",
    )
    assert r.returncode == 2 and expected in r.stderr, r.stderr
    assert not (tmp_path / "s").exists()
    r = od_dist(
        "doctor",
        f"--cluster={THREE}",
        "--role=master",
        f"--pipeline={PIPELINE}",
        override,
        "--connect_timeout=0.2",
    )
    assert f"FIX   global batch: pipeline '{PIPELINE}': {expected}" in r.stdout, r.stdout
    # train refuses it too, before any task starts (exit 2 from the validation, not the trainer).
    loop = tmp_path / "loop.yaml"
    loop.write_text(
        "master: 127.0.0.1:2390\nworker: [127.0.0.1:2391, 127.0.0.1:2392]\nmin_trainers: 2\nmembership_port: 2393\n"
    )
    r = od_dist(
        "train",
        f"--cluster={loop}",
        "--role=master",
        f"--pipeline={PIPELINE}",
        "--model_dir=m",
        override,
        "--max_restarts=3",
        cwd=tmp_path,
    )
    assert r.returncode == 2 and expected in r.stderr, r.stderr
    assert not (tmp_path / "m").exists()


def test_k8s_and_slurm_say_in_one_line_that_they_are_not_elastic(tmp_path):
    # 9 splits over the one group of 3 these jobs run: accepted, with the line.
    override = f"--params_override={BATCH}=9"
    common = [f"--cluster={THREE}", f"--pipeline={PIPELINE}", "--model_dir=runs/lan", override]
    for command, more in (
        ("k8s", ["--image=registry.example/od-dist:1", f"--out={tmp_path / 'j.yaml'}"]),
        ("slurm", [f"--out={tmp_path / 'job.sbatch'}"]),
    ):
        r = od_dist(command, *common, *more)
        assert r.returncode == 0, r.stderr
        said = [line for line in r.stderr.splitlines() if "elastic" in line]
        assert said == [
            f"od-dist {command}: warning: min_trainers 2 in {THREE}: {command} does not support elastic "
            "training; its job trains with all 3 trainers or none (a lost one restarts the job); for "
            "elastic, use `od-dist scripts`"
        ], r.stderr
    r = od_dist("scripts", *common, f"--out={tmp_path / 's'}")  # elastic: the groups of 2 cannot split 9
    assert r.returncode == 2 and "min_trainers 2 allows" in r.stderr


def test_slurm_leaves_no_cluster_file_behind_when_it_refuses(tmp_path):
    r = od_dist(
        "slurm",
        "--nodes=3",
        f"--pipeline={PIPELINE}",
        "--model_dir=runs/x",
        f"--params_override={BATCH}=7",
        "--out=job.sbatch",
        cwd=tmp_path,
    )
    assert r.returncode == 2 and "7 does not split evenly over 3 replicas" in r.stderr, r.stderr
    assert os.listdir(tmp_path) == []
    r = od_dist(
        "slurm", "--nodes=3", f"--pipeline={PIPELINE}", "--model_dir=runs/x", "--out=job.sbatch", cwd=tmp_path
    )
    assert r.returncode == 2  # 8 over 3 nodes
    assert os.listdir(tmp_path) == []


def test_the_scripts_readme_says_how_the_job_heals():
    mwm = cluster_of("master: 10.0.0.1:2222\nworker: [10.0.0.2:2222]\n")
    elastic = cluster_of(
        "master: 10.0.0.1:2222\nworker: [10.0.0.2:2222, 10.0.0.3:2222]\nmin_trainers: 2\nmembership_port: 2226\n"
    )
    ps = cluster_of("master: 10.0.0.1:2222\nworker: [10.0.0.2:2222]\nps: [10.0.0.2:2223]\n")
    assert readme._heals(mwm).startswith(
        "The job heals itself: when a trainer is lost, the other trainers exit 138"
    )
    assert readme._heals(ps).startswith("The job heals itself: a lost parameter_server worker rejoins;")
    assert readme._heals(elastic).startswith(
        "The job heals itself and is elastic (min_trainers 2): when a trainer's machine is lost, the trainers up "
        "(at least 2) go on as a smaller group"
    )
    assert "A machine gone for good: the others train on without it" in readme._gone_for_good(elastic)
    assert "or for a machine that is gone for good, stop all tasks" in readme._gone_for_good(mwm)


def test_doctor_asks_for_no_validation_records_where_no_task_reads_them(tmp_path):
    """A trainer needs the training records only (training reads no validation records); the
    evaluator the validation records."""
    (tmp_path / "data" / "shapes").mkdir(parents=True)
    (tmp_path / "data" / "shapes" / "train.tfrecord").write_bytes(b"")
    loop = tmp_path / "loop.yaml"
    loop.write_text("master: 127.0.0.1:2390\nworker: [127.0.0.1:2391]\nevaluator: 127.0.0.1\n")

    def doctor(*args):
        r = od_dist(
            "doctor",
            f"--cluster={loop}",
            f"--pipeline={PIPELINE}",
            "--connect_timeout=0.2",
            *args,
            cwd=tmp_path,
        )
        return r.stdout.splitlines()

    lines = doctor("--role=worker", "--index=0")
    assert (
        "  ok    task.train_data.input_path: data/shapes/train.tfrecord: 1 file(s) here, for worker:0"
        in lines
    )
    assert not [line for line in lines if "validation_data" in line], lines
    lines = doctor("--role=evaluator")
    assert any(
        line.startswith(
            "  FIX   task.validation_data.input_path: data/shapes/val.tfrecord: no such file here"
        )
        and line.endswith(
            "and evaluator:0 read it on this machine: copy the records here at that path, or put them on a shared folder"
        )
        for line in lines
    ), lines
