"""`od-dist doctor`: what would stop a job on this machine, checked before anything starts.

One line per check, each `ok`, `warn` (worth a look, not a blocker) or `FIX` (with what to do):
this machine's entry in the cluster file, every peer's host name resolving, the port of every peer
this machine's tasks connect to reachable from here, this machine's own ports free (and listening on
every interface, as TensorFlow's server does: a public one is worth a look), the installed
versions, the GPUs the driver shows and those TensorFlow lists (asked in a child process) vs
num_clones, with --pipeline the records its tasks read and the global batch against the trainers
in sync, and with --model_dir that its tasks can write there, whether it must be shared and where
the newest checkpoint is; inside WSL2, NAT networking, which hides its ports from the LAN.

A peer's port is probed with a plain TCP connect; the answer tells the cases apart:
  connected            something accepts connections there (its task, or another
                       program or a proxy on the port: a connect cannot tell)  -> ok
  connection refused   the machine answered, nothing listens yet (or a firewall
                       REJECTs): fine before the job starts                    -> warn
  no answer (timeout)  a firewall DROPs the packets, or the machine is off      -> FIX
  no route to host     the machine is off or on another network                 -> FIX

The link to each peer machine is measured when a doctor runs there too (bytes per second each way,
LINK_TEST_S each way per peer, over the peer's task port, free before the job): while it runs, each
doctor answers the link test on its own tasks' ports (LinkResponder), and one exchange gives both
ends both directions. With the model's bytes and a step's compute (flags) it predicts each
strategy's speed-up (cluster/advice.py).

Fast on purpose: no TensorFlow import (seconds); versions come from the installed packages'
metadata and GPUs from the NVIDIA driver (`nvidia-smi -L`, else /proc/driver/nvidia/gpus). Only
where the driver shows GPUs does a child process import TensorFlow to list its own
(`python -m od_dist.task.gpus`). The checks of this machine itself (ports, versions, GPUs, WSL2)
are in host/doctor_here.py, each line's shape in host/doctor_check.py.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
from collections import defaultdict

from od_dist.cluster import advice, duties, hostinfo, hostport, messages, placement, validate
from od_dist.cluster.spec import Cluster, InvalidCluster, Task
from od_dist.cluster.topology import connecting_peers, model_dir_line
from od_dist.host.doctor_check import FIX, OK, WARN, Check
from od_dist.host.doctor_here import (
    check_gpus,
    check_listening,
    check_ports_here,
    check_versions,
    check_wsl,
    kernel_string,
)

CONNECT_TIMEOUT_S = 3.0


# ----- this machine's entry ----------------------------------------------------------------------


def check_entry(cluster: Cluster, role: str | None, index: int | None, machine) -> tuple[list[Check], tuple]:
    """(the entry check, the tasks that live on this machine)."""
    mine = cluster.tasks_on(machine.is_local)
    if role is not None:
        role, index = validate.normalize_role(role), index or 0
        problems = placement.check_task(cluster, role, index)
        if problems:
            raise InvalidCluster(problems)
        problems = placement.check_this_machine(cluster, role, index, machine.is_local)
        if problems:
            return [Check(FIX, "this machine", problems[0])], mine
        task = cluster.task(role, index)
        return [Check(OK, "this machine", f"{task.name} at {task.address}")], (task,)
    if cluster.loopback_only():
        return [
            Check(
                OK,
                "this machine",
                "a loopback-only cluster: every task runs here (od-dist launch starts them all)",
            )
        ], mine
    if not mine:
        return [
            Check(
                FIX,
                "this machine",
                f"no entry of the cluster file is an address of this machine "
                f"({machine.describe()}); run doctor on a machine the file lists, or fix its addresses",
            )
        ], mine
    if len(mine) == 1:
        return [
            Check(OK, "this machine", f"{mine[0].name} at {mine[0].address} (found by its addresses)")
        ], mine
    names = ", ".join(t.name for t in mine)
    return [
        Check(
            OK,
            "this machine",
            f"runs {names}: `od-dist train` without --role starts them all (or each with --role/--index)",
        )
    ], mine


# ----- peers ----------------------------------------------------------------------------------------


def check_names(peers) -> tuple[list[Check], set[str]]:
    """(a line per peer host name, the names that do not resolve). IP addresses need no lookup."""
    checks, unresolved = [], set()
    for host in sorted({t.address.host for t in peers if not hostport.is_ip(t.address.host)}):
        users = ", ".join(t.name for t in peers if t.address.host == host)
        addresses = hostinfo.resolve(host)
        if addresses:
            checks.append(Check(OK, f"name {host}", f"resolves to {', '.join(sorted(addresses))} ({users})"))
        else:
            unresolved.add(host)
            checks.append(
                Check(
                    FIX,
                    f"name {host}",
                    f"does not resolve from this machine ({users}): add it to "
                    "DNS or to the hosts file, or write its IP address in the cluster file",
                )
            )
    return checks, unresolved


def probe(host: str, port: int, timeout: float) -> tuple[str, str]:
    """(status, what happened) for a TCP connect to host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            # All a TCP connect shows: a proxy or another program on the port accepts too.
            return OK, "accepts connections (its task's server, or whatever else holds the port)"
    except ConnectionRefusedError:
        return WARN, (
            "connection refused: the machine answers and nothing listens on the port yet (fine "
            "before its task starts), or a firewall rejects it"
        )
    except TimeoutError:
        return FIX, (
            f"no answer within {timeout:g} s: a firewall drops TCP port {port} on {host}, or the machine "
            f"is off; open port {port} there to this machine (the README written by od-dist scripts "
            "lists every port and peer)"
        )
    except OSError as e:
        if e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN):
            return (
                FIX,
                f"no route to host ({e.strerror}): the machine is off or on another network; check its address",
            )
        return FIX, f"cannot connect ({e.strerror or e}); check the address and the network"


