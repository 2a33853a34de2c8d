"""sync_every's meeting (task/local_sgd.py) on two replicas of one process (MirroredStrategy over
two logical CPUs: the same replica functions and all-reduce calls as multi_worker_mirrored's
trainers), checked against the outer step computed by hand."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Two replicas whose weights differ (each moved its own way since the anchor), two meetings, then
# each replica's copy of every variable. Run in its own process: logical devices must be set
# before TensorFlow starts.
SCRIPT = r"""
import json, sys
import numpy as np
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import tf_keras
from od_dist.task import local_sgd

lr, mu, wire = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
dist = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with dist.scope():
    model = tf_keras.Sequential([tf_keras.layers.Dense(3, input_shape=(2,)), tf_keras.layers.BatchNormalization()])
    model(tf.zeros([1, 2]))
meetings = local_sgd.Meetings(dist, model, local_sgd.Meeting(5, lr, mu), None if wire == "float32" else tf.as_dtype(wire))
names = [v.name for v in meetings.trained + meetings.stats]
out = {"trained": [v.name for v in meetings.trained], "names": names, "rounds": []}
rng = np.random.default_rng(0)
meetings.anchor()
out["initial"] = {v.name: v.values[0].numpy().tolist() for v in meetings.trained + meetings.stats}
for _ in range(2):
    before = {}
    for v in meetings.trained + meetings.stats:
        copies = []
        for c in v.values:
            c.assign(c.numpy() + rng.normal(size=c.shape).astype(np.float32))
            copies.append(c.numpy().tolist())
        before[v.name] = copies
    meetings.meet()
    after = {v.name: [c.numpy().tolist() for c in v.values] for v in meetings.trained + meetings.stats}
    out["rounds"].append({"before": before, "after": after})
