"""A tf.distribute strategy built from the validated cluster, after a bounded wait for the peers.

- no cluster:               MirroredStrategy over --num_clones devices of this machine
- parameter_server:         ParameterServerStrategy; the master is the coordinator; with several
                            ps tasks, large variables are split across them (a partitioner)
- multi_worker_mirrored:    MultiWorkerMirroredStrategy; the master and every worker train

The pipeline's `runtime.all_reduce_alg` and `runtime.num_packs` reach the strategy as Model
Garden's own builder passes them (pipeline.py refuses values that cannot apply to the strategy).
"""

from __future__ import annotations

import contextlib
import faulthandler
import time

from od_dist import patches
from od_dist.cluster.spec import PARAMETER_SERVER, TF_JOB, Cluster, Task
from od_dist.host.watchdog import Watchdog
from od_dist.protocol import exit_codes, notes
from od_dist.task import devices
from od_dist.task.server import bind_port, probe_all

PROGRESS_EVERY_S = 10.0
TF_NAMES = {
    "mirrored": "MirroredStrategy",
    "parameter_server": "ParameterServerStrategy",
    "multi_worker_mirrored": "MultiWorkerMirroredStrategy",
}


class PeerTimeout(RuntimeError):
    """Some peers never came up (`missing`); the message names each with its address."""

    def __init__(self, message: str, missing=()):
        super().__init__(message)
        self.missing = tuple(missing)


class PeerStopped(KeyboardInterrupt):
    """A peer was stopped by a person (Ctrl+C) before the job started, and said so on its port:
    for this task, as its own Ctrl+C (exit 130). The message: `ps:0 was stopped (Ctrl+C)`."""


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
        seen = probe_all([(t.address.host, t.address.port) for t in peers])
        said = [word for _, word in seen if word]
        if said:
            raise PeerStopped(notes.shown(said[0]))
        missing = [t for t, (listening, _) in zip(peers, seen) if not listening]
        if not missing:
            return
        now = time.monotonic()
        if now >= deadline:
            raise PeerTimeout(_missing_message(missing, timeout_s), missing)
        if now >= next_report:
            next_report = now + PROGRESS_EVERY_S
            print(
                f"waiting for {', '.join(t.name for t in missing)} ({deadline - now:.0f} s left)", flush=True
            )
        time.sleep(0.5)


@contextlib.contextmanager
def hang_guard(timeout_s: float, what: str):
    """TensorFlow's cluster set-up runs in C++ holding the GIL and has no timeout of its own, so
    no Python thread or signal handler can interrupt it. Past the deadline faulthandler (a C
    thread) prints where it was stuck, and a watchdog process ends it with exit 138: every peer
    answered the port probe just before, so one was lost in between, which a restart retries."""
    print(f"{what} (giving up after {timeout_s:.0f} s)", flush=True)
    faulthandler.dump_traceback_later(timeout_s, exit=False)
    message = (
        f"od-dist: {what.split(': ', 1)[0]}: TensorFlow's cluster set-up did not finish in "
        f"{timeout_s:.0f} s: a peer was lost after it answered (or raise --wait_timeout); "
        f"exit {exit_codes.LOST_PEER}"
    )
    with Watchdog() as watchdog:
        watchdog.arm(timeout_s + 1, message)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()


def wait_with_beacon(task: Task, peers, timeout_s: float, beacon=None) -> None:
    """Listens on this task's own port while waiting for the peers, then hands the port over to
    TensorFlow. Under multi_worker_mirrored a trainer's port opens only once its strategy is being
    built, which blocks until every peer is there, so trainers find each other by these beacons.
    Under parameter_server the servers watch the master's port: the beacon tells them the master
    is alive while it waits for a late peer. `beacon`: the port, if the caller bound it already;
    the caller keeps it when the wait ends otherwise (Ctrl+C), to tell the servers (roles.run)."""
    given = beacon is not None
    beacon = beacon or bind_port(task)
    try:
        wait_for_peers(peers, timeout_s)
    except BaseException:
        if not given:
            beacon.close()
        raise
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
    tf.config.experimental_connect_to_cluster(
        resolver, job_name=TF_JOB["master"], make_master_device_default=False
    )
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


# A variable of at least this size is split across the ps tasks (at most one shard per ps), so no
# single ps link carries a large variable alone; smaller ones are placed whole, round-robin.
MIN_SHARD_BYTES = 256 << 10


