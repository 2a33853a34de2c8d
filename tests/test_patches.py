"""od_dist/patches/: a library whose private attribute a patch needs is gone (as after an upgrade)
ends a real `od-dist train` at its start, in one line naming the patch and the installed version;
so does each attribute a library sets on its instances, renamed on a real instance, where the patch
first reads it."""

import glob
import os
import subprocess
import sys

import pytest
from loopback import PIPELINE, ROOT, clean_env, free_ports, od_dist, python_path, site_hook, tiny

# Injected into the real `od-dist train` process: Orbit as if a release had renamed the method the
# training loop's hook overrides.
WITHOUT_TRAIN_N_STEPS = """
import orbit

del orbit.Controller._train_n_steps
"""
# ... as if it had renamed the attribute orbit.Controller sets on itself for its saves' options.
CHECKPOINT_OPTIONS_RENAMED = """
import orbit

made = orbit.Controller.__init__


def renaming(self, *args, **kwargs):
    made(self, *args, **kwargs)
    self._save_options = self.__dict__.pop("_checkpoint_options")


orbit.Controller.__init__ = renaming
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "hook, patch, need",
    [
        (WITHOUT_TRAIN_N_STEPS, "orbit-train-loop", "orbit.Controller._train_n_steps"),
        (CHECKPOINT_OPTIONS_RENAMED, "orbit-save-now", "orbit.Controller._checkpoint_options"),
    ],
    ids=["class", "instance"],
)
def test_a_missing_private_attribute_ends_the_task_at_its_start_in_one_line(
    data_dir, tmp_path, hook, patch, need
):
    from importlib.metadata import version

    model_dir = tmp_path / "run"
    env = {"PYTHONPATH": site_hook(tmp_path, hook) + os.pathsep + ROOT}
    r = od_dist("train", f"--pipeline={PIPELINE}", f"--model_dir={model_dir}", tiny(data_dir), env=env)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("od-dist: ")]
    assert line.startswith(f"od-dist: patch '{patch}' needs {need}, "), line
    assert (
        f"missing in tf-models-official {version('tf-models-official')} (written against 2.20.0)" in line
    ), line
    assert line.endswith("exit 2"), line
    # Before training: no step, no checkpoint.
    assert "od-dist train | step" not in r.stdout, r.stdout[-2000:]
    assert not glob.glob(str(model_dir / "ckpt-*")), os.listdir(model_dir)


# Each attribute a patch reads or sets on a library's instance, on a real instance, then renamed
# (deleted from that instance) one at a time: the patch's function ends the task with the line.
HELD = """
import contextlib
import io
import os
import tempfile

os.environ["TF_USE_LEGACY_KERAS"] = "1"
import orbit
import tensorflow as tf
import tf_keras
from official.core import base_trainer
from official.modeling.optimization import ExponentialMovingAverage
from tensorflow.python.distribute import values

from od_dist import patches


def ended(name, call):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            call()
    except SystemExit as e:
        print(f"{name} | exit {e.code} | {err.getvalue().strip()}", flush=True)
    else:
        print(f"{name} | no exit", flush=True)


class NoTrainer(orbit.AbstractTrainer):
    def train(self, num_steps):
        return {}


class NoSteps(orbit.StandardTrainer):
    def train_step(self, iterator):
        pass


def controller():
    step = tf.Variable(0, dtype=tf.int64)
    manager = tf.train.CheckpointManager(
        tf.train.Checkpoint(step=step), tempfile.mkdtemp(), 1, step_counter=step, checkpoint_interval=5
    )
    return orbit.Controller(trainer=NoTrainer(), global_step=step, steps_per_loop=1, checkpoint_manager=manager)


# The instances as the libraries make them: every patch reads what it needs.
patches.orbit.check_controller(controller())
sgd = tf_keras.optimizers.legacy.SGD(1.0)
assert patches.model_garden.inner_optimizer(ExponentialMovingAverage(sgd)) is sgd
assert patches.model_garden.inner_optimizer(sgd) is None
trainer = object.__new__(base_trainer.Trainer)
trainer._strategy = tf.distribute.get_strategy()
trainer.init_async()  # where Model Garden's Trainer sets _is_async
assert patches.model_garden.is_async(trainer) is False
standard = NoSteps(train_dataset=tf.data.Dataset.range(1))
patches.orbit.check_train_iterator(standard)
patches.orbit.fresh_train_iterators(standard)
assert standard._train_iter is None
dist = tf.distribute.MultiWorkerMirroredStrategy()
patches.tensorflow.merge_communication_options(dist, tf.distribute.experimental.CommunicationOptions(bytes_per_pack=8))
assert dist.extended._communication_options.bytes_per_pack == 8
print("as made | passed", flush=True)

