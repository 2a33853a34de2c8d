"""The agreement of an elastic job's group (host/elastic.py), machine by machine, over real
membership servers on loopback: each simulated machine is an Elastic with its own port, stepped
as its supervisor steps it, its trainers standing in as a flag. The rounds' trainers themselves run
in tests/test_multihost.py; here the rules run in seconds, through every race the issue names."""

import socket
import threading
import time

import pytest
from loopback import od_dist

from od_dist.cluster import spec
from od_dist.host import elastic
from od_dist.protocol import membership

HOSTS = ["10.9.0.1", "10.9.0.2", "10.9.0.3", "10.9.0.4"]
FAST = dict(settle_s=0.3, confirm_s=3.0, look_every_s=0.1)


def wait_until(condition, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_of(n: int, min_trainers: int, strategy: str = "multi_worker_mirrored") -> spec.Cluster:
    ps = {"ps": [f"{HOSTS[-1]}:2223"], "checkpoint_port": 2230} if strategy == "parameter_server" else {}
    return spec.from_document(
        {
            "strategy": strategy,
            "master": f"{HOSTS[0]}:2222",
            "worker": [f"{h}:2222" for h in HOSTS[1:n]],
            "min_trainers": min_trainers,
            "membership_port": 2226,
            **ps,
        }
    )


class Machine:
    """One trainer machine: its Elastic, served; `trains` stands for its trainers."""

    def __init__(self, cluster, index, ports, batch_problem=None, wait_timeout=60.0, lines=None):
        self.task = cluster.members()[index]
        self.lines = lines if lines is not None else []
        self.ports = ports
        self.step = 0
        self.e = elastic.Elastic(
            cluster,
            (self.task,),
            lambda line: self.lines.append(f"{self.task.name}: {line}"),
            wait_timeout,
            lambda: self.step,
            batch_problem or (lambda members: None),
            addresses={h: ("127.0.0.1", ports[h]) for h in HOSTS[: len(cluster.members())]},
            **FAST,
        )
        self.serving = self.e.serving()
        self.trains: membership.Group | None = None

    def tick(self) -> None:
        e = self.e
        if e.phase == elastic.TRAINING:
            why = e.newcomer()
            if why:  # its supervisor asks its trainers to save and stop
                self.lines.append(f"{self.task.name}: {why}")
                self.lose_trainers()
        elif e.phase != elastic.DONE:
            group = e.form()
            if group is not None:
                self.trains = group

    def lose_trainers(self) -> None:
        self.trains = None
        self.e.regroup()

    def power_off(self) -> None:
        self.trains = None
        self.serving.close()


class Cluster:
    """The machines, stepped together in a thread, with the one invariant checked at every tick:
    never two groups training at once (a group trains while all its members train in it)."""

    def __init__(self, n, min_trainers, absent=(), strategy="multi_worker_mirrored", **kwargs):
        self.cluster = cluster_of(n, min_trainers, strategy)
        self.ports = {h: _free_port() for h in HOSTS[:n]}
        self.lines: list[str] = []
        self.machines = [
            None if i in absent else Machine(self.cluster, i, self.ports, lines=self.lines, **kwargs)
            for i in range(n)
        ]
        self.groups_seen: list[tuple[int, tuple[str, ...]]] = []
        self.violations: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                for m in self.machines:
                    if m is not None:
                        m.tick()
                self._check()
            time.sleep(0.02)

    def _check(self) -> None:
        training = {}
        for m in self.machines:
            if m is not None and m.trains is not None:
                training.setdefault((m.trains.round, m.trains.members), set()).add(m.task.name)
        formed = [g for g, names in training.items() if names == set(g[1])]
        if len(formed) > 1:
            self.violations.append(f"two groups train at once: {formed}")
        for g in formed:
            if len(g[1]) < self.cluster.min_trainers:
                self.violations.append(f"a group below min_trainers: {g}")
            if g not in self.groups_seen:
                self.groups_seen.append(g)

    def wait_for(self, members: tuple[str, ...], timeout: float = 30.0) -> tuple[int, tuple[str, ...]]:
        """Until a group of exactly `members` trains on all of them; returns it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                found = [g for g in self.groups_seen if g[1] == members]
                if found and all(
                    m.trains == membership.Group(*found[-1])
                    for m in self.machines
                    if m is not None and m.task.name in members
                ):
                    return found[-1]
            time.sleep(0.05)
        raise AssertionError(
            f"no group of {members} in {timeout} s: {self.groups_seen}\n" + "\n".join(self.lines)
        )

    def act(self, fn) -> None:
        with self._lock:
            fn(self)

    def power_off(self, i: int) -> None:
        """Every process of machine i gone: its trainers and its od-dist."""
        with self._lock:
            self.machines[i].power_off()
            self.machines[i] = None

    def start(self, i: int) -> None:
        """Its od-dist started again (by its script or at boot), with nothing of its past."""
        with self._lock:
            self.machines[i] = Machine(self.cluster, i, self.ports, lines=self.lines)

    def lose_trainers(self, *indexes: int) -> None:
        """The trainers of these machines fail at once (a peer lost, an all-reduce aborted)."""
        with self._lock:
            for i in indexes:
                self.machines[i].lose_trainers()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for m in self.machines:
            if m is not None:
                m.power_off()


@pytest.fixture
def clusters():
    made = []

    def make(n, min_trainers, **kwargs):
        made.append(Cluster(n, min_trainers, **kwargs))
        return made[-1]

    yield make
    for c in made:
        c.close()
        assert not c.violations, c.violations


ALL3 = ("master:0", "worker:0", "worker:1")


def test_three_machines_agree_one_group_then_go_on_without_a_lost_one_and_take_it_back(clusters):
    c = clusters(3, 2)
    first = c.wait_for(ALL3)
    assert first[0] == 1
    # Two trainers lost at the same moment (a collective aborted): the third stops for them; one
    # round follows, with every machine.
    c.lose_trainers(1, 2)
    second = c.wait_for(ALL3)
    assert second[0] > first[0]
    # worker 1's machine lost for good: the others' trainers fail on it; the two up go on.
    c.power_off(2)
    c.act(lambda c: [setattr(m, "step", 1200) for m in c.machines if m])
    c.lose_trainers(0, 1)
    smaller = c.wait_for(("master:0", "worker:0"))
    assert any("without worker:1" in line for line in c.lines), c.lines
    # It comes back with an empty disk: the group saves and stops for it; the next round has all.
    c.act(lambda c: [setattr(m, "step", 1500) for m in c.machines if m])  # the save made for it
    c.start(2)
    again = c.wait_for(ALL3)
    assert again[0] > smaller[0]
    assert any("worker:1 is up and waiting to join" in line for line in c.lines), c.lines
    joined = c.machines[2].e
    assert [(r.round, r.members, r.step) for r in joined.history][-2:] == [
        (smaller[0], smaller[1], 1200),
        (again[0], ALL3, 1500),
    ]
    c.act(lambda c: [m.e.done() for m in c.machines if m])
    assert joined.trained(2000).endswith(
        "1,200-1,500 on 2 of 3 trainers (without worker:1), 1,500-2,000 on 3 of 3 trainers"
    ), joined.trained(2000)
    assert c.groups_seen == sorted(c.groups_seen)  # rounds only go up


def test_the_masters_machine_lost_for_good_the_lead_moves(clusters):
    c = clusters(3, 2)
    c.wait_for(ALL3)
    c.power_off(0)
    c.lose_trainers(1, 2)
    group = c.wait_for(("worker:0", "worker:1"))
    lead = c.cluster.group(group[1]).lead_task()
    assert lead.name == "worker:0" and lead.address.host == HOSTS[1]
    # Its place in a round: the workers numbered again over the members, the file's host and name
    # kept (every line calls a trainer by its name in the file).
    worker1 = c.cluster.task("worker", 1)
    assert c.cluster.in_group(worker1, group[1]).index == 1
    moved = c.cluster.in_group(worker1, ("master:0", "worker:1"))
    assert (moved.index, moved.name, moved.address) == (0, "worker:1", worker1.address)
    smaller = c.cluster.group(("master:0", "worker:1"))
    assert smaller.job_id() == c.cluster.job_id()
    assert [(t.tf_job, t.index, t.name) for t in smaller.trainers()] == [
        ("chief", 0, "master:0"),
        ("worker", 0, "worker:1"),
    ]


def test_parameter_server_the_newest_holder_coordinates_and_a_master_back_joins_as_a_worker(clusters):
    """parameter_server: a round's first member coordinates it (Cluster.group), and the proposer puts
    first the machine holding the newest checkpoint: after the master's loss, worker 1's copy is
    newer; the master back on its old disk then joins as a worker, not as the coordinator."""
    c = clusters(3, 2, strategy="parameter_server")
    first = c.wait_for(ALL3)  # all at step 0: the file's order, the master coordinates
    assert c.cluster.group(first[1]).master == c.cluster.master
    # Worker 1's server lost (and its machine too, back with nothing): it rejoins the same round, as
    # TensorFlow's coordinator takes a worker back; the others never stop.
    c.lose_trainers(2)
    wait_until(lambda: c.machines[2].trains == membership.Group(*first))
    c.power_off(2)
    c.start(2)
    wait_until(lambda: c.machines[2].trains == membership.Group(*first))
    assert c.groups_seen == [first] and all(m.trains == membership.Group(*first) for m in c.machines)
    assert any("worker:1: rejoining round 1 (master:0, worker:0, worker:1)" in line for line in c.lines), (
        c.lines
    )
    c.power_off(0)
    c.act(lambda c: [setattr(m, "step", s) for m, s in zip(c.machines[1:], (1100, 1200))])
    c.lose_trainers(1, 2)
    group = c.wait_for(("worker:1", "worker:0"))
    assert any("worker:1 coordinating (2 of 3 trainers; without master:0)" in line for line in c.lines), (
        c.lines
    )
    smaller = c.cluster.group(group[1])
    worker0, worker1 = c.cluster.task("worker", 0), c.cluster.task("worker", 1)
    assert smaller.master == worker1.address and smaller.workers == (worker0.address,)
    assert [(t.name, t.role, t.index) for t in smaller.members()] == [
        ("worker:1", "master", 0),
        ("worker:0", "worker", 0),
    ]
    assert smaller.ps == c.cluster.ps and smaller.job_id() == c.cluster.job_id()
    coordinator = c.cluster.in_group(worker1, group[1])
    assert (coordinator.role, coordinator.index, coordinator.name) == ("master", 0, "worker:1")
    # The master's machine back on its old disk: the group saves (step 1300, on the coordinator's
    # disk) and takes it in; worker 1, which holds it, coordinates again.
    c.act(lambda c: setattr(c.machines[2], "step", 1300))
    c.start(0)
    c.act(lambda c: setattr(c.machines[0], "step", 500))
    again = c.wait_for(("worker:1", "master:0", "worker:0"))
    assert again[0] > group[0]
    master = c.cluster.in_group(c.cluster.task("master"), again[1])
    assert (master.role, master.index, master.name) == ("worker", 0, "master:0")
    # The ps read which member coordinates from the members' states (task/server.py).
    addresses = [("127.0.0.1", port) for port in c.ports.values()]
    assert membership.rounds_seen(addresses, c.cluster.job_id()) == ("worker:1", False)
    assert membership.rounds_seen(addresses, "another job") == (None, False)


def test_a_machine_that_returns_while_a_group_forms_makes_no_second_group(clusters):
    c = clusters(3, 2)
    c.wait_for(ALL3)
    c.power_off(2)
    c.lose_trainers(0, 1)
    # Back just as the two others settle on a round without it.
    deadline = time.monotonic() + 10
    while c.machines[0].e.phase != elastic.READY and time.monotonic() < deadline:
        time.sleep(0.01)
    c.start(2)
    c.wait_for(ALL3)  # one group after the other; the invariant is checked at every tick


def test_a_split_where_each_side_is_below_the_minimum_trains_nowhere_until_it_heals(clusters):
    c = clusters(4, 3)
    c.wait_for(ALL3 + ("worker:2",))
    closed = _free_port()  # nothing listens there: a machine across the split
    sides = ({HOSTS[0], HOSTS[1]}, {HOSTS[2], HOSTS[3]})

    def split(c):
        for m, host in zip(c.machines, HOSTS):
            side = sides[0] if host in sides[0] else sides[1]
            m.e.addresses.update({h: ("127.0.0.1", closed) for h in HOSTS if h not in side})
            m.lose_trainers()

    c.act(split)
    time.sleep(3)  # ten settle periods: time enough to form, were it allowed
    assert all(m.trains is None for m in c.machines), c.groups_seen
    assert sum("a group needs min_trainers 3" in line for line in c.lines) >= 2, c.lines

    def heal(c):
        for m in c.machines:
            m.e.addresses.update({h: ("127.0.0.1", c.ports[h]) for h in HOSTS})

    c.act(heal)
    c.wait_for(ALL3 + ("worker:2",))


def test_a_group_whose_batch_cannot_split_is_not_formed_said_in_one_line(clusters):
    odd = lambda members: None if len(members) != 2 else "global_batch_size: 3 does not split over 2"  # noqa: E731
    c = clusters(3, 2, batch_problem=odd)
    c.wait_for(ALL3)
    c.power_off(2)
    c.lose_trainers(0, 1)
    time.sleep(2)
    assert all(m.trains is None for m in c.machines[:2])
    said = [line for line in c.lines if "no group of master:0, worker:0" in line]
    assert said == [
        "master:0: no group of master:0, worker:0: global_batch_size: 3 does not split over 2; waiting for a trainer more"
    ], c.lines


def test_the_first_round_waits_for_every_trainer_then_starts_with_those_up(clusters):
    c = clusters(3, 2, absent=(2,), wait_timeout=2.0)
    c.wait_for(("master:0", "worker:0"))
    assert any("waiting for every trainer before the first round" in line for line in c.lines), c.lines


def test_a_trainer_of_an_elastic_job_outside_a_supervisor_is_refused(tmp_path):
    """min_trainers needs each machine's od-dist to agree the rounds: a trainer run alone (no
    --max_restarts) would train in no round: exit 2 before anything starts, with the fix."""
    path = tmp_path / "elastic.yaml"
    path.write_text(
        "strategy: multi_worker_mirrored\nmaster: 127.0.0.1:2322\nworker: [127.0.0.1:2323, 127.0.0.1:2324]\n"
        "min_trainers: 2\nmembership_port: 2326\n"
    )
    r = od_dist(
        "train",
        f"--cluster={path}",
        "--role=worker",
        "--index=0",
        "--pipeline=pipelines/shapes_retinanet.yaml",
        f"--model_dir={tmp_path / 'm'}",
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""  # nothing started
    assert r.stderr.strip() == (
        "od-dist train: --max_restarts: '0': min_trainers: 2 in the cluster file needs this machine's od-dist "
        "to agree each round with the other trainer machines; pass --max_restarts 3 (the generated scripts do)"
    ), r.stderr

    r = od_dist("validate", f"--cluster={path}", timeout=120)
    assert r.returncode == 0, r.stderr
    assert (
        "elastic: the trainers up go on while at least min_trainers 2 of 3 are, agreeing each round on "
        "membership_port 2326"
    ) in r.stdout


def test_the_side_ports_of_an_elastic_job_are_checked_by_doctor_and_opened_by_the_scripts(tmp_path):
    """membership_port and checkpoint_port, once per trainer machine (any trainer may lead): doctor
    binds them here as the job will, and the scripts' firewall lines open them to their peers."""
    lan = spec.from_document(
        {
            "strategy": "multi_worker_mirrored",
            "master": f"{HOSTS[0]}:2222",
            "worker": [f"{h}:2222" for h in HOSTS[1:3]],
            "evaluator": HOSTS[3],
            "checkpoint_port": 2225,
            "min_trainers": 2,
            "membership_port": 2226,
        }
    )
    from od_dist.render import readme

    rules = {(r.task.name, r.port): (r.what, r.sources) for r in readme.inbound_rules(lan)}
    for i, t in enumerate(lan.trainers()):
        others = tuple(h for h in HOSTS[:3] if h != HOSTS[i])
        assert rules[(t.name, 2225)] == ("checkpoints", (HOSTS[3],)), rules
        assert rules[(t.name, 2226)] == ("membership", others), rules
    # parameter_server: any member may coordinate (every member and the ps reach its port) and every
    # worker keeps a copy of the coordinator's checkpoints (every member reads its checkpoint_port).
    ps = cluster_of(3, 2, "parameter_server")
    rules = {(r.task.name, r.port): (r.what, r.sources) for r in readme.inbound_rules(ps)}
    for i, t in enumerate(ps.members()):
        others = tuple(h for h in HOSTS[:3] if h != HOSTS[i])
        assert rules[(t.name, 2222)] == ("", others + (HOSTS[-1],)), rules
        assert rules[(t.name, 2230)] == ("checkpoints", others), rules
    assert rules[("ps:0", 2223)] == ("", tuple(HOSTS[:3])), rules
    ports = [_free_port() for _ in range(5)]
    path = tmp_path / "loop.yaml"
    path.write_text(
        f"strategy: multi_worker_mirrored\nmaster: 127.0.0.1:{ports[0]}\n"
        f"worker: [127.0.0.1:{ports[1]}, 127.0.0.1:{ports[2]}]\ncheckpoint_port: {ports[3]}\n"
        f"min_trainers: 2\nmembership_port: {ports[4]}\n"
    )
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", ports[4]))
        taken.listen()
        r = od_dist("doctor", f"--cluster={path}", timeout=120)
    lines = r.stdout.splitlines()
    assert f"  ok    port {ports[3]} here: free for master:0's checkpoints" in lines, r.stdout
    taken_line = [line for line in lines if line.startswith(f"  FIX   port {ports[4]} here: in use")]
    assert taken_line and taken_line[0].endswith(
        "master:0's membership cannot start: stop that program, or give membership_port another port"
    ), r.stdout
    assert sum(f"port {ports[3]} here" in line for line in lines) == 1, r.stdout  # one machine: once


