"""A long job under random faults: does it finish, lose nothing, and say what happened?

    sudo .venv/bin/python benchmarks/chaos.py [--seed 1] [--faults 20] [--steps 1400]
        [--strategy parameter_server|multi_worker_mirrored] [--no_baseline] [--keep DIR]

Per strategy, a job on simulated machines (network namespaces, tests/netns.py): parameter_server
with a master, two workers and a ps, each on its own machine; multi_worker_mirrored with a master
and a worker. Each machine runs the script `od-dist scripts` wrote for its task, which supervises
it (the scripts' own `--max_restarts` unless given), and keeps `--model_dir` on its own disk (a
relative one, in its working directory: no shared folder) unless `--shared_model_dir`. The demo
detector trains on generated shapes data while a seeded schedule injects faults, each a random
delay after training progressed again from the one before:

    kill     SIGKILL of a random task (the master included)
    term     SIGTERM of a random task (a drained node)
    ps       SIGKILL of the ps (parameter_server only)
    link     a machine's link cut for 5-60 s (its port on the switch down: all its traffic dropped)
    save     SIGKILL of the master while it writes a checkpoint (`ckpt-N_temp/` in model_dir)
    double   SIGKILL or SIGTERM of two tasks 1-5 s apart

`--seed` replays a schedule exactly (which faults, which targets, the delays and durations; when
they land depends on how fast the machine trains). Then it checks the invariants (exit statuses,
checkpoints, orphans, accuracy against a fault-free run of the same length, unless
`--no_baseline`) and prints them, one row per fault and a summary line, as Markdown tables.

Every wait is bounded but generous (`--timeout`, `--recovery_timeout`): the box may be slow.
Needs root (namespaces); says why and exits 0 otherwise.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pathlib
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
import netns  # noqa: E402 (the tests' simulated machines)
from loopback import COCO_LINE, PIPELINE, checkpoint_step  # noqa: E402
from outage import STEP, set_port, simulated_work  # noqa: E402 (benchmarks/: this folder)
from test_multihost import Job, job_cluster, write_scripts  # noqa: E402

PY = sys.executable
LAYOUTS = {  # machine index -> role
    "parameter_server": {0: "master", 1: "worker", 2: "worker", 3: "ps"},
    "multi_worker_mirrored": {0: "master", 1: "worker"},
}
KINDS = {
    "parameter_server": ("kill", "term", "ps", "link", "save", "double"),
    "multi_worker_mirrored": ("kill", "term", "link", "save", "double"),
}
MASTER = 0  # the master's machine in every layout
SEPARATE = "runs/chaos"  # --model_dir relative to each machine's working directory: its own disk
SAID = re.compile(r"died|lost|restart|stopped|unreachable|exit \d+|removed|resuming|no restart")


@dataclass
class Fault:
    kind: str
    targets: list[str]  # task names ("master:0"), or a machine's index for a link cut
    delay_s: float  # after training progressed again from the fault before
    seconds: float = 0.0  # link: how long it is cut; double: the gap between the two
    injected_at: float | None = None
    since: float | None = None  # progress after this counts as recovered (a SIGTERM acts at a loop's end)
    note: str = ""
    before_step: int = 0
    recovered_at: float | None = None
    said: list[str] = field(default_factory=list)
    redone: int | None = None


def schedule(strategy: str, seed: int, count: int) -> list[Fault]:
    """`count` faults, every kind at least once when count allows; the same for the same seed."""
    rng = random.Random(f"{seed}:{strategy}")
    kinds = list(KINDS[strategy])
    picked = (kinds * (count // len(kinds) + 1))[: min(count, len(kinds))]
    picked += [rng.choice(kinds) for _ in range(count - len(picked))]
    rng.shuffle(picked)
    names = task_names(strategy)
    faults = []
    for kind in picked:
        delay = round(rng.uniform(0, 20), 1)
        if kind in ("kill", "term"):
            faults.append(Fault(kind, [rng.choice(names)], delay))
        elif kind == "ps":
            faults.append(Fault(kind, ["ps:0"], delay))
        elif kind == "save":
            faults.append(Fault(kind, ["master:0"], delay))
        elif kind == "link":
            machine = rng.randrange(len(LAYOUTS[strategy]))
            faults.append(Fault(kind, [str(machine)], delay, round(rng.uniform(5, 60), 1)))
        else:
            two = rng.sample(names, 2)
            signals = [rng.choice(("kill", "term")) for _ in two]
            faults.append(
                Fault(kind, [f"{s} {n}" for s, n in zip(signals, two)], delay, round(rng.uniform(1, 5), 1))
            )
    return faults


def task_names(strategy: str) -> list[str]:
    names, counts = [], {}
    for _, role in sorted(LAYOUTS[strategy].items()):
        names.append(f"{role}:{counts.get(role, 0)}")
        counts[role] = counts.get(role, 0) + 1
    return names


class Watch(threading.Thread):
    """Reads every task's console and the checkpoint state twice a second: each line with the
    time it was first seen, and each checkpoint step the state file named."""

    def __init__(self, job: Job, model_dir: str, t0: float):
        super().__init__(daemon=True)
        self.job, self.model_dir, self.t0 = job, model_dir, t0
        self.lines: dict[str, list[tuple[float, str]]] = {n: [] for n in job.logs}
        self.ckpts: list[tuple[float, int]] = []
        self.done = threading.Event()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def run(self) -> None:
        while not self.done.is_set():
            self.look()
            time.sleep(0.5)
        self.look()

    def look(self) -> None:
        t = self.now()
        for name, path in self.job.logs.items():
            text = path.read_text(errors="replace").splitlines()
            seen = self.lines[name]
            seen.extend((t, line) for line in text[len(seen) :])
        step = checkpoint_step(self.model_dir)
        if step is not None and (not self.ckpts or self.ckpts[-1][1] != step):
            self.ckpts.append((t, step))

    def progress(self, after: float = -1.0) -> list[tuple[float, int]]:
        """The master's progress lines (time, step) seen after `after`."""
        return [
            (t, int(m.group(1)))
            for t, line in self.lines["master:0"]
            if t > after
            for m in [STEP.search(line)]
            if m
        ]

    def said(self, start: float, end: float) -> list[str]:
        return [
            f"{name}: {line.strip()[:200]}"
            for name, lines in self.lines.items()
            for t, line in lines
            if start <= t <= end and not STEP.search(line) and SAID.search(line) and "WARNING" not in line
        ]


