"""Several machines on one box: each simulated machine is a Linux network namespace with its own
private address, all plugged into one bridge. Needs root and iproute2 (`ip netns`).

    net = Network(3)                 # machines net[0..2] at 10.77.N.1 .. 10.77.N.3
    net[1].run(["hostname"])         # runs inside that machine's namespace
    net[2].cut_off()                 # its link down: the others stop hearing from it
    net.close()

Layout: a hub namespace holds the bridge; each machine namespace holds `eth0` (one end of a veth
pair, the other end on the bridge) and `lo`. Nothing is created in the box's own namespace and
there is no route out, so all traffic stays inside these namespaces. `ip netns exec` also
bind-mounts /etc/netns/<name>/hosts over /etc/hosts, which gives each machine host names for its
peers (node1, node2, ...).

Cleanup: `close()` kills every process left in the namespaces and deletes them. It runs from the
pytest fixture's finalizer, at interpreter exit (atexit, also after Ctrl+C), and namespaces left
by a run that was killed outright (SIGKILL) are removed by the next run (their pid is gone).
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time

from loopback import ROOT, clean_env

PREFIX = "odt"  # every namespace of this harness: odt<pid>n<network>-<h|m<i>>
_counter = itertools.count()
_open: list[Network] = []


def _ip(*args, check=True, timeout=30):
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


def firewall_tool() -> str | None:
    return shutil.which("nft") or shutil.which("iptables")


def unavailable() -> str | None:
    """Why the harness cannot run here, or None."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "simulated machines need root (ip netns add); CI runs as root"
    if not shutil.which("ip"):
        return "the `ip` command (iproute2) is missing: apt-get install iproute2"
    try:  # root may still lack the rights (a container without CAP_SYS_ADMIN) or veth/bridge support
        Network(1).close()
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return f"cannot make a simulated machine here: {e}"
    return None


def _owner_pid(name: str) -> int | None:
    digits = "".join(itertools.takewhile(str.isdigit, name[len(PREFIX) :]))
    return int(digits) if digits else None


def remove_stale() -> None:
    """Deletes namespaces of this harness whose test run is gone (killed before its cleanup)."""
    r = _ip("netns", "list", check=False)
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX):
            continue
        pid = _owner_pid(name)
        if pid is None or pid == os.getpid() or os.path.exists(f"/proc/{pid}"):
            continue
        _delete_namespace(name)


def _delete_namespace(name: str) -> None:
    _kill_namespace_processes(name)
    _ip("netns", "del", name, check=False)
    shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)


