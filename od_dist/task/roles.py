"""`od-dist train`: what each role does, dispatched from one registry.

ps, worker (parameter_server)   serve until the master is done      -> server.serve
master (parameter_server)       coordinate training, then stop the servers
master, worker (multi_worker)   train together (all-reduce)
evaluator                       evaluate each new checkpoint until the final one
single (no cluster)             train on this machine's --num_clones devices
"""

from __future__ import annotations

import contextlib
import re
import sys
import time
from typing import NoReturn

from od_dist.cluster import topology
from od_dist.cluster.spec import MULTI_WORKER_MIRRORED, PARAMETER_SERVER
from od_dist.host.config import TrainConfig
from od_dist.protocol import checkpoint_feed, exit_codes, membership, notes
from od_dist.task import evaluator, local_sgd
from od_dist.task import params as task_params


class RoleError(RuntimeError):
    """A role that failed at run time; the message is for the user (exit 1)."""


def run_server(config: TrainConfig) -> NoReturn:
    from od_dist.task import devices, server, watch

    selected = config.selected

    def set_up_devices():
        # Workers under parameter_server run the replicas (--num_clones GPUs each); a ps only holds
        # variables and runs none, so it starts whatever num_clones says (a CPU-only ps machine).
        if selected.cluster.runs_replicas(config.role):
            return devices.configure(config.num_clones, config.clone_on_cpu)
        return devices.apply_policy()

    cluster = selected.cluster
    # A worker of an elastic job's round keeps a copy of the coordinator's checkpoints on its own
    # disk: the next round may have it coordinate (host/elastic.py), from the newest step it holds.
    # (Its round comes from its supervisor: none in a Slurm step, one fixed group.)
    member = selected.task.role == "worker" and membership.group_from_env() is not None
    lead = cluster.checkpoint_feed() if member else None
    try:
        with evaluator.following(config, [lead] if lead else [], selected.task.name) as follower:
            code = server.serve(
                cluster,
                selected.task,
                config.wait_timeout,
                devices=set_up_devices,
                term_to_all=selected.term_to_all,
                lost_s=config.lost_peer_timeout if member else None,
            )
    except server.ServerError as e:  # a DeviceError is invalid input: exit 2 (cli/train.py)
        raise RoleError(str(e)) from None
    if code == 0 and follower is not None:
        follower.poll()  # the final checkpoint too, once its thread is done: every member holds it
    # TensorFlow's teardown of a server at interpreter exit can crash (SIGSEGV, exit 139, after
    # "exit 143": benchmarks/chaos.py, a SIGTERM to a parameter_server worker), which a supervisor
    # takes for a permanent failure. A server has nothing left to do: it ends here, with its code.
    watch.exit_now(code)


