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
where the driver shows GPUs does a child process import TensorFlow to list its own.
"""

from __future__ import annotations

import errno
import importlib.metadata
import ipaddress
import os
import platform
import shutil
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass

from od_dist.cluster import advice, duties, hostinfo, hostport, messages, validate
from od_dist.cluster.spec import Cluster, InvalidCluster, Task
from od_dist.cluster.topology import connecting_peers, model_dir_line

OK, WARN, FIX = "ok", "warn", "FIX"
CONNECT_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Check:
    status: str  # OK, WARN or FIX
    what: str
    detail: str

    def __str__(self) -> str:
        return f"{self.status:<5} {self.what}: {self.detail}"


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


# ----- this machine ---------------------------------------------------------------------------------


def _port_owner(port: int) -> str:
    try:
        import psutil

        for c in psutil.net_connections(kind="tcp"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                return f" by {psutil.Process(c.pid).name()} (pid {c.pid})"
    except Exception:  # noqa: BLE001 - the owner is a nicety; permissions vary
        pass
    return ""


def check_ports_here(cluster: Cluster, mine) -> list[Check]:
    """Binds each of this machine's ports as the task will (every interface): the task's own, and
    those its od-dist serves beside it (the checkpoints, the membership of an elastic job)."""
    checks = []
    for task in mine:
        ports = [(task.address.port, task.name, task.key)] if task.role != "evaluator" else []
        ports += [(port, f"{task.name}'s {what}", key) for port, what, key in cluster.side_ports(task)]
        for port, user, key in ports:
            if port is None:
                continue  # runs no server
            try:
                hostinfo.bind_port(task.address.host, port).close()
                checks.append(Check(OK, f"port {port} here", f"free for {user}"))
            except OSError as e:
                checks.append(
                    Check(
                        FIX,
                        f"port {port} here",
                        f"in use{_port_owner(port)} ({e.strerror}); "
                        f"{user} cannot start: stop that program, or give {key} another port",
                    )
                )
    return checks


def check_listening(mine, machine) -> list[Check]:
    """TensorFlow's server listens on every interface of its machine, not only on the address the
    cluster file gives it (it has no setting for one): the public-address rule covers the file's
    addresses, the firewall everything else."""
    ports = sorted({t.address.port for t in mine if t.role != "evaluator" and t.address.port is not None})
    if not ports:
        return []
    shown = ", ".join(map(str, ports))
    public = machine.public_ips()
    if public:
        return [
            Check(
                WARN,
                "listening",
                f"port(s) {shown} will listen on every interface of this machine, its public address(es) "
                f"{', '.join(public)} included, and the TensorFlow server runs whatever it is sent: let the "
                "firewall open them to the peers only (the README written by od-dist scripts lists them)",
            )
        ]
    return [
        Check(
            OK,
            "listening",
            f"port(s) {shown} will listen on every interface of this machine (TensorFlow's server has no "
            "setting for one address); none of them is a public address",
        )
    ]


def _version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _major_minor(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


MODEL_GARDEN = "tf-models-official==2.20.0"  # setup.cfg's pin


def shell_word(requirement: str) -> str:
    """A requirement (`numpy<2.4`) quoted for this machine's shell, in a fix line a person types:
    double quotes on Windows, which cmd and PowerShell both take (cmd passes single quotes on to pip),
    single quotes elsewhere. od-dist's own requirement strings only: no quote, `$` or `%` inside."""
    return f'"{requirement}"' if sys.platform == "win32" else f"'{requirement}'"


def model_garden_install() -> str:
    """The command that installs Model Garden into this Python. On Windows without its requirements:
    one of them, tensorflow-text, has no Windows wheel, and od-dist's own install brings the others
    (setup.cfg says why)."""
    no_deps = "--no-deps " if sys.platform == "win32" else ""
    return f"python -m pip install {no_deps}{MODEL_GARDEN}"


