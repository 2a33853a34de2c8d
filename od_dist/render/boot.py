"""Start at boot (`od-dist scripts --at_boot`): what starts each machine's launch script when the
machine starts, without a person. Linux: a systemd system service, a unit file written beside the
scripts; Windows: a Task Scheduler task at startup, defined by a task XML file written beside the
scripts and registered by the `schtasks /XML` lines of the scripts' README (render/readme.py): the
XML is how a task gets no execution limit (schtasks' defaults stop it after 72 hours, without a
checkpoint) and starts and runs on battery. Both run the script from the machine's working directory (its hosts `workdir`,
absolute), where it is copied, as the user named for that machine (its hosts `user`, else
--at_boot_user; the system account, root or SYSTEM, only when named: cluster/accounts.py). No
TensorFlow here.

systemd follows od-dist's exit codes (protocol/exit_codes.py): it starts the script again after a
retryable exit (137, 138, 143: a task lost past the script's own --max_restarts, or peers that did
not come within --wait_timeout, so that the machines may boot at any time apart), never after exit 0,
a permanent error (1, 2, and every code the table does not call retryable, a crash's 139 too) or a
person's stop (130). Task Scheduler starts nothing again.
"""

from __future__ import annotations

import ntpath
import posixpath
import re
from dataclasses import dataclass
from xml.sax.saxutils import escape

from od_dist.cluster import accounts
from od_dist.cluster.messages import PATH_SHOWN_MAX, problem
from od_dist.protocol import exit_codes, notes
from od_dist.render import quote
from od_dist.render.machines import Launch, ScriptError

RESTART_SEC = 5  # short: od-dist's own supervisor has already backed off before it exits
STOP_MARGIN_S = 30  # after --grace_period: the supervisor's own exit once its tasks saved
# Every exit status but 0 and the retryable ones: the table's "any other code is permanent" (a 139,
# a crash, included), which Restart=on-failure would otherwise restart every RESTART_SEC.
PERMANENT = tuple(c for c in range(1, 256) if c not in exit_codes.RETRYABLE)
SCHTASKS_TR_MAX = 261  # schtasks refuses a longer /TR
LACKING_SHOWN = 12  # machines a refusal names, of those that have no user


@dataclass(frozen=True)
class AtBoot:
    user: str | None = None  # --at_boot_user: the user of every machine whose hosts entry names none
    grace_period: int = 120  # the trainers' time to save after SIGTERM: systemd waits longer


def name(launch: Launch) -> str:
    """The systemd unit's name (without .service) and the scheduled task's."""
    return f"od-dist-{launch.stem}"


def unit_file(launch: Launch) -> str:
    return f"{name(launch)}.service"


def check_users(items: list[Launch], at_boot: AtBoot) -> None:
    """Refuses, in one message before anything is written, the machines whose units would run as
    no user named: a unit runs as root or SYSTEM only when asked to."""
    lacking = [x for x in items if not x.settings.user and at_boot.user is None]
    if not lacking:
        return
    named = ", ".join(f"{x.host} ({x.what()})" for x in lacking[:LACKING_SHOWN])
    more = f" and {len(lacking) - LACKING_SHOWN} more" if len(lacking) > LACKING_SHOWN else ""
    one = len(lacking) == 1
    has, whose = ("has", "its") if one else ("have", "each one's")
    raise ScriptError(
        f"--at_boot: {named}{more} {has} no user for {'its' if one else 'their'} units to run as; add "
        f"'user: <account>' under {whose} entry of the cluster file's hosts: "
        f"(hosts.{lacking[0].host if one else '<host>'}.user), or pass --at_boot_user=<account> for "
        f"every machine; {accounts.SYSTEM_HINT}"
    )


def user_of(launch: Launch, at_boot: AtBoot) -> tuple[str, str]:
    """(where it is given, the user as given) that `launch`'s units run as: its hosts `user`, else
    --at_boot_user; ScriptError naming the fix when it names no account of the machine's system."""
    check_users([launch], at_boot)
    if launch.settings.user:
        key, given, host = f"hosts.{launch.host}.user", launch.settings.user, ""
    else:
        key, given, host = "--at_boot_user", at_boot.user, f"{launch.host} ({launch.what()})"
    for found in accounts.problems(key, given, launch.settings.os, host):
        raise ScriptError(found)
    return key, given