c = controller()
del c._checkpoint_options
ended("orbit-save-now", lambda: patches.orbit.check_controller(c))
ended("orbit-save-now", lambda: patches.orbit.save_now(c, 0))
ended("orbit-save-now", lambda: patches.orbit.save_io_on(c, "/job:localhost/device:CPU:0"))
c = controller()
del c.checkpoint_manager._last_checkpoint_step
ended("checkpoint-next-save", lambda: patches.orbit.check_controller(c))
ended("checkpoint-next-save", lambda: patches.tensorflow.count_saves_from(c.checkpoint_manager, 5))
ema = ExponentialMovingAverage(sgd)
del ema._optimizer
ended("moving-average-inner", lambda: patches.model_garden.inner_optimizer(ema))
del trainer._is_async
ended("trainer-is-async", lambda: patches.model_garden.is_async(trainer))
del standard._train_iter
ended("orbit-train-iterator", lambda: patches.orbit.fresh_train_iterators(standard))
del dist.extended._communication_options
options = tf.distribute.experimental.CommunicationOptions()
ended("communication-options", lambda: patches.tensorflow.merge_communication_options(dist, options))
for cls in values.DistributedVariable, values.DistributedValues:  # a method: check() sees its class
    del cls._get_on_device_or_primary
ended("sync-on-read-reads", patches.check)
"""

# A ParameterServerStrategy needs its servers: two in the same process, on free loopback ports.
HELD_PS = """
import contextlib
import io

import tensorflow as tf

from od_dist import patches

chief, worker, ps = (f"127.0.0.1:{port}" for port in PORTS)
spec = tf.train.ClusterSpec({"chief": [chief], "worker": [worker], "ps": [ps]})
for job in ("worker", "ps"):
    tf.distribute.Server(spec, job_name=job, task_index=0, protocol="grpc", start=True)
resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
    spec, task_type="chief", task_id=0, rpc_layer="grpc"
)
dist = tf.distribute.experimental.ParameterServerStrategy(resolver)
assert patches.tensorflow.cluster_resolver(dist) is resolver
print("as made | passed", flush=True)
del dist._cluster_resolver
err = io.StringIO()
try:
    with contextlib.redirect_stderr(err):
        patches.tensorflow.cluster_resolver(dist)
except SystemExit as e:
    print(f"strategy-resolver | exit {e.code} | {err.getvalue().strip()}", flush=True)