def run_trainer(config: TrainConfig, beacon=None) -> int:
    """The master, an all-reduce worker, or a single machine; `beacon`: its port, already bound."""
    from od_dist.model import pipeline
    from od_dist.task import checkpoints, errors, phases, server, strategy, trainer, watch

    params = task_params.of_task(config)  # before any wait: a bad pipeline fails at once
    pipeline.check_inputs(params, config.pipeline, train=True)
    phases.mark("pipeline loaded")
    if not config.selected.task or config.role == "master":
        # Training reads no validation record; the evaluation after it will, and would fail: said
        # now, not after hours of training.
        problem = pipeline.validation_problem(params, config.pipeline)
        if problem:
            print(f"od-dist: warning: {problem}; training goes on, evaluation would fail", flush=True)
    cluster, task = config.selected.cluster, config.selected.task
    if cluster is None or task == cluster.lead_task():
        # The checkpoint writer, before its strategy: a multi_worker_mirrored worker reads the
        # checkpoint file only once every trainer has joined the group, so all restore what the
        # file names after this (reads files only: TensorFlow's runtime stays uninitialised).
        checkpoints.tidy(config.model_dir)
    try:
        dist = strategy.make(
            cluster,
            task,
            config.num_clones,
            config.clone_on_cpu,
            config.wait_timeout,
            params.runtime.all_reduce_alg,
            params.runtime.num_packs,
            beacon=beacon,
        )
    except strategy.PeerTimeout as e:
        # Retryable, like a peer lost later: a peer that is late (a pod still scheduling, a machine
        # still booting) is there at the next try; the server side exits 138 the same way.
        print(f"od-dist: {e}; exit {exit_codes.LOST_PEER}", file=sys.stderr, flush=True)
        # Its restart would only wait again (a ps that never came: no round could go on either).
        for note in _ps_lost(config) if any(t.role == "ps" for t in e.missing) else (notes.WAITED_OUT,):
            notes.leave_for_supervisor(note)
        return exit_codes.LOST_PEER
    except server.ServerError as e:  # a DeviceError is invalid input: exit 2 (cli/train.py)
        raise RoleError(str(e)) from None
    phases.mark("group formed")
    print(
        f"{task.name if task else 'single'}: training with {strategy.TF_NAMES[config.strategy_name]}, "
        f"{dist.num_replicas_in_sync} replica(s) in sync, model_dir {config.model_dir}",
        flush=True,
    )
    who = task.name if task else "single"
    peers = [t for t in cluster.server_tasks() if t != task] if cluster else []
    guard = watch.LoopGuard(who, config.wait_timeout, _after_loss(config)) if config.is_coordinator else None
    try:
        with watch.Watch(who, _watched(config, peers)) as peers_watch, guard or contextlib.nullcontext():
            # The watch ends once no peer is needed (trainer.train: after the last loop, or once
            # every multi_worker_mirrored trainer holds the final checkpoint): a peer that exits
            # first then closes its port while this one still finishes, which is no lost peer.
            trainer.train(
                params,
                config.model_dir,
                dist,
                data_threads=config.threads.data,
                who=who,
                on_model=_model_built(config, dist, who),
                on_last_loop=peers_watch.stop,
                peer_requests=_server_requests(config, peers),
                pipeline_path=config.pipeline,
                on_loop_start=guard.loop_starts if guard else None,
                same_flags={
                    "--all_reduce_packs": str(config.all_reduce_packs),
                    "--all_reduce_dtype": config.all_reduce_dtype,
                },
            )
    except errors.Stopped as e:
        saved = f"saved {e.path}" if e.path else "the master saved it"
        print(f"{who}: stopped at step {e.step} ({e.why}); {saved}; exit {e.code}", flush=True)
        if config.is_coordinator and e.code == exit_codes.INTERRUPTED:
            # Ctrl+C (or Ctrl+Break) here or on a server is a person ending the job: the servers
            # stop too (exit 130), instead of waiting --wait_timeout for a master that will not
            # come back and then restarting. SIGTERM is a pause (a drained node, an orchestrator's
            # restart): they stay up for the master's return, as after a crash.
            own = e.why in ("SIGINT", "SIGBREAK")
            _stop_servers(cluster, notes.by_person() if own else notes.stopped_the_job(e.why), who)
        if e.code == exit_codes.INTERRUPTED and cluster is not None and task == cluster.lead_task():
            evaluator.tell_evaluators(
                config.model_dir, f"{who} was stopped by a person ({e.why}) at step {e.step}"
            )
        if cluster is not None:
            # The checkpoint is saved and the line printed. A peer that stopped first leaves
            # TensorFlow's shutdown waiting about a minute for its heartbeats: end here instead.
            watch.exit_now(e.code)
        return e.code
    except errors.StartMismatch as e:
        for line in str(e).splitlines():
            print(f"od-dist: {who}: {line}", file=sys.stderr, flush=True)
        return exit_codes.INVALID
    except Exception as e:  # noqa: BLE001 - TensorFlow's error for a lost peer: name it, exit 138
        # A peer error that names none (a collective aborted when the coordination service's
        # heartbeat timed out over a network outage) is still a lost peer: all of them, for all it says.
        lost = (watch.lost_in_error(str(e), peers) or peers) if _is_peer_error(e) else []
        if not lost:
            missing = _missing_data(e, peers, who)
            if config.is_coordinator:
                # A permanent failure: the servers would otherwise wait --wait_timeout for a master
                # that will not come back, exit 138 and be restarted by their own supervisors.
                _stop_servers(
                    cluster, notes.word(f"failed ({missing or type(e).__name__})", _code_of(e)), who
                )
            if missing:
                raise RoleError(missing) from None
            raise
        watch.exit_lost(
            who,
            f"lost {', '.join(f'{t.name} at {t.address}' for t in lost)} "
            f"({type(e).__name__}); {_after_loss(config)}",
        )
    if config.is_coordinator:
        _stop_servers(cluster, notes.DONE, who)
    return 0


