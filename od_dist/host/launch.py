"""`od-dist launch` (and `od-dist train` without --role on a machine that holds several entries):
every task of the cluster that lives on this machine, as child processes.

This module starts the processes and carries their output: one console with prefixed lines
(`[worker:1] ...`), one log file per task under <model_dir>/logs/. Which task to restart, stop or
wait for is supervisor.py's (TensorFlow's recovery rules). On Linux each child also gets
PR_SET_PDEATHSIG, so even a launcher killed with SIGKILL leaves no orphan behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from od_dist.cluster.spec import Task
from od_dist.host import policy, supervisor
from od_dist.host.processes import start_child
from od_dist.host.spare import Spare
from od_dist.protocol import notes


@dataclass
class Child(supervisor.Running):
    reader: threading.Thread | None = None


def _pump(stream, prefix: str, log_path: str, lock: threading.Lock) -> None:
    """Copies a child's output to its log and the console until the child closes it. Never stops
    early: a child whose pipe is not drained blocks, and the launcher would wait for it forever.
    A log that cannot be written (full disk) or a console that went away (`launch | head`) is
    dropped with one note; the other keeps getting every line. A resumed run appends to the log."""
    log = None
    try:
        log = open(log_path, "a", encoding="utf-8", errors="replace")
        log.write(f"----- {time.strftime('%Y-%m-%d %H:%M:%S')} {prefix[1:-1]} started -----\n")
        log.flush()
    except OSError as e:
        log = _drop_log(log, log_path, e)
    for line in iter(stream.readline, ""):
        if log is not None:
            try:
                log.write(line)
                log.flush()
            except (OSError, ValueError) as e:
                log = _drop_log(log, log_path, e)
        with lock:
            _write_console(f"{prefix} {line}")
    stream.close()
    if log is not None:
        try:
            log.close()
        except OSError:
            pass


def _drop_log(log, log_path: str, error: Exception) -> None:
    _say(
        f"cannot write {log_path} ({getattr(error, 'strerror', None) or error}); "
        "its lines go to the console only from here"
    )
    if log is not None:
        try:
            log.close()
        except (OSError, ValueError):
            pass
    return None


def _write_console(text: str) -> None:
    """Writes to the launcher's stdout. When nobody reads it any more (`od-dist launch | head`
    exited: EPIPE), stdout is pointed at the null device, so every later write, the launcher's own
    included, succeeds silently and the job goes on, logging to its files."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except (OSError, ValueError):
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass


def _start(task: Task, argv: list[str], log_dir: str, lock: threading.Lock) -> Child:
    log_path = os.path.join(log_dir, f"{task.role}-{task.index}.log")
    proc = start_child(argv, stdout=subprocess.PIPE, task_log=log_path)
    reader = threading.Thread(target=_pump, args=(proc.stdout, f"[{task.name}]", log_path, lock), daemon=True)
    reader.start()
    return Child(task, proc, log_path, reader=reader)


def _say(message: str) -> None:
    _write_console(f"od-dist launch: {message}\n")


def handle_signals(handler) -> dict:
    """Installs handler for SIGINT, SIGTERM (and CTRL_BREAK on Windows); returns the previous ones."""
    names = [n for n in ("SIGINT", "SIGTERM", "SIGBREAK") if hasattr(signal, n)]
    return {getattr(signal, n): signal.signal(getattr(signal, n), handler) for n in names}


REMOTE_LOG_DIR = "od-dist-logs"


def log_dir_for(model_dir: str) -> str:
    """Where the tasks' logs go: <model_dir>/logs, or for a remote model_dir (gs://, s3://, ...),
    which the launcher cannot write without TensorFlow, ./od-dist-logs on this machine."""
    if "://" in model_dir:
        return os.path.abspath(REMOTE_LOG_DIR)
    return os.path.join(model_dir, "logs")


def child_argv(args: list[str]) -> list[str]:
    """This Python running od-dist with `args` (cluster/commandline.py's `train ...`)."""
    return [sys.executable, "-m", "od_dist", *args]


