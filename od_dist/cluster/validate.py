"""Pure validation rules for a cluster description.

Each rule takes plain data (the parsed YAML document, or a built cluster plus a task) and returns
a list of one-line problems, each naming the key, the value and the fix. Nothing here touches the
network, the file system or TensorFlow, so every rule is testable on its own.
"""

from __future__ import annotations

import difflib
import ipaddress
import re

PARAMETER_SERVER = "parameter_server"
MULTI_WORKER_MIRRORED = "multi_worker_mirrored"
STRATEGIES = (PARAMETER_SERVER, MULTI_WORKER_MIRRORED)

TOP_KEYS = ("strategy", "master", "chief", "worker", "ps", "evaluator", "num_clones", "hosts")
HOST_KEYS = ("os", "python", "venv", "workdir", "num_clones")
HOST_OSES = ("linux", "windows")
ROLES = ("master", "worker", "ps", "evaluator")
ROLE_ALIASES = {"chief": "master"}

_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
# An IPv6 zone id is an interface name (eth0, enp0s3, br-lan, vlan.10) or a Windows interface
# index (12): anything else in it would reach shell scripts, READMEs and manifests.
_ZONE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# Characters that end a line in some shell, YAML or Markdown (control characters, NEL, U+2028,
# U+2029) or reorder how a line reads (bidi controls): no value od-dist writes anywhere may hold one.
UNSAFE_CHARS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")
SHOWN_MAX = 80  # characters of a value echoed in a message
PATH_SHOWN_MAX = 4096  # a path is echoed whole: the longest one Linux opens (PATH_MAX)
MAX_CLONES = 256  # replicas per process: GPUs of one machine, or logical CPU devices


def unsafe_char(text: str) -> str | None:
    """The first character of `text` that no line of a script, README or manifest may hold, as
    Python writes it (e.g. '\\n'), else None."""
    found = UNSAFE_CHARS.search(text)
    return None if found is None else repr(found.group())[1:-1]


