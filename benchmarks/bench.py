"""od-dist's benchmark suite: its overhead and its distributed modes, side by side, in one go.

    python benchmarks/bench.py [--rounds 3] [--steps 200] [--steps_per_loop 50] [--before]

Runs the demo pipeline (pipelines/shapes_retinanet.yaml) on a generated shapes dataset, each case
once per round, interleaved (the order rotates every round), so that the load of the machine
falls on every case alike. Cases:

  raw          python -m official.vision.train on the same experiment config (mirrored)
  train        od-dist train, one process
  ps           od-dist launch on a loopback cluster shaped like clusters/local.yaml (1 ps, the
               master and 2 workers, parameter_server)
  mwm          od-dist launch on a loopback master + 1 worker (multi_worker_mirrored)
  ps-tfdef,    the same two with TensorFlow's default thread pools in every task
  mwm-tfdef    (--intra_op_threads=0 --inter_op_threads=0 --data_threads=0): the "before"; --before
  train-1t     one od-dist train process with --intra_op_threads=1 (what a computing task of a
               two-task machine gets); --before
  cli          `od-dist validate`, `od-dist --help` and a bare interpreter, --cli_runs times a round

With --against DIR (another checkout: `git worktree add DIR COMMIT`), every od-dist case also runs
on DIR's code as CASE@old, in the same rounds, and the table says how each compares.

Per case: steady steps/s (the median of Model Garden's `steps_per_second` summaries in
<model_dir>/train, the first two loops left out: tracing, and the first checkpoint), the time from
process start to the first finished step (the first summary's wall time minus the rest of the
first loop at the steady rate), the wall time, the peak RSS and CPU seconds of each process
(psutil, sampled every 0.2 s), and where the steady loops' CPU goes: milliseconds of CPU per
training step, by process (unlike wall-clock rates, it changes little when other jobs load the
machine). Every step is one global batch (8 images) in every case, so steps/s compare as
examples/s. Prints medians over the rounds and the ratios: train vs raw, and each cluster vs one
`od-dist train` process on the same cores.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time

import psutil
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
from loopback import free_ports  # noqa: E402 (the tests' loopback helpers)

PIPELINE = os.path.join(REPO, "pipelines", "shapes_retinanet.yaml")
PY = sys.executable
TF_DEFAULT_THREADS = ["--intra_op_threads=0", "--inter_op_threads=0", "--data_threads=0"]
TRAIN_CASES = ("raw", "train", "ps", "mwm")
BEFORE_CASES = ("ps-tfdef", "mwm-tfdef", "train-1t")
LABELS = {
    "raw": "raw Model Garden (python -m official.vision.train)",
    "train": "od-dist train (one process)",
    "ps": "launch parameter_server (1 ps, master, 2 workers)",
    "mwm": "launch multi_worker_mirrored (master + 1 worker)",
    "ps-tfdef": "  same, TensorFlow default threads (before)",
    "mwm-tfdef": "  same, TensorFlow default threads (before)",
    "train-1t": "od-dist train (one process), --intra_op_threads=1",
}


# ----- event files (read without TensorFlow: tensorboard's protos and the TFRecord framing) ----


def read_events(path: str):
    from tensorboard.compat.proto import event_pb2

    with open(path, "rb") as f:
        while True:
            header = f.read(12)
            if len(header) < 12:
                return
            (length,) = struct.unpack("<Q", header[:8])
            data = f.read(length)
            f.read(4)
            if len(data) < length:
                return
            event = event_pb2.Event()
            event.ParseFromString(data)
            yield event


def _tensor_value(tensor) -> float | None:
    if tensor.float_val:
        return float(tensor.float_val[0])
    if tensor.double_val:
        return float(tensor.double_val[0])
    content = tensor.tensor_content
    if len(content) == 4:
        return struct.unpack("<f", content)[0]
    if len(content) == 8:
        return struct.unpack("<d", content)[0]
    return None


def steps_per_second(model_dir: str) -> list[tuple[int, float, float]]:
    """(step, wall_time, steps/s) of every `steps_per_second` summary in <model_dir>/train."""
    out = []
    for path in sorted(glob.glob(os.path.join(model_dir, "train", "events.out.tfevents.*"))):
        for event in read_events(path):
            for value in event.summary.value:
                if value.tag == "steps_per_second":
                    v = value.simple_value if value.HasField("simple_value") else _tensor_value(value.tensor)
                    if v is not None:
                        out.append((int(event.step), float(event.wall_time), float(v)))
    return sorted(out)


# ----- running one case ---------------------------------------------------------------------


def steady_rates(summaries: list[tuple[int, float, float]], steps_per_loop: int) -> list[float]:
    """The steady loops' steps/s: the first loop traces the model, and orbit's rate for the second
    includes the checkpoint written after the first (orbit saves when there is none yet)."""
    return [v for step, _, v in summaries if step > 2 * steps_per_loop]


def write_cluster(path: str, kind: str) -> str:
    if kind == "ps":  # the shape of clusters/local.yaml, on free ports
        m, w0, w1, ps = free_ports(4)
        text = (
            f"strategy: parameter_server\nmaster: 127.0.0.1:{m}\n"
            f"worker: [127.0.0.1:{w0}, 127.0.0.1:{w1}]\nps: [127.0.0.1:{ps}]\n"
        )
    else:
        m, w0 = free_ports(2)
        text = f"strategy: multi_worker_mirrored\nmaster: 127.0.0.1:{m}\nworker: [127.0.0.1:{w0}]\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def _role_of(cmdline: list[str], top: str, is_root: bool) -> str:
    text = " ".join(cmdline)
    role = re.search(r"--role=(\w+)", text)
    if role:
        index = re.search(r"--index=(\d+)", text)
        return f"{role.group(1)}:{index.group(1) if index else 0}"
    return top if is_root else f"{top}-child"  # e.g. launch's pipeline check before the tasks start


class PeakRss:
    """Samples the RSS of a process and its descendants until stopped; the peak per role, and the
    CPU seconds (user + system) each had used at its last sample."""

    def __init__(self, pid: int, top: str, interval: float = 0.2):
        self.peak: dict[str, int] = {}
        self.cpu: dict[str, float] = {}
        self.history: list[tuple[float, dict[str, float]]] = []  # (time, CPU seconds by role)
        self._stop = threading.Event()
        self._pid, self._top, self._interval = pid, top, interval
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        try:
            root = psutil.Process(self._pid)
        except psutil.Error:
            return
        while not self._stop.is_set():
            try:
                procs = [root] + root.children(recursive=True)
            except psutil.Error:
                break
            for p in procs:
                try:
                    role = _role_of(p.cmdline(), self._top, p.pid == self._pid)
                    rss = p.memory_info().rss
                    times = p.cpu_times()
                except psutil.Error:
                    continue
                self.peak[role] = max(self.peak.get(role, 0), rss)
                self.cpu[role] = max(self.cpu.get(role, 0.0), times.user + times.system)
            self.history.append((time.time(), dict(self.cpu)))
            self._stop.wait(self._interval)

    def cpu_between(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds each role used between two wall-clock times (the samples nearest before them)."""

        def at(t):
            before = [cpu for when, cpu in self.history if when <= t]
            return before[-1] if before else {}

        start, end = at(t0), at(t1)
        return {role: end[role] - start.get(role, 0.0) for role in end}

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return self.peak


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the run's process group (launch stops its tasks), SIGKILL after 15 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


