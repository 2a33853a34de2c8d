"""The elastic agreement (host/agreement.py) checked by a model, not only by scenarios: hypothesis
drives 3-4 simulated machines, each an Agreement stepped as its supervisor steps it, through random
cuts (both ways), inbound-only blocks (a firewall that lets a machine's own connections out),
kills, power-offs and returns (same disk, a wiped one, another run's), slow looks and time, under
both strategies, in simulated seconds. TensorFlow's part is modelled as docs/faults.md says it
behaves: a multi_worker_mirrored group trains while every member trains in it and all reach each
other, and fails after --lost_peer_timeout otherwise; a parameter_server coordinator trains while it
reaches the ps and any worker server (a server runs the steps of any coordinator, of its round or
not), and a worker server gives up on a coordinator it has not reached for --lost_peer_timeout.
After every step the invariants of docs/faults.md ("The agreement's invariants") are checked."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from od_dist.cluster import spec
from od_dist.host import agreement, lease
from od_dist.protocol.membership import DONE, TRAINING, Group

LOST_PEER_S = 10.0  # --lost_peer_timeout's default
TICK_S = 1.0  # a supervisor's look and step, as often as the real ones
HOSTS = ["10.9.0.1", "10.9.0.2", "10.9.0.3", "10.9.0.4"]


def cluster_of(n: int, strategy: str) -> spec.Cluster:
    ps = {"ps": ["10.9.0.9:2223"], "checkpoint_port": 2230} if strategy == spec.PARAMETER_SERVER else {}
    return spec.from_document(
        {
            "strategy": strategy,
            "master": f"{HOSTS[0]}:2222",
            "worker": [f"{h}:2222" for h in HOSTS[1:n]],
            "min_trainers": n // 2 + 1,
            "membership_port": 2226,
            **ps,
        }
    )


@dataclass
class Disk:
    step: int = 0
    run: str | None = None
    rounds: dict = field(default_factory=dict)  # what the agreement kept of the rounds


class Machine:
    """One trainer machine: its supervisor's Agreement, its disk, its trainers (`trains`)."""

    def __init__(self, model, index: int, disk: Disk):
        self.model, self.index, self.disk = model, index, disk
        self.task = model.cluster.members()[index]
        self.trains: Group | None = None
        self.refused = ""
        self.slow = False
        self.broken_since: float | None = None  # since when its trainers miss what they need
        self.a = agreement.Agreement(
            model.cluster,
            (self.task,),
            lambda line: model.lines.append(f"{model.t:6.0f} {self.task.name}: {line}"),
            wait_timeout=60.0,
            newest_step=lambda: self.disk.step or None,
            batch_problem=lambda members: None,
            clock=lambda: model.t,
            run_of=lambda: self.disk.run,
            set_aside=self.set_aside,
            recall=lambda: dict(self.disk.rounds),
            record=self.disk_rounds,
            model_dir=f"/disk{index}",
            lease_s=lease.LEASE_S,
        )

    @property
    def name(self) -> str:
        return self.task.name

    def disk_rounds(self, kept: dict) -> None:
        self.disk.rounds = dict(kept)

    def set_aside(self) -> str:
        self.disk = self.model.disks[self.index] = Disk()
        return f"/disk{self.index}/set-aside"


class AgreementModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.t = 0.0
        self.lines: list[str] = []

    @initialize(
        n=st.sampled_from([3, 4]),
        strategy=st.sampled_from([spec.PARAMETER_SERVER, spec.MULTI_WORKER_MIRRORED]),
    )
    def start(self, n, strategy):
        self.n, self.strategy = n, strategy
        self.cluster = cluster_of(n, strategy)
        self.min = self.cluster.min_trainers
        self.cut: set[frozenset] = set()
        self.blocked_in: set[int] = set()
        self.disks = [Disk() for _ in range(n)]
        self.machines: list[Machine | None] = [Machine(self, i, self.disks[i]) for i in range(n)]
        self.top_round = 0  # the newest round that trained
        self.run = "run-now"  # the run the rounds train (its id, as a trainer names it)
        self.minority_since: dict[int, float] = {}

    # ----- the network and the machines ------------------------------------------------------------

    def reaches(self, i: int, j: int) -> bool:
        """A connection from machine i to machine j gets through (and its answers back)."""
        return (
            self.machines[i] is not None
            and self.machines[j] is not None
            and frozenset((i, j)) not in self.cut
            and j not in self.blocked_in
        )

    def reaches_ps(self, i: int) -> bool:
        """The ps is on its own machine, on the switch: cut off with a machine cut from all."""
        return any(self.reaches(i, j) for j in range(self.n) if j != i) or self.n == 1

    def up(self):
        return [m for m in self.machines if m is not None and not m.refused]

    def state_of(self, m: Machine) -> dict:
        return m.a.state()

    def training(self) -> dict[tuple, list[Machine]]:
        """The rounds whose trainers make steps now, with the machines in them."""
        out: dict[tuple, list[Machine]] = {}
        for m in self.up():
            if m.trains is None:
                continue
            g = m.trains
            if self.strategy == spec.MULTI_WORKER_MIRRORED:
                group = [x for x in self.up() if x.name in g.members]
                if len(group) == len(g.members) and all(
                    x.trains == g and all(self.reaches(x.index, y.index) for y in group if y is not x)
                    for x in group
                ):
                    out[(g.round, g.members)] = group
            elif g.members[0] == m.name and self.reaches_ps(m.index):
                # TensorFlow's worker servers run the steps of any coordinator that reaches them,
                # of their round or not: what makes two coordinators harmful.
                workers = [
                    x
                    for x in self.up()
                    if x is not m and x.trains is not None and self.reaches(m.index, x.index)
                ]
                if workers:
                    out[(g.round, g.members)] = [m, *workers]
        return out

    def step(self):
        """One second: every machine looks (unless its looks are slow) and acts as its supervisor
        does; then TensorFlow's part: steps made, trainers that fail."""
        for m in self.up():
            if not m.slow:
                others = {
                    x.a.mine: self.state_of(x)
                    for x in self.up()
                    if x is not m and self.reaches(m.index, x.index)
                }
                m.a.seen(others, self.t)
        for m in self.up():
            a = m.a
            if a.phase == TRAINING and m.trains is not None:
                why = a.newcomer()
                if why:
                    self.lines.append(f"{self.t:6.0f} {m.name}: {why}")
                    m.trains = None  # saved and stopped, as asked
                    a.regroup()
            elif a.phase != DONE and m.trains is None:
                try:
                    group = a.form()
                except agreement.RunConflict as e:
                    m.refused = str(e)
                    continue
                if group is not None:
                    m.trains = group
        self.train()
        self.t += TICK_S

    def train(self):
        rounds = self.training()
        remembered = max((max([m.a.round] + [h.round for h in m.a.history]) for m in self.up()), default=0)
        for (r, members), group in rounds.items():
            if r < self.top_round and remembered < self.top_round:
                self.top_round = 0  # no supervisor up remembers the newer round: they count anew
            assert r >= self.top_round, f"round {r} trains after round {self.top_round}\n" + self.log()
            if r > self.top_round:
                # A round starts from the newest checkpoint of its members (the coordinator holds it
                # under parameter_server: the agreement put it first; the broadcast otherwise).
                newest = max((x.disk.step for x in group), default=0)
                source = (
                    group[0]
                    if self.strategy == spec.PARAMETER_SERVER
                    else max(group, key=lambda x: x.disk.step)
                )
                assert source.disk.step == newest, (
                    f"round {r} starts from {source.name}'s step {source.disk.step}, not the newest {newest}\n"
                    + self.log()
                )
                runs = {x.disk.run for x in group if x.disk.step and x.disk.run}
                assert len(runs) <= 1, f"round {r} trains on checkpoints of two runs {runs}\n" + self.log()
                self.top_round = r
                self.run = runs.pop() if runs else self.run
            lead = (
                group[0] if self.strategy == spec.PARAMETER_SERVER else max(group, key=lambda x: x.disk.step)
            )
            lead.disk.step += 10
            lead.disk.run = lead.disk.run or self.run
            for x in group:
                if self.strategy == spec.MULTI_WORKER_MIRRORED or self.reaches(x.index, lead.index):
                    x.disk.step, x.disk.run = lead.disk.step, lead.disk.run  # saved, or fetched
        # Trainers that fail: a multi_worker_mirrored member outside a whole group, a parameter_server
        # worker whose coordinator it cannot reach; each after --lost_peer_timeout.
        trained = {x.name for group in rounds.values() for x in group}
        for m in self.up():
            if m.trains is None:
                m.broken_since = None
                continue
            if self.strategy == spec.MULTI_WORKER_MIRRORED:
                broken = m.name not in trained
            else:
                lead = next((x for x in self.up() if x.name == m.trains.members[0]), None)
                broken = lead is not m and (
                    lead is None or lead.trains != m.trains or not self.reaches(m.index, lead.index)
                )
            if not broken:
                m.broken_since = None
            elif m.broken_since is None:
                m.broken_since = self.t
            elif self.t - m.broken_since >= LOST_PEER_S:
                m.trains, m.broken_since = None, None
                m.a.regroup()  # a lost peer: not its own failure

    def log(self) -> str:
        return "\n".join(self.lines[-60:])

    # ----- faults ----------------------------------------------------------------------------------

    # Machine numbers are drawn 0-3 and taken modulo the machines there are: no rule is a no-op.
    @rule(i=st.integers(0, 3), j=st.integers(1, 3))
    def cut_link(self, i, j):
        i, j = i % self.n, (i + j) % self.n
        if i != j:
            self.cut.add(frozenset((i, j)))

    @rule(i=st.integers(0, 3))
    def cut_off(self, i):
        """A cable pulled: machine i reaches no one."""
        i %= self.n
        self.cut |= {frozenset((i, j)) for j in range(self.n) if j != i}

    @rule(i=st.integers(0, 3))
    def block_inbound(self, i):
        """A firewall that blocks what comes in (a Windows network profile flipped to Public)."""
        self.blocked_in.add(i % self.n)

    @rule()
    def heal(self):
        self.cut.clear()
        self.blocked_in.clear()

    @rule(i=st.integers(0, 3))
    def kill_trainers(self, i):
        m = self.machines[i % self.n]
        if m is not None and m.trains is not None:
            m.trains = None
            m.a.regroup(failed=True)

    @rule(i=st.integers(0, 3))
    def power_off(self, i):
        i %= self.n
        if self.machines[i] is not None:
            self.machines[i] = None
        if all(m is None for m in self.machines):
            self.top_round = 0  # no supervisor left that remembers a round: they start from 1 again

    @rule(i=st.integers(0, 3), disk=st.sampled_from(["same", "wiped", "another run"]))
    def power_on(self, i, disk):
        i %= self.n
        if self.machines[i] is None:
            if disk == "wiped":
                self.disks[i] = Disk()
            elif disk == "another run":
                self.disks[i] = Disk(step=5000, run="earlier")
            self.machines[i] = Machine(self, i, self.disks[i])

    @rule(i=st.integers(0, 3), slow=st.booleans())
    def slow_looks(self, i, slow):
        if self.machines[i % self.n] is not None:
            self.machines[i % self.n].slow = slow

    @rule(seconds=st.integers(1, 40))
    def wait(self, seconds):
        for _ in range(seconds):
            self.step()

    # ----- invariants ------------------------------------------------------------------------------

    @invariant()
    def one_round_trains(self):
        if not hasattr(self, "cluster"):
            return
        rounds = self.training()
        assert len(rounds) <= 1, f"two rounds train at once: {sorted(rounds)}\n" + self.log()

    @invariant()
    def a_minority_never_trains(self):
        """The trainers of a round that makes steps reach min_trainers of its members, or did within
        the coordinator's lease (and one look)."""
        if not hasattr(self, "cluster"):
            return
        for (r, members), group in self.training().items():
            # Reached by the lead: the coordinator opens the connections to its workers' servers.
            lead = group[0]
            held = [
                x for x in self.up() if x.name in members and (x is lead or self.reaches(lead.index, x.index))
            ]
            if len(held) >= self.min:
                self.minority_since.pop(r, None)
            else:
                since = self.minority_since.setdefault(r, self.t)
                assert self.t - since <= lease.LEASE_S + 2 * TICK_S, (
                    f"round {r} trains on {len(held)} of min_trainers {self.min} for {self.t - since:.0f} s\n"
                    + self.log()
                )

    def teardown(self):
        """A majority connected makes progress: everything healed and up (a refused machine aside),
        some round trains within two minutes."""
        if not hasattr(self, "cluster"):
            return
        self.heal()
        for i in range(self.n):
            if self.machines[i] is None:
                self.power_on(i, "same")
            self.machines[i].slow = False
        if any(m.refused for m in self.machines) or any(m.a.phase == DONE for m in self.machines):
            return
        for _ in range(180):
            self.step()
            if self.training() or any(m.refused for m in self.machines):
                return  # trains, or machines of two runs refused (exit 2, each saying why)
        raise AssertionError("healed and up, no round trained within 180 s\n" + self.log())


