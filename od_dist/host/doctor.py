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

from od_dist.cluster import advice, duties, hostinfo, hostport, messages, validate
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
        problems = validate.check_task(cluster, role, index)
        if problems:
            raise InvalidCluster(problems)
        problems = validate.check_this_machine(cluster, role, index, machine.is_local)
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
    (pipeline.check_batch_split, the rule validate, scripts, k8s and slurm apply)."""
    from od_dist.model import pipeline

    try:
        problem, said, read = pipeline.check_batch_split(cluster, pipeline_path, params_override)
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
) -> tuple[list[Check], str]:
    """Every check, in order. Raises InvalidCluster for an invalid file or --role/--index (exit 2).
    `machine` (its interfaces) and `kernel` (the kernel's description) default to this machine's."""
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
    checks += check_peers(reach, connect_timeout)
    checks += check_ports_here(cluster, mine)
    checks += check_listening(mine, machine)
    checks += [Check(WARN, "public-address rule", line) for line in unchecked]
    checks += check_versions()
    checks += check_gpus(cluster, mine)
    checks += check_layout(cluster)
    followed, advised = advice.advise(cluster)
    checks.append(Check(OK if followed else WARN, "strategy", advised))
    if pipeline:
        checks += check_data(cluster, mine, pipeline)
        checks += [
            c for c in check_batch(cluster, pipeline, params_override) if c not in checks
        ]  # one line per bad file
    if model_dir:
        checks += check_model_dir(cluster, mine, model_dir)
        checks += check_checkpoints(cluster, mine, model_dir, connect_timeout)
    return checks, head
