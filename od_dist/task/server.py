"""The life of a TensorFlow server task (every ps; workers under parameter_server).

TensorFlow's `Server.join()` never returns, so a ps would outlive its job. Here `join()` runs in a
daemon thread and the main thread watches for three things:
  - a stop marker: once training is done, the master writes a file named for this task into the
    server's working directory *through the server itself* (`tf.io.write_file` placed on this
    task's CPU), so it works across machines and operating systems with no extra channel;
  - SIGINT/SIGTERM (Ctrl+C, CTRL_BREAK on Windows);
  - the master's port staying closed for longer than the wait timeout (it never came, or it
    died and nobody restarted it), so a server never waits forever.
A crashed master sends no marker: the servers stay up (within that timeout) for a restarted master
to reuse, which is TensorFlow's recovery rule.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import threading
import time

from absl import logging

from od_dist import patches
from od_dist.cluster import hostinfo
from od_dist.cluster.spec import Cluster, Task
from od_dist.protocol import exit_codes, membership, notes, peers
from od_dist.task import phases
from od_dist.task import stop as stop_mod

POLL_S = 0.5
MASTER_PROBE_S = 5.0
MASTER_EXIT_WAIT_S = 30.0
# An elastic round's coordinator binds its port within seconds of the round's start (task/roles.py's
# beacon, before TensorFlow's import); a worker of the round that never sees it this long (at most
# --wait_timeout) takes it for lost, and its od-dist forms the next round.
ROUND_START_S = 60.0
# A server stopped with Ctrl+C asks the master to save and end the job (stop_request), and waits
# this long for its word (--grace_period's default: a loop plus a save).
PERSON_STOP_WAIT_S = 120.0
MARKER_WRITE_POLLS = 4  # polls a stop marker may stay empty (being written) before it counts as notes.DONE


class ServerError(RuntimeError):
    """A server that could not start or was abandoned; the message is for the user."""


def stop_marker(cluster: Cluster, task: Task) -> str:
    """Relative on purpose: it resolves in the server's own working directory, on its own machine.
    It names the job (Cluster.job_id) as well as the task: jobs may share a directory (an NFS home)."""
    return f".od-dist-stop-{cluster.job_id()}-{task.tf_job}-{task.index}"


def stop_request(cluster: Cluster, task: Task) -> str:
    """What a server stopped by a person leaves in its working directory for the master to read
    through it (stop_requests): relative, named like its stop marker."""
    return stop_marker(cluster, task).replace("-stop-", "-stop-request-", 1)


# A master that stops before training has no TensorFlow connection to write stop markers through;
# it holds its port (its beacon) from its start, and answers each connection there with this and
# why it stops, for BEACON_LINGER_S (the servers probe it every MASTER_PROBE_S). A task stopped by
# Ctrl+C before the job started does the same on its own port, for the peers waiting for it.
BEACON_WORD = b"od-dist master: "
BEACON_LINGER_S = MASTER_PROBE_S + 2.0
BEACON_READ_S = 0.3  # a beacon that says nothing (still training's) answers no byte


def probe_master(host: str, port: int) -> tuple[bool, str]:
    """(listening, what the master said on its port: '' unless it stops before training)."""
    return probe_all([(host, port)])[0]


def probe_all(addresses) -> list[tuple[bool, str]]:
    """For each (host, port): (listening, what the task there said on its port, '' if nothing:
    a task stopped before the job started says why, say_on_beacon). All are read at once, within
    BEACON_READ_S: TensorFlow's server and a beacon that says nothing send no byte first."""
    conns = []
    for host, port in addresses:
        try:
            conns.append(socket.create_connection((host, port), timeout=1.0))
        except OSError:
            conns.append(None)
    words = [""] * len(conns)
    waiting = {c: i for i, c in enumerate(conns) if c is not None}
    deadline = time.monotonic() + BEACON_READ_S
    try:
        while waiting and time.monotonic() < deadline:
            ready, _, _ = select.select(list(waiting), [], [], max(0.0, deadline - time.monotonic()))
            for conn in ready:
                i = waiting.pop(conn)
                try:
                    data = conn.recv(4096)
                except OSError:
                    data = b""
                if data.startswith(BEACON_WORD):
                    words[i] = data[len(BEACON_WORD) :].decode("utf-8", "replace").strip()
    finally:
        for conn in conns:
            if conn is not None:
                conn.close()
    return [(conn is not None, word) for conn, word in zip(conns, words)]


