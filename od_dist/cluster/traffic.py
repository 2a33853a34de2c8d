"""What a training step moves over the network, for a cluster layout and a model's size. No
TensorFlow: the trainer passes the model's byte counts, the doctor only the layout.

- multi_worker_mirrored (ring all-reduce, TensorFlow's choice on CPUs and across machines): each
  of N trainers sends, and receives, 2(N-1)/N x the gradient bytes per step. Every link carries
  the same.
- parameter_server: each worker step reads the weights from the ps tasks and sends the gradients
  back (at least once each; a model that reads a variable twice in a step, as the weight decay of
  Model Garden's detectors does, reads it twice). TensorFlow places variables round-robin on the
  ps tasks (od-dist splits large ones across them), so each ps holds about 1/P of the bytes, and a
  machine's link carries what its ps tasks serve to workers elsewhere plus what its workers fetch
  from ps tasks elsewhere. All workers step at once, so per round (one step on every worker) a
  machine's link carries that sum over the workers.

- sync_every H (multi_worker_mirrored trainers that step alone): every H steps one ring all-reduce
  of the change of every float variable (weights and batch-norm statistics): 2(N-1)/N x the
  weight bytes per trainer per meeting, 1/H of it per step.

Bytes are in float32; a wire of 2 bytes a value (bfloat16, --all_reduce_dtype) halves them. The
*_step_bytes functions give what one step puts through the busiest link in one direction (links
are full duplex: what a trainer sends and what it receives travel at once), which
cluster/advice.py turns into time.

Measured on simulated machines (benchmarks/scaling.py, BENCHMARKS.md): the mwm figure matched the
interface counters to 1%; under parameter_server the demo detector read its weights twice a step.
"""

from __future__ import annotations

from collections import Counter

from od_dist.cluster.spec import Cluster
from od_dist.cluster.validate import PARAMETER_SERVER


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


WIRE_FLOAT32 = 4  # bytes a value: the byte counts here are float32's


def ring_bytes(n: int, nbytes: float) -> float:
    """What each of n trainers sends, and as much it receives, in one ring all-reduce of `nbytes`:
    2(N-1)/N x nbytes (0 alone)."""
    return 2 * (n - 1) / n * nbytes if n > 1 else 0.0


def ps_carried(ps_hosts: Counter, worker_hosts: Counter, per_step: float, hosts=()) -> dict[str, float]:
    """{host: bytes its link carries per round of steps, both directions together}: each worker
    step moves `per_step` (its reads and its writes) between its host and the ps hosts, each ps
    host holding its share of the variables (its ps tasks over all of them)."""
    num_ps = sum(ps_hosts.values())
    carried = {}
    for host in set(hosts) | set(ps_hosts) | set(worker_hosts):
        share = ps_hosts[host] / num_ps if num_ps else 0.0  # of the variables, served from this host
        served = sum(n for h, n in worker_hosts.items() if h != host) * share * per_step
        fetched = worker_hosts[host] * (1 - share) * per_step
        carried[host] = served + fetched
    return carried


def mwm_step_bytes(n: int, grad_bytes: float, wire: int = WIRE_FLOAT32) -> float:
    """multi_worker_mirrored, every step: bytes one step puts through each trainer's link, one way."""
    return ring_bytes(n, grad_bytes * wire / WIRE_FLOAT32)


def sync_every_step_bytes(n: int, weight_bytes: float, every: int, wire: int = WIRE_FLOAT32) -> float:
    """sync_every H: a meeting's ring all-reduce of every float variable's change, over H steps."""
    return ring_bytes(n, weight_bytes * wire / WIRE_FLOAT32) / every


def ps_step_bytes(ps_hosts: Counter, worker_hosts: Counter, weight_bytes: float, grad_bytes: float) -> float:
    """parameter_server: a round of steps (every worker one) through the busiest link, one way (half
    of what it carries both ways: the reads go one way, the writes the other)."""
    carried = ps_carried(ps_hosts, worker_hosts, weight_bytes + grad_bytes)
    return max(carried.values(), default=0.0) / 2


def link_bytes(cluster: Cluster, weight_bytes: float, grad_bytes: float) -> tuple[float, dict[str, float]]:
    """(bytes one trainer/worker sends + receives per step, {host: bytes its link carries per
    round of steps}), in both directions together."""
    hosts = {t.address.host for t in cluster.server_tasks()}
    if cluster.strategy != PARAMETER_SERVER:
        n = len([t for t in cluster.server_tasks() if cluster.runs_replicas(t.role)])
        per = 2 * ring_bytes(n, grad_bytes)
        return per, dict.fromkeys(hosts, per)
    per_step = weight_bytes + grad_bytes
    ps_hosts = Counter(t.address.host for t in cluster.tasks_of("ps"))
    workers = Counter(t.address.host for t in cluster.tasks_of("worker"))
    return per_step, ps_carried(ps_hosts, workers, per_step, hosts)


def describe(cluster: Cluster, weight_bytes: float, grad_bytes: float) -> str:
    """The master's start-up line: the bytes each step moves, per worker and on the busiest link."""
    per, carried = link_bytes(cluster, weight_bytes, grad_bytes)
    host, most = max(carried.items(), key=lambda kv: kv[1]) if carried else ("", 0.0)
    if cluster.strategy != PARAMETER_SERVER:
        n = len([t for t in cluster.server_tasks() if cluster.runs_replicas(t.role)])
        return (
            f"network: each step all-reduces {_mb(grad_bytes)} of gradients; each of the {n} trainers "
            f"sends and receives {_mb(per / 2)} per step (ring), {_mb(per)} through every machine's link; "
            f"a 100 Mbit/s link needs {per / 2 * 8 / 1e8:.2f} s per step for it"
        )
    workers = len(cluster.tasks_of("worker"))
    line = (
        f"network: each worker step reads {_mb(weight_bytes)} of weights from the ps tasks and sends "
        f"{_mb(grad_bytes)} of gradients (at least {_mb(per)} per step through a worker's link)"
    )
    if len(carried) < 2 or cluster.loopback_only():
        return line + "; every task is on this machine: no link carries it"
    return line + (
        f"; with {workers} worker(s) stepping at once the busiest link, {host}'s, carries {_mb(most)} "
        f"per round of steps: {most / 2 * 8 / 1e8:.2f} s on a 100 Mbit/s link"
    )


def single_link_layout(cluster: Cluster) -> str | None:
    """Why the layout puts every variable behind one machine's link (every ps on one machine that
    runs no worker, several workers elsewhere), with the layout to use instead; else None."""
    if cluster.strategy != PARAMETER_SERVER:
        return None
    ps_hosts = {t.address.host for t in cluster.tasks_of("ps")}
    worker_hosts = [t.address.host for t in cluster.tasks_of("worker")]
    if len(ps_hosts) != 1 or len(worker_hosts) < 2:
        return None
    (host,) = ps_hosts
    if host in worker_hosts or cluster.loopback_only():
        return None
    return (
        f"every ps task is on {host}, which runs no worker: each step of the {len(worker_hosts)} workers "
        f"reads every weight and writes every gradient through {host}'s link alone, the job's "
        "bottleneck on a LAN (on 100 Mbit/s it trained slower than one machine: BENCHMARKS.md); "
        "put a ps on each worker machine instead (ps: one host:port per worker host, on another "
        "port), so the variables spread over every worker's link"
    )
