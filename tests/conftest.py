"""Shared fixtures (the shared plain helpers are in loopback.py)."""

import os
import signal
import socket
import sys
import threading

import netns
import pytest
from loopback import WINDOWS_LIKE, python_path

# Every test, and every process a test starts, runs as on a Windows machine's install: without
# tensorflow_text (tests/test_windows.py says which tests cover which command).
sys.path.insert(0, WINDOWS_LIKE)
if WINDOWS_LIKE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):  # xdist's workers inherit it
    os.environ["PYTHONPATH"] = python_path(WINDOWS_LIKE)

# CI's 2 cores run three xdist workers, each starting TensorFlow processes that size their intra-op
# pools for the whole machine unless od-dist gives them a share (tasks of one loopback cluster): the
# pools of a simulated machine's task, a lone trainer and the workers' own TensorFlow outnumber the
# cores and spin waiting for each other. One intra-op thread each: three 110-step trainers at once
# took 34.5 s and 52.0 s of CPU with TensorFlow's pools, 25.3 s and 45.9 s with one (2026-11-28).
os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")

# The slowest modules, longest first (each alone with `--durations=15`, 2026-11-28; docs/tests.md;
# test_lan_mirrored.py came out of test_multihost.py, which had taken 20 minutes of one worker's run
# at 12da41d, 2026-12-02):
# xdist hands a whole module (--dist loadfile) to whichever worker is free, so the long ones start
# at once and the short ones fill in at the end, and the workers finish together. But
# test_supervisor.py fourth: its stand-in tasks wait (67 s, 3 s of CPU), so it runs while the
# heaviest use both cores, not later beside other waits (cores idle 5.7% of a run, not 7.8%).
LONGEST_FIRST = (
    "test_multihost.py",
    "test_faults_trainer.py",
    "test_lan_mirrored.py",
    "test_supervisor.py",
    "test_distributed.py",
    "test_readme_lan.py",  # 53 s alone, 107 s beside other work (2026-12-01)
    "test_slurm.py",
    "test_faults.py",
    "test_defects.py",
    "test_trainer.py",
    "test_odapi.py",
    "test_export.py",
    "test_user_inputs.py",
    "test_data.py",
    "test_hostile.py",
    "test_scripts.py",
    "test_devices.py",
    "test_patches.py",
    "test_elastic.py",
    "test_windows.py",
    "test_scaling.py",
    "test_launch.py",
    "test_cli.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a module keeps its order


@pytest.fixture(autouse=True)
def _environment_kept():
    """os.environ as it was before each test, after it: a command that a test runs in its own
    process may set variables for the whole process (`train` takes TF_CONFIG out and may size
    TensorFlow's thread pools by TF_NUM_*_THREADS), which must not reach the next tests of this
    xdist worker or the processes they start."""
    before = dict(os.environ)
    yield
    if os.environ != before:
        for name in set(os.environ) - set(before):
            del os.environ[name]
        os.environ.update(before)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A small shapes dataset (48 training, 8 validation images of 64x64), written once per run
    (per xdist worker) by `od-dist data shapes`, in this process: a child of its own would start
    Python and import TensorFlow once more (3.5 s of CPU), which a run's workers have imported as
    they collected the tests."""
    from od_dist import cli

    out = tmp_path_factory.mktemp("shapes")
    args = ["data", "shapes", f"--out={out}", "--num_train=48", "--num_val=8", "--image_size=64"]
    assert cli.main(["od-dist", *args]) == 0
    return str(out)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
def _netns_available():
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    netns.remove_stale()
    # A SIGTERM (CI timeout, `kill`) would end the run without finalizers or atexit; as an
    # interruption it runs both, so the namespaces go too.
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupt)
    yield
    if previous == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@pytest.fixture
def machines(_netns_available):
    """`machines(n)` -> a tests/netns.Network of n simulated machines (root only; skips
    otherwise), removed with every process in it when the test ends, passed or failed."""
    made = []

    def make(n):
        network = netns.Network(n)
        made.append(network)
        return network

    yield make
    for network in made:
        network.close()


@pytest.fixture
def not_http():
    """A port where something else listens: it answers every connection with a line of no HTTP."""
    server = socket.create_server(("127.0.0.1", 0))

    def answer():
        while True:
            try:
                client, _ = server.accept()
            except OSError:  # closed: the test is over
                return
            with client:
                client.recv(1024)
                client.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")

    threading.Thread(target=answer, daemon=True).start()
    with server:
        yield server.getsockname()[1]
