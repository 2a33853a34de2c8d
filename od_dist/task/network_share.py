"""How much of a multi_worker_mirrored step the network takes, measured on this job's own links
while it trains, and what would lower it: the master's line after the first steady loop.

- All-reduce every step: after that loop every trainer all-reduces, twice, a tensor of one step's
  gradient bytes (in the type they go in); the second is timed (the first traces it). Its time over
  the loop's time a step is the share. It is a floor: the all-reduce of a step also waits for the
  slowest trainer's backward pass.
- sync_every: the meeting is timed as it runs; its time over the loop's (steps and meeting) is the
  share.

Over half, the line says which sync_every would bring a meeting down to about a tenth of the
time, from the same figures.
"""

from __future__ import annotations

import math
import time

OVER = 0.5  # a share above this gets the advice
AIM = 0.1  # the share of a meeting the advised sync_every aims at
PREFIX = "od-dist train | network:"


def every_for(compute_s: float, meeting_s: float, aim: float = AIM) -> int:
    """The fewest steps between meetings for which a meeting of `meeting_s` is at most `aim` of
    the time, when a step computes for `compute_s`: meeting / (H x compute + meeting) <= aim."""
    return max(1, math.ceil(meeting_s * (1 - aim) / (aim * max(compute_s, 1e-9))))


def every_step_line(step_s: float, all_reduce_s: float, grad_bytes: int, weight_bytes: int) -> str:
    """The line for trainers that all-reduce every step: `step_s` a step (all-reduce included),
    `all_reduce_s` one all-reduce of the `grad_bytes` it sends."""
    share = min(all_reduce_s / max(step_s, 1e-9), 1.0)
    line = (
        f"{PREFIX} {share:.0%} of a step ({all_reduce_s:.3f} s to all-reduce {grad_bytes / 1e6:.2f} MB "
        f"of gradients, of {step_s:.3f} s a step)"
    )
    if share <= OVER:
        return line
    compute = max(step_s - all_reduce_s, 1e-3)
    meeting = all_reduce_s * weight_bytes / max(grad_bytes, 1)  # a meeting sends every weight once
    return (
        f"{line}; the network is most of the step: with 'sync_every: {every_for(compute, meeting)}' in the "
        f"cluster file the trainers would meet about every {every_for(compute, meeting) * compute:.0f} s "
        "and spend about a tenth of the time on it (README: on a slow LAN)"
    )


def meeting_line(every: int, loop_s: float, meeting_s: float) -> str:
    """The line for sync_every trainers: a loop of `every` steps took `loop_s`, its meeting `meeting_s`."""
    share = meeting_s / max(loop_s + meeting_s, 1e-9)
    line = f"{PREFIX} {share:.0%} of the time in meetings ({meeting_s:.2f} s a meeting, every {every} steps of {loop_s:.2f} s)"
    if share <= OVER:
        return line
    better = every_for(loop_s / every, meeting_s)
    return f"{line}; raise sync_every to about {better} to spend about a tenth of the time on meetings"


class Measure:
    """Called after each training loop (steps, seconds) by every trainer of the group; `meet`: the
    meeting of sync_every (None: an all-reduce every step). Prints on the lead only."""

    def __init__(self, dist, lead: bool, grad_bytes: int, weight_bytes: int, wire=None, meetings=None):
        self.dist, self.lead, self.meetings = dist, lead, meetings
        self.grad_bytes, self.weight_bytes, self.wire = grad_bytes, weight_bytes, wire
        self.loops = 0

    def __call__(self, steps: int, seconds: float) -> None:
        self.loops += 1
        meeting_s = None
        if self.meetings is not None:
            began = time.monotonic()
            self.meetings.meet()
            meeting_s = time.monotonic() - began
        if self.loops != 2 or not steps:  # the first loop holds the trace: the second is steady
            return
        if meeting_s is not None:
            line = meeting_line(steps, seconds, meeting_s)
        else:
            line = every_step_line(seconds / steps, self._all_reduce_s(), self.grad_bytes, self.weight_bytes)
        if self.lead:
            print(line, flush=True)

    def _all_reduce_s(self) -> float:
        """One all-reduce of a step's gradient bytes, timed (collective: every trainer runs it)."""
        import tensorflow as tf

        dtype = self.wire or tf.float32
        n = max(1, self.grad_bytes // dtype.size)

        @tf.function
        def all_reduce():
            def sent():
                value = tf.zeros([n], dtype)
                return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, value)

            return self.dist.run(sent)

        all_reduce()  # traced, and the links warmed
        began = time.monotonic()
        done = all_reduce()
        for value in self.dist.experimental_local_results(done):
            value.numpy()
        return time.monotonic() - began
