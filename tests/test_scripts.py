"""`od-dist scripts`: every value reaches `od-dist train` intact in every shell.

- bash: every generated .sh passes `bash -n` and is run for real with a recording stand-in for
  od-dist (on PATH, in a venv, or as `python -m od_dist`) in directories full of special characters.
- cmd: the .cmd files run for real under Wine (slow; skipped without wine/mingw-w64). The
  stand-in is a small C program that records GetCommandLineW(), which mslex then splits by the
  Windows C-runtime rules: exactly what a Windows od-dist.exe would see. (A batch stand-in such as
  `echo %*> file` would itself lose a trailing `1` to the `1>` redirection.) A fast emulation of
  cmd's batch-line parsing checks the same lines without Wine.
- PowerShell is not installable here: the .ps1 quoting is checked by emulating PowerShell's
  single-quoted-string rules, and the command line the script hands to Process.Start is split by
  mslex, as for cmd.
"""

import dataclasses
import os
import pathlib
import re
import shutil
import stat
import subprocess
import time

import mslex
import powershell
import pytest
import yaml
from loopback import ROOT, od_dist

from od_dist.cli.flags import LAUNCH_MAX_RESTARTS
from od_dist.cluster import spec as cluster_mod
from od_dist.protocol import notes
from od_dist.render import machines, quote, readme, scripts

LAN = os.path.join(ROOT, "clusters", "lan-example.yaml")

MODEL_DIR = "runs/a b&c%PATH%^!\"'é"
DIR_WEIRD = "a b&c%PATH%^!'é(1) ;,="  # for directory names: Windows forbids '"' in them
CLUSTER_PATH = "clusters/c l&u%s^t!e'r é.yaml"
# Values that break naive quoting in at least one shell.
VALUES = [
    MODEL_DIR,
    "",
    " ",
    "plain",
    "trailing\\",
    "trailing space\\",
    'quote"inside',
    'back\\"slash',
    "\\\\server\\share\\x y",
    "\\\\server\\share\\",
    "C:\\",
    "C:\\Program Files (x86)\\od dist\\",
    "C:\\a&b\\%PATH%\\c^d!e\\x y.yaml",
    "//server/share/x y",
    "%PATH%",
    "%%",
    "%~dp0",
    "%1",
    "^",
    "^^",
    "x^",
    "!PATH!",
    "a&b|c<d>e(f)",
    "it's",
    "\u2018smart\u2019 \u201alow\u201b",
    "$HOME `id` $(id) ${x} \\$",
    "nbsp\u00a0x",
    "日本語",
    "emoji \U0001f389",
    "-",
    "2>&1",
    "x 1",
]
PASSED = [
    "--pipeline=pipelines/p q.yaml",
    f"--model_dir={MODEL_DIR}",
    "--params_override=trainer.train_steps=2000; x: '%~dp0' \"q\"",
    "--num_clones=2",
    "--noclone_on_cpu",
    "--model_dir=\\\\server\\share\\runs\\a b\\",  # Windows forms: a share, a drive, a trailing \\
    "--pipeline=C:\\od dist (x86)\\p&q%PATH%.yaml",
    *VALUES,
    "--wait_timeout=301",
]  # ends in a 1, as `echo %*> file` would show


# ----- emulations of the shells' own rules ------------------------------------------------------


def cmd_batch_line(line, env=None):
    """cmd's processing of one batch-file line, delayed expansion off: phase 1 (`%%` -> `%`,
    `%NAME%` -> its value), then phase 2 (`"` toggles the quoted state; outside it `^` escapes the
    next character and an unescaped & | < > is a command separator, reported as an error)."""
    env = env or {"PATH": "C:\\Windows"}
    out, i = [], 0
    while i < len(line):
        if line[i] == "%":
            if line[i + 1 : i + 2] == "%":
                out.append("%")
                i += 2
                continue
            end = line.find("%", i + 1)
            if end > i + 1 and line[i + 1 : end] in env:
                out.append(env[line[i + 1 : end]])
                i = end + 1
                continue
            if line[i + 1 : i + 2].isdigit() or line[i + 1 : i + 2] in ("~", "*"):
                i += 2  # a batch parameter: empty here
                continue
        out.append(line[i])
        i += 1
    text, result, quoted, i = "".join(out), [], False, 0
    while i < len(text):
        c = text[i]
        if c == '"':
            quoted = not quoted
        elif not quoted and c == "^":
            i += 1
            c = text[i] if i < len(text) else ""
        elif not quoted and c in "&|<>":
            raise ValueError(f"unescaped {c!r} at {i}: cmd would split the command here")
        result.append(c)
        i += 1
    return "".join(result)


# ----- quoting functions ----------------------------------------------------------------------