def variable_partitioner(num_ps: int):
    """TensorFlow's partitioner for `num_ps` ps tasks (None for one ps: nothing to split)."""
    import tensorflow as tf

    if num_ps < 2:
        return None
    return tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=MIN_SHARD_BYTES, max_shards=num_ps
    )


def collective_options(all_reduce_alg: str | None):
    """multi_worker_mirrored's CommunicationOptions from runtime.all_reduce_alg (None: AUTO)."""
    import tensorflow as tf

    return tf.distribute.experimental.CommunicationOptions(
        implementation=patches.model_garden.collective_communication(all_reduce_alg)
    )


def pack_gradients(dist, gradients: list[int], packs: int) -> list[int]:
    """multi_worker_mirrored: all-reduce the gradients (their bytes, in order) in at most `packs`
    packs (TensorFlow's CommunicationOptions.bytes_per_pack: a total over `packs`); returns the
    bytes of each pack TensorFlow makes, none for one pack or another strategy. Called once the
    model is built (its size is known only then) and before the first step; every trainer builds the
    same model, so all pack alike, as collectives need."""
    import tensorflow as tf

    if packs <= 1 or not isinstance(dist, tf.distribute.MultiWorkerMirroredStrategy):
        return []
    bytes_per_pack = -(-sum(gradients) // packs)
    # The options are fixed when the strategy is built; it merges these into every all-reduce.
    patches.tensorflow.merge_communication_options(
        dist, tf.distribute.experimental.CommunicationOptions(bytes_per_pack=bytes_per_pack)
    )
    return packed(gradients, bytes_per_pack)


def packed(sizes: list[int], bytes_per_pack: int) -> list[int]:
    """The packs TensorFlow groups tensors of these sizes into (cross_device_utils.group_by_size, as
    of 2.20): in order, a pack closed once it holds more than bytes_per_pack, so a large tensor can
    leave fewer packs than the total over bytes_per_pack."""
    packs: list[int] = []
    for size in sizes:
        if not packs or packs[-1] > bytes_per_pack:
            packs.append(0)
        packs[-1] += size
    return packs


def innermost_optimizer(optimizer):
    """The optimizer that applies the gradients, inside any wrappers."""
    while getattr(optimizer, "inner_optimizer", None) is not None:  # a LossScaleOptimizer
        optimizer = optimizer.inner_optimizer
    while patches.model_garden.inner_optimizer(optimizer) is not None:  # Model Garden's moving average
        optimizer = patches.model_garden.inner_optimizer(optimizer)
    return optimizer


def reduce_gradients_in(dist, optimizer, dtype_name: str):
    """multi_worker_mirrored: the optimizer sums the float32 gradients across trainers in
    `dtype_name`, then casts the sums back; returns that dtype when set, else None. Still one
    all-reduce per step, packed as pack_gradients says (in bytes of `dtype_name`). Called before
    the first step is traced."""
    import tensorflow as tf

    from od_dist.model.pipeline import PipelineError

    if dtype_name == "float32" or not isinstance(dist, tf.distribute.MultiWorkerMirroredStrategy):
        return None
    wire = tf.as_dtype(dtype_name)
    optimizer = innermost_optimizer(optimizer)
    if not hasattr(optimizer, "gradient_aggregator"):
        raise PipelineError(
            f"--all_reduce_dtype {dtype_name}: the pipeline's optimizer {type(optimizer).__name__} "
            "takes no gradient aggregator (only the legacy Keras optimizers Model Garden builds do); "
            "use --all_reduce_dtype float32"
        )
    summed = optimizer.gradient_aggregator

    def aggregate(grads_and_vars):
        def dense_float32(g):
            return g is not None and not isinstance(g, tf.IndexedSlices) and g.dtype == tf.float32

        sent = [(tf.cast(g, wire) if dense_float32(g) else g, v) for g, v in grads_and_vars]
        return [
            (g if g is None or g.dtype == v.dtype.base_dtype else tf.cast(g, v.dtype.base_dtype), v)
            for g, v in summed(sent)
        ]

    optimizer.gradient_aggregator = aggregate
    return wire


def gradients_to_ps_whole(dist, optimizer) -> int:
    """parameter_server: each step's gradients go to each ps as one tensor per dtype, cut back
    into each variable's gradient there, rather than one transfer per variable; returns the number
    of ps tasks they go to (0: not done). The values the optimizer applies are the same (concat
    and split only copy). Why: TensorFlow moves every tensor between tasks as its own transfer, at
    about 75-80 us of CPU on each end on a 2-core box, whatever its size (benchmarks/ps_transfers.py:
    400 variables of 1.9 MB in all, 67 ms a step; 40 of the same bytes, 10 ms; the gradients sent
    whole, 48 ms), and the demo's model has 235 trainable variables. Done only where nothing
    between the aggregation and the update would pull the gradients back to the worker: one replica
    per worker, no clipping or gradient transformers. Called before the first step is traced."""
    import tensorflow as tf

    if (
        not isinstance(dist, tf.distribute.experimental.ParameterServerStrategy)
        or dist.num_replicas_in_sync != 1
    ):
        return 0
    optimizer = innermost_optimizer(optimizer)
    clipped = any(
        getattr(optimizer, name, None) is not None for name in ("clipvalue", "clipnorm", "global_clipnorm")
    )
    if (
        not hasattr(optimizer, "gradient_aggregator")
        or clipped
        or getattr(optimizer, "gradient_transformers", None)
    ):
        return 0
    summed = optimizer.gradient_aggregator

    def aggregate(grads_and_vars):
        # Summed first: with one replica that is an identity on the worker, which would bring
        # gradients cut on the ps back to it.
        pairs = list(summed(grads_and_vars))
        by_ps: dict = {}
        for i, (g, v) in enumerate(pairs):
            if g is not None and not isinstance(g, tf.IndexedSlices) and g.shape.is_fully_defined():
                by_ps.setdefault((v.device, g.dtype), []).append(i)
        for (device, _), members in by_ps.items():
            if len(members) < 2:
                continue
            whole = tf.concat([tf.reshape(pairs[i][0], [-1]) for i in members], 0)  # on the worker
            with tf.device(device):  # the one transfer, and the cut on the ps
                parts = tf.split(tf.identity(whole), [pairs[i][0].shape.num_elements() for i in members])
                for i, part in zip(members, parts):
                    pairs[i] = (tf.reshape(part, pairs[i][0].shape), pairs[i][1])
        return pairs

    optimizer.gradient_aggregator = aggregate
    return patches.tensorflow.cluster_resolver(dist).cluster_spec().num_tasks("ps")


def mirrored_cross_device_ops(all_reduce_alg: str | None, num_packs: int):
    """One machine's cross-device ops from runtime.all_reduce_alg/num_packs (None: TensorFlow's pick)."""
    return patches.model_garden.mirrored_cross_device_ops(all_reduce_alg, num_packs)


def make(
    cluster: Cluster | None,
    task: Task | None,
    num_clones: int,
    clone_on_cpu: bool,
    wait_timeout: float,
    all_reduce_alg: str | None = None,
    num_packs: int = 1,
    beacon=None,
):
    import tensorflow as tf

    if cluster is None:
        return tf.distribute.MirroredStrategy(
            devices.configure(num_clones, clone_on_cpu),
            cross_device_ops=mirrored_cross_device_ops(all_reduce_alg, num_packs),
        )
    peers = [t for t in cluster.server_tasks() if t != task]
    if cluster.strategy == PARAMETER_SERVER:
        devices.apply_policy()  # the coordinator runs no replicas, but the same policy
        wait_with_beacon(task, peers, wait_timeout, beacon)
        with hang_guard(wait_timeout, f"{task.name}: every peer is up; connecting to the cluster"):
            num_gpus = _worker_gpus(cluster, _resolver(cluster, task, 0))
            return tf.distribute.experimental.ParameterServerStrategy(
                _resolver(cluster, task, num_gpus),
                variable_partitioner=variable_partitioner(len(cluster.tasks_of("ps"))),
            )
    names = devices.configure(num_clones, clone_on_cpu)
    num_gpus = len(names) if names[0].startswith("/gpu") else 0
    wait_with_beacon(task, peers, wait_timeout, beacon)
    with hang_guard(wait_timeout, f"{task.name}: every peer is up; joining the all-reduce group"):
        dist = tf.distribute.MultiWorkerMirroredStrategy(
            cluster_resolver=_resolver(cluster, task, num_gpus),
            communication_options=collective_options(all_reduce_alg),
        )
    if cluster.sync_every:
        # Trainers that step alone send nothing in a step. TensorFlow's handling of a last partial
        # batch all-reduces, at every step, whether each trainer's input has one more batch
        # (input_lib._enable_get_next_as_optional, on in multi-worker mode for a dataset of
        # unknown length); the training data repeats forever (Model Garden's reader), so there is
        # no last batch to handle. Read when the datasets are distributed, after this.
        dist.extended.experimental_enable_get_next_as_optional = False
    return dist
