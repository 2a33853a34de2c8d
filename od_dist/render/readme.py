"""The README written beside the launch scripts: which machine runs which script, in what order,
what happens on a fault, the inbound firewall rules of each machine (cluster/topology.py says
who connects to whom) as commands for its shells and, with --at_boot, the lines that make each
machine start its script at boot (render/boot.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from od_dist.cluster import accounts, duties
from od_dist.cluster.spec import Cluster, Task
from od_dist.cluster.topology import connecting_peers, feed_readers, model_dir_line
from od_dist.cluster.validate import PARAMETER_SERVER
from od_dist.host.policy import HEALTHY_S
from od_dist.protocol import notes
from od_dist.render import boot, quote
from od_dist.render.machines import Launch

# ----- who talks to whom (cluster/topology.py) -----------------------------------------------------


@dataclass(frozen=True)
class InboundRule:
    task: Task
    port: int
    sources: tuple[str, ...]  # peer hosts, this host itself left out (local traffic)
    peers: tuple[Task, ...] = ()  # the tasks that connect, from those hosts
    what: str = ""  # the port's use when it is not the task's own: "checkpoints", "membership"

    @property
    def label(self) -> str:
        """'master 0', or 'master 0 checkpoints': the rule's name and how the README says it."""
        return f"{self.task.role} {self.task.index}" + (f" {self.what}" if self.what else "")


def inbound_rules(cluster: Cluster) -> list[InboundRule]:
    out = []
    for task in cluster.tasks():
        uses = [(task.address.port, connecting_peers(cluster, task), "")]
        for port, what, _ in cluster.side_ports(task):
            uses.append((port, feed_readers(cluster) if what == "checkpoints" else cluster.members(), what))
        for port, peers, what in uses:
            # A dict keeps the peers' order and finds a repeated host at once (a list would make the
            # rule of a ps or master, which thousands of workers reach, quadratic).
            remote = tuple(p for p in peers if p.address.host != task.address.host)
            sources = dict.fromkeys(p.address.host for p in remote)
            if sources:
                out.append(InboundRule(task, port, tuple(sources), remote, what))
    return out


def firewall_ways(rule: InboundRule, os_name: str) -> list[tuple[str, list[str]]]:
    """The copy-paste commands of one rule, each way with its own: (shell or tool, lines), every
    value quoted for its shell. Windows: PowerShell or cmd (netsh); Linux: ufw or iptables."""
    name = f"od-dist {rule.label}"
    if os_name == "windows":
        remote = ",".join(rule.sources)
        return [
            (
                "PowerShell",
                [
                    f"New-NetFirewallRule -DisplayName {quote.ps(name)} -Direction Inbound -Protocol TCP "
                    f"-LocalPort {rule.port} -RemoteAddress {','.join(quote.ps(h) for h in rule.sources)} "
                    "-Action Allow"
                ],
            ),
            (
                "cmd",
                [
                    f'netsh advfirewall firewall add rule name="{name}" dir=in action=allow protocol=TCP '
                    f"localport={rule.port} {quote.cmd('remoteip=' + remote)}"
                ],
            ),
        ]
    ufw = [f"sudo ufw allow proto tcp from {quote.sh(h)} to any port {rule.port}" for h in rule.sources]
    # -I: before the final REJECT rule that RHEL-family systems ship (-A would land after it).
    iptables = [
        f"sudo {'ip6tables' if ':' in h else 'iptables'} -I INPUT -p tcp -s {quote.sh(h)} "
        f"--dport {rule.port} -j ACCEPT"
        for h in rule.sources
    ]
    return [("ufw", ufw), ("iptables", iptables)]


def firewall_lines(rule: InboundRule, os_name: str) -> list[str]:
    """Every way's commands of one rule, one after another."""
    return [line for _, lines in firewall_ways(rule, os_name) for line in lines]


# ----- README ------------------------------------------------------------------------------------


def _run_line(launch: Launch, file: str) -> str:
    if file.endswith(".sh"):
        return f"`bash {file}`"
    if file.endswith(".ps1"):
        return f"`powershell -ExecutionPolicy Bypass -File {file}`"
    return f"`{file}`"


# How each system's firewall commands are run; the ways of one system are alternatives.
FIREWALL_SHELLS = {"linux": "with sudo", "windows": "in an Administrator shell"}