def _code_of(e: BaseException) -> int:
    """The exit status `e` ends this process with (cli/train.py's _run_role, and cli's main)."""
    from od_dist.model.pipeline import PipelineError

    if isinstance(e, KeyboardInterrupt):
        return exit_codes.INTERRUPTED
    if isinstance(e, SystemExit) and isinstance(e.code, int):  # patches.check
        return e.code
    return exit_codes.INVALID if isinstance(e, PipelineError) else exit_codes.FAILED


def _stopped_before_training(config: TrainConfig, beacon, e: BaseException) -> None:
    """The master stops before it connected to its servers (a pipeline or records check, Ctrl+C
    while it loads or waits for its peers): it tells them on its port, which it still holds, so
    they exit at once with its reason rather than wait --wait_timeout and exit 138 (retryable)."""
    from od_dist.task import server
    from od_dist.task.strategy import PeerStopped

    code = _code_of(e)
    if isinstance(e, PeerStopped):
        word = notes.stopped_the_job(str(e))
    elif code == exit_codes.INTERRUPTED:
        word = notes.by_person()
    else:
        word = notes.word(f"stopped before training ({str(e).strip() or type(e).__name__})", code)
    why = f"{e}; " if isinstance(e, PeerStopped) else ""
    print(
        f"{config.selected.task.name}: {why}stopping before training (exit {code}); telling the servers "
        f"(for {server.BEACON_LINGER_S:.0f} s)",
        flush=True,
    )
    server.say_on_beacon(beacon, word.splitlines()[0])


def _stopped_before_starting(task, e: KeyboardInterrupt) -> None:
    """Ctrl+C on a server or a multi_worker_mirrored trainer before it serves or trains (while it
    loads or waits): it says so on its port, which is free then, to the peers waiting for it
    (strategy.wait_for_peers), which end with 130 in turn, rather than wait --wait_timeout."""
    from od_dist.task import server

    try:
        port = server.bind_port(task)
    except (server.ServerError, OSError):
        return  # its TensorFlow server holds it: its peers have connected already
    word = str(e) or f"{task.name} was stopped (Ctrl+C)"  # its own Ctrl+C, or a peer's passed on
    print(
        f"{task.name}: {str(e) or 'Ctrl+C'} before the job started; telling the peers waiting for it "
        f"(for {server.BEACON_LINGER_S:.0f} s)",
        flush=True,
    )
    with port:
        server.say_on_beacon(port, word)