def test_who_trained_when_leaves_out_empty_rounds_and_joins_rounds_of_the_same_members(clusters):
    c = clusters(3, 2)
    e = c.machines[0].e
    two = ("master:0", "worker:0")
    e.history = [
        elastic.Round(1, ALL3, 0),
        elastic.Round(2, ALL3, 50),  # a trainer lost and back before a save: the same three
        elastic.Round(3, two, 150),  # worker 1 lost...
        elastic.Round(4, two, 300),  # ...a round of the same two after another loss
        elastic.Round(5, ALL3, 550),
        elastic.Round(6, two, 550),  # trained no step
        elastic.Round(7, ALL3, 550),
    ]
    assert e.trained(1200) == (
        "trained steps 0-150 on 3 of 3 trainers, 150-550 on 2 of 3 trainers (without worker:1), "
        "550-1,200 on 3 of 3 trainers"
    )


def test_the_looker_outlives_an_error_of_one_look_and_sees_no_one_meanwhile(clusters):
    """A look that raises (an answer that is no HTTP, a bug in one read): one line, the others count
    as unseen for that look (the coordinator's lease and the forming read it so), and the next look
    sees them again. Before, the looker thread died and its machine acted on a frozen view."""
    c = clusters(3, 2)
    c.wait_for(ALL3)
    m = c.machines[1]
    read, failed = m.e._read_others, []

    def failing_once():
        if not failed:
            failed.append(1)
            raise RuntimeError("a read that broke")
        return read()

    m.e._read_others = failing_once
    wait_until(lambda: failed and m.e._alive)
    assert any(
        "membership: a look at the other machines failed (RuntimeError: a read that broke)" in line
        for line in c.lines
    ), c.lines


def test_a_forming_machine_takes_no_done_of_another_run_for_the_end_of_its_own():
    """A machine forming (its trainers restarted) that sees a machine still serving DONE of an
    earlier run goes on forming; a DONE of its own run ends its part (a machine holding none:
    tests/test_fences.py)."""
    from od_dist.host import agreement

    cluster = cluster_of(3, 2)
    here = agreement.Agreement(
        cluster,
        (cluster.members()[1],),
        lambda line: None,
        60.0,
        newest_step=lambda: 40,
        batch_problem=lambda members: None,
        clock=lambda: 0.0,
        run_of=lambda: "bbbbbbbbbbbb",
    )
    done = {
        "job": cluster.job_id(),
        "trainers": ["master:0"],
        "phase": membership.DONE,
        "round": 3,
        "members": [],
        "step": 900,
        "run": "aaaaaaaaaaaa",
        "history": [],
    }
    here.seen({"10.9.0.1": done}, 0.0)
    assert here.finished_elsewhere() is None
    here.seen({"10.9.0.1": {**done, "run": "bbbbbbbbbbbb"}}, 0.0)
    assert here.finished_elsewhere()["run"] == "bbbbbbbbbbbb"
