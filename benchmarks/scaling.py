"""Does adding machines train the detector faster? Measured on simulated machines on one box.

    sudo .venv/bin/python benchmarks/scaling.py [--cases one,mwm2,mwm3,ps2] [--links unshaped,100mbit]
        [--steps 150] [--steps_per_loop 25] [--cores 0.6] [--ps_cores 0.4] [--period_ms 100]
        [--json out.json] [--keep DIR]
    sudo .venv/bin/python benchmarks/scaling.py --accuracy [--recipe examples|steps] [--target_ap50 0.95]
    sudo .venv/bin/python benchmarks/scaling.py --odapi_config PIPELINE.config [--steps 30]

Each machine is a network namespace (tests/netns.py) with its own address, a CPU cap (a cgroup:
cgroup v1 `cpu.cfs_quota_us` or v2 `cpu.max`, whichever the box has) and, per link setting, a rate
on its link (`tc qdisc ... tbf` on its eth0: what it sends, so every link is capped both ways).
Each machine's task starts from the `.sh` that `od-dist scripts` wrote for it, as a user would
start it; the one-machine baseline is `od-dist train` without a cluster. Demo pipeline
(pipelines/shapes_retinanet.yaml), generated shapes data.

Cases (`--cases`, comma-separated; a case may carry, in brackets, a params override, train flags
or a setting of its machines: `mwm2[runtime.all_reduce_alg=ring]`, `mwm2[--intra_op_threads=1]`,
`mwm2[@period_ms=10]`, `mwm3[@last_cores=1.2]` (the last machine's CPU cap: a faster machine), or of the
cluster file: `mwm3[@sync_every=25]`, with `@outer_learning_rate=0.7` and `@outer_momentum=0.9` for
DiLoCo's outer step):

  one         one machine, no cluster: the baseline
  mwmN        multi_worker_mirrored, master + N-1 workers, one per machine; the per-machine batch
              stays 8 (global batch 8 x N), as a user adding machines does
  psN         parameter_server: master and one ps on a small machine (--ps_cores), a worker on
              each of N other machines; global batch 8 (each step runs on one worker)
  psNeach     parameter_server: master alone on a small machine, a worker and a ps on each of N
              other machines (the variables spread over every worker machine's link)

Per case and link setting: steady examples/s (examples over the steady loops / their wall time:
the first two loops, with tracing, are left out), the speed-up against `one` on the same link
setting in the same run, scaling efficiency (speed-up / trainer machines), bytes each machine
sent per step (interface counters over the steady loops), and a step breakdown per machine:
busy (CPU seconds used / what its cap allows: computing, serialising, gRPC) and idle (waiting for
the network or a peer), with the share of its link's rate its traffic used.

Time to accuracy (`--accuracy`; cases default one,mwm2,mwm3, links unshaped): the demo as shipped
(1000 steps of 8 images on one machine, `--steps` to change) on a 2000-image training split. With
`--recipe examples` (the default) an N-machine case trains steps/N steps with
`--fixed_replica_batch` (8 images per machine, the learning rate x N), its schedule and warmup
shortened to match, so every case sees the same examples; with `--recipe steps` every case trains
the demo's steps and schedule at its global batch of 8, split over the machines (the default
without `--fixed_replica_batch`): the same training, each step faster. Every case keeps a
checkpoint every tenth of its steps; after all cases trained, each checkpoint is evaluated (COCO
AP50 on the 200 held-out images, outside the caps) and the table gives the time from the start to
the write of the first checkpoint with AP50 >= --target_ap50, and the last checkpoint's AP50
against one machine's.

The real-size workload (`--odapi_config`, throughput): an Object Detection API pipeline.config,
imported with `od-dist pipeline import` as a user would, on shapes data generated at the imported
pipeline's input size, for example SSD MobileNet V2 FPNLite 320 (384x384 in Model Garden, its 90
classes as published), whose step costs far more compute per byte of gradients than the demo's:

    sudo .venv/bin/python benchmarks/scaling.py --cases one,mwm2,mwm3 --steps 30 --steps_per_loop 5 \
        --odapi_config tests/odapi_configs/ssd_mobilenet_v2_fpnlite_320x320_coco17_tpu-8.config

Needs root (namespaces, cgroups, tc); says why and exits 0 otherwise. Run it at normal priority: the
caps then hold against niced background load. Figures are noisy; compare only within one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
import capped  # noqa: E402 (the tests' CPU caps and link rates)
import netns  # noqa: E402 (the tests' simulated machines)

PIPELINE = os.path.join(REPO, "pipelines", "shapes_retinanet.yaml")
PY = sys.executable
PORT = 2222
PER_MACHINE_BATCH = 8
DEFAULT_CASES = "one,mwm2,mwm3,ps2"
DEFAULT_LINKS = "unshaped,100mbit"
ACCURACY_CASES = "one,mwm2,mwm3"
CLUSTER_KEYS = ("sync_every", "outer_learning_rate", "outer_momentum")  # @key=value of an mwm case
PROGRESS = re.compile(r"od-dist train \| step (\d+)/\d+ .*?\| ([\d.]+) steps/s \| ([\d.]+) examples/s")


@dataclass
class Case:
    name: str  # as given, with its brackets
    kind: str  # one, mwm, ps, pseach
    n: int  # trainer machines (mwm: all trainers; ps: workers)
    override: str = ""
    flags: list = field(default_factory=list)
    harness: dict = field(default_factory=dict)  # @period_ms=10: this case's machines

    @property
    def trainers(self) -> int:
        return self.n

    def machines(self) -> int:
        return 1 if self.kind == "one" else self.n if self.kind == "mwm" else self.n + 1

    def global_batch(self) -> int:
        return PER_MACHINE_BATCH * (self.n if self.kind == "mwm" else 1)


def parse_case(text: str) -> Case:
    m = re.fullmatch(r"(one|mwm|ps)(\d*)(each)?(?:\[(.*)\])?", text.strip())
    if not m or (m.group(1) != "one" and not m.group(2)) or (m.group(3) and m.group(1) != "ps"):
        raise SystemExit(f"--cases: {text!r}: use one, mwmN, psN or psNeach, optionally with [overrides]")
    kind = m.group(1) + (m.group(3) or "")
    inside = [p for p in (m.group(4) or "").split(",") if p]
    flags = [p for p in inside if p.startswith("--")]
    harness = {k[1:]: float(v) for k, v in (p.split("=", 1) for p in inside if p.startswith("@"))}
    if set(harness) - {"period_ms", "last_cores", *CLUSTER_KEYS}:
        raise SystemExit(
            f"--cases: {text!r}: the settings are @period_ms=N, @last_cores=C (the last machine's CPU cap) "
            f"and the cluster file's @{', @'.join(CLUSTER_KEYS)}"
        )
    if m.group(1) != "mwm" and set(harness) & set(CLUSTER_KEYS):
        raise SystemExit(f"--cases: {text!r}: sync_every applies to mwmN cases")
    override = ",".join(p for p in inside if not p.startswith(("--", "@")))
    return Case(text.strip(), kind, int(m.group(2) or 1), override, flags, harness)


def roles(case: Case) -> dict[int, list[str]]:
    """Machine index -> the tasks it runs ("master", "worker", "ps")."""
    if case.kind == "one":
        return {0: ["single"]}
    if case.kind == "mwm":
        return {0: ["master"], **{i: ["worker"] for i in range(1, case.n)}}
    if case.kind == "ps":
        return {0: ["master", "ps"], **{i: ["worker"] for i in range(1, case.n + 1)}}
    return {0: ["master"], **{i: ["worker", "ps"] for i in range(1, case.n + 1)}}


def cluster_text(case: Case, net, work: str) -> str:
    """The cluster file: every task on its machine's address, ps on PORT + 1 when it shares one."""
    by_role: dict[str, list[str]] = {"master": [], "worker": [], "ps": []}
    for i, tasks in sorted(roles(case).items()):
        for t in tasks:
            by_role[t].append(f"{net[i].ip}:{PORT + (1 if t == 'ps' else 0)}")
    lines = [f"master: {by_role['master'][0]}", f"worker: [{', '.join(by_role['worker'])}]"]
    for key in CLUSTER_KEYS:
        if key in case.harness:
            value = case.harness[key]
            lines.append(f"{key}: {int(value) if key == 'sync_every' else value}")
    if by_role["ps"]:
        lines.append(f"ps: [{', '.join(by_role['ps'])}]")
    lines.append("hosts:")
    for m in net:
        workdir = os.path.join(work, m.hostname)
        os.makedirs(workdir, exist_ok=True)
        lines.append(f"  {m.ip}: {{os: linux, python: '{PY}', workdir: '{workdir}'}}")
    return "\n".join(lines) + "\n"