AgreementModel.TestCase.settings = settings(
    max_examples=500,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,  # the same cases on every run: a failure found once is found again
)
test_agreement_model = AgreementModel.TestCase


def scenario(strategy: str, n: int = 3) -> AgreementModel:
    model = AgreementModel()
    model.start(n=n, strategy=strategy)
    model.wait(10)
    assert model.training(), model.log()
    return model


def run_checked(model: AgreementModel, seconds: int) -> None:
    for _ in range(seconds):
        model.step()
        model.one_round_trains()
        model.a_minority_never_trains()


@pytest.mark.parametrize("fault", ["cut_off", "block_inbound"])
def test_parameter_server_a_master_cut_off_for_60_s_then_healed_one_coordinator_at_any_time(fault):
    """The master (coordinating round 1) cut off for 60 s, both ways (a cable, a switch's reboot) or
    inbound only (a Windows network profile flipped to Public): the workers form round 2 without it,
    the master's lease has stopped it first; healed, it sees the newer round and joins it. Before the
    lease and the newer-round rule, rounds 1 and 2 both trained after the heal."""
    model = scenario(spec.PARAMETER_SERVER)
    getattr(model, fault)(0)
    run_checked(model, 60)
    ((r, members),) = model.training()
    assert r == 2 and members[0] != "master:0", model.log()
    assert any(
        "master:0: " in line and "stops before the others form without it" in line for line in model.lines
    ) or (fault == "block_inbound"), model.log()
    model.heal()
    run_checked(model, 60)
    ((r, members),) = model.training()
    assert r >= 3 and set(members) == {"master:0", "worker:0", "worker:1"}, model.log()


