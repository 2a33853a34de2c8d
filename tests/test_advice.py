"""What od-dist tells a user choosing a layout, and the refusals that go with it: the strategy the
measurements recommend (validate, doctor), a batch that some elastic group could not split
(validate, doctor, scripts, train), k8s and slurm on a file that asks for elastic, the scripts'
README on healing, and doctor on records a machine's tasks never read. No TensorFlow: each
command here is refused or answers before any task starts."""

import os
import subprocess
import sys

import pytest
from loopback import PIPELINE, ROOT

from od_dist.cluster import advice, safe_yaml
from od_dist.cluster import spec as cluster_mod
from od_dist.model import pipeline
from od_dist.render import readme

THREE = os.path.join(ROOT, "clusters", "three-machines.yaml")
BATCH = "task.train_data.global_batch_size"


def od_dist(*args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, "-m", "od_dist", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def cluster_of(text):
    return cluster_mod.from_document(safe_yaml.loads(text))


@pytest.mark.parametrize(
    "text, followed, said",
    [
        (
            "master: 10.0.0.1:2222\nworker: [10.0.0.2:2222, 10.0.0.3:2222]\n",
            True,
            "multi_worker_mirrored on 3 trainer machines is what the measurements recommend; expect about "
            "1.87x one machine's speed at 100 Mbit/s for the demo, 2.67x for a real-size detector",
        ),
        (
            "master: 10.0.0.1:2222\nworker: [10.0.0.2:2222]\n",
            True,
            "on 2 trainer machines is what the measurements recommend; expect about 1.63x",
        ),
        (
            "master: 10.0.0.1:2222\nworker: [10.0.0.2:2222, 10.0.0.3:2222, 10.0.0.4:2222]\n",
            True,
            "on 4 trainer machines is what the measurements recommend; more than 3 were not measured",
        ),
        (
            "master: 10.0.0.1:2222\nworker: [10.0.0.2:2222, 10.0.0.3:2222]\nps: [10.0.0.2:2223, 10.0.0.3:2223]\n",
            False,
            "parameter_server trained slower than one machine at 100 Mbit/s (0.81x with one ps machine, "
            "0.99x with a ps on each worker machine, 2 workers); for speed the measurements recommend "
            "multi_worker_mirrored",
        ),
        (
            "master: 127.0.0.1:2222\nworker: [127.0.0.1:2223]\n",
            True,
            "every trainer is on one machine: no speed-up over one machine to expect",
        ),
    ],
)
def test_the_strategy_the_measurements_recommend_for_a_layout(text, followed, said):
    ok, line = advice.advise(cluster_of(text))
    assert ok is followed and said in line, line
    assert line.endswith("(BENCHMARKS.md, docs/scaling.md)")


def test_validate_and_doctor_say_it():
    r = od_dist("validate", f"--cluster={THREE}")
    assert r.returncode == 0, r.stderr
    assert (
        "strategy: multi_worker_mirrored on 3 trainer machines is what the measurements recommend" in r.stdout
    )
    lan = os.path.join(ROOT, "clusters", "lan-example.yaml")
    r = od_dist("doctor", f"--cluster={lan}", "--role=ps", "--index=0", "--connect_timeout=0.2")
    assert "warn  strategy: parameter_server trained slower than one machine" in r.stdout, r.stdout


def test_every_group_min_trainers_allows_counts():
    assert pipeline.group_replicas([1, 1, 1], 2) == [2, 3]
    assert pipeline.group_replicas([1, 1, 1], None) == [3]
    assert pipeline.group_replicas([2, 1, 1], 2) == [2, 3, 4]  # a machine of two clones
    assert pipeline.groups_problem(12, [2, 3], 2) is None


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
