"""Per-machine launch scripts: one cluster file -> a bash, cmd or PowerShell script per task, plus
a README that says which machine runs which script and which ports each machine must open.

Every value reaches `od-dist train` through exactly one quoting layer per shell, done by the
functions of `od_dist.render.quote` (tested on their own and by running the scripts: bash for
real, cmd under Wine). The cmd script hands its line to the program as it is (no `call`, which
would expand `%` a second time) after `chcp 65001` (the file is UTF-8 without BOM; cmd decodes each
line with the current code page). The PowerShell script hands the ready-made Windows command line
to System.Diagnostics.Process, so PowerShell's own native-argument passing, which drops embedded
quotes in 5.1 and changed in 7.3, plays no part: right for Windows PowerShell 5.1 and PowerShell
7.x alike. Its files are UTF-8 with BOM (5.1 reads BOM-less files in the ANSI code page).

Scripts fit each host's `os` (hosts settings): `.sh` for linux hosts, `.cmd` and `.ps1` for
windows hosts, all three for a host whose OS is not declared. No TensorFlow here.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from dataclasses import dataclass

from od_dist.cluster import commandline, duties
from od_dist.cluster.spec import Cluster, HostSettings, Task
from od_dist.cluster.topology import connecting_peers
from od_dist.cluster.validate import PARAMETER_SERVER
from od_dist.data import records
from od_dist.render import quote
from od_dist.render.quote import QuoteError, sh_path

CMD_LINE_LIMIT = 8191  # cmd's maximum line length
ScriptError = QuoteError  # a value no launch script can carry; the message names it and the fix
bash_quote, ps_quote, windows_arg, cmd_escape = quote.sh, quote.ps, quote.windows_arg, quote.cmd_escape
windows_command_line = quote.windows_command_line


def _check(value: str, what: str) -> str:
    return quote.check(value, what)


def cmd_args(args: list[str]) -> str:
    return " ".join(quote.cmd(a) for a in args)


def cmd_path(path: str) -> str:
    return '"' + quote.cmd_in_quotes(path) + '"'


# ----- what each task runs -----------------------------------------------------------------------


@dataclass(frozen=True)
class Launch:
    """How one task starts on its host."""

    task: Task
    host: str
    settings: HostSettings
    args: tuple[str, ...]  # everything after the program: [-m od_dist] train --cluster=... ...
    cluster_path: str = ""

    @property
    def windows(self) -> bool:
        return self.settings.os == "windows"

    @property
    def oses(self) -> tuple[str, ...]:
        """The systems to write scripts for: the declared one, else both."""
        return (self.settings.os,) if self.settings.os else ("linux", "windows")

    def on(self, os_name: str) -> Launch:
        """This launch as written for one system."""
        return dataclasses.replace(self, settings=dataclasses.replace(self.settings, os=os_name))

    @property
    def stem(self) -> str:
        return f"{self.task.role}-{self.task.index}"

    @property
    def venv_bin(self) -> str | None:
        venv = self.settings.venv
        if not venv:
            return None
        return venv.rstrip("\\/") + ("\\Scripts" if self.windows else "/bin")

    @property
    def program(self) -> str:
        """The interpreter (`python` setting), else the venv's od-dist, else `od-dist` on PATH."""
        if self.settings.python:
            return self.settings.python
        if self.venv_bin:
            return self.venv_bin + ("\\od-dist.exe" if self.windows else "/od-dist")
        return "od-dist"

    @property
    def files(self) -> tuple[str, ...]:
        names = {"linux": (f"{self.stem}.sh",), "windows": (f"{self.stem}.cmd", f"{self.stem}.ps1")}
        return sum((names[o] for o in self.oses), ())

    def describe(self) -> str:
        return f"{self.task.role} {self.task.index} ({self.task.address}) of {self.cluster_path}"


def launches(cluster: Cluster, cluster_path: str, passed_on: list[str]) -> list[Launch]:
    out = []
    for task in cluster.tasks():
        host = task.address.host
        settings = cluster.host_settings(host)
        prefix = ["-m", "od_dist"] if settings.python else []
        args = tuple(prefix + commandline.train_args(passed_on, cluster, task, cluster_path))
        for i, a in enumerate(args):
            _check(a, f"argument {i + 1} of {task.name}")
        for name in ("python", "venv", "workdir"):
            value = getattr(settings, name)
            if value is not None:
                _check(value, f"hosts.{host}.{name}")
                _check_home(value, f"hosts.{host}.{name}", settings.os)
        out.append(Launch(task, host, settings, args, cluster_path))
    return out


