"""The README's Windows install, checked from this Linux machine.

1. Its command, resolved for win_amd64 / Python 3.11 by a resolver that evaluates Windows'
   environment markers (uv; pip evaluates the running interpreter's), from the package index
   without downloading a wheel: every package has a Windows wheel, the versions that must match
   across one job's machines match Linux's, and Model Garden's requirements but tensorflow-text
   are met although it is installed with --no-deps.
2. The Windows-equivalent environment: Linux's resolution of the same requirements with
   tensorflow_text unimportable (tests/windows_like, first on the path of every test process and of
   every process a test starts; tests/conftest.py). The whole suite runs so; the commands of the
   demo and of a user's first day are covered by: `data shapes` (conftest's data_dir), `train` on
   one machine and `eval` (test_trainer, test_export), `launch` of a parameter_server cluster
   (test_distributed) and of a multi_worker_mirrored one (test_faults), `export` and `predict`
   (test_export), `pipeline import` of every config in tests/odapi_configs (test_odapi), `data voc`
   and `data coco` (test_data).
"""

import configparser
import importlib.metadata
import os
import re
import subprocess
import sys

import pytest
from loopback import ROOT, clean_env, od_dist
from packaging.requirements import Requirement
from uv import find_uv_bin

WINDOWS = ("--python-platform", "x86_64-pc-windows-msvc", "--python-version", "3.11")
LINUX = ("--python-platform", "x86_64-manylinux_2_28", "--python-version", "3.11")
# The machines of one job must run these at one version (doctor compares them).
SAME_EVERYWHERE = ("tensorflow", "tf-keras", "keras", "numpy")
# Pure-Python packages published as source only; pip builds them on any OS.
SOURCE_ONLY = {"promise", "seqeval"}


def readme_windows_command() -> str:
    """The command in the README's first ```bat block."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    found = re.search(r"```bat\n(.+?)\n```", text, re.S)
    assert found, "README.md has no ```bat block with the Windows install"
    return found.group(1).strip()


def pip_installs(command: str) -> tuple[list[str], list[str]]:
    """The requirements the command installs with their dependencies (a `-e .` is this project's
    install_requires), and those installed with --no-deps."""
    with_deps, no_deps = [], []
    for part in command.split("&&"):
        words = part.split()
        if "pip" not in words or "install" not in words:
            continue
        args = words[words.index("install") + 1 :]
        if args == ["-e", "."]:
            cfg = configparser.ConfigParser()
            cfg.read(os.path.join(ROOT, "setup.cfg"))
            lines = cfg["options"]["install_requires"].splitlines()
            with_deps += [line for line in lines if line.strip() and not line.strip().startswith("#")]
        elif args[:1] == ["--no-deps"] and all("==" in a for a in args[1:]):
            no_deps += args[1:]
        else:
            pytest.fail(f"the README's Windows command has a pip install this test does not read: {part}")
    return with_deps, no_deps


def compile_(tmp_path, name, requirements, *options) -> dict[str, str]:
    """uv's resolution of `requirements` (metadata only): {package: version}."""
    source = tmp_path / f"{name}.in"
    source.write_text("\n".join(requirements) + "\n")
    r = subprocess.run(
        [find_uv_bin(), "pip", "compile", "--quiet", "--no-header", "--no-annotate", *options, str(source)],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(UV_NO_CONFIG="1"),
    )
    assert r.returncode == 0, f"{name}: {r.stderr[-3000:]}"
    pins = {}
    for line in r.stdout.splitlines():
        if "==" in line:
            package, version = line.split(";")[0].strip().split("==")
            pins[package.lower().replace("_", "-")] = version
    return pins