def peers_to_reach(cluster: Cluster, mine) -> list[Task]:
    """The tasks whose port a task of this machine connects to (the firewall rules the generated
    scripts' README asks for; a peer it never reaches may rightly be closed to it). A machine with
    no entry: every server."""
    if not mine:
        return list(cluster.server_tasks())
    out = []
    for task in cluster.server_tasks():
        if task in mine:
            continue
        talkers = connecting_peers(cluster, task)
        if any(m in talkers for m in mine):
            out.append(task)
    return out


def check_peers(peers, timeout: float) -> list[Check]:
    """Every peer's port, probed in parallel so that N silent peers cost one timeout, not N."""
    results: dict[Task, tuple[str, str]] = {}

    def one(task):
        results[task] = probe(task.address.host, task.address.port, timeout)

    threads = [threading.Thread(target=one, args=(t,), daemon=True) for t in peers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 5)
    checks = []
    for t in peers:
        status, detail = results.get(t, (FIX, "the probe did not return"))
        checks.append(Check(status, f"{t.name} at {t.address}", detail))
    return checks


# ----- the link to each peer ----------------------------------------------------------------------

LINK_MAGIC = "OD-DIST-LINK 1"
LINK_TEST_S = 0.5  # each way, per peer: a second a peer
LINK_TEST_MAX_S = 3.0  # what a responder grants a peer's doctor, each way
_LINK_BLOCK = 32 << 10  # sent and read whole; its first byte 1 marks the last


class LinkError(Exception):
    pass


def _read_line(sock: socket.socket, limit: int = 256) -> str:
    out = bytearray()
    while not out.endswith(b"\n"):
        got = sock.recv(1)
        if not got:
            raise LinkError("closed the connection")
        out += got
        if len(out) > limit:
            raise LinkError("sent something else")
    return out.decode("ascii", "replace").strip()


def _send_blocks(sock: socket.socket, seconds: float) -> None:
    block = bytearray(_LINK_BLOCK)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sock.sendall(block)
    block[0] = 1
    sock.sendall(block)