def _model_built(config: TrainConfig, dist, who: str):
    """What is done once the model exists, before the first step: the all-reduce's type (set on
    the optimizer) and packs (whose size follows the model's), and on the master a line with the
    bytes each step moves for this model and layout, so a user can hold it against the network
    before waiting an hour. With the cluster file's sync_every, the trainers step alone and meet
    after every loop instead. Several multi_worker_mirrored trainers: returns what each loop's end
    runs (the meeting, and the network's share of a step: network_share.Measure)."""
    meeting = local_sgd.of_cluster(config.selected.cluster) if config.in_sync else None
    lead = config.role == "master"

    def built(trainer_obj):
        import tensorflow as tf

        from od_dist.cluster import traffic
        from od_dist.task import network_share, strategy, trainer
        from od_dist.task.group import several_trainers

        model, optimizer = trainer_obj.model, trainer_obj.optimizer
        several = several_trainers(dist)
        if meeting is not None and several:
            local_sgd.step_locally(dist, optimizer)
            wire = None if config.all_reduce_dtype == "float32" else tf.as_dtype(config.all_reduce_dtype)
            meetings = local_sgd.Meetings(dist, model, meeting, wire)
            meetings.anchor()
            weights, gradients = trainer.variable_bytes(model, wire)
            if lead:
                sent_in = f" in {config.all_reduce_dtype}" if wire is not None else ""
                print(
                    f"{who}: sync_every {meeting.every}: {local_sgd.describe(meeting)}; each meeting all-reduces "
                    f"{meetings.bytes / 1e6:.2f} MB{sent_in} (the change of every weight and batch-norm "
                    "statistic), no step does",
                    flush=True,
                )
            return network_share.Measure(dist, lead, sum(gradients), meetings.bytes, wire, meetings)
        wire = strategy.reduce_gradients_in(dist, optimizer, config.all_reduce_dtype)
        weights, gradients = trainer.variable_bytes(model, wire)
        sent_in = f" in {config.all_reduce_dtype}" if wire is not None else ""
        packs = strategy.pack_gradients(dist, gradients, config.all_reduce_packs)
        whole = strategy.gradients_to_ps_whole(dist, optimizer) if config.ps_pack_gradients else 0
        if lead:
            smallest, largest = (f"{min(packs) / 1e6:.2f}", f"{max(packs) / 1e6:.2f}") if packs else ("", "")
            sizes = smallest if smallest == largest else f"{smallest} to {largest}"
            how = (
                f"; all-reduced{sent_in} in {len(packs)} packs of {sizes} MB as the backward pass computes them"
                if packs
                else sent_in and f"; all-reduced{sent_in}"
            )
            if whole:
                how = f"; the gradients go to the {whole} ps task(s) as one tensor each a step, not one per variable"
            line = traffic.describe(config.selected.cluster, weights, sum(gradients))
            print(f"{who}: {line}{how}", flush=True)
        if not several:
            return None
        # A meeting would send every float variable once (batch-norm statistics too).
        float_bytes = sum(v.shape.num_elements() * 4 for v in model.variables if v.dtype.is_floating)
        sent = float_bytes * (wire.size if wire is not None else 4) // 4
        return network_share.Measure(dist, lead, sum(gradients), sent, wire)

    return built


_NO_SUCH_FILE = re.compile(r"([^\s;'\"]+)[;:]\s*No such file or directory")


def _missing_data(e: Exception, peers, who: str) -> str | None:
    """TensorFlow's page for records a task cannot open, as one line naming the task (from the
    device in the message, else this trainer), its address, the path and the fix; else None."""
    import tensorflow as tf

    from od_dist.task import watch

    text = str(e)
    path = _NO_SUCH_FILE.search(text)
    if not isinstance(e, tf.errors.NotFoundError) or not path:
        return None
    named = {(job, int(index)) for job, index in watch.TF_TASK.findall(text)}
    where = [t for t in peers if (t.tf_job, t.index) in named]
    task = f"{where[0].name} at {where[0].address}" if where else who
    return (
        f"{task} cannot read {path.group(1)}: no such file on that machine; every machine whose task "
        "reads data needs the records at that path (copy them there, or put them on a shared "
        "folder), then start the job again ('od-dist doctor --pipeline' checks it)"
    )


def _server_requests(config: TrainConfig, peers):
    """The parameter_server master reads the servers' stop requests (a Ctrl+C on a server's
    machine) at each loop boundary; other trainers have none to read."""
    if not config.is_coordinator:
        return None
    from od_dist.task import server

    servers = [t for t in peers if t.role in ("ps", "worker")]
    return lambda: server.stop_requests(config.selected.cluster, servers)


