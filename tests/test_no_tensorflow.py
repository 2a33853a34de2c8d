"""The host side (od_dist/host/, od_dist/protocol/, od_dist/patches/) and the commands that run
beside the tasks work where TensorFlow cannot be imported: a `tensorflow` package first on the path
fails its import, as a missing one's does, in every process these tests start."""

import ast
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


def _imports_of_each_module():
    """{module: the od_dist modules it imports}, from every import statement of od_dist's sources,
    those inside functions too (which run later, but still make the two modules need each other)."""
    package = os.path.join(ROOT, "od_dist")
    files = {}
    for folder, _, names in os.walk(package):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path[:-3], ROOT).replace(os.sep, ".").removesuffix(".__init__")
                files[module] = path
    graph = {}
    for module, path in files.items():
        here = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        imported = set()
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package `level - 1` up from this one
                    parts = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for a in node.names:  # `from od_dist.cli import data` imports a module, not a name
                    imported |= {f"{base}.{a.name}"} if f"{base}.{a.name}" in files else {base} & set(files)
        graph[module] = imported - {module}
    return graph


def test_od_dists_modules_import_each_other_one_way():
    """No two modules of od_dist import each other, directly or through others: each circle makes
    the order of imports matter (a name one of them has not defined yet) and the two one piece."""
    graph = _imports_of_each_module()
    assert "od_dist.model.predict" in graph and "od_dist.model.export" in graph["od_dist.model.predict"]
    circles = []
    for start in sorted(graph):  # every module from which a path of imports leads back to it
        path, seen = [start], set()
        stack = [(start, iter(sorted(graph[start])))]
        while stack:
            module, rest = stack[-1]
            nxt = next(rest, None)
            if nxt is None:
                stack.pop()
                path.pop()
            elif nxt == start:
                circles.append(" -> ".join([*path, start]))
                break
            elif nxt not in seen:
                seen.add(nxt)
                path.append(nxt)
                stack.append((nxt, iter(sorted(graph[nxt]))))
    assert not circles, "\n".join(circles)


def test_the_host_side_neither_imports_the_task_side_nor_holds_tensorflow_code():
    """od_dist/host/ sits below od_dist/task/: none of its modules imports one of the task side's
    (doctor's GPU query runs it by name in a child, `python -m od_dist.task.gpus`), and none holds
    TensorFlow code, not even as a string a child runs."""
    graph = _imports_of_each_module()
    upward = {m: sorted(i for i in graph[m] if i.startswith("od_dist.task")) for m in graph if ".host." in m}
    assert {m: i for m, i in upward.items() if i} == {}
    host = os.path.join(ROOT, "od_dist", "host")
    sources = [n for n in sorted(os.listdir(host)) if n.endswith(".py")]
    holding = [
        n for n in sources if "import tensorflow" in open(os.path.join(host, n), encoding="utf-8").read()
    ]
    assert holding == [], holding


def test_doctors_tensorflow_query_is_the_task_side_module_in_a_child():
    """What `od-dist doctor` asks TensorFlow, where the driver shows GPUs: the count it lists, from
    `python -m od_dist.task.gpus` in a child process (this machine has none)."""
    import tensorflow as tf

    from od_dist.host import doctor_here

    assert doctor_here.tensorflow_gpus() == (
        len(tf.config.list_physical_devices("GPU")),
        f"TensorFlow {tf.__version__}, tf.config.list_physical_devices",
    )
