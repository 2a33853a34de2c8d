"""What each machine of a cluster runs, for its launch script: one `od-dist train` command per
machine (a `Launch`: its tasks, its hosts settings, the arguments), every value checked before any
script is written: one line a shell can carry, and paths a Windows machine can read."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from od_dist.cluster import commandline
from od_dist.cluster.messages import PATH_SHOWN_MAX, problem
from od_dist.cluster.spec import Cluster, HostSettings, Task
from od_dist.render import quote
from od_dist.render.quote import QuoteError

ScriptError = QuoteError  # a value no launch script can carry; the message names it and the fix


def _check(value: str, what: str) -> str:
    return quote.check(value, what)


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
