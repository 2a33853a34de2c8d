"""The table of what each role does under each strategy, and the places that read it."""

import pytest

from od_dist.cluster import duties, spec
from od_dist.cluster.validate import ROLES, STRATEGIES
from od_dist.host import cpu_budget, policy

PS, MWMS = "parameter_server", "multi_worker_mirrored"
TRAIN, VAL = ("train_data",), ("validation_data",)  # training reads no validation records


def test_every_role_a_cluster_file_can_make_is_in_the_table():
    for strategy in STRATEGIES:
        for role in ROLES:
            if (strategy, role) != (MWMS, "ps"):  # validate refuses a ps under multi_worker_mirrored
                duties.of(strategy, role)
    duties.of("mirrored", "single")
    with pytest.raises(KeyError):
        duties.of(MWMS, "ps")


@pytest.mark.parametrize(
    "strategy, role, replicas, server, data, coordinator, light, trainer",
    [
        (PS, "master", False, False, TRAIN, True, True, True),
        (PS, "worker", True, True, TRAIN, False, False, False),
        (PS, "ps", False, True, (), False, True, False),
        (PS, "evaluator", False, False, VAL, False, True, False),
        (MWMS, "master", True, False, TRAIN, False, False, True),
        (MWMS, "worker", True, False, TRAIN, False, False, True),
        (MWMS, "evaluator", False, False, VAL, False, True, False),
        ("mirrored", "single", True, False, TRAIN, False, False, True),
    ],
)
def test_what_each_role_does(strategy, role, replicas, server, data, coordinator, light, trainer):
    d = duties.of(strategy, role)
    assert (d.runs_replicas, d.is_server, d.reads_records) == (replicas, server, data)
    assert (d.is_coordinator, d.mostly_waits, d.is_trainer) == (coordinator, light, trainer)
    # The places that used to decide it themselves now read the table.
    assert policy.is_trainer(strategy, role) == trainer
    assert cpu_budget.mostly_waits(role, strategy) == light
    if role != "single":
        doc = {"master": "127.0.0.1:2230", "worker": ["127.0.0.1:2231"], "evaluator": "127.0.0.1"}
        if strategy == PS:
            doc["ps"] = ["127.0.0.1:2232"]
        assert spec.from_document(doc).runs_replicas(role) == replicas
