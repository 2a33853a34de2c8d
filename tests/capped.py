"""Constraints for simulated machines (tests/netns.py): a CPU cap and a link rate, so a machine on
this box behaves like a small computer on a slow LAN. Root only, Linux only.

    cap = CpuCap("node2", cores=0.6)         # a cgroup with cpu.cfs_quota_us (v1) or cpu.max (v2)
    machine.popen(args, preexec_fn=cap.enter)  # the process and all its children share the cap
    shape(machine, "100mbit")                # tbf on the machine's eth0 (egress: every link is
                                             # capped both ways, since each end shapes what it sends)
    tx_bytes(machine)                        # bytes the machine has sent so far
    cap.usage_s(), cap.throttled()           # CPU seconds used, periods throttled
    cap.close()

`unavailable()` says why none of this can work here (not root, no cpu controller, no tc).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

V1 = "/sys/fs/cgroup/cpu"
V1_ACCT = "/sys/fs/cgroup/cpuacct"
V2 = "/sys/fs/cgroup"
PERIOD_US = 100_000
# A simulated machine's weight against the box's other processes: high, so that its processes get
# their whole quota while other (niced) work runs on the box; the quota still caps them.
V1_SHARES, V2_WEIGHT = 8192, 800


def cgroup_version() -> int | None:
    """1 (a v1 `cpu` controller), 2 (unified hierarchy with the cpu controller), or None."""
    if os.path.exists(os.path.join(V1, "cpu.cfs_quota_us")):
        return 1
    controllers = os.path.join(V2, "cgroup.controllers")
    if os.path.exists(controllers) and "cpu" in open(controllers).read().split():
        return 2
    return None


def unavailable() -> str | None:
    """Why CPU caps and link rates cannot be applied here, or None."""
    if os.geteuid() != 0:
        return "CPU caps and link rates need root (cgroups, tc)"
    if cgroup_version() is None:
        return f"no cgroup cpu controller ({V1}/cpu.cfs_quota_us or cpu in {V2}/cgroup.controllers)"
    if not shutil.which("tc"):
        return "the `tc` command (iproute2) is missing: apt-get install iproute2"
    return None


class CpuCap:
    """A cgroup whose processes share `cores` CPUs (quota per 100 ms period)."""

    def __init__(self, name: str, cores: float, period_us: int = PERIOD_US):
        self.cores = cores
        self.version = cgroup_version()
        if self.version is None:
            raise RuntimeError(unavailable() or "no cgroup cpu controller")
        leaf = f"odscale-{os.getpid()}-{name}"
        if self.version == 1:
            self.path = os.path.join(V1, leaf)
            os.makedirs(self.path, exist_ok=True)
            self._write("cpu.cfs_period_us", str(period_us))
            self._write("cpu.cfs_quota_us", str(int(cores * period_us)))
            self._write("cpu.shares", str(V1_SHARES))
            # cpuacct is usually co-mounted with cpu (cpu,cpuacct); else a sibling group there.
            self.acct = self.path if os.path.exists(os.path.join(self.path, "cpuacct.usage")) else None
            if self.acct is None and os.path.isdir(V1_ACCT):
                self.acct = os.path.join(V1_ACCT, leaf)
                os.makedirs(self.acct, exist_ok=True)
        else:
            with open(os.path.join(V2, "cgroup.subtree_control"), "w") as f:
                f.write("+cpu")
            self.path = os.path.join(V2, leaf)
            os.makedirs(self.path, exist_ok=True)
            self._write("cpu.max", f"{int(cores * period_us)} {period_us}")
            self._write("cpu.weight", str(V2_WEIGHT))
            self.acct = None

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def add(self, pid: int) -> None:
        for group in {self.path, self.acct} - {None}:
            with open(os.path.join(group, "cgroup.procs"), "w") as f:
                f.write(str(pid))

    def enter(self) -> None:
        """preexec_fn: puts the starting process (and so its children) under the cap."""
        self.add(os.getpid())

    def _stat(self) -> dict:
        with open(os.path.join(self.path, "cpu.stat")) as f:
            return {k: int(v) for k, v in (line.split() for line in f if line.strip())}

    def usage_s(self) -> float:
        """CPU seconds used by the group's processes so far."""
        if self.version == 2:
            return self._stat()["usage_usec"] / 1e6
        with open(os.path.join(self.acct, "cpuacct.usage")) as f:
            return int(f.read()) / 1e9

    def throttled(self) -> int:
        """Periods in which the group hit its quota and was stopped."""
        return self._stat()["nr_throttled"]

    def pids(self) -> list[int]:
        with open(os.path.join(self.path, "cgroup.procs")) as f:
            return [int(p) for p in f.read().split()]

    def close(self) -> None:
        """Removes the group (its processes must be gone: kill them first)."""
        for group in {self.path, self.acct} - {None}:
            for _ in range(50):
                try:
                    os.rmdir(group)
                    break
                except FileNotFoundError:
                    break
                except OSError:  # processes still exiting
                    time.sleep(0.1)


def shape(machine, rate: str, burst: str = "128kb", latency: str = "100ms") -> None:
    """Caps what `machine` sends on its eth0 at `rate` (tc's units: 100mbit, 1gbit)."""
    subprocess.run(
        ["tc", "-n", machine.netns, "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate]
        + ["burst", burst, "latency", latency],
        check=True,
        capture_output=True,
        timeout=30,
    )


def qdisc(machine) -> str:
    """The machine's eth0 queueing discipline as tc shows it (to check a rate is in place)."""
    r = subprocess.run(
        ["tc", "-n", machine.netns, "qdisc", "show", "dev", "eth0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return r.stdout.strip()


def tx_bytes(machine) -> int:
    """Bytes `machine` has sent on its eth0 (the interface's counter)."""
    r = subprocess.run(
        ["ip", "-n", machine.netns, "-j", "-s", "link", "show", "eth0"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return int(json.loads(r.stdout)[0]["stats64"]["tx"]["bytes"])


def rate_bits(rate: str) -> float:
    """tc's rate words as bits/s: '100mbit' -> 1e8, '1gbit' -> 1e9."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, factor in units.items():
        if rate.lower().endswith(unit):
            return float(rate[: -len(unit)]) * factor
    raise ValueError(f"{rate!r}: a rate in tc's units, e.g. 100mbit or 1gbit")
