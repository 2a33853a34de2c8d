"""Per-machine launch scripts: one cluster file -> a bash, cmd or PowerShell script per machine,
plus a README that says which machine runs which script and which ports each machine must open.

Each script runs one `od-dist train` command: a machine's one task with its --role/--index, or for
a machine that holds several entries (a ps with its worker) no --role, so that od-dist starts every
entry of that machine under one supervisor (cluster/commandline.py's machine_args).

Every value reaches `od-dist train` through exactly one quoting layer per shell, done by the
functions of `od_dist.render.quote` (tested on their own and by running the scripts: bash for
real, cmd under Wine). The cmd script hands its line to the program as it is (no `call`, which
would expand `%` a second time) after `chcp 65001` (the file is UTF-8 without BOM; cmd decodes each
line with the current code page). Started by a double-click, it keeps its window open after a
failure, so its last line can be read. The PowerShell script hands the ready-made Windows command
line to System.Diagnostics.Process, so PowerShell's own native-argument passing, which drops
embedded quotes in 5.1 and changed in 7.3, plays no part: right for Windows PowerShell 5.1 and
PowerShell 7.x alike. Its files are UTF-8 with BOM (5.1 reads BOM-less files in the ANSI code page).

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
from od_dist.cluster.messages import PATH_SHOWN_MAX, problem
from od_dist.cluster.spec import Cluster, HostSettings, Task
from od_dist.cluster.topology import connecting_peers
from od_dist.cluster.validate import PARAMETER_SERVER
from od_dist.data import writing
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
    """How one machine starts its tasks: one `od-dist train` command."""

    tasks: tuple[Task, ...]  # this machine's entries, in the cluster's order (servers first)
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
        return "_".join(f"{t.role}-{t.index}" for t in self.tasks)

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

    def what(self) -> str:
        """'ps 0 and worker 0': the tasks, as the README and the scripts' comments name them."""
        names = [f"{t.role} {t.index}" for t in self.tasks]
        return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]

    def describe(self) -> str:
        where = ", ".join(str(t.address) for t in self.tasks)
        return f"{self.what()} ({where}) of {self.cluster_path}"

    @property
    def together(self) -> str | None:
        """For a machine of several entries, the comment line that says how they run."""
        if len(self.tasks) == 1:
            return None
        return (
            "od-dist train without --role starts every task of this machine, each under one supervisor "
            "(as od-dist launch does)."
        )


def launches(cluster: Cluster, cluster_path: str, passed_on: list[str]) -> list[Launch]:
    """One Launch per machine (per host as the cluster file writes it), in the order of its first task."""
    by_host: dict[str, list[Task]] = {}
    for task in cluster.tasks():
        by_host.setdefault(task.address.host, []).append(task)
    out = []
    for host, tasks in by_host.items():
        settings = cluster.host_settings(host)
        prefix = ["-m", "od_dist"] if settings.python else []
        args = tuple(prefix + commandline.machine_args(passed_on, cluster, tasks, cluster_path))
        what = tasks[0].name if len(tasks) == 1 else host
        for i, a in enumerate(args):
            _check(a, f"argument {i + 1} of {what}")
        for name in ("python", "venv", "workdir"):
            value = getattr(settings, name)
            if value is not None:
                _check(value, f"hosts.{host}.{name}")
                _check_home(value, f"hosts.{host}.{name}", settings.os)
        launch = Launch(tuple(tasks), host, settings, args, cluster_path)
        if launch.windows:
            _check_windows_paths(launch)
        out.append(launch)
    return out


# The paths of a task's command line that a Windows machine must be able to read.
PATH_FLAGS = ("--cluster=", "--pipeline=", "--model_dir=")


def is_posix_absolute(path: str) -> bool:
    """`/srv/runs`: absolute on Linux; on Windows, a folder of whatever drive is current. `//server/share`
    is a Windows UNC path written with slashes."""
    return path.startswith("/") and not path.startswith("//")


def _check_windows_paths(launch: Launch) -> None:
    """A Windows machine's paths (the job's flags, its hosts settings) must not be absolute Linux ones."""
    flags = [(a.partition("=")[0], a.partition("=")[2]) for a in launch.args if a.startswith(PATH_FLAGS)]
    settings = [
        (f"hosts.{launch.host}.{n}", getattr(launch.settings, n)) for n in ("python", "venv", "workdir")
    ]
    windows_forms = "C:\\... or \\\\server\\share\\..."
    for what, value in flags + settings:
        if value and is_posix_absolute(value):
            fix = (
                f"write it as a Windows path ({windows_forms})"
                if what.startswith("hosts.")
                else "pass a path relative to the working directory (hosts workdir), which Linux and "
                f"Windows machines read alike, or a Windows one ({windows_forms})"
            )
            raise ScriptError(
                problem(
                    what,
                    value,
                    f"an absolute Linux path, and {launch.host} ({launch.what()}) runs Windows",
                    fix,
                    PATH_SHOWN_MAX,
                )
            )


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
    ]
    if launch.together:
        lines.append(f"# {launch.together}")
    lines.append("set -e")
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


