"""Pure validation rules for a cluster description: the rules on the parsed document.

Each rule takes plain data (the parsed YAML document) and returns a list of one-line problems,
each naming the key, the value and the fix; `check_document` runs them all. Nothing here touches
the network, the file system or TensorFlow, so every rule is testable on its own. Addresses are
parsed in `hostport`, the problem lines written by `messages.problem`. The rules on a built cluster
and the task this machine runs are in `placement`.
"""

from __future__ import annotations

from od_dist.cluster import accounts
from od_dist.cluster.hostport import AddressError, host_key, is_loopback, parse_address
from od_dist.cluster.messages import did_you_mean, problem, shown

PARAMETER_SERVER = "parameter_server"
MULTI_WORKER_MIRRORED = "multi_worker_mirrored"
STRATEGIES = (PARAMETER_SERVER, MULTI_WORKER_MIRRORED)

TOP_KEYS = (
    "strategy",
    "master",
    "chief",
    "worker",
    "ps",
    "evaluator",
    "num_clones",
    "checkpoint_port",
    "min_trainers",
    "membership_port",
    "sync_every",
    "outer_learning_rate",
    "outer_momentum",
    "hosts",
)
HOST_KEYS = ("os", "python", "venv", "workdir", "num_clones", "user")
HOST_OSES = ("linux", "windows")
ROLES = ("master", "worker", "ps", "evaluator")
ROLE_ALIASES = {"chief": "master"}
MAX_CLONES = 256  # replicas per process: GPUs of one machine, or logical CPU devices
# The outer step of `sync_every` (task/local_sgd.py). By default the plain average of the trainers'
# weights (local SGD): learning rate 1, no momentum. DiLoCo's (arXiv 2311.08105) Nesterov 0.7 / 0.9
# is a setting: its momentum applies about 7 times each meeting's average change once it builds up,
# which the paper pairs with a small inner learning rate (AdamW) and 500 steps between meetings; on the
# demo's SGD schedule with 50 it ended at AP50 0.002 where the plain average reached 0.343 in the
# same run (BENCHMARKS.md, "sync_every").
OUTER_LEARNING_RATE = 1.0
OUTER_MOMENTUM = 0.0
DILOCO = (0.7, 0.9)  # the paper's outer learning rate and momentum
OUTER_KEYS = ("outer_learning_rate", "outer_momentum")  # with sync_every only


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


def _same_machine(a: str, b: str) -> bool:
    return a == b or (is_loopback(a) and is_loopback(b))


def _port_user(doc: dict, port: int, hosts: list[str]) -> tuple[str, str] | None:
    """(key, its address) of an entry that uses `port` on the machine of one of `hosts`."""
    for _, key, value in address_entries(doc):
        if not isinstance(value, str):
            continue
        try:
            host, used = parse_address(value.strip(), need_port=False)
        except AddressError:
            continue  # said by check_addresses
        if used == port and any(_same_machine(host, h) for h in hosts):
            return key, value
    return None


def _trainer_hosts(doc: dict) -> list[tuple[str, str]]:
    """(key, host) of the master and every worker, in the cluster's order (the lead first)."""
    out = []
    for role, key, value in address_entries(doc):
        if role in ("master", "worker") and isinstance(value, str):
            try:
                out.append((key, parse_address(value.strip(), need_port=False)[0]))
            except AddressError:
                pass
    return sorted(out, key=lambda e: e[0] not in ("master", "chief"))


