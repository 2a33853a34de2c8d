"""A long job under random faults: does it finish, lose nothing, and say what happened?

    sudo .venv/bin/python benchmarks/chaos.py [--seed 1] [--faults 20] [--steps 1400]
        [--strategy parameter_server|multi_worker_mirrored] [--elastic [--gone_for_good]]
        [--no_baseline] [--keep DIR] [--against DIR]

Per strategy, a job on simulated machines (network namespaces, tests/netns.py): parameter_server
with a master, two workers and a ps, each on its own machine; multi_worker_mirrored with a master
and a worker. `--elastic` (multi_worker_mirrored only): a master and two workers, `min_trainers: 2`
and `membership_port` in the cluster file, global batch 6 (it splits over 3 trainers and over 2),
so the trainers up go on without a lost machine and take it back (docs/faults.md#elastic). Each
machine runs the script `od-dist scripts` wrote for its task, which supervises it (the scripts' own
`--max_restarts` unless given), and keeps `--model_dir` on its own disk (a relative one, in its
working directory: no shared folder) unless `--shared_model_dir`. The demo detector trains on
generated shapes data while a seeded schedule injects faults, each a random delay after training
progressed again from the one before:

    kill     SIGKILL of a random task (the master included)
    term     SIGTERM of a random task (a drained node)
    ps       SIGKILL of the ps (parameter_server only)
    link     a machine's link cut for 5-60 s (its port on the switch down: all its traffic dropped)
    save     SIGKILL of the master while it writes a checkpoint (`ckpt-N_temp/` in model_dir)
    double   SIGKILL or SIGTERM of two tasks 1-5 s apart
    gone     (--elastic only) a trainer machine lost: every process on it killed at once (a power
             cut); its script started again 20-90 s after the loss (once the group of 2 holds a
             checkpoint newer than at the loss, if that takes longer), on its old disk or, half the
             time, an empty one (its --model_dir wiped: a new disk). `--gone_for_good`: the
             schedule's last `gone` never comes back, and the group of 2 finishes the job.
             Its figures: loss to the smaller group training (a survivor's disk holds a checkpoint
             newer than any at the loss) and return to the larger group training (the returned
             machine's disk holds a checkpoint newer than any disk held at its return; the time of
             its `round N: ...` line too). An elastic schedule holds `gone` at least twice.

A fault's target whose machine is off (`gone`, not yet back) is replaced by the first machine up
in the file's order, said in the fault's row. `--seed` replays a schedule exactly (which faults,
which targets, the delays and durations; when they land depends on how fast the machine trains).
Then it checks the invariants (exit statuses, checkpoints, orphans, accuracy against a fault-free
run of the same length and layout, unless `--no_baseline`; elastic: each machine's last od-dist
exits 0, but that of one lost for good, which died with it; the final checkpoint is on the disk of
every member of the last round; each disk's checkpoints never go backwards, a wiped one counted
anew; what a power-off leaves in its temporary folders is listed, not counted) and prints them, one
row per fault and a summary line, as Markdown tables. A fault is recovered at the first progress
line after the first death a supervisor reports after it (a loop that was ending as the fault came
prints its line after it; a SIGTERM: after the task's exit at its loop's end), or after the fault
itself when nothing died (an outage TensorFlow rode out). Each fault's row says where its recovery went
(benchmarks/breakdown.py: the restart line, then the phase lines of the tasks started after it,
od_dist/task/phases.py; a `gone` fault's loss to the smaller group's first step, and its return apart,
from its script's new start to the larger group's), and the summary line the median of each phase
over the faults (a return's in a line of its own).

`--against DIR` (a checkout of an older commit: `git worktree add DIR COMMIT`) runs the same schedule
on that code right after (its tasks import od_dist from DIR) and ends with one line per code: the
recovery median and max, and the median of each phase.

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
import shutil
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
from breakdown import ROUND, breakdown, describe, medians  # noqa: E402 (benchmarks/: where recovery goes)
from lan_job import PORT, Job, job_cluster, write_scripts  # noqa: E402
from loopback import COCO_LINE, PIPELINE, checkpoint_step  # noqa: E402
from outage import STEP, set_port, simulated_work  # noqa: E402 (benchmarks/: this folder)

from od_dist.protocol import spare  # noqa: E402 (a parked spare's process name)
from od_dist.task.phases import SHOW_ENV  # noqa: E402 (the tasks print their phase lines)

PY = sys.executable
LAYOUTS = {  # machine index -> role
    "parameter_server": {0: "master", 1: "worker", 2: "worker", 3: "ps"},
    "multi_worker_mirrored": {0: "master", 1: "worker"},
}
ELASTIC = {0: "master", 1: "worker", 2: "worker"}  # --elastic: three trainer machines
ELASTIC_KEYS = {  # the cluster file's: a group of 2 of the 3 goes on (host/elastic.py)
    "strategy": "multi_worker_mirrored",
    "checkpoint_port": PORT + 1,
    "min_trainers": 2,
    "membership_port": PORT + 2,
}
ELASTIC_BATCH = 6  # splits over 3 trainers and over 2: every group keeps the same arithmetic
KINDS = {
    "parameter_server": ("kill", "term", "ps", "link", "save", "double"),
    "multi_worker_mirrored": ("kill", "term", "link", "save", "double"),
}
MASTER = 0  # the master's machine in every layout
SEPARATE = "runs/chaos"  # --model_dir relative to each machine's working directory: its own disk
SAID = re.compile(
    r"died|lost|restart|stopped|unreachable|exit \d+|removed|resuming|no restart|round \d+:|\bjoin\b"
)


@dataclass
class Fault:
    kind: str
    targets: list[str]  # task names ("master:0"), or a machine's index for a link cut or a loss
    delay_s: float  # after training progressed again from the fault before
    seconds: float = 0.0  # link: how long it is cut; double: the gap between the two; gone: until back
    wipe: bool = False  # gone: back on an empty disk
    for_good: bool = False  # gone: never back
    injected_at: float | None = None
    since: float | None = None  # progress after this counts as recovered (a SIGTERM acts at a loop's end)
    note: str = ""
    before_step: int = 0
    recovered_at: float | None = None  # gone: the smaller group trains
    back_at: float | None = None  # gone: its script started again
    rejoined_at: float | None = None  # gone: the larger group trains (a checkpoint on its disk)
    round_at: float | None = None  # gone: its console's round line with it among the members
    lost: str | None = None  # gone: the task of the machine lost
    smaller_step_at: float | None = None  # gone: the smaller group's first step (its first progress line)
    larger_step_at: float | None = None  # gone: the larger group's first step, once it is back
    said: list[str] = field(default_factory=list)
    redone: int | None = None
    went: dict[str, float] = field(default_factory=dict)  # where its recovery went (breakdown.py)
    went_back: dict[str, float] = field(default_factory=dict)  # gone: where its return went
    terms: list[str] = field(default_factory=list)  # the tasks a SIGTERM of it reached


def layout(strategy: str, elastic: bool = False) -> dict[int, str]:
    return ELASTIC if elastic else LAYOUTS[strategy]


def schedule(
    strategy: str, seed: int, count: int, elastic: bool = False, gone_for_good: bool = False
) -> list[Fault]:
    """`count` faults, every kind at least once when count allows (`gone` twice); the same for the
    same seed."""
    rng = random.Random(f"{seed}:{strategy}" + (":elastic" if elastic else ""))
    kinds = list(KINDS[strategy]) + (["gone"] if elastic else [])
    if elastic:
        others = [k for k in kinds if k != "gone"]
        picked = ["gone", "gone"][:count]
        picked += rng.sample(others, min(len(others), count - len(picked)))
    else:
        picked = (kinds * (count // len(kinds) + 1))[: min(count, len(kinds))]
    picked += [rng.choice(kinds) for _ in range(count - len(picked))]
    rng.shuffle(picked)
    roles = layout(strategy, elastic)
    names = task_names(roles)
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
            machine = rng.randrange(len(roles))
            faults.append(Fault(kind, [str(machine)], delay, round(rng.uniform(5, 60), 1)))
        elif kind == "gone":
            machine = rng.randrange(len(roles))
            back = round(rng.uniform(20, 90), 1)
            faults.append(Fault(kind, [str(machine)], delay, back, wipe=rng.random() < 0.5))
        else:
            two = rng.sample(names, 2)
            signals = [rng.choice(("kill", "term")) for _ in two]
            faults.append(
                Fault(kind, [f"{s} {n}" for s, n in zip(signals, two)], delay, round(rng.uniform(1, 5), 1))
            )
    gone = [f for f in faults if f.kind == "gone"]
    if gone_for_good and gone:
        gone[-1].for_good = True  # the last: no loss after it could leave a group of min_trainers
    return faults


def task_names(roles: dict[int, str]) -> list[str]:
    names, counts = [], {}
    for _, role in sorted(roles.items()):
        names.append(f"{role}:{counts.get(role, 0)}")
        counts[role] = counts.get(role, 0) + 1
    return names


class ChaosJob(Job):
    """The job's machines, each running its generated script, which a `gone` fault powers off and
    starts again: `current[task]` is the key of its machine's latest start in `procs` and `logs`
    (`worker:1`, then `worker:1#2`, ...). Each start has a TMPDIR of its own (<tmpdir>/<key>), so
    what a power-off leaves there is told from what a task left behind."""

    def __init__(self, cdir: pathlib.Path, net, roles: dict[int, str], scripts, tmpdir: pathlib.Path):
        self.procs, self.logs = {}, {}
        self.cdir, self.net, self.tmpdir = cdir, net, tmpdir
        self.machine_of: dict[str, int] = {}
        self.script_of: dict[str, pathlib.Path] = {}
        self.current: dict[str, str] = {}
        self.starts: dict[str, list[str]] = {}
        self.powered_off: set[str] = set()  # starts killed by a power-off
        self.down: set[str] = set()  # tasks whose machine is off now
        counters: dict[str, int] = {}
        for i, role in sorted(roles.items()):
            index = counters.get(role, 0)
            counters[role] = index + 1
            self.machine_of[f"{role}:{index}"] = i
            self.script_of[f"{role}:{index}"] = scripts / f"{role}-{index}.sh"
        # Servers first, as Job.from_scripts: any order works.
        for name in sorted(self.machine_of, key=lambda n: n.startswith("master")):
            self.start(name)

    def start(self, name: str) -> str:
        n = len(self.starts.setdefault(name, [])) + 1
        key = name if n == 1 else f"{name}#{n}"
        tmp = self.tmpdir / key.replace(":", "-")
        tmp.mkdir()
        env = netns.machine_env()
        env["TMPDIR"] = str(tmp)  # every task's temporary files, to find those left over
        env[SHOW_ENV] = "1"  # the start-up's phase lines on the console (breakdown.py reads them)
        self.logs[key] = self.cdir / f"{key.replace(':', '-')}.log"
        with open(self.logs[key], "w") as log:
            self.procs[key] = self.net[self.machine_of[name]].popen(
                ["bash", str(self.script_of[name])], stdout=log, stderr=subprocess.STDOUT, env=env
            )
        self.starts[name].append(key)
        self.current[name] = key
        self.down.discard(name)
        return key

    def power_off(self, name: str) -> None:
        self.net[self.machine_of[name]].power_off()
        key = self.current[name]
        try:
            self.procs[key].wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self.powered_off.add(key)
        self.down.add(name)

    def proc(self, name: str) -> subprocess.Popen:
        return self.procs[self.current[name]]

    def up(self) -> list[str]:
        return [n for n in self.current if n not in self.down]

    def stand_in(self, name: str) -> str:
        """`name`, or when its machine is off the first task up in the file's order."""
        if name not in self.down:
            return name
        order = sorted(self.machine_of, key=self.machine_of.get)
        return next(n for n in order if n not in self.down)

    def task_at(self, machine: int) -> str:
        return next(n for n, i in self.machine_of.items() if i == machine)