"""

NEEDS = {
    "orbit-save-now": "orbit.Controller._checkpoint_options",
    "checkpoint-next-save": "tensorflow.train.CheckpointManager._last_checkpoint_step",
    "moving-average-inner": "official.modeling.optimization.ExponentialMovingAverage._optimizer",
    "trainer-is-async": "official.core.base_trainer.Trainer._is_async",
    "orbit-train-iterator": "orbit.StandardTrainer._train_iter",
    "communication-options": "tensorflow.python.distribute.collective_all_reduce_strategy."
    "CollectiveAllReduceExtended._communication_options",
    "sync-on-read-reads": "tensorflow.python.distribute.values.SyncOnReadVariable._get_on_device_or_primary",
    "strategy-resolver": "tensorflow.distribute.experimental.ParameterServerStrategy._cluster_resolver",
}


def _cases(source):
    r = subprocess.run(
        [sys.executable, "-c", source],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=clean_env(PYTHONPATH=python_path(ROOT)),
        timeout=120,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return [line.split(" | ") for line in r.stdout.splitlines() if " | " in line]


def _assert_each_ends(cases, names):
    assert cases[0] == ["as made", "passed"], cases
    assert sorted({name for name, *_ in cases[1:]}) == sorted(names), cases
    for name, code, line in cases[1:]:
        assert code == "exit 2", (name, code, line)
        assert line.startswith(f"od-dist: patch '{name}' needs {NEEDS[name]}, missing in "), line
        assert line.endswith("or update od_dist/patches/; exit 2"), line


def test_each_attribute_a_patch_reads_on_an_instance_renamed_ends_the_task_in_one_line():
    cases = _cases(HELD)
    assert len(cases) == 1 + 10, cases
    _assert_each_ends(cases, set(NEEDS) - {"strategy-resolver"})


@pytest.mark.slow
def test_a_parameter_server_strategy_without_its_resolver_ends_the_task_in_one_line():
    _assert_each_ends(_cases(f"PORTS = {free_ports(3)}\n" + HELD_PS), {"strategy-resolver"})


def _in_a_task_s_python(tmp_path, code):
    """`code` run in a child with a task's environment for TensorFlow's import (tf_keras as Keras),
    from a file (autograph reads a function's source)."""
    (tmp_path / "child.py").write_text(code)
    return subprocess.run(
        [sys.executable, str(tmp_path / "child.py")],
        capture_output=True,
        text=True,
        env=clean_env(TF_USE_LEGACY_KERAS="1", PYTHONPATH=python_path(ROOT)),
        timeout=120,
    )


def test_a_tasks_imports_leave_out_what_no_task_uses_which_stays_importable(tmp_path):
    # keras-without-pandas, tensorflow-without-gce: tf_keras (loaded by TensorFlow under
    # TF_USE_LEGACY_KERAS) takes pandas for absent, TensorFlow's GCE resolver the Google API client.
    # model-garden-deferred: Model Garden's pyplot and tensorflow_datasets are not run at its import
    # (a module's namespace holds only the import system's names) nor at a trace by autograph, which
    # reads every module's __file__; each is loaded at its first name. Any other module may import
    # each of them.
    code = (
        "import sys\n"
        "from od_dist import patches\n"
        "patches.imports.import_tensorflow()\n"
        "from tf_keras.src.engine import data_adapter\n"
        "from tensorflow.python.distribute.cluster_resolver import gce_cluster_resolver as gce\n"
        "assert 'pandas' not in sys.modules and 'googleapiclient' not in sys.modules\n"
        "assert data_adapter.pd is None and gce._GOOGLE_API_CLIENT_INSTALLED is False\n"
        "patches.check()  # as a task's start: imports the modules Model Garden's patches need\n"
        "from od_dist.model import pipeline\n"
        "pipeline.import_model_garden()\n"
        "import tensorflow as tf\n"
        "def plus_one(x):\n"
        "    return x + 1 if x > 0 else x\n"
        "assert int(tf.function(plus_one)(tf.constant(1))) == 2  # autograph converts it\n"
        "def unrun(name):\n"
        "    return all(k.startswith('__') for k in sys.modules[name].__dict__)\n"
        "assert all(unrun(name) for name in patches.imports.DEFERRED), 'run at import'\n"
        "from official.vision.utils.object_detection import visualization_utils\n"
        "figure = visualization_utils.plt.figure(frameon=False)  # its first name: now loaded\n"
        "import matplotlib.pyplot as plt\n"
        "import tensorflow_datasets as tfds\n"
        "assert plt.gcf() is figure and not unrun('matplotlib.pyplot') and tfds.builder and not unrun('tensorflow_datasets')\n"
        "import googleapiclient.discovery\n"
        "import pandas\n"
        "print('ok', pandas.DataFrame({'a': [1]}).shape)\n"
    )
    r = _in_a_task_s_python(tmp_path, code)
    assert r.returncode == 0 and r.stdout.strip() == "ok (1, 1)", r.stdout[-2000:] + r.stderr[-2000:]


def test_a_server_imports_tensorflow_without_keras_and_serves(tmp_path):
    # A ps or worker server runs the functions its coordinator sends, no Python model code: its
    # import leaves Keras out (1 s of CPU of every server's start), and Keras stays importable.
    (port,) = free_ports(1)
    code = (
        "import sys\n"
        "from od_dist import patches\n"
        "patches.imports.import_tensorflow(keras=False)\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('tf_keras', 'keras')], 'keras loaded'\n"
        "import tensorflow as tf\n"
        f"spec = tf.train.ClusterSpec({{'ps': ['127.0.0.1:{port}']}})\n"
        "server = tf.distribute.Server(spec, job_name='ps', task_index=0, protocol='grpc', start=True)\n"
        "import tf_keras\n"
        "print('ok', server.target)\n"
    )
    r = _in_a_task_s_python(tmp_path, code)
    assert r.returncode == 0 and r.stdout.strip() == f"ok grpc://127.0.0.1:{port}", (
        r.stdout[-2000:] + r.stderr[-2000:]
    )
