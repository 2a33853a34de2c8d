"""Ctrl+C on one machine of a job whose machines each run `od-dist train --max_restarts 3` (as
the generated scripts do): how long until every machine's od-dist has ended, and with what status.

    python benchmarks/ctrl_c.py [--strategy multi_worker_mirrored|parameter_server] [--stop ROLE]
        [--keep DIR]

Each task of a loopback cluster is started as its machine's script starts it, in a process group
of its own (its own terminal); once the master has printed a step, SIGINT goes to the process
group of the task named by --stop (Ctrl+C in that terminal). Demo pipeline, generated shapes data.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
ROLES = {"multi_worker_mirrored": ("master", "worker"), "parameter_server": ("ps", "worker", "master")}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def small_data(work: str, num_val: int = 8) -> str:
    """The shapes records a short run trains on, written under `work`; returns their folder."""
    data = os.path.join(work, "data")
    subprocess.run(
        [PY, "-m", "od_dist", "data", "shapes", f"--out={data}", "--num_train=200", f"--num_val={num_val}"],
        cwd=REPO,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return data


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", choices=sorted(ROLES), default="multi_worker_mirrored")
    parser.add_argument("--stop", default="master", help="the role whose machine gets Ctrl+C")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds to wait for every od-dist")
    parser.add_argument("--keep", help="keep logs and model here")
    args = parser.parse_args(argv)
    roles = ROLES[args.strategy]
    if args.stop not in roles:
        parser.error(f"--stop: {args.stop!r}: one of {', '.join(roles)} under {args.strategy}")
    work = args.keep or tempfile.mkdtemp(prefix="od-dist-ctrl-c-")
    os.makedirs(work, exist_ok=True)
    data = small_data(work)
    cluster = os.path.join(work, "cluster.yaml")
    with open(cluster, "w") as f:
        for role in roles:
            address = f"127.0.0.1:{free_port()}"
            f.write(f"{role}: {address}\n" if role == "master" else f"{role}: [{address}]\n")
    override = (
        "trainer.train_steps=100000,trainer.steps_per_loop=25,trainer.summary_interval=25,"
        f"trainer.checkpoint_interval=1000,task.train_data.input_path={data}/train.tfrecord,"
        f"task.validation_data.input_path={data}/val.tfrecord"
    )
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    procs, logs = {}, {}
    try:
        for role in roles:
            logs[role] = os.path.join(work, f"{role}.log")
            argv = [PY, "-m", "od_dist", "train", f"--cluster={cluster}", f"--role={role}", "--index=0"]
            argv += [f"--pipeline={REPO}/pipelines/shapes_retinanet.yaml", f"--model_dir={work}/model"]
            argv += [f"--params_override={override}", "--max_restarts=3"]
            with open(logs[role], "w") as log:
                procs[role] = subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, cwd=work, env=env, start_new_session=True
                )
        deadline = time.monotonic() + 600
        while "od-dist train | step" not in open(logs["master"]).read():
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs.values()):
                print(f"no training; logs in {work}")
                return 1
            time.sleep(0.5)
        os.killpg(procs[args.stop].pid, signal.SIGINT)  # Ctrl+C in that machine's terminal
        sent = time.monotonic()
        ended = {}
        while len(ended) < len(procs) and time.monotonic() - sent < args.timeout:
            for role, p in procs.items():
                if role not in ended and p.poll() is not None:
                    ended[role] = (p.returncode, time.monotonic() - sent)
            time.sleep(0.2)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    print(f"{args.strategy}: Ctrl+C on the {args.stop}'s machine; logs in {work}")
    for role in roles:
        code, t = ended.get(role, (None, None))
        print(
            f"  {role}'s od-dist: "
            + (f"exit {code}, {t:.1f} s after Ctrl+C" if code is not None else "still running: killed")
        )
        lines = [x for x in open(logs[role], errors="replace").read().splitlines() if x.strip()]
        for line in lines[-2:]:
            print(f"    {line[:300]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