class Watch(threading.Thread):
    """Reads every start's console and each trainer disk's checkpoint state twice a second: each
    line with the time it was first seen, and each step a disk's state file named (None: none,
    as after a wipe)."""

    def __init__(self, job: ChaosJob, disks: dict[str, str], t0: float, everyone: bool = False):
        super().__init__(daemon=True)
        self.job, self.disks, self.t0, self.everyone = job, disks, t0, everyone
        self.lines: dict[str, list[tuple[float, str]]] = {}
        self.on_disk: dict[str, list[tuple[float, int | None]]] = {n: [] for n in disks}
        self.done = threading.Event()
        self.look()

    @property
    def ckpts(self) -> list[tuple[float, int]]:
        """The master's disk: each step its checkpoint file named, in turn."""
        return [(t, s) for t, s in self.on_disk.get("master:0", []) if s is not None]

    def now(self) -> float:
        return time.monotonic() - self.t0

    def run(self) -> None:
        while not self.done.is_set():
            self.look()
            time.sleep(0.5)
        self.look()

    def look(self) -> None:
        t = self.now()
        for key, path in list(self.job.logs.items()):
            text = path.read_text(errors="replace").splitlines()
            seen = self.lines.setdefault(key, [])
            seen.extend((t, line) for line in text[len(seen) :])
        for name, d in self.disks.items():
            step = checkpoint_step(d)
            seq = self.on_disk[name]
            if (seq and seq[-1][1] != step) or (not seq and step is not None):
                seq.append((t, step))

    def progress(self, after: float = -1.0) -> list[tuple[float, int]]:
        """The master's progress lines (time, step) seen after `after`; elastic: every trainer's
        (the master's machine may be off, and the lead moves)."""
        keys = list(self.lines) if self.everyone else ["master:0"]
        return sorted(
            (t, int(m.group(1)))
            for key in keys
            for t, line in self.lines.get(key, [])
            if t > after
            for m in [STEP.search(line)]
            if m
        )

    def said(self, start: float, end: float) -> list[str]:
        return [
            f"{name}: {line.strip()[:200]}"
            for name, lines in list(self.lines.items())
            for t, line in lines
            if start <= t <= end and not STEP.search(line) and SAID.search(line) and "WARNING" not in line
        ]

    def rounds(self) -> list[tuple[float, str, int, list[str]]]:
        """Every round line seen: (time, start, round, members)."""
        return sorted(
            (t, key, int(m.group(1)), m.group(2).split(", "))
            for key, lines in list(self.lines.items())
            for t, line in lines
            for m in [ROUND.search(line)]
            if m
        )


