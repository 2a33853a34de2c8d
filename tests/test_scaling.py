"""Scaling levers and what od-dist tells the user about the network (issue: scaling on simulated
machines; the benchmark itself is benchmarks/scaling.py, its harness checked in
test_scaling_harness.py): the bytes a step moves, the layout warning, the pipeline's all-reduce
settings reaching the strategy, --fixed_replica_batch. What a real multi_worker_mirrored master says
it moves is checked on the pair of test_faults.py, which it shares."""

import re
import subprocess
import sys

import pytest
from loopback import PIPELINE, ROOT

from od_dist.cluster import spec, traffic
from od_dist.host import config, doctor

MB = 1e6


def cluster(text: str) -> spec.Cluster:
    import yaml

    return spec.from_document(yaml.safe_load(text))


ONE_PS_MACHINE = "master: 10.0.0.1:2222\nworker: [10.0.0.2:2222, 10.0.0.3:2222]\nps: [10.0.0.4:2222]\n"
PS_ON_EACH_WORKER = (
    "master: 10.0.0.1:2222\nworker: [10.0.0.2:2222, 10.0.0.3:2222]\nps: [10.0.0.2:2223, 10.0.0.3:2223]\n"
)


# ----- the bytes a step moves (no TensorFlow) -----------------------------------------------------


def test_ring_all_reduce_bytes_per_trainer():
    c = cluster("master: 10.0.0.1:2222\nworker: [10.0.0.2:2222, 10.0.0.3:2222]\n")
    per, carried = traffic.link_bytes(c, 4 * MB, 2 * MB)
    assert per == pytest.approx(2 * 2 * (2 / 3) * 2 * MB)  # sent + received, 2(N-1)/N x gradients
    assert set(carried.values()) == {per}
    line = traffic.describe(c, 4 * MB, 2 * MB)
    assert "all-reduces 2.0 MB of gradients; each of the 3 trainers sends and receives 2.7 MB" in line


def test_one_ps_machine_carries_every_worker_step():
    per, carried = traffic.link_bytes(cluster(ONE_PS_MACHINE), 2 * MB, 2 * MB)
    assert per == 4 * MB
    assert carried["10.0.0.4"] == 8 * MB  # both workers' reads and writes
    assert carried["10.0.0.2"] == carried["10.0.0.3"] == 4 * MB
    assert (
        "with 2 worker(s) stepping at once the busiest link, 10.0.0.4's, carries 8.0 MB"
        in traffic.describe(cluster(ONE_PS_MACHINE), 2 * MB, 2 * MB)
    )


def test_a_ps_on_each_worker_machine_halves_the_busiest_link():
    per, carried = traffic.link_bytes(cluster(PS_ON_EACH_WORKER), 2 * MB, 2 * MB)
    # Each worker fetches half the variables from the other machine and serves the other half.
    assert carried["10.0.0.2"] == carried["10.0.0.3"] == 4 * MB
    assert carried["10.0.0.1"] == 0
    local = cluster("master: 127.0.0.1:2222\nworker: [127.0.0.1:2223]\nps: [127.0.0.1:2224]\n")
    assert traffic.describe(local, 2 * MB, 2 * MB).endswith(
        "every task is on this machine: no link carries it"
    )


# ----- the doctor's layout check (no TensorFlow) --------------------------------------------------


def test_doctor_warns_when_every_variable_is_behind_one_link():
    (check,) = doctor.check_layout(cluster(ONE_PS_MACHINE))
    assert check.status == doctor.WARN
    assert str(check).startswith(
        "warn  layout: every ps task is on 10.0.0.4, which runs no worker: each step of the 2 workers"
    )
    assert "put a ps on each worker machine instead" in str(check)
    assert doctor.check_layout(cluster(PS_ON_EACH_WORKER)) == []
    one_worker = "master: 10.0.0.1:2222\nworker: [10.0.0.2:2222]\nps: [10.0.0.4:2222]\n"
    assert doctor.check_layout(cluster(one_worker)) == []
    assert doctor.check_layout(cluster("master: 10.0.0.1:2222\nworker: [10.0.0.2:2222]\n")) == []


