"""Task addresses as the cluster file writes them: 'host:port' parsed and normalized (IPv6 in
brackets, a zone id only as an interface name, nothing that would break a line of a script), a
`hosts` key, and what kind of host an address is (loopback, an IP literal, public). No network."""

from __future__ import annotations

import ipaddress
import re

from od_dist.cluster.messages import shown, unsafe_char

_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
# An IPv6 zone id is an interface name (eth0, enp0s3, br-lan, vlan.10) or a Windows interface
# index (12): anything else in it would reach shell scripts, READMEs and manifests.
_ZONE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class AddressError(ValueError):
    def __init__(self, what: str, fix: str):
        super().__init__(what)
        self.what, self.fix = what, fix


def parse_address(text: str, need_port: bool = True) -> tuple[str, int | None]:
    """'host:port' -> (normalized host, port). IPv6 hosts come back without brackets."""
    bad = unsafe_char(text)
    if bad:
        raise AddressError(
            f"contains the control character '{bad}'", "an address is one line of plain text: remove it"
        )
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise AddressError("unclosed '['", "write IPv6 addresses as [addr]:port, e.g. [fd00::5]:2222")
        host, rest = text[1:end], text[end + 1 :]
        zone = host.partition("%")[2]
        if "%" in host and not _ZONE.fullmatch(zone):
            raise AddressError(
                f"zone id '{shown(zone)}' is not an interface name",
                "write the interface after '%' as letters, digits, '_', '.' and '-' (e.g. [fe80::1%eth0]), "
                "or its number on Windows",
            )
        try:
            host = str(ipaddress.IPv6Address(host))
        except ValueError:
            raise AddressError(
                f"'{shown(host)}' is not an IPv6 address", "brackets are only for IPv6 addresses"
            ) from None
        if rest and not rest.startswith(":"):
            raise AddressError("unexpected text after ']'", "write it as [addr]:port")
        port_text = rest[1:] if rest else None
    elif text.count(":") > 1:
        head, tail = text.rsplit(":", 1)
        fix = f"write it as [{shown(head)}]:{shown(tail)}"
        if not _is_ipv6(head) and _is_ipv6(text):  # e.g. fe80::1: no port was given
            fix = f"write it as [{shown(text)}]:PORT"
        raise AddressError("an IPv6 address must be in brackets", fix)
    else:
        host, sep, port_text = text.partition(":")
        if not sep:
            port_text = None
        host = _check_host(host)
    if port_text is None:
        if need_port:
            raise AddressError("no port", "write it as host:port, e.g. 10.0.0.5:2222")
        return host, None
    if not (port_text.isascii() and port_text.isdigit()):
        raise AddressError(
            f"port '{shown(port_text)}' is not a number", "write it as host:port, e.g. 10.0.0.5:2222"
        )
    if len(port_text.lstrip("0")) > 5:  # int() refuses numbers of more than 4300 digits
        raise AddressError(f"port '{shown(port_text)}' is out of range", "use a port between 1 and 65535")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise AddressError(f"port {port} is out of range", "use a port between 1 and 65535")
    return host, port


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
        return True
    except ValueError:
        return False


def _check_host(host: str) -> str:
    if not host:
        raise AddressError("no host", "write it as host:port, e.g. 10.0.0.5:2222")
    if all(part.isascii() and part.isdigit() for part in host.split(".")):
        try:
            return str(ipaddress.IPv4Address(host))
        except ValueError:
            raise AddressError(
                f"'{shown(host)}' is not a valid IPv4 address", "use four numbers 0-255, e.g. 10.0.0.5"
            ) from None
    labels = host.rstrip(".").split(".")
    if len(host) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise AddressError(
            f"'{shown(host)}' is not a valid host name",
            "use an IP address or a name of letters, digits, '-' and '.'",
        )
    return host.lower().rstrip(".")


def format_address(host: str, port: int | None) -> str:
    shown = f"[{host}]" if ":" in host else host
    return shown if port is None else f"{shown}:{port}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def machine_of(host: str) -> str:
    """What tells machines apart: the host as written, every loopback address being this one."""
    return "localhost" if is_loopback(host) else host


def is_ip(host: str) -> bool:
    """An IP address literal (a host name is not)."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def is_public(host: str) -> bool:
    """True for IP literals on the public internet. Names are not resolved here."""
    try:
        return ipaddress.ip_address(host).is_global
    except ValueError:
        return False


def host_key(key) -> str:
    """A `hosts` key -> the host as task addresses normalize it. A bare IPv6 address is accepted
    (no port can follow it); a port is refused: the settings are per machine."""
    text = str(key).strip()
    if _is_ipv6(text.split("%", 1)[0]):
        return parse_address(f"[{text}]", need_port=False)[0].split("%", 1)[0]
    host, port = parse_address(text, need_port=False)
    if port is not None:
        raise AddressError(
            "a hosts key is a machine, not host:port", f"write it as {format_address(host, None)}"
        )
    return host
