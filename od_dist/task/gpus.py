"""`python -m od_dist.task.gpus`: the GPUs TensorFlow lists on this machine, one line for
`od-dist doctor` (host/doctor_here.py), which runs it in a child process so that the host side never
imports TensorFlow: `od-dist GPUs: <count> <TensorFlow version>`."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before the import: its C++ lines are not the answer

import tensorflow as tf  # noqa: E402

print("od-dist GPUs:", len(tf.config.list_physical_devices("GPU")), tf.__version__)
