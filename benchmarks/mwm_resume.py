"""A multi_worker_mirrored pair's start, phase by phase: the demo's `od-dist train` as master and
worker on loopback, each with a model_dir of its own and none of them holding a checkpoint, so the
resume sets both trainers' variables to the master's own initial values in the broadcast
(od_dist/task/controller.py, `_broadcast`), as every new group and every trainer on a new disk does.
On this checkout and on each `--against` checkout, interleaved (the order alternates every round).

    .venv/bin/python benchmarks/mwm_resume.py [--rounds 3] [--against DIR ...]

Prints, for each trainer of each pair, the CPU seconds of its phases (od_dist/task/phases.py) and
the medians per checkout: the model built, the resume (from the model built to `resumed`) and the
first loop (from `resumed` to `first loop`: the train step's trace and first step).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))
from loopback import PIPELINE, free_ports, shapes_data  # noqa: E402

from od_dist.task.phases import LINE, SHOW_ENV  # noqa: E402 (the phase lines, as the tasks print them)


def pair(code_dir: str, work: str, name: str, data: str) -> list[dict]:
    """The pair's two trainers' phases, {phase: CPU seconds by then}, master first."""
    folder = os.path.join(work, name)
    os.makedirs(folder)
    master, worker = free_ports(2)
    cluster = os.path.join(folder, "cluster.yaml")
    with open(cluster, "w", encoding="utf-8") as f:
        f.write(
            f"strategy: multi_worker_mirrored\nmaster: 127.0.0.1:{master}\nworker: [127.0.0.1:{worker}]\n"
        )
    override = (
        "trainer.train_steps=2,trainer.steps_per_loop=1,trainer.summary_interval=1,"
        f"trainer.checkpoint_interval=100,task.train_data.input_path={data}/train.tfrecord,"
        f"task.validation_data.input_path={data}/val.tfrecord"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "PYTHONPATH")}
    env["PYTHONPATH"] = code_dir
    env[SHOW_ENV] = "1"  # the phase lines on the console, read below
    procs = []
    for role in ("master", "worker"):
        argv = [
            sys.executable,
            "-m",
            "od_dist",
            "train",
            f"--cluster={cluster}",
            f"--role={role}",
            "--index=0",
        ]
        argv += [f"--pipeline={PIPELINE}", f"--model_dir={os.path.join(folder, role)}"]
        argv += [f"--params_override={override}", "--wait_timeout=120"]
        log = open(os.path.join(folder, f"{role}.log"), "w", encoding="utf-8")
        procs.append((subprocess.Popen(argv, env=env, cwd=folder, stdout=log, stderr=subprocess.STDOUT), log))
    phases = []
    for (proc, log), role in zip(procs, ("master", "worker")):
        code = proc.wait(timeout=600)
        log.close()
        with open(log.name, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if code != 0:
            raise SystemExit(f"{name} {role}: exit {code}\n{text[-2000:]}")
        found = {}
        for m in LINE.finditer(text):
            found.setdefault(m["phase"].split(" at step")[0], float(m["cpu"]))
        phases.append(found)
    return phases


def spans(phases: dict) -> dict:
    return {
        "model built": phases["model built"],
        "resume": phases["resumed"] - phases["model built"],
        "first loop": phases["first loop"] - phases["resumed"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--against", action="append", default=[], help="another od-dist checkout")
    args = parser.parse_args()
    codes = [("this checkout", REPO)] + [
        (os.path.basename(d.rstrip("/")), os.path.abspath(d)) for d in args.against
    ]
    seen: dict = {name: [] for name, _ in codes}
    loads = [os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="od-dist-mwm-resume-") as work:
        data = shapes_data(work)
        for r in range(args.rounds):
            for i, (name, code_dir) in enumerate(codes if r % 2 == 0 else codes[::-1]):
                for role, phases in zip(("master", "worker"), pair(code_dir, work, f"r{r}-{i}", data)):
                    seen[name].append(spans(phases))
                    shown = ", ".join(f"{k} {v:.1f}" for k, v in seen[name][-1].items())
                    print(f"round {r + 1}: {name} {role}: CPU seconds: {shown}", flush=True)
    loads.append(os.getloadavg())
    print(f"\nmedians over {args.rounds} pairs (both trainers), CPU seconds:")
    print("| code | model built | resume | first loop |\n|---|---|---|---|")
    for name, runs in seen.items():
        cells = [statistics.median(run[k] for run in runs) for k in ("model built", "resume", "first loop")]
        print(f"| {name} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    print("load average (1 min) before, after:", round(loads[0][0], 1), round(loads[1][0], 1))
    print("command: python benchmarks/mwm_resume.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
