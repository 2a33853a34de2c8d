"""`od-dist doctor`'s checks of this machine itself: its ports free, what listens on which
interface, the installed versions, its GPUs (the driver's, and TensorFlow's in a child process),
and WSL2's networking. host/doctor.py runs them with the others."""

from __future__ import annotations

import importlib.metadata
import ipaddress
import os
import platform
import shutil
import subprocess
import sys

from od_dist.cluster import hostinfo, validate
from od_dist.cluster.messages import GPU_INSTALL
from od_dist.cluster.spec import Cluster
from od_dist.host.doctor_check import FIX, OK, WARN, Check

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
GPUS_MODULE = "od_dist.task.gpus"  # run by its name, never imported here: it imports TensorFlow


def tensorflow_gpus(timeout: float = TF_GPUS_TIMEOUT_S) -> tuple[int | None, str]:
    """(the GPUs TensorFlow lists here, how it went): a child process asks it (the host side never
    imports TensorFlow). None when it could not be asked."""
    try:
        r = subprocess.run(
            [sys.executable, "-m", GPUS_MODULE],
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