def task_pid(job: ChaosJob, name: str) -> int | None:
    """The task process that the machine's `od-dist train --max_restarts` runs (its child that is
    not its parked spare)."""
    sup = job.proc(name).pid
    try:
        children = open(f"/proc/{sup}/task/{sup}/children").read().split()
    except OSError:
        return None
    for pid in children:
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() != spare.PARKED_NAME:
                    return int(pid)
        except OSError:
            pass
    return None


def signal_task(job: ChaosJob, name: str, sig: int, reached: list[str] | None = None) -> str:
    """Sends `sig` to `name`'s task (its stand-in's if its machine is off); says what happened, and
    adds the task signalled to `reached`."""
    instead = job.stand_in(name)
    said = "" if instead == name else f"{name}'s machine is off: "
    pid = task_pid(job, instead)
    if pid is None:
        return f"{said}{instead}: no task running (restarting)"
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return f"{said}{instead}: gone before the signal"
    if reached is not None:
        reached.append(instead)
    return f"{said}{signal.Signals(sig).name} {instead}"


KILLS = ("kill", "ps", "link", "save", "double")  # faults whose first effect is a task's death
DEATH_WITHIN_S = 30.0  # after a link's outage: TensorFlow's heartbeat, --lost_peer_timeout and more


def first_death(watch: Watch, fault: Fault, running) -> float:
    """When a supervisor first said a task died after `fault` (waited for at most DEATH_WITHIN_S
    after it, a link's outage added); the injection when none did (a fault without effect)."""
    until = time.monotonic() + DEATH_WITHIN_S + (fault.seconds if fault.kind == "link" else 0.0)
    while time.monotonic() < until and running():
        died = [
            t
            for lines in list(watch.lines.values())
            for t, line in list(lines)
            if t >= fault.injected_at and " died " in line
        ]
        if died:
            return min(died)
        time.sleep(0.25)
    return fault.injected_at


