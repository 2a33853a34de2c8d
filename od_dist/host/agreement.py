"""The rules of an elastic job's agreement (the cluster file's min_trainers), with no I/O: a
machine's phase, the rounds, proposals, the coordinator's lease and the run a checkpoint belongs to.
host/elastic.py serves this machine's state and reads the others' (`seen`); the supervisor steps it
(`form` while no trainer of its runs, `newcomer` while they train). The clock is passed in, so a
model of many machines (tests/test_agreement_model.py) drives these rules through cuts, heals and
returns in simulated time.

A change of members is a new round: TensorFlow's all-reduce needs a fixed group, and
parameter_server's coordinator a fixed cluster. Every member's trainers start again in the round's
cluster from the newest checkpoint of the run (task/controller.py sends it to those behind). Under
parameter_server a round's first member coordinates it (Cluster.group), the ps keep serving.

For each trainer machine:
  - Its phase: forming (no trainer of its runs), ready (it took a proposal and waits for every
    member to take it), training, or done (its trainers finished).
  - The first machine in the cluster file's order (the master, worker 0, 1, ...) among those forming
    or ready leads the forming. Once the machines it sees forming have stayed the same for SETTLE_S,
    it proposes them as the next round (one past the highest any machine shows), if they are at least
    min_trainers and the global batch splits over their replicas. Before the job's first round it
    waits for every trainer, up to --wait_timeout. A machine whose rounds failed FAILS_TO_COOL times in
    a row is left out (it neither leads nor is proposed) until it has stayed up cooling_s.
  - A forming machine takes its lead's proposal when it is a member; a ready machine starts its
    trainers once every member shows the same round and members, and drops the proposal after
    CONFIRM_S otherwise.
  - A training machine stops its trainers (they save a checkpoint at one step, task/stop.py) when
    it sees a newer round anywhere (a newer round always wins), or a machine forming that the group
    must take in. Under parameter_server only the coordinator's machine stops for a newcomer; the
    workers' machines keep their servers up until it has saved and left the round, then follow.
  - The run: every machine says which run its checkpoints belong to (protocol/lineage.py); machines
    holding checkpoints of two runs refuse to form (RunConflict), never adopting the other's. A
    machine done says the run its trainers finished, and that DONE ends the part of a machine still
    forming only if it is of that machine's run (the one it holds, or, holding none, one it saw
    trained): an earlier run's machine still up ends none of a new run's.
  - The round of a checkpoint: a newer round's checkpoint beats a higher step of an older round.

Never two groups: min_trainers is more than half of the trainers (cluster/validate.py), a machine
trains in one round at a time, and under multi_worker_mirrored a group trains only while every member
does. Under parameter_server the coordinator needs no member to go on, so it holds a lease: it
trains only while its last look within lease_s saw min_trainers trainers in its round (members
training, or forming to rejoin it and seeing it). lease_s, its length from --lost_peer_timeout and
the look cycle it is counted in: host/lease.py. No TensorFlow here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from od_dist.cluster import hostport
from od_dist.cluster.spec import PARAMETER_SERVER, Cluster, Task
from od_dist.host.lease import LEASE_S
from od_dist.protocol import lineage
from od_dist.protocol.membership import DONE, FORMING, READY, TRAINING, Group

SETTLE_S = 3.0  # the machines seen forming unchanged this long: none is still on its way
CONFIRM_S = 30.0  # a proposal not taken by every member within this is dropped
FAILS_TO_COOL = 2  # failed rounds in a row after which a machine is left out of proposals...
COOLING_S = 60.0  # ...until it has stayed up this long (twice as long at each further failure)
STEADY_S = 120.0  # training this long ends a machine's streak of failed rounds


@dataclass(frozen=True)
class Round:
    round: int
    members: tuple[str, ...]
    step: int  # the newest checkpoint it started from (0: none)


class RunConflict(Exception):
    """Machines hold checkpoints of two runs: said in one line; the machine refuses to form."""


def history_of(state: dict) -> list[Round]:
    """The rounds so far, as a machine's state (Agreement.state) lists them."""
    return [Round(r, tuple(m), step) for r, m, step in state["history"]]


