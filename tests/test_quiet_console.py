"""Lines a person reads as a failure, or as noise, kept off the console in real processes: TensorFlow's
device probe in a command that uses no device, its ERROR for a checkpoint whose files are gone, and
the start-up's measurement lines (in each task's log; on the console only for the benchmarks)."""

import os
import subprocess
import sys
import textwrap

from loopback import PIPELINE, od_dist

from od_dist.task import phases


def test_data_check_keeps_the_device_probe_off_the_console_at_a_users_level_2(data_dir):
    """TF_CPP_MIN_LOG_LEVEL=2 shows TensorFlow's errors, and a machine without a GPU logs its
    failed cuInit as one: `data check`, which uses no device, still shows none of it."""
    r = od_dist(
        "data",
        "check",
        "--records",
        os.path.join(data_dir, "val.tfrecord"),
        env={"TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "cuInit" not in r.stderr and r.stderr == "", r.stderr
    assert r.stdout.splitlines()[-1] == "ok: every record decodes, boxes and ids are valid", r.stdout


def test_the_filter_passes_every_other_line_on():
    """console.without_lines drops only the lines it names: the rest of file descriptor 2 (sys.stderr,
    a C++ library's writes, a last line without its newline) reaches the console as written."""
    code = textwrap.dedent("""
        import os, sys
        from od_dist.host import console
        with console.without_lines(console.DEVICE_PROBE):
            os.write(2, b"E cuda_platform.cc:51] failed call to cuInit: UNKNOWN ERROR (303)\\nkept C++ line\\n")
            print("od-dist: an error line", file=sys.stderr)
            os.write(2, b"no newline")
        print(" after", file=sys.stderr)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "kept C++ line\nod-dist: an error line\nno newline after\n", (
        r.stderr
    )


def test_a_checkpoint_whose_files_are_gone_is_no_error_on_the_console(tmp_path):
    """An evaluator's folder whose `checkpoint` file names ckpt-2 after it was set aside or pruned:
    TensorFlow's latest_checkpoint logs an ERROR and finds none, and the caller goes on. The log
    keeps the line; the console does not show it."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "checkpoint").write_text(f'model_checkpoint_path: "{folder}/ckpt-2"\n')
    log = tmp_path / "logs" / "evaluator-0.log"
    code = textwrap.dedent("""
        import sys
        from od_dist.host import console
        console.setup(sys.argv[1], False)
        import tensorflow as tf
        assert tf.train.latest_checkpoint(sys.argv[2]) is None
    """)
    r = subprocess.run(
        [sys.executable, "-c", code, str(log), str(folder)],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "OD_DIST_TASK_LOG"},
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr == "" and r.stdout == "", r.stderr
    assert f"ERROR tensorflow: Couldn't match files for checkpoint {folder}/ckpt-2" in log.read_text()


def test_a_refusal_is_one_line_and_the_start_up_lines_go_to_the_log(tmp_path):
    """A pipeline refused after TensorFlow's import (an input size the model cannot take) says so in
    one line, with no measurement before it: the threads and start-up phase lines are in the task's
    log. The benchmarks' variable (phases.SHOW_ENV) puts them on the console as well."""
    args = [
        "train",
        f"--pipeline={PIPELINE}",
        f"--model_dir={tmp_path / 'D'}",
        "--params_override=task.model.input_size=[96,96,3]",
    ]
    r = od_dist(*args, env={phases.SHOW_ENV: None})
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith("od-dist: pipeline ") and "multiples of 64" in r.stderr, r.stderr
    log = (tmp_path / "D" / "logs" / "train.log").read_text()
    assert [m["phase"] for m in phases.LINE.finditer(log)] == [
        "TensorFlow imported",
        "Model Garden imported",
    ], log
    assert "single: threads intra-op " in log, log

    r = od_dist(*args, env={phases.SHOW_ENV: "1"})
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    lines = r.stdout.splitlines()
    assert [m["phase"] for m in map(phases.LINE.search, lines) if m] == [
        "TensorFlow imported",
        "Model Garden imported",
    ]
    assert lines[0].startswith("single: threads intra-op "), r.stdout