OLD = "@old"  # a case run on --against's code


def run_case(case: str, work: str, run_id: str, args, data_dir: str, raw_config: str) -> dict:
    code_dir = args.against if case.endswith(OLD) else REPO
    case_name, case = case, case.removesuffix(OLD)
    model_dir = os.path.join(work, run_id)
    override = (
        f"trainer.train_steps={args.steps},trainer.steps_per_loop={args.steps_per_loop},"
        f"trainer.summary_interval={args.steps_per_loop},trainer.checkpoint_interval={args.steps},"
        f"task.train_data.input_path={data_dir}/train.tfrecord,"
        f"task.validation_data.input_path={data_dir}/val.tfrecord"
    )
    common = [f"--pipeline={PIPELINE}", f"--model_dir={model_dir}", f"--params_override={override}"]
    kind = case.split("-")[0]
    if kind == "raw":
        experiment = yaml.safe_load(open(PIPELINE, encoding="utf-8"))["experiment"]
        argv = [
            PY,
            "-m",
            "official.vision.train",
            f"--experiment={experiment}",
            "--mode=train",
            f"--model_dir={model_dir}",
            f"--config_file={raw_config}",
            f"--params_override={override}",
        ]
    elif kind == "train":
        argv = [PY, "-m", "od_dist", "train", *common]
    else:
        cluster = write_cluster(os.path.join(work, f"{run_id}.yaml"), kind)
        argv = [PY, "-m", "od_dist", "launch", f"--cluster={cluster}", *common, "--wait_timeout=120"]
    if case.endswith("-tfdef"):
        argv += TF_DEFAULT_THREADS
    if case == "train-1t":
        argv.append("--intra_op_threads=1")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CONFIG", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")
    }
    env["PYTHONPATH"] = code_dir + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    log_path = os.path.join(work, f"{run_id}.log")
    start = time.time()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(
            argv,
            cwd=work,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        rss = PeakRss(proc.pid, "launch" if kind in ("ps", "mwm") else kind)
        try:
            code = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
        except BaseException:  # Ctrl+C or SIGTERM: leave no training behind
            _stop_group(proc)
            raise
        wall = time.time() - start
        peak = rss.stop()
    result = {
        "case": case_name,
        "start": start,
        "exit": code,
        "wall_s": wall,
        "rss_mib": {k: v / 2**20 for k, v in peak.items()},
        "cpu_s": dict(rss.cpu),
    }
    summaries = steps_per_second(model_dir)
    steady = steady_rates(summaries, args.steps_per_loop)
    if code != 0 or not summaries or not steady:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            tail = f.read()[-1500:]
        print(
            f"  {case_name} FAILED (exit {code}, {len(summaries)} summaries); log {log_path}:\n{tail}",
            flush=True,
        )
        result["failed"] = True
        return result
    result["steady_sps"] = statistics.median(steady)
    # Where the steady phase's CPU went: milliseconds per training step, by process.
    window = [x for x in summaries if x[0] >= 2 * args.steps_per_loop]  # the loops steady_rates counts
    (step0, t0, _), (step1, t1, _) = window[0], window[-1]
    if step1 > step0:
        result["steady_cpu_ms_per_step"] = {
            role: 1000 * cpu / (step1 - step0) for role, cpu in rss.cpu_between(t0, t1).items()
        }
    first_wall = summaries[0][1]
    result["first_step_s"] = first_wall - start - (args.steps_per_loop - 1) / result["steady_sps"]
    return result


def time_cli(runs: int) -> dict[str, list[float]]:
    cases = {
        "python -c pass": [PY, "-c", "pass"],
        "od-dist validate": [PY, "-m", "od_dist", "validate", "--cluster", "clusters/local.yaml"],
        "od-dist --help": [PY, "-m", "od_dist", "--help"],
    }
    env = dict(os.environ, PYTHONPATH=REPO)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(runs):
        for name, argv in cases.items():
            start = time.perf_counter()
            subprocess.run(
                argv, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            times[name].append(time.perf_counter() - start)
    return times


# ----- the report ---------------------------------------------------------------------------


def machine() -> str:
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    from importlib.metadata import version

    mem = psutil.virtual_memory().total / 2**30
    return (
        f"{platform.system()} {platform.machine()}, {psutil.cpu_count()} cores ({model}), {mem:.0f} GiB, "
        f"Python {platform.python_version()}, tensorflow {version('tensorflow')}, "
        f"tf-models-official {version('tf-models-official')}"
    )


def _median(results: list[dict], key: str) -> float | None:
    values = [r[key] for r in results if key in r]
    return statistics.median(values) if values else None


def report(results: dict[str, list[dict]], cli: dict[str, list[float]], args, loads) -> str:
    lines = []
    med = {
        c: {k: _median(rs, k) for k in ("steady_sps", "first_step_s", "wall_s")} for c, rs in results.items()
    }

    def ratio(a, b):
        return f"{a / b:.2f}" if a is not None and b else "-"

    def num(v, fmt):
        return format(v, fmt) if v is not None else "-"

    if results:
        lines += [
            "| case | steady steps/s | ratio | first step (s) | wall (s) | runs ok |",
            "|---|---|---|---|---|---|",
        ]
        for case, rs in results.items():
            m = med[case]
            old = OLD if case.endswith(OLD) else ""
            plain = case.removesuffix(OLD)
            base = "raw" if plain == "train" else f"train{old}" if plain != "raw" else None
            r = ratio(m["steady_sps"], med.get(base, {}).get("steady_sps")) if base else "1.00"
            r += f" vs {base}" if base else ""
            if old and med.get(plain, {}).get("steady_sps"):
                r += f"; now {ratio(med[plain]['steady_sps'], m['steady_sps'])}x of this"
            if case.split("-")[0] in ("ps", "mwm") and med.get("train-1t", {}).get("steady_sps"):
                r += f" ({ratio(m['steady_sps'], med['train-1t']['steady_sps'])} vs train-1t)"
            first = num(m["first_step_s"], ".1f")
            if (
                case == "train"
                and "raw" in med
                and m["first_step_s"] is not None
                and med["raw"]["first_step_s"]
            ):
                first += f" ({m['first_step_s'] - med['raw']['first_step_s']:+.1f} vs raw)"
            ok = sum(1 for x in rs if not x.get("failed"))
            label = LABELS[plain] + (f" on {args.against}" if old else "")
            lines.append(
                f"| {label} | {num(m['steady_sps'], '.2f')} | {r} | {first} | "
                f"{num(m['wall_s'], '.0f')} | {ok}/{len(rs)} |"
            )
        lines.append("")
        lines += [
            "| case | peak RSS per process (MiB, max over rounds) | CPU seconds per process (median) | "
            "steady phase: CPU ms per step, by process |",
            "|---|---|---|---|",
        ]
        for case, rs in results.items():
            peak: dict[str, float] = {}
            cpu: dict[str, list[float]] = {}
            for r in rs:
                for role, mib in r["rss_mib"].items():
                    peak[role] = max(peak.get(role, 0.0), mib)
                for role, seconds in r.get("cpu_s", {}).items():
                    cpu.setdefault(role, []).append(seconds)
            cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
            per_step: dict[str, list[float]] = {}
            for r in rs:
                for role, ms in r.get("steady_cpu_ms_per_step", {}).items():
                    per_step.setdefault(role, []).append(ms)
            step_med = {k: statistics.median(v) for k, v in per_step.items()}
            lines.append(
                f"| {case} | {', '.join(f'{k} {v:.0f}' for k, v in sorted(peak.items()))} | "
                f"{', '.join(f'{k} {v:.0f}' for k, v in sorted(cpu_med.items()))}, "
                f"total {sum(cpu_med.values()):.0f} | "
                f"{', '.join(f'{k} {v:.0f}' for k, v in sorted(step_med.items()) if v >= 0.5)}"
                f"{', total ' + format(sum(step_med.values()), '.0f') if step_med else '-'} |"
            )
        lines.append("")
    if cli:
        base = statistics.median(cli["python -c pass"])
        lines += ["| command | median (ms) | vs bare interpreter |", "|---|---|---|"]
        for name, times in cli.items():
            m = statistics.median(times)
            lines.append(f"| {name} | {m * 1000:.0f} | x{m / base:.1f} |")
        lines.append("")
    lines.append(f"machine: {machine()}")
    lines.append(f"load average (1/5/15 min) before: {loads[0]}, after: {loads[1]}")
    lines.append(f"command: python benchmarks/bench.py {' '.join(sys.argv[1:])}".rstrip())
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians over them)")
    parser.add_argument("--steps", type=int, default=200, help="training steps per run")
    parser.add_argument("--steps_per_loop", type=int, default=50, help="steps per loop (and per summary)")
    parser.add_argument(
        "--cases",
        default=",".join(TRAIN_CASES + ("cli",)),
        help="comma-separated: raw, train, ps, mwm, ps-tfdef, mwm-tfdef, train-1t, cli",
    )
    parser.add_argument(
        "--before",
        action="store_true",
        help="add ps-tfdef and mwm-tfdef (TensorFlow's default threads in every task, "
        "before the budgets) and train-1t (one process with 1 intra-op thread)",
    )
    parser.add_argument("--cli_runs", type=int, default=5, help="runs of each CLI command per round")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before a run is killed")
    parser.add_argument("--json", help="also write every run's figures here")
    parser.add_argument(
        "--keep", help="keep model_dirs and logs in this directory (default: a temporary one)"
    )
    parser.add_argument(
        "--against",
        help="another checkout of od-dist (git worktree add DIR COMMIT): each od-dist case also runs "
        f"on its code, as CASE{OLD}, interleaved",
    )
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through run_case's cleanup
    cases = [c for c in args.cases.split(",") if c]
    if args.before:
        cases += [c for c in BEFORE_CASES if c not in cases]
    unknown = [c for c in cases if c not in TRAIN_CASES + BEFORE_CASES + ("cli",)]
    if unknown or args.steps <= 2 * args.steps_per_loop:
        parser.error(
            f"unknown cases {unknown}"
            if unknown
            else "--steps must exceed 2 x --steps_per_loop "
            "(the first two loops are left out of the steady rate)"
        )
    if args.against:
        args.against = os.path.abspath(args.against)
        if not os.path.isfile(os.path.join(args.against, "od_dist", "__init__.py")):
            parser.error(f"--against: {args.against}: not an od-dist checkout")
        cases += [c + OLD for c in cases if c not in ("raw", "cli")]
    train_cases = [c for c in cases if c != "cli"]

    work = args.keep or tempfile.mkdtemp(prefix="od-dist-bench-")
    os.makedirs(work, exist_ok=True)
    loads = [tuple(round(x, 1) for x in os.getloadavg())]
    started = time.time()
    try:
        data_dir = os.path.join(work, "data")
        raw_config = os.path.join(work, "raw_config.yaml")
        if train_cases:
            subprocess.run(
                [
                    PY,
                    "-m",
                    "od_dist",
                    "data",
                    "shapes",
                    f"--out={data_dir}",
                    "--num_train=500",
                    "--num_val=8",
                ],
                cwd=REPO,
                env=dict(os.environ, PYTHONPATH=REPO),
                check=True,
                stdout=subprocess.DEVNULL,
            )
            doc = yaml.safe_load(open(PIPELINE, encoding="utf-8"))
            doc.pop("experiment")
            doc.setdefault("runtime", {})["distribution_strategy"] = "mirrored"
            with open(raw_config, "w", encoding="utf-8") as f:
                yaml.safe_dump(doc, f)
        results: dict[str, list[dict]] = {c: [] for c in train_cases}
        cli: dict[str, list[float]] = {}
        try:
            for r in range(args.rounds):
                order = cases[r % len(cases) :] + cases[: r % len(cases)]  # rotate: no case always first
                for case in order:
                    if case == "cli":
                        for name, times in time_cli(args.cli_runs).items():
                            cli.setdefault(name, []).extend(times)
                        continue
                    result = run_case(case, work, f"r{r}-{case}", args, data_dir, raw_config)
                    results[case].append(result)
                    print(
                        f"round {r + 1}/{args.rounds} {case:<10} steady {result.get('steady_sps', 0):6.2f} "
                        f"steps/s  first step {result.get('first_step_s', 0):5.1f} s  wall "
                        f"{result['wall_s']:5.0f} s  ({time.time() - started:.0f} s so far)",
                        flush=True,
                    )
        except (KeyboardInterrupt, SystemExit):
            print("interrupted: the table holds the runs that finished", flush=True)
        results = {c: rs for c, rs in results.items() if rs}
        loads.append(tuple(round(x, 1) for x in os.getloadavg()))
        table = report(results, cli, args, loads)
        print()
        print(table)
        print(f"total {time.time() - started:.0f} s")
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"results": results, "cli": cli, "loads": loads, "args": vars(args)}, f, indent=1)
        failed = any(x.get("failed") for rs in results.values() for x in rs)
        return 1 if failed else 0
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