def _check_home(value: str, what: str, os_name: str | None) -> None:
    """`~` and `~/...` become $HOME in a .sh; Windows shells have no `~`, and `~user` is refused."""
    if not value.startswith("~"):
        return
    if value != "~" and not value.startswith("~/"):
        raise ScriptError(
            f"{what}: '{value}': only '~' and '~/...' (the user's home) are understood; write the full path"
        )
    if os_name != "linux":
        hint = "" if os_name else ", or declare 'os: linux' for this host"
        raise ScriptError(
            f"{what}: '{value}': '~' means nothing to Windows cmd and PowerShell scripts; write the "
            f"full path{hint}"
        )


# ----- renderers ---------------------------------------------------------------------------------


def render_sh(launch: Launch) -> str:
    s = launch.settings
    lines = [
        "#!/usr/bin/env bash",
        f"# od-dist launch script for {quote.check(launch.describe())}.",
        f"# Run it on {quote.check(launch.host)}: bash {launch.stem}.sh   (generated by `od-dist scripts`; "
        "see README.md)",
        "set -e",
    ]
    if s.workdir:
        lines.append(f"cd -- {sh_path(s.workdir)}")
    if s.venv:  # what the venv's bin/activate does, without its prompt and shell-function side effects
        lines += [
            f"export VIRTUAL_ENV={sh_path(s.venv)}",
            'export PATH="$VIRTUAL_ENV/bin:$PATH"',
            "unset PYTHONHOME",
        ]
    head = list(launch.args[: launch.args.index("train") + 1])  # [-m od_dist] train, then one flag a line
    words = [" ".join([sh_path(launch.program)] + [quote.sh(w) for w in head])]
    words += [quote.sh(a) for a in launch.args[len(head) :]]
    lines.append("exec " + " \\\n  ".join(words))
    return "\n".join(lines) + "\n"


def render_cmd(launch: Launch) -> str:
    s = launch.settings
    program = "od-dist" if launch.program == "od-dist" else cmd_path(launch.program)
    lines = [
        "@echo off",
        f"rem od-dist launch script for {launch.task.role} {launch.task.index} "
        f"({quote.cmd_escape(str(launch.task.address))}).",
        f"rem Run it on {quote.cmd_escape(launch.host)} (Windows 10 or later): {launch.stem}.cmd",
        "rem Generated by `od-dist scripts`; see README.md next to it.",
        "setlocal EnableExtensions DisableDelayedExpansion",
        "rem UTF-8, so that non-ASCII text below reaches od-dist intact; the code page is restored at the end.",
        'for /f "tokens=2 delims=:." %%c in (\'chcp\') do set "OD_DIST_OLD_CP=%%c"',
        "chcp 65001 >nul 2>&1",
    ]
    if s.workdir:
        # `(call )` clears ERRORLEVEL, which pushd sets only on failure (`||` is not reliable after
        # built-ins in every cmd).
        lines += [
            "(call )",
            f"pushd {cmd_path(s.workdir)}",
            "if errorlevel 1 (echo od-dist: cannot change to the working directory 1>&2 & exit /b 1)",
        ]
    if s.venv:  # what the venv's activate.bat does; `call` would expand % in the path a second time
        lines += [
            f'set "VIRTUAL_ENV={quote.cmd_in_quotes(s.venv)}"',
            f'set "PATH={quote.cmd_in_quotes(launch.venv_bin)};%PATH%"',
            'set "PYTHONHOME="',
        ]
    lines += [
        f"{program} {cmd_args(list(launch.args))}",
        'set "OD_DIST_RC=%ERRORLEVEL%"',
    ]
    if s.workdir:
        lines.append("popd")
    lines += ["if defined OD_DIST_OLD_CP chcp %OD_DIST_OLD_CP% >nul 2>&1", "exit /b %OD_DIST_RC%"]
    for line in lines:
        if len(line) > CMD_LINE_LIMIT:
            raise ScriptError(
                f"{launch.stem}.cmd: a line of {len(line)} characters is longer than cmd's "
                f"{CMD_LINE_LIMIT}: shorten the paths or flags"
            )
    return "\r\n".join(lines) + "\r\n"


