"""What each role does under each strategy: the one table the cluster model, a task's set-up, the
supervisor, the thread budgets, doctor and the generated scripts and manifests read.

Roles are the cluster file's words; `single` is one machine without a cluster (strategy
`mirrored`). No TensorFlow here.
"""

from __future__ import annotations

from dataclasses import dataclass

from od_dist.cluster.validate import MULTI_WORKER_MIRRORED, PARAMETER_SERVER

MIRRORED = "mirrored"


@dataclass(frozen=True)
class Duties:
    runs_replicas: bool  # holds the model's replicas: --num_clones devices are its own
    is_server: bool  # a TensorFlow server that runs what the master schedules, until told to stop
    reads_records: tuple[str, ...]  # the pipeline's record splits it opens (or lists) on its machine
    is_coordinator: bool  # drives the steps from outside the replicas (the parameter_server client)
    mostly_waits: bool  # mostly waits while the others compute: a small thread budget
    is_trainer: bool  # trains and saves checkpoints: stopped first, given time to save


# The pipeline's record splits (its task.train_data and task.validation_data).
RECORD_SPLITS = ("train_data", "validation_data")
# Training reads the training records only (Model Garden's mode 'train'); the validation records
# are the evaluator's (and `od-dist eval`'s).
_TRAIN, _VAL = ("train_data",), ("validation_data",)
#                    replicas server records                coord  light  trainer
_PS_MASTER = Duties(False, False, _TRAIN, True, True, True)  # lists the files its workers read
_PS_WORKER = Duties(True, True, _TRAIN, False, False, False)
_PS = Duties(False, True, (), False, True, False)
_EVALUATOR = Duties(False, False, _VAL, False, True, False)
_TRAINER = Duties(True, False, _TRAIN, False, False, True)

TABLE: dict[tuple[str, str], Duties] = {
    (PARAMETER_SERVER, "master"): _PS_MASTER,
    (PARAMETER_SERVER, "worker"): _PS_WORKER,
    (PARAMETER_SERVER, "ps"): _PS,
    (PARAMETER_SERVER, "evaluator"): _EVALUATOR,
    (MULTI_WORKER_MIRRORED, "master"): _TRAINER,
    (MULTI_WORKER_MIRRORED, "worker"): _TRAINER,
    (MULTI_WORKER_MIRRORED, "evaluator"): _EVALUATOR,
    (MIRRORED, "single"): _TRAINER,
}


def of(strategy: str, role: str) -> Duties:
    """The duties of `role` under `strategy` (KeyError for a pair no cluster file can make)."""
    return TABLE[(strategy, role)]
