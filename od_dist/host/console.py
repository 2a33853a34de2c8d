"""What a task shows on its console, and what goes to its log file.

The console shows od-dist's own lines (ready, progress, results, errors) and real warnings, each
warning once. Everything else goes to the task's log file: TensorFlow's C++ log lines, library log
records, Python warnings and what libraries print (pycocotools' tables, Model Garden's metric
dicts). `--verbose` leaves every stream as it is.

How, without touching TensorFlow: file descriptor 2, where TensorFlow's C++ logging writes, is
pointed at the log file; `sys.stderr` stays on the console (od-dist's error lines, tracebacks,
the hang guard's dump); `sys.stdout` sends what od-dist's own modules (and orbit, the training
loop) print to the console and anything else to the log; Python logging (absl, TensorFlow,
captured warnings) writes every record to the log and WARNING and above to the console, once
each, apart from known harmless ones. Set up before TensorFlow is imported (TensorFlow adds its
own handler when the root logger has none)."""

from __future__ import annotations

import io
import logging
import os
import sys

# Warnings every run prints that say nothing about the user's job: the log keeps them.
HARMLESS = (
    "Gradients do not exist for variables",  # heads a detection loss leaves unused in a step
    "Input dict contained keys",  # tf_keras: the detector's input dict carries extra keys
    # A checkpoint saved from several tasks (parameter_server): TensorFlow retraces its save
    # function on purpose at every save, and warns of it from the fifth save on.
    "MultiDeviceSaver.save.<locals>.tf_function_save",
)

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
