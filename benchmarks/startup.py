"""Where a task's start-up goes: the demo trainer's start to its first step, a server's start to
ready, phase by phase, side by side with an older commit in the same run.

    .venv/bin/python benchmarks/startup.py [--rounds 3] [--against DIR ...] [--cases train,ps]

DIR: another checkout of od-dist (`git worktree add DIR COMMIT`, or `git archive COMMIT | tar -x
-C DIR`), as often as wanted; each case also runs on each one's code as CASE@NAME (NAME: the
folder's name), interleaved (the order rotates every round), so the load of a shared machine
falls on all alike. Cases:

  train   `od-dist train` of the demo pipeline (pipelines/shapes_retinanet.yaml) on generated
          shapes data, one machine, steps_per_loop 1: its first progress line is its first step
  ps      `od-dist train --role ps` of a parameter_server cluster on loopback: until it says
          `serving on` (its master never comes; it is killed then)
  end     the train case's 2 steps run to the end: from its `done at step` line to its exit (the
          process's teardown, which a restart or the next round waits for)

Per case, medians over the rounds: the wall time from the process's start to that line (seen on
its output; end: from that line to the exit), the CPU seconds the process tree had used by then
(steadier than wall time under load; end: after that line), and each phase line the task printed (od_dist/task/phases.py: seconds since its start and
of CPU by then; a commit older than those lines shows only the totals).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))
from loopback import PIPELINE, free_ports, shapes_data  # noqa: E402 (the tests' demo pipeline, free ports, data)

from od_dist.task.phases import LINE, SHOW_ENV  # noqa: E402 (the phase lines, as the tasks print them)

PY = sys.executable
READY = {"train": "od-dist train | step 1/", "ps": "serving on", "end": "od-dist train | done at step"}
MEASURED = {"end": "`done at step` to the exit"}  # what a case measures, if not its start to its line
CASES = tuple(READY)


def tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process and its descendants so far."""
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def argv_for(case: str, work: str, run_id: str, data: str) -> list[str]:
    if case in ("train", "end"):
        override = (
            "trainer.train_steps=2,trainer.steps_per_loop=1,trainer.summary_interval=1,"
            f"trainer.checkpoint_interval=100,task.train_data.input_path={data}/train.tfrecord,"
            f"task.validation_data.input_path={data}/val.tfrecord"
        )
        return [
            PY,
            "-m",
            "od_dist",
            "train",
            f"--pipeline={PIPELINE}",
            f"--model_dir={os.path.join(work, run_id)}",
            f"--params_override={override}",
        ]
    m, w, ps = free_ports(3)
    cluster = os.path.join(work, f"{run_id}.yaml")
    with open(cluster, "w", encoding="utf-8") as f:
        f.write(
            f"strategy: parameter_server\nmaster: 127.0.0.1:{m}\nworker: [127.0.0.1:{w}]\nps: [127.0.0.1:{ps}]\n"
        )
    return [
        PY,
        "-m",
        "od_dist",
        "train",
        f"--cluster={cluster}",
        "--role=ps",
        "--index=0",
        f"--pipeline={PIPELINE}",
        f"--model_dir={os.path.join(work, run_id)}",
        "--wait_timeout=120",
    ]


def run_case(case: str, work: str, run_id: str, data: str, code_dir: str, timeout: float) -> dict:
    """One start: {"ready_s", "cpu_s", "phases": {phase: (seconds since start, of CPU)}}, or
    {"failed": its log's tail}."""
    plain = case.split("@")[0]
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "PYTHONPATH")}
    env["PYTHONPATH"] = code_dir
    env[SHOW_ENV] = "1"  # the phase lines on the console, read below
    log_path = os.path.join(work, f"{run_id}.log")
    ready = threading.Event()
    result: dict = {"phases": {}}
    start = time.time()
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(
        argv_for(plain, work, run_id, data),
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )

    def read():
        with open(log_path, "w", encoding="utf-8") as log:
            for line in proc.stdout:
                log.write(line)
                m = LINE.search(line)
                if m:
                    phase = m["phase"].split(" at step")[0]
                    result["phases"].setdefault(phase, (float(m["since"]), float(m["cpu"])))
                if not ready.is_set() and READY[plain] in line:
                    result["ready_s"] = time.time() - start
                    result["cpu_s"] = tree_cpu(proc.pid)
                    ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        ready.wait(timeout)
        if plain == "end" and ready.is_set():
            line_at, cpu_at = result["ready_s"], result["cpu_s"]
            proc.wait(timeout)
            now = resource.getrusage(resource.RUSAGE_CHILDREN)  # the whole tree, reaped
            tree = sum(getattr(now, f) - getattr(reaped, f) for f in ("ru_utime", "ru_stime"))
            result["ready_s"], result["cpu_s"] = time.time() - start - line_at, tree - cpu_at
    except subprocess.TimeoutExpired:
        result.pop("ready_s", None)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing after the line is measured
        except ProcessLookupError:
            pass
        proc.wait()
        reader.join(10)
    if "ready_s" not in result:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            return {"failed": f.read()[-1500:]}
    return result