def kill_during_save(job: ChaosJob, disks: dict[str, str], timeout: float, running) -> str | None:
    """SIGKILL of the master (elastic, its machine off: the lead) as soon as a checkpoint save is
    seen in progress on its disk; None when the job ended first (no fault: nothing to recover)."""
    name = job.stand_in("master:0")
    model_dir = disks[name]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not running():
            return None
        if glob.glob(os.path.join(model_dir, "ckpt-*_temp")) or glob.glob(
            os.path.join(model_dir, "*tempstate*")
        ):
            return signal_task(job, name, signal.SIGKILL) + " during a save"
        time.sleep(0.02)
    return signal_task(job, name, signal.SIGKILL) + f" (no save seen in {timeout:.0f} s)"


def newest(disks: dict[str, str], names) -> int:
    return max([checkpoint_step(disks[n]) or 0 for n in names] + [0])


def gone(fault: Fault, job: ChaosJob, watch: Watch, disks: dict[str, str], args, running) -> None:
    """A trainer machine lost: powered off; once the group without it holds a newer checkpoint than
    any at the loss, and `fault.seconds` after the loss, its script is started again (its disk
    wiped first for `fault.wipe`), unless `fault.for_good` or the job ended meanwhile; waits until
    its disk holds a checkpoint newer than any at its return (the larger group trains)."""
    name = job.stand_in(job.task_at(int(fault.targets[0])))
    i = job.machine_of[name]
    instead = "" if name == job.task_at(int(fault.targets[0])) else " (the machine drawn was off)"
    survivors = [n for n in job.up() if n != name]
    at_loss = newest(disks, survivors)
    job.power_off(name)
    lost = watch.now()
    fault.lost = name
    fault.note = f"{job.net[i].hostname} ({name}) powered off{instead}"
    until = time.monotonic() + args.recovery_timeout
    while time.monotonic() < until and any(job.proc(n).poll() is None for n in survivors):
        if newest(disks, survivors) > at_loss:
            fault.recovered_at = watch.now()
            break
        time.sleep(0.25)
    if fault.for_good:
        fault.note += ", for good"
        return
    if fault.recovered_at is None:
        fault.note += "; not started again: the group without it did not train"
        return
    time.sleep(max(0.0, fault.seconds - (watch.now() - lost)))
    done = watch.progress()
    if not running() or (done and done[-1][1] >= args.steps):
        fault.note += f"; not started again: the job ended within {fault.seconds:g} s"
        return
    if fault.wipe:
        shutil.rmtree(disks[name], ignore_errors=True)
    held = newest(disks, job.current)
    key = job.start(name)
    fault.back_at = watch.now()
    fault.note += (
        f"; its script started again {fault.back_at - lost:.0f} s after"
        + (" on an empty disk" if fault.wipe else " on its old disk")
        + f" (newest checkpoint anywhere: step {held})"
    )
    until = time.monotonic() + args.recovery_timeout
    while time.monotonic() < until and job.proc(name).poll() is None and running():
        if fault.round_at is None:
            rounds = [t for t, k, _, members in watch.rounds() if k == key and name in members]
            fault.round_at = rounds[0] if rounds else None
        if (checkpoint_step(disks[name]) or 0) > held:
            fault.rejoined_at = watch.now()
            break
        time.sleep(0.25)
    if fault.round_at is None:
        rounds = [t for t, k, _, members in watch.rounds() if k == key and name in members]
        fault.round_at = rounds[0] if rounds else None


def inject(fault: Fault, job: ChaosJob, watch: Watch, net, disks: dict[str, str], args, running) -> None:
    sig = {"kill": signal.SIGKILL, "term": signal.SIGTERM}
    if fault.kind in ("kill", "term"):
        fault.note = signal_task(
            job, fault.targets[0], sig[fault.kind], fault.terms if fault.kind == "term" else None
        )
    elif fault.kind == "ps":
        fault.note = signal_task(job, "ps:0", signal.SIGKILL)
    elif fault.kind == "save":
        fault.note = kill_during_save(job, disks, args.save_wait, running)
        if fault.note is None:
            fault.injected_at = None  # the job ended while the fault waited for a save
    elif fault.kind == "gone":
        gone(fault, job, watch, disks, args, running)
    elif fault.kind == "link":
        name = job.stand_in(job.task_at(int(fault.targets[0])))
        i = job.machine_of[name]
        set_port(net, i, up=False)
        time.sleep(fault.seconds)
        set_port(net, i, up=True)
        fault.note = f"{net[i].hostname} ({args.roles[i]}) cut off {fault.seconds:g} s" + (
            "" if i == int(fault.targets[0]) else " (the machine drawn was off)"
        )
    else:
        notes = []
        for n, target in enumerate(fault.targets):
            if n:
                time.sleep(fault.seconds)
            kind, name = target.split()
            notes.append(signal_task(job, name, sig[kind], fault.terms if kind == "term" else None))
        fault.note = f", {fault.seconds:g} s later ".join(notes)


