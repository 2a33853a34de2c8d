"""What each strategy is expected to give on this LAN, from its own figures, and the one od-dist
recommends: the lines `doctor` prints (it measures the link and takes a step's compute) and
`validate` (the layout only: it prints the arithmetic and says what it lacks). No TensorFlow, no
network: pure arithmetic; the bytes rules are cluster/traffic.py's.

The model (docs/scaling.md, "What od-dist predicts"): a trainer's step takes

    c + b / r

c its compute (one machine's step at its own batch, as alone), b the bytes that step puts through
the busiest link one way (traffic.py), r that link's bytes per second one way; one after the other:
no transfer overlapping the backward pass, no latency, no CPU cost per transfer. N machines that
compute steps, each at its own batch (the per-machine batch kept, as a user adding machines does),
then give

    N x c / (c + b / r)

times one machine's examples per second. b per step:
- multi_worker_mirrored: 2(N-1)/N x the gradients (half in bfloat16, --all_reduce_dtype);
- sync_every H: 2(N-1)/N x every float variable (weights, batch-norm statistics) / H;
- parameter_server: the busiest link's share of every variable read and every gradient written,
  per round (every worker one step), half of it each way.
Examples per second only: sync_every trains with local steps and parameter_server asynchronously,
so neither says how soon a given accuracy comes.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from od_dist.cluster import hostport, traffic
from od_dist.cluster.validate import PARAMETER_SERVER

MBIT = 1e6 / 8  # bytes per second in 1 Mbit/s
SYNC_EVERY_SHOWN = (10, 50)  # besides the file's own H
# A strategy expected within this fraction of the best is as good: of those, the first in the order
# predict() gives (the one that changes the training least) is recommended.
CLOSE = 0.9
DOCS = "docs/scaling.md, What od-dist predicts"
ONE_MACHINE = (
    "every trainer is on one machine: no speed-up over one machine to expect; across machines "
    f"`od-dist doctor` predicts each strategy's from the link it measures and a step's compute ({DOCS})"
)


class Figures(NamedTuple):
    """What the prediction is made from, each None when not known, and where each came from."""

    weight_bytes: float | None = None  # every float variable, in float32 (weights, batch-norm statistics)
    grad_bytes: float | None = None  # the trainable variables' gradients, in float32
    step_s: float | None = None  # a step's compute on one machine at its own batch
    link_bytes_per_s: float | None = None  # one way, the slowest link measured
    model_from: str = "--model_mb"
    step_from: str = "--step_time"
    link_from: str = "--link_mbit"


class Layout(NamedTuple):
    machines: int  # trainer machines under multi_worker_mirrored
    ps_hosts: Counter  # parameter_server: ps tasks by machine
    worker_hosts: Counter  # and workers by machine
    ps_said: str  # which parameter_server layout is predicted
    strategy: str | None  # the file's, None for a bare count of machines
    sync_every: int | None  # the file's


class Prediction(NamedTuple):
    name: str
    setting: str  # how a cluster file or flag asks for it
    machines: int  # that compute steps
    step_bytes: float | None  # through the busiest link per step, one way
    rule: str  # how step_bytes is counted, with the figures
    link_s: float | None
    speedup: float | None  # examples/s against one machine


def _machine(task, each_task: bool = False) -> str:
    return str(task.address) if each_task else hostport.machine_of(task.address.host)


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def layout_of(cluster_or_machines, each_task: bool = False) -> Layout:
    """The layout a prediction is made for: a cluster file's, or N machines (parameter_server then
    with a worker and a ps on each, its best layout). `each_task`: every task as if on a machine of
    its own (a loopback file whose tasks doctor checks one by one, --role)."""
    if isinstance(cluster_or_machines, Layout):
        return cluster_or_machines
    if isinstance(cluster_or_machines, int):
        n = cluster_or_machines
        each = Counter(f"machine {i}" for i in range(n))
        return Layout(n, each, Counter(each), "a worker and a ps on each machine", None, None)
    cluster = cluster_or_machines
    trainers = list(dict.fromkeys(_machine(t, each_task) for t in cluster.members()))
    n = 1 if cluster.loopback_only() and not each_task else len(trainers)
    if cluster.strategy == PARAMETER_SERVER:
        ps = Counter(_machine(t, each_task) for t in cluster.tasks_of("ps"))
        workers = Counter(_machine(t, each_task) for t in cluster.tasks_of("worker"))
        said = f"this file's: {len(workers)} worker machine(s), ps tasks on {len(ps)} machine(s)"
    else:
        ps = Counter(trainers)
        workers = Counter(trainers)
        said = f"a worker and a ps on each of the {n} machines"
    return Layout(n, ps, workers, said, cluster.strategy, cluster.sync_every)


def _timed(machines: int, step_s, step_bytes, rate) -> tuple[float | None, float | None]:
    if step_s is None or rate is None or step_bytes is None:
        return None, None
    link_s = step_bytes / rate
    return link_s, machines * step_s / (step_s + link_s) if step_s + link_s > 0 else float(machines)


def _known(x, f):
    return None if x is None else f(x)


def _of(nbytes, noun: str) -> str:
    return f"{_mb(nbytes)} of {noun}" if nbytes is not None else f"the {noun}"


def predict(
    cluster_or_layout,
    weight_bytes: float | None,
    grad_bytes: float | None,
    step_s: float | None,
    link_bytes_per_s: float | None,
    sync_every: int | None = None,
    wire_bytes_per_value: int = traffic.WIRE_FLOAT32,
) -> list[Prediction]:
    """Each strategy's expected examples/s against one machine, in the order recommend() prefers
    (the training least changed first): multi_worker_mirrored every step in float32 and bfloat16,
    sync_every at the file's H (or `sync_every`) and SYNC_EVERY_SHOWN (its wire
    `wire_bytes_per_value`: 4 float32, 2 bfloat16), parameter_server. A figure None leaves the
    speed-up None (and the bytes, for a byte count)."""
    layout = layout_of(cluster_or_layout)
    n = layout.machines
    out = []
    for wire, name, setting in (
        (4, "multi_worker_mirrored", "strategy: multi_worker_mirrored, every step in sync"),
        (2, "multi_worker_mirrored bfloat16", "the same with --all_reduce_dtype bfloat16"),
    ):
        nbytes = _known(grad_bytes, lambda g, w=wire: traffic.mwm_step_bytes(n, g, w))
        dtype = "float32" if wire == 4 else "bfloat16"
        rule = f"2(N-1)/N x {_of(grad_bytes, 'gradients')} in {dtype}"
        out.append(Prediction(name, setting, n, nbytes, rule, *_timed(n, step_s, nbytes, link_bytes_per_s)))
    every = sync_every or layout.sync_every
    wire = wire_bytes_per_value
    dtype = "bfloat16" if wire == 2 else "float32"
    for h in sorted({every, *SYNC_EVERY_SHOWN} - {None}):
        nbytes = _known(weight_bytes, lambda w, h=h: traffic.sync_every_step_bytes(n, w, h, wire))
        rule = f"2(N-1)/N x {_of(weight_bytes, 'weights and statistics')} in {dtype}, once every {h} steps"
        name = f"sync_every {h}" + (" bfloat16" if wire == 2 else "")
        setting = f"sync_every: {h} in the cluster file" + (" (its own)" if h == layout.sync_every else "")
        out.append(Prediction(name, setting, n, nbytes, rule, *_timed(n, step_s, nbytes, link_bytes_per_s)))
    workers = len(layout.worker_hosts)
    nbytes = (
        traffic.ps_step_bytes(layout.ps_hosts, layout.worker_hosts, weight_bytes, grad_bytes)
        if weight_bytes is not None and grad_bytes is not None
        else None
    )
    rule = (
        f"the busiest link's share of every weight read ({_of(weight_bytes, 'weights')}) and every "
        f"gradient sent ({_of(grad_bytes, 'gradients')}) by each of {workers} workers a round, "
        f"half each way; {layout.ps_said}"
    )
    out.append(
        Prediction(
            "parameter_server",
            "strategy: parameter_server (asynchronous)",
            workers,
            nbytes,
            rule,
            *_timed(workers, step_s, nbytes, link_bytes_per_s),
        )
    )
    return out


def recommend(predictions: list[Prediction]) -> tuple[Prediction | None, str]:
    """(the one recommended, why), None for one machine: the first within CLOSE of the best
    (predictions are in the order of the training least changed). Requires every speed-up."""
    best = max(predictions, key=lambda p: p.speedup)
    if best.speedup < 1:
        return (
            None,
            f"none is expected to beat one machine on this link (the best: {best.name}, {best.speedup:.2f}x)",
        )
    for p in predictions:
        if p.speedup >= CLOSE * best.speedup:
            why = (
                "the best expected"
                if p is best
                else f"within {100 - CLOSE * 100:.0f}% of the best ({best.name}, {best.speedup:.2f}x) and "
                "closer to training as one machine does"
            )
            return p, why
    return best, "the best expected"  # not reached: best itself is within CLOSE


def own(layout: Layout, predictions: list[Prediction]) -> Prediction | None:
    """The prediction for what the cluster file asks (multi_worker_mirrored in float32, its sync_every
    or parameter_server)."""
    if layout.strategy is None:
        return None
    if layout.strategy == PARAMETER_SERVER:
        name = "parameter_server"
    elif layout.sync_every:
        name = f"sync_every {layout.sync_every}"
    else:
        name = "multi_worker_mirrored"
    return next((p for p in predictions if p.name.split(" bfloat16")[0] == name), None)


def figures_line(layout: Layout, figures: Figures) -> str:
    def said(value, shown, source, missing):
        return f"{shown(value)} ({source})" if value is not None else f"{missing}: not known ({source})"

    model = (
        f"weights and statistics {_mb(figures.weight_bytes)}, gradients {_mb(figures.grad_bytes)} in float32 "
        f"({figures.model_from})"
        if figures.weight_bytes is not None and figures.grad_bytes is not None
        else f"the model's bytes: not known ({figures.model_from})"
    )
    step = said(
        figures.step_s, lambda s: f"a step's compute {s:.3f} s", figures.step_from, "a step's compute"
    )
    link = said(
        figures.link_bytes_per_s,
        lambda r: f"the link {r / 1e6:.2f} MB/s one way ({r / MBIT:.0f} Mbit/s)",
        figures.link_from,
        "the link's speed",
    )
    return (
        f"{layout.machines} machines train under multi_worker_mirrored; {model}; {step}; {link}. A step = compute + its bytes through "
        "the busiest link, one after the other (no overlap with the backward pass, no latency): N x c / "
        f"(c + bytes / link) one machine's examples/s, each machine at its own batch ({DOCS})"
    )


def expect_line(p: Prediction, figures: Figures) -> str:
    if p.speedup is not None:
        c = figures.step_s
        return (
            f"{p.speedup:.2f}x one machine: {p.machines} machines x {c:.3f} s / ({c:.3f} s + {p.link_s:.3f} s "
            f"for {_mb(p.step_bytes)} a step through the busiest link: {p.rule}, at "
            f"{figures.link_bytes_per_s / 1e6:.2f} MB/s) ({p.setting})"
        )
    moved = _mb(p.step_bytes) if p.step_bytes is not None else "b"
    lacks = [
        what
        for what, value in (
            ("the model's bytes", p.step_bytes),
            ("a step's compute c", figures.step_s),
            ("the link", figures.link_bytes_per_s),
        )
        if value is None
    ]
    return (
        f"{p.machines} machines x c / (c + {moved} / link), {moved} a step through the busiest link: {p.rule}; "
        f"lacks {', '.join(lacks)} ({p.setting})"
    )


def advise(
    cluster, figures: Figures = Figures(), each_task: bool = False
) -> tuple[bool, list[tuple[str, str]]]:
    """(whether the file asks for what od-dist recommends, or nothing can be said against it; the
    lines (what, detail): the figures, each strategy's expected speed-up, the recommendation)."""
    layout = layout_of(cluster, each_task)
    if layout.machines < 2:
        return True, [("strategy", ONE_MACHINE)]
    predictions = predict(
        layout, figures.weight_bytes, figures.grad_bytes, figures.step_s, figures.link_bytes_per_s
    )
    lines = [("figures", figures_line(layout, figures))]
    lines += [(f"expect {p.name}", expect_line(p, figures)) for p in predictions]
    if any(p.speedup is None for p in predictions):
        missing = [
            what
            for what, value in (
                (f"the model's bytes ({figures.model_from})", figures.weight_bytes),
                (f"a step's compute ({figures.step_from})", figures.step_s),
                (f"the link's speed ({figures.link_from})", figures.link_bytes_per_s),
            )
            if value is None
        ]
        return True, lines + [
            (
                "strategy",
                f"no recommendation without {', '.join(missing)}: `od-dist doctor` measures the link to each "
                "peer running `od-dist doctor` too, and takes --step_time and --model_mb",
            )
        ]
    choice, why = recommend(predictions)
    mine = own(layout, predictions)
    if choice is None:
        followed = False
        said = f"recommends one machine: {why}"
    else:
        followed = mine is None or mine.speedup >= CLOSE * choice.speedup
        said = f"recommends {choice.name} ({choice.setting}): {choice.speedup:.2f}x one machine, {why}"
    if mine is not None and (choice is None or mine.name != choice.name):
        said += f"; this file asks for {mine.name}: {mine.speedup:.2f}x"
    return followed, lines + [("strategy", said)]


def predict_case(
    cluster_or_machines,
    strategy: str,
    weight_bytes: float,
    grad_bytes: float,
    step_s: float,
    link_bytes_per_s: float,
    sync_every: int | None = None,
    wire_bytes_per_value: int = traffic.WIRE_FLOAT32,
) -> Prediction:
    """One case's prediction (a benchmark's: `strategy` multi_worker_mirrored, with `sync_every` or
    `wire_bytes_per_value` 2 for bfloat16, or parameter_server)."""
    predictions = predict(
        cluster_or_machines,
        weight_bytes,
        grad_bytes,
        step_s,
        link_bytes_per_s,
        sync_every,
        wire_bytes_per_value,
    )
    if strategy == PARAMETER_SERVER:
        name = "parameter_server"
    elif sync_every:
        name = f"sync_every {sync_every}" + (" bfloat16" if wire_bytes_per_value == 2 else "")
    else:
        name = "multi_worker_mirrored" + (" bfloat16" if wire_bytes_per_value == 2 else "")
    return next(p for p in predictions if p.name == name)


def against_measured(prediction: Prediction, measured: float) -> str:
    """A predicted speed-up beside a measured one: what benchmarks/scaling.py prints for a case."""
    p = prediction
    return (
        f"predicted {p.speedup:.2f}x ({p.machines} machines x c / (c + {p.link_s:.3f} s for {_mb(p.step_bytes)} "
        f"a step: {p.rule})), measured {measured:.2f}x: measured/predicted {measured / p.speedup:.2f}"
    )