def _receive_blocks(sock: socket.socket) -> float:
    """Bytes per second, from the first block's arrival to the last's (the start of a transfer,
    which only waits for the first bytes, left out)."""
    buf = bytearray(_LINK_BLOCK)
    view = memoryview(buf)
    first, blocks = None, 0
    while True:
        got = 0
        while got < _LINK_BLOCK:
            n = sock.recv_into(view[got:])
            if not n:
                raise LinkError("closed the connection during the test")
            got += n
        now = time.monotonic()
        if first is None:
            first = now
        else:
            blocks += 1
        if buf[0] == 1:
            break
    return blocks * _LINK_BLOCK / (now - first) if blocks and now > first else 0.0


class Link(dict):
    """{peer host: (bytes/s from here to it, bytes/s from it to here, seconds each way)}, filled by
    this doctor's tests and by its responder's (a peer's doctor measuring this machine)."""

    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()

    def record(self, host: str, to_it: float, from_it: float, seconds: float) -> None:
        with self.lock:
            self[host] = (to_it, from_it, seconds)


def measure_link(
    host: str, port: int, job: str, me: str, seconds: float, timeout: float
) -> tuple[float, float]:
    """(bytes/s to host, bytes/s from it) against the doctor answering on host:port. Raises
    OSError (nothing there) or LinkError (something else there: its task, another program)."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.settimeout(seconds + timeout + 10)
        s.sendall(f"{LINK_MAGIC} {job} {me} {seconds:g}\n".encode())
        try:
            answer = _read_line(s)
        except (LinkError, OSError) as e:
            raise LinkError(f"the port answers, but not as an od-dist doctor ({e})") from None
        if answer != f"{LINK_MAGIC} ok":
            raise LinkError(
                f"the port answers, but not as an od-dist doctor of this cluster file ({answer[:80]!r})"
            )
        _send_blocks(s, seconds)
        to_it = float(_read_line(s))
        from_it = _receive_blocks(s)
        s.sendall(f"{from_it}\n".encode())
    return to_it, from_it


class LinkResponder:
    """While entered, answers the link test on `ports` of this machine (its tasks' ports, free before
    the job: a port that cannot be bound is left out), so that a peer's doctor can measure the link;
    each test it answers is recorded in `link` under the host the peer names (its cluster address)."""

    def __init__(self, ports, job: str, link: Link, bind_host: str = "127.0.0.1"):
        self.ports, self.job, self.link, self.bind_host = ports, job, link, bind_host
        self.sockets: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        self.stop = threading.Event()

    def __enter__(self):
        for port in self.ports:
            try:
                sock = hostinfo.bind_port(self.bind_host, port)
            except OSError:
                continue
            sock.settimeout(0.2)
            self.sockets.append(sock)
            thread = threading.Thread(target=self._accept, args=(sock,), daemon=True)
            thread.start()
            self.threads.append(thread)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for thread in self.threads:
            thread.join(2)
        for sock in self.sockets:
            sock.close()

    def _accept(self, sock: socket.socket) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(5)
                words = _read_line(conn).split()
                if len(words) != 5 or " ".join(words[:2]) != LINK_MAGIC:
                    return  # a plain connect (a peer's probe) or a stranger
                job, host, asked = words[2], words[3], float(words[4])
                if job != self.job:
                    conn.sendall(f"{LINK_MAGIC} another cluster file (job {self.job})\n".encode())
                    return
                seconds = min(max(asked, 0.05), LINK_TEST_MAX_S)
                conn.sendall(f"{LINK_MAGIC} ok\n".encode())
                conn.settimeout(seconds + 15)
                from_it = _receive_blocks(conn)
                conn.sendall(f"{from_it}\n".encode())
                _send_blocks(conn, seconds)
                to_it = float(_read_line(conn))
                self.link.record(host, to_it, from_it, seconds)
            except (OSError, LinkError, ValueError):
                return


def link_peers(cluster: Cluster, mine) -> dict[str, list[Task]]:
    """{peer host: its server tasks}: the machines whose link to this one a job's steps use (every
    other machine of the file; on a loopback file with --role, the other tasks, as if on machines
    of their own). A peer's doctor answers on one of its tasks' ports."""
    hosts_here = {hostport.machine_of(t.address.host) for t in mine}
    out: dict[str, list[Task]] = defaultdict(list)
    for task in cluster.server_tasks():
        if task in mine or task.address.port is None:
            continue
        if hostport.machine_of(task.address.host) in hosts_here and not cluster.loopback_only():
            continue
        out[task.address.host].append(task)
    return dict(out)


def check_links(
    cluster: Cluster,
    mine,
    probed: list[Check],
    timeout: float,
    seconds: float = LINK_TEST_S,
    wait: float = 0.0,
) -> tuple[list[Check], float | None, str]:
    """(a line per peer host, the slowest rate one way in bytes/s or None, where it came from).
    Tests each peer whose port accepted connections in `probed` (with `wait`, every peer, again
    and again for up to `wait` s, until a doctor there answers or tests this machine)."""
    peers = link_peers(cluster, mine)
    ports = sorted({t.address.port for t in mine if t.role != "evaluator" and t.address.port is not None})
    if not peers or not ports or seconds <= 0:
        return [], None, ""
    job, me = cluster.job_id(), mine[0].address.host
    accepted = {c.what for c in probed if c.status == OK}
    link, why = Link(), {}
    with LinkResponder(ports, job, link, me):
        deadline = time.monotonic() + wait
        while True:
            for host, tasks in peers.items():
                if host in link:
                    continue
                for task in tasks:
                    if not wait and f"{task.name} at {task.address}" not in accepted:
                        why.setdefault(host, "its port accepted no connection when probed")
                        continue
                    try:
                        link.record(
                            host, *measure_link(host, task.address.port, job, me, seconds, timeout), seconds
                        )
                        break
                    except LinkError as e:
                        why[host] = str(e)
                    except OSError as e:
                        why[host] = f"no od-dist doctor answers ({e.strerror or e})"
            if all(h in link for h in peers) or time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        time.sleep(0.2 if wait else 0)  # a test a peer began on this machine's ports ends in it
    checks = []
    for host in peers:
        if host in link:
            to_it, from_it, spent = link[host]
            checks.append(
                Check(
                    OK,
                    f"link to {host}",
                    f"{to_it / 1e6:.2f} MB/s to it, {from_it / 1e6:.2f} MB/s from it "
                    f"({min(to_it, from_it) * 8 / 1e6:.0f} Mbit/s the slower way; {spent:g} s each way)",
                )
            )
    missing = [h for h in peers if h not in link]
    if missing:
        reasons = "; ".join(f"{h}: {why.get(h, 'no answer')}" for h in missing)
        checks.append(
            Check(
                OK,
                "link",
                f"not measured to {', '.join(missing)} ({reasons}); it is measured while `od-dist doctor` runs "
                "on both machines: run it with --link_wait 30 on each within 30 s, or give --link_mbit",
            )
        )
    rates = [min(v[0], v[1]) for h, v in link.items() if h in peers]
    if not rates:
        return checks, None, "measured to no peer"
    said = f"measured, the slowest of {len(rates)} of {len(peers)} peer(s)"
    return checks, min(rates), said


def check_advice(cluster: Cluster, figures, each_task: bool = False) -> list[Check]:
    """Each strategy's expected speed-up from the figures, and the one recommended (cluster/advice.py).
    `each_task`: every task as if on a machine of its own (a loopback file checked with --role)."""
    followed, lines = advice.advise(cluster, figures, each_task)
    return [
        Check(WARN if what == "strategy" and not followed else OK, what, detail) for what, detail in lines
    ]


# ----- the pipeline's records ---------------------------------------------------------------------


def check_data(cluster: Cluster, mine, pipeline_path: str) -> list[Check]:
    """The pipeline's input files, on this machine, for its tasks that read them: the master and
    the workers open (or, a parameter_server master, list) the training and validation records,
    the evaluator the validation records (cluster/duties.py). Paths resolve in the working
    directory, as in training. Reads the pipeline file itself (no TensorFlow): values from
    --params_override are not seen."""
    import glob

    from od_dist.model import pipeline

    readers = {
        split: [t for t in mine if split in duties.of(cluster.strategy, t.role).reads_records]
        for split in duties.RECORD_SPLITS
    }
    if not any(readers.values()):
        return [Check(OK, "data", "no task here reads records")]
    try:
        doc = pipeline._read_file(pipeline_path)
    except pipeline.PipelineError as e:
        return [Check(FIX, "pipeline", str(e))]
    checks = []
    for split, tasks in readers.items():
        if not tasks:
            continue
        key = f"task.{split}.input_path"
        names = ", ".join(t.name for t in tasks)
        value = pipeline._get(doc, key)
        if not value:
            checks.append(
                Check(WARN, key, "not set in the pipeline file (the experiment's default): not checked")
            )
            continue
        patterns = value if isinstance(value, list) else str(value).split(",")
        for pattern in (str(p).strip() for p in patterns if str(p).strip()):
            if "://" in pattern:
                checks.append(Check(WARN, key, f"{pattern}: remote, not checked from here"))
                continue
            found = glob.glob(pattern)
            if found:
                checks.append(Check(OK, key, f"{pattern}: {len(found)} file(s) here, for {names}"))
            else:
                checks.append(
                    Check(
                        FIX,
                        key,
                        f"{pattern}: no such file here (working directory {os.getcwd()}), and {names} "
                        "read it on this machine: copy the records here at that path, or put them on "
                        "a shared folder",
                    )
                )
    return checks


def check_model_dir(cluster: Cluster, mine, model_dir: str) -> list[Check]:
    """The model_dir, for this machine's tasks that write it (every task but the servers), by the
    same probe `train` makes before it starts."""
    from od_dist.host import config

    writers = [t for t in mine if not duties.of(cluster.strategy, t.role).is_server]
    if not writers:
        return [Check(OK, "model_dir", "no task here writes it")]
    names = ", ".join(t.name for t in writers)
    why = config.model_dir_problem(model_dir)
    where = messages.shown(model_dir, messages.PATH_SHOWN_MAX)
    if why:
        return [
            Check(
                FIX,
                "model_dir",
                f"{where}: cannot be created or written: {why} (for {names}); pass a folder this "
                "user can write",
            )
        ]
    shown_dir = where if "://" not in model_dir else f"{where} (remote, not checked from here)"
    return [Check(OK, "model_dir", f"{shown_dir}: writable here, for {names}")]


def check_batch(cluster: Cluster, pipeline_path: str, params_override: str | None = None) -> list[Check]:
    """The global batch against the trainers in sync, as they check it at start
    (batch.check_batch_split, the rule validate, scripts, k8s and slurm apply)."""
    from od_dist.model import batch, pipeline

    try:
        problem, said, read = batch.check_batch_split(cluster, pipeline_path, params_override)
    except pipeline.PipelineError as e:
        return [Check(FIX, "pipeline", str(e))]
    if problem:
        return [Check(FIX, "global batch", problem)]
    return [Check(OK if read else WARN, "global batch", said)] if said else []


def check_checkpoints(cluster: Cluster, mine, model_dir: str, timeout: float) -> list[Check]:
    """Whether --model_dir must be shared (the scripts' README says it in the same words), and
    where the newest checkpoint is: here, or on the lead's machine when its checkpoint feed (the
    cluster file's checkpoint_port) answers with a newer one."""
    from od_dist.protocol import checkpoint_feed

    if all(duties.of(cluster.strategy, t.role).is_server for t in mine):
        return []  # no task here writes or reads checkpoints
    checks = [Check(OK, "model_dir shared?", model_dir_line(cluster).replace("`", ""))]
    here = checkpoint_feed.newest(model_dir)
    has = f"step {here[0]}" if here else "none"
    lead, feed = cluster.lead_task(), cluster.checkpoint_feed()
    if lead is None or lead in mine:
        return checks + [Check(OK, "newest checkpoint", f"here: {has}")]
    if feed is None:
        return checks + [
            Check(
                OK,
                "newest checkpoint",
                f"here: {has}; {lead.name}'s are on its machine ({lead.address.host})",
            )
        ]
    try:
        listing = checkpoint_feed.read_listing(feed.host, feed.port, timeout)
    except checkpoint_feed.FeedError as e:
        return checks + [
            Check(
                OK,
                "newest checkpoint",
                f"here: {has}; {lead.name}'s checkpoint feed at {feed} does not answer ({e}): it serves "
                "its newest only while the job trains",
            )
        ]
    if listing.get("job") != cluster.job_id():
        return checks + [
            Check(WARN, "newest checkpoint", f"here: {has}; {feed} serves another job's checkpoints")
        ]
    step = int(listing.get("step") or 0)
    if step and step > (here[0] if here else 0):
        where = f"on {lead.name}'s machine ({lead.address.host}, its checkpoint feed at {feed})"
        return checks + [Check(OK, "newest checkpoint", f"step {step} {where}; here: {has}")]
    return checks + [
        Check(OK, "newest checkpoint", f"here: {has} ({lead.name}'s feed serves step {step or 'none'})")
    ]


# ----- all of it ------------------------------------------------------------------------------------


def check_layout(cluster: Cluster) -> list[Check]:
    """A parameter_server layout that puts every variable behind one machine's link."""
    from od_dist.cluster import traffic

    problem = traffic.single_link_layout(cluster)
    return [Check(WARN, "layout", problem)] if problem else []


def run(
    cluster_path: str,
    role: str | None,
    index: int | None,
    allow_public: bool,
    connect_timeout: float = CONNECT_TIMEOUT_S,
    machine=None,
    pipeline: str | None = None,
    model_dir: str | None = None,
    kernel: str | None = None,
    params_override: str | None = None,
    figures=None,
    link_test: float = LINK_TEST_S,
    link_wait: float = 0.0,
) -> tuple[list[Check], str]:
    """Every check, in order. Raises InvalidCluster for an invalid file or --role/--index (exit 2).
    `machine` (its interfaces) and `kernel` (the kernel's description) default to this machine's.
    `figures` (advice.Figures): the model's bytes, a step's compute, and the link's speed when given
    (else measured: `link_test` s each way per peer, waiting up to `link_wait` s for their doctors)."""
    from od_dist.host import config

    unchecked: list[str] = []
    cluster = config.load_cluster(cluster_path, allow_public, unchecked)
    if index is not None and role is None:
        raise InvalidCluster([messages.problem("--index", index, "given without --role", "add --role")])
    machine = machine or hostinfo.this_machine()
    head = (
        f"{cluster_path}: valid, strategy {cluster.strategy}, {len(cluster.tasks())} tasks, "
        f"num_clones {cluster.num_clones}"
    )
    checks, mine = check_entry(cluster, role, index, machine)
    checks += check_wsl(cluster, role, index, mine, machine, kernel_string() if kernel is None else kernel)
    name_checks, unresolved = check_names([t for t in cluster.server_tasks() if t not in mine])
    checks += name_checks
    reach = [t for t in peers_to_reach(cluster, mine) if t.address.host not in unresolved]
    probed = check_peers(reach, connect_timeout)
    checks += probed
    checks += check_ports_here(cluster, mine)
    checks += check_listening(mine, machine)
    checks += [Check(WARN, "public-address rule", line) for line in unchecked]
    checks += check_versions()
    checks += check_gpus(cluster, mine)
    checks += check_layout(cluster)
    figures = figures or advice.Figures()
    if figures.link_bytes_per_s is None:
        link_checks, rate, said = check_links(cluster, mine, probed, connect_timeout, link_test, link_wait)
        checks += link_checks
        if rate is not None:
            figures = figures._replace(link_bytes_per_s=rate, link_from=said)
    checks += check_advice(cluster, figures, each_task=cluster.loopback_only() and role is not None)
    if pipeline:
        checks += check_data(cluster, mine, pipeline)
        checks += [
            c for c in check_batch(cluster, pipeline, params_override) if c not in checks
        ]  # one line per bad file
    if model_dir:
        checks += check_model_dir(cluster, mine, model_dir)
        checks += check_checkpoints(cluster, mine, model_dir, connect_timeout)
    return checks, head