def accuracy_override(case: Case, args, data_dir: str) -> str:
    """--recipe examples: the demo's own schedule, shortened N times for N machines (each step sees
    N times the examples under --fixed_replica_batch). --recipe steps: the demo as it is, its
    global batch split over the machines. A checkpoint kept every tenth of the run."""
    split = args.recipe == "steps" or case.kind == "one"
    steps = args.steps if split else -(-args.steps // case.n)
    parts = [
        f"trainer.train_steps={steps}",
        f"trainer.steps_per_loop={max(1, steps // 10)}",
        f"trainer.summary_interval={max(1, steps // 10)}",
        f"trainer.checkpoint_interval={max(1, steps // 10)}",
        "trainer.max_to_keep=100",
        f"trainer.optimizer_config.learning_rate.cosine.decay_steps={steps}",
        f"trainer.optimizer_config.warmup.linear.warmup_steps={100 if split else max(1, 100 // case.n)}",
        f"task.train_data.global_batch_size={PER_MACHINE_BATCH}",
        f"task.train_data.input_path={data_dir}/train.tfrecord",
        f"task.validation_data.input_path={data_dir}/val.tfrecord",
    ]
    return ",".join(parts + ([case.override] if case.override else []))


def params_override(case: Case, args, data_dir: str) -> str:
    if args.accuracy:
        return accuracy_override(case, args, data_dir)
    parts = [
        f"trainer.train_steps={args.steps}",
        f"trainer.steps_per_loop={args.steps_per_loop}",
        f"trainer.summary_interval={args.steps_per_loop}",
        f"trainer.checkpoint_interval={args.steps}",  # one save, after the last loop
        f"task.train_data.global_batch_size={case.global_batch()}",
        f"task.train_data.input_path={data_dir}/train.tfrecord",
        f"task.validation_data.input_path={data_dir}/val.tfrecord",
    ]
    return ",".join(parts + ([case.override] if case.override else []))


class Monitor(threading.Thread):
    """Tails the master's log; at each progress line, snapshots every machine's sent bytes and
    CPU seconds, so rates, bytes and CPU are taken over the same steady loops."""

    def __init__(self, log: str, net, caps):
        super().__init__(daemon=True)
        self.log, self.net, self.caps = log, net, caps
        self.points: list[dict] = []
        self.done = threading.Event()

    def snapshot(self, step: int, rate: float) -> dict:
        return {
            "t": time.monotonic(),
            "step": step,
            "examples_s": rate,
            "tx": [capped.tx_bytes(m) for m in self.net],
            "cpu": [c.usage_s() for c in self.caps],
        }

    def run(self):
        seen = 0
        while not self.done.is_set():
            try:
                text = open(self.log, errors="replace").read()
            except FileNotFoundError:
                text = ""
            found = PROGRESS.findall(text)
            for step, steps_s, rate in found[seen:]:
                point = self.snapshot(int(step), float(rate))
                point["batch"] = round(float(rate) / float(steps_s)) if float(steps_s) else 0
                self.points.append(point)
            seen = len(found)
            self.done.wait(0.2)


def run_case(case: Case, link: str, args, work: str, data_dir: str) -> dict:
    tag = re.sub(r"[^A-Za-z0-9]+", "-", f"{case.name}-{link}").strip("-")
    cdir = os.path.join(work, tag)
    for n in range(2, 100):  # a case listed twice runs twice
        if not os.path.exists(cdir):
            break
        cdir = os.path.join(work, f"{tag}-{n}")
    os.makedirs(cdir)
    model_dir = os.path.join(cdir, "model")
    layout = roles(case)
    net = netns.Network(case.machines())
    caps = []
    procs: dict[str, subprocess.Popen] = {}
    result = {"case": case.name, "link": link, "machines": case.machines(), "load_before": os.getloadavg()}
    try:
        for i, m in enumerate(net):
            small = case.kind in ("ps", "pseach") and i == 0
            period_us = int(1000 * case.harness.get("period_ms", args.period_ms))
            cores = args.ps_cores if small else args.cores
            if i == len(net) - 1 and "last_cores" in case.harness:  # a machine of another speed
                cores = case.harness["last_cores"]
            caps.append(capped.CpuCap(f"{tag}-m{i}", cores, period_us))
            if link != "unshaped":
                capped.shape(m, link)
        override = params_override(case, args, data_dir)
        if args.accuracy and args.recipe == "examples" and case.kind != "one":
            case = dataclasses.replace(case, flags=case.flags + ["--fixed_replica_batch"])
        commands: dict[str, tuple] = {}
        if case.kind == "one":
            commands["single"] = (
                0,
                [PY, "-m", "od_dist", "train", f"--pipeline={args.pipeline}", f"--model_dir={model_dir}"]
                + [f"--params_override={override}", *case.flags],
            )
        else:
            cluster = os.path.join(cdir, "cluster.yaml")
            with open(cluster, "w") as f:
                f.write(cluster_text(case, net, cdir))
            out = os.path.join(cdir, "scripts")
            subprocess.run(
                [PY, "-m", "od_dist", "scripts", f"--cluster={cluster}", f"--pipeline={args.pipeline}"]
                + [f"--model_dir={model_dir}", f"--params_override={override}", "--max_restarts=0"]
                + ["--wait_timeout=300", f"--out={out}", *case.flags],
                check=True,
                capture_output=True,
                timeout=120,
                cwd=REPO,
            )
            # One script a machine, named after its tasks ("ps-0_master-0.sh"), as a user gets them.
            scripts = {
                frozenset(name[: -len(".sh")].split("_")): name
                for name in os.listdir(out)
                if name.endswith(".sh")
            }
            counters: dict[str, int] = {}
            for i, tasks in sorted(layout.items()):
                names = []
                for t in tasks:
                    names.append(f"{t}-{counters.get(t, 0)}")
                    counters[t] = counters.get(t, 0) + 1
                name = "master:0" if "master-0" in names else names[0].replace("-", ":")
                commands[name] = (i, ["bash", os.path.join(out, scripts[frozenset(names)])])
        lead = "single" if case.kind == "one" else "master:0"
        logs = {name: os.path.join(cdir, name.replace(":", "-") + ".log") for name in commands}
        monitor = Monitor(logs[lead], net, caps)
        start, start_time = time.monotonic(), time.time()
        for name, (i, argv) in commands.items():
            with open(logs[name], "w") as log:
                # keep_sys: a task sees its machine's CPU limit, as it does in a container.
                procs[name] = subprocess.Popen(
                    net[i].command(argv, keep_sys=True),
                    env=netns.machine_env(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=REPO,
                    preexec_fn=caps[i].enter,
                )
        monitor.start()
        deadline = start + args.timeout
        for name, p in procs.items():
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        monitor.done.set()
        monitor.join()
        result["wall_s"] = time.monotonic() - start
        result["model_dir"], result["override"] = model_dir, override
        result["start_time"] = start_time
        result["codes"] = {n: p.poll() for n, p in procs.items()}
        result["load_after"] = os.getloadavg()
        result["failed"] = any(c != 0 for c in result["codes"].values())
        if result["failed"]:
            result["tail"] = {n: open(logs[n], errors="replace").read()[-1500:] for n in logs}
        result.update(summarise(monitor.points, case, link, layout, caps, args))
        result["startup"] = startup(model_dir, start_time, result.get("step_s"))
        lead_log = "train" if case.kind == "one" else "master-0"
        result.update(model_bytes(logs.get("master:0")))
        result["first_step_s"] = result["startup"].get(lead_log, {}).get("total")
        result["examples_per_s"] = result.get("steady_examples_s")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        net.close()
        for c in caps:
            c.close()
    return result


GRADIENTS = re.compile(r"network: each step all-reduces ([\d.]+) MB of gradients(.*all-reduced in bfloat16)?")
MEETING = re.compile(r"each meeting all-reduces ([\d.]+) MB( in bfloat16)?")


def model_bytes(master_log: str | None) -> dict:
    """The model's bytes as the master says them, in float32 (a bfloat16 job says half): the
    gradients a step all-reduces, or the weights and statistics a meeting does."""
    try:
        text = open(master_log, errors="replace").read() if master_log else ""
    except FileNotFoundError:
        return {}
    found = {}
    if m := GRADIENTS.search(text):
        found["grad_bytes"] = float(m.group(1)) * 1e6 * (2 if m.group(2) else 1)
    if m := MEETING.search(text):
        found["weight_bytes"] = float(m.group(1)) * 1e6 * (2 if m.group(2) else 1)
    return found


def link_bytes_per_s(link: str) -> float | None:
    """tc's rate (e.g. 9mbit, 1gbit) in bytes a second; None unshaped."""
    m = re.fullmatch(r"([\d.]+)(k|m|g)bit", link)
    return float(m.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)] / 8 if m else None


def prediction(case: Case, link: str, results: list[dict], base_eps: float | None):
    """od-dist's own prediction of this case's speed-up (cluster/advice.py) from the figures of
    this run: one machine's step, the model's bytes as the masters said them, the link's rate."""
    from od_dist.cluster import advice

    rate = link_bytes_per_s(link)
    grads = next((r["grad_bytes"] for r in results if r.get("grad_bytes")), None)
    weights = next((r["weight_bytes"] for r in results if r.get("weight_bytes")), None)
    if case.kind != "mwm" or not rate or not base_eps or not grads or not weights:
        return None
    step_s = PER_MACHINE_BATCH / base_eps
    wire = 2 if "--all_reduce_dtype=bfloat16" in case.flags else 4
    every = int(case.harness["sync_every"]) if "sync_every" in case.harness else None
    return advice.predict_case(case.n, "multi_worker_mirrored", weights, grads, step_s, rate, every, wire)


def predictions_report(results: list[dict], cases: list[Case]) -> list[str]:
    """Each mwm case's predicted throughput speed-up beside the measured one (steady examples/s
    against one machine's on the same link in the same run)."""
    from od_dist.cluster import advice

    lines = []
    for r in results:
        case = next((c for c in cases if c.name == r["case"]), None)
        base = next((x for x in results if x["case"] == "one" and x["link"] == r["link"]), None)
        base_eps = (base or {}).get("steady_examples_s")
        if case is None or not r.get("steady_examples_s") or not base_eps:
            continue
        p = prediction(case, r["link"], results, base_eps)
        if p is not None and p.speedup:
            measured = r["steady_examples_s"] / base_eps
            lines.append(f"{r['case']:<34} {r['link']:<9} {advice.against_measured(p, measured)}")
    if lines:
        lines.insert(
            0, "od-dist's prediction (cluster/advice.py) against the measured speed-up of throughput:"
        )
    return lines


# Evaluates each checkpoint of a model_dir in turn, in one process (TensorFlow imported once): a
# scratch model_dir whose checkpoint state names that checkpoint. Prints one JSON line per checkpoint.
EVAL_EACH = """
import glob, json, os, re, sys, tempfile
import tensorflow as tf
from od_dist.task import devices, trainer
from od_dist.model import pipeline
model_dir, override = sys.argv[1], sys.argv[2]
devices.apply_policy()
params = pipeline.load_pipeline(sys.argv[3], override, "mirrored")
paths = sorted(glob.glob(os.path.join(model_dir, "ckpt-*.index")), key=lambda p: int(re.search(r"ckpt-(\\d+)", p).group(1)))
for index in paths:
    ckpt = index[: -len(".index")]
    with tempfile.TemporaryDirectory(prefix="od-dist-eval-") as scratch:
        tf.compat.v1.train.update_checkpoint_state(scratch, ckpt)
        m = trainer.evaluate_latest(params, scratch)
    print(json.dumps({"ckpt": ckpt, "written": os.path.getmtime(index), "step": m["step"], "AP50": m["AP50"]}), flush=True)
"""


# Start-up phases, from the lines each trainer's log stamps (absl's local time): imports end where the
# device policy is applied, the model is built when Model Garden's trainer starts, the trainer's
# set-up (datasets, optimizer slots, restore) ends where the first loop starts. The first step's
# end is not logged: it is the first loop's end less the loop's other steps at the steady rate.
PHASES = (
    ("imports", "od-dist device policy"),
    ("model", "Running default trainer"),
    ("set_up", "training until step"),
)
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")
PHASE_COLUMNS = ("imports", "model", "set_up", "first_step", "total")
FIRST_LOOP = re.compile(r"train \| step:\s+(\d+) \| steps/sec")


def startup(model_dir: str, start_time: float, step_s: float | None) -> dict:
    """{trainer log name: {phase: seconds, ..., "first_step": seconds since the start}}."""
    found = {}
    logs_dir = os.path.join(model_dir, "logs")
    for name in sorted(os.listdir(logs_dir)) if os.path.isdir(logs_dir) else []:
        if not name.startswith(("train", "master", "worker")):
            continue
        stamps, first_loop = {}, None
        for line in open(os.path.join(logs_dir, name), errors="replace"):
            m = STAMP.match(line)
            if not m:
                continue
            t = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
            for phase, marker in PHASES:
                if marker in line and phase not in stamps:
                    stamps[phase] = t - start_time
            loop = FIRST_LOOP.search(line)
            if loop and first_loop is None and "set_up" in stamps:
                first_loop = (int(loop.group(1)), t - start_time)
        if len(stamps) < len(PHASES):
            continue
        phases, before = {}, 0.0
        for phase, _ in PHASES:
            phases[phase] = stamps[phase] - before
            before = stamps[phase]
        if first_loop and step_s:
            steps, end = first_loop
            phases["first_step"] = end - (steps - 1) * step_s - before
            phases["total"] = end - (steps - 1) * step_s
        found[name[: -len(".log")]] = {k: round(v, 1) for k, v in phases.items()}
    return found


def evaluate_checkpoints(result: dict, args) -> None:
    """AP50 of every checkpoint the case kept, and the time from its start to each one's write."""
    r = subprocess.run(
        [PY, "-c", EVAL_EACH, result["model_dir"], result["override"], args.pipeline],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=3600,
    )
    curve = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    if r.returncode != 0 or not curve:
        result["eval_error"] = (r.stdout + r.stderr)[-1500:]
        return
    for point in curve:
        point["seconds"] = point.pop("written") - result["start_time"]
    result["curve"] = curve
    reached = [p for p in curve if p["AP50"] >= args.target_ap50]
    result["time_to_target_s"] = reached[0]["seconds"] if reached else None
    result["final_ap50"] = curve[-1]["AP50"]


def accuracy_report(results: list[dict], args) -> str:
    base = next((r for r in results if r["case"] == "one" and "curve" in r), None)
    lines = [
        f"time to AP50 >= {args.target_ap50} (from the start to the write of the first checkpoint "
        "that reaches it), and the last checkpoint's AP50",
        f"{'case':<10} {'steps':>5} {'batch':>5} {'examples/s':>10} {'to target':>10} {'speed-up':>8} "
        f"{'final AP50':>10} {'vs one':>7}",
    ]
    for r in results:
        if "curve" not in r:
            lines.append(f"{r['case']:<10} failed: {r.get('codes')} {r.get('eval_error', '')[-300:]}")
            continue
        t = r["time_to_target_s"]
        speed = base["time_to_target_s"] / t if base and t and base["time_to_target_s"] else None
        lines.append(
            f"{r['case']:<10} {r['curve'][-1]['step']:>5} {r.get('batch', 0):>5} "
            f"{r.get('steady_examples_s', 0):>10.1f} "
            + (f"{t:>9.0f}s" if t else f"{'not reached':>10}")
            + (f" {speed:>7.2f}x" if speed else f" {'-':>8}")
            + f" {r['final_ap50']:>10.3f} "
            + (f"{r['final_ap50'] - base['final_ap50']:>+7.3f}" if base else "")
        )
        lines.append(
            "           AP50 by checkpoint (s: AP50): "
            + ", ".join(f"{p['seconds']:.0f}: {p['AP50']:.3f}" for p in r["curve"])
        )
    return "\n".join(lines)


def summarise(points, case: Case, link: str, layout, caps, args) -> dict:
    steady = points[2:] if len(points) >= 4 else points[1:]
    if len(steady) < 2:
        return {"steady_examples_s": 0.0, "loops": len(points)}
    first, last = steady[0], steady[-1]
    dt, steps = last["t"] - first["t"], last["step"] - first["step"]
    batch = last["batch"] or case.global_batch()  # as the master printed it (overrides, flags)
    # Under parameter_server each step runs on one worker: a worker takes `workers` global
    # steps' time for each of its own steps.
    own_step_s = dt / steps * (case.n if case.kind in ("ps", "pseach") else 1)
    rate_bits = None if link == "unshaped" else capped.rate_bits(link)
    per_machine = []
    for i, tasks in sorted(layout.items()):
        sent = last["tx"][i] - first["tx"][i]
        cpu = last["cpu"][i] - first["cpu"][i]
        busy = cpu / (dt * caps[i].cores)  # share of its cap it used
        per_machine.append(
            {
                "tasks": "+".join(tasks),
                "cores": caps[i].cores,
                "bytes_per_step": sent / steps,
                "busy": busy,
                "link_use": (sent * 8 / dt / rate_bits) if rate_bits else None,
                # A trainer's own step: computing (CPU at its cap, gRPC included) and idle
                # (waiting for bytes or for a peer); the link's share: its bytes at the rate.
                "compute_ms": 1000 * own_step_s * min(busy, 1.0),
                "idle_ms": 1000 * own_step_s * max(0.0, 1 - busy),
                "link_ms": 1000 * own_step_s * (sent * 8 / dt / rate_bits) if rate_bits else None,
            }
        )
    return {
        "batch": batch,
        "steady_examples_s": steps * batch / dt,
        "median_loop_examples_s": statistics.median(p["examples_s"] for p in steady[1:]),
        "step_s": dt / steps,
        "steady_steps": steps,
        "loops": len(points),
        "per_machine": per_machine,
    }


def report(results: list[dict], cases: list[Case], links: list[str], args) -> str:
    # A case listed more than once (e.g. `one,mwm2,one`): the median of its runs, all shown.
    runs: dict[tuple, list] = {}
    for r in results:
        if not r.get("failed") and r.get("steady_examples_s"):
            runs.setdefault((r["case"], r["link"]), []).append(r)
    by = {}
    for key, rs in runs.items():
        by[key] = dict(rs[-1], steady_examples_s=statistics.median(x["steady_examples_s"] for x in rs))
        by[key]["runs"] = [round(x["steady_examples_s"], 1) for x in rs]
    for r in results:
        by.setdefault((r["case"], r["link"]), r)
    lines = [
        f"{'case':<34} {'link':<9} {'examples/s':>10} {'speed-up':>8} {'eff.':>5} {'step ms':>7}  "
        "per machine: tasks, sent KB/step, busy % of cap, link use %",
    ]
    for link in links:
        for case in {c.name: c for c in cases}.values():
            # Against one machine with the same bracketed settings when the run has it.
            same = "one" + case.name[case.name.index("[") :] if "[" in case.name else "one"
            base = (by.get((same, link)) or by.get(("one", link)) or {}).get("steady_examples_s")
            r = by.get((case.name, link))
            if r is None:
                continue
            eps = r.get("steady_examples_s", 0.0)
            if r.get("failed") or not eps:
                lines.append(f"{case.name:<34} {link:<9} failed: exit codes {r.get('codes')}")
                continue
            speed = eps / base if base else float("nan")
            eff = speed / case.trainers
            machines = "; ".join(
                f"{m['tasks']} {m['bytes_per_step'] / 1e3:.0f} KB {100 * m['busy']:.0f}%"
                + (f" {100 * m['link_use']:.0f}%" if m["link_use"] is not None else "")
                for m in r["per_machine"]
            )
            lines.append(
                f"{case.name:<34} {link:<9} {eps:>10.1f} {speed:>7.2f}x {eff:>5.2f} "
                f"{1000 * r['step_s']:>7.0f}  {machines}"
                + (f" (runs: {', '.join(map(str, r['runs']))})" if len(r.get("runs", ())) > 1 else "")
            )
    predicted = predictions_report(results, cases)
    lines += ["", *predicted] if predicted else []
    lines += [
        "",
        "step breakdown of each trainer machine (its own step): compute = CPU at its cap (gRPC",
        "included), idle = waiting for bytes or peers, link = its sent bytes at the link rate",
    ]
    for r in results:
        if r.get("failed") or not r.get("per_machine"):
            continue
        parts = []
        for m in r["per_machine"]:
            if m["tasks"] in ("master", "master+ps") and r["case"].startswith("ps"):
                parts.append(f"{m['tasks']} busy {100 * m['busy']:.0f}%")
                continue
            link = f" link {m['link_ms']:.0f}" if m["link_ms"] is not None else ""
            parts.append(f"{m['tasks']} {m['compute_ms']:.0f} compute {m['idle_ms']:.0f} idle{link}")
        lines.append(f"{r['case']:<34} {r['link']:<9} batch {r['batch']:>2}: " + "; ".join(parts) + " (ms)")
    return "\n".join(lines)


def startup_report(results: list[dict]) -> str:
    lines = [
        "start-up of each trainer, in seconds: imports (Python, TensorFlow, Model Garden), model build "
        "(and its check), trainer set-up (datasets, optimizer, restore), first step (the train loop's "
        "trace and the step), total from the start",
        f"{'case':<34} {'link':<9} {'trainer':<9} {'imports':>7} {'model':>6} {'set-up':>6} {'step 1':>6} "
        f"{'total':>6}",
    ]
    for r in results:
        for name, p in r.get("startup", {}).items():
            lines.append(
                f"{r['case']:<34} {r['link']:<9} {name:<9} "
                + " ".join(f"{p[k]:>6.1f}" if k in p else f"{'-':>6}" for k in PHASE_COLUMNS)
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases", help=f"comma-separated (default {DEFAULT_CASES}; with --accuracy {ACCURACY_CASES})"
    )
    parser.add_argument(
        "--links",
        help=f"unshaped or tc rates, e.g. 1gbit,100mbit (default {DEFAULT_LINKS}; --accuracy unshaped)",
    )
    parser.add_argument("--steps", type=int, help="one machine's steps (default 150; --accuracy 1000)")
    parser.add_argument("--steps_per_loop", type=int, default=25)
    parser.add_argument("--cores", type=float, default=0.6, help="CPU cap of a trainer machine")
    parser.add_argument(
        "--ps_cores", type=float, default=0.4, help="CPU cap of the parameter_server master's machine"
    )
    parser.add_argument(
        "--period_ms",
        type=float,
        default=100,
        help="CPU cap accounting period (cfs_period_us / cpu.max period): a machine of 0.6 cores runs "
        "60%% of each period and is stopped for the rest",
    )
    parser.add_argument(
        "--timeout", type=float, help="seconds a case may take (default 600; --accuracy 1800)"
    )
    parser.add_argument(
        "--accuracy",
        action="store_true",
        help="time to accuracy instead: one,mwm2,mwm3 by default, the demo's 1000 steps (see above)",
    )
    parser.add_argument("--target_ap50", type=float, default=0.95)
    parser.add_argument(
        "--recipe",
        choices=("examples", "steps"),
        default="examples",
        help="--accuracy: `examples`: N machines train steps/N steps of N x 8 images with "
        "--fixed_replica_batch; `steps`: every case trains the demo's steps at its global batch of 8, "
        "split over the machines (a case whose replicas do not divide it needs its own, e.g. "
        "mwm3[task.train_data.global_batch_size=9])",
    )
    parser.add_argument(
        "--odapi_config",
        help="an Object Detection API pipeline.config to train instead of the demo: imported with "
        "`od-dist pipeline import`, on shapes data at its own input size (the real-size workload: "
        "tests/odapi_configs/ssd_mobilenet_v2_fpnlite_320x320_coco17_tpu-8.config)",
    )
    parser.add_argument("--json", help="also write every figure here")
    parser.add_argument("--keep", help="keep logs and models in this directory")
    args = parser.parse_args(argv)
    args.cases = args.cases or (ACCURACY_CASES if args.accuracy else DEFAULT_CASES)
    args.links = args.links or ("unshaped" if args.accuracy else DEFAULT_LINKS)
    args.steps = args.steps or (1000 if args.accuracy else 150)
    args.timeout = args.timeout or (1800 if args.accuracy else 600)
    why = (
        netns.unavailable() if os.geteuid() == 0 else "simulated machines need root (namespaces, cgroups, tc)"
    )
    why = why or capped.unavailable()
    if why:
        print(f"skipped: {why}")
        return 0
    cases = [parse_case(c) for c in re.split(r",(?![^\[]*\])", args.cases)]
    links = [x.strip() for x in args.links.split(",")]
    for link in links:
        if link != "unshaped":
            capped.rate_bits(link)
    netns.remove_stale()
    work = args.keep or tempfile.mkdtemp(prefix="od-dist-scaling-")
    os.makedirs(work, exist_ok=True)
    args.pipeline, image_size = PIPELINE, 128
    if args.odapi_config:
        args.pipeline = os.path.join(work, "pipeline.yaml")
        subprocess.run(
            [PY, "-m", "od_dist", "pipeline", "import", f"--config={args.odapi_config}"]
            + [f"--out={args.pipeline}", "--force"],
            cwd=REPO,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        with open(args.pipeline, encoding="utf-8") as f:
            image_size = yaml.safe_load(f)["task"]["model"]["input_size"][0]
    data_dir = os.path.join(work, "data")
    subprocess.run(
        [PY, "-m", "od_dist", "data", "shapes", f"--out={data_dir}", f"--image_size={image_size}"]
        + (["--num_train=2000", "--num_val=200"] if args.accuracy else ["--num_train=500", "--num_val=8"]),
        cwd=REPO,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    print(f"load average before: {os.getloadavg()}", flush=True)
    started = time.time()
    results = []
    try:
        for link in links:
            for case in cases:
                r = run_case(case, link, args, work, data_dir)
                results.append(r)
                print(
                    f"{case.name} {link}: {r.get('steady_examples_s', 0):.1f} examples/s, wall "
                    f"{r['wall_s']:.0f} s, load {r['load_before'][0]:.1f} -> {r['load_after'][0]:.1f} "
                    f"({time.time() - started:.0f} s so far)"
                    + (f" FAILED {r['codes']}" if r.get("failed") else ""),
                    flush=True,
                )
                if r.get("failed"):
                    for name, tail in r["tail"].items():
                        print(f"----- {name}\n{tail}", flush=True)
    except KeyboardInterrupt:
        print("interrupted: the table holds the cases that finished", flush=True)
    print(f"load average after: {os.getloadavg()}")
    print()
    print(report(results, cases, links, args))
    print()
    print(startup_report(results))
    if args.accuracy:
        for r in results:
            r.update(time_to_target_s=None, final_ap50=None)  # null in the JSON unless reached
            if not r.get("failed"):
                evaluate_checkpoints(r, args)
        print()
        print(accuracy_report(results, args))
    print(f"total {time.time() - started:.0f} s; {args.cores} cores per trainer machine, {args.steps} steps")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if any(r.get("failed") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
