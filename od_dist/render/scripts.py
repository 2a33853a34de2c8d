"""Per-machine launch scripts: one cluster file -> a bash, cmd or PowerShell script per task, plus
a README that says which machine runs which script and which ports each machine must open.

Every value reaches `od-dist train` through exactly one quoting layer per shell, done here by pure
functions (tested on their own and by running the scripts: bash for real, cmd under Wine):

- bash: `bash_quote` puts anything that is not plainly safe in single quotes (`'` -> `'\\''`);
  inside single quotes bash expands nothing, and non-ASCII bytes pass through as they are.
- Windows programs parse their own command line (the C-runtime rules: `"` groups, `\\` escapes a
  quote). `windows_arg` quotes one argument by those rules.
- cmd: `cmd_escape` then escapes that command line for a batch file: every `"` becomes `^"`, so
  cmd never enters its quoted state and every `& | < > ( ) ^` is `^`-escaped with certainty; every
  `%` is doubled (the only escape for `%` in a batch file); `!` is literal because the script turns
  delayed expansion off itself; no `call` (it would expand `%` a second time); non-ASCII needs
  `chcp 65001`, which the script runs first (the file is UTF-8 without BOM; cmd decodes each line
  with the current code page).
- PowerShell: `ps_quote` makes a single-quoted literal (nothing expands; `'` and its typographic
  look-alikes, which PowerShell also ends strings with, are doubled). The script hands the
  ready-made Windows command line to System.Diagnostics.Process, so PowerShell's own
  native-argument passing, which drops embedded quotes in 5.1 and changed in 7.3, plays no part:
  right for Windows PowerShell 5.1 and PowerShell 7.x alike. Files are UTF-8 with BOM (5.1 reads
  BOM-less files in the ANSI code page).

Scripts fit each host's `os` (hosts settings): `.sh` for linux hosts, `.cmd` and `.ps1` for
windows hosts, all three for a host whose OS is not declared. No TensorFlow here.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass

from od_dist.cluster.spec import Cluster, HostSettings, Task
from od_dist.cluster.topology import connecting_peers
from od_dist.cluster.validate import PARAMETER_SERVER

CMD_LINE_LIMIT = 8191  # cmd's maximum line length
_BASH_SAFE = re.compile(r"^[A-Za-z0-9_@%+=:,./-]+$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_CMD_SPECIAL = set("&|<>()^")
PS_SINGLE_QUOTES = "'\u2018\u2019\u201a\u201b"  # PowerShell ends a '...' string on any of these


class ScriptError(ValueError):
    """A value that no launch script can carry (e.g. a newline); the message names it and the fix."""


def _check(value: str, what: str) -> str:
    if _CONTROL.search(value):
        raise ScriptError(
            f"{what}: {value!r} contains a control character (newline, tab, ...); "
            "launch scripts pass values on one line: remove it"
        )
    return value


# ----- quoting ---------------------------------------------------------------------------------


def bash_quote(value: str) -> str:
    """One bash word that is exactly `value`."""
    if _BASH_SAFE.match(value):
        return value
    return "'" + value.replace("'", "'\\''") + "'"


def windows_arg(value: str) -> str:
    """One argument of a Windows command line, as the C runtime (and CommandLineToArgvW) splits it:
    quoted when empty or holding whitespace (the C runtime splits at space and tab only; quoting
    any Unicode space as well costs nothing) or a quote; backslashes doubled only before a quote."""
    if value and not any(c.isspace() or c == '"' for c in value):
        return value
    out, backslashes = ['"'], 0
    for c in value:
        if c == "\\":
            backslashes += 1
            continue
        out.append("\\" * (2 * backslashes + 1) if c == '"' else "\\" * backslashes)
        out.append(c)
        backslashes = 0
    out.append("\\" * (2 * backslashes) + '"')
    return "".join(out)


def windows_command_line(args: list[str]) -> str:
    """The arguments after the program name, joined into one Windows command line."""
    return " ".join(windows_arg(a) for a in args)


def cmd_escape(text: str) -> str:
    """A piece of a command line, escaped for a line of a .cmd/.bat file (delayed expansion off).

    Every `"` is written `^"`: cmd then never enters its quoted state, so escaping every other
    special character with `^` is always right, and the program still receives the quotes."""
    out = []
    for c in text:
        if c == "%":
            out.append("%%")
        elif c == '"' or c in _CMD_SPECIAL:
            out.append("^" + c)
        else:
            out.append(c)
    return "".join(out)


def cmd_args(args: list[str]) -> str:
    return " ".join(cmd_escape(windows_arg(a)) for a in args)


def cmd_in_quotes(path: str) -> str:
    """Text for inside real double quotes in a batch file (a program to run, `pushd`, `set "N=..."`):
    there only `%` is special. Windows paths cannot contain `"`."""
    if '"' in path:
        raise ScriptError(f"{path}: a Windows path cannot contain '\"': fix the hosts settings")
    return path.replace("%", "%%")


def cmd_path(path: str) -> str:
    return '"' + cmd_in_quotes(path) + '"'


def ps_quote(value: str) -> str:
    """A PowerShell single-quoted string that is exactly `value`."""
    return "'" + "".join(c + c if c in PS_SINGLE_QUOTES else c for c in value) + "'"


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


def train_args(cluster_path: str, task: Task, passed_on: list[str]) -> list[str]:
    """The `od-dist train` arguments of one task: its role and index, the cluster file, the flags."""
    return ["train", f"--cluster={cluster_path}", f"--role={task.role}", f"--index={task.index}", *passed_on]


def launches(cluster: Cluster, cluster_path: str, passed_on: list[str]) -> list[Launch]:
    out = []
    for task in cluster.tasks():
        host = task.address.host
        settings = cluster.host_settings(host)
        prefix = ["-m", "od_dist"] if settings.python else []
        flags = [
            a for a in passed_on if cluster.runs_replicas(task.role) or not a.startswith("--num_clones=")
        ]
        args = tuple(prefix + train_args(cluster_path, task, flags))
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


def sh_path(value: str) -> str:
    """A path as one bash word, `~` or `~/` at its start expanded to $HOME as bash would."""
    if value == "~":
        return '"$HOME"'
    if value.startswith("~/"):
        return '"$HOME"' + bash_quote(value[1:])
    return bash_quote(value)


# ----- renderers ---------------------------------------------------------------------------------


def render_sh(launch: Launch) -> str:
    s = launch.settings
    lines = [
        "#!/usr/bin/env bash",
        f"# od-dist launch script for {launch.describe()}.",
        f"# Run it on {launch.host}: bash {launch.stem}.sh   (generated by `od-dist scripts`; see README.md)",
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
    words = [" ".join([sh_path(launch.program)] + [bash_quote(w) for w in head])]
    words += [bash_quote(a) for a in launch.args[len(head) :]]
    lines.append("exec " + " \\\n  ".join(words))
    return "\n".join(lines) + "\n"


def render_cmd(launch: Launch) -> str:
    s = launch.settings
    program = "od-dist" if launch.program == "od-dist" else cmd_path(launch.program)
    lines = [
        "@echo off",
        f"rem od-dist launch script for {launch.task.role} {launch.task.index} ({launch.task.address}).",
        f"rem Run it on {launch.host} (Windows 10 or later): {launch.stem}.cmd",
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
            f'set "VIRTUAL_ENV={cmd_in_quotes(s.venv)}"',
            f'set "PATH={cmd_in_quotes(launch.venv_bin)};%PATH%"',
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
        return [f"$exe = [System.IO.Path]::Combine($PWD.ProviderPath, {ps_quote(program)})"]
    # The name only ever inside single quotes (nothing expands there), escaped for -Name's wildcards.
    return [
        f"$exe = (Get-Command -Name ([System.Management.Automation.WildcardPattern]::Escape({ps_quote(program)}))"
        " -CommandType Application -ErrorAction Stop | Select-Object -First 1).Path",
        "if ([System.IO.Path]::GetExtension($exe) -ne '.exe') {",
        f"    throw ({ps_quote(program + ' must be an .exe (found ')} + $exe + "
        f"{ps_quote('): a .cmd/.bat would parse the arguments again')})",
        "}",
    ]


def render_ps1(launch: Launch) -> str:
    s = launch.settings
    lines = [
        f"# od-dist launch script for {launch.describe()}.",
        f"# Run it on {launch.host}:  powershell -ExecutionPolicy Bypass -File {launch.stem}.ps1",
        "# Generated by `od-dist scripts`; see README.md next to it.",
        "# Right for Windows PowerShell 5.1 and PowerShell 7.x alike: the Windows command line below is",
        "# built once, by the C-runtime rules od-dist parses it with, and handed to the process as is;",
        "# PowerShell's own native-argument passing (changed in 7.3) plays no part.",
        "$ErrorActionPreference = 'Stop'",
    ]
    if s.workdir:
        lines.append(f"Set-Location -LiteralPath {ps_quote(s.workdir)}")
    if s.venv:  # what the venv's Activate.ps1 does, without needing it to be allowed to run
        lines += [
            f"$env:VIRTUAL_ENV = {ps_quote(s.venv)}",
            f"$env:PATH = {ps_quote(launch.venv_bin + ';')} + $env:PATH",
            "Remove-Item -Path Env:PYTHONHOME -ErrorAction SilentlyContinue",
        ]
    lines += _ps_program(launch)
    lines.append("# od-dist receives exactly these arguments, one per line:")
    lines += [f"#   {a}" for a in launch.args]
    lines += [
        f"$arguments = {ps_quote(windows_command_line(list(launch.args)))}",
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
        sources = dict.fromkeys(  # each host once, in order
            p.address.host for p in connecting_peers(cluster, task) if p.address.host != task.address.host
        )
        if sources:
            out.append(InboundRule(task, task.address.port, tuple(sources)))
    return out


def firewall_lines(rule: InboundRule, os_name: str) -> list[str]:
    name = f"od-dist {rule.task.role} {rule.task.index}"
    if os_name == "windows":
        remote = ",".join(rule.sources)
        return [
            f"New-NetFirewallRule -DisplayName '{name}' -Direction Inbound -Protocol TCP "
            f"-LocalPort {rule.port} -RemoteAddress {remote} -Action Allow",
            f'netsh advfirewall firewall add rule name="{name}" dir=in action=allow protocol=TCP '
            f"localport={rule.port} remoteip={remote}",
        ]
    lines = [f"sudo ufw allow proto tcp from {h} to any port {rule.port}" for h in rule.sources]
    lines += [
        f"sudo {'ip6tables' if ':' in h else 'iptables'} -A INPUT -p tcp -s {h} --dport {rule.port} -j ACCEPT"
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


def render_readme(
    cluster: Cluster,
    cluster_path: str,
    items: list[Launch],
    command: str,
    wait_timeout: int,
    max_restarts: int = 0,
) -> str:
    md = [
        f"# Launch scripts for `{cluster_path}`",
        "",
        "Generated by `od-dist scripts` (regenerate after every change to the cluster file):",
        "",
        f"    {command}",
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
            f"`{s.python} -m od_dist`" if s.python else f"venv `{s.venv}`" if s.venv else "`od-dist` on PATH"
        )
        md.append(
            f"| {launch.host} | {s.os or 'not declared'} | {launch.task.role} {launch.task.index} | {launch.task.address} | "
            f"{run} | {f'`{s.workdir}`' if s.workdir else 'where you run it'} | {source} |"
        )
    md += [
        "",
        "Copy each script to its machine. It changes to the working directory, activates the Python "
        "environment and runs `od-dist train` with the task's `--role`/`--index`; the cluster file "
        f"(`{cluster_path}`), the pipeline and `--model_dir` are resolved from that working directory, "
        "so each machine needs them there (the evaluator reads the master's checkpoints: give both the "
        "same model_dir on a shared folder, or run them on one machine).",
        "",
        "## Order",
        "",
        "Any order. Every trainer and server waits for its peers, up to `--wait_timeout` seconds "
        f"({wait_timeout} s here), and then names the ones still missing; start all machines within "
        "that window. The servers exit by themselves after the master finishes; Ctrl+C stops any "
        "task (a trainer saves a checkpoint first).",
        "",
        "## Faults",
        "",
        f"Each script runs its task with `--max_restarts {max_restarts}`: when the task is lost (killed, "
        "or it lost a peer: exit 130, 137, 138 or 143) the script's `od-dist train` starts it again, "
        f"up to {max_restarts} times, after 2 s (doubling), so the job heals itself: a lost "
        "parameter_server worker rejoins; when a ps or the master is lost (under "
        "multi_worker_mirrored, any trainer), the other trainers exit 138 naming it and are "
        "restarted too, and training resumes from the last checkpoint in model_dir. A permanent "
        "error (exit 1, or 2 for invalid input) is not retried. Past the limit, or for a machine "
        "that is gone for good, stop all tasks and start them all again.",
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
                f"### {host}: {rule.task.role} {rule.task.index}, port {rule.port}",
                "",
                f"Allow TCP port {rule.port} from {', '.join(rule.sources)} "
                f"({', '.join(t.name for t in connecting_peers(cluster, rule.task) if t.address.host != host)}).",
                "",
                "```",
            ]
            for os_name in launch.oses:
                md += firewall_lines(rule, os_name)
            md += ["```", ""]
    no_inbound = [x for x in items if not any(r.task == x.task for r in rules)]
    if no_inbound:
        md.append(
            "No inbound port: "
            + ", ".join(f"{x.task.role} {x.task.index} ({x.host})" for x in no_inbound)
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


def write_file(path: str, text: str, suffix: str) -> None:
    encoding = "utf-8-sig" if suffix == ".ps1" else "utf-8"
    with open(path, "w", encoding=encoding, newline="") as f:
        f.write(text)
    if suffix == ".sh":
        os.chmod(path, 0o755)


def write_scripts(
    cluster: Cluster,
    cluster_path: str,
    passed_on: list[str],
    out_dir: str,
    command: str,
    wait_timeout: int,
    max_restarts: int = 0,
) -> list[str]:
    """Writes every task's scripts and README.md into out_dir; returns the paths written."""
    items = launches(cluster, cluster_path, passed_on)
    rendered = [
        (f, RENDERERS[os.path.splitext(f)[1]](launch.on(os_name)))
        for launch in items
        for os_name in launch.oses
        for f in launch.on(os_name).files
    ]
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, text in rendered + [
        ("README.md", render_readme(cluster, cluster_path, items, command, wait_timeout, max_restarts))
    ]:
        path = os.path.join(out_dir, name)
        write_file(path, text, os.path.splitext(name)[1])
        written.append(path)
    return written
