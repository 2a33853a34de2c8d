"""Does a start-up lever change what trains? The demo's loss, step by step, at the same seed, on
this checkout and on others, side by side.

    .venv/bin/python benchmarks/same_training.py [--steps 20] [--against DIR ...] [--env NAME=VALUE ...]

Each run: `od-dist train` of the demo pipeline on the same generated shapes data, steps_per_loop 1
(a progress line, and its loss, every step), in a process whose Python, NumPy and TensorFlow
seeds are set before od-dist starts: the same initial weights and the same order of the data.
Runs: this checkout twice (what the machine's own arithmetic varies: TensorFlow's multi-threaded
kernels may add in another order), each --against checkout, and this checkout with each --env
(e.g. TF_USE_LEGACY_KERAS=0: what a lever that is an environment variable changes). Prints every
run's losses and the largest difference of each from the first run.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
from loopback import PIPELINE, shapes_data  # noqa: E402 (the demo pipeline, its data)

PY = sys.executable
LOSS = re.compile(r"od-dist train \| step (\d+)/\d+ .*?\| loss ([\d.]+)")
SEEDED = """
import os, random, sys
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # as od_dist.cli.run, before TensorFlow
import numpy as np
import tensorflow as tf
random.seed(0)
np.random.seed(0)
tf.random.set_seed(0)
from od_dist import cli
sys.exit(cli.main(["od-dist", *sys.argv[1:]]))
"""


def losses(code_dir: str, env_extra: dict, work: str, name: str, data: str, steps: int) -> list[float]:
    override = (
        f"trainer.train_steps={steps},trainer.steps_per_loop=1,trainer.summary_interval={steps},"
        f"trainer.checkpoint_interval={steps},task.train_data.input_path={data}/train.tfrecord,"
        f"task.validation_data.input_path={data}/val.tfrecord"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "PYTHONPATH")}
    env.update(env_extra, PYTHONPATH=code_dir, TF_CPP_MIN_LOG_LEVEL="2")
    argv = [
        PY,
        "-c",
        SEEDED,
        "train",
        f"--pipeline={PIPELINE}",
        f"--model_dir={os.path.join(work, name)}",
        f"--params_override={override}",
    ]
    out = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=900).stdout
    got = [float(loss) for _, loss in LOSS.findall(out)]
    if len(got) != steps:
        raise SystemExit(f"{name}: {len(got)} of {steps} losses; its output:\n{out[-2000:]}")
    return got


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--against", action="append", default=[], help="another od-dist checkout")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE: this checkout with it")
    args = parser.parse_args()
    runs = [("this checkout", REPO, {}), ("this checkout, again", REPO, {})]
    runs += [(os.path.basename(os.path.abspath(d)), os.path.abspath(d), {}) for d in args.against]
    runs += [(f"this checkout, {e}", REPO, dict([e.split("=", 1)])) for e in args.env]
    with tempfile.TemporaryDirectory(prefix="od-dist-same-") as work:
        data = shapes_data(work, PY)
        curves = {}
        for i, (name, code_dir, env) in enumerate(runs):
            curves[name] = losses(code_dir, env, work, f"run{i}", data, args.steps)
            print(f"{name}: {' '.join(f'{v:.4f}' for v in curves[name])}", flush=True)
    first = curves[runs[0][0]]
    print(f"\nlargest |loss - {runs[0][0]}'s| over {args.steps} steps (losses printed to 4 decimals):")
    for name, curve in curves.items():
        print(f"  {name:<40} {max(abs(a - b) for a, b in zip(curve, first)):.4f}")
    print(f"command: python benchmarks/same_training.py {' '.join(sys.argv[1:])}".rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