def _firewall_section(cluster: Cluster, launch: Launch, rules: list[InboundRule]) -> list[str]:
    ports = ", ".join(str(r.port) for r in rules)
    md = [
        f"### {quote.md_word(launch.host)} ({launch.what()}): port{'s' if len(rules) > 1 else ''} {ports}",
        "",
    ]
    for rule in rules:
        peers = ", ".join(t.name for t in rule.peers)
        md.append(
            f"- TCP port {rule.port} ({rule.label}) from "
            f"{', '.join(quote.md_word(h) for h in rule.sources)} ({peers})."
        )
    md.append("")
    for os_name in launch.oses:
        ways: dict[str, list[str]] = {}
        for rule in rules:
            for how, lines in firewall_ways(rule, os_name):
                ways.setdefault(how, []).extend(lines)
        md.append(f"{os_name.capitalize()}: one of these, {FIREWALL_SHELLS[os_name]}.")
        md.append("")
        for n, (how, lines) in enumerate(ways.items()):
            md += [f"{'Or ' if n else ''}{how}:", "", "```", *lines, "```", ""]
        if os_name == "windows":  # Windows Defender Firewall's block rules win over any allow rule
            md += [
                "The first time Python listens on a port, Windows may ask whether to allow it on "
                "networks: choose Allow. Cancel adds rules that block Python and win over the ones above: "
                "delete them in `wf.msc` (Inbound Rules, the Python entries marked blocked).",
                "",
            ]
    return md


def _code(lines: list[str]) -> list[str]:
    return ["```", *lines, "```", ""]


def _boot_sections(items: list[Launch], at_boot: boot.AtBoot) -> list[str]:
    """How each machine starts its script at boot: its systemd unit's or its Windows task's lines."""
    oses = {o for x in items for o in x.oses}
    md = [
        "## Start at boot",
        "",
        "Each machine below starts its script at boot, without a person, once its lines have run. Copy "
        "its script"
        + (" (on Linux with its `.service` file)" if "linux" in oses else "")
        + (" (on Windows with its task's `.xml` file)" if "windows" in oses else "")
        + " into its "
        "working directory first, the path named below. Remove them once the job is done: they start it "
        "at every boot. Each runs as the user named below for its machine: its `user` in the cluster "
        "file's `hosts:`, else `--at_boot_user`; root or SYSTEM is the system account (root on Linux, "
        "SYSTEM on Windows).",
        "",
    ]
    if "linux" in oses:
        md.append(
            "- Linux: systemd runs the script as that user (`User=`) once the network is up; its console goes to the "
            "journal (`journalctl -u <unit>`). systemd starts it again "
            f"{boot.RESTART_SEC} s after a retryable exit (137, 138, 143; also after `--wait_timeout` for "
            "peers that did not come, so the machines may boot at any time), not after exit 0, 1, 2 or a "
            "person's stop (130). `sudo systemctl kill --signal=SIGINT <unit>` is Ctrl+C on that machine "
            "(see Order); `systemctl stop` and a shutdown send SIGTERM: the trainers save a checkpoint "
            "and exit 143 (systemd shows it failed)."
        )
    if "windows" in oses:
        md.append(
            "- Windows: Task Scheduler runs the `.cmd` as that user whether anyone is logged on or not, with no "
            "time limit and on battery too (schtasks asks a named user's password once; SYSTEM has none)"
            ", and does not start it again after it ends (`schtasks /Run` does). The removal lines first "
            f"stop the job as a SIGTERM does (the trainers save a checkpoint): `{notes.STOP_FILE}` in the "
            "working directory, which its od-dist watches for, then the grace period's wait; `schtasks /End` "
            "then ends whatever still runs at once. What it prints is in each "
            "task's log in `<model_dir>/logs/`. The lines below are for an Administrator cmd, not "
            "PowerShell (which passes their quotes on otherwise)."
        )
    if any(x.program == "od-dist" for x in items):
        md.append(
            "- A machine that runs `od-dist` from PATH needs it on the system's PATH (systemd's: "
            "`/usr/local/bin`, `/usr/bin`, ...), not a login shell's."
        )
    md.append("")
    for launch in items:
        md += [f"### {quote.md_word(launch.host)} ({launch.what()})", ""]
        given = boot.user_of(launch, at_boot)[1]
        for os_name in launch.oses:
            user = quote.md(accounts.on(given, os_name))
            if os_name == "linux":
                install, remove = boot.systemd_lines(launch)
                md += [
                    f"Linux: the unit `{boot.unit_file(launch)}` runs "
                    f"{quote.md(boot.script_path(launch, 'linux'))} as {user}; to install it and start it now:",
                    "",
                    *_code(install),
                    "To remove it:",
                    "",
                    *_code(remove),
                ]
            else:
                create, delete = boot.schtasks_lines(launch, at_boot)
                md += [
                    f"Windows: the task `{boot.name(launch)}` runs "
                    f"{quote.md(boot.script_path(launch, 'windows'))} as {user}; to create it and start it now:",
                    "",
                    *_code(create),
                    "To remove it:",
                    "",
                    *_code(delete),
                ]
    return md