def _ps_program(launch: Launch) -> list[str]:
    program = launch.program
    if re.search(r"[\\/:]", program):  # a path: relative ones are relative to the working directory
        return [f"$exe = [System.IO.Path]::Combine($PWD.ProviderPath, {quote.ps(program)})"]
    # The name only ever inside single quotes (nothing expands there), escaped for -Name's wildcards.
    return [
        f"$exe = (Get-Command -Name ([System.Management.Automation.WildcardPattern]::Escape({quote.ps(program)}))"
        " -CommandType Application -ErrorAction Stop | Select-Object -First 1).Path",
        "if ([System.IO.Path]::GetExtension($exe) -ne '.exe') {",
        f"    throw ({quote.ps(program + ' must be an .exe (found ')} + $exe + "
        f"{quote.ps('): a .cmd/.bat would parse the arguments again')})",
        "}",
    ]


def render_ps1(launch: Launch) -> str:
    s = launch.settings
    lines = [
        f"# od-dist launch script for {quote.check(launch.describe())}.",
        f"# Run it on {quote.check(launch.host)}:  powershell -ExecutionPolicy Bypass -File {launch.stem}.ps1",
        "# Generated by `od-dist scripts`; see README.md next to it.",
        "# Right for Windows PowerShell 5.1 and PowerShell 7.x alike: the Windows command line below is",
        "# built once, by the C-runtime rules od-dist parses it with, and handed to the process as is;",
        "# PowerShell's own native-argument passing (changed in 7.3) plays no part.",
        "$ErrorActionPreference = 'Stop'",
    ]
    if s.workdir:
        lines.append(f"Set-Location -LiteralPath {quote.ps(s.workdir)}")
    if s.venv:  # what the venv's Activate.ps1 does, without needing it to be allowed to run
        lines += [
            f"$env:VIRTUAL_ENV = {quote.ps(s.venv)}",
            f"$env:PATH = {quote.ps(launch.venv_bin + ';')} + $env:PATH",
            "Remove-Item -Path Env:PYTHONHOME -ErrorAction SilentlyContinue",
        ]
    lines += _ps_program(launch)
    lines.append("# od-dist receives exactly these arguments, one per line:")
    lines += [f"#   {quote.check(a)}" for a in launch.args]
    lines += [
        f"$arguments = {quote.ps(quote.windows_command_line(list(launch.args)))}",
        "$start = New-Object System.Diagnostics.ProcessStartInfo",
        "$start.FileName = $exe",
        "$start.Arguments = $arguments",
        "# Set-Location does not move the process's own directory: pass it on explicitly.",
        "$start.WorkingDirectory = $PWD.ProviderPath",
        "$start.UseShellExecute = $false",
        "$process = [System.Diagnostics.Process]::Start($start)",
        "$process.WaitForExit()",
        "exit $process.ExitCode",
    ]
    return "\r\n".join(lines) + "\r\n"


# ----- who talks to whom (cluster/topology.py) -----------------------------------------------------


@dataclass(frozen=True)
class InboundRule:
    task: Task
    port: int
    sources: tuple[str, ...]  # peer hosts, this host itself left out (local traffic)


def inbound_rules(cluster: Cluster) -> list[InboundRule]:
    out = []
    for task in cluster.tasks():
        # A dict keeps the peers' order and finds a repeated host at once (a list would make the
        # rule of a ps or master, which thousands of workers reach, quadratic).
        sources = dict.fromkeys(
            p.address.host for p in connecting_peers(cluster, task) if p.address.host != task.address.host
        )
        if sources:
            out.append(InboundRule(task, task.address.port, tuple(sources)))
    return out


