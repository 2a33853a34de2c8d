"""Trainers that step alone and meet every H steps: the cluster file's `sync_every` under
multi_worker_mirrored (local SGD; DiLoCo with an outer momentum).

Every step of multi_worker_mirrored all-reduces the gradients. Where a step's compute is short
against the link (a GPU machine on 100 Mbit/s or 1 Gbit/s), that all-reduce is the step. Here each
trainer applies its own gradients with its own optimizer state and no communication, and once a
loop (the loop is `sync_every` steps: loop_every sets trainer.steps_per_loop) the trainers
meet: one all-reduce of the change of every weight since the last meeting (batch-norm statistics
included), averaged, then an outer step on the trainable weights (by default the average itself;
with an outer momentum DiLoCo's, Douillard et al. 2023, arXiv 2311.08105: Nesterov momentum on the
outer gradient, the weights at the last meeting minus the average) and the plain average for the
statistics. Every trainer computes the same outer step
from the same all-reduced values, so every trainer holds the same weights, bit for bit, after a
meeting; checkpoints are saved at loop ends, after it, so a checkpoint (and so the evaluator) never
holds a trainer's own weights.

The global step counts as under every-step sync: one step is one batch on every trainer (the
global batch), so the learning-rate schedule and its warmup read the same step for the same
examples. What is sent is the change since the meeting, not the weights: in bfloat16 (the job's
--all_reduce_dtype) that rounds the change, which is small, not the weights.
"""

from __future__ import annotations

import typing

MET = "od-dist: the trainers met, meeting"  # in the task's log, with its number and the weights' digest


class Meeting(typing.NamedTuple):
    every: int  # steps between meetings
    learning_rate: float  # the outer step's; 1.0 with momentum 0: the plain average
    momentum: float


def of_cluster(cluster) -> Meeting | None:
    """The cluster file's meeting, None when its trainers all-reduce every step."""
    if cluster is None or not cluster.sync_every:
        return None
    return Meeting(cluster.sync_every, cluster.outer_learning_rate, cluster.outer_momentum)


def describe(meeting: Meeting) -> str:
    """One line for the master's start and `validate`."""
    if meeting.learning_rate == 1.0 and meeting.momentum == 0.0:
        outer = "the average of their weights (local SGD)"
    else:
        outer = (
            f"an outer Nesterov step on the average change (DiLoCo: learning rate {meeting.learning_rate:g}, "
            f"momentum {meeting.momentum:g})"
        )
    every = f"every {meeting.every} steps"
    return f"the trainers step alone on their own batches and meet {every}: one all-reduce, then {outer}"


def loop_every(params, meeting: Meeting) -> str:
    """The trainers meet at the end of every loop, so a loop is `every` steps: saves and stops
    fall at loop ends, after a meeting. Sets params.trainer.steps_per_loop; returns a line."""
    was = int(params.trainer.steps_per_loop)
    params.override({"trainer": {"steps_per_loop": meeting.every}}, is_strict=True)
    return f"trainer.steps_per_loop {was} -> {meeting.every}: {describe(meeting)}, at the end of every loop"


def step_locally(dist, optimizer) -> None:
    """Each replica applies its own gradients: the optimizer's all-reduce becomes a scaling by the
    replicas in sync, which undoes Model Garden's division of the loss by them (its tasks scale
    the loss so that the all-reduced sum is the mean). Called before the first step is traced."""
    import tensorflow as tf

    from od_dist.model.pipeline import PipelineError
    from od_dist.task.strategy import innermost_optimizer

    optimizer = innermost_optimizer(optimizer)
    if not hasattr(optimizer, "gradient_aggregator"):
        raise PipelineError(
            f"sync_every: the pipeline's optimizer {type(optimizer).__name__} takes no gradient aggregator "
            "(only the legacy Keras optimizers Model Garden builds do); remove sync_every from the cluster file"
        )
    replicas = dist.num_replicas_in_sync

    def scaled(g):
        if g is None:
            return None
        if isinstance(g, tf.IndexedSlices):
            return tf.IndexedSlices(g.values * tf.cast(replicas, g.values.dtype), g.indices, g.dense_shape)
        return g * tf.cast(replicas, g.dtype)

    def own(grads_and_vars):
        return [(scaled(g), v) for g, v in grads_and_vars]

    optimizer.gradient_aggregator = own


class Meetings:
    """The meeting of `dist`'s replicas over `model`'s floating-point variables. Made once the
    weights are what every trainer starts from (restored, or broadcast): that is the first anchor."""

    def __init__(self, dist, model, meeting: Meeting, wire=None):
        import tensorflow as tf

        from od_dist import patches

        self.meeting = meeting
        self.dist = dist
        self.wire = wire
        self.trained = [v for v in model.trainable_variables if v.dtype.is_floating]
        seen = {id(v) for v in self.trained}
        self.stats = [v for v in model.variables if v.dtype.is_floating and id(v) not in seen]
        self.sizes = [v.shape.num_elements() for v in self.trained + self.stats]
        total, trained = sum(self.sizes), sum(self.sizes[: len(self.trained)])
        self.bytes = total * (wire.size if wire is not None else 4)
        # Two flat variables, each trainer's own (no broadcast of initial values: set by anchor()).
        with dist.scope(), patches.tensorflow.local_initial_values(dist):
            self.anchor_values = tf.Variable(tf.zeros([total]), trainable=False, name="od_dist_anchor")
            self.velocity = tf.Variable(tf.zeros([trained]), trainable=False, name="od_dist_outer_velocity")
        self._trained = trained
        self._anchor = tf.function(self._anchor_fn)
        self._meet = tf.function(self._meet_fn)
        self.count = 0

    def _local_flat(self):
        import tensorflow as tf

        # In a replica's context a variable reads as this replica's copy (a batch-norm statistic
        # included, which across replicas would read as their mean).
        return tf.concat([tf.reshape(v.read_value(), [-1]) for v in self.trained + self.stats], 0)

    def _anchor_fn(self):
        values = self.dist.run(self._local_flat)
        self.anchor_values.assign(self.dist.experimental_local_results(values)[0])

    def _meet_fn(self):
        import tensorflow as tf

        def change():
            delta = self._local_flat() - self.anchor_values.read_value()
            sent = tf.cast(delta, self.wire) if self.wire is not None else delta
            mean = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.MEAN, sent)
            return tf.cast(mean, tf.float32)

        mean = self.dist.experimental_local_results(self.dist.run(change))[0]
        anchor = self.anchor_values.read_value()
        trained, stats = mean[: self._trained], mean[self._trained :]
        lr, mu = self.meeting.learning_rate, self.meeting.momentum
        outer = -trained  # the outer gradient: the weights at the last meeting minus the average
        velocity = mu * self.velocity.read_value() + outer
        new = tf.concat(
            [anchor[: self._trained] - lr * (outer + mu * velocity), anchor[self._trained :] + stats], 0
        )
        self.velocity.assign(velocity)
        self.anchor_values.assign(new)
        for v, part in zip(self.trained + self.stats, tf.split(new, self.sizes)):
            v.assign(tf.reshape(part, v.shape))

    def anchor(self) -> None:
        """The weights every trainer holds now become the point the next meeting steps from."""
        self._anchor()

    def meet(self) -> None:
        """Collective: every trainer calls it at the same loop boundary. The task's log gets a
        digest of the weights met on: every trainer's line for a meeting is the same."""
        import hashlib

        from absl import logging

        self._meet()
        self.count += 1
        digest = hashlib.sha256(self.anchor_values.numpy().tobytes()).hexdigest()[:16]
        logging.info("%s %d: weights %s", MET, self.count, digest)
