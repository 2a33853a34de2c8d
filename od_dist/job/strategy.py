"""A tf.distribute strategy built from the validated cluster, after a bounded wait for the peers.

- no cluster:               MirroredStrategy over --num_clones devices of this machine
- parameter_server:         ParameterServerStrategy; the master is the coordinator
- multi_worker_mirrored:    MultiWorkerMirroredStrategy; the master and every worker train
"""

from __future__ import annotations

import contextlib
import faulthandler
import time

from od_dist.cluster.spec import PARAMETER_SERVER, Cluster, Task
from od_dist.job import devices
from od_dist.job.server import bind_port, is_listening

PROGRESS_EVERY_S = 10.0
TF_NAMES = {
    "mirrored": "MirroredStrategy",
    "parameter_server": "ParameterServerStrategy",
    "multi_worker_mirrored": "MultiWorkerMirroredStrategy",
}


class PeerTimeout(RuntimeError):
    """Some peers never came up; the message names each with its address."""


def _missing_message(missing, timeout_s: float) -> str:
    names = ", ".join(f"{t.name} at {t.address}" for t in missing)
    return (
        f"timed out after {timeout_s:.0f} s waiting for {names}; start them (the same od-dist train "
        "command on their machines), check that their ports are open in the firewall, or raise --wait_timeout"
    )


def wait_for_peers(peers, timeout_s: float) -> None:
    """Polls every peer's port until all answer in the same pass (a peer seen once may have gone
    since); raises PeerTimeout naming those that did not."""
    deadline = time.monotonic() + timeout_s
    next_report = time.monotonic() + PROGRESS_EVERY_S
    while True:
        missing = [t for t in peers if not is_listening(t.address.host, t.address.port)]
        if not missing:
            return
        now = time.monotonic()
        if now >= deadline:
            raise PeerTimeout(_missing_message(missing, timeout_s))
        if now >= next_report:
            next_report = now + PROGRESS_EVERY_S
            print(
                f"waiting for {', '.join(t.name for t in missing)} ({deadline - now:.0f} s left)", flush=True
            )
        time.sleep(0.5)


@contextlib.contextmanager
def hang_guard(timeout_s: float, what: str):
    """TensorFlow's cluster set-up runs in C++ holding the GIL and has no timeout of its own, so
    no Python thread or signal handler can interrupt it. faulthandler's watchdog is a C thread:
    past the deadline it prints where we were stuck and exits 1."""
    print(f"{what} (giving up after {timeout_s:.0f} s)", flush=True)
    faulthandler.dump_traceback_later(timeout_s, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def wait_with_beacon(task: Task, peers, timeout_s: float, beacon=None) -> None:
    """Listens on this task's own port while waiting for the peers, then hands the port over to
    TensorFlow. Under multi_worker_mirrored a trainer's port opens only once its strategy is being
    built, which blocks until every peer is there, so trainers find each other by these beacons.
    Under parameter_server the servers watch the master's port: the beacon tells them the master
    is alive while it waits for a late peer. `beacon`: the port, if the caller bound it already."""
    beacon = beacon or bind_port(task)
    try:
        wait_for_peers(peers, timeout_s)
    finally:
        beacon.close()


def _resolver(cluster: Cluster, task: Task, num_gpus: int):
    import tensorflow as tf

    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster.cluster_spec()),
        task_type=task.tf_job,
        task_id=task.index,
        rpc_layer="grpc",
        num_accelerators={"GPU": num_gpus} if num_gpus else None,
    )


def _worker_gpus(cluster: Cluster, resolver) -> int:
    """Under parameter_server the replicas live on the workers, so count their GPUs (each worker
    exposes --num_clones of them), not the coordinator's. Every worker must have the same number."""
    import tensorflow as tf

    # make_master_device_default=False keeps ops of this client local; with the default it hangs.
    tf.config.experimental_connect_to_cluster(resolver, job_name="chief", make_master_device_default=False)
    gpus = tf.config.list_logical_devices("GPU")
    counts = {
        t.name: sum(f"/job:worker/replica:0/task:{t.index}/" in d.name for d in gpus)
        for t in cluster.tasks_of("worker")
    }
    if len(set(counts.values())) > 1:
        shown = ", ".join(f"{name}={n}" for name, n in counts.items())
        raise devices.DeviceError(
            f"parameter_server needs the same number of GPUs on every worker, found {shown}; "
            "give every worker the same --num_clones and GPUs"
        )
    return next(iter(counts.values()))


def make(
    cluster: Cluster | None,
    task: Task | None,
    num_clones: int,
    clone_on_cpu: bool,
    wait_timeout: float,
    beacon=None,
):
    import tensorflow as tf

    if cluster is None:
        return tf.distribute.MirroredStrategy(devices.configure(num_clones, clone_on_cpu))
    peers = [t for t in cluster.server_tasks() if t != task]
    if cluster.strategy == PARAMETER_SERVER:
        devices.apply_policy()  # the coordinator runs no replicas, but the same policy
        wait_with_beacon(task, peers, wait_timeout, beacon)
        with hang_guard(wait_timeout, f"{task.name}: every peer is up; connecting to the cluster"):
            num_gpus = _worker_gpus(cluster, _resolver(cluster, task, 0))
            return tf.distribute.experimental.ParameterServerStrategy(_resolver(cluster, task, num_gpus))
    names = devices.configure(num_clones, clone_on_cpu)
    num_gpus = len(names) if names[0].startswith("/gpu") else 0
    wait_with_beacon(task, peers, wait_timeout, beacon)
    with hang_guard(wait_timeout, f"{task.name}: every peer is up; joining the all-reduce group"):
        return tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=_resolver(cluster, task, num_gpus))