def shown(value, limit: int = SHOWN_MAX) -> str:
    """A value as an error message echoes it: on one line (unsafe characters escaped) and cut."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"a number of about {int(value.bit_length() * 0.30103) + 1} digits"  # str() may refuse it
    text = value if isinstance(value, str) else repr(value)
    text = UNSAFE_CHARS.sub(lambda m: repr(m.group())[1:-1], text)
    if len(text) > limit:
        text = f"{text[: limit - 20]}...({len(text)} characters)"
    return text


def problem(key: str, value, what: str, fix: str, limit: int = SHOWN_MAX) -> str:
    return f"{shown(key)}: '{shown(value, limit)}': {what}; {fix}"


def did_you_mean(word, choices, what: str = "keys") -> str:
    """The closest of `choices` to a misspelt `word`, else the first dozen `choices` (the cluster
    file's keys, a pipeline's)."""
    choices = list(choices)
    close = difflib.get_close_matches(str(word), choices, n=1, cutoff=0.6)
    if close:
        return f"did you mean '{close[0]}'?"
    shown = ", ".join(choices[:12]) + (", ..." if len(choices) > 12 else "")
    return f"known {what}: {shown}"


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


# ----- rules on the parsed document -----------------------------------------------------------


def check_shape(doc) -> list[str]:
    if doc is None:
        return [
            "cluster file: '': the file is empty; write at least 'master: host:port' (see clusters/local.yaml)"
        ]
    if not isinstance(doc, dict):
        return [
            problem(
                "cluster file",
                type(doc).__name__,
                "the top level is not a mapping",
                "start with keys such as 'master: host:port' and 'worker: [...]'",
            )
        ]
    return []


def check_keys(doc: dict) -> list[str]:
    out = []
    for key in doc:
        if not isinstance(key, str) or key not in TOP_KEYS:
            out.append(problem(str(key), key, "unknown key", did_you_mean(str(key), TOP_KEYS)))
    if "master" in doc and "chief" in doc:
        out.append(
            problem(
                "chief",
                doc["chief"],
                "'master' and 'chief' are the same role and both are given",
                "keep only one of them",
            )
        )
    return out


def address_entries(doc: dict) -> list[tuple[str, str, object]]:
    """(role, key as shown to the user, raw value) for every address in the document."""
    out = []
    for name in ("master", "chief"):
        if name in doc and not isinstance(doc[name], list):
            out.append(("master", name, doc[name]))
    for role in ("worker", "ps"):
        value = doc.get(role)
        items = [value] if isinstance(value, str) else value if isinstance(value, list) else []
        out.extend((role, f"{role}[{i}]", item) for i, item in enumerate(items))
    if "evaluator" in doc and not isinstance(doc["evaluator"], list):
        out.append(("evaluator", "evaluator", doc["evaluator"]))
    return out


def check_addresses(doc: dict) -> list[str]:
    out = []
    for name in ("master", "chief", "evaluator"):
        if isinstance(doc.get(name), list):
            out.append(
                problem(
                    name,
                    doc[name],
                    f"exactly one {name} is allowed, not a list",
                    f"write a single 'host:port' for {name}",
                )
            )
    for role in ("worker", "ps"):
        value = doc.get(role)
        if value is not None and not isinstance(value, (str, list)):
            out.append(
                problem(role, value, "not a list of addresses", f"write it as {role}: ['host:port', ...]")
            )
    seen: dict[tuple[str, int], str] = {}
    for role, key, value in address_entries(doc):
        if not isinstance(value, str):
            kind = type(value).__name__
            out.append(
                problem(
                    key,
                    value,
                    f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}, not a 'host:port' string",
                    "write the address as text, e.g. 10.0.0.5:2222",
                )
            )
            continue
        try:
            host, port = parse_address(value.strip(), need_port=role != "evaluator")
        except AddressError as e:
            out.append(problem(key, value, e.what, e.fix))
            continue
        if port is None:
            continue
        if is_loopback(host):
            # Every loopback address (127.0.0.0/8, ::1, localhost) is this machine, and a server
            # listens on all its interfaces: one port, one task.
            host = "this machine (loopback)"
        if (host, port) in seen:
            what = f"the same address as {seen[host, port]}"
            if host.startswith("this machine"):
                what += (
                    " (every loopback address is this machine, and a server listens on all of its addresses)"
                )
            out.append(problem(key, value, what, "give every task its own host:port"))
        else:
            seen[host, port] = key
    return out


def infer_strategy(doc: dict) -> str | None:
    strategy = doc.get("strategy")
    if strategy is None:
        return PARAMETER_SERVER if doc.get("ps") else MULTI_WORKER_MIRRORED
    return strategy if strategy in STRATEGIES else None


def check_strategy(doc: dict) -> list[str]:
    strategy = doc.get("strategy")
    if strategy is not None and strategy not in STRATEGIES:
        return [
            problem(
                "strategy",
                strategy,
                "unknown strategy",
                did_you_mean(strategy, STRATEGIES, "strategies"),
            )
        ]
    strategy = infer_strategy(doc)
    has_master = "master" in doc or "chief" in doc
    out = []
    if strategy == PARAMETER_SERVER:
        if not doc.get("ps"):
            out.append(
                problem(
                    "ps",
                    doc.get("ps", ""),
                    "parameter_server needs at least one ps",
                    "add 'ps: [host:port]', or set 'strategy: multi_worker_mirrored'",
                )
            )
        if not has_master:
            out.append(
                problem(
                    "master",
                    "",
                    "parameter_server needs exactly one master (the coordinator)",
                    "add 'master: host:port'",
                )
            )
        if not doc.get("worker"):
            out.append(
                problem(
                    "worker",
                    doc.get("worker", ""),
                    "parameter_server needs at least one worker",
                    "add 'worker: [host:port, ...]'",
                )
            )
    else:
        if "ps" in doc:
            out.append(
                problem(
                    "ps",
                    doc["ps"],
                    "multi_worker_mirrored keeps variables on the trainers and has no ps",
                    "remove 'ps', or set 'strategy: parameter_server'",
                )
            )
        if not has_master and not doc.get("worker"):
            out.append(
                problem(
                    "master", "", "no trainer is listed", "add 'master: host:port' and/or 'worker: [...]'"
                )
            )
    return out


def _check_count(key: str, value) -> list[str]:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return [problem(key, value, "not a positive whole number", f"write e.g. '{key.split('.')[-1]}: 1'")]
    if value > MAX_CLONES:
        return [
            problem(
                key,
                value,
                f"more replicas than any machine has devices (at most {MAX_CLONES})",
                "give the number of GPUs of the machine",
            )
        ]
    return []


def check_num_clones(doc: dict) -> list[str]:
    return _check_count("num_clones", doc["num_clones"]) if "num_clones" in doc else []


def check_hosts(doc: dict) -> list[str]:
    hosts = doc.get("hosts")
    if hosts is None:
        return []
    if not isinstance(hosts, dict):
        return [
            problem(
                "hosts", hosts, "not a mapping", "write 'hosts:' then one '<host>: {os: linux}' per machine"
            )
        ]
    used = set()
    for _, _, value in address_entries(doc):
        try:
            used.add(parse_address(str(value), need_port=False)[0])
        except AddressError:
            pass
    out = []
    seen: dict[str, str] = {}
    for host, settings in hosts.items():
        key = f"hosts.{host}"
        try:
            normalized = host_key(host)
        except AddressError as e:
            out.append(problem(key, host, e.what, e.fix))
            continue
        if normalized in seen:  # YAML sees two keys; they would silently merge into one machine
            out.append(
                problem(
                    key, host, f"the same machine as hosts.{seen[normalized]}", "keep one entry per machine"
                )
            )
            continue
        seen[normalized] = str(host)
        if normalized not in used:
            out.append(
                problem(
                    key,
                    host,
                    "no task of the cluster runs on this host",
                    "fix the spelling or remove the entry",
                )
            )
        if not isinstance(settings, dict):
            out.append(
                problem(key, settings, "not a mapping", "write e.g. '{os: windows, venv: C:\\od\\venv}'")
            )
            continue
        for name, value in settings.items():
            if name not in HOST_KEYS:
                out.append(problem(f"{key}.{name}", value, "unknown key", did_you_mean(str(name), HOST_KEYS)))
            elif name == "os" and value not in HOST_OSES:
                out.append(
                    problem(
                        f"{key}.os", value, "unknown operating system", f"use one of: {', '.join(HOST_OSES)}"
                    )
                )
            elif name in ("python", "venv", "workdir") and (not isinstance(value, str) or not value.strip()):
                out.append(problem(f"{key}.{name}", value, "not a path", "write the path as text"))
            elif name in ("python", "venv", "workdir") and value.strip().startswith("-"):
                # A shell would read it as an option of cd/exec.
                out.append(
                    problem(
                        f"{key}.{name}", value, "starts with '-'", f"write it as ./{shown(value.strip())}"
                    )
                )
            elif name == "num_clones":
                out.extend(_check_count(f"{key}.num_clones", value))
        if "python" in settings and "venv" in settings:
            out.append(
                problem(
                    f"{key}.python",
                    settings["python"],
                    "both 'python' and 'venv' are given",
                    "keep one: 'venv' (a virtual environment) or 'python' (an interpreter)",
                )
            )
    return out


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


def check_loopback_mix(doc: dict) -> list[str]:
    """A loopback entry means "this machine" to every machine, so it cannot share a cluster with
    addresses of other machines."""
    hosts = {}
    for _, key, value in address_entries(doc):
        try:
            hosts[key] = parse_address(str(value).strip(), need_port=False)[0]
        except AddressError:
            pass
    loop = [k for k, h in hosts.items() if is_loopback(h)]
    if loop and len(loop) < len(hosts):
        other = next(k for k, h in hosts.items() if not is_loopback(h))
        return [
            problem(
                loop[0],
                doc_value(doc, loop[0]),
                f"a loopback address in a cluster that also lists "
                f"other machines ({other}); other machines would reach themselves",
                "use this machine's network address, or make every entry loopback",
            )
        ]
    return []


def doc_value(doc: dict, key: str):
    role, _, rest = key.partition("[")
    value = doc.get(role)
    return value[int(rest[:-1])] if rest and isinstance(value, list) else value


def check_document(doc) -> list[str]:
    """Every rule that needs only the document. Later rules assume the shape is right."""
    shape = check_shape(doc)
    if shape:
        return shape
    return (
        check_keys(doc)
        + check_addresses(doc)
        + check_loopback_mix(doc)
        + check_strategy(doc)
        + check_num_clones(doc)
        + check_hosts(doc)
    )


# ----- rules on a built cluster ---------------------------------------------------------------


def check_equal_clones(cluster) -> list[str]:
    """Under parameter_server the coordinator builds one replica layout for every worker."""
    if cluster.strategy != PARAMETER_SERVER:
        return []
    counts = {t.name: cluster.clones_for(t.address.host) for t in cluster.tasks_of("worker")}
    if len(set(counts.values())) > 1:
        shown = ", ".join(f"{name}={n}" for name, n in counts.items())
        return [
            problem(
                "hosts.*.num_clones",
                shown,
                "parameter_server needs the same num_clones on every worker",
                "give every worker host the same num_clones",
            )
        ]
    return []


def unchecked_names(cluster, resolved) -> list[str]:
    """The host names the public-address rule cannot judge: they resolve to nothing here
    (`resolved`, as for check_public). Unknown, not private: one line each for the user."""
    names = dict.fromkeys(
        t.address.host
        for t in cluster.tasks()
        if t.address.host != "localhost" and not is_ip(t.address.host) and not resolved.get(t.address.host)
    )
    return [
        f"{name}: does not resolve on this machine, so whether it is a public internet address is "
        "not checked here (it is on a machine where it resolves); write its IP address to have it checked"
        for name in names
    ]


def check_public(cluster, allow_public: bool, resolved=None) -> list[str]:
    """Addresses on the public internet, unless allowed. `resolved` maps host names to the IP
    addresses they resolve to (looked up by the caller: this module touches no network); a name
    counts as public when any of its addresses is, and one that resolves to none is not judged
    (unchecked_names)."""
    if allow_public:
        return []
    resolved = resolved or {}
    out = []
    for t in cluster.tasks():
        host = t.address.host
        public = [ip for ip in resolved.get(host, ()) if is_public(ip)]
        if is_public(host) or public:
            where = f" ({host} resolves to {', '.join(sorted(public))})" if public else ""
            out.append(
                problem(
                    t.key,
                    str(t.address),
                    f"a public internet address{where}",
                    "the TensorFlow server has no authentication and runs any graph it is sent: use a "
                    "private network, or pass --allow_public_addresses if you accept that risk",
                )
            )
    return out


def normalize_role(role: str | None) -> str | None:
    return ROLE_ALIASES.get(role, role) if role else role


def check_task(cluster, role: str, index: int) -> list[str]:
    role = normalize_role(role)
    if role not in ROLES:
        return [
            problem("--role", role, "unknown role", f"use one of: {', '.join(ROLES)} (or chief for master)")
        ]
    count = len(cluster.tasks_of(role))
    if count == 0:
        return [problem("--role", role, f"the cluster file lists no {role}", "pick a role the file lists")]
    if role in ("master", "evaluator") and index != 0:
        return [problem("--index", index, f"there is only one {role}", "use --index 0 or leave --index out")]
    if not 0 <= index < count:
        return [
            problem("--index", index, f"{role} has indexes 0 to {count - 1}", f"use an index below {count}")
        ]
    return []


def check_this_machine(cluster, role: str, index: int, is_local) -> list[str]:
    """The ordering check: the entry at role/index must be an address of this machine."""
    task = cluster.task(role, index)
    if cluster.loopback_only() or is_local(task.address.host):
        return []
    mine = cluster.tasks_on(is_local)
    if len(mine) == 1:
        hint = (
            f"this machine is {mine[0].role} index {mine[0].index}, not {index}: "
            f"run with --role {mine[0].role} --index {mine[0].index}"
        )
    elif mine:
        hint = "this machine has " + ", ".join(t.name for t in mine) + f": pick one of them, not {task.name}"
    else:
        hint = (
            "no entry of the cluster file is an address of this machine: fix the address or run on that host"
        )
    return [problem(task.key, str(task.address), "not an address of this machine", hint)]


def infer_task(cluster, is_local) -> tuple[object | None, list[str]]:
    """With --role omitted: the one entry that is this machine."""
    if cluster.loopback_only():
        return None, [
            problem(
                "--role",
                "",
                "every task of this loopback cluster runs on this machine",
                "pass --role and --index, or run 'od-dist launch' to start them all",
            )
        ]
    mine = cluster.tasks_on(is_local)
    if len(mine) == 1:
        return mine[0], []
    if not mine:
        return None, [
            problem(
                "--role",
                "",
                "no entry of the cluster file is an address of this machine",
                "fix the addresses, or pass --role and --index",
            )
        ]
    return None, [
        problem(
            "--role",
            "",
            "several entries are this machine: " + ", ".join(t.name for t in mine),
            "pass --role and --index",
        )
    ]