def _workdir(launch: Launch, os_name: str) -> str:
    """The machine's working directory, absolute for `os_name`; ScriptError naming the fix else."""
    workdir = launch.settings.workdir
    key = f"hosts.{launch.host}.workdir"
    both = (
        ""
        if launch.settings.os
        else f", or declare the os of {launch.host} (not declared: it gets both systems')"
    )
    if not workdir:
        raise ScriptError(
            f"--at_boot: {launch.host} ({launch.what()}) has no working directory, where its script is "
            f"copied and runs at boot; set {key} to an absolute path"
        )
    if os_name == "linux":
        if not workdir.startswith("/"):
            raise ScriptError(
                problem(
                    key,
                    workdir,
                    "not an absolute Linux path, which systemd needs",
                    f"write the full path{both}",
                    PATH_SHOWN_MAX,
                )
            )
        return "/" + posixpath.normpath(workdir).lstrip("/")  # systemd refuses `..` and `//` in it
    if not re.match(r"[A-Za-z]:[\\/]|[\\/]{2}[^\\/]", workdir):
        fix = f"write it as C:\\... or \\\\server\\share\\...{both}"
        raise ScriptError(
            problem(
                key, workdir, "not an absolute Windows path, which Task Scheduler needs", fix, PATH_SHOWN_MAX
            )
        )
    if "%" in workdir:  # Task Scheduler and cmd expand %NAME% in a task's command: no escape reaches both
        raise ScriptError(
            problem(
                key,
                workdir,
                "contains '%', which a task at startup cannot carry",
                "choose a folder without it",
                PATH_SHOWN_MAX,
            )
        )
    return workdir


def script_path(launch: Launch, os_name: str) -> str:
    """Where the machine's script is at boot: in its working directory."""
    if os_name == "linux":
        return posixpath.join(_workdir(launch, "linux"), f"{launch.stem}.sh")
    return ntpath.join(_workdir(launch, "windows"), f"{launch.stem}.cmd")


def unit_path(launch: Launch) -> str:
    """Where the unit file is copied with the script, to be installed from."""
    return posixpath.join(_workdir(launch, "linux"), unit_file(launch))


# ----- Linux: a systemd system service ------------------------------------------------------------


def render_unit(launch: Launch, at_boot: AtBoot) -> str:
    workdir = _workdir(launch, "linux")
    user = accounts.on(user_of(launch, at_boot)[1], "linux")  # root too, written: the unit says whom
    where = ", ".join(str(t.address) for t in launch.tasks)
    restarted = ", ".join(str(c) for c in sorted(exit_codes.RETRYABLE - {exit_codes.INTERRUPTED}))
    return "\n".join(
        [
            f"# Starts {quote.check(launch.describe())} at boot,",
            f"# on {quote.check(launch.host)}. Generated by `od-dist scripts --at_boot`; README.md has the lines",
            "# that install and remove it.",
            "[Unit]",
            f"Description=od-dist {quote.systemd_value(f'{launch.what()} ({where})')}",
            "Wants=network-online.target",
            "After=network-online.target",
            "",
            "[Service]",
            f"User={user}",
            f"WorkingDirectory={quote.systemd_value(workdir)}",
            f"ExecStart=/bin/bash {quote.systemd(script_path(launch, 'linux'))}",
            "# Python buffers a pipe: each line reaches the journal when it is written.",
            "Environment=PYTHONUNBUFFERED=1",
            f"# Started again after a retryable exit ({restarted}), not after exit 0, a permanent error",
            "# (every other code) or a person's stop (130: Ctrl+C on any machine of the job).",
            "Restart=on-failure",
            f"RestartSec={RESTART_SEC}",
            f"SuccessExitStatus={exit_codes.INTERRUPTED}",
            f"RestartPreventExitStatus={' '.join(str(c) for c in PERMANENT)}",
            "# SIGTERM to od-dist alone, which stops its tasks: the trainers save a checkpoint within",
            "# --grace_period before anything left is killed.",
            "KillMode=mixed",
            f"TimeoutStopSec={at_boot.grace_period + STOP_MARGIN_S}",
            "",
            "[Install]",
            "WantedBy=multi-user.target",
            "",
        ]
    )


def systemd_lines(launch: Launch) -> tuple[list[str], list[str]]:
    """The lines that install and start the unit, and those that remove it."""
    unit = unit_file(launch)
    return (
        [
            f"sudo cp {quote.sh(unit_path(launch))} /etc/systemd/system/",
            "sudo systemctl daemon-reload",
            f"sudo systemctl enable --now {unit}",
        ],
        [
            f"sudo systemctl disable --now {unit}",
            f"sudo rm /etc/systemd/system/{unit}",
            "sudo systemctl daemon-reload",
        ],
    )


# ----- Windows: a Task Scheduler task at startup --------------------------------------------------

SYSTEM_SID = "S-1-5-18"  # LocalSystem, as a task's UserId


def task_file(launch: Launch) -> str:
    """The task's XML file, written beside the scripts and copied with them."""
    return f"{name(launch)}.xml"


def task_path(launch: Launch) -> str:
    return ntpath.join(_workdir(launch, "windows"), task_file(launch))


def _run_as(launch: Launch, at_boot: AtBoot) -> str:
    """The task's user (SYSTEM: the system account); refuses SYSTEM where it cannot reach the
    working directory."""
    workdir = _workdir(launch, "windows")
    key, given = user_of(launch, at_boot)
    run_as = accounts.on(given, "windows")
    if run_as == accounts.SYSTEM["windows"] and re.match(r"[\\/]{2}", workdir):
        raise ScriptError(
            problem(
                key,
                given,
                f"{launch.host}'s task would run as SYSTEM, which cannot reach its working directory "
                f"{workdir} (a network share)",
                f"name the user whose share it is in hosts.{launch.host}.user, e.g. LAB\\od",
            )
        )
    return run_as