def test_the_readme_windows_command_resolves_for_win_amd64_at_linuxs_versions(tmp_path):
    with_deps, no_deps = pip_installs(readme_windows_command())
    assert [Requirement(r).name for r in no_deps] == ["tf-models-official"], no_deps

    windows = compile_(tmp_path, "windows", with_deps, *WINDOWS)
    assert "tensorflow-text" not in windows
    # A wheel for Windows, not only a source archive that may not build there: the same versions
    # again with source builds refused for all but the known pure-Python ones.
    wheels_only = [o for p in sorted(set(windows) - SOURCE_ONLY) for o in ("--only-binary", p)]
    wheels = compile_(tmp_path, "windows-wheels", with_deps, *WINDOWS, *wheels_only)
    moved = {p: (v, wheels.get(p, "none")) for p, v in windows.items() if wheels.get(p) != v}
    assert not moved, f"no win_amd64 wheel at the version resolved (resolved, with wheels only): {moved}"
    garden = compile_(tmp_path, "model-garden", no_deps, *WINDOWS, "--no-deps", "--only-binary", ":all:")
    assert garden == {Requirement(r).name: str(Requirement(r).specifier)[2:] for r in no_deps}

    linux = compile_(tmp_path, "linux", with_deps, *LINUX)
    for package in SAME_EVERYWHERE:
        assert windows[package] == linux[package], (package, windows[package], linux[package])
    assert linux["tf-models-official"] == garden["tf-models-official"]

    # Model Garden installed without its requirements: od-dist's Windows list must meet them all
    # but tensorflow-text. Read from the installed Model Garden, which is the pinned one.
    assert importlib.metadata.version("tf-models-official") == garden["tf-models-official"]
    unmet = []
    for line in importlib.metadata.requires("tf-models-official"):
        need = Requirement(line)
        name = need.name.lower().replace("_", "-")
        if name == "tensorflow-text" or (need.marker and not need.marker.evaluate({"sys_platform": "win32"})):
            continue
        if name not in windows or not need.specifier.contains(windows[name], prereleases=True):
            unmet.append(f"{line} (resolved: {windows.get(name, 'absent')})")
    assert not unmet, "Model Garden's requirements not met on Windows: " + "; ".join(unmet)


def test_tensorflow_text_cannot_be_imported_by_the_tests_or_their_processes():
    with pytest.raises(ModuleNotFoundError):
        import tensorflow_text  # noqa: F401
    r = subprocess.run(
        [sys.executable, "-c", "import tensorflow_text"], capture_output=True, text=True, env=clean_env()
    )
    assert r.returncode == 1 and "No module named 'tensorflow_text'" in r.stderr, r.stderr[-2000:]


def test_a_missing_model_garden_is_one_line_with_the_install_command(tmp_path):
    """A Windows machine whose install missed its second step: `official` cannot be imported."""
    (tmp_path / "official").mkdir()
    (tmp_path / "official" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'official'\", name='official')\n"
    )
    r = od_dist(
        "eval",
        "--pipeline=pipelines/shapes_retinanet.yaml",
        f"--model_dir={tmp_path / 'model'}",
        env={"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ["PYTHONPATH"]])},
    )
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("od-dist eval: No module named 'official' in this Python"), r.stderr[-2000:]
    assert last.endswith("python -m pip install tf-models-official==2.20.0"), last


def test_the_job_object_that_ties_a_supervisor_s_children_to_it_is_laid_out_as_windows_x64_s():
    """host/winjob.py runs on Windows only; what can be checked here is what it hands the system:
    JOBOBJECT_EXTENDED_LIMIT_INFORMATION as winnt.h lays it out on x64 (144 bytes, LimitFlags at 16,
    IoInfo at 64, ProcessMemoryLimit at 112), asking for kill-on-close (0x2000) alone."""
    import ctypes
    import struct

    from od_dist.host import winjob

    if struct.calcsize("P") != 8:
        pytest.skip("the x64 layout: a 64-bit Python")
    basic, extended = winjob.JOBOBJECT_BASIC_LIMIT_INFORMATION, winjob.JOBOBJECT_EXTENDED_LIMIT_INFORMATION
    assert ctypes.sizeof(basic) == 64 and ctypes.sizeof(winjob.IO_COUNTERS) == 48
    assert (basic.LimitFlags.offset, basic.Affinity.offset, basic.SchedulingClass.offset) == (16, 48, 60)
    assert ctypes.sizeof(extended) == 144
    assert (
        extended.IoInfo.offset,
        extended.ProcessMemoryLimit.offset,
        extended.PeakJobMemoryUsed.offset,
    ) == (
        64,
        112,
        136,
    )
    info = winjob.kill_on_close_limits()
    raw = bytes(info)
    assert raw[16:20] == (0x2000).to_bytes(4, "little") and not any(raw[:16]) and not any(raw[20:])
    assert winjob.hold(object()) is False  # no job objects here: the child is left as it was
