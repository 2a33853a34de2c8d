"""--num_clones: how many replicas one trainer process runs, and on which devices."""

from __future__ import annotations

from od_dist.cluster.messages import GPU_INSTALL


class DeviceError(RuntimeError):
    """This machine cannot give the replicas asked for; the message is for the user."""


def apply_policy() -> str:
    """The device policy of every od-dist process that imports TensorFlow (servers, trainers, the
    evaluator, `od-dist eval`), applied before TensorFlow initializes its devices: memory growth on
    every visible GPU, so processes that share a GPU machine (a worker and the evaluator, several
    tasks under `launch`) each take what they use instead of the first one taking it all.
    Returns what was done, also written to the log."""
    import tensorflow as tf
    from absl import logging

    gpus = tf.config.get_visible_devices("GPU")
    try:
        for gpu in gpus:
            tf.config.experimental.set_memory_growth(gpu, True)
        done = f"memory growth on for {len(gpus)} GPU(s)" if gpus else "no GPU visible"
    except RuntimeError:  # devices already initialized (a second call in one process): keep them
        done = "devices were already initialized; left as they are"
    logging.info("od-dist device policy: %s", done)
    return done


def configure(num_clones: int, clone_on_cpu: bool) -> list[str]:
    """Sets up this process's devices (before TensorFlow initializes them) and returns the
    device names for the replicas: N logical CPUs with clone_on_cpu, else the first N GPUs with
    memory growth on (so several processes can share a GPU machine), else the CPU."""
    import tensorflow as tf

    if clone_on_cpu:
        apply_policy()  # GPUs the process may still see get the same policy
        cpu = tf.config.list_physical_devices("CPU")[0]
        if num_clones > 1:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(num_clones)]
            )
        return [f"/cpu:{i}" for i in range(num_clones)]
    gpus = tf.config.list_physical_devices("GPU")
    if num_clones > max(len(gpus), 1):  # one replica without a GPU trains on the CPU (said below)
        apply_policy()
        raise DeviceError(
            f"num_clones {num_clones} asks for {num_clones} GPUs but TensorFlow sees "
            f"{len(gpus) or 'none'} here; lower num_clones (--num_clones, or the cluster file's), "
            f"on a GPU machine give TensorFlow CUDA's libraries ({GPU_INSTALL}, README: GPU machines), "
            "or on one machine without --cluster add --clone_on_cpu"
        )
    if not gpus:
        apply_policy()
        # On the console, not only in the log: a GPU machine whose TensorFlow lacks CUDA's
        # libraries would otherwise train for hours on the CPU without a word.
        print(
            f"od-dist: training on the CPU: TensorFlow sees no GPU here (on a GPU machine: {GPU_INSTALL}, "
            "README: GPU machines)",
            flush=True,
        )
        return ["/cpu:0"]
    tf.config.set_visible_devices(gpus[:num_clones], "GPU")
    apply_policy()
    return [f"/gpu:{i}" for i in range(num_clones)]