def orphans(net, workdirs, model_dirs, job: ChaosJob) -> tuple[list[str], list[str]]:
    """Processes, listening ports and temporary files left on any machine after the job; and the
    temporary folders of the starts a power-off killed (what a power cut leaves: not counted)."""
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
    cut = []
    for key in job.procs:
        tmp = job.tmpdir / key.replace(":", "-")
        (cut if key in job.powered_off else left).extend(glob.glob(os.path.join(tmp, "*")))
    return found + [f"file left: {p}" for p in left], cut


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
    label = ("chaos" if faults else "fault-free") + args.suffix
    cdir = pathlib.Path(work) / f"{strategy}{'-elastic' if args.elastic else ''}-{label}"
    cdir.mkdir()
    tmpdir = cdir / "tmp"
    tmpdir.mkdir()
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
        + ([f"task.train_data.global_batch_size={ELASTIC_BATCH}"] if args.elastic else [])
        + ([args.params_override] if args.params_override else [])
    )
    roles = args.roles = layout(strategy, args.elastic)
    net = netns.Network(len(roles))
    job = None
    try:
        cluster = job_cluster(cdir, net, roles, **(ELASTIC_KEYS if args.elastic else {}))
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
        t0, wall0 = time.monotonic(), time.time()  # wall0: the phase lines' `at` on the watch's clock
        job = ChaosJob(cdir, net, roles, scripts, tmpdir)
        disks = {n: str(model_dirs[i]) for n, i in job.machine_of.items() if roles[i] != "ps"}
        watch = Watch(job, disks, t0, everyone=args.elastic)
        watch.start()
        if args.elastic:
            # The job is over once a machine's od-dist up has exited (one that finished, or failed:
            # the others then get --wait_timeout to follow); a machine powered off is not waited for.
            running = lambda: all(job.proc(n).poll() is None for n in job.up())  # noqa: E731
        else:
            # The job is over once the master's machine's od-dist has exited, whatever the others do:
            # it writes the final checkpoint, and a failed job must show as failed, not as a hang.
            running = lambda: job.proc("master:0").poll() is None  # noqa: E731
        deadline = t0 + args.timeout
        while not watch.progress() and running() and time.monotonic() < deadline:
            time.sleep(0.5)
        for n, fault in enumerate(faults):
            last = faults[n - 1] if n else None
            if last and last.kind == "gone" and last.recovered_at is None:
                break  # the group without it never trained: no more faults; what happens is reported
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
            inject(fault, job, watch, net, disks, args, running)
            if fault.injected_at is None:
                break  # training ended before this fault could be made
            fault.since = fault.injected_at if fault.kind == "gone" else watch.now()
            if fault.kind in KILLS:
                # A loop that was ending as the fault came prints its line after it: training
                # counts as going on again from the restart the fault brought (none: no effect).
                fault.since = max(fault.since, first_death(watch, fault, running))
            # A task that a SIGTERM reached exits at the end of its loop: from then on. (Not one the
            # signal found restarting: it would wait for a death that never comes, and no fault after.)
            for name in fault.terms:
                key = job.current[name]
                until = time.monotonic() + args.recovery_timeout
                while time.monotonic() < until and running():
                    died = [t for t, line in watch.lines[key] if t >= fault.injected_at and " died " in line]
                    if died:
                        fault.since = max(fault.since, died[0])
                        break
                    time.sleep(0.5)
            print(
                f"  {fault.injected_at:7.1f} s  step {fault.before_step:5d}  {fault.kind:6s} {fault.note}",
                flush=True,
            )
            if fault.kind == "gone":
                print("           " + gone_figures(fault), flush=True)
        if args.elastic:
            while running() and time.monotonic() < deadline:
                time.sleep(0.5)
        else:
            job.wait(["master:0"], timeout=max(1.0, deadline - time.monotonic()))
        ended = watch.now()
        # The others end by themselves within --wait_timeout of the first's end (a task's life
        # in docs/roles.md); one still running then is reported as such (exit None), and killed below.
        job.wait([job.current[n] for n in job.up()], timeout=args.wait_timeout + 60)
        codes = {n: job.proc(n).poll() for n in job.current}
        watch.done.set()
        watch.join()
        final_rounds = watch.rounds()
        last_members = final_rounds[-1][3] if final_rounds else [n for n in disks]
        lead = next((n for n in sorted(last_members, key=job.machine_of.get) if n in disks), "master:0")
        finished = (
            all(codes[n] == 0 for n in (job.up() if args.elastic else ["master:0"]))
            and checkpoint_step(disks[lead]) == args.steps
        )
        for fault in faults:
            if fault.injected_at is None:
                continue
            if fault.recovered_at is None and fault.kind != "gone":
                got = watch.progress(after=fault.since)
                fault.recovered_at = got[0][0] if got else None
            if fault.recovered_at is None and fault.kind != "gone" and finished:
                # A SIGTERM in the last loop: the task saved the final step and its restart had
                # nothing left to train. The job finished, when the master's od-dist exited.
                fault.recovered_at = ended
                fault.note += " (the final step was saved; the job then finished)"
            end = fault.recovered_at if fault.recovered_at is not None else ended
            if fault.kind == "gone" and fault.rejoined_at is not None:
                end = fault.rejoined_at
            if fault.kind == "gone":
                first_steps(fault, watch)
            said = watch.said(fault.injected_at, end)
            if fault.kind == "gone":
                # Two recoveries, each read apart: the survivors' start to the smaller group's first
                # step, which ends before the machine's script starts again; then the larger group's.
                lost_end = next(
                    (t for t in (fault.smaller_step_at, fault.recovered_at) if t is not None), ended
                )
                fault.went = breakdown(watch.lines, wall0, fault.injected_at, lost_end)
                if fault.back_at is not None:
                    back_end = next(
                        (t for t in (fault.larger_step_at, fault.rejoined_at) if t is not None), ended
                    )
                    fault.went_back = breakdown(watch.lines, wall0, fault.back_at, back_end)
            else:
                fault.went = breakdown(watch.lines, wall0, fault.injected_at, end)
            # The round lines first: who trained after the fault.
            fault.said = [s for s in said if ROUND.search(s)] + [s for s in said if not ROUND.search(s)]
            # A restarted master (elastic: any new round) resumes from the checkpoint named last
            # before its first progress line: the steps printed beyond that are redone (at least).
            if args.elastic:
                restarted = any(ROUND.search(s) for s in fault.said)
                restored = max(
                    (s for seq in watch.on_disk.values() for t, s in seq if t <= end and s is not None),
                    default=0,
                )
            else:
                restarted = any("master:0" in s and "restart" in s for s in fault.said)
                restored = max((s for t, s in watch.ckpts if t <= end), default=0)
            reached = max((s for t, s in watch.progress() if t <= fault.since), default=0)
            fault.redone = max(0, reached - restored) if restarted else 0
        time.sleep(2)  # what a task leaves behind is left by now
        left, cut = orphans(
            net,
            [str(w) for w in workdirs.values()],
            sorted({str(d) for d in model_dirs.values()}),
            job,
        )
        return {
            "strategy": strategy,
            "wall_s": ended,
            "codes": codes,
            "starts": {k: job.procs[k].poll() for k in job.procs},
            "powered_off": sorted(job.powered_off),
            "down": sorted(job.down),
            "last_lines": {
                n: (lines[-1][1].strip()[:200] if lines else "")
                for n in job.current
                for lines in [watch.lines.get(job.current[n], [])]
            },
            "progress": watch.progress(),
            "ckpts": [s for _, s in watch.ckpts],
            "on_disk": {n: [s for _, s in seq] for n, seq in watch.on_disk.items()},
            "last_round": final_rounds[-1][2:] if final_rounds else None,
            "last_members": last_members,
            # The final checkpoint to evaluate: the master's, elastic the lead's of the last round.
            "model_dir": disks[lead] if args.elastic else str(model_dir),
            "lead": lead,
            # Each trainer's disk: every multi_worker_mirrored trainer keeps a copy.
            "trainer_dirs": {
                f"{roles[i]}@{net[i].hostname}": str(d) for i, d in model_dirs.items() if roles[i] != "ps"
            },
            "disk_of": {f"{roles[i]}@{net[i].hostname}": n for n, i in job.machine_of.items()},
            "override": override,
            "orphans": left,
            "cut": cut,
            "trained": [
                line.split("od-dist train: ", 1)[1]
                for key in job.procs
                for _, line in watch.lines.get(key, [])
                if "od-dist train: trained steps" in line
            ],
            "logs": str(cdir),
        }
    finally:
        if job:
            job.kill()
        net.close()


