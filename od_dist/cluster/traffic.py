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

Measured on simulated machines (benchmarks/scaling.py, BENCHMARKS.md): the mwm figure matched the
interface counters to 1%; under parameter_server the demo detector read its weights twice a step.
"""

from __future__ import annotations

from collections import Counter

from od_dist.cluster.spec import Cluster
from od_dist.cluster.validate import PARAMETER_SERVER


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def link_bytes(cluster: Cluster, weight_bytes: float, grad_bytes: float) -> tuple[float, dict[str, float]]:
    """(bytes one trainer/worker sends + receives per step, {host: bytes its link carries per
    round of steps}), in both directions together."""
    hosts = {t.address.host for t in cluster.server_tasks()}
    if cluster.strategy != PARAMETER_SERVER:
        n = len([t for t in cluster.server_tasks() if cluster.runs_replicas(t.role)])
        per = 2 * 2 * (n - 1) / n * grad_bytes if n > 1 else 0.0
        return per, dict.fromkeys(hosts, per)
    per_step = weight_bytes + grad_bytes
    ps_hosts = Counter(t.address.host for t in cluster.tasks_of("ps"))
    num_ps = sum(ps_hosts.values())
    workers = Counter(t.address.host for t in cluster.tasks_of("worker"))
    carried = {}
    for host in hosts:
        share = ps_hosts[host] / num_ps  # of the variables, served from this host
        served = sum(n for h, n in workers.items() if h != host) * share * per_step
        fetched = workers[host] * (1 - share) * per_step
        carried[host] = served + fetched
    return per_step, carried


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
