"""Findings of issue 73 fixed in the host side's own rules (host/agreement.py, host/rounds.py,
host/elastic.py), each test reproducing one: the coordinator's lease against the look cycle
(finding 5), a DONE of an earlier run (finding 8), and failures nobody was charged for (finding 7).
Fast tests of the real objects: Agreement and Elastic on loopback, the supervisor's own step, the
agreement's model; no TensorFlow, no network namespaces."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from loopback import od_dist
from test_agreement_model import scenario
from test_elastic import HOSTS, _free_port, cluster_of

from od_dist.cluster import spec
from od_dist.cluster.spec import InvalidCluster
from od_dist.host import agreement, config, elastic, lease, supervisor
from od_dist.host.processes import Running
from od_dist.protocol import membership

ALL3 = ("master:0", "worker:0", "worker:1")
RUN, EARLIER = "bbbbbbbbbbbb", "aaaaaaaaaaaa"


def state(cluster, index: int, phase: str, round_: int = 1, run=None, step: int = 0, **more) -> dict:
    """A machine's membership state, as Agreement.state says it."""
    return {
        "job": cluster.job_id(),
        "trainers": [cluster.members()[index].name],
        "phase": phase,
        "round": round_,
        "members": list(ALL3) if phase != membership.FORMING else [],
        "step": step,
        "step_round": 0,
        "run": run,
        "stopping": False,
        "cooling": 0.0,
        "sees": [],
        "history": [],
        **more,
    }


def agreement_of(cluster, index: int, lines: list, clock, **kwargs) -> agreement.Agreement:
    return agreement.Agreement(
        cluster,
        (cluster.members()[index],),
        lines.append,
        60.0,
        newest_step=kwargs.pop("newest_step", lambda: None),
        batch_problem=lambda members: None,
        clock=clock,
        **kwargs,
    )


# ----- finding 5: the lease and the look cycle -------------------------------------------------


def test_a_lost_peer_timeout_whose_lease_is_shorter_than_two_looks_is_refused_before_anything_starts():
    """Finding 5: --lost_peer_timeout 7 or less gave an elastic parameter_server coordinator a
    lease (0.6 x it) of 4.2 s or less, shorter than the gap between two looks that renew it with a
    machine silent: a healthy coordinator was killed without a save every few seconds. Now the
    lease is two look cycles (6 s) and a --lost_peer_timeout that cannot give it is refused, in one
    line naming the flag, the value and the fix; multi_worker_mirrored (no lease) and a job without
    min_trainers take any value as before."""
    assert lease.LEASE_S == 2 * (lease.LOOK_EVERY_S + membership.TIMEOUT_S) == 6.0
    assert lease.lease_for(10) == lease.LEASE_S

    def checked(cluster, lost_peer_timeout):
        task = cluster.members()[0]
        selected = config.TaskConfig(cluster, task, "lan.yaml", "")
        return config.train_config(
            selected,
            "p.yaml",
            "m",
            None,
            False,
            None,
            300,
            lost_peer_timeout=lost_peer_timeout,
            files_here=False,
        )

    ps = cluster_of(3, 2, "parameter_server")
    for timeout in (1, 5, 7, 9):
        with pytest.raises(InvalidCluster) as refused:
            checked(ps, timeout)
        assert refused.value.problems == [
            f"--lost_peer_timeout: '{timeout}': an elastic parameter_server job's coordinator would hold a "
            f"lease of {0.6 * timeout:.1f} s (0.6 x it), shorter than two of its looks at the other machines "
            "(6 s with one of them silent): a healthy coordinator would be killed without a save; pass "
            "--lost_peer_timeout 10 or more (the default is 10)"
        ], refused.value.problems
    assert checked(ps, 10).lost_peer_timeout == 10
    assert checked(cluster_of(3, 2), 5).lost_peer_timeout == 5  # multi_worker_mirrored: no lease
    fixed = spec.from_document(
        {
            "strategy": "parameter_server",
            "master": "10.9.0.1:2222",
            "worker": ["10.9.0.2:2222"],
            "ps": ["10.9.0.9:2223"],
        }
    )
    assert checked(fixed, 5).lost_peer_timeout == 5  # not elastic: no lease