def first_steps(f: Fault, watch: Watch) -> None:
    """A loss's first steps: of the first round without the lost machine after the loss, and of
    its round once it is back (the first progress line after each round line)."""
    rounds = watch.rounds()
    without = [t for t, _, _, members in rounds if t > f.injected_at and f.lost not in members]
    if without:
        got = watch.progress(after=without[0])
        f.smaller_step_at = got[0][0] if got else None
    if f.round_at is not None:
        got = watch.progress(after=f.round_at)
        f.larger_step_at = got[0][0] if got else None


def since(t, t0) -> str:
    return f"{t - t0:.1f} s" if t is not None and t0 is not None else "not seen"


def gone_figures(f: Fault) -> str:
    """Each to a step trained (a progress line) and to a checkpoint newer than any before."""
    loss = (
        f"loss to the smaller group training: {since(f.smaller_step_at, f.injected_at)} to its first "
        f"step, {since(f.recovered_at, f.injected_at)} to a newer checkpoint"
    )
    if f.for_good or f.back_at is None:
        return loss
    return (
        f"{loss}; return to the larger group training: {since(f.larger_step_at, f.back_at)} to its first "
        f"step, {since(f.rejoined_at, f.back_at)} to a checkpoint on its disk (its round line "
        f"{since(f.round_at, f.back_at)})"
    )


def gone_went(f: Fault) -> str:
    """Where a loss went, after the power-off, to the smaller group's first step; and its return,
    after its script started again, to the larger group's."""
    back = f"; return (s after its script started): {describe(f.went_back)}" if f.went_back else ""
    return f"loss: {describe(f.went)}{back}"


def backwards_on(seq: list[int | None]) -> list[tuple[int, int]]:
    """Steps a disk's checkpoint file named after a later one; None (no checkpoint: a wiped
    disk) starts its count again."""
    out, last = [], None
    for s in seq:
        if s is not None and last is not None and s < last:
            out.append((last, s))
        last = s
    return out


