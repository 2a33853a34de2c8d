"""What a multi_worker_mirrored trainer adds to start-up: the demo model built under
MultiWorkerMirroredStrategy by a pair of processes on loopback, then as many plain variables,
against one process under MirroredStrategy. Each process is pinned to a core of its own with one
intra-op thread, so the pair and the single process get the same CPU.

    .venv/bin/python benchmarks/mwm_startup.py

MultiWorkerMirroredStrategy broadcasts each variable's initial value from the chief in a
collective of its own; the plain variables show that cost apart from the model's build.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
from loopback import PIPELINE, free_ports  # noqa: E402 (the tests' demo pipeline and free ports)


def child(multi_worker: bool) -> None:
    import tensorflow as tf
    from official.core import task_factory

    from od_dist.model import pipeline

    params = pipeline.load_pipeline(PIPELINE, None, "mirrored")
    dist = tf.distribute.MultiWorkerMirroredStrategy() if multi_worker else tf.distribute.MirroredStrategy()
    task = task_factory.get_task(params.task)
    start = time.perf_counter()
    with dist.scope():
        model = task.build_model()
    built = time.perf_counter()
    with dist.scope():
        for _ in model.variables:
            tf.Variable(tf.zeros([64]))
    done = time.perf_counter()
    print(json.dumps({"variables": len(model.variables), "model_s": built - start, "plain_s": done - built}))


def run(cores: list[int], tf_config: list[str | None]) -> list[dict]:
    procs = []
    for core, config in zip(cores, tf_config):
        env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
        env.update(TF_USE_LEGACY_KERAS="1", TF_NUM_INTRAOP_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3")
        if config:
            env["TF_CONFIG"] = config
        argv = ["taskset", "-c", str(core), sys.executable, __file__, "--child", "mwm" if config else "one"]
        procs.append(subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.PIPE, text=True))
    return [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2] == "mwm")
        return 0
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        print("skipped: needs 2 cores (one per process of the pair)")
        return 0
    workers = [f"127.0.0.1:{port}" for port in free_ports(2)]
    configs = [
        json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}) for i in range(2)
    ]
    rows = [("one process (MirroredStrategy)", r) for r in run(cores[:1], [None])]
    rows += [
        (f"pair, task {i} (MultiWorkerMirroredStrategy)", r) for i, r in enumerate(run(cores[:2], configs))
    ]
    print(f"{'':<46} {'model build':>11} {'plain variables':>16}")
    for name, r in rows:
        print(f"{name:<46} {r['model_s']:>10.2f}s {r['plain_s']:>7.2f}s ({r['variables']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
