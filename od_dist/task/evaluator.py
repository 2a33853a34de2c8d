"""The evaluator role: each new checkpoint evaluated until the final one, from the lead's folder or
its checkpoint feed, and the lead's word that a person stopped the job."""

from __future__ import annotations

import contextlib
import os
import sys
import time

from od_dist.host.config import TrainConfig
from od_dist.protocol import checkpoint_feed, exit_codes, lineage, notes, peers
from od_dist.task import params as task_params

EVAL_POLL_S = 30


# In model_dir, which the evaluator reads: the lead's word that a person stopped the job. The
# evaluator cannot tell that from a pause (SIGTERM, a crash) by the master's port alone, and would
# wait --wait_timeout for a master that will not come back, then exit 0 as if training finished.
STOPPED_NOTE = ".od-dist-stopped"


def tell_evaluators(model_dir: str, why: str) -> None:
    import tensorflow as tf

    path = tf.io.gfile.join(model_dir, STOPPED_NOTE)
    try:
        # Unique each time (an evaluator acts only on a word written while it runs), and renamed
        # into place so that it is never read half written.
        with tf.io.gfile.GFile(f"{path}.tmp", "w") as f:
            f.write(f"{why}\n{time.time():.3f} {os.getpid()}\n")
        tf.io.gfile.rename(f"{path}.tmp", path, overwrite=True)
    except (tf.errors.OpError, OSError) as e:
        print(f"od-dist: cannot tell the evaluator in {model_dir} that the job was stopped ({e})", flush=True)


def read_stopped_note(model_dir: str) -> str:
    import tensorflow as tf

    try:
        with tf.io.gfile.GFile(tf.io.gfile.join(model_dir, STOPPED_NOTE)) as f:
            return f.read()
    except (tf.errors.OpError, OSError):
        return ""


@contextlib.contextmanager
def following(config: TrainConfig, feeds, who: str):
    """Fetches from the lead's checkpoint `feeds` (cluster.checkpoint_feeds()) into --model_dir,
    when the cluster file has one; yields the Follower, or None."""
    if not feeds:
        yield None
        return
    say = lambda line: print(f"{who}: {line}", flush=True)
    job = config.selected.cluster.job_id()
    feeds = [(a.host, a.port) for a in feeds]
    with checkpoint_feed.Follower(feeds, job, config.model_dir, say, by=who) as follower:
        yield follower


def own_run_only(follower, model_dir: str, keep_waiting) -> bool:
    """Whether the checkpoints in `model_dir` are this run's, to evaluate: it holds none, or the
    lead's feed answered once (its run is the folder's then: the follower's first fetch set
    another's aside). Waits for that while `keep_waiting()`."""
    while lineage.holds_checkpoints(model_dir) and not follower.answered.wait(follower.every_s):
        if not keep_waiting():
            return False
    return True


def run_evaluator(config: TrainConfig) -> int:
    """Evaluates each new checkpoint until the final one. Checkpoints may be far apart, so it
    waits as long as the master is alive (its port open within --wait_timeout), not a fixed time.
    Its exit says what happened to the job: 0 it finished (the final checkpoint evaluated), 130 a
    person stopped it (the lead's STOPPED_NOTE), 138 it never started (no master ever came) or
    the evaluator gave up before the final checkpoint (its line says which it evaluated last)."""
    from od_dist.model import pipeline
    from od_dist.task import devices, trainer
    from od_dist.task.server import is_listening

    params = task_params.of_task(config)
    pipeline.check_inputs(params, config.pipeline, evaluate=True)
    devices.apply_policy()  # it often shares a GPU machine with a worker
    lead = config.selected.cluster.lead_task() if config.selected.cluster else None
    master = lead.address if lead else None  # the master, or worker 0 when the cluster has none
    absent = peers.Unreachable(never_seen_since=time.monotonic())
    seen = [False]  # the master was ever up: the job started
    before = read_stopped_note(config.model_dir)  # an earlier run's word is none for this one
    stopped = []
    followers: list = []  # the fetches from the lead's checkpoint feed, if the cluster has one
    started = time.monotonic()
    told = [False]

    def keep_waiting() -> bool:
        now = time.monotonic()
        # Up: its port, or its checkpoint feed (it outlives training, for this evaluator).
        up = (master is not None and is_listening(master.host, master.port)) or bool(
            followers and followers[0].reachable
        )
        absent.look("master", up, now)
        if lead and not followers and not told[0] and checkpoint_feed.newest(config.model_dir) is None:
            # A wait that may last the whole training: said once, at the first poll (within
            # EVAL_POLL_S), whether or not the master is up yet (it may start minutes later).
            told[0] = True
            print(
                f"evaluator: no checkpoint in {config.model_dir} after {now - started:.0f} s; {lead.name} at "
                f"{master}{'' if up else ' (not up now)'} writes them into its --model_dir on its machine: "
                "unless that is this folder (one machine, or a shared folder), give the cluster file a "
                "checkpoint_port (it then serves them here)",
                flush=True,
            )
        if up:
            seen[0] = True
            return True
        said = read_stopped_note(config.model_dir)
        if said and said != before:
            stopped.append(said.splitlines()[0])
            return False
        return not absent.lost("master", now, config.wait_timeout)

    cluster = config.selected.cluster
    feeds = cluster.checkpoint_feeds() if cluster else ()
    with following(config, feeds, checkpoint_feed.EVALUATOR) as follower:
        followers.extend([follower] if follower else [])
        metrics = None
        if follower is None or own_run_only(follower, config.model_dir, keep_waiting):
            metrics = trainer.continuous_eval(
                params,
                config.model_dir,
                timeout_s=min(EVAL_POLL_S, config.wait_timeout),
                keep_waiting=keep_waiting,
                pipeline_path=config.pipeline,
            )
    if stopped:
        print(f"evaluator: {stopped[0]}; exit {exit_codes.INTERRUPTED}", flush=True)
        return exit_codes.INTERRUPTED
    if metrics is None and master is not None and not seen[0]:
        # The job never started (no master, no checkpoint): retryable, like a trainer's wait for
        # its peers, and not restarted by its supervisor (it would only wait again).
        print(
            f"od-dist: evaluator: the master at {master} never came within --wait_timeout "
            f"({config.wait_timeout:.0f} s) and {config.model_dir} has no checkpoint: the job did not start; "
            f"exit {exit_codes.LOST_PEER}",
            file=sys.stderr,
            flush=True,
        )
        notes.leave_for_supervisor(notes.WAITED_OUT)
        return exit_codes.LOST_PEER
    final = int(params.trainer.train_steps)
    if metrics is None:
        feed = config.selected.cluster.checkpoint_feed() if config.selected.cluster else None
        missed = (
            f"no checkpoint appeared in {config.model_dir} while the master was reachable "
            f"(or within {config.wait_timeout} s), so none was evaluated, not the final ckpt-{final}; "
            + (
                f"none came from the master's checkpoint feed at {feed} either"
                if feed
                else "the master writes them on its own machine: give the cluster file a checkpoint_port "
                "(the master then serves them to the evaluator), or give both the same shared folder"
            )
        )
    elif metrics.get("step", 0) < final:
        missed = (
            f"the master was unreachable for --wait_timeout ({config.wait_timeout:.0f} s) after "
            f"ckpt-{metrics.get('step', 0)}, the last evaluated: the final ckpt-{final} was not"
        )
    else:
        return 0
    # Retryable: a restart, once the job trains again, evaluates what this one missed.
    print(f"od-dist: evaluator: {missed}; exit {exit_codes.LOST_PEER}", file=sys.stderr, flush=True)
    return exit_codes.LOST_PEER