def test_doctor_prints_the_layout_warning(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(ONE_PS_MACHINE)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "od_dist",
            "doctor",
            f"--cluster={path}",
            "--role=master",
            "--connect_timeout=0.1",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert "warn  layout: every ps task is on 10.0.0.4" in r.stdout, r.stdout + r.stderr


# ----- runtime.all_reduce_alg / num_packs: used, or refused, never dropped -------------------------


@pytest.mark.parametrize(
    "strategy, override, message",
    [
        (
            "parameter_server",
            "runtime.all_reduce_alg=ring",
            "runtime.all_reduce_alg: 'ring': parameter_server has no",
        ),
        (
            "parameter_server",
            "runtime.num_packs=2",
            "runtime.num_packs: '2': parameter_server has no all-reduce",
        ),
        ("multi_worker_mirrored", "runtime.all_reduce_alg=hierarchical_copy", "use one of ring, nccl under"),
        ("multi_worker_mirrored", "runtime.num_packs=4", "pass --all_reduce_packs N to od-dist train"),
        ("mirrored", "runtime.all_reduce_alg=ring", "use one of nccl, hierarchical_copy under mirrored"),
        ("mirrored", "runtime.num_packs=2", "applies with runtime.all_reduce_alg nccl or hierarchical_copy"),
    ],
)
def test_all_reduce_settings_that_cannot_apply_are_refused(strategy, override, message):
    from od_dist.model import pipeline

    with pytest.raises(pipeline.PipelineError, match=re.escape(message)):
        pipeline.load_pipeline(PIPELINE, override, strategy)


def test_all_reduce_settings_reach_the_strategy():
    import tensorflow as tf

    from od_dist.model import pipeline
    from od_dist.task import strategy

    params = pipeline.load_pipeline(PIPELINE, "runtime.all_reduce_alg=ring", "multi_worker_mirrored")
    options = strategy.collective_options(params.runtime.all_reduce_alg)
    assert options.implementation == tf.distribute.experimental.CommunicationImplementation.RING
    params = pipeline.load_pipeline(
        PIPELINE, "runtime.all_reduce_alg=hierarchical_copy,runtime.num_packs=2", "mirrored"
    )
    ops = strategy.mirrored_cross_device_ops(params.runtime.all_reduce_alg, params.runtime.num_packs)
    assert isinstance(ops, tf.distribute.HierarchicalCopyAllReduce) and ops._num_packs == 2
    assert strategy.variable_partitioner(1) is None
    assert isinstance(
        strategy.variable_partitioner(3), tf.distribute.experimental.partitioners.MinSizePartitioner
    )


# A trainer's step under multi_worker_mirrored with --all_reduce_dtype bfloat16: 1 + 2**-10 has no
# bfloat16 (8 significant bits), so the sum sent rounds to 1; 3 has. In a process of its own: the
# strategy configures the collectives of the whole process.
BFLOAT16_STEP = """
import os
os.environ["TF_USE_LEGACY_KERAS"] = "1"
import tensorflow as tf
import tf_keras
from od_dist.task import strategy, trainer

dist = tf.distribute.MultiWorkerMirroredStrategy()
with dist.scope():
    v = tf.Variable([0.0, 0.0])
    sgd = tf_keras.optimizers.legacy.SGD(1.0)
wire = strategy.reduce_gradients_in(dist, sgd, "bfloat16")
print("set:", wire.name)
print("set on one machine:", strategy.reduce_gradients_in(tf.distribute.MirroredStrategy(), sgd, "bfloat16"))
dense = tf_keras.Sequential([tf_keras.layers.Dense(2, input_shape=(3,))])  # 8 float32 weights
print("bytes:", trainer.variable_bytes(dense), trainer.variable_bytes(dense, wire))


@tf.function
def step():
    dist.run(lambda: sgd.apply_gradients([(tf.constant([1 + 2**-10, 3.0]), v)]))


step()
print("variable:", v.dtype.name, v.numpy().tolist())
"""


def test_bfloat16_all_reduce_rounds_what_is_sent_and_keeps_float32_variables():
    r = subprocess.run([sys.executable, "-c", BFLOAT16_STEP], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    want = "set: bfloat16\nset on one machine: None\nbytes: (32, [24, 8]) (32, [12, 4])\nvariable: float32 [-1.0, -3.0]\n"
    assert want in r.stdout, r.stdout


# ----- --fixed_replica_batch --------------------------------------------------------------------


def test_by_default_replicas_share_the_batch_and_one_it_does_not_divide_is_refused():
    from od_dist.model import batch, pipeline

    params = pipeline.load_pipeline(PIPELINE, None, "multi_worker_mirrored")
    said = batch.split_over_replicas(params, 2)
    assert said == (
        "global batch 8 split over 2 replicas, 4 each; learning rate and steps as written "
        "(--fixed_replica_batch: 8 per replica instead)"
    )
    assert params.task.train_data.global_batch_size == 8 and params.trainer.train_steps == 2000
    with pytest.raises(pipeline.PipelineError) as e:
        batch.split_over_replicas(params, 3)
    assert str(e.value) == (
        "task.train_data.global_batch_size: 8 does not split evenly over 3 replicas in sync; set a "
        "multiple of 3 (6 or 9) with --params_override task.train_data.global_batch_size=N, or pass "
        "--fixed_replica_batch to make 8 each replica's batch"
    )
    with pytest.raises(
        pipeline.PipelineError, match=r"over 16 replicas in sync; set a multiple of 16 \(16\)"
    ):
        batch.split_over_replicas(params, 16)


def test_fixed_replica_batch_scales_batch_and_learning_rate():
    from od_dist.model import batch, pipeline

    params = pipeline.load_pipeline(PIPELINE, None, "multi_worker_mirrored")
    said = batch.scale_for_replicas(params, 3)
    assert said == "global batch 8 x 3 replicas = 24, learning rate x3, warmup 100 steps"
    assert params.task.train_data.global_batch_size == 24
    assert params.trainer.optimizer_config.learning_rate.cosine.initial_learning_rate == pytest.approx(0.24)
    assert params.trainer.train_steps == 2000  # steps as written
    # No warmup in the pipeline: one is added (5% of the steps), from the unscaled rate.
    params = pipeline.load_pipeline(PIPELINE, "trainer.optimizer_config.warmup.type=null", "mirrored")
    batch.scale_for_replicas(params, 2)
    warmup = params.trainer.optimizer_config.warmup
    assert warmup.type == "linear" and warmup.linear.warmup_steps == 100  # 5% of the 2000 steps
    assert warmup.linear.warmup_learning_rate == pytest.approx(0.08)
    params = pipeline.load_pipeline(PIPELINE, None, "mirrored")
    batch.scale_for_replicas(params, 1)
    assert params.task.train_data.global_batch_size == 8


def test_fixed_replica_batch_counts_every_trainer_and_is_refused_under_parameter_server():
    mwm = cluster("master: 127.0.0.1:2222\nworker: [127.0.0.1:2223, 127.0.0.1:2224]\n")
    selected = config.TaskConfig(mwm, mwm.task("master", 0), "c.yaml", "")
    cfg = config.train_config(selected, PIPELINE, "m", None, False, None, 60, fixed_replica_batch=True)
    assert cfg.replicas == 3
    # --num_clones on the command line is every trainer's (one launch line serves every machine),
    # over the cluster file's num_clones: 3 trainers x 2 clones.
    cfg = config.train_config(selected, PIPELINE, "m", 2, False, None, 60, fixed_replica_batch=True)
    assert cfg.replicas == 6 and cfg.num_clones == 2
    hosts = cluster(
        "master: 10.0.0.1:2222\nworker: [10.0.0.2:2222, 10.0.0.3:2222]\n"
        "num_clones: 2\nhosts: {10.0.0.3: {num_clones: 4}}\n"
    )
    selected = config.TaskConfig(hosts, hosts.task("master", 0), "c.yaml", "")
    assert config.train_config(selected, PIPELINE, "m", None, False, None, 60).replicas == 2 + 2 + 4
    assert config.train_config(selected, PIPELINE, "m", 1, False, None, 60).replicas == 3
    ps = cluster("master: 127.0.0.1:2222\nworker: [127.0.0.1:2223]\nps: [127.0.0.1:2224]\n")
    selected = config.TaskConfig(ps, ps.task("master", 0), "c.yaml", "")
    with pytest.raises(spec.InvalidCluster, match="--fixed_replica_batch: 'True': parameter_server runs"):
        config.train_config(selected, PIPELINE, "m", None, False, None, 60, fixed_replica_batch=True)


def test_the_packs_the_master_reports_are_the_packs_tensorflow_makes():
    """--all_reduce_packs N sets TensorFlow's bytes_per_pack to the total over N; TensorFlow closes a
    pack once it holds more than that, so large tensors leave fewer packs: strategy.packed counts
    them as TensorFlow's own grouping does."""
    import tensorflow as tf
    from tensorflow.python.distribute import cross_device_utils

    from od_dist.task import strategy

    for floats in ([8] * 8, [10, 10, 50, 10, 10], [1000, 3, 3, 3], [5], [7, 1, 7, 1, 7, 1, 7, 1]):
        sizes = [4 * n for n in floats]
        for packs in (1, 2, 3, 4):
            per_pack = -(-sum(sizes) // packs)
            grouped = cross_device_utils.group_by_size([tf.zeros([n]) for n in floats], per_pack)
            want = [sum(4 * t.shape.num_elements() for t in pack) for pack in grouped]
            assert strategy.packed(sizes, per_pack) == want, (floats, packs)
    assert strategy.packed([32] * 8, 64) == [96, 96, 64]  # 4 asked, 3 made


# ----- a batch the trainers cannot share: refused before anything starts -------------------------

THREE = "strategy: multi_worker_mirrored\nmaster: 127.0.0.1:1\nworker: [127.0.0.1:2, 127.0.0.1:3]\n"
REFUSED = (
    "pipeline '{p}': task.train_data.global_batch_size: 8 does not split evenly over 3 replicas in sync "
    "(3 trainers x 1 clone); set a multiple of 3 (6 or 9) with --params_override "
    "task.train_data.global_batch_size=N, or pass --fixed_replica_batch to make 8 each replica's batch"
)


def test_the_batch_rule_names_the_trainers_clones_and_the_batches_that_divide():
    from od_dist.model import batch

    assert batch.batch_problem(9, 3, [1, 1, 1]) is None and batch.batch_problem(8, 1) is None
    assert "over 3 replicas in sync (3 trainers x 1 clone); set a multiple of 3 (6 or 9)" in (
        batch.batch_problem(8, 3, [1, 1, 1])
    )
    assert "over 10 replicas in sync (4 trainers with 2+2+2+4 clones); set a multiple of 10 (10)" in (
        batch.batch_problem(8, 10, [2, 2, 2, 4])
    )
    assert "(2 trainers x 2 clones); set a multiple of 4 (4 or 8)" in batch.batch_problem(6, 4, [2, 2])
    # The file's batch, or --params_override's (as a list of keys, YAML, or a file), no TensorFlow.
    three = cluster(THREE)
    assert batch.check_batch_split(three, PIPELINE)[0] == REFUSED.format(p=PIPELINE)
    override = "task.train_data.global_batch_size=12,trainer.train_steps=5"
    assert batch.check_batch_split(three, PIPELINE, override) == (
        None,
        "global batch 12 over 3 replicas in sync, 4 each",
        True,
    )
    assert batch.check_batch_split(three, PIPELINE, "{task: {train_data: {global_batch_size: 7}}}")[0]
    # The key given twice: the last one trains, as Model Garden applies the overrides in order.
    twice = "task.train_data.global_batch_size=2,task.model.input_size=[64,64,3],task.train_data.global_batch_size=3"
    assert batch.check_batch_split(three, PIPELINE, twice)[0] is None
    # Every trainer's --num_clones counts; parameter_server and a lone trainer split nothing.
    assert (
        "(3 trainers x 2 clones); set a multiple of 6 (6 or 12)"
        in batch.check_batch_split(three, PIPELINE, "task.train_data.global_batch_size=10", num_clones=2)[0]
    )
    ps = cluster("master: 127.0.0.1:1\nworker: [127.0.0.1:2, 127.0.0.1:3]\nps: [127.0.0.1:4]\n")
    assert batch.check_batch_split(ps, PIPELINE) == (None, "", False)
    assert batch.in_sync_clones(ps) == [] and batch.in_sync_clones(three) == [1, 1, 1]


def test_validate_scripts_k8s_slurm_and_doctor_refuse_a_batch_the_trainers_cannot_share(tmp_path):
    """Three multi_worker_mirrored trainers and the demo's batch of 8: one line, exit 2, nothing
    written (doctor: its FIX line); a batch they share, or --fixed_replica_batch, passes."""
    path = tmp_path / "three.yaml"
    path.write_text(THREE)
    common = [f"--cluster={path}", f"--pipeline={PIPELINE}"]
    out = tmp_path / "out"
    runs = {
        "validate": common,
        "scripts": [*common, "--model_dir=runs/x", f"--out={out}"],
        "k8s": [*common, "--model_dir=runs/x", "--image=i"],
        "slurm": [*common, "--model_dir=runs/x", f"--out={out / 'job.sh'}"],
    }
    for name, args in runs.items():
        r = od_dist_cmd(name, *args)
        assert r.returncode == 2, (name, r.stdout, r.stderr)
        assert r.stderr.splitlines() == [f"od-dist {name}: " + REFUSED.format(p=PIPELINE)], (name, r.stderr)
        assert not out.exists() and not (name == "k8s" and r.stdout), name
    r = od_dist_cmd("validate", *common, "--params_override=task.train_data.global_batch_size=9")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == f"pipeline {PIPELINE}: global batch 9 over 3 replicas in sync, 3 each"
    r = od_dist_cmd("scripts", *runs["scripts"][1:], f"--cluster={path}", "--fixed_replica_batch")
    assert r.returncode == 0 and out.is_dir(), r.stderr
    r = od_dist_cmd("doctor", *common)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "  FIX   global batch: " + REFUSED.format(p=PIPELINE) in r.stdout.splitlines(), r.stdout


def od_dist_cmd(*args):
    return subprocess.run(
        [sys.executable, "-m", "od_dist", *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