def check_versions() -> list[Check]:
    """What this machine has installed, from package metadata (importing TensorFlow takes seconds)."""
    from od_dist import __version__

    found = {
        "od-dist": _version("od-dist") or __version__,
        "Python": platform.python_version(),
        "TensorFlow": _version("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-intel"),
        "Model Garden (tf-models-official)": _version("tf-models-official"),
        "numpy": _version("numpy"),
    }
    checks = []
    tf_version, mg_version, np_version = (
        found["TensorFlow"],
        found["Model Garden (tf-models-official)"],
        found["numpy"],
    )
    if tf_version is None or _major_minor(tf_version) != (2, 20):
        checks.append(
            Check(
                FIX,
                "TensorFlow",
                f"{tf_version or 'not installed'}; od-dist needs 2.20: "
                f"pip install {shell_word('tensorflow~=2.20.0')} (or reinstall od-dist)",
            )
        )
    if mg_version is None or _major_minor(mg_version) != (2, 20):
        checks.append(
            Check(
                FIX,
                "Model Garden",
                f"tf-models-official {mg_version or 'not installed'}; od-dist "
                f"needs 2.20.0: {model_garden_install()}",
            )
        )
    if np_version is not None and _major_minor(np_version) >= (2, 4):
        checks.append(
            Check(
                FIX,
                "numpy",
                f"{np_version}: Model Garden 2.20's COCO evaluation fails with "
                f"numpy 2.4; pip install {shell_word('numpy<2.4')}",
            )
        )
    shown = ", ".join(f"{k} {v or 'missing'}" for k, v in found.items())
    checks.insert(
        0, Check(OK if not checks else WARN, "versions", shown + " (every machine should show the same)")
    )
    return checks


def count_gpus() -> tuple[int, str]:
    """(NVIDIA GPUs on this machine, how they were counted), from the driver, without TensorFlow."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=15)
            if r.returncode == 0:
                return sum(line.startswith("GPU ") for line in r.stdout.splitlines()), "nvidia-smi -L"
            return 0, f"nvidia-smi -L failed: {(r.stderr or r.stdout).strip()[:200]}"
        except (OSError, subprocess.TimeoutExpired) as e:
            return 0, f"nvidia-smi -L failed: {e}"
    proc = "/proc/driver/nvidia/gpus"
    if os.path.isdir(proc):
        return len(os.listdir(proc)), proc
    return 0, "no NVIDIA driver found: no nvidia-smi, no /proc/driver/nvidia"


# TensorFlow's own view, in a child: importing it takes seconds here and more on a busy machine.
TF_GPUS_TIMEOUT_S = 120.0
_LIST_GPUS = """
import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf
print("od-dist GPUs:", len(tf.config.list_physical_devices("GPU")), tf.__version__)
"""


def tensorflow_gpus(timeout: float = TF_GPUS_TIMEOUT_S) -> tuple[int | None, str]:
    """(the GPUs TensorFlow lists here, how it went): a child process asks it (the host side never
    imports TensorFlow). None when it could not be asked."""
    try:
        r = subprocess.run(
            [sys.executable, "-c", _LIST_GPUS],
            capture_output=True,
            text=True,
            encoding="utf-8",
            errors="replace",
            stdin=subprocess.DEVNULL,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return None, f"TensorFlow did not answer within {timeout:.0f} s"
    except OSError as e:
        return None, f"could not start Python to ask TensorFlow: {e}"
    for line in r.stdout.splitlines():
        if line.startswith("od-dist GPUs: "):
            count, version = line.split()[2:4]
            return int(count), f"TensorFlow {version}, tf.config.list_physical_devices"
    last = [line for line in (r.stderr or "").splitlines() if line.strip()]
    return None, f"could not ask TensorFlow (exit {r.returncode}: {last[-1][:200] if last else 'no output'})"


def check_gpus(cluster: Cluster, mine, counted=None, tf_counted=None) -> list[Check]:
    """The GPUs the driver shows (nvidia-smi) beside those TensorFlow lists, against num_clones.
    `counted`/`tf_counted` (count, how) stand in for asking them."""
    from od_dist.task.devices import GPU_INSTALL

    trainers = [t for t in mine if cluster.runs_replicas(t.role)]
    gpus, how = counted or count_gpus()
    if gpus:
        tf_gpus, tf_how = tf_counted or tensorflow_gpus()
    else:  # TensorFlow sees no NVIDIA GPU that the driver does not show: not worth its import
        tf_gpus, tf_how = 0, "TensorFlow not asked"
    shown = f"{gpus} from the driver ({how}), {'?' if tf_gpus is None else tf_gpus} in TensorFlow ({tf_how})"
    if not trainers:
        return [Check(OK, "GPUs", f"{shown}; none needed: no task here holds replicas")]
    names = ", ".join(t.name for t in trainers)
    if gpus and tf_gpus == 0:
        return [
            Check(
                FIX,
                "GPUs",
                f"{shown}: TensorFlow was installed without CUDA's libraries and {names} would train on "
                f"the CPU; on Linux and WSL2 install od-dist with {GPU_INSTALL} (README: GPU machines)",
            )
        ]
    usable = gpus if tf_gpus is None else tf_gpus
    need = max(cluster.clones_for(t.address.host) for t in trainers)
    checks = [Check(WARN, "TensorFlow's GPUs", tf_how)] if tf_gpus is None else []
    if need > usable:
        if usable == 0 and need == 1:
            return checks + [Check(OK, "GPUs", f"{shown}; {names} will train on the CPU (num_clones 1)")]
        return checks + [
            Check(
                FIX,
                "GPUs",
                f"num_clones {need} for {names} needs {need} GPUs, found {usable}: {shown}; lower "
                "num_clones (hosts.<host>.num_clones in the cluster file, or --num_clones) or add GPUs",
            )
        ]
    return checks + [Check(OK, "GPUs", f"{shown} for num_clones {need} ({names})")]


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


# ----- WSL2 ----------------------------------------------------------------------------------------

# Where a Linux kernel names itself; WSL's kernels say `microsoft` there (5.15.x-microsoft-standard-WSL2).
KERNEL_FILES = ("/proc/sys/kernel/osrelease", "/proc/version")
WSLCONFIG_LINES = ("[wsl2]", "networkingMode=mirrored")


def kernel_string(paths=KERNEL_FILES) -> str:
    """The kernel's description from `paths` (those that can be read, joined), "" when none can."""
    found = []
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                found.append(f.read().strip())
        except OSError:
            continue
    return " ".join(found)