print("RESULT " + json.dumps(out))
"""


def _run(lr: float, mu: float, wire: str = "float32") -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=REPO)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(lr), str(mu), wire],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@pytest.mark.parametrize(("lr", "mu"), [(0.7, 0.9), (1.0, 0.0)])
def test_meeting_equals_the_outer_step_by_hand_and_leaves_every_replica_the_same(lr, mu):
    """The outer gradient is the anchor (the weights at the last meeting) minus the average of
    the replicas' weights; velocity = mu * velocity + gradient; anchor -= lr * (gradient + mu *
    velocity) (Nesterov, as DiLoCo's outer SGD); batch-norm statistics take the plain average."""
    out = _run(lr, mu)
    trained = set(out["trained"])
    assert trained and set(out["names"]) - trained, "the model has weights and batch-norm statistics"
    anchor = {name: np.array(value, np.float64) for name, value in out["initial"].items()}
    velocity = dict.fromkeys(anchor, 0.0)
    for i, r in enumerate(out["rounds"]):
        for name in out["names"]:
            before = np.array(r["before"][name], np.float64)
            after = np.array(r["after"][name], np.float32)
            assert not np.array_equal(before[0], before[1]), f"{name}: the replicas should differ before"
            assert np.array_equal(after[0], after[1]), f"{name}: the replicas differ after meeting {i + 1}"
            mean = before.mean(axis=0)
            if name in trained:
                g = anchor[name] - mean
                velocity[name] = mu * velocity[name] + g
                anchor[name] = anchor[name] - lr * (g + mu * velocity[name])
            else:
                anchor[name] = mean
            np.testing.assert_allclose(after[0], anchor[name], rtol=1e-5, atol=1e-5, err_msg=name)
            anchor[name] = after[0].astype(np.float64)


def test_bfloat16_on_the_wire_rounds_the_change_not_the_weights():
    """The change since the meeting goes in bfloat16: the replicas still end bit for bit equal, and
    the weights are the average to within bfloat16's rounding of the change (8 bits), not of the
    weights themselves."""
    out = _run(1.0, 0.0, "bfloat16")
    for name in out["names"]:
        r = out["rounds"][0]
        before = np.array(r["before"][name], np.float64)
        after = np.array(r["after"][name], np.float32)
        assert np.array_equal(after[0], after[1]), name
        change = np.abs(before - np.array(out["initial"][name])).max()
        np.testing.assert_allclose(after[0], before.mean(axis=0), atol=change / 64, err_msg=name)


def test_two_trainers_on_loopback_meet_with_the_same_weights_bit_for_bit(tmp_path, data_dir):
    """A real job: master and worker (multi_worker_mirrored on loopback, sync_every 5, 12 steps).
    Each trainer logs a digest of the weights after every meeting: the same digests on both, a
    meeting at every loop end (the one-step first loop, then steps 5, 10 and the last, 12), and
    the job's checkpoints are written at meeting steps only."""
    import re

    from loopback import PIPELINE, checkpoint_step, od_dist, tiny, write_cluster

    from od_dist.task import local_sgd

    cluster = write_cluster(tmp_path, ps=0, workers=1, strategy="multi_worker_mirrored")
    with open(cluster, "a") as f:
        f.write("sync_every: 5\n")
    model_dir = tmp_path / "run"
    done = od_dist(
        "launch",
        f"--cluster={cluster}",
        f"--pipeline={PIPELINE}",
        f"--model_dir={model_dir}",
        tiny(data_dir, steps=12),
        "--max_restarts=0",
        timeout=400,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "sync_every 5: the trainers step alone" in done.stdout, done.stdout[-3000:]
    # The lead says how much of the time the meetings took, measured on this job's links.
    assert re.search(
        r"od-dist train \| network: \d+% of the time in meetings \([\d.]+ s a meeting", done.stdout
    )
    met = re.compile(re.escape(local_sgd.MET) + r" (\d+): weights ([0-9a-f]{16})")
    logs = {name: (model_dir / "logs" / f"{name}.log").read_text() for name in ("master-0", "worker-0")}
    seen = {name: met.findall(text) for name, text in logs.items()}
    assert len(seen["master-0"]) == 4, logs["master-0"][-3000:]
    assert seen["master-0"] == seen["worker-0"], seen
    assert len({digest for _, digest in seen["master-0"]}) == 4, "each meeting moves the weights"
    assert checkpoint_step(str(model_dir)) == 12
    steps = sorted(int(p.name.split("-")[1].split(".")[0]) for p in model_dir.glob("ckpt-*.index"))
    assert steps and set(steps) <= {1, 5, 10, 12}, steps


STEP_SCRIPT = r"""
import json
import numpy as np
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import tf_keras
from od_dist.task import local_sgd

dist = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with dist.scope():
    w = tf.Variable([1.0, 2.0])
    optimizer = tf_keras.optimizers.legacy.SGD(0.1)
local_sgd.step_locally(dist, optimizer)

@tf.function
def step(x):
    def fn(x):
        with tf.GradientTape() as tape:
            # As Model Garden's tasks: the loss divided by the replicas in sync.
            loss = tf.reduce_sum(w * x) / dist.num_replicas_in_sync
        optimizer.apply_gradients([(tape.gradient(loss, w), w)])
    dist.run(fn, args=(x,))

inputs = dist.experimental_distribute_values_from_function(
    lambda ctx: tf.constant([1.0, 0.0]) if ctx.replica_id_in_sync_group == 0 else tf.constant([0.0, 3.0])
)
step(inputs)
print("RESULT " + json.dumps([c.numpy().tolist() for c in w.values]))
"""


def test_a_step_applies_each_replicas_own_gradient_unscaled():
    """step_locally: no all-reduce in a step; each replica's weights move by the learning rate
    times its own gradient (Model Garden's division of the loss by the replicas undone)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=REPO)
    done = subprocess.run(
        [sys.executable, "-c", STEP_SCRIPT], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    copies = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))[7:])
    np.testing.assert_allclose(copies[0], [1.0 - 0.1 * 1.0, 2.0], rtol=1e-6)
    np.testing.assert_allclose(copies[1], [1.0, 2.0 - 0.1 * 3.0], rtol=1e-6)


def test_the_network_share_and_the_advised_sync_every_by_hand():
    """A step of 0.75 s of which 0.5 s is the all-reduce of 2 MB, with 4 MB of weights (a meeting:
    1 s): 67% of a step; the compute is 0.25 s, so a meeting is at most a tenth of the time from
    H >= 1 x 0.9 / (0.1 x 0.25) = 36 steps."""
    from od_dist.task import network_share

    assert network_share.every_for(0.25, 1.0) == 36
    assert 1.0 / (36 * 0.25 + 1.0) <= 0.1 < 1.0 / (35 * 0.25 + 1.0)
    line = network_share.every_step_line(0.75, 0.5, 2_000_000, 4_000_000)
    assert line.startswith("od-dist train | network: 67% of a step (0.500 s to all-reduce 2.00 MB"), line
    assert "'sync_every: 36'" in line, line
    quiet = network_share.every_step_line(1.0, 0.2, 2_000_000, 4_000_000)
    assert "20% of a step" in quiet and "sync_every" not in quiet
    # Meetings of 3 s after loops of 25 steps of 2 s (0.08 s a step): 60%, advise 25 x ... by hand:
    # 3 x 0.9 / (0.1 x 0.08) = 337.5 -> 338.
    line = network_share.meeting_line(25, 2.0, 3.0)
    assert "60% of the time in meetings" in line and "raise sync_every to about 338" in line, line


def test_validate_explains_sync_every(tmp_path):
    from loopback import od_dist

    path = tmp_path / "c.yaml"
    path.write_text(
        "strategy: multi_worker_mirrored\nsync_every: 25\nouter_learning_rate: 0.7\nouter_momentum: 0.9\n"
        "master: 127.0.0.1:2222\nworker: [127.0.0.1:2223]\n"
    )
    done = od_dist("validate", f"--cluster={path}")
    assert done.returncode == 0, done.stderr
    assert (
        "sync_every: the trainers step alone on their own batches and meet every 25 steps: one all-reduce, "
        "then an outer Nesterov step on the average change (DiLoCo: learning rate 0.7, momentum 0.9); "
        "checkpoints are written after a meeting"
    ) in done.stdout, done.stdout