def _stop_servers(cluster, why: str, who: str) -> None:
    """Tells the ps and parameter_server workers to exit 0 (their stop marker says `why`)."""
    from od_dist.task import server

    servers = [t for t in cluster.server_tasks() if t.role in ("ps", "worker")]
    failed = server.send_stop(cluster, servers, why)
    told = [t.name for t in servers if t.name not in failed]
    print(
        f"{who}: {notes.shown(why)}; told {', '.join(told) or 'no server'} to stop"
        + "".join(f"; {name}: {reason}" for name, reason in failed.items()),
        flush=True,
    )


def _after_loss(config: TrainConfig) -> str:
    if config.is_coordinator:
        return "restart the job (every task) to resume from the last checkpoint"
    return (
        "multi_worker_mirrored cannot go on without every trainer; restart all of them to resume "
        "from the last checkpoint"
    )


def _watched(config: TrainConfig, peers) -> list:
    """What a trainer watches: under parameter_server, the workers (the job goes on while one is
    left) and each ps; under multi_worker_mirrored, every other trainer."""
    if config.is_coordinator:
        workers = [t for t in peers if t.role == "worker"]
        return [
            (
                workers,
                True,
                config.wait_timeout,
                "every worker is gone, so nothing trains; restart them "
                "on the same addresses to rejoin, or restart the job to resume from the last checkpoint",
                (notes.WAITED_OUT,),
            ),
            (
                [t for t in peers if t.role == "ps"],
                False,
                config.wait_timeout,
                _after_loss(config),
                _ps_lost(config),
            ),
        ]
    if config.strategy_name == "multi_worker_mirrored":
        return [(peers, False, config.lost_peer_timeout, _after_loss(config), ())]
    return []


def _ps_lost(config: TrainConfig) -> tuple[str, ...]:
    """The notes a coordinator leaves when a ps stayed away --wait_timeout: in an elastic job, that
    no round can go on (its variables were there), not only that a restart would wait again."""
    return (notes.WAITED_OUT, notes.PS_LOST) if config.selected.cluster.min_trainers else (notes.WAITED_OUT,)


def _is_peer_error(e: Exception) -> bool:
    import tensorflow as tf

    return isinstance(
        e,
        (
            tf.errors.UnavailableError,
            tf.errors.AbortedError,
            tf.errors.CancelledError,
            tf.errors.DeadlineExceededError,  # a peer's heartbeat missed (a network outage)
        ),
    )


@contextlib.contextmanager
def _checkpoint_feed(config: TrainConfig):
    """The lead's checkpoint feed (the cluster file's checkpoint_port) while it trains, else None."""
    cluster, task = config.selected.cluster, config.selected.task
    at = cluster.checkpoint_feed() if cluster is not None and task == cluster.lead_task() else None
    if at is None:
        yield None
        return
    # What a fetcher says it holds is believed from its own machine's address only.
    fetchers = [
        (checkpoint_feed.EVALUATOR if t.role == "evaluator" else t.name, t.address.host)
        for t in topology.feed_readers(cluster)
    ]
    try:
        feed = checkpoint_feed.Feed(
            config.model_dir,
            at.host,
            at.port,
            cluster.job_id(),
            fetchers,
            say=lambda line: print(f"{task.name}: {line}", flush=True),
        )
    except OSError as e:
        raise RoleError(
            f"checkpoint_port: {at.port}: cannot serve the checkpoints on {at} ({e.strerror or e}); "
            "free the port, or give checkpoint_port another one in the cluster file"
        ) from None
    with feed:
        where = f"port {at.port} of every interface ({at.host} is none of them)" if feed.everywhere else at
        print(
            f"{task.name}: serving the newest checkpoint of {config.model_dir} on {where}, read-only",
            flush=True,
        )
        yield feed