def say_on_beacon(beacon: socket.socket, word: str, linger_s: float = BEACON_LINGER_S) -> None:
    """Answers every connection to a task's port with `word` (probe_all: the master's servers,
    or a task's peers while they wait for it) for linger_s seconds; a second Ctrl+C ends it."""
    deadline = time.monotonic() + linger_s
    try:
        beacon.settimeout(POLL_S)
        while time.monotonic() < deadline:
            try:
                conn, _ = beacon.accept()
            except TimeoutError:
                continue
            with conn:
                try:
                    conn.sendall(BEACON_WORD + word.encode("utf-8", "replace") + b"\n")
                except OSError:  # an earlier probe, queued and closed since
                    pass
    except (OSError, KeyboardInterrupt):
        pass


def is_listening(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def bind_port(task: Task) -> socket.socket:
    """Binds this task's port on every interface, as TensorFlow's server will, and returns the
    listening socket. TensorFlow reports a taken port as a bare 'Could not start gRPC server' (or
    crashes), so this names the port and the fix instead."""
    try:
        return hostinfo.bind_port(task.address.host, task.address.port)
    except OSError as e:
        if e.errno in hostinfo.PORT_TAKEN:
            raise ServerError(
                f"{task.name}: port {task.address.port} is already in use on this machine "
                f"({e.strerror}); stop the program using it, or give {task.key} another port "
                "in the cluster file"
            ) from None
        raise


def serve(
    cluster: Cluster,
    task: Task,
    wait_timeout: float,
    devices=None,
    term_to_all: bool = False,
    lost_s: float | None = None,
) -> int:
    """Runs this task's server until the master says done (0) or that a person stopped it (130),
    a signal (143 for SIGTERM, 130 for SIGINT/SIGBREAK, unless the master's word came first), or the master stays
    unreachable for wait_timeout seconds (LOST_PEER, 138: it never came, or it died); `lost_s`, once
    it was up: a worker of an elastic job, whose supervisor then forms the next round. A ps of an
    elastic job watches whichever member coordinates the round (round_lead) instead of the master.
    `term_to_all`: a SIGTERM reaches the master too (scancel, a Slurm time limit), which saves
    its checkpoint through the servers: they serve on until its port closes, then exit 143."""
    import tensorflow as tf

    bind_port(task).close()
    marker = stop_marker(cluster, task)
    request = stop_request(cluster, task)
    try:
        # Left by an earlier run, it is no stop request for this one; and the master will write it here.
        with open(marker, "w"):
            pass
        os.remove(marker)
        if os.path.exists(request):
            os.remove(request)
    except OSError as e:
        print(
            f"{task.name}: cannot write in its working directory {os.getcwd()} ({e.strerror}): the master "
            f"cannot tell it to stop after training, so it will stop {wait_timeout:.0f} s after the master "
            "is gone; run it from a writable directory",
            file=sys.stderr,
            flush=True,
        )
    if devices is not None:
        devices()
    try:
        server = tf.distribute.Server(
            tf.train.ClusterSpec(cluster.cluster_spec()),
            job_name=task.tf_job,
            task_index=task.index,
            protocol="grpc",
            start=True,
        )
    except (tf.errors.UnknownError, tf.errors.InternalError) as e:
        raise ServerError(
            f"{task.name}: could not start the TensorFlow server on {task.address} "
            f"({e.message.strip()}); is the port free?"
        ) from None
    stop = threading.Event()
    received = []

    def on_signal(signum, _frame):
        # Its supervisor's own stop (a restart; CTRL_BREAK on Windows) is a SIGTERM: never a
        # person's Ctrl+C that asks the master to end the job.
        received.append(stop_mod.meant(signum))
        stop.set()

    for name in ("SIGINT", "SIGTERM", "SIGBREAK"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), on_signal)
    # Only now say "ready": a Ctrl+C/SIGTERM sent in answer to that line must find the handlers.
    threading.Thread(target=server.join, name=f"{task.name}-join", daemon=True).start()
    phases.mark("serving")  # before the line a benchmark or a test waits for
    print(f"{task.name} serving on {task.address}", flush=True)

    master = cluster.master
    # A ps of an elastic job serves whichever member coordinates the round (host/elastic.py).
    follows_rounds = task.role == "ps" and cluster.min_trainers is not None
    absent = peers.Unreachable(never_seen_since=time.monotonic())
    next_probe = 0.0
    unwritten = 0
    asked_at = None  # when a Ctrl+C here asked the master to end the job
    termed_at = None  # when a SIGTERM came that the master also got (term_to_all)
    try:
        while True:
            if stop.wait(POLL_S):
                # Every SIGTERM is the same request then (its supervisor passes one on too); a
                # Ctrl+C still stops it at once.
                terms = set(received) == {signal.SIGTERM}
                if term_to_all and terms and master and is_listening(master.host, master.port):
                    if termed_at is None:
                        termed_at = time.monotonic()
                        print(
                            f"{task.name}: SIGTERM; serving until the master has saved and exited", flush=True
                        )
                    stop.clear()
                    continue
                if asked_at is None and _ask_master(master, task, request, received):
                    asked_at = time.monotonic()
                    stop.clear()
                    continue
                break
            if os.path.exists(marker):
                why = _read_marker(marker)
                if not why and unwritten < MARKER_WRITE_POLLS:  # seen between its creation and its text
                    unwritten += 1
                    continue
                code = _told(task, why)
                _wait_for_master_exit(master, wait_timeout)
                return code
            if asked_at is not None and (
                time.monotonic() - asked_at > PERSON_STOP_WAIT_S or not is_listening(master.host, master.port)
            ):
                print(
                    f"{task.name}: the master did not answer; stopping, exit {exit_codes.INTERRUPTED}",
                    flush=True,
                )
                return exit_codes.INTERRUPTED
            if termed_at is not None and not is_listening(master.host, master.port):
                break  # the master saved and exited: the SIGTERM's exit below
            now = time.monotonic()
            if master is not None and now >= next_probe:
                next_probe = now + MASTER_PROBE_S
                lead, forming = round_lead(cluster) if follows_rounds else (None, False)
                master = lead or master
                listening, word = probe_master(master.host, master.port)
                if word:  # the master stops before training: no marker will come
                    return _told(task, word)
                elastic = lost_s is not None
                if elastic and listening and not absent.seen("master"):
                    print(f"{task.name}: the round's coordinator at {master} is up", flush=True)
                # Members forming the next round: the job goes on, whatever the last coordinator's port.
                absent.look("master", listening or (forming and not lead), now)
                lost_after = wait_timeout
                if elastic:
                    lost_after = lost_s if absent.seen("master") else min(wait_timeout, ROUND_START_S)
                if absent.lost("master", now, lost_after):
                    then = (
                        "its od-dist forms the next round"
                        if elastic
                        else "restart the job to resume from the last checkpoint, or raise --wait_timeout "
                        "to wait longer"
                    )
                    print(
                        f"{task.name}: {peers.lost_line(f'the master at {master}', lost_after)}; "
                        f"stopping, exit {exit_codes.LOST_PEER} ({then})",
                        file=sys.stderr,
                        flush=True,
                    )
                    if not elastic:
                        notes.leave_for_supervisor(notes.WAITED_OUT)  # its restart would wait again
                    return exit_codes.LOST_PEER
        if os.path.exists(marker):  # the master said done (or stopped), then the signal came
            return _told(task, _read_marker(marker))
        # Without the master's word this is a stop, not the end of the job: a supervisor restarts
        # a server stopped this way (SIGTERM: a drained node), as it would after a crash.
        code = exit_codes.for_signal(received[0])
        print(f"{task.name}: stopped by signal {received[0]}; exit {code}", flush=True)
        return code
    finally:
        for path in (marker, request):
            if os.path.exists(path):
                os.remove(path)