def firewall_lines(rule: InboundRule, os_name: str) -> list[str]:
    """The copy-paste commands of one rule: PowerShell and cmd (netsh) for Windows, bash for Linux;
    every value quoted for its shell."""
    name = f"od-dist {rule.task.role} {rule.task.index}"
    if os_name == "windows":
        remote = ",".join(rule.sources)
        return [
            f"New-NetFirewallRule -DisplayName {quote.ps(name)} -Direction Inbound -Protocol TCP "
            f"-LocalPort {rule.port} -RemoteAddress {','.join(quote.ps(h) for h in rule.sources)} "
            "-Action Allow",
            f'netsh advfirewall firewall add rule name="{name}" dir=in action=allow protocol=TCP '
            f"localport={rule.port} {quote.cmd('remoteip=' + remote)}",
        ]
    lines = [f"sudo ufw allow proto tcp from {quote.sh(h)} to any port {rule.port}" for h in rule.sources]
    # -I: before the final REJECT rule that RHEL-family systems ship (-A would land after it).
    lines += [
        f"sudo {'ip6tables' if ':' in h else 'iptables'} -I INPUT -p tcp -s {quote.sh(h)} "
        f"--dport {rule.port} -j ACCEPT"
        for h in rule.sources
    ]
    return lines


# ----- README ------------------------------------------------------------------------------------


def _run_line(launch: Launch, file: str) -> str:
    if file.endswith(".sh"):
        return f"`bash {file}`"
    if file.endswith(".ps1"):
        return f"`powershell -ExecutionPolicy Bypass -File {file}`"
    return f"`{file}`"


def _records_note(cluster: Cluster, items: list[Launch]) -> str:
    """Where the records must be, and the doctor line that finds what is missing on a machine."""
    readers = dict.fromkeys(
        quote.md_word(x.host) for x in items if duties.of(cluster.strategy, x.task.role).reads_records
    )
    place = ("--cluster=", "--pipeline=", "--model_dir=")
    doctor = ["od-dist", "doctor", *(a for a in items[0].args if a.startswith(place))]
    return (
        "The records the pipeline reads (`task.train_data` / `task.validation_data` `input_path`) must be "
        f"on every machine whose task reads them ({', '.join(readers)}), at that path from its working "
        "directory, or on a shared folder. Before the first start, run on each machine "
        f"{quote.md(' '.join(quote.sh(a) for a in doctor))}: it names what is missing there."
    )