def task_pid(job: Job, name: str) -> int | None:
    """The task process that the machine's `od-dist train --max_restarts` runs (its child)."""
    sup = job.procs[name].pid
    try:
        children = open(f"/proc/{sup}/task/{sup}/children").read().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def signal_task(job: Job, name: str, sig: int) -> str:
    pid = task_pid(job, name)
    if pid is None:
        return f"{name}: no task running (restarting)"
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return f"{name}: gone before the signal"
    return f"{signal.Signals(sig).name} {name}"


def terminated(fault: Fault) -> list[str]:
    """The tasks a fault sent SIGTERM."""
    if fault.kind == "term":
        return fault.targets
    return [t.split()[1] for t in fault.targets if t.startswith("term ")] if fault.kind == "double" else []


def kill_during_save(job: Job, model_dir: str, timeout: float) -> str:
    """SIGKILL of the master as soon as a checkpoint save is seen in progress."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if glob.glob(os.path.join(model_dir, "ckpt-*_temp")) or glob.glob(
            os.path.join(model_dir, "*tempstate*")
        ):
            return signal_task(job, "master:0", signal.SIGKILL) + " during a save"
        time.sleep(0.02)
    return signal_task(job, "master:0", signal.SIGKILL) + f" (no save seen in {timeout:.0f} s)"


def inject(fault: Fault, job: Job, net, model_dir: str, args) -> None:
    sig = {"kill": signal.SIGKILL, "term": signal.SIGTERM}
    if fault.kind in ("kill", "term"):
        fault.note = signal_task(job, fault.targets[0], sig[fault.kind])
    elif fault.kind == "ps":
        fault.note = signal_task(job, "ps:0", signal.SIGKILL)
    elif fault.kind == "save":
        fault.note = kill_during_save(job, model_dir, args.save_wait)
    elif fault.kind == "link":
        i = int(fault.targets[0])
        set_port(net, i, up=False)
        time.sleep(fault.seconds)
        set_port(net, i, up=True)
        fault.note = f"{net[i].hostname} ({LAYOUTS[args.current][i]}) cut off {fault.seconds:g} s"
    else:
        notes = []
        for n, target in enumerate(fault.targets):
            if n:
                time.sleep(fault.seconds)
            kind, name = target.split()
            notes.append(signal_task(job, name, sig[kind]))
        fault.note = f", {fault.seconds:g} s later ".join(notes)


def orphans(net, workdirs, model_dirs, tmpdir) -> list[str]:
    """Processes, listening ports and temporary files left on any machine after the job."""
    found = []
    for machine in net:
        pids = subprocess.run(
            ["ip", "netns", "pids", machine.netns], capture_output=True, text=True
        ).stdout.split()
        for pid in pids:
            try:
                cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")[:120]
            except OSError:
                continue
            found.append(f"{machine.hostname}: process {pid} {cmd}")
        ports = subprocess.run(machine.command(["ss", "-Htln"]), capture_output=True, text=True).stdout
        found += [
            f"{machine.hostname}: listening {line.split()[3]}" for line in ports.splitlines() if line.strip()
        ]
    left = []
    for model_dir in model_dirs:
        left += glob.glob(os.path.join(model_dir, "*_temp")) + glob.glob(
            os.path.join(model_dir, "*tempstate*")
        )
    for d in workdirs:
        left += glob.glob(os.path.join(d, ".od-dist-*"))
    left += glob.glob(os.path.join(tmpdir, "*"))
    return found + [f"file left: {p}" for p in left]


def unreadable_checkpoints(model_dir: str) -> tuple[list[int], list[str]]:
    """The steps of every ckpt-N in model_dir, and those that do not restore (each tensor read back,
    as the trainer's own check does)."""
    code = (
        "import glob, json, os, sys\n"
        "from od_dist.task.checkpoints import _complete\n"
        "prefixes = sorted(p[:-6] for p in glob.glob(os.path.join(sys.argv[1], 'ckpt-*.index')))\n"
        "names = set(os.listdir(sys.argv[1]))\n"
        "print(json.dumps([[p, _complete(p, names)] for p in prefixes]))\n"
    )
    r = subprocess.run([PY, "-c", code, model_dir], capture_output=True, text=True, cwd=REPO, timeout=1800)
    if r.returncode:
        return [], [f"check failed: {r.stderr.strip()[-300:]}"]
    checked = json.loads(r.stdout.strip().splitlines()[-1])
    steps = sorted(int(p.rsplit("-", 1)[1]) for p, _ in checked)
    return steps, [os.path.basename(p) for p, ok in checked if not ok]


def evaluate(model_dir: str, override: str) -> tuple[float | None, str]:
    r = subprocess.run(
        [
            PY,
            "-m",
            "od_dist",
            "eval",
            f"--pipeline={PIPELINE}",
            f"--model_dir={model_dir}",
            f"--params_override={override}",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=3600,
    )
    m = COCO_LINE.search(r.stdout)
    return (float(m["AP50"]) if m else None), (m.group(0) if m else (r.stdout + r.stderr).strip()[-300:])


def run_job(strategy: str, faults: list[Fault], args, work: str, data: str) -> dict:
    """One job of `strategy` under `faults` (none: the fault-free run); returns what was seen."""
    label = "chaos" if faults else "fault-free"
    cdir = pathlib.Path(work) / f"{strategy}-{label}"
    cdir.mkdir()
    tmpdir = cdir / "tmp"
    tmpdir.mkdir()
    os.environ["TMPDIR"] = str(tmpdir)  # every task's temporary files, to find those left over
    args.current = strategy
    override = ",".join(
        [
            f"trainer.train_steps={args.steps}",
            f"trainer.steps_per_loop={args.steps_per_loop}",
            f"trainer.summary_interval={args.steps_per_loop}",
            f"trainer.checkpoint_interval={args.steps_per_loop * 2}",
            f"task.train_data.input_path={data}/train.tfrecord",
            f"task.validation_data.input_path={data}/val.tfrecord",
        ]
        + ([args.params_override] if args.params_override else [])
    )
    roles = LAYOUTS[strategy]
    net = netns.Network(len(roles))
    job = None
    try:
        cluster = job_cluster(cdir, net, roles)
        flags = [] if args.max_restarts is None else [f"--max_restarts={args.max_restarts}"]
        workdirs = {i: cdir / net[i].hostname for i in roles}
        if args.shared_model_dir:
            scripts, model_dir = write_scripts(cdir, cluster, None, None, args.wait_timeout, override, flags)
            model_dirs = {i: model_dir for i in roles}
        else:  # each machine's own, in its working directory
            scripts, _ = write_scripts(
                cdir, cluster, None, None, args.wait_timeout, override, flags, model_dir=SEPARATE
            )
            model_dirs = {i: workdirs[i] / SEPARATE for i in roles}
        model_dir = model_dirs[MASTER]  # where the master saves: the checkpoints watched and checked
        t0 = time.monotonic()
        job = Job.from_scripts(cdir, net, roles, scripts)
        watch = Watch(job, str(model_dir), t0)
        watch.start()
        # The job is over once the master's machine's od-dist has exited, whatever the others do:
        # it writes the final checkpoint, and a failed job must show as failed, not as a hang.
        running = lambda: job.procs["master:0"].poll() is None  # noqa: E731
        deadline = t0 + args.timeout
        while not watch.progress() and running() and time.monotonic() < deadline:
            time.sleep(0.5)
        for n, fault in enumerate(faults):
            last = faults[n - 1] if n else None
            # Training must have progressed again since the fault before (bounded).
            wait_until = time.monotonic() + args.recovery_timeout
            while last and last.recovered_at is None and running() and time.monotonic() < wait_until:
                got = watch.progress(after=last.since)
                if got:
                    last.recovered_at = got[0][0]
                time.sleep(0.5)
            if last and last.recovered_at is None:
                break  # not recovered: no more faults; what happens is reported
            time.sleep(fault.delay_s)
            done = watch.progress()
            if not running() or (done and done[-1][1] >= args.steps):
                break  # training ended before this fault
            fault.injected_at = watch.now()
            fault.before_step = max((s for _, s in done), default=0)
            inject(fault, job, net, str(model_dir), args)
            fault.since = watch.now()
            for name in terminated(fault):  # it exits at the end of its loop: from then on
                until = time.monotonic() + args.recovery_timeout
                while time.monotonic() < until and running():
                    died = [t for t, line in watch.lines[name] if t >= fault.injected_at and " died " in line]
                    if died:
                        fault.since = max(fault.since, died[0])
                        break
                    time.sleep(0.5)
            print(
                f"  {fault.injected_at:7.1f} s  step {fault.before_step:5d}  {fault.kind:6s} {fault.note}",
                flush=True,
            )
        codes = job.wait(["master:0"], timeout=max(1.0, deadline - time.monotonic()))
        ended = watch.now()
        # The others end by themselves within --wait_timeout of the master's end (a task's life
        # in docs/roles.md); one still running then is reported as such (exit None), and killed below.
        others = [n for n in job.procs if n != "master:0"]
        codes.update(job.wait(others, timeout=args.wait_timeout + 60))
        watch.done.set()
        watch.join()
        for fault in faults:
            if fault.injected_at is None:
                continue
            if fault.recovered_at is None:
                got = watch.progress(after=fault.since)
                fault.recovered_at = got[0][0] if got else None
            if (
                fault.recovered_at is None
                and codes["master:0"] == 0
                and checkpoint_step(str(model_dir)) == args.steps
            ):
                # A SIGTERM in the last loop: the task saved the final step and its restart had
                # nothing left to train. The job finished, when the master's od-dist exited.
                fault.recovered_at = ended
                fault.note += " (the final step was saved; the job then finished)"
            end = fault.recovered_at if fault.recovered_at is not None else ended
            fault.said = watch.said(fault.injected_at, end)
            # A restarted master resumes from the checkpoint named last before its first progress
            # line: the steps it had printed beyond that are redone (at least).
            restarted = any("master:0" in s and "restart" in s for s in fault.said)
            reached = max((s for t, s in watch.progress() if t <= fault.since), default=0)
            restored = max((s for t, s in watch.ckpts if t <= end), default=0)
            fault.redone = max(0, reached - restored) if restarted else 0
        time.sleep(2)  # what a task leaves behind is left by now
        left = orphans(
            net,
            [str(w) for w in workdirs.values()],
            sorted({str(d) for d in model_dirs.values()}),
            str(tmpdir),
        )
        return {
            "strategy": strategy,
            "wall_s": ended,
            "codes": codes,
            "last_lines": {
                n: (lines[-1][1].strip()[:200] if lines else "") for n, lines in watch.lines.items()
            },
            "progress": watch.progress(),
            "ckpts": [s for _, s in watch.ckpts],
            "model_dir": str(model_dir),
            # Each trainer's disk: every multi_worker_mirrored trainer keeps a copy.
            "trainer_dirs": {
                f"{roles[i]}@{net[i].hostname}": str(d) for i, d in model_dirs.items() if roles[i] != "ps"
            },
            "override": override,
            "orphans": left,
            "logs": str(cdir),
        }
    finally:
        if job:
            job.kill()
        net.close()
        os.environ.pop("TMPDIR", None)


def invariants(
    r: dict, faults: list[Fault], baseline: dict | None, args
) -> list[tuple[str, bool | None, str]]:
    rows = []
    final = max((s for _, s in r["progress"]), default=0)
    ok = set(r["codes"].values()) == {0} and final == args.steps
    bad = {n: c for n, c in r["codes"].items() if c != 0}
    evidence = f"master's last progress step {final}/{args.steps}; exits {r['codes']}"
    if bad:
        evidence += "; " + "; ".join(f"{n}: {r['last_lines'][n]}" for n in bad)
    rows.append(("job ends at its final step, every od-dist exit 0", ok, evidence))
    ckpts = r["ckpts"]
    backwards = [(a, b) for a, b in zip(ckpts, ckpts[1:]) if b < a]
    left, unreadable = {}, []
    for name, d in r["trainer_dirs"].items():  # the master's, and any other trainer's that holds one
        if d not in left and (d == r["model_dir"] or checkpoint_step(d) is not None):
            left[d], bad = unreadable_checkpoints(d)
            unreadable += [f"{name}: {b}" for b in bad]
    left = {name: left[d] for name, d in r["trainer_dirs"].items() if d in left}
    rows.append(
        (
            "every ckpt-N left restores",
            not unreadable and all(left.values()),
            f"ckpt steps left {left}; unreadable {unreadable}",
        )
    )
    rows.append(
        (
            "checkpoint steps never go backwards",
            not backwards,
            f"named in turn: {ckpts}; backwards {backwards}",
        )
    )
    last = checkpoint_step(r["model_dir"])
    # Under parameter_server only the master's disk holds checkpoints; under multi_worker_mirrored
    # every trainer's does, and each must end at the final step.
    held = {name: checkpoint_step(d) for name, d in r["trainer_dirs"].items()}
    rows.append(
        (
            "the final checkpoint is the final step",
            last == args.steps and all(s in (None, args.steps) for s in held.values()),
            f"the master's checkpoint file names ckpt-{last}; each trainer's disk (None: no checkpoint): {held}",
        )
    )
    rows.append(
        ("no orphan process, port or temporary file", not r["orphans"], "; ".join(r["orphans"][:8]) or "none")
    )
    if r.get("ap50") is None or not baseline or baseline.get("ap50") is None:
        rows.append(
            (
                "AP50 within 0.03 of the fault-free run",
                None,
                f"not checked: {r.get('eval', '')} / {baseline and baseline.get('eval')}",
            )
        )
    else:
        d = r["ap50"] - baseline["ap50"]
        rows.append(
            (
                "AP50 within 0.03 of the fault-free run",
                abs(d) <= 0.03,
                f"{r['ap50']:.3f} against {baseline['ap50']:.3f} ({d:+.3f})",
            )
        )
    injected = [f for f in faults if f.injected_at is not None]
    lost = [f for f in injected if f.recovered_at is None]
    rows.append(
        (
            "training progressed again after every fault",
            not lost,
            f"{len(injected) - len(lost)}/{len(injected)} recovered",
        )
    )
    return rows


def report(r: dict, faults: list[Fault], baseline: dict | None, args) -> None:
    print(f"\n### {r['strategy']}: {args.command}\n\nlogs in {r['logs']}\n")
    print("| invariant | holds | evidence |\n|---|---|---|")
    for name, ok, evidence in invariants(r, faults, baseline, args):
        print(f"| {name} | {'n/a' if ok is None else 'pass' if ok else 'FAIL'} | {evidence} |")
    print(
        "\n| # | at (s) | step | fault | what od-dist printed | recovery (s) | steps redone |\n|---|---|---|---|---|---|---|"
    )
    for n, f in enumerate(faults, 1):
        if f.injected_at is None:
            print(
                f"| {n} | | | {f.kind}: not injected (training ended or a fault before was not recovered) | | | |"
            )
            continue
        rec = f"{f.recovered_at - f.injected_at:.1f}" if f.recovered_at is not None else "not recovered"
        said = "<br>".join(s.replace("|", "/") for s in f.said[:3]) or "(nothing)"
        print(
            f"| {n} | {f.injected_at:.0f} | {f.before_step} | {f.kind}: {f.note} | {said} | {rec} | {f.redone} |"
        )
    injected = [f for f in faults if f.injected_at is not None]
    times = [f.recovered_at - f.injected_at for f in injected if f.recovered_at is not None]
    overhead = (
        f"{r['wall_s'] / baseline['wall_s']:.2f}x the fault-free run ({r['wall_s']:.0f} s against {baseline['wall_s']:.0f} s)"
        if baseline
        else f"{r['wall_s']:.0f} s (no fault-free run)"
    )
    print(
        f"\n{r['strategy']}: {len(injected)} faults injected of {len(faults)}, {len(times)} survived; recovery "
        + (f"median {statistics.median(times):.0f} s, max {max(times):.0f} s" if times else "none")
        + f"; {sum(f.redone or 0 for f in injected)} steps redone; wall clock {overhead}",
        flush=True,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--faults", type=int, default=20, help="faults per job")
    parser.add_argument(
        "--steps",
        type=int,
        default=1400,
        help="enough for 20 faults of either strategy (multi_worker_mirrored's took 1200 steps)",
    )
    parser.add_argument("--steps_per_loop", type=int, default=25, help="a checkpoint every two loops")
    parser.add_argument("--strategy", choices=sorted(LAYOUTS), help="run one; default both")
    parser.add_argument(
        "--max_restarts", type=int, help="passed to each script; default: the scripts' own (od-dist scripts')"
    )
    parser.add_argument(
        "--shared_model_dir",
        action="store_true",
        help="one --model_dir every machine shares; default each machine's own, on its own disk",
    )
    parser.add_argument(
        "--wait_timeout",
        type=int,
        default=120,
        help="seconds to wait for peers, and the least a stuck parameter_server loop is given",
    )
    parser.add_argument("--timeout", type=float, default=7200, help="seconds one job may take in all")
    parser.add_argument(
        "--recovery_timeout", type=float, default=900, help="seconds to wait for progress after a fault"
    )
    parser.add_argument("--save_wait", type=float, default=300, help="seconds to wait for a save to kill")
    parser.add_argument("--num_val", type=int, default=100, help="held-out images for AP50")
    parser.add_argument("--params_override", default="", help="added to the job's overrides")
    parser.add_argument(
        "--no_baseline", action="store_true", help="skip the fault-free run (no AP50, overhead)"
    )
    parser.add_argument("--keep", help="keep logs and models in this directory")
    args = parser.parse_args(argv)
    args.command = "benchmarks/chaos.py " + " ".join(argv if argv is not None else sys.argv[1:])
    prepared = simulated_work("od-dist-chaos-", args.keep, args.num_val)
    if not prepared:
        return 0
    work, data = prepared
    print(f"logs in {work}", flush=True)
    for strategy in [args.strategy] if args.strategy else sorted(LAYOUTS, reverse=True):
        baseline = None
        if not args.no_baseline:
            print(f"{strategy}: fault-free run", flush=True)
            baseline = run_job(strategy, [], args, work, data)
            baseline["ap50"], baseline["eval"] = evaluate(baseline["model_dir"], baseline["override"])
            print(f"  {baseline['wall_s']:.0f} s, exits {baseline['codes']}, {baseline['eval']}", flush=True)
        faults = schedule(strategy, args.seed, args.faults)
        print(f"{strategy}: chaos run, {len(faults)} faults (seed {args.seed})", flush=True)
        r = run_job(strategy, faults, args, work, data)
        r["ap50"], r["eval"] = (
            evaluate(r["model_dir"], r["override"])
            if checkpoint_step(r["model_dir"])
            else (None, "no checkpoint")
        )
        report(r, faults, baseline, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
