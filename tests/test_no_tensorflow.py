"""The host side (od_dist/host/, od_dist/protocol/, od_dist/patches.py) and the commands that run
beside the tasks work where TensorFlow cannot be imported: a `tensorflow` package first on the path
fails its import, as a missing one's does, in every process these tests start."""

import os
import subprocess
import sys

from loopback import ROOT, clean_env, free_ports, python_path

BLOCK = 'raise ModuleNotFoundError("No module named \'tensorflow\'", name="tensorflow")\n'

# Every module of the host side, imported: none may import TensorFlow, even on the way.
IMPORT_ALL = """
import importlib, pkgutil
import od_dist.host, od_dist.protocol
names = ["od_dist.patches", "od_dist.cli"] + [
    m.name for p in (od_dist.host, od_dist.protocol) for m in pkgutil.iter_modules(p.__path__, p.__name__ + ".")
]
for name in names:
    importlib.import_module(name)
print("imported", len(names))
"""


def without_tensorflow(tmp_path):
    blocked = tmp_path / "no-tensorflow"
    (blocked / "tensorflow").mkdir(parents=True)
    (blocked / "tensorflow" / "__init__.py").write_text(BLOCK)
    return clean_env(PYTHONPATH=python_path(blocked, ROOT))


def run(env, *args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120
    )


def test_the_host_side_imports_and_its_commands_run_without_tensorflow(tmp_path):
    env = without_tensorflow(tmp_path)
    r = run(env, "-c", "import tensorflow")
    assert r.returncode != 0 and "No module named 'tensorflow'" in r.stderr, r.stderr  # the block holds

    r = run(env, "-c", IMPORT_ALL)
    assert r.returncode == 0 and "imported" in r.stdout, r.stdout + r.stderr

    r = run(env, "-m", "od_dist", "launch", "--help")
    assert r.returncode == 0 and "launch" in r.stdout, r.stdout + r.stderr

    ports = free_ports(3)
    cluster = tmp_path / "loopback.yaml"
    cluster.write_text(
        f"master: 127.0.0.1:{ports[0]}\nworker: [127.0.0.1:{ports[1]}]\nps: [127.0.0.1:{ports[2]}]\n"
    )
    r = run(env, "-m", "od_dist", "doctor", f"--cluster={cluster}")
    assert r.returncode == 0 and r.stdout.splitlines()[-1].startswith("od-dist doctor: nothing to fix"), (
        r.stdout + r.stderr
    )

    r = run(env, "-m", "od_dist", "validate", f"--cluster={cluster}")
    assert r.returncode == 0, r.stdout + r.stderr

    lan = tmp_path / "lan.yaml"
    lan.write_text("master: 10.0.0.1:2222\nworker: [10.0.0.2:2222]\nps: [10.0.0.2:2223]\n")
    out = tmp_path / "out"
    r = run(
        env,
        "-m",
        "od_dist",
        "scripts",
        f"--cluster={lan}",
        "--pipeline=pipelines/shapes_retinanet.yaml",
        "--model_dir=runs/a",
        f"--out={out}",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert os.listdir(out), r.stdout