def render_readme(
    cluster: Cluster,
    cluster_path: str,
    items: list[Launch],
    command: str,
    wait_timeout: int,
    max_restarts: int = 0,
    at_boot: boot.AtBoot | None = None,
) -> str:
    rules = inbound_rules(cluster)
    rules_of: dict[str, list[InboundRule]] = {x.host: [] for x in items}
    for rule in rules:
        rules_of[rule.task.address.host].append(rule)
    md = [
        f"# Launch scripts for {quote.md(cluster_path)}",
        "",
        "Generated by `od-dist scripts` (regenerate after every change to the cluster file):",
        "",
        f"    {quote.check(command)}",
        "",
        f"Strategy: `{cluster.strategy}`. One script per machine, in the shell of its `os` "
        "(the cluster file's `hosts:` settings): `.sh` for Linux, `.cmd` (cmd) and `.ps1` (PowerShell; "
        "either one) for Windows, all three for a machine whose `os` is not declared (use the one "
        "that fits). Each runs one `od-dist train`; on a machine that holds several tasks (a ps with "
        "its worker) it has no `--role`, and starts every task of that machine under one supervisor, "
        "as `od-dist launch` does: one console with prefixed lines, a log per task in "
        "`<model_dir>/logs/`.",
        "",
        "## Which machine runs which script",
        "",
        "| machine | os | runs | script | open inbound TCP | working directory | od-dist from |",
        "|---|---|---|---|---|---|---|",
    ]
    for launch in items:
        s = launch.settings
        run = " or ".join(_run_line(launch, f) for f in launch.files)
        source = (
            quote.md(f"{s.python} -m od_dist", table=True)
            if s.python
            else f"venv {quote.md(s.venv, table=True)}"
            if s.venv
            else "`od-dist` on PATH"
        )
        workdir = quote.md(s.workdir, table=True) if s.workdir else "where you run it"
        ports = ", ".join(str(r.port) for r in rules_of[launch.host]) or "none"
        md.append(
            f"| {quote.md_word(launch.host, table=True)} | {s.os or 'not declared'} | {launch.what()} | "
            f"{run} | {ports} | {workdir} | {source} |"
        )
    readers = [
        x.host for x in items if any(duties.of(cluster.strategy, t.role).reads_records for t in x.tasks)
    ]
    # Every script passes the job's --pipeline and --model_dir: doctor checks them on each machine.
    files = [a for a in items[0].args if a.startswith(("--pipeline=", "--model_dir=", "--params_override="))]
    doctor = " ".join(quote.sh(a) for a in ["od-dist", "doctor", f"--cluster={cluster_path}", *files])
    md += [
        "",
        "Copy each script to its machine. It changes to the working directory, activates the Python "
        "environment and runs `od-dist train`; the cluster file "
        f"({quote.md(cluster_path)}), the pipeline and `--model_dir` are resolved from that working directory, "
        "so each machine needs them there. " + model_dir_line(cluster),
        "",
        "The pipeline's records (its input files) must be on every machine that reads them, the trainers' "
        + ("and the evaluator's " if cluster.tasks_of("evaluator") else "")
        + "("
        + ", ".join(quote.md_word(h) for h in readers)
        + ("; a ps reads none" if cluster.tasks_of("ps") else "")
        + "), at the paths the pipeline names, or on a shared folder. Check each "
        "machine before the first start, in its working directory:",
        "",
        f"    {quote.check(doctor)}",
        "",
        "It names what would stop the job there: records that are missing, a model_dir it cannot "
        "write, a peer's port that a firewall drops, a TensorFlow or Model Garden other than od-dist's.",
        "",
        "A `.cmd` started by a double-click keeps its window open when od-dist fails, so that its "
        "last line can be read; started from a console, it returns at once.",
        "",
        "## Order",
        "",
        "Any order. Every trainer and server waits for its peers, up to `--wait_timeout` seconds "
        f"({wait_timeout} s here), and then names the ones still missing; start all machines within "
        "that window. "
        + ("The servers exit by themselves after the master finishes. " if cluster.tasks_of("ps") else "")
        + "Ctrl+C on any "
        "machine ends the job on every machine: the trainers save one checkpoint first, and every "
        "script's `od-dist train` exits 130 without restarting its tasks.",
        "",
        "## Faults",
        "",
        f"Each script runs its tasks with `--max_restarts {max_restarts}`: when a task is lost (killed, "
        "or it lost a peer: exit 137, 138 or 143) the script's `od-dist train` starts it again, "
        f"up to {max_restarts} times in a row (at once, then after 2 s, doubling); the count starts over once training "
        f"progressed (a newer checkpoint, or a loop past every earlier start's furthest step) or the tasks ran {HEALTHY_S / 60:.0f} minutes, so a long run's "
        "occasional faults never use it up. " + _heals(cluster) + " A permanent error (exit 1, or 2 "
        "for invalid input) is not retried, nor a task that waited `--wait_timeout` for peers that did "
        "not come (exit 138 once, not once per restart). " + _gone_for_good(cluster),
        "",
        "## Firewall: inbound TCP, from these peers only",
        "",
    ]
    if cluster.strategy == PARAMETER_SERVER:
        md.append(
            "Under parameter_server the master connects to every ps and worker, and the workers "
            "reach the ps. Every ps and worker also checks that the master's port is open: a server "
            "whose master stays unreachable for --wait_timeout seconds stops, so open the master's "
            "port to them too."
        )
    else:
        md.append(
            "Under multi_worker_mirrored every trainer (master and workers) talks to every other."
            + (
                f" With min_trainers ({cluster.min_trainers}) each trainer machine's od-dist agrees each "
                f"round's group with the others on membership_port ({cluster.membership_port}), and any "
                "trainer may become the lead that serves the checkpoints."
                if cluster.min_trainers
                else ""
            )
        )
    md += [
        (
            "The evaluator runs no server and needs no inbound port; it checks that the "
            f"{'master' if cluster.master else 'worker 0 (the chief)'}'s port is open, to know training is "
            "alive, so that port is open to it too"
            + (
                ", and fetches the checkpoints from its checkpoint_port. "
                if cluster.checkpoint_feed()
                else ". "
            )
            if cluster.tasks_of("evaluator")
            else ""
        )
        + "Outbound connections must be "
        "allowed (they are by default). The TensorFlow server has no authentication: open its "
        "port to these peers only, never to the internet. Peers on the same machine need no rule.",
        "",
    ]
    if any(not re.fullmatch(r"[0-9.]+|[0-9a-fA-F:]+", h) for r in rules for h in r.sources):
        md += ["Some peers are host names: the firewall commands need their IP addresses.", ""]
    for launch in items:
        if rules_of[launch.host]:
            md += _firewall_section(cluster, launch, rules_of[launch.host])
    no_inbound = [x for x in items if not rules_of[x.host]]
    if no_inbound:
        md.append(
            "No inbound port: " + ", ".join(f"{quote.md_word(x.host)} ({x.what()})" for x in no_inbound) + "."
        )
        md.append("")
    if at_boot:
        md += _boot_sections(items, at_boot)
    md += [
        "How the scripts quote values for each shell, the generic `od-dist-node.sh` / `od-dist-node.ps1`, "
        "and Kubernetes: `scripts/README.md` in the od-dist repository.",
        "",
    ]
    return "\n".join(md)


