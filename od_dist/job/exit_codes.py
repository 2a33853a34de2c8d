"""Exit codes: permanent (do not retry) and retryable (restart, and the job resumes from its last
checkpoint). One table for od-dist, its supervisors and orchestrators.

The retryable codes are the ones Kubeflow's `restartPolicy: ExitCode` retries (130, 137, 143, and
138 "reserved for user-defined retries"); every other non-zero code is permanent there too, so a
TFJob restarts exactly the pods od-dist would restart itself.
"""

from __future__ import annotations

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


def normalize(returncode: int) -> int:
    """A child's return code as a shell reports it: Popen's -N (killed by signal N) is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def is_retryable(returncode: int) -> bool:
    return normalize(returncode) in RETRYABLE