def run(
    strategy: str,
    tasks: list[Task],
    args: dict[Task, list[str]],
    model_dir: str,
    max_restarts: int,
    grace_s: float,
    lead: str | None = None,
    eval_command: str | None = None,
    who: str = "launch",
    elastic=None,
) -> int:
    """Starts the tasks, each with its `args` (`train ...`), supervises and restarts them
    (supervisor.py), returns the job's exit status. `lead`, `eval_command`: supervisor.Supervisor's.
    `who`: the od-dist command that runs them, in its own lines. `elastic`: (say) -> the
    host/elastic.py agreement of an elastic job's trainers here, None for none."""
    log_dir = log_dir_for(model_dir)
    os.makedirs(log_dir, exist_ok=True)
    lock = threading.Lock()

    def say(message: str) -> None:
        _write_console(f"od-dist {who}: {message}\n")

    def start(task: Task) -> Child:
        return _start(task, child_argv(args[task]), log_dir, lock)

    def finish(child: Child) -> None:
        child.reader.join(timeout=5)  # the last lines of a task that exited

    sup = supervisor.Supervisor(
        strategy,
        tasks,
        start,
        say,
        max_restarts,
        grace_s,
        finish=finish,
        lead=lead,
        eval_command=eval_command,
        model_dir=model_dir,
        elastic=elastic(say) if elastic else None,
        stop_file=os.path.abspath(notes.STOP_FILE),
    )
    previous = handle_signals(sup.on_signal)
    try:
        say(
            f"starting {', '.join(t.name for t in tasks)}; logs in {log_dir}; up to {max_restarts} "
            f"restart(s) in a row (--max_restarts)"
        )
        return sup.run()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run_task(
    task: Task,
    strategy: str,
    argv: list[str],
    max_restarts: int,
    grace_s: float,
    tf_config: str | None = None,
    lead: bool = True,
    eval_command: str | None = None,
    model_dir: str | None = None,
    term_to_all: bool = False,
    elastic=None,
) -> int:
    """`od-dist train --max_restarts N`: this machine's one task as a child (its output straight to
    the console), restarted by the same rules and messages as under launch. `lead`: the task writes
    the final checkpoint; `model_dir`: its --model_dir; `term_to_all`: a SIGTERM reaches the
    master too (a Slurm task), so a server serves on until the master has saved; `elastic`: as
    for run()."""

    def say(message: str) -> None:
        print(f"od-dist train: {message}", file=sys.stderr, flush=True)

    warm = Spare(argv, tf_config) if policy.is_trainer(strategy, task.role) else None
    sup = supervisor.Supervisor(
        strategy,
        [task],
        lambda t: supervisor.Running(t, warm.start() if warm else start_child(argv, tf_config=tf_config)),
        say,
        max_restarts,
        grace_s,
        lead=task.name if lead else None,
        eval_command=eval_command,
        model_dir=model_dir,
        term_to_all=term_to_all,
        elastic=elastic(say) if elastic else None,
        stop_file=os.path.abspath(notes.STOP_FILE),
        spare=warm,
    )
    previous = handle_signals(sup.on_signal)
    try:
        return sup.run()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


_CHECK_PIPELINE = """
import sys
from od_dist.model import batch, pipeline
try:
    params = pipeline.load_pipeline(sys.argv[1], sys.argv[2] or None, sys.argv[3])
    for split in (int(a[len("split="):]) for a in sys.argv[4:] if a.startswith("split=")):
        batch.split_over_replicas(params, split)
    pipeline.check_inputs(params, sys.argv[1], train="train" in sys.argv[4:], evaluate="eval" in sys.argv[4:])
    pipeline.check_model(params, sys.argv[1])
except pipeline.PipelineError as e:
    print(e, file=sys.stderr)
    sys.exit(2)
"""


def check_pipeline(
    path: str, params_override: str | None, strategy: str, train: bool, evaluate: bool, split: int = 1
) -> tuple[int, str]:
    """Loads the pipeline as the trainers will, checks the records the tasks here open (`train`:
    a trainer is here; `evaluate`: an evaluator), that its batch splits over the `split` replicas
    in sync that share it, and builds its model once (pipeline.check_model), before any task
    starts: (0, '') when it is good,
    (2, the one-line problem) when it is not, (1, what went wrong) when the check itself failed.
    It runs in a short-lived child so TensorFlow stays out of the launcher, which forks every task."""
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            _CHECK_PIPELINE,
            path,
            params_override or "",
            strategy,
            *(["train"] if train else []),
            *(["eval"] if evaluate else []),
            *([f"split={split}"] if split > 1 else []),
        ],
        capture_output=True,
        text=True,
        encoding="utf-8",
        errors="replace",
        stdin=subprocess.DEVNULL,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    )
    if r.returncode == 0:
        return 0, ""
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    if r.returncode == 2:
        return 2, lines[-1] if lines else "invalid pipeline"
    return 1, f"could not check the pipeline (exit {r.returncode}): {lines[-1] if lines else 'no output'}"
