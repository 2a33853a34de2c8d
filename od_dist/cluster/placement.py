"""Rules on a built cluster (cluster/spec.py's Cluster), for the task this machine runs.

Which task that is (--role and --index checked against the file, and that its entry is an address
of this machine, or the one entry that is), whether an address is on the public internet, and one
replica layout for every worker under parameter_server. Like the rules on the parsed document
(`validate`), each returns one-line problems, each naming the key, the value and the fix, and
touches no network: the caller looks up what this machine's addresses and names resolve to.
"""

from __future__ import annotations

from od_dist.cluster.hostport import is_ip, is_public
from od_dist.cluster.messages import problem
from od_dist.cluster.validate import PARAMETER_SERVER, ROLES, normalize_role


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