def _is_port(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and 1 <= value <= 65535


def check_checkpoint_port(doc: dict) -> list[str]:
    """`checkpoint_port`: where the lead (the master, else worker 0) serves its newest checkpoint
    to an evaluator that does not share its folder (protocol/checkpoint_feed.py): a port of the
    lead's machine that no task of that machine uses; of every trainer's machine when the lead may
    move (min_trainers)."""
    if "checkpoint_port" not in doc:
        return []
    port = doc["checkpoint_port"]
    fix = "write a free port of the master's machine, e.g. 'checkpoint_port: 2230'"
    if not _is_port(port):
        return [problem("checkpoint_port", port, "not a port number between 1 and 65535", fix)]
    trainers = _trainer_hosts(doc)
    if not trainers:
        return [problem("checkpoint_port", port, "no master or worker serves it", "list a master")]
    serving = trainers if "min_trainers" in doc else trainers[:1]
    taken = _port_user(doc, port, [h for _, h in serving])
    if taken:
        where = f"the {trainers[0][0].split('[')[0]}'s machine ({trainers[0][1]})"
        if len(serving) > 1:
            where = "a trainer's machine (with min_trainers any trainer may become the lead)"
        return [
            problem(
                "checkpoint_port",
                port,
                f"{taken[0]} uses that port on {where}",
                "give the checkpoints a port of their own",
            )
        ]
    return []


def check_elastic(doc: dict) -> list[str]:
    """`min_trainers` (a smaller group of trainers goes on without a lost one: under
    multi_worker_mirrored the all-reduce group, under parameter_server the master and workers, any
    of which may coordinate) and `membership_port` (where each trainer machine's od-dist agrees the
    group with the others: host/elastic.py). More than half of the trainers: the two sides of a
    split network can then never both form a group."""
    if "min_trainers" not in doc and "membership_port" not in doc:
        return []
    if "min_trainers" not in doc:
        return [
            problem(
                "membership_port",
                doc["membership_port"],
                "used only with min_trainers",
                "add min_trainers (e.g. 'min_trainers: 2'), or remove membership_port",
            )
        ]
    wanted = doc["min_trainers"]
    trainers = _trainer_hosts(doc)
    n, half = len(trainers), len(trainers) // 2 + 1
    if isinstance(wanted, bool) or not isinstance(wanted, int) or not 1 <= wanted <= n:
        return [
            problem(
                "min_trainers",
                wanted,
                f"not a number of trainers between 1 and {n} (the master and workers listed)",
                f"write e.g. 'min_trainers: {max(1, half)}'",
            )
        ]
    out = []
    if wanted < half:
        out.append(
            problem(
                "min_trainers",
                wanted,
                f"{wanted} of {n} trainers would let both sides of a split network train apart",
                f"write more than half of them: {half} or more",
            )
        )
    if infer_strategy(doc) == PARAMETER_SERVER and "checkpoint_port" not in doc:
        out.append(
            problem(
                "min_trainers",
                wanted,
                "under parameter_server needs checkpoint_port: the workers keep copies of the "
                "coordinator's checkpoints from it, so that the next round's coordinator resumes from "
                "the newest on its own disk",
                "add a free port of every trainer's machine, e.g. 'checkpoint_port: 2230'",
            )
        )
    port = doc.get("membership_port")
    if port is None:
        return out + [
            problem(
                "min_trainers",
                wanted,
                "needs membership_port, where each trainer machine's od-dist agrees the group with the others",
                "add a free port of every trainer's machine, e.g. 'membership_port: 2226'",
            )
        ]
    if not _is_port(port):
        return out + [
            problem(
                "membership_port",
                port,
                "not a port number between 1 and 65535",
                "write a free port of every trainer's machine, e.g. 'membership_port: 2226'",
            )
        ]
    if port == doc.get("checkpoint_port"):
        return out + [
            problem(
                "membership_port", port, "checkpoint_port is the same port", "give each a port of its own"
            )
        ]
    taken = _port_user(doc, port, [h for _, h in trainers])
    if taken:
        out.append(
            problem(
                "membership_port",
                port,
                f"{taken[0]} uses that port on a trainer's machine ({taken[1]})",
                "give the membership a port of its own",
            )
        )
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
            elif name == "user":
                out.extend(accounts.problems(f"{key}.user", value, settings.get("os")))
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
        + check_checkpoint_port(doc)
        + check_elastic(doc)
        + check_sync_every(doc)
        + check_hosts(doc)
    )


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_sync_every(doc: dict) -> list[str]:
    """`sync_every: H` (multi_worker_mirrored): each trainer steps alone on its own batches, and every
    H steps the trainers average their weights in one all-reduce, then take the outer step
    (`outer_learning_rate`, `outer_momentum`). For links too slow for an all-reduce every step."""
    out = []
    if "sync_every" not in doc:
        return [
            problem(key, doc[key], "used only with sync_every", "add e.g. 'sync_every: 25', or remove it")
            for key in OUTER_KEYS
            if key in doc
        ]
    every = doc["sync_every"]
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        out.append(
            problem(
                "sync_every",
                every,
                "not a number of steps (1 or more)",
                "write e.g. 'sync_every: 25' (the trainers meet every 25 steps)",
            )
        )
    if infer_strategy(doc) != MULTI_WORKER_MIRRORED:
        out.append(
            problem(
                "sync_every",
                every,
                "applies to multi_worker_mirrored trainers (parameter_server has no replicas to average)",
                "remove sync_every, or the ps entries for 'strategy: multi_worker_mirrored'",
            )
        )
    rate = doc.get("outer_learning_rate", OUTER_LEARNING_RATE)
    if not _number(rate) or not 0 < rate <= 10:
        out.append(
            problem(
                "outer_learning_rate",
                rate,
                "not a learning rate above 0 (at most 10)",
                f"write e.g. 'outer_learning_rate: {DILOCO[0]}' (DiLoCo's; 1 with outer_momentum 0: the plain average)",
            )
        )
    momentum = doc.get("outer_momentum", OUTER_MOMENTUM)
    if not _number(momentum) or not 0 <= momentum < 1:
        out.append(
            problem(
                "outer_momentum",
                momentum,
                "not a momentum from 0 to below 1",
                f"write e.g. 'outer_momentum: {DILOCO[1]}' (DiLoCo's; 0: no momentum)",
            )
        )
    return out


def normalize_role(role: str | None) -> str | None:
    return ROLE_ALIASES.get(role, role) if role else role