def test_bash_quote_round_trip():
    words = " ".join(scripts.bash_quote(v) for v in VALUES)
    r = subprocess.run(["bash", "-c", f"printf '%s\\0' {words}"], capture_output=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().split("\0")[:-1] == VALUES


def test_windows_command_line_round_trip():
    assert mslex.split(scripts.windows_command_line(VALUES), like_cmd=False) == VALUES
    assert scripts.windows_arg("plain") == "plain"  # no quotes where none are needed
    assert scripts.windows_arg("a b\\") == '"a b\\\\"'  # a trailing backslash must not eat the quote


def test_cmd_escape_survives_batch_parsing():
    for v in VALUES:
        line = scripts.cmd_escape(scripts.windows_arg(v))
        assert mslex.split(cmd_batch_line(line), like_cmd=False) == [v], (v, line)
    line = scripts.cmd_args(VALUES)
    assert mslex.split(cmd_batch_line(line), like_cmd=False) == VALUES
    # The emulation is strict: plain CRT quoting, as written by hand, does not survive cmd.
    with pytest.raises(ValueError):
        cmd_batch_line(scripts.windows_arg('a"b&c'))
    assert mslex.split(cmd_batch_line(scripts.windows_arg("%PATH%")), like_cmd=False) != ["%PATH%"]


def test_ps_quote_round_trip():
    for v in VALUES:
        assert powershell.unquote(scripts.ps_quote(v)) == (v, ""), v
    # Doubling only the ASCII quote is not enough: PowerShell also ends strings on ’ and friends.
    naive = "'" + "it\u2019s".replace("'", "''") + "'"
    assert powershell.unquote(naive) != ("it\u2019s", "")


# ----- the generated scripts ------------------------------------------------------------------


def win(path):
    """A Linux path as Wine's Z: drive shows it."""
    return "Z:" + str(path).replace("/", "\\")


def make_tree(base):
    """Directories with special characters, holding stand-ins: a venv, an interpreter, a workdir."""
    tree = {
        "venv": base / f"v {DIR_WEIRD}",
        "py": base / f"p {DIR_WEIRD}",
        "work": base / f"w {DIR_WEIRD}",
        "bin": base / "bin",
        "run": base / "run",
    }
    for d in tree.values():
        d.mkdir(parents=True, exist_ok=True)
    return tree


def make_cluster(tree):
    """Linux and Windows machines with every kind of settings; 10.0.0.2 (Linux) and 10.0.0.5
    (Windows) hold a ps and a worker each: one script, one `od-dist train` without --role."""
    doc = {
        "strategy": "parameter_server",
        "ps": ["10.0.0.1:2222", "10.0.0.2:2223", "10.0.0.5:2223"],
        "worker": ["10.0.0.2:2222", "10.0.0.3:2222", "10.0.0.5:2222"],
        "master": "10.0.0.4:2222",
        "evaluator": "10.0.0.6",
        "hosts": {
            "10.0.0.1": {"os": "linux", "venv": str(tree["venv"]), "workdir": str(tree["work"])},
            "10.0.0.2": {"os": "linux", "python": str(tree["py"] / "python"), "workdir": str(tree["work"])},
            "10.0.0.3": {"os": "linux"},
            "10.0.0.4": {"os": "windows", "venv": win(tree["venv"]), "workdir": win(tree["work"])},
            "10.0.0.5": {
                "os": "windows",
                "python": win(tree["py"] / "python.exe"),
                "workdir": win(tree["work"]),
            },
            "10.0.0.6": {"os": "windows"},
        },
    }
    return cluster_mod.from_document(doc)


SH_STAND_IN = """\
#!/usr/bin/env bash
printf '%s\\0' "$(pwd)" "${VIRTUAL_ENV-<unset>}" "${PYTHONHOME-<unset>}" "$@" > "$OD_DIST_RECORD"
exit "${OD_DIST_RECORD_EXIT:-0}"
"""


def install_sh(path):
    path.write_text(SH_STAND_IN)
    path.chmod(0o755)


def train_head(launch):
    """The start of a machine's `train` command: its one task's --role/--index, else no role at all
    (od-dist starts every entry of the machine)."""
    (task, *more) = launch.tasks
    where = [] if more else [f"--role={task.role}", f"--index={task.index}"]
    return ["train", f"--cluster={launch.cluster_path}", *where, *PASSED][:4]


def test_sh_scripts_pass_exact_arguments(tmp_path):
    tree = make_tree(tmp_path)
    (tree["venv"] / "bin").mkdir()
    install_sh(tree["venv"] / "bin" / "od-dist")
    install_sh(tree["py"] / "python")
    install_sh(tree["bin"] / "od-dist")
    cluster = make_cluster(tree)
    out = tmp_path / "out"
    scripts.write_scripts(cluster, CLUSTER_PATH, PASSED, str(out), "od-dist scripts ...", 300)
    linux = [x for x in machines.launches(cluster, CLUSTER_PATH, PASSED) if not x.windows]
    assert len(linux) == 3
    record = tmp_path / "record"
    env = dict(
        os.environ,
        PATH=f"{tree['bin']}:{os.environ['PATH']}",
        OD_DIST_RECORD=str(record),
        OD_DIST_RECORD_EXIT="7",
        PYTHONHOME="/bogus",
    )
    for launch in linux:
        path = out / f"{launch.stem}.sh"
        assert os.stat(path).st_mode & stat.S_IXUSR
        r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        record.unlink(missing_ok=True)
        r = subprocess.run(["bash", str(path)], env=env, cwd=tree["run"], capture_output=True, timeout=30)
        assert r.returncode == 7, r.stderr  # od-dist's exit status is the script's
        cwd, venv, pythonhome, *args = record.read_bytes().decode().split("\0")[:-1]
        assert args == list(launch.args), launch.stem
        assert args[args.index("train") :][:4] == train_head(launch)
        assert cwd == str(launch.settings.workdir or tree["run"])
        if launch.settings.venv:
            assert (venv, pythonhome) == (launch.settings.venv, "<unset>")


def test_ps1_scripts(tmp_path):
    tree = make_tree(tmp_path)
    cluster = make_cluster(tree)
    out = tmp_path / "out"
    scripts.write_scripts(cluster, CLUSTER_PATH, PASSED, str(out), "od-dist scripts ...", 300)
    windows = [x for x in machines.launches(cluster, CLUSTER_PATH, PASSED) if x.windows]
    assert len(windows) == 3
    for launch in windows:
        raw = (out / f"{launch.stem}.ps1").read_bytes()
        assert raw.startswith(b"\xef\xbb\xbf")  # Windows PowerShell 5.1 reads BOM-less files as ANSI
        text = raw[3:].decode("utf-8")
        assert "\n" not in text.replace("\r\n", "")
        values = {}
        for line in text.split("\r\n"):
            for prefix in (
                "$arguments = ",
                "Set-Location -LiteralPath ",
                "$env:VIRTUAL_ENV = ",
                "$exe = [System.IO.Path]::Combine($PWD.ProviderPath, ",
            ):
                if line.startswith(prefix):
                    value, rest = powershell.unquote(line[len(prefix) :])
                    assert rest in ("", ")"), line
                    values[prefix.split()[0]] = value
        assert mslex.split(values["$arguments"], like_cmd=False) == list(launch.args)
        assert values.get("Set-Location") == launch.settings.workdir
        assert values.get("$env:VIRTUAL_ENV") == launch.settings.venv
        if launch.program == "od-dist":
            assert (
                "Get-Command -Name ([System.Management.Automation.WildcardPattern]::Escape('od-dist')) "
                "-CommandType Application"
            ) in text
        else:
            assert values["$exe"] == launch.program
        assert "$start.WorkingDirectory = $PWD.ProviderPath" in text


def test_cmd_scripts_survive_batch_parsing(tmp_path):
    """The fast check of the .cmd files; the real one runs them under Wine (test_cmd_under_wine)."""
    tree = make_tree(tmp_path)
    cluster = make_cluster(tree)
    for launch in machines.launches(cluster, CLUSTER_PATH, PASSED):
        if not launch.windows:
            continue
        text = scripts.render_cmd(launch)
        lines = text.split("\r\n")
        assert lines[0] == "@echo off" and "setlocal EnableExtensions DisableDelayedExpansion" in lines
        assert lines.index("chcp 65001 >nul 2>&1") < min(i for i, x in enumerate(lines) if not x.isascii())
        # call would expand % a second time (`(call )` only clears ERRORLEVEL); the one `call` puts the
        # script's own path into a search-and-replace of cmd's command line, never a value of the job
        assert [x for x in lines if x.lower().startswith("call ")] == [
            'call set "OD_DIST_REST=%%OD_DIST_LINE:%OD_DIST_SELF%=%%"'
        ]
        (run,) = [x for x in lines if " train " in x and not x.startswith("rem")]
        parsed = mslex.split(cmd_batch_line(run), like_cmd=False)
        assert parsed[0] == launch.program and parsed[1:] == list(launch.args)


def test_values_a_script_cannot_carry():
    cluster = cluster_mod.load(LAN)
    with pytest.raises(scripts.ScriptError, match="control character"):
        machines.launches(cluster, "c.yaml", ["--model_dir=a\nb"])
    with pytest.raises(scripts.ScriptError):
        scripts.cmd_path('C:\\a"b')


# ----- Wine -----------------------------------------------------------------------------------

STAND_IN_C = r"""
/* Stand-in for od-dist.exe / python.exe: appends its command line, working directory and
   VIRTUAL_ENV (UTF-16LE, one per line) to the file named by OD_DIST_RECORD and exits with
   OD_DIST_RECORD_EXIT. */
#include <windows.h>
#include <wchar.h>
static void put(HANDLE h, const wchar_t *s) {
    DWORD w;
    WriteFile(h, s, (DWORD)(wcslen(s) * sizeof(wchar_t)), &w, NULL);
    WriteFile(h, L"\n", sizeof(wchar_t), &w, NULL);
}
int wmain(void) {
    static wchar_t path[32768], buf[32768];
    if (!GetEnvironmentVariableW(L"OD_DIST_RECORD", path, 32768)) return 3;
    HANDLE h = CreateFileW(path, FILE_APPEND_DATA, 0, NULL, OPEN_ALWAYS, FILE_ATTRIBUTE_NORMAL, NULL);
    if (h == INVALID_HANDLE_VALUE) return 4;
    put(h, GetCommandLineW());
    GetCurrentDirectoryW(32768, buf);
    put(h, buf);
    if (!GetEnvironmentVariableW(L"VIRTUAL_ENV", buf, 32768)) buf[0] = 0;
    put(h, buf);
    CloseHandle(h);
    if (GetEnvironmentVariableW(L"OD_DIST_RECORD_EXIT", buf, 32768)) return _wtoi(buf);
    return 0;
}
"""


class Wine:
    def __init__(self, base):
        self.base = base
        self.stand_in = base / "stand-in.exe"
        locales = base / "locales"
        locales.mkdir()
        # Wine's cmd decodes batch lines with the OEM code page and ignores chcp; a Unicode-only
        # locale (hi_IN) makes that UTF-8, which is what `chcp 65001` does on Windows 10 and later.
        self.env = dict(
            os.environ,
            WINEDEBUG="-all",
            WINEPREFIX=str(base / "prefix"),
            WINEDLLOVERRIDES="mscoree,mshtml=",
            LOCPATH=str(locales),
            LC_ALL="hi_IN.UTF-8",
        )
        for cmd in (
            ["x86_64-w64-mingw32-gcc", "-municode", "-O1", "-s", "-o", str(self.stand_in), str(base / "s.c")],
            ["localedef", "-i", "hi_IN", "-f", "UTF-8", str(locales / "hi_IN.UTF-8")],
        ):
            if cmd[0] == "x86_64-w64-mingw32-gcc":
                (base / "s.c").write_text(STAND_IN_C)
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                pytest.skip(f"{cmd[0]} failed: {r.stderr.strip()[-300:]}")
        r = self.run_cmd(["/c", "exit", "0"], timeout=180)  # makes the prefix (several seconds, once)
        if r.returncode != 0:
            pytest.skip(f"wine does not run cmd here: {r.stderr[-300:]!r}")

    def run_cmd(self, args, env=None, cwd=None, timeout=120):
        return subprocess.run(
            ["wine", "cmd", *args],
            env=dict(self.env, **(env or {})),
            cwd=cwd,
            capture_output=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    def close(self):
        subprocess.run(["wineserver", "-k"], env=self.env, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def wine(tmp_path_factory):
    missing = [
        t for t in ("wine", "wineserver", "x86_64-w64-mingw32-gcc", "localedef") if not shutil.which(t)
    ]
    if missing:
        pytest.skip(
            f"needs {', '.join(missing)}: apt-get install -y --no-install-recommends wine wine64 "
            "gcc-mingw-w64-x86-64-win32 locales"
        )
    w = Wine(tmp_path_factory.mktemp("wine"))
    yield w
    w.close()


def run_cmd_script(wine, script, tree, record, exit_code="0"):
    record.unlink(missing_ok=True)
    # /v:on: as on a machine whose registry turns delayed expansion on; the script must turn it off.
    r = wine.run_cmd(
        ["/v:on", "/c", win(script)],
        env={"WINEPATH": win(tree["bin"]), "OD_DIST_RECORD": win(record), "OD_DIST_RECORD_EXIT": exit_code},
        cwd=tree["run"],
    )
    assert record.exists(), (r.stdout, r.stderr)
    line, cwd, venv = record.read_bytes().decode("utf-16-le").split("\n")[:3]
    return r, mslex.split(line, like_cmd=False), cwd, venv


@pytest.mark.slow
def test_cmd_under_wine(wine, tmp_path):
    tree = make_tree(tmp_path)
    (tree["venv"] / "Scripts").mkdir()
    shutil.copy(wine.stand_in, tree["venv"] / "Scripts" / "od-dist.exe")
    shutil.copy(wine.stand_in, tree["py"] / "python.exe")
    shutil.copy(wine.stand_in, tree["bin"] / "od-dist.exe")
    cluster = make_cluster(tree)
    out = tmp_path / "out"
    scripts.write_scripts(cluster, CLUSTER_PATH, PASSED, str(out), "od-dist scripts ...", 300)
    windows = [x for x in machines.launches(cluster, CLUSTER_PATH, PASSED) if x.windows]
    assert {bool(x.settings.venv) for x in windows} == {True, False} and any(
        x.settings.python for x in windows
    )
    for launch in windows:
        r, argv, cwd, venv = run_cmd_script(wine, out / f"{launch.stem}.cmd", tree, tmp_path / "record", "7")
        assert argv[1:] == list(launch.args), launch.stem
        assert r.returncode == 7  # od-dist's exit status is the script's
        assert cwd.rstrip("\\") == (launch.settings.workdir or win(tree["run"]))
        assert venv == (launch.settings.venv or "")


@pytest.mark.slow
def test_wine_harness_catches_broken_quoting(wine, tmp_path, monkeypatch):
    """The Wine check is not vacuous: the same script with `%` left single fails it."""
    tree = make_tree(tmp_path)
    shutil.copy(wine.stand_in, tree["bin"] / "od-dist.exe")
    cluster = make_cluster(tree)
    (launch,) = [
        x for x in machines.launches(cluster, CLUSTER_PATH, PASSED) if x.tasks[0].role == "evaluator"
    ]
    real = quote.cmd_escape
    monkeypatch.setattr(quote, "cmd_escape", lambda text: real(text).replace("%%", "%"))
    (tmp_path / "broken.cmd").write_bytes(scripts.render_cmd(launch).encode())
    r, argv, _, _ = run_cmd_script(wine, tmp_path / "broken.cmd", tree, tmp_path / "record")
    assert argv[1:] != list(launch.args)


# How Windows starts a .cmd: from a console, cmd runs it in the console's own process, whose command
# line (%CMDCMDLINE%) does not name it; a double-click (Explorer's ShellExecute) runs
# `cmd.exe /c ""<full path>" "`; a program that starts the file with its own command line
# (PowerShell, Task Scheduler) `cmd.exe /c "<full path>"`, OpenSSH's server `cmd.exe /c <path>`.
# Wine's cmd has no CMDCMDLINE of its own; an environment variable of that name stands in for it, as
# it overrides the dynamic one on Windows.
CONSOLE = '"C:\\WINDOWS\\system32\\cmd.exe"'
PAUSED = "Press a key to close this window."


def double_click(script):
    return f'C:\\WINDOWS\\system32\\cmd.exe /c ""{win(script)}" "'


def started_by_a_program(script):
    return f'C:\\WINDOWS\\system32\\cmd.exe /c "{win(script)}"'


def started_over_ssh(script):
    return f'"c:\\windows\\system32\\cmd.exe" /c {win(script)}'


def start_cmd_script(wine, script, tree, record, cmdcmdline, exit_code, out):
    """The script under Wine with its input open (a `pause` waits for it) and its output in `out`."""
    env = {"WINEPATH": win(tree["bin"]), "OD_DIST_RECORD": win(record), "OD_DIST_RECORD_EXIT": exit_code}
    if cmdcmdline is not None:
        env["CMDCMDLINE"] = cmdcmdline
    with open(out, "wb") as f:
        return subprocess.Popen(  # by its name in its folder: Wine's cmd /c splits a path at `&`
            ["wine", "cmd", "/c", script.name],
            env=dict(wine.env, **env),
            cwd=script.parent,
            stdin=subprocess.PIPE,
            stdout=f,
            stderr=subprocess.STDOUT,
        )


@pytest.mark.slow
def test_a_double_clicked_cmd_keeps_its_window_open_after_a_failure(wine, tmp_path):
    """Started from a console, or by a program (PowerShell, Task Scheduler, OpenSSH's server: no person
    may be there to press a key), the .cmd returns at once whatever the exit; started by a
    double-click, it returns at once after success and waits for a key after a failure (od-dist's or
    its own), so the window, which closes with it, still shows the last line. Its own path holds
    characters that cmd would parse (the check reads cmd's command line inside quotes)."""
    tree = make_tree(tmp_path)
    shutil.copy(wine.stand_in, tree["bin"] / "od-dist.exe")
    cluster = make_cluster(tree)
    (launch,) = [
        x for x in machines.launches(cluster, CLUSTER_PATH, PASSED) if x.tasks[0].role == "evaluator"
    ]
    folder = tmp_path / "s a&b(1) !x 'é;,="
    folder.mkdir()
    script = folder / f"{launch.stem}.cmd"
    script.write_bytes(scripts.render_cmd(launch).encode())
    gone = dataclasses.replace(
        launch, settings=dataclasses.replace(launch.settings, workdir=win(tmp_path / "gone"))
    )
    lost = folder / "lost.cmd"
    lost.write_bytes(scripts.render_cmd(gone).encode())
    record, out = tmp_path / "record", tmp_path / "out"
    for cmdcmdline, code in [
        (None, "7"),
        (CONSOLE, "7"),
        (started_by_a_program(script), "7"),
        (started_over_ssh(script), "7"),
        (double_click(script), "0"),
    ]:
        proc = start_cmd_script(wine, script, tree, record, cmdcmdline, code, out)
        try:
            assert proc.wait(timeout=60) == int(code), out.read_bytes()  # at once, its input still open
        finally:
            proc.kill()
        assert PAUSED.encode() not in out.read_bytes()
    for started, code in [(script, "7"), (lost, "0")]:
        record.unlink(missing_ok=True)
        proc = start_cmd_script(wine, started, tree, record, double_click(started), code, out)
        try:
            deadline = time.monotonic() + 60
            while (
                PAUSED.encode() not in out.read_bytes()
                and proc.poll() is None
                and time.monotonic() < deadline
            ):
                time.sleep(0.2)
            text = out.read_bytes().decode("utf-8", "replace")
            assert (
                f"od-dist: exit status {7 if started == script else 1}, see the lines above. {PAUSED}" in text
            )
            with pytest.raises(subprocess.TimeoutExpired):  # it waits for the key
                proc.wait(timeout=2)
            proc.stdin.write(b"\r\n")
            proc.stdin.close()
            assert proc.wait(timeout=60) == (7 if started == script else 1)
        finally:
            proc.kill()
        assert record.exists() == (started == script)  # od-dist never ran where the folder is missing
    assert "cannot change to the working directory" in text


@pytest.mark.slow
def test_one_script_per_machine_with_a_ps_on_each_windows_worker_machine(wine, tmp_path):
    """parameter_server on 3 machines, a ps and a worker on each of the two Windows ones: one .cmd
    and one .ps1 per Windows machine, each running the one `od-dist train` of its machine (no
    --role: od-dist starts both entries there); a README row per machine."""
    tree = make_tree(tmp_path)
    (tree["venv"] / "Scripts").mkdir()
    shutil.copy(wine.stand_in, tree["venv"] / "Scripts" / "od-dist.exe")
    shutil.copy(wine.stand_in, tree["bin"] / "od-dist.exe")
    doc = {
        "master": "10.0.0.1:2222",
        "worker": ["10.0.0.2:2222", "10.0.0.3:2222"],
        "ps": ["10.0.0.2:2223", "10.0.0.3:2223"],
        "hosts": {
            "10.0.0.1": {"os": "linux"},
            "10.0.0.2": {"os": "windows", "venv": win(tree["venv"]), "workdir": win(tree["work"])},
            "10.0.0.3": {"os": "windows"},
        },
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(doc, allow_unicode=True), encoding="utf-8")
    flags = ["--pipeline=C:\\od dist\\p.yaml", "--model_dir=\\\\server\\share\\runs\\a b\\", "--num_clones=2"]
    r = od_dist("scripts", "--cluster=c.yaml", *flags, "--out=out", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out"
    assert sorted(os.listdir(out)) == [
        scripts.MANIFEST,
        "README.md",
        "master-0.sh",
        "ps-0_worker-0.cmd",
        "ps-0_worker-0.ps1",
        "ps-1_worker-1.cmd",
        "ps-1_worker-1.ps1",
    ]
    one = ["train", "--cluster=c.yaml", *flags, "--max_restarts=3"]
    record = tmp_path / "record"
    for stem, workdir in (("ps-0_worker-0", win(tree["work"])), ("ps-1_worker-1", win(tree["run"]))):
        r, argv, cwd, _ = run_cmd_script(wine, out / f"{stem}.cmd", tree, record)
        assert r.returncode == 0 and argv[1:] == one, stem
        assert cwd.rstrip("\\") == workdir
        assert len(record.read_bytes().decode("utf-16-le").split("\n")) == 4  # one command: 3 lines + ""
        (line,) = [
            x
            for x in (out / f"{stem}.ps1").read_bytes().decode("utf-8-sig").split("\r\n")
            if x.startswith("$arguments = ")
        ]
        assert mslex.split(powershell.unquote(line[len("$arguments = ") :])[0], like_cmd=False) == one
    readme = (out / "README.md").read_text()
    rows = [x for x in readme.split("\n") if x.startswith("| 10.0.0.")]
    assert rows == [
        f"| 10.0.0.2 | windows | ps 0 and worker 0 | `ps-0_worker-0.cmd` or `powershell -ExecutionPolicy Bypass "
        f"-File ps-0_worker-0.ps1` | 2223, 2222 | `{win(tree['work'])}` | venv `{win(tree['venv'])}` |",
        "| 10.0.0.3 | windows | ps 1 and worker 1 | `ps-1_worker-1.cmd` or `powershell -ExecutionPolicy Bypass "
        "-File ps-1_worker-1.ps1` | 2223, 2222 | where you run it | `od-dist` on PATH |",
        "| 10.0.0.1 | linux | master 0 | `bash master-0.sh` | 2222 | where you run it | `od-dist` on PATH |",
    ]
    machine = readme.split("### 10.0.0.2 (ps 0 and worker 0): ports 2223, 2222")[1].split("###")[0]
    assert "- TCP port 2223 (ps 0) from 10.0.0.1, 10.0.0.3 (master:0, worker:1)." in machine
    assert "- TCP port 2222 (worker 0) from 10.0.0.1 (master:0)." in machine  # its ps is local
    assert machine.count("New-NetFirewallRule") == 2 and machine.count("netsh") == 2
    assert "sudo" not in machine


def test_absolute_linux_paths_for_a_windows_machine_are_refused(tmp_path):
    """The cluster file, pipeline and model_dir of a Windows machine (and its hosts paths) must not be
    absolute Linux paths: one line naming the machine, exit 2, nothing written."""
    (tmp_path / "clusters").mkdir()
    shutil.copy(LAN, tmp_path / "clusters")  # its master, 192.168.1.108, runs Windows
    base = ["scripts", "--pipeline=pipelines/p.yaml", "--model_dir=runs/lan", "--out=out"]
    for args, flag in [
        ([f"--cluster={tmp_path / 'clusters' / 'lan-example.yaml'}"], "--cluster"),
        (["--cluster=clusters/lan-example.yaml", "--model_dir=/srv/runs"], "--model_dir"),
        (["--cluster=clusters/lan-example.yaml", "--pipeline=/srv/p.yaml"], "--pipeline"),
    ]:
        r = od_dist(*base, *args, cwd=tmp_path)
        assert r.returncode == 2, r.stdout + r.stderr
        (line,) = r.stderr.splitlines()
        assert line.startswith(f"od-dist scripts: {flag}: '/"), line
        assert (
            "': an absolute Linux path, and 192.168.1.108 (master 0) runs Windows; pass a path relative "
            in line
        )
        assert not (tmp_path / "out").exists()
    doc = cluster_mod.from_document(
        {
            "master": "10.0.0.1:2222",
            "worker": ["10.0.0.2:2222"],
            "hosts": {"10.0.0.1": {"os": "windows", "workdir": "/opt/od"}},
        }
    )
    with pytest.raises(
        scripts.ScriptError,
        match=r"hosts.10.0.0.1.workdir: '/opt/od': an absolute Linux path, and 10.0.0.1 \(master 0\) runs Windows; write it as a Windows path",
    ):
        machines.launches(doc, "c.yaml", [])
    # Windows forms, and a share written with slashes, are taken.
    for model_dir in ("C:\\runs", "\\\\server\\share\\runs", "//server/share/runs", "runs/lan"):
        (launch,) = [
            x
            for x in machines.launches(cluster_mod.load(LAN), "c.yaml", [f"--model_dir={model_dir}"])
            if x.windows
        ]
        assert f"--model_dir={model_dir}" in launch.args


# ----- README, firewall, CLI ------------------------------------------------------------------


def rules_of(cluster):
    return {
        r.task.name + (f" {r.what}" if r.what else ""): (r.port, r.sources)
        for r in readme.inbound_rules(cluster)
    }


def test_firewall_rules():
    lan = cluster_mod.load(LAN)
    assert rules_of(lan) == {
        "ps:0": (2224, ("192.168.1.108", "192.168.1.109", "192.168.1.111")),
        "worker:0": (2222, ("192.168.1.108",)),
        "worker:1": (2222, ("192.168.1.108",)),
        # the servers probe the master's port to stop when it is gone for good, the evaluator to
        # know training is alive
        "master:0": (2223, ("192.168.1.116", "192.168.1.109", "192.168.1.111", "192.168.1.120")),
        # the evaluator fetches the master's checkpoints from its checkpoint_port
        "master:0 checkpoints": (2225, ("192.168.1.120",)),
    }  # the evaluator runs no server
    mwms = cluster_mod.from_document(
        {"master": "10.0.0.1:2222", "worker": ["10.0.0.2:2222", "10.0.0.1:2223"], "evaluator": "10.0.0.3"}
    )
    assert rules_of(mwms) == {
        "master:0": (2222, ("10.0.0.2", "10.0.0.3")),  # its peer on the same host needs no rule
        "worker:0": (2222, ("10.0.0.1",)),
        "worker:1": (2223, ("10.0.0.2",)),
    }
    # No master: the evaluator probes worker 0, TensorFlow's chief, and gets its port.
    chiefless = cluster_mod.from_document(
        {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"], "evaluator": "10.0.0.3"}
    )
    assert chiefless.lead_task().name == "worker:0"
    assert rules_of(chiefless) == {
        "worker:0": (2222, ("10.0.0.2", "10.0.0.3")),
        "worker:1": (2222, ("10.0.0.1",)),
    }
    (ps_rule,) = [r for r in readme.inbound_rules(lan) if r.task.role == "ps"]
    win_lines = readme.firewall_lines(ps_rule, "windows")
    assert win_lines[0].startswith(
        "New-NetFirewallRule -DisplayName 'od-dist ps 0' -Direction Inbound -Protocol TCP "
        "-LocalPort 2224 -RemoteAddress '192.168.1.108','192.168.1.109','192.168.1.111'"
    )
    assert win_lines[1].startswith('netsh advfirewall firewall add rule name="od-dist ps 0" dir=in')
    assert "sudo ufw allow proto tcp from 192.168.1.109 to any port 2224" in readme.firewall_lines(
        ps_rule, "linux"
    )
    (feed_rule,) = [r for r in readme.inbound_rules(lan) if r.what]
    assert readme.firewall_lines(feed_rule, "windows")[0].startswith(
        "New-NetFirewallRule -DisplayName 'od-dist master 0 checkpoints' -Direction Inbound -Protocol TCP "
        "-LocalPort 2225 -RemoteAddress '192.168.1.120'"
    )


def test_cli_writes_scripts_by_os_and_readme(tmp_path):
    r = od_dist(
        "scripts",
        "--cluster=clusters/lan-example.yaml",  # relative: the Windows master reads it too
        "--pipeline=pipelines/shapes_retinanet.yaml",
        "--model_dir=runs/lan",
        f"--out={tmp_path}",
        "--wait_timeout=120",
    )
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path)) == [
        scripts.MANIFEST,
        "README.md",
        "evaluator-0.sh",
        "master-0.cmd",
        "master-0.ps1",
        "ps-0.sh",
        "worker-0.sh",
        "worker-1.sh",
    ]
    assert r.stdout.startswith("wrote 6 scripts for 5 machines and README.md")
    readme = (tmp_path / "README.md").read_text()
    assert "Any order" in readme and "(120 s here)" in readme
    assert (
        "| 192.168.1.108 | windows | master 0 | `master-0.cmd` or `powershell -ExecutionPolicy Bypass "
        "-File master-0.ps1` | 2223, 2225 | `C:\\TFWS\\od-dist` | venv `C:\\TFWS\\venv` |"
    ) in readme
    assert "| 192.168.1.120 | linux | evaluator 0 | `bash evaluator-0.sh` | none |" in readme
    # The Windows master's port is open to the servers, which probe it, and its checkpoint_port to
    # the evaluator; nothing else on Windows.
    assert readme.count("New-NetFirewallRule") == 2
    assert (
        "New-NetFirewallRule -DisplayName 'od-dist master 0' -Direction Inbound -Protocol TCP -LocalPort 2223 "
        "-RemoteAddress '192.168.1.116','192.168.1.109','192.168.1.111','192.168.1.120' -Action Allow"
    ) in readme
    windows = readme.split("### 192.168.1.108 (master 0): ports 2223, 2225")[1]
    assert (
        windows.index("Windows: one of these, in an Administrator shell.")
        < windows.index("PowerShell:")
        < windows.index("New-NetFirewallRule")
        < windows.index("Or cmd:")
        < windows.index("netsh")
        # Windows Defender Firewall's first-run prompt: Cancel blocks Python over the port rules.
        < windows.index("choose Allow. Cancel adds rules that block Python and win over the ones above")
    )
    assert readme.count("choose Allow") == 1  # the Windows machine's section only
    assert "### 192.168.1.116 (ps 0): port 2224" in readme
    assert "Linux: one of these, with sudo." in readme
    assert "No inbound port: 192.168.1.120 (evaluator 0)." in readme
    # Where the records must be, and the line that checks a machine for them.
    assert (
        "The pipeline's records (its input files) must be on every machine that reads them, the trainers' and the evaluator's (192.168.1.109, "
        "192.168.1.111, 192.168.1.108, 192.168.1.120; a ps reads none)"
    ) in readme
    assert (
        "    od-dist doctor --cluster=clusters/lan-example.yaml --pipeline=pipelines/shapes_retinanet.yaml "
        "--model_dir=runs/lan\n"
    ) in readme


def test_num_clones_only_for_the_roles_that_run_replicas():
    lan = cluster_mod.load(LAN)
    args = {
        x.tasks[0].name: x.args
        for x in machines.launches(lan, "c.yaml", ["--num_clones=2", "--wait_timeout=9"])
    }
    assert "--num_clones=2" in args["worker:0"] and "--num_clones=2" in args["worker:1"]
    for name in ("ps:0", "master:0", "evaluator:0"):  # parameter_server: no replicas there
        assert "--num_clones=2" not in args[name] and "--wait_timeout=9" in args[name], name


def test_machines_of_unknown_os_get_all_three_scripts(tmp_path):
    doc = {
        "master": "10.0.0.1:2222",
        "worker": ["10.0.0.2:2222", "10.0.0.3:2222"],
        "ps": ["10.0.0.4:2222"],
        "hosts": {
            "10.0.0.2": {"os": "linux"},
            "10.0.0.3": {"workdir": "/srv/od"},
            "10.0.0.4": {"os": "windows"},
        },
    }
    scripts.write_scripts(
        cluster_mod.from_document(doc), "c.yaml", ["--model_dir=m"], str(tmp_path), "cmd", 300
    )
    assert sorted(os.listdir(tmp_path)) == [
        scripts.MANIFEST,
        "README.md",
        "master-0.cmd",
        "master-0.ps1",
        "master-0.sh",  # no hosts entry
        "ps-0.cmd",
        "ps-0.ps1",  # declared windows
        "worker-0.sh",  # declared linux
        "worker-1.cmd",
        "worker-1.ps1",
        "worker-1.sh",
    ]  # an entry without os
    readme = (tmp_path / "README.md").read_text()
    assert "| 10.0.0.1 | not declared | master 0 |" in readme
    # Its firewall lines for both systems.
    master = readme.split("### 10.0.0.1 (master 0): port 2222")[1].split("###")[0]
    assert "sudo ufw allow" in master and "New-NetFirewallRule" in master


def test_home_in_paths(tmp_path):
    """`~` in workdir/venv/python works in a .sh (bash's $HOME) and is refused for Windows."""
    home = tmp_path / "home"
    (home / "venv" / "bin").mkdir(parents=True)
    (home / "work dir").mkdir()
    install_sh(home / "venv" / "bin" / "od-dist")
    doc = {
        "master": "10.0.0.1:2222",
        "worker": ["10.0.0.2:2222"],
        "hosts": {"10.0.0.1": {"os": "linux", "venv": "~/venv", "workdir": "~/work dir"}},
    }
    (launch,) = [
        x
        for x in machines.launches(cluster_mod.from_document(doc), "c.yaml", ["--model_dir=m"])
        if x.tasks[0].role == "master"
    ]
    script = tmp_path / "master-0.sh"
    script.write_text(scripts.render_sh(launch))
    record = tmp_path / "record"
    env = dict(os.environ, HOME=str(home), OD_DIST_RECORD=str(record))
    assert subprocess.run(["bash", str(script)], env=env, timeout=30).returncode == 0
    cwd, venv, _, *argv = record.read_bytes().decode().split("\0")[:-1]
    assert (cwd, venv) == (str(home / "work dir"), str(home / "venv"))
    assert argv == list(launch.args)
    for settings, fragment in [
        ({"os": "windows", "workdir": "~/od"}, "means nothing to Windows"),
        ({"venv": "~/venv"}, "declare 'os: linux'"),  # all three scripts
        ({"os": "linux", "python": "~bob/python"}, "only '~' and '~/...'"),
    ]:
        doc["hosts"] = {"10.0.0.1": settings}
        with pytest.raises(scripts.ScriptError, match=fragment):
            machines.launches(cluster_mod.from_document(doc), "c.yaml", [])


def test_ps1_python_with_powershell_metacharacters():
    # Every quote character of PowerShell's specification and its escape: none may end a literal
    # or reach the code. No path separator: found by Get-Command.
    python = "py\"$(Start-Process calc)`*[x]'’;&" + powershell.SINGLE_QUOTES + powershell.DOUBLE_QUOTES
    doc = {
        "master": "10.0.0.1:2222",
        "worker": ["10.0.0.2:2222"],
        "hosts": {"10.0.0.1": {"os": "windows", "python": python}},
    }
    (launch,) = [
        x
        for x in machines.launches(cluster_mod.from_document(doc), "c.yaml", [])
        if x.tasks[0].role == "master"
    ]
    code = [line for line in scripts.render_ps1(launch).split("\r\n") if line and not line.startswith("#")]
    seen = []
    for line in code:
        bare, literals = powershell.outside_single_quotes(line)
        assert "Start-Process" not in bare and "$(" not in bare, line  # the value never reaches code
        # Nothing expands: od-dist's own code writes no expandable string and no escape.
        assert not set(bare) & set(powershell.DOUBLE_QUOTES + powershell.BACKTICK), line
        seen += [x for x in literals if "Start-Process" in x]
    assert python in seen  # Get-Command gets it exactly (escaped for -Name's wildcards by PowerShell itself)
    assert any(x.startswith(python + " must be an .exe") for x in seen)


def test_checked_in_lan_example_is_current(tmp_path):
    (tmp_path / "clusters").mkdir()
    shutil.copy(LAN, tmp_path / "clusters")
    r = od_dist(
        "scripts",
        "--cluster=clusters/lan-example.yaml",
        "--pipeline=pipelines/shapes_retinanet.yaml",
        "--model_dir=runs/lan",
        "--out=scripts/lan-example",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    fresh, checked_in = tmp_path / "scripts" / "lan-example", os.path.join(ROOT, "scripts", "lan-example")
    assert sorted(os.listdir(fresh)) == sorted(os.listdir(checked_in))
    for name in os.listdir(fresh):
        with open(os.path.join(checked_in, name), "rb") as f:
            assert (fresh / name).read_bytes() == f.read(), (
                f"scripts/lan-example/{name} is stale: regenerate it"
            )


def test_cli_errors_exit_2(tmp_path):
    base = [f"--cluster={LAN}", "--pipeline=p", f"--out={tmp_path}"]
    r = od_dist("scripts", *base, "--model_dir=a\nb")
    assert r.returncode == 2 and "control character" in r.stderr
    r = od_dist("scripts", *base)
    assert r.returncode == 2 and "--model_dir" in r.stderr
    r = od_dist("scripts", *base, "--model_dir=m", "--role=ps")
    assert r.returncode == 2 and "--role" in r.stderr
    r = od_dist("scripts", f"--cluster={LAN}", "--pipeline=p", "--model_dir=m")
    assert r.returncode == 2 and "--out" in r.stderr


# ----- the generic node scripts ---------------------------------------------------------------


def test_node_sh(tmp_path):
    node = os.path.join(ROOT, "scripts", "od-dist-node.sh")
    assert subprocess.run(["bash", "-n", node], timeout=30).returncode == 0
    tree = make_tree(tmp_path)
    (tree["venv"] / "bin").mkdir()
    install_sh(tree["venv"] / "bin" / "od-dist")
    install_sh(tree["bin"] / "od-dist")
    install_sh(tree["py"] / "python")
    record = tmp_path / "record"

    def run(*args, **env):
        record.unlink(missing_ok=True)
        full = dict(
            os.environ,
            PATH=f"{tree['bin']}:{os.environ['PATH']}",
            OD_DIST_RECORD=str(record),
            OD_DIST_WORKDIR=str(tree["work"]),
            **env,
        )
        for name in (
            "OD_DIST_VENV",
            "OD_DIST_PYTHON",
            "OD_DIST_PIPELINE",
            "OD_DIST_MODEL_DIR",
            "OD_DIST_CLUSTER",
        ):
            if name not in env:
                full.pop(name, None)
        r = subprocess.run(["bash", node, *args], env=full, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        cwd, venv, _, *argv = record.read_bytes().decode().split("\0")[:-1]
        assert cwd == str(tree["work"])
        return argv, venv

    argv, venv = run(
        "worker",
        "1",
        "--wait_timeout=5",
        MODEL_DIR,
        OD_DIST_PIPELINE="pipelines/p q.yaml",
        OD_DIST_MODEL_DIR=MODEL_DIR,
        OD_DIST_VENV=str(tree["venv"]),
    )
    # The README's cluster file by default; restarts as the generated scripts have them, before the
    # caller's flags (a --max_restarts there wins: absl takes the last).
    restarts = f"--max_restarts={LAUNCH_MAX_RESTARTS}"
    assert argv == [
        "train",
        "--cluster=clusters/lan.yaml",
        "--role=worker",
        "--index=1",
        "--pipeline=pipelines/p q.yaml",
        f"--model_dir={MODEL_DIR}",
        restarts,
        "--wait_timeout=5",
        MODEL_DIR,
    ]
    assert venv == str(tree["venv"])
    argv, venv = run("master", OD_DIST_CLUSTER=CLUSTER_PATH)  # od-dist on PATH
    assert (argv, venv) == (["train", f"--cluster={CLUSTER_PATH}", "--role=master", restarts], "<unset>")
    argv, _ = run("--num_clones=2", OD_DIST_PYTHON=str(tree["py"] / "python"))  # role from this machine
    assert argv == ["-m", "od_dist", "train", "--cluster=clusters/lan.yaml", restarts, "--num_clones=2"]
    (tree["work"] / ".venv" / "bin").mkdir(parents=True)
    install_sh(tree["work"] / ".venv" / "bin" / "od-dist")
    _, venv = run("ps", "0")  # the checkout's own .venv
    assert venv == str(tree["work"] / ".venv")


def test_node_ps1_text():
    with open(os.path.join(ROOT, "scripts", "od-dist-node.ps1"), "rb") as f:
        raw = f.read()
    assert raw.isascii() and b"\n" not in raw.replace(b"\r\n", b"")
    text = raw.decode()
    # The same C-runtime quoting as windows_arg, and the same hand-over to Process.Start.
    for needle in (
        "function ConvertTo-WindowsArgument",
        "'[\\s\"]'",
        "'\\' * (2 * $backslashes + 1)",
        "$start.WorkingDirectory = $PWD.ProviderPath",
        "[System.Diagnostics.Process]::Start($start)",
        "exit $process.ExitCode",
        # As od-dist-node.sh: the README's cluster file, the generated scripts' restarts, then
        # the caller's flags.
        "$cluster = 'clusters/lan.yaml'",
        f"$argv.Add('--max_restarts={LAUNCH_MAX_RESTARTS}')\r\nfor (; $i -lt $rest.Count; $i++)",
    ):
        assert needle in text, needle


def test_node_scripts_name_what_exists():
    for name in ("od-dist-node.sh", "od-dist-node.ps1"):
        with open(os.path.join(ROOT, "scripts", name)) as f:
            text = f.read()
        for path in re.findall(r"od_dist/[\w/]+\.py", text):
            assert os.path.isfile(os.path.join(ROOT, path)), (name, path)
        assert f"--max_restarts={LAUNCH_MAX_RESTARTS} (the generated scripts' default" in text, name


def test_scripts_for_a_large_cluster_check_each_task_in_time_linear_in_the_tasks(tmp_path):
    """Every task's arguments are checked as the task will check them; that must not walk every
    other task per task (3,000 workers took 84 s). Counted in the real child, through a hook: the
    addresses parsed and the hosts' clones looked up, for 400 and 800 workers on 100 machines."""
    import loopback

    hook = loopback.site_hook(
        tmp_path,
        "import atexit, ipaddress, sys\n"
        "from od_dist.cluster import spec\n"
        "calls = [0]\n"
        "def counted(f):\n"
        "    def g(*a, **k):\n"
        "        calls[0] += 1\n"
        "        return f(*a, **k)\n"
        "    return g\n"
        "ipaddress.ip_address = counted(ipaddress.ip_address)\n"
        "spec.Cluster.clones_for = counted(spec.Cluster.clones_for)\n"
        "atexit.register(lambda: print(f'CALLS {calls[0]}', file=sys.stderr))\n",
    )
    counts = {}
    for workers in (400, 800):
        cluster = tmp_path / f"c{workers}.yaml"
        hosts = [f"10.0.{i // 100}.{1 + i % 100}:2222" for i in range(workers)]
        cluster.write_text(
            "strategy: parameter_server\nmaster: 10.1.0.1:2222\nps:\n  - 10.1.0.2:2222\nworker:\n"
            + "".join(f"  - {h}\n" for h in hosts)
        )
        r = od_dist(
            "scripts",
            f"--cluster={cluster}",
            "--pipeline=pipelines/shapes_retinanet.yaml",
            "--model_dir=runs/big",
            f"--out={tmp_path / f'out{workers}'}",
            env={"PYTHONPATH": os.pathsep.join([hook, ROOT])},
        )
        assert r.returncode == 0, r.stdout + r.stderr
        counts[workers] = int(r.stderr.split("CALLS ")[-1])
    # Linear: twice the tasks, about twice the calls (quadratic: four times, 160,000 at 400).
    assert counts[800] < 2.5 * counts[400] and counts[400] < 50 * 402, counts


# ----- start at boot (--at_boot) --------------------------------------------------------------

# Every character a unit file's syntax or a shell treats specially (Linux), and cmd (Windows: no `%`,
# which a task at startup cannot carry, nor `"`, which no Windows path holds).
BOOT_LINUX_WORKDIR = "//srv/od dist/./x/../a%b$c'd\\e\"f é;g&h(i)"
BOOT_WINDOWS_WORKDIR = "C:\\Program Files (x86)\\od dist&x^y!z\\"


def boot_launches(hosts):
    """The launches of the master (10.0.0.1) and the worker (10.0.0.2) with these hosts settings."""
    doc = {"master": "10.0.0.1:2222", "worker": ["10.0.0.2:2222"], "hosts": hosts}
    by_host = {
        x.host: x for x in machines.launches(cluster_mod.from_document(doc), "c.yaml", ["--model_dir=m"])
    }
    return by_host["10.0.0.1"], by_host["10.0.0.2"]


def unit_settings(text):
    """A unit file's settings, each key's values in order (comments and section lines left out)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def systemd_words(line):
    """A unit's command line as systemd reads it (systemd.syntax(7), systemd.service(5)): words split
    at spaces outside double quotes, C escapes, `%%` (a specifier) and `$$` (a variable) undone."""
    words = re.findall(r'"((?:[^"\\]|\\.)*)"|(\S+)', line)
    undo = re.compile(r"%%|\$\$|\\(.)")
    return [undo.sub(lambda m: m.group(1) or m.group(0)[0], a or b) for a, b in words]


def test_at_boot_systemd_unit(tmp_path):
    from od_dist.protocol import exit_codes
    from od_dist.render import boot

    master, _ = boot_launches({"10.0.0.1": {"os": "linux", "workdir": BOOT_LINUX_WORKDIR}})
    text = boot.render_unit(master, boot.AtBoot(user="root", grace_period=200))
    s = unit_settings(text)
    real_workdir = "/srv/od dist/a%b$c'd\\e\"f é;g&h(i)"  # `//`, `.`, `..` resolved, as the .sh's `cd` does
    assert s["WorkingDirectory"] == [real_workdir.replace("%", "%%")]  # specifiers only: no quoting there
    # The script by its absolute path, in the working directory, through bash (no mode bit needed).
    assert systemd_words(s["ExecStart"][0]) == ["/bin/bash", real_workdir + "/master-0.sh"]
    assert boot.script_path(master, "linux") == real_workdir + "/master-0.sh"
    assert s["Wants"] == s["After"] == ["network-online.target"] and s["WantedBy"] == ["multi-user.target"]
    assert s["User"] == ["root"]  # the system account, named (tests/test_boot_users.py)
    assert s["Restart"] == ["on-failure"] and s["RestartSec"] == ["5"]
    # Restart=on-failure restarts every exit but 0, SuccessExitStatus and RestartPreventExitStatus:
    # exactly the retryable ones, without a person's stop; of every status a process can exit with,
    # not only those the table names (a crash's 139 is permanent, not restarted every 5 s).
    clean = {0, *map(int, s["SuccessExitStatus"][0].split())}
    prevented = set(map(int, s["RestartPreventExitStatus"][0].split()))
    restarted = {c for c in range(256) if c not in clean | prevented}
    assert restarted == {137, 138, 143} == exit_codes.RETRYABLE - {exit_codes.INTERRUPTED}
    assert clean == {0, 130} and {1, 2, 139} <= prevented
    # SIGTERM to od-dist only, which stops its tasks; killed only after the trainers' save.
    assert s["KillMode"] == ["mixed"] and s["TimeoutStopSec"] == ["230"]
    s = unit_settings(boot.render_unit(master, boot.AtBoot(user="od-dist")))
    assert s["User"] == ["od-dist"] and s["TimeoutStopSec"] == ["150"]
    with pytest.raises(scripts.ScriptError, match="not a Linux user name"):
        boot.render_unit(master, boot.AtBoot(user="LAB\\od dist"))


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="needs systemd-analyze")
def test_at_boot_units_pass_systemd_analyze_verify(tmp_path):
    from od_dist.render import boot

    master, worker = boot_launches(
        {
            "10.0.0.1": {"os": "linux", "workdir": BOOT_LINUX_WORKDIR},
            "10.0.0.2": {"os": "linux", "workdir": "/srv/od"},
        }
    )
    for launch, at_boot in ((master, boot.AtBoot(user="root")), (worker, boot.AtBoot(user="od-dist"))):
        path = tmp_path / boot.unit_file(launch)
        path.write_text(boot.render_unit(launch, at_boot))
        r = subprocess.run(
            ["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0 and path.name not in r.stdout + r.stderr, r.stdout + r.stderr
    # systemd's own reading of a quoted word, where verify shows it: as the program to run, which it
    # finds (or names as it read it when its rules refuse the characters there). `$$` is undone only
    # in the arguments, where the script's path goes: not checked here.
    for name in ["a b", "a%b", "aé;&()*!=b", "a\\b", 'a"b', "a'b"]:
        program = tmp_path / "bin" / name / "t"
        program.parent.mkdir(parents=True)
        shutil.copy("/bin/true", program)
        path = tmp_path / "read.service"
        path.write_text(f"[Service]\nExecStart={quote.systemd(str(program))}\n")
        r = subprocess.run(
            ["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0 or f"contains special characters: {program}\n" in r.stderr, (name, r.stderr)


def cmd_c_s(command_line):
    """What `cmd /s /c <rest>` runs: the rest without its first and last quote (cmd /? on /S)."""
    rest = command_line.split(" /c ", 1)[1]
    return rest[1 : rest.rindex('"')]


def test_at_boot_schtasks_lines():
    from od_dist.render import boot

    master, worker = boot_launches(
        {
            "10.0.0.1": {"os": "windows", "workdir": BOOT_WINDOWS_WORKDIR},
            "10.0.0.2": {"os": "linux", "workdir": "/w"},
        }
    )
    script = "C:\\Program Files (x86)\\od dist&x^y!z\\master-0.cmd"
    assert boot.script_path(master, "windows") == script
    (create, run), (stop, wait, end, delete) = boot.schtasks_lines(master, boot.AtBoot(user="SYSTEM"))
    # The line as cmd passes it on (quote.cmd: no quoted state, every special character ^-escaped),
    # then split as schtasks splits its command line (the C runtime's rules).
    argv = mslex.split(cmd_batch_line(create), like_cmd=False)
    xml_path = "C:\\Program Files (x86)\\od dist&x^y!z\\od-dist-master-0.xml"
    assert argv == ["schtasks", "/Create", "/TN", "od-dist-master-0", "/XML", xml_path, "/RU", "SYSTEM", "/F"]
    assert boot.task_path(master) == xml_path
    # The task (its XML): at startup, cmd running the script by its quoted path whatever the path
    # holds, in the working directory; no execution limit (schtasks' default stops it after 72 hours,
    # with no checkpoint), no battery or idle conditions, one instance.
    import xml.etree.ElementTree as ET

    ns = {"t": "http://schemas.microsoft.com/windows/2004/02/mit/task"}
    task = ET.fromstring(boot.render_task(master, boot.AtBoot(user="SYSTEM")).encode("utf-16"))
    assert task.find("t:Triggers/t:BootTrigger/t:Enabled", ns).text == "true"
    settings = {e.tag.split("}")[1]: e.text for e in task.find("t:Settings", ns)}
    assert settings["ExecutionTimeLimit"] == "PT0S" and settings["MultipleInstancesPolicy"] == "IgnoreNew"
    assert settings["DisallowStartIfOnBatteries"] == settings["StopIfGoingOnBatteries"] == "false"
    idle = task.find("t:Settings/t:IdleSettings/t:StopOnIdleEnd", ns)
    assert idle.text == "false"
    assert task.find("t:Principals/t:Principal/t:UserId", ns).text == "S-1-5-18"  # SYSTEM
    exec_ = task.find("t:Actions/t:Exec", ns)
    tr = exec_.find("t:Command", ns).text + " " + exec_.find("t:Arguments", ns).text
    assert tr == boot.task_command(master) and tr.startswith("cmd.exe /d /v:off /s /c ")
    assert mslex.split(cmd_c_s(tr), like_cmd=False) == [script]
    assert exec_.find("t:WorkingDirectory", ns).text == BOOT_WINDOWS_WORKDIR
    assert mslex.split(cmd_batch_line(run), like_cmd=False) == ["schtasks", "/Run", "/TN", "od-dist-master-0"]
    # The removal stops the job first as a SIGTERM does (the trainers save), through the stop file
    # its supervisor watches in its working directory, and gives it its grace period.
    command, target = stop.split(" > ")  # a redirection of cmd's, meant
    assert command == "type nul"
    assert mslex.split(cmd_batch_line(target), like_cmd=False) == [BOOT_WINDOWS_WORKDIR + notes.STOP_FILE]
    assert wait == f"timeout /t {boot.STOP_WAIT_S} /nobreak"
    assert mslex.split(cmd_batch_line(end), like_cmd=False) == ["schtasks", "/End", "/TN", "od-dist-master-0"]
    assert mslex.split(cmd_batch_line(delete), like_cmd=False) == [
        "schtasks",
        "/Delete",
        "/TN",
        "od-dist-master-0",
        "/F",
    ]
    assert "%" not in create + run + delete  # an interactive cmd has no escape for it, unlike a batch file
    (create, _), _ = boot.schtasks_lines(master, boot.AtBoot(user="LAB\\od dist"))
    argv = mslex.split(cmd_batch_line(create), like_cmd=False)
    assert argv[argv.index("/RU") :][:4] == ["/RU", "LAB\\od dist", "/RP", "*"]  # schtasks asks for it
    task = ET.fromstring(boot.render_task(master, boot.AtBoot(user="LAB\\od dist")).encode("utf-16"))
    principal = task.find("t:Principals/t:Principal", ns)
    assert [(e.tag.split("}")[1], e.text) for e in principal] == [
        ("UserId", "LAB\\od dist"),
        ("LogonType", "Password"),
    ]
    # SYSTEM cannot reach a network share: a share's task needs the user whose share it is.
    (share, _) = boot_launches({"10.0.0.1": {"os": "windows", "workdir": "\\\\fs\\od"}})
    with pytest.raises(scripts.ScriptError) as refused:
        boot.render_task(share, boot.AtBoot(user="SYSTEM"))
    assert str(refused.value) == (
        "--at_boot_user: 'SYSTEM': 10.0.0.1's task would run as SYSTEM, which cannot reach its working "
        "directory \\\\fs\\od (a network share); name the user whose share it is in hosts.10.0.0.1.user, "
        "e.g. LAB\\od"
    )
    assert boot.render_task(share, boot.AtBoot(user="LAB\\od"))
    # What a task at startup cannot run, each refused in one line naming the fix.
    for hosts, fragment in [
        ({"os": "windows", "workdir": "C:\\100%\\od"}, "contains '%'"),
        ({"os": "windows", "workdir": "od"}, "not an absolute Windows path"),
        ({"os": "windows"}, "has no working directory"),
        ({"os": "windows", "workdir": "C:\\" + "x" * 240}, "a task's command line takes 261"),
    ]:
        (launch, _) = boot_launches({"10.0.0.1": hosts})
        with pytest.raises(scripts.ScriptError, match=re.escape(fragment)):
            boot.schtasks_lines(launch, boot.AtBoot(user="SYSTEM"))
    for hosts, fragment in [
        ({"os": "linux", "workdir": "~/od"}, "not an absolute Linux path"),
        ({"workdir": "/srv/od"}, "declare the os of 10.0.0.1"),  # both systems: not a Windows path
    ]:
        (launch, _) = boot_launches({"10.0.0.1": hosts})
        with pytest.raises(scripts.ScriptError, match=re.escape(fragment)):
            for os_name in launch.oses:
                boot.script_path(launch, os_name)


def test_at_boot_windows_task_registers_in_wines_task_scheduler(wine, tmp_path):
    """The README's lines, run by Wine's cmd: schtasks registers the task from its XML file as the
    scripts wrote it (UTF-16), with the settings the XML asks for as Task Scheduler read them (no
    execution limit, no battery conditions, one instance), and the removal lines delete it."""
    import xml.etree.ElementTree as ET

    from od_dist.render import boot

    workdir = tmp_path / "work"
    master, _ = boot_launches({"10.0.0.1": {"os": "windows", "workdir": win(workdir)}})
    data, _ = scripts.encoded(boot.task_file(master), boot.render_task(master, boot.AtBoot(user="SYSTEM")))
    workdir.mkdir()
    (workdir / boot.task_file(master)).write_bytes(data)
    (create, _), (stop, _, end, delete) = boot.schtasks_lines(master, boot.AtBoot(user="SYSTEM"))
    r = wine.run_cmd(["/c", create])
    assert r.returncode == 0, (r.stdout, r.stderr)
    stored = (
        pathlib.Path(wine.env["WINEPREFIX"])
        / "drive_c"
        / "windows"
        / "system32"
        / "tasks"
        / boot.name(master)
    )
    task = ET.fromstring(stored.read_bytes().decode("utf-8-sig"))
    ns = {"t": "http://schemas.microsoft.com/windows/2004/02/mit/task"}
    settings = {e.tag.split("}")[1]: e.text for e in task.find("t:Settings", ns)}
    assert settings["ExecutionTimeLimit"] == "PT0S" and settings["MultipleInstancesPolicy"] == "IgnoreNew"
    assert settings["DisallowStartIfOnBatteries"] == settings["StopIfGoingOnBatteries"] == "false"
    r = wine.run_cmd(["/c", stop])  # the stop file, where the task's supervisor watches for it
    assert r.returncode == 0 and (workdir / notes.STOP_FILE).exists(), (r.stdout, r.stderr)
    wine.run_cmd(["/c", end])  # nothing runs it here: what matters is that the delete follows
    r = wine.run_cmd(["/c", delete])
    assert r.returncode == 0 and not stored.exists(), (r.stdout, r.stderr)


def test_at_boot_of_a_machine_of_undeclared_os_both_systems(tmp_path):
    from od_dist.render import boot

    doc = {
        "master": "10.0.0.1:2222",
        "worker": ["10.0.0.2:2222"],
        "hosts": {"10.0.0.1": {"workdir": "//fileserver/od"}, "10.0.0.2": {"os": "linux", "workdir": "/w"}},
    }
    scripts.write_scripts(
        cluster_mod.from_document(doc),
        "c.yaml",
        [],
        str(tmp_path),
        "cmd",
        300,
        at_boot=boot.AtBoot(user="od"),
    )
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".xml")) == ["od-dist-master-0.xml"]
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".service")) == [
        "od-dist-master-0.service",
        "od-dist-worker-0.service",
    ]
    text = (tmp_path / "README.md").read_text()
    section = text.split("## Start at boot\n")[1].split("How the scripts")[0]
    master, worker = (section.split(f"### {h}")[1].split("\n### ")[0] for h in ("10.0.0.1", "10.0.0.2"))
    assert "Linux: the unit `od-dist-master-0.service`" in master and "/TN od-dist-master-0" in master
    assert "od-dist-worker-0.service" in worker and "schtasks" not in worker  # declared linux


def test_cli_at_boot(tmp_path):
    base = [
        "scripts",
        "--cluster=clusters/lan-example.yaml",
        "--pipeline=pipelines/shapes_retinanet.yaml",
        "--model_dir=runs/lan",
        f"--out={tmp_path}",
    ]
    plain = tmp_path.parent / f"{tmp_path.name}-plain"
    r = od_dist(*base[:-1], f"--out={plain}")
    assert r.returncode == 0, r.stderr
    r = od_dist(*base, "--at_boot")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(
        "wrote 6 scripts, 4 systemd units, 1 Windows task file for 5 machines and README.md"
    )
    units = sorted(f for f in os.listdir(tmp_path) if f.endswith((".service", ".xml")))
    assert units == sorted(
        [f"od-dist-{s}.service" for s in ("evaluator-0", "ps-0", "worker-0", "worker-1")]
        + ["od-dist-master-0.xml"]
    )
    assert (tmp_path / "od-dist-master-0.xml").read_bytes()[:2] == b"\xff\xfe"  # UTF-16, as schtasks reads it
    assert sorted(set(os.listdir(tmp_path)) - set(units)) == sorted(os.listdir(plain))
    text = (tmp_path / "README.md").read_text()
    assert f"--max_restarts=3 --at_boot --out={tmp_path}\n" in text  # the command that regenerates it
    section = text.split("## Start at boot\n")[1]
    assert text.index("## Firewall") < text.index("## Start at boot")  # beside the firewall lines
    # Each machine's hosts user (clusters/lan-example.yaml): od on Linux, SYSTEM named for Windows.
    assert (
        "`/opt/od-dist/ps-0.sh` as `od`;" in section
        and "`C:\\TFWS\\od-dist\\master-0.cmd` as `SYSTEM`;" in section
    )
    assert (tmp_path / "od-dist-ps-0.service").read_text().count("\nUser=od\n") == 1
    assert (
        "```\nsudo cp /opt/od-dist/od-dist-ps-0.service /etc/systemd/system/\nsudo systemctl daemon-reload\n"
        "sudo systemctl enable --now od-dist-ps-0.service\n```\n\nTo remove it:\n\n```\n"
        "sudo systemctl disable --now od-dist-ps-0.service\nsudo rm /etc/systemd/system/od-dist-ps-0.service\n"
        "sudo systemctl daemon-reload\n```\n"
    ) in section
    assert (
        "schtasks /Create /TN od-dist-master-0 /XML C:\\TFWS\\od-dist\\od-dist-master-0.xml /RU SYSTEM /F\n"
        "schtasks /Run /TN od-dist-master-0\n```\n\nTo remove it:\n\n```\ntype nul > C:\\TFWS\\od-dist\\od-dist.stop\n"
        "timeout /t 150 /nobreak\nschtasks /End /TN od-dist-master-0\n"
        "schtasks /Delete /TN od-dist-master-0 /F\n"
    ) in section
    # Without the flag again: the units go (od-dist wrote them), the rest is the plain run's.
    r = od_dist(*base)
    assert r.returncode == 0 and r.stdout.startswith("wrote 6 scripts for 5 machines"), r.stderr
    assert sorted(os.listdir(tmp_path)) == sorted(os.listdir(plain))
    assert "Start at boot" not in (tmp_path / "README.md").read_text()
    r = od_dist(*base, "--at_boot_user=od")
    assert r.returncode == 2 and "--at_boot_user: od: given without --at_boot" in r.stderr
    # No hosts: workdir.
    r = od_dist("scripts", "--cluster=clusters/local.yaml", *base[2:], "--at_boot", "--at_boot_user=od")
    assert r.returncode == 2 and "has no working directory, where its script is copied" in r.stderr, r.stderr
