"""Start at boot (`od-dist scripts --at_boot`): what starts each machine's launch script when the
machine starts, without a person. Linux: a systemd system service, a unit file written beside the
scripts; Windows: a Task Scheduler task at startup, the `schtasks` lines of the scripts' README
(render/readme.py). Both run the script from the machine's working directory (its hosts `workdir`,
absolute), where it is copied. No TensorFlow here.

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

from od_dist.cluster.messages import PATH_SHOWN_MAX, problem
from od_dist.protocol import exit_codes
from od_dist.render import quote
from od_dist.render.machines import Launch, ScriptError

RESTART_SEC = 5  # short: od-dist's own supervisor has already backed off before it exits
STOP_MARGIN_S = 30  # after --grace_period: the supervisor's own exit once its tasks saved
# Every exit status but 0 and the retryable ones: the table's "any other code is permanent" (a 139,
# a crash, included), which Restart=on-failure would otherwise restart every RESTART_SEC.
PERMANENT = tuple(c for c in range(1, 256) if c not in exit_codes.RETRYABLE)
SCHTASKS_TR_MAX = 261  # schtasks refuses a longer /TR
LINUX_USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*|[0-9]+")  # a name or a uid, as systemd's User= takes


@dataclass(frozen=True)
class AtBoot:
    user: str | None = None  # systemd's User=, schtasks' /RU; None: root, SYSTEM
    grace_period: int = 120  # the trainers' time to save after SIGTERM: systemd waits longer


def name(launch: Launch) -> str:
    """The systemd unit's name (without .service) and the scheduled task's."""
    return f"od-dist-{launch.stem}"


def unit_file(launch: Launch) -> str:
    return f"{name(launch)}.service"


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
    user = []
    if at_boot.user:
        if not LINUX_USER.fullmatch(at_boot.user):
            raise ScriptError(
                problem(
                    "--at_boot_user",
                    at_boot.user,
                    "not a Linux user name",
                    "give one such as od-dist or 1000",
                )
            )
        user = [f"User={at_boot.user}"]
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
            *user,
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


def task_command(launch: Launch) -> str:
    """The task's command: cmd runs the .cmd by its quoted path. /s takes the outer quotes off
    whatever the path holds (& ( ) ^ spaces); /d skips AutoRun commands; /v:off keeps `!` literal."""
    return f'cmd.exe /d /v:off /s /c ""{script_path(launch, "windows")}""'


def schtasks_lines(launch: Launch, at_boot: AtBoot) -> tuple[list[str], list[str]]:
    """For an Administrator cmd: the lines that create the task and start it now, and the one that
    deletes it. Each value is one argument of schtasks' command line (quote.cmd); none holds `%`,
    which an interactive cmd, unlike a batch file, cannot escape."""
    command = task_command(launch)
    if len(command) > SCHTASKS_TR_MAX:
        raise ScriptError(
            problem(
                f"hosts.{launch.host}.workdir",
                launch.settings.workdir,
                f"the task's command is {len(command)} characters, and schtasks takes {SCHTASKS_TR_MAX}",
                "choose a shorter folder",
                PATH_SHOWN_MAX,
            )
        )
    if at_boot.user is None:
        run_as = ["/RU", "SYSTEM"]  # whether anyone is logged on or not, without a password
    elif "%" in at_boot.user:
        raise ScriptError(problem("--at_boot_user", at_boot.user, "contains '%'", "give the user's name"))
    else:
        run_as = ["/RU", at_boot.user, "/RP", "*"]  # asks for the password: the task runs logged off
    task = name(launch)
    create = ["schtasks", "/Create", "/TN", task, "/SC", "ONSTART", *run_as, "/TR", command, "/F"]
    return (
        [" ".join(quote.cmd(a) for a in create), f"schtasks /Run /TN {quote.cmd(task)}"],
        [f"schtasks /Delete /TN {quote.cmd(task)} /F"],
    )