def check_wsl(
    cluster: Cluster, role: str | None, index: int | None, mine, machine, kernel: str
) -> list[Check]:
    """Inside WSL2, this machine's cluster address on none of its interfaces is WSL's default NAT
    networking: WSL has its own address (172.x), and a port opened inside it cannot be reached from
    another machine, so its task would be a silent peer. Mirrored networking gives WSL the Windows
    machine's addresses."""
    if "microsoft" not in kernel.lower() or cluster.loopback_only():
        return []
    if role is not None:
        task = cluster.task(validate.normalize_role(role), index or 0)
        missing = (
            None
            if machine.is_local(task.address.host)
            else f"{task.name}'s address {task.address.host} is on none of its interfaces"
        )
    else:
        missing = None if mine else "no address of the cluster file is on its interfaces"
    if missing is None:
        return [
            Check(
                OK,
                "WSL2",
                "this machine's entry is found in WSL; other machines reach its ports once WSL's Hyper-V "
                "firewall lets them in (New-NetFirewallHyperVRule, in an Administrator PowerShell on "
                "Windows), or under NAT through netsh interface portproxy",
            )
        ]
    here = ", ".join(sorted(ip for ip in machine.ips if not ipaddress.ip_address(ip).is_loopback)) or "none"
    wslconfig = " and ".join(f"`{line}`" for line in WSLCONFIG_LINES)
    return [
        Check(
            FIX,
            "WSL2",
            f"this is WSL ({kernel.split()[0]}) with NAT networking: {missing} "
            f"({here}), and other machines cannot reach a port opened here; on Windows 11 22H2 or later "
            f"put the lines {wslconfig} in %UserProfile%\\.wslconfig on Windows, run `wsl --shutdown`, start "
            "WSL again and allow the ports with New-NetFirewallHyperVRule (before 22H2: netsh interface "
            "portproxy; README: Windows machines, GPU: WSL2)",
        )
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
