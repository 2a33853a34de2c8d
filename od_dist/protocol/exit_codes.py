"""Exit codes: permanent (do not retry) and retryable (restart, and the job resumes from its last
checkpoint). One table for od-dist, its supervisors and orchestrators.

The retryable codes are the ones Kubeflow's `restartPolicy: ExitCode` retries (130, 137, 143, and
138 "reserved for user-defined retries"); every other non-zero code is permanent there too, so a
TFJob restarts exactly the pods od-dist would restart itself.
"""

from __future__ import annotations

import signal

OK = 0
FAILED = 1  # permanent: a bug or an unrecoverable runtime failure (no checkpoint to evaluate, ...)
INVALID = 2  # permanent: invalid input (cluster file, flag, pipeline); nothing was started
LOST_PEER = (
    138  # retryable: a peer was lost (ps, master, an all-reduce trainer, every parameter_server worker)
)
# or did not come within --wait_timeout (a late pod or machine is there at the next try)
# A trainer stopped by SIGINT or SIGTERM saves a checkpoint first; one that overran --grace_period
# was killed before its save, and its supervisor's last line names the step a restart resumes from.
INTERRUPTED = 130  # retryable: SIGINT (Ctrl+C)
KILLED = 137  # retryable: SIGKILL (128 + 9), as a shell or Kubernetes reports it
TERMINATED = 143  # retryable: SIGTERM (128 + 15)

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


def for_signal(signum: int) -> int:
    """The exit code of a process stopped by signal `signum`: SIGTERM (the system's: a drained node,
    scancel, a launcher) 143; any other (SIGINT, SIGBREAK: a person's Ctrl+C or Ctrl+Break) 130.
    A task takes its supervisor's CTRL_BREAK for the SIGTERM it stands for (task/stop.py meant)."""
    return TERMINATED if signum == signal.SIGTERM else INTERRUPTED


def asked_by(code: int) -> str:
    """Who a stop's exit code says asked for it: the system (SIGTERM) or a person (Ctrl+C)."""
    return "SIGTERM" if code == TERMINATED else "Ctrl+C"
