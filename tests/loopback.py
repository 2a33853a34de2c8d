"""What the tests that run od-dist share (and the benchmark): the repository's paths, the
environment a task starts in, loopback clusters on free ports, a tiny training run's overrides and
the step of a model_dir's latest checkpoint. Fixtures (`data_dir`) are in conftest.py."""

import os
import re
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PIPELINE = os.path.join(ROOT, "pipelines", "shapes_retinanet.yaml")
# The demo's RetinaNet on 64x64 inputs, 2 images a step, where the model's size does not matter:
# a ResNet-10 backbone at a quarter of its width (0.36 M parameters, as small as the demo's) and a
# one-convolution head, which TensorFlow builds and traces faster than the demo's MobileNetV2 with
# two: a 10-step `od-dist train` took 13-16 s of CPU instead of 20 (2026-11-26, `time`).
SMALL = (
    "task.model.backbone.type=resnet,task.model.backbone.resnet.model_id=10,"
    "task.model.backbone.resnet.depth_multiplier=0.25,task.model.backbone.mobilenet=null,"
    "task.model.head.num_convs=1,"
    "task.model.input_size=[64,64,3],task.train_data.global_batch_size=2,"
    "task.validation_data.global_batch_size=2"
)
# A few steps, a checkpoint every loop: enough to prove the wiring, not to learn.
TINY = (
    "trainer.train_steps={steps},trainer.steps_per_loop=5,trainer.summary_interval=5,"
    "trainer.checkpoint_interval=5,"
    "task.train_data.input_path={data}/train.tfrecord,task.validation_data.input_path={data}/val.tfrecord,"
    + SMALL
)
# The COCO line `eval` prints, the one pattern the tests and benchmarks read it with (by name: step,
# AP, AP50, AP75).
COCO_LINE = re.compile(
    r"od-dist eval \| step (?P<step>\d+) \| AP (?P<AP>[\d.]+) \| AP50 (?P<AP50>[\d.]+)(?: \| AP75 (?P<AP75>[\d.]+))?"
)


def tiny(data_dir, steps=10):
    return "--params_override=" + TINY.format(steps=steps, data=data_dir)


def clean_env(**extra):
    """This process's environment without TF_CONFIG (a task takes its role from flags here), with
    `extra` (a None value removes that variable)."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


# On the tests' path before the installed packages (tests/conftest.py): tensorflow_text cannot be
# imported there, as on Windows, where it has no wheel; the whole suite runs without it.
WINDOWS_LIKE = os.path.join(ROOT, "tests", "windows_like")


def python_path(*folders):
    """PYTHONPATH for a child: `folders` first, then this process's own (WINDOWS_LIKE under pytest)."""
    return os.pathsep.join([*map(str, folders), *filter(None, [os.environ.get("PYTHONPATH")])])


def site_hook(tmp_path, source):
    """PYTHONPATH with a folder first whose sitecustomize.py (`source`) every Python process started
    with it runs first: a fault injected into the real child processes of a test."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(source)
    return python_path(hook)


def od_dist(*args, cwd=ROOT, timeout=180, env=None):
    """`python -m od_dist ARGS` run to its end as a user runs it (without TF_CONFIG; `env` added):
    its CompletedProcess, output as text. This checkout's od_dist, in any working directory and
    whichever checkout is installed."""
    return subprocess.run(
        [sys.executable, "-m", "od_dist", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=clean_env(**{"PYTHONPATH": python_path(ROOT), **(env or {})}),
        timeout=timeout,
    )


def run_cli(capsys, *args):
    """The command in this process, where TensorFlow is imported once (a process of its own pays
    its import each time): (code, out, err). For what a command does, not the console a user
    sees (TensorFlow's own lines go to the process's stderr, not to capsys)."""
    from od_dist import cli

    code = cli.main(["od-dist", *args])
    out, err = capsys.readouterr()
    return code, out, err


def checkpoint_step(model_dir):
    """The step of the latest complete checkpoint, from TensorFlow's `checkpoint` state file (no
    TensorFlow here); None without one."""
    try:
        with open(os.path.join(model_dir, "checkpoint")) as f:
            text = f.read()
    except OSError:
        return None
    m = re.search(r'^model_checkpoint_path: ".*ckpt-(\d+)"', text, re.M)
    return int(m.group(1)) if m else None


def free_ports(n):
    """n ports free on 127.0.0.1 now: all bound at once, so they differ, then released for the
    servers (a test retries if another program takes one in between)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def write_cluster(tmp_path, ps=1, workers=2, strategy=None, evaluator=False):
    """<tmp_path>/cluster.yaml: the master, `workers` workers and `ps` ps on free loopback ports."""
    ports = iter(free_ports(1 + workers + ps))
    lines = [f"strategy: {strategy}"] if strategy else []
    if evaluator:
        lines.append("evaluator: 127.0.0.1")
    lines.append(f"master: 127.0.0.1:{next(ports)}")
    lines.append("worker: [" + ", ".join(f"127.0.0.1:{next(ports)}" for _ in range(workers)) + "]")
    if ps:
        lines.append("ps: [" + ", ".join(f"127.0.0.1:{next(ports)}" for _ in range(ps)) + "]")
    path = tmp_path / "cluster.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def checkpoint_code(model_dir, step) -> str:
    """Python source that leaves checkpoint `step` in `model_dir` as TensorFlow's save does, without
    TensorFlow: its data shard, an index that ends as a table does, then the state file naming it
    (the step a supervisor or a feed reports is of a checkpoint whole on disk: protocol/lineage.py)."""
    from od_dist.protocol import lineage

    folder, prefix = str(model_dir), f"ckpt-{step}"
    state = f'model_checkpoint_path: "{prefix}"\nall_model_checkpoint_paths: "{prefix}"\n'
    index = b"index %d" % int(step) + bytes(48) + lineage.TABLE_MAGIC
    return (
        "import os\n"
        f"os.makedirs({folder!r}, exist_ok=True)\n"
        f"open(os.path.join({folder!r}, {prefix + '.data-00000-of-00001'!r}), 'wb').write(b'weights' * 100)\n"
        f"open(os.path.join({folder!r}, {prefix + '.index'!r}), 'wb').write({index!r})\n"
        f"open(os.path.join({folder!r}, 'checkpoint'), 'w').write({state!r})\n"
    )


def write_checkpoint(model_dir, step) -> None:
    """checkpoint_code, run here."""
    exec(checkpoint_code(model_dir, step), {})


def shapes_data(folder, python=sys.executable) -> str:
    """The benchmarks' small shapes dataset (64 training images, 8 validation) in `folder`/data,
    written by this checkout's `od-dist data shapes`; returns that folder."""
    data = os.path.join(folder, "data")
    subprocess.run(
        [python, "-m", "od_dist", "data", "shapes", f"--out={data}", "--num_train=64", "--num_val=8"],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return data
