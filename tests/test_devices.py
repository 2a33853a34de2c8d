"""Devices on a machine without a GPU (this one, CI's): a trainer whose cluster asks for GPUs refuses
at start in one line, and one that trains on the CPU says so on its console."""

import subprocess
import sys

import pytest
from loopback import PIPELINE, ROOT, clean_env, free_ports, od_dist, tiny


def test_a_trainer_whose_cluster_asks_for_gpus_it_lacks_refuses_in_one_line(tmp_path, data_dir):
    """num_clones 2 without --clone_on_cpu asks for 2 GPUs; TensorFlow sees none here."""
    (port,) = free_ports(1)
    cluster = tmp_path / "gpus.yaml"
    cluster.write_text(f"strategy: multi_worker_mirrored\nmaster: 127.0.0.1:{port}\nnum_clones: 2\n")
    model_dir = tmp_path / "model"
    r = od_dist(
        "train",
        f"--cluster={cluster}",
        "--role=master",
        f"--pipeline={PIPELINE}",
        f"--model_dir={model_dir}",
        tiny(data_dir, steps=1),
        env=clean_env(CUDA_VISIBLE_DEVICES=""),
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        "od-dist: num_clones 2 asks for 2 GPUs but TensorFlow sees none here; lower num_clones "
        "(--num_clones, or the cluster file's), on a GPU machine give TensorFlow CUDA's libraries "
        '(pip install -e ".[gpu]", README: GPU machines), or on one machine without --cluster add '
        "--clone_on_cpu"
    ], r.stderr
    assert "training with" not in r.stdout  # refused before its strategy: no step, no peer awaited


CPU_LINE = (
    'od-dist: training on the CPU: TensorFlow sees no GPU here (on a GPU machine: pip install -e ".[gpu]", '
    "README: GPU machines)"
)


@pytest.mark.slow  # trains a step
def test_a_trainer_on_the_cpu_says_so_on_its_console(tmp_path, data_dir):
    """The console (od-dist's own lines, the rest in the log file) shows it, before training; the
    log has the pools that TensorFlow's own variables sized (tf.config.threading reports 0 for them)."""
    r = od_dist(
        "train",
        f"--pipeline={PIPELINE}",
        f"--model_dir={tmp_path / 'model'}",
        tiny(data_dir, steps=1),
        env=clean_env(CUDA_VISIBLE_DEVICES="", TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="3"),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert CPU_LINE in lines, r.stdout
    # The threads line, a measurement, in the task's log only.
    assert not any(": threads " in line for line in lines), r.stdout
    with open(tmp_path / "model" / "logs" / "train.log") as f:
        logged = f.read().splitlines()
    assert any(
        line.startswith("single: threads intra-op 1, inter-op 3, tf.data default (") for line in logged
    ), logged
    started = next(i for i, line in enumerate(lines) if "training with" in line)
    assert lines.index(CPU_LINE) < started, r.stdout


def test_clones_on_cpu_and_one_replica_without_gpu():
    """--clone_on_cpu gives logical CPUs without a word; one replica falls back to the CPU and says
    so; more replicas than GPUs is refused (devices.configure, in a fresh process)."""
    code = "from od_dist.task import devices\nprint('cpus', devices.configure(2, True))\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0 and "cpus ['/cpu:0', '/cpu:1']" in r.stdout, r.stdout + r.stderr
    assert "training on the CPU" not in r.stdout
    code = (
        "from od_dist.task import devices\n"
        "print('one', devices.configure(1, False))\n"
        "try:\n"
        "    devices.configure(3, False)\n"
        "except devices.DeviceError as e:\n"
        "    print('refused:', e)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env=clean_env(CUDA_VISIBLE_DEVICES=""),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[:2] == [CPU_LINE, "one ['/cpu:0']"], r.stdout
    assert "refused: num_clones 3 asks for 3 GPUs but TensorFlow sees none here;" in r.stdout, r.stdout


def test_the_gpu_install_is_tensorflow_with_cuda_at_the_same_version():
    """The install that doctor and the trainers name is setup.cfg's extra `gpu`: TensorFlow with CUDA's
    libraries (its own extra `and-cuda`, which 2.20 has) at the version od-dist requires, on Linux
    (WSL2 included); the Dockerfile's GPU variant installs that extra."""
    import configparser
    import os

    from od_dist.task.devices import GPU_INSTALL

    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    requires = [x.strip() for x in cfg["options"]["install_requires"].splitlines()]
    (tensorflow,) = [x for x in requires if x.startswith("tensorflow~=")]
    gpu = [x.strip() for x in cfg["options.extras_require"]["gpu"].splitlines() if x.strip()]
    assert gpu == [f'tensorflow[and-cuda]{tensorflow[len("tensorflow") :]}; sys_platform == "linux"'], gpu
    assert GPU_INSTALL == 'pip install -e ".[gpu]"'
    docker = open(os.path.join(ROOT, "Dockerfile"), encoding="utf-8").read()
    assert "--build-arg EXTRAS=gpu" in docker and '.venv/bin/pip install -e ".[$EXTRAS]"' in docker