def _kill_namespace_processes(name: str) -> None:
    """Kills the processes inside one of our namespaces (by pid, as `ip netns pids` lists them):
    only processes a test started there live in it."""
    for attempt in range(20):
        r = _ip("netns", "pids", name, check=False)
        pids = [int(p) for p in r.stdout.split() if p.isdigit()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


class Machine:
    """One simulated machine: a namespace with `eth0` at `ip` and `lo` up."""

    def __init__(self, network: Network, index: int, netns: str, ip: str, hostname: str):
        self.network, self.index, self.netns, self.ip, self.hostname = network, index, netns, ip, hostname

    def __repr__(self) -> str:
        return f"Machine({self.hostname}, {self.ip})"

    def command(self, args: list[str], keep_sys: bool = False) -> list[str]:
        """`args` run on this machine. `keep_sys`: enter its network namespace only (nsenter), so the
        process keeps the box's /sys and its cgroup mounts, and sees a CPU cap put on it as it would
        in a container; `ip netns exec` mounts a fresh /sys without them (and gives the peers' host
        names through /etc/hosts, which nsenter does not)."""
        if keep_sys:
            return ["nsenter", f"--net=/run/netns/{self.netns}", *args]
        return ["ip", "netns", "exec", self.netns, *args]

    def run(self, args: list[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        """Runs `args` on this machine and waits (bounded); output captured as text."""
        kwargs.setdefault("env", machine_env())
        return subprocess.run(self.command(args), capture_output=True, text=True, timeout=timeout, **kwargs)

    def popen(self, args: list[str], **kwargs) -> subprocess.Popen:
        """Starts `args` on this machine. `ip netns exec` execs it, so the pid is the program's own;
        whatever is left running is killed by the network's cleanup."""
        kwargs.setdefault("env", machine_env())
        return subprocess.Popen(self.command(args), **kwargs)

    def od_dist(self, *args: str, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        return self.run([sys.executable, "-m", "od_dist", *args], timeout=timeout, **kwargs)

    def listen(self, port: int) -> subprocess.Popen:
        """A program listening on `port` on every interface of this machine, until killed."""
        code = (
            "import socket, sys, time; s = socket.socket(); s.bind(('0.0.0.0', int(sys.argv[1]))); "
            "s.listen(); print('ready', flush=True); time.sleep(3600)"
        )
        proc = self.popen([sys.executable, "-c", code, str(port)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready", f"could not listen on {self.ip}:{port}"
        return proc

    def drop_tcp(self, port: int) -> None:
        """A firewall on this machine that silently drops incoming TCP to `port` (nft or iptables)."""
        if shutil.which("nft"):
            for rule in (
                ["add", "table", "inet", "odtest"],
                ["add", "chain", "inet", "odtest", "input", "{ type filter hook input priority 0; }"],
                ["add", "rule", "inet", "odtest", "input", "tcp", "dport", str(port), "drop"],
            ):
                subprocess.run(self.command(["nft", *rule]), check=True, capture_output=True, timeout=30)
        else:
            subprocess.run(
                self.command(["iptables", "-A", "INPUT", "-p", "tcp", "--dport", str(port), "-j", "DROP"]),
                check=True,
                capture_output=True,
                timeout=30,
            )

    def clear_firewall(self) -> None:
        if shutil.which("nft"):
            subprocess.run(
                self.command(["nft", "delete", "table", "inet", "odtest"]), capture_output=True, timeout=30
            )
        else:
            subprocess.run(self.command(["iptables", "-F", "INPUT"]), capture_output=True, timeout=30)

    def power_off(self) -> None:
        """Every process of this machine killed at once (kill -9), as a power cut leaves it."""
        _kill_namespace_processes(self.netns)

    def cut_off(self) -> None:
        """Pulls this machine's cable: its link goes down, packets to it go nowhere."""
        _ip("-n", self.netns, "link", "set", "eth0", "down")

    def reconnect(self) -> None:
        _ip("-n", self.netns, "link", "set", "eth0", "up")


CODE_ENV = "OD_DIST_CODE"  # another checkout whose code the machines run (benchmarks/chaos.py --against)


def machine_env() -> dict:
    """The test run's environment for a machine's processes: the worktree's code (PYTHONPATH), or
    CODE_ENV's checkout, no TF_CONFIG left over from the caller."""
    env = clean_env()
    code = os.environ.get(CODE_ENV, ROOT)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (code, os.environ.get("PYTHONPATH")) if p)
    return env


class Network:
    """`size` machines on one bridge, at 10.77.<subnet>.1 .. size (host names node1 .. node<size>)."""

    def __init__(self, size: int):
        number = next(_counter)
        self.prefix = f"{PREFIX}{os.getpid()}n{number}-"
        self.subnet = f"10.77.{number % 256}"
        self.hub = self.prefix + "h"
        self.machines: list[Machine] = []
        self.closed = False
        _open.append(self)
        try:
            self._build(size)
        except BaseException:
            self.close()
            raise

    def _build(self, size: int) -> None:
        _ip("netns", "add", self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{self.subnet}.{i + 1} node{i + 1}\n" for i in range(size))
        for i in range(size):
            netns, port = f"{self.prefix}m{i}", f"p{i}"
            machine = Machine(self, i, netns, f"{self.subnet}.{i + 1}", f"node{i + 1}")
            _ip("netns", "add", netns)
            self.machines.append(machine)
            os.makedirs(f"/etc/netns/{netns}", exist_ok=True)
            with open(f"/etc/netns/{netns}/hosts", "w") as f:
                f.write(hosts)
            # Both ends are created directly in their namespaces: nothing touches the box's own.
            _ip(
                "link", "add", "eth0", "netns", netns, "type", "veth", "peer", "name", port, "netns", self.hub
            )
            _ip("-n", self.hub, "link", "set", port, "master", "br0")
            _ip("-n", self.hub, "link", "set", port, "up")
            _ip("-n", netns, "addr", "add", f"{machine.ip}/24", "dev", "eth0")
            _ip("-n", netns, "link", "set", "eth0", "up")
            _ip("-n", netns, "link", "set", "lo", "up")

    def __getitem__(self, i: int) -> Machine:
        return self.machines[i]

    def __iter__(self):
        return iter(self.machines)

    def __len__(self) -> int:
        return len(self.machines)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for m in self.machines:
            _delete_namespace(m.netns)
        _delete_namespace(self.hub)
        if self in _open:
            _open.remove(self)


@atexit.register
def _close_all() -> None:
    for network in list(_open):
        network.close()
