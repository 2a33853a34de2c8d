"""--num_clones: how many replicas one trainer process runs, and on which devices."""

from __future__ import annotations


class DeviceError(RuntimeError):
    """This machine cannot give the replicas asked for; the message is for the user."""


def configure(num_clones: int, clone_on_cpu: bool) -> list[str]:
    """Sets up this process's devices (before TensorFlow initializes them) and returns the
    device names for the replicas: N logical CPUs with clone_on_cpu, else the first N GPUs with
    memory growth on (so several processes can share a GPU machine), else the CPU."""
    import tensorflow as tf

    if clone_on_cpu:
        cpu = tf.config.list_physical_devices("CPU")[0]
        if num_clones > 1:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(num_clones)])
        return [f"/cpu:{i}" for i in range(num_clones)]
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        if num_clones > 1:
            raise DeviceError(f"--num_clones={num_clones} asks for {num_clones} GPUs but this machine has none; "
                              "add --clone_on_cpu to run the replicas on logical CPU devices")
        return ["/cpu:0"]
    if num_clones > len(gpus):
        raise DeviceError(f"--num_clones={num_clones} asks for {num_clones} GPUs but this machine has "
                          f"{len(gpus)}; lower --num_clones")
    tf.config.set_visible_devices(gpus[:num_clones], "GPU")
    for gpu in gpus[:num_clones]:
        tf.config.experimental.set_memory_growth(gpu, True)
    return [f"/gpu:{i}" for i in range(num_clones)]