def _heals(cluster) -> str:
    """How the job heals itself, by strategy and min_trainers (docs/faults.md has every case)."""
    if cluster.min_trainers:
        return (
            f"The job heals itself and is elastic (min_trainers {cluster.min_trainers}): when a trainer's "
            f"machine is lost, the trainers up (at least {cluster.min_trainers}) go on as a smaller group "
            "from the newest checkpoint any of them holds, and take it back when its script is started "
            "again (on its old disk or an empty one)."
        )
    if cluster.strategy == PARAMETER_SERVER:
        return (
            "The job heals itself: a lost parameter_server worker rejoins; when a ps or the master is lost, "
            "the other tasks exit 138 naming it and are restarted too, and training resumes from the "
            "master's last checkpoint."
        )
    return (
        "The job heals itself: when a trainer is lost, the other trainers exit 138 naming it and are "
        "restarted too, and training resumes from the newest checkpoint any trainer holds (a trainer whose "
        "model_dir is behind or empty gets the variables from the others)."
    )


def _gone_for_good(cluster) -> str:
    if cluster.min_trainers:
        return (
            "Past the limit, stop all tasks and start them all again. A machine gone for good: the others "
            "train on without it; to replace it at another address, write that address into the cluster "
            "file on every machine, regenerate these scripts, then stop all tasks and start them all again."
        )
    return "Past the limit, or for a machine that is gone for good, stop all tasks and start them all again."