# A double-click runs a .cmd as `cmd.exe /c ""<its full path>" "` (Explorer, like any program that
# starts the file itself), and its window closes when it ends; from a console, cmd's own command
# line (%CMDCMDLINE%) is the console's and does not name the script. Its quotes are removed first,
# so that the values sit inside the quotes of `set` and `if`, where no other character is special
# (twice: where cmd has no CMDCMDLINE, as Wine's, the first leaves a quote behind). `call` expands
# the line a second time to put the path into the search-and-replace; a path with `%` or `^` (which
# that expands or doubles) may not be recognised.
_CMD_CLICKED = [
    "rem Started by a double-click (cmd's command line names this script): keep the window open after",
    "rem a failure, so that its last line can be read. Started from a console: return at once.",
    'set "OD_DIST_SELF=%~f0"',
    'set "OD_DIST_PAUSE="',
    'set "OD_DIST_LINE=%CMDCMDLINE:"=%"',
    'set "OD_DIST_LINE=%OD_DIST_LINE:"=%"',
    'call set "OD_DIST_REST=%%OD_DIST_LINE:%OD_DIST_SELF%=%%"',
    'if /i not "%OD_DIST_REST%"=="%OD_DIST_LINE%" set "OD_DIST_PAUSE=1"',
]


def render_cmd(launch: Launch) -> str:
    s = launch.settings
    program = "od-dist" if launch.program == "od-dist" else cmd_path(launch.program)
    where = ", ".join(str(t.address) for t in launch.tasks)
    lines = [
        "@echo off",
        f"rem od-dist launch script for {launch.what()} ({quote.cmd_escape(where)}).",
        f"rem Run it on {quote.cmd_escape(launch.host)} (Windows 10 or later): {launch.stem}.cmd",
        "rem Generated by `od-dist scripts`; see README.md next to it.",
    ]
    if launch.together:
        lines.append(f"rem {launch.together}")
    lines += [
        "setlocal EnableExtensions DisableDelayedExpansion",
        *_CMD_CLICKED,
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
            "if errorlevel 1 (echo od-dist: cannot change to the working directory 1>&2 "
            '& set "OD_DIST_RC=1" & goto od_dist_end)',
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
    lines += [
        ":od_dist_end",
        "if defined OD_DIST_OLD_CP chcp %OD_DIST_OLD_CP% >nul 2>&1",
        'if not "%OD_DIST_RC%"=="0" if defined OD_DIST_PAUSE (echo od-dist: exit status %OD_DIST_RC%, '
        "see the lines above. Press a key to close this window. & pause >nul)",
        "exit /b %OD_DIST_RC%",
    ]
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
        *([f"# {launch.together}"] if launch.together else []),
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


def firewall_ways(rule: InboundRule, os_name: str) -> list[tuple[str, list[str]]]:
    """The copy-paste commands of one rule, each way with its own: (shell or tool, lines), every
    value quoted for its shell. Windows: PowerShell or cmd (netsh); Linux: ufw or iptables."""
    name = f"od-dist {rule.task.role} {rule.task.index}"
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
        peers = ", ".join(
            t.name for t in connecting_peers(cluster, rule.task) if t.address.host != launch.host
        )
        md.append(
            f"- TCP port {rule.port} ({rule.task.role} {rule.task.index}) from "
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
    return md


def render_readme(
    cluster: Cluster,
    cluster_path: str,
    items: list[Launch],
    command: str,
    wait_timeout: int,
    max_restarts: int = 0,
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
    files = [a for a in items[0].args if a.startswith(("--pipeline=", "--model_dir="))]
    doctor = " ".join(quote.sh(a) for a in ["od-dist", "doctor", f"--cluster={cluster_path}", *files])
    md += [
        "",
        "Copy each script to its machine. It changes to the working directory, activates the Python "
        "environment and runs `od-dist train`; the cluster file "
        f"({quote.md(cluster_path)}), the pipeline and `--model_dir` are resolved from that working directory, "
        "so each machine needs them there (the evaluator reads the master's checkpoints: give both the "
        "same model_dir on a shared folder, or run them on one machine).",
        "",
        "The pipeline's records (its input files) must be on every trainer machine ("
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
        "that window. The servers exit by themselves after the master finishes. Ctrl+C on any "
        "machine ends the job on every machine: the trainers save one checkpoint first, and every "
        "script's `od-dist train` exits 130 without restarting its tasks.",
        "",
        "## Faults",
        "",
        f"Each script runs its tasks with `--max_restarts {max_restarts}`: when a task is lost (killed, "
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
    md += [
        "How the scripts quote values for each shell, the generic `od-dist-node.sh` / `od-dist-node.ps1`, "
        "and Kubernetes: `scripts/README.md` in the od-dist repository.",
        "",
    ]
    return "\n".join(md)


RENDERERS = {".sh": render_sh, ".cmd": render_cmd, ".ps1": render_ps1}


MANIFEST = writing.MANIFEST  # lists what a run wrote into --out


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
    """Writes every machine's scripts and README.md into out_dir as `writing.write_owned` does (each
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
    kept = writing.write_owned(out_dir, {name: encoded(name, text) for name, text in rendered})
    if kept:
        print(
            f"kept {', '.join(kept)} in {out_dir}: an earlier run's, not written now and changed since "
            "(or written before od-dist kept digests); delete them if no machine runs them",
            file=sys.stderr,
        )
    return [os.path.join(out_dir, name) for name, _ in rendered]
