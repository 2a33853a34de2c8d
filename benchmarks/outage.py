"""What a short network outage does to a multi_worker_mirrored job, on simulated machines.

    sudo .venv/bin/python benchmarks/outage.py [--outages 5,15,45] [--lost_peer_timeout 3600]
        [--steps 400] [--steps_per_loop 25] [--keep DIR]

A master and a worker, each on its own machine (a network namespace, tests/netns.py), train the
demo (pipelines/shapes_retinanet.yaml, generated shapes data). Once the master has printed a
step, the worker's port on the switch (the bridge) goes down for each outage's seconds, then comes
back: a switch restarting or a cable pulled and plugged in again. Per outage: whether training went
on after it (progress lines after the link came back), each task's exit status and last line, and
the seconds from the cut to each exit.

`--lost_peer_timeout` is passed to both trainers: a large value (the default, 3600) leaves the
outage to TensorFlow alone (what its collectives and coordination service tolerate); od-dist's
default shows what a user gets.

Needs root (namespaces); says why and exits 0 otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
import netns  # noqa: E402 (the tests' simulated machines)
from ctrl_c import small_data  # noqa: E402 (benchmarks/: this script's folder)

PIPELINE = os.path.join(REPO, "pipelines", "shapes_retinanet.yaml")
PY = sys.executable
PORT = 2222
STEP = re.compile(r"od-dist train \| step (\d+)/")


def set_port(net, i: int, up: bool) -> None:
    """Machine i's port on the switch, down or up (its own interface keeps its address)."""
    subprocess.run(
        ["ip", "-n", net.hub, "link", "set", f"p{i}", "up" if up else "down"], check=True, timeout=30
    )


def steps_in(path: str) -> list[int]:
    try:
        return [int(s) for s in STEP.findall(open(path, errors="replace").read())]
    except FileNotFoundError:
        return []


def last_line(path: str) -> str:
    lines = [x for x in open(path, errors="replace").read().splitlines() if x.strip()]
    return lines[-1][-300:] if lines else ""


def run_outage(seconds: float, args, work: str, data_dir: str) -> dict:
    cdir = os.path.join(work, f"outage-{seconds:g}s")
    os.makedirs(cdir)
    net = netns.Network(2)
    procs = {}
    logs = {}
    try:
        cluster = os.path.join(cdir, "cluster.yaml")
        with open(cluster, "w") as f:
            f.write(f"master: {net[0].ip}:{PORT}\nworker: [{net[1].ip}:{PORT}]\n")
        override = ",".join(
            [
                f"trainer.train_steps={args.steps}",
                f"trainer.steps_per_loop={args.steps_per_loop}",
                f"trainer.summary_interval={args.steps_per_loop}",
                f"trainer.checkpoint_interval={args.steps_per_loop * 4}",
                f"task.train_data.input_path={data_dir}/train.tfrecord",
                f"task.validation_data.input_path={data_dir}/val.tfrecord",
            ]
        )
        for i, role in enumerate(("master", "worker")):
            logs[role] = os.path.join(cdir, f"{role}.log")
            argv = [PY, "-m", "od_dist", "train", f"--cluster={cluster}", f"--role={role}", "--index=0"]
            argv += [f"--pipeline={PIPELINE}", f"--model_dir={os.path.join(cdir, 'model')}"]
            argv += [f"--params_override={override}", f"--lost_peer_timeout={args.lost_peer_timeout}"]
            with open(logs[role], "w") as log:
                procs[role] = net[i].popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=cdir)
        deadline = time.monotonic() + args.timeout
        while not steps_in(logs["master"]) and time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs.values()):
                break
            time.sleep(0.5)
        before = steps_in(logs["master"])
        cut = time.monotonic()
        set_port(net, 1, up=False)
        time.sleep(seconds)
        set_port(net, 1, up=True)
        back = time.monotonic()
        exited_at = {}
        while time.monotonic() < deadline and len(exited_at) < len(procs):
            for role, p in procs.items():
                if role not in exited_at and p.poll() is not None:
                    exited_at[role] = time.monotonic() - cut
            time.sleep(0.2)
        after = steps_in(logs["master"])
        return {
            "outage_s": seconds,
            "steps_before": max(before or [0]),
            "trained_after": max(after or [0]) > max(before or [0]) and len(after) > len(before),
            "last_step": max(after or [0]),
            "back_at_s": back - cut,
            "codes": {r: p.poll() for r, p in procs.items()},
            "exited_at_s": exited_at,
            "last_lines": {r: last_line(path) for r, path in logs.items()},
        }
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        net.close()


def simulated_work(prefix: str, keep: str | None, num_val: int = 8) -> tuple[str, str] | None:
    """A run's folder (`keep`, else a new one) and the shapes records in it, where simulated
    machines can be made; else None, said why."""
    why = netns.unavailable() if os.geteuid() == 0 else "simulated machines need root (namespaces)"
    if why:
        print(f"skipped: {why}")
        return None
    netns.remove_stale()
    work = keep or tempfile.mkdtemp(prefix=prefix)
    os.makedirs(work, exist_ok=True)
    return work, small_data(work, num_val)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--outages", default="5,15,45", help="seconds the link is down, comma-separated")
    parser.add_argument("--lost_peer_timeout", type=int, default=3600)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--steps_per_loop", type=int, default=25)
    parser.add_argument("--timeout", type=float, default=900, help="seconds one outage's run may take")
    parser.add_argument("--keep", help="keep logs and models in this directory")
    args = parser.parse_args(argv)
    prepared = simulated_work("od-dist-outage-", args.keep)
    if not prepared:
        return 0
    work, data_dir = prepared
    print(f"--lost_peer_timeout {args.lost_peer_timeout}; logs in {work}", flush=True)
    for seconds in (float(s) for s in args.outages.split(",")):
        r = run_outage(seconds, args, work, data_dir)
        print(
            f"outage {r['outage_s']:g} s at step {r['steps_before']}: "
            f"{'training went on' if r['trained_after'] else 'training did not go on'} "
            f"(last step {r['last_step']}); exits {r['codes']} at "
            + ", ".join(f"{k} {v:.0f} s" for k, v in r["exited_at_s"].items())
            + " after the cut",
            flush=True,
        )
        for role, line in r["last_lines"].items():
            print(f"  {role}: {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
