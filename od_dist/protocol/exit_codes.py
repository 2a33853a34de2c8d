"""Exit codes: permanent (do not retry) and retryable (restart, and the job resumes from its last
checkpoint). One table for od-dist, its supervisors and orchestrators.

The retryable codes are the ones Kubeflow's `restartPolicy: ExitCode` retries (130, 137, 143, and
138 "reserved for user-defined retries"); every other non-zero code is permanent there too, so a
TFJob restarts exactly the pods od-dist would restart itself.
"""

from __future__ import annotations

import os

OK = 0
FAILED = 1  # permanent: a bug or an unrecoverable runtime failure (no checkpoint to evaluate, ...)
INVALID = 2  # permanent: invalid input (cluster file, flag, pipeline); nothing was started
LOST_PEER = (
    138  # retryable: a peer was lost (ps, master, an all-reduce trainer, every parameter_server worker)
)
# or did not come within --wait_timeout (a late pod or machine is there at the next try)
INTERRUPTED = 130  # retryable: SIGINT (Ctrl+C); a trainer saved a checkpoint first
KILLED = 137  # retryable: SIGKILL (128 + 9), as a shell or Kubernetes reports it
TERMINATED = 143  # retryable: SIGTERM (128 + 15); a trainer saved a checkpoint first

RETRYABLE = frozenset({LOST_PEER, INTERRUPTED, KILLED, TERMINATED})

# What each code means, in one line each: `od-dist --help` lists them from here.
MEANINGS = {
    OK: "ok",
    FAILED: "runtime failure",
    INVALID: "invalid input (nothing was started)",
    INTERRUPTED: "interrupted by Ctrl+C (SIGINT)",
    KILLED: "killed (SIGKILL)",
    LOST_PEER: "a peer was lost or did not come within --wait_timeout",
    TERMINATED: "terminated (SIGTERM)",
}


def summary() -> str:
    """Every code and what it means, permanent ones first: for `od-dist --help`."""
    permanent = [f"{c} {m}" for c, m in MEANINGS.items() if c not in RETRYABLE]
    retryable = [f"{c} {m}" for c, m in MEANINGS.items() if c in RETRYABLE]
    return (
        f"{', '.join(permanent)}; retryable (a restart resumes training from the last "
        f"checkpoint): {', '.join(retryable)}; any other code is permanent."
    )


def normalize(returncode: int) -> int:
    """A child's return code as a shell reports it: Popen's -N (killed by signal N) is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def is_retryable(returncode: int) -> bool:
    return normalize(returncode) in RETRYABLE


# A task run by od-dist's own supervisor (launch, train --max_restarts) can say more than its exit
# code, which stays the table's for Kubernetes: a file named <its pid>.<word> in this folder (one
# folder per start of a task, removed once it exited: a PID is reused).
NOTES_ENV = "OD_DIST_SUPERVISOR_NOTES"
WAITED_OUT = "waited-out"  # exit 138 after --wait_timeout without a peer: a restart would wait again


def tell_supervisor(word: str) -> None:
    """Leaves `word` for this process's supervisor, if it has one."""
    folder = os.environ.get(NOTES_ENV)
    if folder:
        try:
            with open(os.path.join(folder, f"{os.getpid()}.{word}"), "w"):
                pass
        except OSError:
            pass  # the supervisor then restarts it, as for any 138


def told(folder: str, pid: int, word: str) -> bool:
    """Whether the child `pid` left `word` in `folder` (tell_supervisor)."""
    return os.path.exists(os.path.join(folder, f"{pid}.{word}"))