def median(values):
    return statistics.median(values) if values else None


def report(results: dict[str, list[dict]], checkouts: dict[str, str], loads) -> str:
    lines = []
    for plain in [c for c in CASES if c in results]:
        keys = [k for k in results if k.split("@")[0] == plain]
        phases: list[str] = []
        for k in keys:
            for r in results[k]:
                phases += [p for p in r.get("phases", {}) if p not in phases]
        head = f"| {plain}: wall / CPU (s) | {MEASURED.get(plain, f'start to `{READY[plain].strip()}`')} |"
        lines += [head + "".join(f" {p} |" for p in phases) + " runs ok |", "|---" * (3 + len(phases)) + "|"]
        totals = {}
        for k in keys:
            ok = [r for r in results[k] if "failed" not in r]
            totals[k] = (median([r["ready_s"] for r in ok]), median([r["cpu_s"] for r in ok]))
            cells = [totals[k]]
            for p in phases:
                got = [r["phases"][p] for r in ok if p in r["phases"]]
                cells.append((median([g[0] for g in got]), median([g[1] for g in got])))
            shown = [f"{w:.1f} / {c:.1f}" if w is not None else "-" for w, c in cells]
            lines.append(
                f"| {k} ({checkouts[k]}) | " + " | ".join(shown) + f" | {len(ok)}/{len(results[k])} |"
            )
        for k in keys[1:]:
            (w_new, c_new), (w_old, c_old) = totals[keys[0]], totals[k]
            if w_new and w_old:
                lines.append(
                    f"\n{plain}: this checkout {w_new / w_old:.2f}x the wall time of {k}, {c_new / c_old:.2f}x its CPU"
                )
        lines.append("")
    lines.append(
        "phases: seconds since the process started / CPU seconds of the process by then (od_dist/task/phases.py)"
    )
    lines.append(
        f"machine: {psutil.cpu_count()} cores; load average (1/5/15 min) before: {loads[0]}, after: {loads[1]}"
    )
    lines.append(f"command: python benchmarks/startup.py {' '.join(sys.argv[1:])}".rstrip())
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians over them)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    parser.add_argument(
        "--against",
        action="append",
        default=[],
        help="another od-dist checkout (repeatable): each case also runs on its code, interleaved",
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds before a start is given up")
    parser.add_argument("--keep", help="keep model_dirs and logs in this directory")
    args = parser.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    if any(c not in CASES for c in cases):
        parser.error(f"--cases: one of {', '.join(CASES)}")
    checkouts = {c: REPO for c in cases}
    for folder in map(os.path.abspath, args.against):
        if not os.path.isfile(os.path.join(folder, "od_dist", "__init__.py")):
            parser.error(f"--against: {folder}: not an od-dist checkout")
        checkouts.update({f"{c}@{os.path.basename(folder)}": folder for c in args.cases.split(",") if c})
    cases = list(checkouts)
    work = args.keep or tempfile.mkdtemp(prefix="od-dist-startup-")
    os.makedirs(work, exist_ok=True)
    loads = [tuple(round(x, 1) for x in os.getloadavg())]
    results: dict[str, list[dict]] = {c: [] for c in cases}
    try:
        data = shapes_data(work, PY)
        for r in range(args.rounds):
            for case in cases[r % len(cases) :] + cases[: r % len(cases)]:  # rotate: none always first
                result = run_case(case, work, f"r{r}-{case}", data, checkouts[case], args.timeout)
                results[case].append(result)
                if "failed" in result:
                    print(f"round {r + 1} {case}: FAILED\n{result['failed']}", flush=True)
                    continue
                print(
                    f"round {r + 1}/{args.rounds} {case:<9} ready {result['ready_s']:5.1f} s  CPU "
                    f"{result['cpu_s']:5.1f} s  "
                    + "  ".join(f"{p} {w:.1f}/{c:.1f}" for p, (w, c) in result["phases"].items()),
                    flush=True,
                )
        loads.append(tuple(round(x, 1) for x in os.getloadavg()))
        print()
        print(report(results, checkouts, loads))
        return 1 if any("failed" in r for rs in results.values() for r in rs) else 0
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
