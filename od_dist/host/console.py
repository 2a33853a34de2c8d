"""What a task shows on its console, and what goes to its log file.

The console shows od-dist's own lines (ready, progress, results, errors) and real warnings, each
warning once. Everything else goes to the task's log file: TensorFlow's C++ log lines, library log
records, Python warnings, what libraries print (pycocotools' tables, Model Garden's metric
dicts) and od-dist's own start-up measurements (task/phases.py). `--verbose` leaves every stream
as it is.

How, without touching TensorFlow: file descriptor 2, where TensorFlow's C++ logging writes, is
pointed at the log file; `sys.stderr` stays on the console (od-dist's error lines, tracebacks,
the hang guard's dump); `sys.stdout` sends what od-dist's own modules (and orbit, the training
loop) print to the console and anything else to the log; Python logging (absl, TensorFlow,
captured warnings) writes every record to the log and WARNING and above to the console, once
each, apart from known harmless ones. Set up before TensorFlow is imported (TensorFlow adds its
own handler when the root logger has none)."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import threading

# Warnings (and an error) of libraries that say nothing about the user's job: the log keeps them.
HARMLESS = (
    "Gradients do not exist for variables",  # heads a detection loss leaves unused in a step
    "Input dict contained keys",  # tf_keras: the detector's input dict carries extra keys
    # A checkpoint saved from several tasks (parameter_server): TensorFlow retraces its save
    # function on purpose at every save, and warns of it from the fifth save on.
    "MultiDeviceSaver.save.<locals>.tf_function_save",
    # An ERROR of TensorFlow's latest_checkpoint: the `checkpoint` file names a checkpoint whose
    # files are gone (set aside by --new_run or a follower's fetch, pruned by max_to_keep while an
    # evaluator looked). It then finds none and the caller goes on: to wait for the next (an
    # evaluator), or to od-dist's own line of what is missing.
    "Couldn't match files for checkpoint",
)

# TensorFlow's C++ lines that a command running nothing on a device keeps off its console even at
# a TF_CPP_MIN_LOG_LEVEL that shows errors (2, od-dist's default and a common setting of users'):
# its device probe on a machine without a GPU, an ERROR that says nothing of the command's work.
DEVICE_PROBE = ("failed call to cuInit",)

# Whose prints the console shows: od-dist's, and orbit's short lines (checkpoint restored, saved,
# "training until step N"; its metric dicts go to the log: trainer.py).
CONSOLE_MODULES = ("od_dist", "orbit")

LOG_ENV = "OD_DIST_TASK_LOG"  # set by `launch`: the log file it writes the task's console lines to


class _ByOrigin(io.TextIOBase):
    """sys.stdout: what od-dist's own modules (and orbit) print goes to the console (and, when no
    launcher copies the console into the log, to the log as well); anything else to the log only."""

    def __init__(self, console, log, copy_to_log: bool):
        self._console, self._log, self._copy = console, log, copy_to_log

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        caller = sys._getframe(1).f_globals.get("__name__", "")  # print() is C: frame 1 called it
        if caller.split(".")[0] in CONSOLE_MODULES:
            self._console.write(text)
            if self._copy:
                self._log.write(text)
        else:
            self._log.write(text)
        return len(text)

    def flush(self) -> None:
        self._console.flush()
        self._log.flush()

    def to_log(self, text: str) -> None:
        self._log.write(text)
        self._log.flush()


class _ConsoleWarnings(logging.Filter):
    """WARNING and above, each message once, without the harmless ones."""

    def __init__(self):
        super().__init__()
        self._seen = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if any(h in message for h in HARMLESS):
            return False
        key = (record.name, message)
        if key in self._seen:
            return False
        self._seen.add(key)
        return True


def to_log(line: str) -> None:
    """`line` in the task's log only (measurements: task/phases.py). Without a log of its own
    (--verbose, no log path, a library's caller) it is printed, as every other line is then."""
    if isinstance(sys.stdout, _ByOrigin):
        sys.stdout.to_log(line + "\n")
    else:
        print(line, flush=True)


@contextlib.contextmanager
def without_lines(dropped=DEVICE_PROBE):
    """Within it, file descriptor 2 (where TensorFlow's C++ log writes, and sys.stderr) passes
    through a filter: a line holding any of `dropped` is left out, every other goes on to the
    console as it was written. For a command without a log file of its own (`data check`)."""
    sys.stderr.flush()
    console = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    marks = [d.encode() for d in dropped]

    def pump():
        with open(read_end, "rb") as lines:
            for line in lines:
                if not any(m in line for m in marks):
                    view = memoryview(line)
                    while view:
                        view = view[os.write(console, view) :]

    reader = threading.Thread(target=pump, name="od-dist stderr filter", daemon=True)
    reader.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(console, 2)  # the pipe's last write end closed: the reader passes on the rest and ends
        reader.join(timeout=5)  # a child still holding the pipe would keep it open
        os.close(console)


def task_log_path(model_dir: str | None, name: str) -> str | None:
    """The log file of a task: the launcher's when it runs us, else <model_dir>/logs/<name>.log
    (None without a local model_dir: then nothing is redirected)."""
    if os.environ.get(LOG_ENV):
        return os.environ[LOG_ENV]
    if not model_dir or "://" in model_dir:
        return None
    return os.path.join(model_dir, "logs", f"{name}.log")


def setup(log_path: str | None, verbose: bool) -> str | None:
    """Routes this process's output as the module says. Returns the log file in use, or None
    (verbose, no log path, or a log that cannot be written: then everything stays on the console)."""
    if verbose or not log_path:
        return None
    try:
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        log = open(log_path, "a", encoding="utf-8", errors="backslashreplace", buffering=1)
    except OSError:
        return None
    copy_console = not os.environ.get(LOG_ENV)  # under launch, launch writes the console lines there
    sys.stdout.flush()
    sys.stderr.flush()
    console_err = os.fdopen(os.dup(2), "w", encoding="utf-8", errors="backslashreplace", buffering=1)
    os.dup2(log.fileno(), 2)  # TensorFlow's C++ log lines
    sys.stderr = console_err
    sys.stdout = _ByOrigin(sys.stdout, log, copy_console)

    root = logging.getLogger()
    root.setLevel(logging.INFO)
    to_log = logging.StreamHandler(log)
    to_log.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    to_console = logging.StreamHandler(console_err)
    to_console.setLevel(logging.WARNING)
    to_console.addFilter(_ConsoleWarnings())
    to_console.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root.handlers = [to_log, to_console]
    logging.captureWarnings(True)
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.INFO)  # its INFO records (Model Garden's) go to the log
    return log_path
