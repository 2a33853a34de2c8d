"""What a task shows on its console and what goes to its log (od_dist/host/console.py), in a real
child process: TensorFlow's C++ lines (written to file descriptor 2), library prints and log
records go to the log; od-dist's lines and real warnings, once each, to the console."""

import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import logging, os, sys, warnings
    from od_dist.host import console
    console.setup(sys.argv[1], sys.argv[2] == "1")
    exec('print("od-dist progress line")', {"__name__": "od_dist.task.trainer"})
    exec('print("pycocotools table line")', {"__name__": "pycocotools.cocoeval"})
    exec('print("saved checkpoint to ckpt-5.")', {"__name__": "orbit.controller"})
    os.write(2, b"I0000 grpc_server_lib.cc C++ line\\n")
    for _ in range(3):
        logging.getLogger("tensorflow").warning("a real warning")
    logging.getLogger("absl").warning("Gradients do not exist for variables ['x']")
    logging.getLogger("absl").info("an info record")
    warnings.warn("Input dict contained keys ['6']")
    logging.getLogger("tensorflow").warning(
        "5 out of the last 5 calls to <function MultiDeviceSaver.save.<locals>.tf_function_save at "
        "0x7f0> triggered tf.function retracing."
    )
    print("od-dist: an error line", file=sys.stderr)
""")


def run_child(tmp_path, verbose, env_log=None):
    env = {k: v for k, v in os.environ.items() if k != "OD_DIST_TASK_LOG"}
    if env_log:
        env["OD_DIST_TASK_LOG"] = env_log
    log = str(tmp_path / "logs" / "worker-0.log")
    r = subprocess.run(
        [sys.executable, "-c", CHILD, log, "1" if verbose else "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout, r.stderr, (open(log).read() if os.path.exists(log) else "")


def test_console_shows_od_dist_lines_and_real_warnings_once(tmp_path):
    out, err, log = run_child(tmp_path, verbose=False)
    assert out == "od-dist progress line\nsaved checkpoint to ckpt-5.\n"
    assert err.splitlines() == ["WARNING tensorflow: a real warning", "od-dist: an error line"]
    for detail in (
        "pycocotools table line",
        "C++ line",
        "Gradients do not exist",
        "an info record",
        "Input dict contained keys",
        "tf_function_save at 0x7f0> triggered tf.function retracing",
        "od-dist progress line",
    ):
        assert detail in log, detail
    assert log.count("a real warning") == 3  # the log keeps every one


def test_under_launch_the_log_gets_the_detail_only(tmp_path):
    """launch copies the console lines into the same file itself: no duplicates."""
    log = str(tmp_path / "logs" / "worker-0.log")
    out, _, text = run_child(tmp_path, verbose=False, env_log=log)
    assert out == "od-dist progress line\nsaved checkpoint to ckpt-5.\n"
    assert "C++ line" in text and "pycocotools table line" in text
    assert "od-dist progress line" not in text


def test_verbose_brings_everything_back(tmp_path):
    out, err, log = run_child(tmp_path, verbose=True)
    assert "pycocotools table line" in out and "od-dist progress line" in out
    assert "C++ line" in err
    assert log == ""