def machines(cluster: Cluster) -> dict[str, tuple[str, ...]]:
    """The trainers of each machine (hostport.machine_of), in the cluster file's order."""
    out: dict[str, list[str]] = {}
    for t in cluster.members():
        out.setdefault(hostport.machine_of(t.address.host), []).append(t.name)
    return {m: tuple(names) for m, names in out.items()}


@dataclass
class Agreement:
    """This machine's side of the agreement. `here`: its trainers; `newest_step`: its newest
    checkpoint's step (None: none); `run_of`: the run its checkpoints belong to (None: none named);
    `batch_problem(members)`: why the global batch cannot split over those trainers' replicas, or
    None; `clock`: seconds, monotonic."""

    cluster: Cluster
    here: tuple[Task, ...]
    say: Callable[[str], None]
    wait_timeout: float
    newest_step: Callable[[], int | None]
    batch_problem: Callable[[tuple[str, ...]], str | None]
    clock: Callable[[], float] = time.monotonic
    run_of: Callable[[], str | None] = lambda: None
    set_aside: Callable[[], str | None] = lambda: None  # moves the folder's checkpoints aside
    recall: Callable[[], dict | None] = lambda: None  # what its disk kept of the rounds (record)
    record: Callable[[dict], None] = lambda kept: None
    model_dir: str | None = None
    settle_s: float = SETTLE_S
    confirm_s: float = CONFIRM_S
    lease_s: float = LEASE_S
    cooling_s: float = COOLING_S
    phase: str = FORMING
    round: int = 0
    members: tuple[str, ...] = ()
    history: list[Round] = field(default_factory=list)
    stopping: bool = False  # its trainers were asked to stop: no machine rejoins this round here
    failures: int = 0  # its rounds that failed in a row
    on_change: Callable[[], None] = lambda: None  # its phase changed: the others' answers wanted now
    lease_lost: bool = False  # newcomer()'s reason is the coordinator's lease: no save, a kill
    done_run: str | None = None  # done: the run its trainers finished (said in its state)

    def __post_init__(self):
        self.names = [t.name for t in self.cluster.members()]
        self.tasks_of = machines(self.cluster)
        self.mine = next(m for m, names in self.tasks_of.items() if self.here[0].name in names)
        self.order = sorted(self.tasks_of, key=lambda m: self.names.index(self.tasks_of[m][0]))
        self.job = self.cluster.job_id()
        now = self.clock()
        self.started_at = self.forming_since = self.failed_at = now
        self.training_since = now
        self._alive: dict[str, dict] = {}  # the others that answered the last look
        self._looked_at = float("-inf")  # when the last look started
        self._quorum_at = float("-inf")  # the last look that saw this round's quorum
        self._settled: tuple[frozenset, float] = (frozenset(), now)
        self._proposed_at = now
        self._said = ""
        # The runs this od-dist saw trained (a machine ready or training in one): a machine holding no
        # checkpoint takes a DONE of one of them for the end of its part, never another run's.
        self._runs_seen: set[str] = set()
        self._told_done: set[tuple[str, str | None]] = set()  # DONEs of other runs said, once each
        # (round, members, when): its trainers left that round with 138 (a lost peer), to be judged
        # by the first look that starts after it.
        self._lost_peer_at: tuple[int, tuple[str, ...], float] | None = None
        # What its disk remembers of the rounds (`recall`, kept by `record`): the last round this
        # machine trained in, and the round its newest checkpoint came in, which a new process of
        # od-dist (a reboot) would not know otherwise. Rounds go on counting from it.
        self._noting = threading.Lock()
        kept = self.recall() or {}
        self.round = self._trained_round = int(kept.get("round", 0))
        self._step_seen = 0  # the newest step at the last look, and the round it came in
        self._step_round = 0
        if kept.get("step") and kept["step"] == (self.newest_step() or 0):
            self._step_seen, self._step_round = int(kept["step"]), int(kept.get("step_round", 0))

    # ----- what this machine says, what it reads ------------------------------------------------

    def state(self) -> dict:
        self._note_step()
        return {
            "job": self.job,
            "trainers": list(self.tasks_of[self.mine]),
            "phase": self.phase,
            "round": self.round,
            "members": list(self.members),
            "step": self._step_seen,
            "step_round": self._step_round,
            "run": self.done_run if self.phase == DONE and self.done_run else self.run_of(),
            "model_dir": self.model_dir,
            "stopping": self.stopping,
            "cooling": self.cooling(),
            "sees": sorted(self._alive),
            "history": [[r.round, list(r.members), r.step] for r in self.history],
        }

    def _note_step(self) -> None:
        """The round of this machine's newest checkpoint: the round its trainers last trained in
        when the step changed (saved, a stop's save, a copy fetched); 0 for what a new process of
        od-dist finds on the disk, which a round of the live machines then beats."""
        with self._noting:  # the looker's thread and the membership server's both note it
            step = self.newest_step() or 0
            if step != self._step_seen:
                self._step_seen, self._step_round = step, (self._trained_round if step else 0)
                self._keep()

    def _keep(self) -> None:
        self.record({"round": self._trained_round, "step": self._step_seen, "step_round": self._step_round})

    def seen(self, states: dict[str, dict], at: float) -> None:
        """A look, started at `at`: the other machines that answered, with their states."""
        self._note_step()
        self._alive = {m: s for m, s in states.items() if s.get("job") == self.job}
        self._looked_at = at
        self._runs_seen |= {
            s["run"]
            for s in self._alive.values()
            if s.get("phase") in (READY, TRAINING) and lineage.is_run(s.get("run"))
        }
        if self._lost_peer_at is not None and at >= self._lost_peer_at[2]:
            self._judge_lost_peer(at)
        if self.phase == TRAINING and self._quorum(self._alive):
            self._quorum_at = at

    def _quorum(self, alive: dict[str, dict]) -> bool:
        """The trainers of this round this machine reaches, its own included, are min_trainers:
        members training in it, or forming to rejoin it and seeing this machine."""
        held = set(self.tasks_of[self.mine]) & set(self.members)
        for m, s in alive.items():
            if (s["phase"] == TRAINING and s["round"] == self.round) or (
                s["phase"] == FORMING and self.mine in s.get("sees", ())
            ):
                held |= set(s["trainers"]) & set(self.members)
        return len(held) >= (self.cluster.min_trainers or 1)

    def charge(self, why: str, now: float | None = None) -> None:
        """A failure of this machine's own that no exit code says (its trainers overran the stop's
        --grace_period and were killed, or claimed a lost peer that lost nothing): counted as a
        failed round, as policy.own_failure's exits are, towards leaving it out of proposals."""
        now = self.clock() if now is None else now
        self.failures, self.failed_at = self.failures + 1, now
        self.say(f"{why}: counted as this machine's failure ({self.failures} in a row)")

    def _judge_lost_peer(self, at: float) -> None:
        """Its trainers left round r with 138 (a lost peer): when the first look after it finds every
        other member's machine still training in round r (none stopping), no peer was lost: the
        loss is this machine's own (a trainer that fails its peers' collective or watch every
        round), charged. A peer gone, forming, stopping or in another round: another's loss."""
        r, members, _ = self._lost_peer_at
        self._lost_peer_at = None
        others = [m for m in self._machines_of(members) if m != self.mine]
        if others and all(
            self._alive.get(m, {}).get("phase") == TRAINING
            and self._alive[m].get("round") == r
            and not self._alive[m].get("stopping")
            for m in others
        ):
            names = ", ".join(n for m in others for n in self.tasks_of[m] if n in members)
            self.charge(
                f"round {r}: {', '.join(self.tasks_of[self.mine])} exited 138 (a lost peer) while every "
                f"other member ({names}) trained on in it: no peer was lost",
                at,
            )

    def _say_once(self, line: str) -> None:
        if line != self._said:
            self._said = line
            self.say(line)

    def _machines_of(self, members) -> list[str]:
        return [m for m in self.order if set(self.tasks_of[m]) & set(members)]

    def cooling(self, now: float | None = None) -> float:
        """Seconds this machine is still left out of proposals after failed rounds (0: none)."""
        if self.failures < FAILS_TO_COOL:
            return 0.0
        now = self.clock() if now is None else now
        wait = self.cooling_s * 2 ** (self.failures - FAILS_TO_COOL)
        return max(0.0, wait - (now - self.failed_at))

    def _key(self, state: dict) -> tuple[int, int]:
        """What makes a machine's newest checkpoint the newest: its round first, then its step."""
        return state.get("step_round", 0), state.get("step", 0)

    # ----- forming --------------------------------------------------------------------------------

    def regroup(self, now: float | None = None, failed: bool = False, lost_peer: bool = False) -> None:
        """This machine's trainers stopped (lost a peer, or asked to stop): it forms again.
        `failed`: its own trainers failed (counted towards leaving it out of proposals).
        `lost_peer`: they exited 138 unasked: the next look says whose loss it was (_judge_lost_peer)."""
        now = self.clock() if now is None else now
        if failed:
            self.failures, self.failed_at = self.failures + 1, now
        if lost_peer and not failed and self.phase == TRAINING and self.members:
            self._lost_peer_at = (self.round, self.members, now)
        self.phase, self.forming_since, self.stopping = FORMING, now, False
        self._settled = (frozenset(), now)
        self.on_change()

    def _our_runs(self) -> set[str]:
        """The runs this machine is of: the one its checkpoints belong to, or, holding none, the
        runs it saw trained since its od-dist started (it waited to join one, or trained in it)."""
        mine = self.run_of() if self.newest_step() else None
        return {mine} if mine else set(self._runs_seen)

    def _done_of_another_run(self, state: dict) -> bool:
        """`state` is a machine's DONE (its trainers finished) of a run this machine is not of: an
        earlier run's od-dist still up (serving its final checkpoint), which ends nothing here."""
        return state.get("phase") == DONE and state.get("run") not in self._our_runs()

    def finished_elsewhere(self) -> dict | None:
        """The state of a machine whose trainers finished this machine's run (while this one
        formed): of the run this machine holds, or, holding none, of a run it saw trained. A DONE
        carries its run; a DONE of any other run (an earlier run's machine still up, a run named
        by no one) ends nothing."""
        ours = self._our_runs()
        return next((s for s in self._alive.values() if s["phase"] == DONE and s.get("run") in ours), None)

    def _say_done_of_other_runs(self) -> None:
        for m, s in self._alive.items():
            key = (m, s.get("run"))
            if self._done_of_another_run(s) and key not in self._told_done:
                self._told_done.add(key)
                held = self.run_of() if self.newest_step() else None
                why = (
                    f"this machine holds run {held}"
                    if held
                    else "this machine holds no checkpoint of it and saw no machine train it"
                )
                self.say(
                    f"{', '.join(s['trainers'])} finished run {s.get('run') or '(none named)'} (round "
                    f"{s.get('round', 0)}, step {s.get('step', 0):,}); {why}: not the end of this run, "
                    "forming without it"
                )

    def done(self, run: str | None = None) -> None:
        """Its trainers finished (or those of `run`, this machine's, finished without them): its
        state says DONE and that run from now on."""
        held = self.run_of() if self.newest_step() else None
        self.done_run = run or held or self._run_of_round()
        self.phase = DONE

    def _run_of_round(self) -> str | None:
        """The run a member of this machine's round says it trains (a worker that fetched no copy)."""
        for s in self._alive.values():
            if s.get("round") == self.round and lineage.is_run(s.get("run")):
                if set(s.get("trainers", ())) & set(self.members):
                    return s["run"]
        return None

    def _of_another_run(self, state: dict) -> bool:
        """The machine of `state` holds checkpoints of a run other than this machine's."""
        mine = self.run_of() if self.newest_step() else None
        return bool(mine and state.get("run") and state.get("step") and state["run"] != mine)

    def _check_runs(self, alive: dict[str, dict]) -> None:
        """Machines up that hold checkpoints of another run. While a round of theirs trains, this
        machine is the one behind: under parameter_server its folder holds a worker's copies, set
        aside (moved) so that it joins their run; under multi_worker_mirrored its own checkpoints,
        which it never gives up on its own: RunConflict. With no round training, RunConflict too:
        which run goes on is the user's to say."""
        others = {m: s for m, s in alive.items() if self._of_another_run(s) and s["phase"] != DONE}
        if not others:
            return
        mine, step = self.run_of(), self.newest_step() or 0
        live = [s for s in others.values() if s["phase"] == TRAINING]
        if live and self.cluster.strategy == PARAMETER_SERVER:
            aside = self.set_aside()
            self.say(
                f"{self.model_dir} held copies of run {mine} (to step {step:,}), not of run {live[0]['run']}, "
                f"which round {live[0]['round']} trains: moved them to {aside}; joining run {live[0]['run']}"
            )
            return
        held = ", ".join(
            f"{', '.join(s['trainers'])} holds run {s['run']} at step {s['step']:,} in {s.get('model_dir')} (on {m})"
            for m, s in others.items()
        )
        raise RunConflict(
            f"checkpoints of two runs: {', '.join(self.tasks_of[self.mine])} holds run {mine} at step {step:,} "
            f"in {self.model_dir}, {held}; no machine takes over another run's: go on with one run by moving "
            f"the other's checkpoints out of its --model_dir, or {lineage.FRESH_HINT}"
        )

    def form(self, now: float | None = None) -> Group | None:
        """One step of forming: the group to start this machine's trainers in, once agreed."""
        now = self.clock() if now is None else now
        self._check_runs(self._alive)
        # A machine of another run is none of this machine's to form with (it refuses, or sets
        # its copies aside and comes back of this run), nor one that finished another run.
        if self.finished_elsewhere() is None:
            self._say_done_of_other_runs()
        alive = {
            m: s
            for m, s in self._alive.items()
            if not self._of_another_run(s) and not self._done_of_another_run(s)
        }
        if self.phase == READY:
            return self._confirm(now, alive)
        rejoin = self._round_to_rejoin(alive)
        if rejoin is not None:
            self.history = history_of(rejoin)
            self.phase, self.round, self.members = TRAINING, rejoin["round"], tuple(rejoin["members"])
            self.training_since = self._quorum_at = now
            self._note_step()
            self._trained_round = self.round
            self._keep()
            self.say(
                f"rejoining round {self.round} ({', '.join(self.members)}), which {self.members[0]} "
                "coordinates: TensorFlow's coordinator takes a worker back on its address"
            )
            return Group(self.round, self.members)
        # A machine still stopping the trainers of a round older than one seen (stuck in a step
        # whose peers are cut off, until --grace_period) holds no one back.
        newest = max([self.round] + [s["round"] for s in alive.values()])
        training = [
            s
            for s in alive.values()
            if s["phase"] == TRAINING and not (s.get("stopping") and s["round"] < newest)
        ]
        if training:
            # A round winds down (or trains on): the deadline counts only time without one.
            self.forming_since = now
            s = max(training, key=lambda s: s["round"])
            if set(self.tasks_of[self.mine]) & set(s["members"]):  # its trainers have yet to stop
                self._say_once(
                    f"waiting for {', '.join(s['trainers'])} to stop its trainers of round {s['round']}"
                )
            else:
                self._say_once(
                    f"waiting to join the group of round {s['round']} ({', '.join(s['members'])}): it saves "
                    "a checkpoint and goes on with this machine"
                )
            return None
        if self.finished_elsewhere():
            return None
        if self.cooling(now):
            wait = self.cooling_s * 2 ** (self.failures - FAILS_TO_COOL)
            self._say_once(
                f"left out of the next rounds for {wait:.0f} s: this machine's last {self.failures} rounds "
                "failed (its log says why); the others go on without it"
            )
            return None
        up = [
            m
            for m in self.order
            if m == self.mine
            or (alive.get(m, {}).get("phase") in (FORMING, READY) and not alive[m].get("cooling"))
        ]
        lead = up[0]
        if lead != self.mine:
            s = alive[lead]
            if (
                s["phase"] == READY
                and s["round"] > self.round
                and set(self.tasks_of[self.mine]) <= set(s["members"])
            ):
                self.history = history_of(s)
                self._take(Group(s["round"], tuple(s["members"])), now)
            return None
        return self._propose(now, alive)

    def _round_to_rejoin(self, alive: dict[str, dict]) -> dict | None:
        """parameter_server: the state of the machine coordinating the round that this machine's
        trainers are members of, while it trains and was not asked to stop: a lost worker rejoins
        that round, as TensorFlow's coordinator runs its steps on the others meanwhile."""
        if self.cluster.strategy != PARAMETER_SERVER or self._looked_at < self.forming_since:
            return None  # not a look from before this machine's loss: its coordinator may be gone
        mine = set(self.tasks_of[self.mine])
        for s in alive.values():
            members = s["members"]
            if (
                s["phase"] == TRAINING
                and not s.get("stopping")
                and members
                and members[0] in s["trainers"]
                and mine <= set(members[1:])
                and s["round"] >= max((t["round"] for t in alive.values()), default=0)
            ):
                return s
        return None

    def _propose(self, now: float, alive: dict[str, dict]) -> None:
        forming = [
            m
            for m in self.order
            if m == self.mine or (alive.get(m, {}).get("phase") == FORMING and not alive[m].get("cooling"))
        ]
        if frozenset(forming) != self._settled[0]:
            self._settled = (frozenset(forming), now)
            return None
        if now - self._settled[1] < self.settle_s:
            return None
        members = tuple(n for n in self.names if any(n in self.tasks_of[m] for m in forming))
        missing = [n for n in self.names if n not in members]
        histories = [self.history] + [history_of(s) for s in alive.values()]
        history = max(histories, key=lambda h: h[-1].round if h else 0)
        if missing:
            up = f"{len(members)} of {len(self.names)} trainers up ({', '.join(members)}; not up: {', '.join(missing)})"
            if len(members) < self.cluster.min_trainers:
                self._say_once(f"waiting: {up}; a group needs min_trainers {self.cluster.min_trainers}")
                return None
            if not history and now - self.started_at < self.wait_timeout:
                self._say_once(
                    f"waiting for every trainer before the first round: {up}; after --wait_timeout "
                    f"({self.wait_timeout:.0f} s from the start) the {len(members)} up start"
                )
                return None
            problem = self.batch_problem(members)
            if problem:
                self._say_once(f"no group of {', '.join(members)}: {problem}; waiting for a trainer more")
                return None
        self.history = list(history)
        if self.cluster.strategy == PARAMETER_SERVER:
            members = self._newest_first(members, alive)
        rounds = [self.round] + [s["round"] for s in alive.values()] + [h[-1].round for h in histories if h]
        group = Group(max(rounds) + 1, members)
        # Said, as the round line is, so that a reader (benchmarks/breakdown.py) sees how long the
        # forming took and how long the members then took to take the proposal.
        self.say(
            f"proposing round {group.round}: {', '.join(members)} (forming unchanged for "
            f"{now - self._settled[1]:.0f} s); waiting for every member to take it"
        )
        self._take(group, now)
        return None

    def _newest_first(self, members: tuple[str, ...], alive: dict[str, dict]) -> tuple[str, ...]:
        """parameter_server: the round's coordinator (its first member) is a trainer of the machine
        that holds the newest checkpoint (the newest round's, then the highest step; the file's order
        among equals), so it resumes from it without a fetch: a master back on an old disk joins as a
        worker."""
        keys = {m: (self._key(alive[m]) if m in alive else (0, 0)) for m in self._machines_of(members)}
        self._note_step()
        keys[self.mine] = (self._step_round, self._step_seen)
        newest = max(keys.values())
        holder = next(m for m in self._machines_of(members) if keys[m] == newest)
        lead = next(n for n in members if n in self.tasks_of[holder])
        return (lead,) + tuple(n for n in members if n != lead)

    def _take(self, group: Group, now: float) -> None:
        self.phase, self.round, self.members = READY, group.round, group.members
        self._proposed_at = now
        self.on_change()

    def _confirm(self, now: float, alive: dict[str, dict]) -> Group | None:
        want = (self.round, list(self.members))
        waiting = [
            m
            for m in self._machines_of(self.members)
            if m != self.mine
            and not (
                alive.get(m, {}).get("phase") in (READY, TRAINING)
                and (alive[m]["round"], alive[m]["members"]) == want
            )
        ]
        newer = [s for s in alive.values() if s["round"] > self.round and s["phase"] in (READY, TRAINING)]
        if not waiting and not newer:
            step = max(
                [self.newest_step() or 0]
                + [alive[m]["step"] for m in self._machines_of(self.members) if m in alive]
            )
            self.history.append(Round(self.round, self.members, step))
            self.phase = TRAINING
            self.training_since = self._quorum_at = now
            self._note_step()  # what it holds now is of the rounds before
            self._trained_round = self.round
            self._keep()
            self.say(self.round_line())
            return Group(self.round, self.members)
        if newer:
            self.say(f"round {self.round}: round {newer[0]['round']} is newer; forming again")
            self.regroup(now)
        elif now - self._proposed_at > self.confirm_s:
            names = ", ".join(n for m in waiting for n in self.tasks_of[m])
            self.say(
                f"round {self.round} was not taken by {names} within {self.confirm_s:.0f} s; forming again"
            )
            self.regroup(now)
        return None

    def round_line(self) -> str:
        r = self.history[-1]
        missing = [n for n in self.names if n not in r.members]
        without = f"; without {', '.join(missing)}" if missing else ""
        lead = f", {r.members[0]} coordinating" if self.cluster.strategy == PARAMETER_SERVER else ""
        return (
            f"round {r.round}: {', '.join(r.members)} train from step {r.step:,}{lead} "
            f"({len(r.members)} of {len(self.names)} trainers{without})"
        )

    # ----- training -------------------------------------------------------------------------------

    def coordinates(self) -> bool:
        """parameter_server: this machine runs the round's coordinator (its first member)."""
        return bool(self.members) and self.members[0] in self.tasks_of[self.mine]

    def newcomer(self, members: bool = True, now: float | None = None) -> str | None:
        """While training: why this machine's trainers stop now (a checkpoint, then a new round),
        None while they go on. `members`: a member that lost its trainers counts (else only a
        machine the group must take in, a newer round, the lease)."""
        now = self.clock() if now is None else now
        if now - self.training_since >= STEADY_S:
            self.failures = 0
        alive = self._alive
        newer = [s for s in alive.values() if s["round"] > self.round and s["phase"] in (READY, TRAINING)]
        if newer:
            s = max(newer, key=lambda s: s["round"])
            return f"round {s['round']} ({', '.join(s['members'])}) is newer than round {self.round}, which stops here"
        ps = self.cluster.strategy == PARAMETER_SERVER
        self.lease_lost = ps and self.coordinates() and now - self._quorum_at > self.lease_s
        if self.lease_lost:
            return (
                f"the coordinator of round {self.round} has not reached min_trainers "
                f"({self.cluster.min_trainers}) of its round for {now - self._quorum_at:.0f} s: it stops before "
                "the others form without it"
            )
        if ps and not self.coordinates():
            # Its worker servers serve until the coordinator has saved and left the round.
            lead = next((s for s in alive.values() if self.members[0] in s["trainers"]), None)
            # (Done, it tells its servers itself, and serves its final checkpoint to their fetch.)
            if lead is not None and (lead["phase"] == FORMING or lead["round"] != self.round):
                return f"{self.members[0]} left round {self.round} (it saved a checkpoint)"
            return None
        for s in alive.values():
            same = (s["round"], s["members"]) == (self.round, list(self.members))
            if s.get("cooling") or self._of_another_run(s):
                continue  # left out of proposals, or of another run: no reason to stop for it
            if s["phase"] == FORMING or (s["phase"] == READY and not same):
                names = ", ".join(s["trainers"])
                if set(s["trainers"]) & set(self.members):
                    if ps and self.members[0] not in s["trainers"]:
                        continue  # a worker lost and back rejoins this round (form)
                    if members:
                        return f"{names} of round {self.round} is forming a new group"
                    continue
                return f"{names} is up and waiting to join"
        return None

    def trained(self, final_step: int | None, states: list[dict]) -> str:
        """Who trained which steps: `trained steps 0-1,200 on 3 of 3 trainers, 1,200-3,000 on 2 of
        3 trainers (without worker:1)`. Rounds that trained no step are left out, and rounds of the
        same members one after another (a trainer lost and back before a save) said as one.
        `states`: the others' (the final step as the lead wrote it, which a member may not hold)."""
        states = [s for s in states if not self._done_of_another_run(s)]
        final_step = max([final_step or 0] + [s.get("step", 0) for s in states])
        spans: list[list] = []  # [from, to, members]
        for i, r in enumerate(self.history):
            end = self.history[i + 1].step if i + 1 < len(self.history) else (final_step or r.step)
            if end <= r.step:
                continue
            if spans and set(spans[-1][2]) == set(r.members):
                spans[-1][1] = end
            else:
                spans.append([r.step, end, r.members])
        parts = []
        for start, end, members in spans:
            missing = [n for n in self.names if n not in members]
            without = f" (without {', '.join(missing)})" if missing else ""
            parts.append(f"{start:,}-{end:,} on {len(members)} of {len(self.names)} trainers{without}")
        return "trained steps " + ", ".join(parts) if parts else ""