def round_lead(cluster: Cluster):
    """(the address of the member that coordinates the round an elastic parameter_server job trains
    in now, None while none trains; whether its members form the next round), from the trainer
    machines' membership."""
    addresses = list(cluster.membership_addresses().values())
    name, forming = membership.rounds_seen(addresses, cluster.job_id())
    return next((t.address for t in cluster.members() if t.name == name), None), forming


def _ask_master(master, task: Task, request: str, received: list) -> bool:
    """After a first Ctrl+C (SIGINT, SIGBREAK; not SIGTERM, a pause) with the master up: asks it to
    save a checkpoint and end the job, which it reads at its next loop boundary. False when the
    server should stop at once instead."""
    if len(received) != 1 or received[0] == signal.SIGTERM or master is None:
        return False
    if not is_listening(master.host, master.port):
        return False
    try:
        with open(request, "w", encoding="utf-8") as f:
            f.write(f"{task.name} was stopped by Ctrl+C")
    except OSError:
        return False
    print(
        f"{task.name}: Ctrl+C: asking the master to save a checkpoint and end the job (up to "
        f"{PERSON_STOP_WAIT_S:.0f} s; Ctrl+C again to stop at once)",
        flush=True,
    )
    return True


def _told(task: Task, why: str) -> int:
    """The line for the master's word, and the exit code it means: 0 when training is done, 130
    when a person stopped the job, the master's own when it failed (protocol/notes.py)."""
    said, code = notes.read(why)
    if code == exit_codes.INTERRUPTED:
        print(f"{task.name}: the master {said}; stopping; exit {code}", flush=True)
    else:
        print(f"{task.name}: the master {why or notes.DONE}; stopping", flush=True)
    return code