def invariants(
    r: dict, faults: list[Fault], baseline: dict | None, args
) -> list[tuple[str, bool | None, str]]:
    rows = []
    final = max((s for _, s in r["progress"]), default=0)
    if args.elastic:
        # A machine lost for good took its od-dist with it; every other machine's last start
        # must exit 0. The starts a power-off killed are listed, not counted.
        up = {n: c for n, c in r["codes"].items() if n not in r["down"]}
        ok = bool(up) and set(up.values()) == {0} and final == args.steps
        bad = {n: c for n, c in up.items() if c != 0}
        evidence = (
            f"last progress step {final}/{args.steps}; each machine's last od-dist: {up}"
            + (f"; off at the end (lost for good, not counted): {r['down']}" if r["down"] else "")
            + f"; killed by a power-off: {r['powered_off'] or 'none'}"
        )
        name = "job ends at its final step, each machine's last od-dist exit 0 (but one lost for good)"
    else:
        ok = set(r["codes"].values()) == {0} and final == args.steps
        bad = {n: c for n, c in r["codes"].items() if c != 0}
        evidence = f"master's last progress step {final}/{args.steps}; exits {r['codes']}"
        name = "job ends at its final step, every od-dist exit 0"
    if bad:
        evidence += "; " + "; ".join(f"{n}: {r['last_lines'][n]}" for n in bad)
    rows.append((name, ok, evidence))
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
    if args.elastic:  # every trainer's disk, each in turn (a wiped one starts again)
        turns = {n: [s for s in seq] for n, seq in r["on_disk"].items()}
        backwards = {n: backwards_on(seq) for n, seq in turns.items() if backwards_on(seq)}
        rows.append(
            (
                "checkpoint steps never go backwards (each trainer's disk; None: wiped or none yet)",
                not backwards,
                f"named in turn: {turns}; backwards {backwards}",
            )
        )
    else:
        ckpts = r["ckpts"]
        backwards = [(a, b) for a, b in zip(ckpts, ckpts[1:]) if b < a]
        rows.append(
            (
                "checkpoint steps never go backwards",
                not backwards,
                f"named in turn: {ckpts}; backwards {backwards}",
            )
        )
    held = {name: checkpoint_step(d) for name, d in r["trainer_dirs"].items()}
    if args.elastic:
        # The members of the last round hold the final checkpoint; a machine lost for good, or
        # one that was off when the job ended, holds what it had.
        members = {name for name, task in r["disk_of"].items() if task in r["last_members"]}
        rows.append(
            (
                "the final checkpoint is the final step, on every disk of the last round's members",
                bool(members) and all(held[m] == args.steps for m in members),
                f"last round {r['last_round']}; each trainer's disk (None: no checkpoint): {held}",
            )
        )
    else:
        last = checkpoint_step(r["model_dir"])
        # Under parameter_server only the master's disk holds checkpoints; under multi_worker_mirrored
        # every trainer's does, and each must end at the final step.
        rows.append(
            (
                "the final checkpoint is the final step",
                last == args.steps and all(s in (None, args.steps) for s in held.values()),
                f"the master's checkpoint file names ckpt-{last}; each trainer's disk (None: no checkpoint): {held}",
            )
        )
    cut = f" (a power-off's leftovers, not counted: {len(r['cut'])} files in the killed starts' TMPDIR)"
    rows.append(
        (
            "no orphan process, port or temporary file",
            not r["orphans"],
            ("; ".join(r["orphans"][:8]) or "none") + (cut if r["cut"] else ""),
        )
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
                f"{r['ap50']:.3f} against {baseline['ap50']:.3f} ({d:+.3f})"
                + (f", {r['lead']}'s final checkpoint" if args.elastic else ""),
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
    back = [f for f in injected if f.back_at is not None]
    if back:
        rows.append(
            (
                "every machine back trained in the larger group",
                all(f.rejoined_at is not None for f in back),
                f"{sum(f.rejoined_at is not None for f in back)}/{len(back)}",
            )
        )
    return rows


def report(r: dict, faults: list[Fault], baseline: dict | None, args) -> None:
    print(
        f"\n### {r['strategy']}{' (elastic)' if args.elastic else ''}: {args.command}\n\nlogs in {r['logs']}\n"
    )
    print("| invariant | holds | evidence |\n|---|---|---|")
    for name, ok, evidence in invariants(r, faults, baseline, args):
        print(f"| {name} | {'n/a' if ok is None else 'pass' if ok else 'FAIL'} | {evidence} |")
    print(
        "\n| # | at (s) | step | fault | what od-dist printed | recovery (s) | where it went (s after the fault) "
        "| steps redone |\n|---|---|---|---|---|---|---|---|"
    )
    for n, f in enumerate(faults, 1):
        if f.injected_at is None:
            print(
                f"| {n} | | | {f.kind}: not injected (training ended or a fault before was not recovered) | | | | |"
            )
            continue
        rec = f"{f.recovered_at - f.injected_at:.1f}" if f.recovered_at is not None else "not recovered"
        if f.kind == "gone":
            rec += "; " + gone_figures(f)
        said = "<br>".join(s.replace("|", "/") for s in f.said[:3]) or "(nothing)"
        print(
            f"| {n} | {f.injected_at:.0f} | {f.before_step} | {f.kind}: {f.note} | {said} | {rec} | "
            f"{describe(f.went) if f.kind != 'gone' else gone_went(f)} | {f.redone} |"
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
    went = [f.went for f in injected if f.went]
    print(
        f"where recovery went, median s after the fault (faults): {medians(went) or 'no lines'}", flush=True
    )
    if args.elastic:
        lost = [f for f in injected if f.kind == "gone"]

        def listed(pairs) -> str:
            return ", ".join(f"{t - t0:.1f}" for t, t0 in pairs if t is not None and t0 is not None) or "none"

        print(
            f"elastic: {len(lost)} machines lost; loss to the smaller group training (s): to its first step "
            f"{listed((f.smaller_step_at, f.injected_at) for f in lost)}, to a newer checkpoint "
            f"{listed((f.recovered_at, f.injected_at) for f in lost)}; return to the larger group training "
            f"(s): to its first step {listed((f.larger_step_at, f.back_at) for f in lost)}, to a checkpoint "
            f"on its disk {listed((f.rejoined_at, f.back_at) for f in lost)} (to its round line: "
            f"{listed((f.round_at, f.back_at) for f in lost)})",
            flush=True,
        )
        returns = [f.went_back for f in lost if f.went_back]
        if returns:
            print(
                f"where the returns went, median s after the script started again (returns): {medians(returns)}",
                flush=True,
            )
        for line in sorted(set(r["trained"])):
            print(f"who trained when: {line}", flush=True)


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
        "--elastic",
        action="store_true",
        help=f"multi_worker_mirrored on 3 trainer machines, min_trainers 2, global batch {ELASTIC_BATCH}; "
        "adds the fault `gone` (a machine lost, and back)",
    )
    parser.add_argument(
        "--gone_for_good",
        action="store_true",
        help="with --elastic: the schedule's last `gone` never comes back (the group of 2 finishes)",
    )
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
    parser.add_argument(
        "--against",
        help="another checkout of od-dist (git worktree add DIR COMMIT): the same schedule then runs on "
        "its code too, and a last line compares the recoveries",
    )
    args = parser.parse_args(argv)
    args.suffix = ""
    if args.against and not os.path.isfile(os.path.join(args.against, "od_dist", "__init__.py")):
        parser.error(f"--against: {args.against}: not an od-dist checkout")
    if args.elastic and args.strategy not in (None, "multi_worker_mirrored"):
        parser.error("--elastic is multi_worker_mirrored's (parameter_server takes no min_trainers)")
    if args.gone_for_good and not args.elastic:
        parser.error("--gone_for_good needs --elastic")
    if args.elastic and args.shared_model_dir:
        parser.error("--elastic keeps each machine's --model_dir on its own disk (a `gone` may wipe it)")
    args.command = "benchmarks/chaos.py " + " ".join(argv if argv is not None else sys.argv[1:])
    prepared = simulated_work("od-dist-chaos-", args.keep, args.num_val)
    if not prepared:
        return 0
    work, data = prepared
    print(f"logs in {work}", flush=True)
    strategies = ["multi_worker_mirrored"] if args.elastic else None
    for strategy in strategies or ([args.strategy] if args.strategy else sorted(LAYOUTS, reverse=True)):
        baseline = None
        if not args.no_baseline:
            print(f"{strategy}: fault-free run", flush=True)
            baseline = run_job(strategy, [], args, work, data)
            baseline["ap50"], baseline["eval"] = evaluate(baseline["model_dir"], baseline["override"])
            print(f"  {baseline['wall_s']:.0f} s, exits {baseline['codes']}, {baseline['eval']}", flush=True)
        faults = schedule(strategy, args.seed, args.faults, args.elastic, args.gone_for_good)
        print(f"{strategy}: chaos run, {len(faults)} faults (seed {args.seed})", flush=True)
        for n, f in enumerate(faults, 1):
            more = ""
            if f.kind == "gone":
                more = (
                    " for good"
                    if f.for_good
                    else f", back after {f.seconds:g} s{', disk wiped' if f.wipe else ''}"
                )
            print(
                f"  planned {n}: {f.kind} {' / '.join(f.targets)}{more}, {f.delay_s:g} s after the last recovery",
                flush=True,
            )
        r = run_job(strategy, faults, args, work, data)
        r["ap50"], r["eval"] = (
            evaluate(r["model_dir"], r["override"])
            if checkpoint_step(r["model_dir"])
            else (None, "no checkpoint")
        )
        report(r, faults, baseline, args)
        if args.against:
            compare(strategy, faults, args, work, data)
    return 0


def compare(strategy: str, faults: list[Fault], args, work: str, data: str) -> None:
    """The same schedule on the --against checkout's code (every machine's processes import od_dist
    from there: tests/netns.py), then one line a code: its recovery median and max, its phases'."""
    theirs = schedule(strategy, args.seed, args.faults, args.elastic, args.gone_for_good)
    os.environ[netns.CODE_ENV] = os.path.abspath(args.against)
    args.suffix = "-against"
    try:
        print(f"{strategy}: the same schedule on {args.against}", flush=True)
        r = run_job(strategy, theirs, args, work, data)
        r["ap50"], r["eval"] = (None, "not evaluated")
        report(r, theirs, None, args)
    finally:
        del os.environ[netns.CODE_ENV]
        args.suffix = ""
    for name, run in (("this code", faults), (args.against, theirs)):
        times = [
            f.recovered_at - f.injected_at
            for f in run
            if f.injected_at is not None and f.recovered_at is not None
        ]
        went = medians([f.went for f in run if f.went]) or "no lines"
        print(
            f"{strategy}, {name}: recovery median {statistics.median(times) if times else float('nan'):.1f} s, "
            f"max {max(times, default=float('nan')):.1f} s over {len(times)} faults; {went}",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