def render_task(launch: Launch, at_boot: AtBoot) -> str:
    """The Task Scheduler task (schema 1.2, Windows 7 and later): at startup, whether anyone is
    logged on or not, no execution limit, no battery or idle conditions, one instance at a time."""
    command = task_command(launch)
    program, arguments = command.split(" ", 1)
    run_as = _run_as(launch, at_boot)
    principal = (
        f"<UserId>{SYSTEM_SID}</UserId><RunLevel>HighestAvailable</RunLevel>"
        if run_as == accounts.SYSTEM["windows"]
        else f"<UserId>{escape(run_as)}</UserId><LogonType>Password</LogonType>"
    )
    return "\n".join(
        [
            '<?xml version="1.0" encoding="UTF-16"?>',
            '<Task version="1.2" xmlns="http://schemas.microsoft.com/windows/2004/02/mit/task">',
            "  <RegistrationInfo>",
            f"    <Description>od-dist {escape(launch.what())}, generated by `od-dist scripts --at_boot`"
            "</Description>",
            "  </RegistrationInfo>",
            "  <Triggers><BootTrigger><Enabled>true</Enabled></BootTrigger></Triggers>",
            f'  <Principals><Principal id="Author">{principal}</Principal></Principals>',
            "  <Settings>",
            "    <MultipleInstancesPolicy>IgnoreNew</MultipleInstancesPolicy>",
            "    <DisallowStartIfOnBatteries>false</DisallowStartIfOnBatteries>",
            "    <StopIfGoingOnBatteries>false</StopIfGoingOnBatteries>",
            "    <StartWhenAvailable>true</StartWhenAvailable>",
            "    <IdleSettings><StopOnIdleEnd>false</StopOnIdleEnd><RestartOnIdle>false</RestartOnIdle>"
            "</IdleSettings>",
            "    <AllowStartOnDemand>true</AllowStartOnDemand>",
            "    <Enabled>true</Enabled>",
            "    <!-- PT0S: no limit (the default, 72 hours, is a hard stop: no checkpoint) -->",
            "    <ExecutionTimeLimit>PT0S</ExecutionTimeLimit>",
            "    <Priority>7</Priority>",
            "  </Settings>",
            '  <Actions Context="Author">',
            "    <Exec>",
            f"      <Command>{escape(program)}</Command>",
            f"      <Arguments>{escape(arguments)}</Arguments>",
            f"      <WorkingDirectory>{escape(_workdir(launch, 'windows'))}</WorkingDirectory>",
            "    </Exec>",
            "  </Actions>",
            "</Task>",
            "",
        ]
    )


STOP_WAIT_S = 150  # the trainers' --grace_period (120 s by default) and the servers' stop after it


def _stop_file(launch: Launch) -> str:
    """The stop file in the task's working directory (protocol/notes.py), a Windows path."""
    return ntpath.join(_workdir(launch, "windows"), notes.STOP_FILE)


def task_command(launch: Launch) -> str:
    """The task's command: cmd runs the .cmd by its quoted path. /s takes the outer quotes off
    whatever the path holds (& ( ) ^ spaces); /d skips AutoRun commands; /v:off keeps `!` literal."""
    return f'cmd.exe /d /v:off /s /c ""{script_path(launch, "windows")}""'


def schtasks_lines(launch: Launch, at_boot: AtBoot) -> tuple[list[str], list[str]]:
    """For an Administrator cmd: the lines that register the task from its XML file and start it
    now, and the ones that end and delete it. Each value is one argument of schtasks' command line
    (quote.cmd); none holds `%`, which an interactive cmd, unlike a batch file, cannot escape."""
    command = task_command(launch)
    if len(command) > SCHTASKS_TR_MAX:
        raise ScriptError(
            problem(
                f"hosts.{launch.host}.workdir",
                launch.settings.workdir,
                f"the task's command is {len(command)} characters, and a task's command line takes "
                f"{SCHTASKS_TR_MAX}",
                "choose a shorter folder",
                PATH_SHOWN_MAX,
            )
        )
    user = _run_as(launch, at_boot)
    # SYSTEM: whether anyone is logged on or not, without a password; a user: schtasks asks for it.
    run_as = ["/RU", user] if user == accounts.SYSTEM["windows"] else ["/RU", user, "/RP", "*"]
    task = name(launch)
    create = ["schtasks", "/Create", "/TN", task, "/XML", task_path(launch), *run_as, "/F"]
    return (
        [" ".join(quote.cmd(a) for a in create), f"schtasks /Run /TN {quote.cmd(task)}"],
        [
            # The job stopped as a SIGTERM stops it (the trainers save), given its grace period
            # to end by itself; /End then ends whatever is left at once.
            f"type nul > {quote.cmd(_stop_file(launch))}",
            f"timeout /t {STOP_WAIT_S} /nobreak",
            f"schtasks /End /TN {quote.cmd(task)}",
            f"schtasks /Delete /TN {quote.cmd(task)} /F",
        ],
    )
