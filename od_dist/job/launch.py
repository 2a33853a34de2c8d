"""`od-dist launch`: every task of the cluster that lives on this machine, as child processes.

One console with prefixed lines (`[worker:1] ...`), one log file per task under
<model_dir>/logs/, and one fate: when a task fails or the user presses Ctrl+C, every other task is
stopped too. On Linux each child also gets PR_SET_PDEATHSIG, so even a launcher killed with
SIGKILL leaves no orphan behind.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from od_dist.cluster.spec import Task

SERVER_GRACE_S = 60.0  # servers stop by themselves within this after the master is done
TERMINATE_GRACE_S = 10.0


@dataclass
class Child:
    task: Task
    proc: subprocess.Popen
    log_path: str
    reader: threading.Thread


def _die_with_parent_hook():
    """A pre-exec hook: the kernel sends the child SIGTERM when the launcher dies. libc is loaded
    here, in the parent (loading a library in a forked child of a threaded parent can deadlock),
    and the child exits at once if the launcher died before the hook ran."""
    try:
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:
        return None
    parent = os.getpid()

    def hook():
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)

    return hook


def _pump(stream, prefix: str, log_path: str, lock: threading.Lock) -> None:
    """Copies a child's output to its log and the console until the child closes it. Never stops
    early: a child whose pipe is not drained blocks, and the launcher would wait for it forever.
    A log that cannot be written (full disk) or a console that went away (`launch | head`) is
    dropped with one note; the other keeps getting every line. A resumed run appends to the log."""
    log = None
    try:
        log = open(log_path, "a", encoding="utf-8", errors="replace")
        log.write(f"----- {time.strftime('%Y-%m-%d %H:%M:%S')} {prefix[1:-1]} started -----\n")
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
    _say(f"cannot write {log_path} ({getattr(error, 'strerror', None) or error}); "
         "its lines go to the console only from here")
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
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TF_CONFIG", None)  # the child gets its task from --cluster/--role/--index
    kwargs = {}
    if os.name == "nt":
        kwargs["creationflags"] = subprocess.CREATE_NEW_PROCESS_GROUP
    elif sys.platform.startswith("linux"):
        kwargs["preexec_fn"] = _die_with_parent_hook()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            text=True, encoding="utf-8", errors="replace", bufsize=1, env=env, **kwargs)
    log_path = os.path.join(log_dir, f"{task.role}-{task.index}.log")
    reader = threading.Thread(target=_pump, args=(proc.stdout, f"[{task.name}]", log_path, lock), daemon=True)
    reader.start()
    return Child(task, proc, log_path, reader)


def _stop(children: list[Child]) -> None:
    """SIGTERM (CTRL_BREAK on Windows) to every live child, then SIGKILL after a grace period."""
    live = [c for c in children if c.proc.poll() is None]
    for c in live:
        try:
            c.proc.send_signal(signal.CTRL_BREAK_EVENT if os.name == "nt" else signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for c in live:
        try:
            c.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()
    for c in children:
        c.reader.join(timeout=5)


def _say(message: str) -> None:
    _write_console(f"od-dist launch: {message}\n")


def run(cluster_path: str, tasks: list[Task], train_args: list[str], model_dir: str) -> int:
    """Starts the tasks, supervises them, returns 0 when the job finished cleanly."""
    log_dir = os.path.join(model_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    lock = threading.Lock()
    children: list[Child] = []
    interrupted = []

    def on_signal(signum, _frame):
        interrupted.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for task in tasks:
            argv = [sys.executable, "-m", "od_dist", "train", f"--cluster={cluster_path}", f"--role={task.role}",
                    f"--index={task.index}", *train_args]
            children.append(_start(task, argv, log_dir, lock))
        _say(f"started {', '.join(c.task.name for c in children)}; logs in {log_dir}")
        return _supervise(children, interrupted)
    finally:
        _stop(children)
        for s, handler in previous.items():
            signal.signal(s, handler)


def _supervise(children: list[Child], interrupted: list) -> int:
    has_master = any(c.task.role == "master" for c in children)
    trainers_done_at = None
    while True:
        if interrupted:
            _say("interrupted; stopping every task")
            return 130
        for c in children:
            code = c.proc.poll()
            if code not in (None, 0):
                _say(f"{c.task.name} failed (exit {code}); stopping the others. Its log: {c.log_path}")
                return 1
        running = [c for c in children if c.proc.poll() is None]
        if not running:
            _say("every task finished")
            return 0
        # Training is over when no trainer (master, all-reduce worker) is left running; then
        # servers must stop by themselves soon, and the evaluator after the final checkpoint.
        if has_master and trainers_done_at is None and not any(c.task.role == "master" for c in running):
            trainers_done_at = time.monotonic()
        if trainers_done_at is not None and time.monotonic() - trainers_done_at > SERVER_GRACE_S:
            if all(c.task.role in ("ps", "worker") for c in running):
                _say(f"{', '.join(c.task.name for c in running)} still running {SERVER_GRACE_S:.0f} s after "
                     "the master finished; stopping them")
                return 1
        time.sleep(0.2)


_CHECK_PIPELINE = """
import sys
from od_dist.model import pipeline
try:
    pipeline.load_pipeline(sys.argv[1], sys.argv[2] or None, sys.argv[3])
except pipeline.PipelineError as e:
    print(e, file=sys.stderr)
    sys.exit(2)
"""


def check_pipeline(path: str, params_override: str | None, strategy: str) -> tuple[int, str]:
    """Loads the pipeline as the trainers will, before any task starts: (0, '') when it is good,
    (2, the one-line problem) when it is not, (1, what went wrong) when the check itself failed.
    It runs in a short-lived child so TensorFlow stays out of the launcher, which forks every task."""
    r = subprocess.run([sys.executable, "-c", _CHECK_PIPELINE, path, params_override or "", strategy],
                       capture_output=True, text=True, encoding="utf-8", errors="replace",
                       stdin=subprocess.DEVNULL, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    if r.returncode == 0:
        return 0, ""
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    if r.returncode == 2:
        return 2, lines[-1] if lines else "invalid pipeline"
    return 1, f"could not check the pipeline (exit {r.returncode}): {lines[-1] if lines else 'no output'}"