def _read_marker(path: str) -> str:
    """What the master wrote: why the job ends (send_stop's `why`); "" while not yet written."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(4096).strip()
    except OSError:
        return ""


def _wait_for_master_exit(master, limit_s: float) -> None:
    """Let the master exit first: if its servers vanish under it, TensorFlow prints a burst of
    harmless but alarming 'connection refused' errors as the master releases remote functions."""
    deadline = time.monotonic() + min(limit_s, MASTER_EXIT_WAIT_S)
    while master is not None and time.monotonic() < deadline and is_listening(master.host, master.port):
        time.sleep(POLL_S)


def stop_requests(cluster: Cluster, tasks) -> list[str]:
    """From the connected master, at a loop boundary: what each server stopped by a person asks
    (`ps:0 was stopped (Ctrl+C)`), read through the server itself as its stop marker is written.
    A server that cannot be reached asks nothing here: the master's peer watch deals with it."""
    import tensorflow as tf

    asked = []
    for task in tasks:
        try:
            with (
                patches.tensorflow.own_executor(),
                tf.device(f"/job:{task.tf_job}/replica:0/task:{task.index}/device:CPU:0"),
            ):
                found = tf.io.matching_files(stop_request(cluster, task)).numpy()
                if len(found):
                    asked.append(tf.io.read_file(found[0]).numpy().decode("utf-8", "replace").strip())
        except tf.errors.OpError as e:
            logging.info("could not read the stop request of %s: %s", task.name, e)
    return [a for a in asked if a]


def send_stop(cluster: Cluster, tasks, why: str = notes.DONE, timeout_s: float = 30.0) -> dict[str, str]:
    """From the connected master: write each server's stop marker (`why` the job ends, which the
    server prints) through that server, all at once. Returns, for each task that could not be
    told, the reason: gone ("could not reach"), or its working directory would not take the
    marker (e.g. read-only)."""
    import tensorflow as tf

    told = set()
    problems = {}
    unreachable = (
        tf.errors.UnavailableError,
        tf.errors.DeadlineExceededError,
        tf.errors.CancelledError,
        tf.errors.AbortedError,
    )

    def write(task):
        try:
            # Its own executor: a failed remote op poisons the executor it ran in, and with the
            # shared one every other task's write would report this task's error.
            with (
                patches.tensorflow.own_executor(),
                tf.device(f"/job:{task.tf_job}/replica:0/task:{task.index}/device:CPU:0"),
            ):
                tf.io.write_file(stop_marker(cluster, task), why)
                # A remote op without outputs can return before it ran: reading the marker back
                # surfaces a write that failed (a read-only directory).
                tf.io.read_file(stop_marker(cluster, task)).numpy()
            told.add(task.name)
        except unreachable as e:  # a gone server is reported, not fatal
            logging.info("could not tell %s to stop: %s", task.name, e)
            problems[task.name] = "could not reach it"
        except tf.errors.OpError as e:
            problems[task.name] = (
                "could not write its stop marker in its working directory "
                f"({e.message.strip().splitlines()[0]})"
            )

    threads = [threading.Thread(target=write, args=(t,), daemon=True) for t in tasks]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return {t.name: problems.get(t.name, "could not reach it") for t in tasks if t.name not in told}