def test_parameter_server_a_machine_back_is_taken_in_by_a_planned_stop_that_loses_no_step():
    """A worker's machine powered off, a round forms without it; back on its old disk: only the
    coordinator stops for it (saving through the worker servers, which serve on until it left the
    round), and the next round starts from the coordinator's newest step. Before, every member
    stopped its worker servers at once and the coordinator could not save."""
    model = scenario(spec.PARAMETER_SERVER)
    model.power_off(2)
    model.kill_trainers(0)  # a round without worker:1 follows (a worker lost alone would rejoin its round)
    run_checked(model, 30)
    ((r, members),) = model.training()
    assert "worker:1" not in members, model.log()
    step = model.machines[0].disk.step
    model.power_on(2, "same")
    stops = []
    for _ in range(40):
        model.step()
        model.one_round_trains()
        stops += [line for line in model.lines if "left round" in line and line not in stops]
        if model.training() and list(model.training())[0][0] > r:
            break
    ((r2, members),) = model.training()
    assert r2 > r and set(members) == {"master:0", "worker:0", "worker:1"}, model.log()
    assert model.machines[0].disk.step >= step, model.log()
    assert any("worker:0: master:0 left round" in line for line in stops), model.log()


@pytest.mark.parametrize("strategy", [spec.PARAMETER_SERVER, spec.MULTI_WORKER_MIRRORED])
def test_a_machine_back_with_an_earlier_runs_folder_never_takes_the_job_over(strategy):
    """Worker 1's machine back with a folder of an earlier run, at a higher step, while the others
    train this run: under parameter_server its folder holds a worker's copies, set aside (moved) with
    a line, and it joins this run; under multi_worker_mirrored its own checkpoints, so it refuses
    (exit 2, naming both runs) and the others train on. Before, the higher step won: a
    parameter_server round was coordinated from it, a multi_worker_mirrored one broadcast it."""
    model = scenario(strategy)
    model.power_off(2)
    run_checked(model, 30)
    run = model.machines[0].disk.run
    model.power_on(2, "another run")
    run_checked(model, 60)
    ((_, members),) = model.training()
    assert all(m.disk.run == run for m in model.machines if m.name in members), model.log()
    if strategy == spec.PARAMETER_SERVER:
        assert set(members) == {"master:0", "worker:0", "worker:1"}, model.log()
        assert any("held copies of run earlier (to step 5,000)" in line for line in model.lines), model.log()
    else:
        assert "worker:1" not in members and "checkpoints of two runs" in model.machines[2].refused, (
            model.log()
        )


def test_a_machine_that_fails_every_round_is_left_out_and_the_others_go_on():
    """Worker 1's trainers fail at every start (a bad GPU, a full disk): after two failed rounds in
    a row it is left out of proposals for a while, and the two others train without it; the
    others' losses are not their failures, so nothing counts against their own machines."""
    model = scenario(spec.MULTI_WORKER_MIRRORED)
    bad = model.machines[2]
    for _ in range(120):
        if bad.trains is not None:
            model.kill_trainers(2)
        model.step()
        model.one_round_trains()
        if bad.a.cooling() and model.training():
            break
    ((_, members),) = model.training()
    assert members == ("master:0", "worker:0"), model.log()
    assert bad.a.failures == 2 and all(m.a.failures == 0 for m in model.machines[:2]), model.log()
    assert any(
        "worker:1: left out of the next rounds for 60 s: this machine's last 2 rounds failed" in line
        for line in model.lines
    ), model.log()
