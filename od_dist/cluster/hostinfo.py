"""This machine's own addresses, to check that a task really runs where the cluster file says, and
its ports, bound as a task's server binds them."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import threading
import time
from dataclasses import dataclass

import psutil

from od_dist.cluster.hostport import is_ip, is_public

RESOLVE_TIMEOUT_S = 3.0
# A port another program holds (Windows says so with its own code; a privileged one is EACCES).
PORT_TAKEN = frozenset({errno.EADDRINUSE, getattr(errno, "WSAEADDRINUSE", -1), errno.EACCES})


def bind_port(host: str, port: int) -> socket.socket:
    """Binds `port` on every interface of `host`'s address family, as TensorFlow's server will
    (its gRPC server listens on every interface, whatever address the cluster gives the task:
    TensorFlow has no setting for it), and listens; raises OSError (errno in PORT_TAKEN: another
    program has it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    # SO_REUSEADDR as gRPC sets it, so a port in TIME_WAIT after a previous run is not "taken".
    if os.name != "nt":
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
        s.listen()
    except OSError:
        s.close()
        raise
    return s


@dataclass(frozen=True)
class ThisMachine:
    names: frozenset[str]  # host names, lower case
    ips: frozenset[str]  # normalized IP addresses of every interface

    def public_ips(self) -> list[str]:
        """This machine's addresses on the public internet: a task's port listens on them too."""
        return sorted(ip for ip in self.ips if is_public(ip))

    def describe(self) -> str:
        shown = sorted(self.names) + sorted(ip for ip in self.ips if not ipaddress.ip_address(ip).is_loopback)
        return ", ".join(shown)

    def is_local(self, host: str) -> bool:
        """True when `host` (an IP or a name from the cluster file) names this machine."""
        host = host.lower()
        if host in self.names or host in self.ips:
            return True
        try:
            ipaddress.ip_address(host)
            return False  # an IP literal that none of our interfaces has
        except ValueError:
            pass
        return bool(_resolve(host) & self.ips)


def _normalize(ip: str) -> str:
    return str(ipaddress.ip_address(ip.split("%", 1)[0]))  # drop an IPv6 zone such as %eth0


def _lookup(name: str, result: list) -> None:
    """getaddrinfo in a lookup thread; a name that does not resolve is an empty answer, not a
    traceback from the thread."""
    try:
        result.append(socket.getaddrinfo(name, None))
    except (OSError, UnicodeError):
        pass


def _answer(result: list) -> frozenset[str]:
    try:
        return frozenset(_normalize(info[4][0]) for info in result[0]) if result else frozenset()
    except ValueError:
        return frozenset()


_RESOLVED: dict[str, frozenset[str]] = {}


def _resolve(name: str) -> frozenset[str]:
    """A name's addresses, or none when resolving fails or takes too long: the lookup runs in a
    daemon thread, so a slow DNS server delays neither the answer nor the exit."""
    return resolve_all([name])[name]


def resolve_all(names) -> dict[str, frozenset[str]]:
    """Every name's addresses, the new ones looked up at once (one timeout for all, not one per
    name); names that do not resolve in time get none. Answers are kept for the process."""
    lookups = {}
    for name in dict.fromkeys(names):
        if name not in _RESOLVED:
            result: list = []
            thread = threading.Thread(target=_lookup, args=(name, result), daemon=True)
            thread.start()
            lookups[name] = (thread, result)
    deadline = time.monotonic() + RESOLVE_TIMEOUT_S
    for thread, _ in lookups.values():
        thread.join(max(0.0, deadline - time.monotonic()))
    _RESOLVED.update((name, _answer(result)) for name, (_, result) in lookups.items())
    return {name: _RESOLVED[name] for name in names}


def resolve_names(cluster) -> dict[str, frozenset[str]]:
    """The addresses of the cluster's host names (IP literals and localhost need no lookup), for
    the public-address rule."""
    names = [
        t.address.host for t in cluster.tasks() if t.address.host != "localhost" and not is_ip(t.address.host)
    ]
    return resolve_all(names) if names else {}


def resolve(name: str) -> frozenset[str]:
    """A host name's addresses (normalized), or none when it does not resolve within a few seconds."""
    return _resolve(name.lower())


def this_machine() -> ThisMachine:
    ips = set()
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                try:
                    ips.add(_normalize(a.address))
                except ValueError:
                    pass
    hostname = socket.gethostname().lower()
    names = {hostname, hostname.split(".")[0], "localhost"}
    return ThisMachine(frozenset(names), frozenset(ips))