def render_readme(
    cluster: Cluster,
    cluster_path: str,
    items: list[Launch],
    command: str,
    wait_timeout: int,
    max_restarts: int = 0,
) -> str:
    md = [
        f"# Launch scripts for {quote.md(cluster_path)}",
        "",
        "Generated by `od-dist scripts` (regenerate after every change to the cluster file):",
        "",
        f"    {quote.check(command)}",
        "",
        f"Strategy: `{cluster.strategy}`. One script per task, in the shell of its machine's `os` "
        "(the cluster file's `hosts:` settings): `.sh` for Linux, `.cmd` (cmd) and `.ps1` (PowerShell; "
        "either one) for Windows, all three for a machine whose `os` is not declared (use the one "
        "that fits).",
        "",
        "## Which machine runs which script",
        "",
        "| machine | os | task | address | run | working directory | od-dist from |",
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
        md.append(
            f"| {quote.md_word(launch.host, table=True)} | {s.os or 'not declared'} | {launch.task.role} "
            f"{launch.task.index} | {quote.md_word(str(launch.task.address), table=True)} | {run} | {workdir} | "
            f"{source} |"
        )
    md += [
        "",
        "Copy each script to its machine. It changes to the working directory, activates the Python "
        "environment and runs `od-dist train` with the task's `--role`/`--index`; the cluster file "
        f"({quote.md(cluster_path)}), the pipeline and `--model_dir` are resolved from that working directory, "
        "so each machine needs them there (the evaluator reads the master's checkpoints: give both the "
        "same model_dir on a shared folder, or run them on one machine).",
        "",
        _records_note(cluster, items),
        "",
        "## Order",
        "",
        "Any order. Every trainer and server waits for its peers, up to `--wait_timeout` seconds "
        f"({wait_timeout} s here), and then names the ones still missing; start all machines within "
        "that window. The servers exit by themselves after the master finishes. Ctrl+C on any "
        "machine ends the job on every machine: the trainers save one checkpoint first, and every "
        "script's `od-dist train` exits 130 without restarting its task.",
        "",
        "## Faults",
        "",
        f"Each script runs its task with `--max_restarts {max_restarts}`: when the task is lost (killed, "
        "or it lost a peer: exit 137, 138 or 143) the script's `od-dist train` starts it again, "
        f"up to {max_restarts} times, after 2 s (doubling), so the job heals itself: a lost "
        "parameter_server worker rejoins; when a ps or the master is lost (under "
        "multi_worker_mirrored, any trainer), the other trainers exit 138 naming it and are "
        "restarted too, and training resumes from the last checkpoint in model_dir. A permanent "
        "error (exit 1, or 2 for invalid input) is not retried, nor a task that waited "
        "`--wait_timeout` for peers that did not come (exit 138 once, not once per restart). Past "
        "the limit, or for a machine that is gone for good, stop all tasks and start them all again.",
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
        md.append("Under multi_worker_mirrored every trainer (master and workers) talks to every other.")
    md += [
        "The evaluator runs no server and needs no inbound port; it checks that the "
        f"{'master' if cluster.master else 'worker 0 (the chief)'}'s port is open, to know training is "
        "alive, so that port is open to it too. Outbound connections must be "
        "allowed (they are by default). The TensorFlow server has no authentication: open its "
        "port to these peers only, never to the internet.",
        "",
    ]
    rules = inbound_rules(cluster)
    if any(not re.fullmatch(r"[0-9.]+|[0-9a-fA-F:]+", h) for r in rules for h in r.sources):
        md += ["Some peers are host names: the firewall commands need their IP addresses.", ""]
    by_host: dict[str, list[InboundRule]] = {}
    for rule in rules:
        by_host.setdefault(rule.task.address.host, []).append(rule)
    for launch in items:
        host = launch.host
        if host not in by_host:
            continue
        for rule in by_host.pop(host):
            md += [
                f"### {quote.md_word(host)}: {rule.task.role} {rule.task.index}, port {rule.port}",
                "",
                f"Allow TCP port {rule.port} from {', '.join(quote.md_word(h) for h in rule.sources)} "
                f"({', '.join(t.name for t in connecting_peers(cluster, rule.task) if t.address.host != host)}).",
                "",
                "```",
            ]
            for os_name in launch.oses:
                md += firewall_lines(rule, os_name)
            md += ["```", ""]
    ruled = {r.task for r in rules}
    no_inbound = [x for x in items if x.task not in ruled]
    if no_inbound:
        md.append(
            "No inbound port: "
            + ", ".join(f"{x.task.role} {x.task.index} ({quote.md_word(x.host)})" for x in no_inbound)
            + "."
        )
        md.append("")
    md += [
        "How the scripts quote values for each shell, the generic `od-dist-node.sh` / `od-dist-node.ps1`, "
        "and Kubernetes: `scripts/README.md` in the od-dist repository.",
        "",
    ]
    return "\n".join(md)


RENDERERS = {".sh": render_sh, ".cmd": render_cmd, ".ps1": render_ps1}


MANIFEST = records.MANIFEST  # lists what a run wrote into --out


def encoded(name: str, text: str) -> tuple[bytes, int]:
    """A script's bytes (PowerShell 5.1 reads UTF-8 only with a BOM) and its mode."""
    suffix = os.path.splitext(name)[1]
    return text.encode("utf-8-sig" if suffix == ".ps1" else "utf-8"), 0o777 if suffix == ".sh" else 0o666


def write_scripts(
    cluster: Cluster,
    cluster_path: str,
    passed_on: list[str],
    out_dir: str,
    command: str,
    wait_timeout: int,
    max_restarts: int = 0,
) -> list[str]:
    """Writes every task's scripts and README.md into out_dir as `records.write_owned` does (each
    file atomically; only files an earlier run wrote and nobody changed since are replaced or, when
    this run does not write them, removed; nothing else there is touched); returns their paths.
    Scripts of an earlier run that were changed since are kept, said in one line."""
    items = launches(cluster, cluster_path, passed_on)
    rendered = [
        (f, RENDERERS[os.path.splitext(f)[1]](launch.on(os_name)))
        for launch in items
        for os_name in launch.oses
        for f in launch.on(os_name).files
    ]
    rendered.append(
        ("README.md", render_readme(cluster, cluster_path, items, command, wait_timeout, max_restarts))
    )
    out_dir = os.path.normpath(out_dir)
    kept = records.write_owned(out_dir, {name: encoded(name, text) for name, text in rendered})
    if kept:
        print(
            f"kept {', '.join(kept)} in {out_dir}: an earlier run's, not written now and changed since "
            "(or written before od-dist kept digests); delete them if no machine runs them",
            file=sys.stderr,
        )
    return [os.path.join(out_dir, name) for name, _ in rendered]