def test_the_refusal_is_the_commands_one_line_and_exit_2(tmp_path):
    """Finding 5, as a person meets it: `od-dist train --lost_peer_timeout 5` on a machine of an
    elastic parameter_server job exits 2 with that line (under InvalidCluster's header naming the
    cluster file) and starts nothing. Before, it trained
    with a 3 s lease."""
    path = tmp_path / "elastic.yaml"
    path.write_text(
        "strategy: parameter_server\nmaster: 127.0.0.1:2322\nworker: [127.0.0.1:2323, 127.0.0.1:2324]\n"
        "ps: [127.0.0.1:2325]\nmin_trainers: 2\nmembership_port: 2326\ncheckpoint_port: 2327\n"
    )
    r = od_dist(
        "train",
        f"--cluster={path}",
        "--role=worker",
        "--index=0",
        "--max_restarts=3",
        "--lost_peer_timeout=5",
        "--wait_timeout=1",  # before: no refusal, this machine alone waited for peers, then 138
        "--pipeline=pipelines/shapes_retinanet.yaml",
        f"--model_dir={tmp_path / 'm'}",
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    header, *problems = r.stderr.strip().splitlines()
    assert header == f"od-dist train: invalid input ({path}):", (
        r.stderr
    )  # InvalidCluster's, as for every flag
    assert [p.strip() for p in problems] == [
        "--lost_peer_timeout: '5': an elastic parameter_server job's coordinator would hold a lease of 3.0 s "
        "(0.6 x it), shorter than two of its looks at the other machines (6 s with one of them silent): a "
        "healthy coordinator would be killed without a save; pass --lost_peer_timeout 10 or more (the "
        "default is 10)"
    ], r.stderr


def test_the_looker_refuses_a_lease_shorter_than_two_of_its_looks():
    """Finding 5, in the object that renews the lease: an Elastic given the 3 s lease
    --lost_peer_timeout 5 made is refused at once (two of its looks with a machine silent are
    2 x (1 + 2) s); before, it took it."""
    cluster = cluster_of(3, 2, "parameter_server")

    def made(lease_s):
        return elastic.Elastic(
            cluster,
            (cluster.members()[0],),
            lambda line: None,
            60.0,
            lambda: None,
            lambda members: None,
            lease_s=lease_s,
            addresses={h: ("127.0.0.1", 9) for h in HOSTS[:3]},
        )

    with pytest.raises(ValueError, match=r"lease \(3\.0 s\) is shorter than 2 looks"):
        made(lease.lease_for(5))
    assert made(lease.lease_for(10)).lease_s == 6.0


# ----- finding 8: a DONE of another run ------------------------------------------------------


def test_a_done_of_an_earlier_run_ends_none_of_a_new_runs_fresh_machines():
    """Finding 8, second half: a new run's machines with empty folders (--new_run, or folders
    cleared) saw the master's od-dist of the earlier run still up, DONE, and ended with exit 0: the
    new run never trained. Now a DONE ends a machine's part only when it is of its run (held, or,
    holding nothing, seen trained): they form without it, said once."""
    cluster = cluster_of(3, 2)
    lines, t = [], [0.0]
    fresh = agreement_of(cluster, 1, lines, lambda: t[0])
    fresh.wait_timeout = 5.0  # the first round's wait for every trainer
    done = state(cluster, 0, membership.DONE, round_=5, run=EARLIER, step=900)
    other = state(cluster, 2, membership.FORMING, round_=0)
    for _ in range(10):
        fresh.seen({HOSTS[0]: done, HOSTS[2]: {**other, "sees": sorted(HOSTS[:2])}}, t[0])
        assert fresh.finished_elsewhere() is None
        fresh.form()
        t[0] += 1.0
    said = [line for line in lines if "finished run" in line]
    assert said == [
        f"master:0 finished run {EARLIER} (round 5, step 900); this machine holds no checkpoint of it and saw "
        "no machine train it: not the end of this run, forming without it"
    ], lines
    # The two fresh ones form the new run's first round (round 1: the earlier run's rounds are not
    # this run's history), without waiting for the earlier run's machine.
    assert fresh.phase == membership.READY and (fresh.round, fresh.members) == (
        1,
        ("worker:0", "worker:1"),
    ), lines


def test_a_done_of_the_run_a_fresh_machine_saw_trained_or_holds_still_ends_its_part():
    """The other side of finding 8's fix: a machine back with an empty folder while a round of run
    R trains, which then finishes, ends with it (it saw R trained); a machine holding R's checkpoints
    ends on R's DONE; a DONE names its run even once its folder is set aside."""
    cluster = cluster_of(3, 2)
    lines, t = [], [0.0]
    fresh = agreement_of(cluster, 2, lines, lambda: t[0])
    fresh.seen({HOSTS[0]: state(cluster, 0, membership.TRAINING, run=RUN, step=40)}, 0.0)
    fresh.seen({HOSTS[0]: state(cluster, 0, membership.DONE, run=RUN, step=90)}, 1.0)
    assert fresh.finished_elsewhere()["run"] == RUN
    holder = agreement_of(cluster, 1, lines, lambda: t[0], newest_step=lambda: 40, run_of=lambda: RUN)
    holder.seen({HOSTS[0]: state(cluster, 0, membership.DONE, run=RUN, step=90)}, 0.0)
    assert holder.finished_elsewhere()["run"] == RUN
    folder = {"run": RUN}
    finisher = agreement_of(
        cluster,
        0,
        lines,
        lambda: t[0],
        newest_step=lambda: 90 if folder["run"] else None,
        run_of=lambda: folder["run"],
    )
    finisher.done()
    folder["run"] = None  # --new_run on that machine sets its folder aside while it still serves
    assert finisher.state()["phase"] == membership.DONE and finisher.state()["run"] == RUN


def test_a_fresh_machines_supervisor_is_not_ended_by_an_earlier_runs_done(tmp_path):
    """Finding 8 through the supervisor's own loop (host/rounds.py) and real membership servers on
    loopback: worker 0's od-dist, its folder empty, sees the master's od-dist of the earlier run
    still up and DONE. Before, it said "finished the job without this machine's" and exited 0; now
    it forms, and alone (worker 1 not up) ends as any machine alone: 138 after --wait_timeout."""
    cluster = cluster_of(3, 2)
    ports = {h: _free_port() for h in HOSTS[:3]}
    addresses = {h: ("127.0.0.1", p) for h, p in ports.items()}
    lines: list[str] = []
    say = lines.append
    master = elastic.Elastic(
        cluster,
        (cluster.members()[0],),
        say,
        60.0,
        lambda: 900,
        lambda m: None,
        run_of=lambda: EARLIER,
        addresses=addresses,
    )
    master.round = 5
    master.done()
    here = elastic.Elastic(
        cluster,
        (cluster.members()[1],),
        say,
        0.5,
        lambda: None,
        lambda m: None,
        addresses=addresses,
        settle_s=0.2,
        confirm_s=0.5,
        look_every_s=0.1,
    )

    def start(task):
        raise AssertionError(f"{task.name} started: no round can form here")

    sup = supervisor.Supervisor(
        spec.MULTI_WORKER_MIRRORED, [cluster.members()[1]], start, say, 3, 1.0, elastic=here
    )
    result = []
    with master.serving():
        thread = threading.Thread(target=lambda: result.append(sup.run()), daemon=True)
        thread.start()
        thread.join(30)
    assert result == [138], lines
    assert not any("finished the job without this machine's" in line for line in lines), lines
    assert any(f"master:0 finished run {EARLIER} (round 5, step 900)" in line for line in lines), lines


# ----- finding 7: failures nobody was charged for ---------------------------------------------


def test_a_machine_whose_trainers_exit_138_every_round_is_charged_and_left_out():
    """Finding 7: worker 1's trainers exit 138 (a lost peer) at every round while the others train
    on (a trainer that fails its peers' collective, a watch that takes a live peer for lost): 138
    was always another machine's loss, so nobody was charged and the job cycled for ever. Now the
    first look after such an exit finds every other member still training in that round: the loss
    is its own, charged; two in a row leave it out, and the others train without it."""
    model = scenario(spec.MULTI_WORKER_MIRRORED)
    bad = model.machines[2]
    for _ in range(200):
        if bad.trains is not None:
            bad.trains = None
            bad.a.regroup(lost_peer=True)  # its supervisor, on the trainers' exit 138 (host/rounds.py)
        model.step()
        model.one_round_trains()
        if bad.a.cooling() and model.training():
            break
    ((_, members),) = model.training()
    assert members == ("master:0", "worker:0"), model.log()
    assert bad.a.failures == 2 and all(m.a.failures == 0 for m in model.machines[:2]), model.log()
    assert any(
        "worker:1: round 1: worker:1 exited 138 (a lost peer) while every other member (master:0, worker:0) "
        "trained on in it: no peer was lost: counted as this machine's failure (1 in a row)" in line
        for line in model.lines
    ), model.log()
    assert any("worker:1: left out of the next rounds for 60 s" in line for line in model.lines), model.log()


def test_a_138_after_a_peer_was_really_lost_charges_nobody():
    """The other side of finding 7's rule: a survivor whose trainers exit 138 because a peer is gone
    (its machine absent from the look, or forming after its own failure) is not charged; nor is a
    look that started before the exit taken to judge it."""
    cluster = cluster_of(3, 2)
    lines, t = [], [10.0]
    a = agreement_of(cluster, 0, lines, lambda: t[0])
    a.phase, a.round, a.members = membership.TRAINING, 1, ALL3
    training = {
        HOSTS[1]: state(cluster, 1, membership.TRAINING),
        HOSTS[2]: state(cluster, 2, membership.TRAINING),
    }
    for others in (
        {HOSTS[1]: training[HOSTS[1]]},  # worker:1's machine gone
        {**training, HOSTS[2]: state(cluster, 2, membership.FORMING, round_=1)},  # it failed first
        {**training, HOSTS[2]: {**training[HOSTS[2]], "stopping": True}},  # asked to stop
    ):
        a.phase = membership.TRAINING
        a.regroup(lost_peer=True)
        a.seen(training, t[0] - 1)  # a look from before the exit: no verdict
        a.seen(others, t[0])
        assert a.failures == 0, lines
    a.phase = membership.TRAINING
    a.regroup(lost_peer=True)
    a.seen(training, t[0])
    assert a.failures == 1, lines


def test_trainers_killed_after_the_grace_period_of_a_round_stop_are_charged_once():
    """Finding 7: a trainer asked to stop for a new round that hangs (a step that never ends) was
    killed after --grace_period as a planned stop, never charged: a machine that hangs at every
    round held every round back for ever. Now the kill charges its machine, once per stop."""
    cluster = cluster_of(3, 2)
    lines: list[str] = []
    task = cluster.members()[1]
    a = agreement_of(cluster, 1, lines, time.monotonic)
    a.phase, a.round, a.members = membership.TRAINING, 1, ALL3
    hung = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)",
        ]
    )
    try:
        sup = supervisor.Supervisor(
            spec.MULTI_WORKER_MIRRORED, [task], lambda t: None, lines.append, 3, 1.0, elastic=a
        )
        sup.running = {task.name: Running(task, hung)}
        sup.regrouping, sup.regroup_asked_at = True, time.monotonic() - 2.0
        assert sup._elastic_step() is None
        assert hung.wait(10) is not None
        assert sup._elastic_step() is None  # still listed until its exit is handled: not charged again
    finally:
        hung.kill()
        hung.wait()
    assert a.failures == 1, lines
    assert lines == [
        "worker:0 still running 1 s after the stop (--grace_period); killing them",
        "worker:0 overran --grace_period (1 s) and was killed: counted as this machine's failure (1 in a row)",
    ], lines