def _serve_final(feed, config: TrainConfig) -> None:
    """Training is done: the feed stays up until the evaluator holds the final checkpoint (it
    may be on a machine without the folder), and, in an elastic round, every worker that keeps a
    copy (run_server), at most --wait_timeout."""
    cluster = config.selected.cluster
    final = checkpoint_feed.newest(config.model_dir)
    fetchers = [checkpoint_feed.EVALUATOR] if cluster.tasks_of("evaluator") else []
    if membership.group_from_env() is not None and cluster.strategy == PARAMETER_SERVER:
        fetchers += [t.name for t in cluster.tasks_of("worker")]
    waiting = [by for by in fetchers if final is not None and not feed.fetched(final[0], by)]
    if not waiting:
        return
    who = "the evaluator" if waiting == [checkpoint_feed.EVALUATOR] else ", ".join(waiting)
    print(
        f"{config.selected.task.name}: serving {final[1]} until {who} {'has' if len(waiting) == 1 else 'have'} it "
        f"(at most --wait_timeout, {config.wait_timeout} s)",
        flush=True,
    )
    if cluster.strategy == MULTI_WORKER_MIRRORED and len(cluster.trainers()) > 1:
        from od_dist.host import console

        # The coordination service runs in this task: once the other trainers' normal exit stops
        # their heartbeats it calls them crashed, in an ERROR line of this log (docs/console.md).
        console.to_log(
            f"{config.selected.task.name}: the other trainers are done and exit; TensorFlow's coordination "
            "service, still up here while this task serves, will log them as crashed in about 10 s "
            "(BaseCollectiveExecutor::StartAbort UNAVAILABLE ... The tasks have crashed): their normal "
            "end, not a failure"
        )
    deadline = time.monotonic() + config.wait_timeout
    missed = [
        by for by in waiting if not feed.wait_fetched(final[0], max(0.0, deadline - time.monotonic()), by)
    ]
    if missed:
        who = "the evaluator" if missed == [checkpoint_feed.EVALUATOR] else ", ".join(missed)
        print(
            f"{config.selected.task.name}: {who} did not fetch {final[1]} within --wait_timeout; "
            f"it is in {config.model_dir} on this machine",
            flush=True,
        )


def run(config: TrainConfig) -> int:
    from od_dist import patches
    from od_dist.task import phases, server, threads

    task = config.selected.task
    # The port before TensorFlow's import (seconds): a taken port fails at once. The coordinator
    # keeps it as its beacon from here, so the servers see it alive while it loads.
    beacon = None
    if task is not None and task.address.port is not None:
        try:
            beacon = server.bind_port(task)
        except server.ServerError as e:
            raise RoleError(str(e)) from None
        if not config.is_coordinator:
            beacon.close()
            beacon = None
    try:
        patches.imports.import_tensorflow(keras=not config.is_server)
        # Before anything initialises TensorFlow's thread pools (devices, servers, strategies).
        threads.apply(config.threads, task.name if task else "single")
        phases.mark("TensorFlow imported")
        # A library upgrade that breaks a patch: one line now, before any wait or step. A server
        # runs none of Model Garden's code: TensorFlow's patches only (no Model Garden import).
        if config.is_server:
            patches.check([patches.base.TENSORFLOW[0]])
            return run_server(config)
        patches.check()
        phases.mark("Model Garden imported")  # by check(): its patches' modules
        if config.role == "evaluator":
            return evaluator.run_evaluator(config)
        with _checkpoint_feed(config) as feed:
            code = run_trainer(config, beacon)
            if feed is not None and code == 0:
                _serve_final(feed, config)
            return code
    except BaseException as e:
        if beacon is not None and beacon.fileno() != -1:  # still ours: TensorFlow never connected
            _stopped_before_training(config, beacon, e)
        elif isinstance(e, KeyboardInterrupt) and task is not None and task.address.port is not None:
            _stopped_before_starting(task, e)
        raise
    finally:
        if beacon is not None:
            beacon.close()
