"""An elastic job (the cluster file's min_trainers): the group that trains is agreed by the trainer
machines' own od-dist supervisors, over their membership ports, without a shared folder or a service
outside the job. TensorFlow's all-reduce needs a fixed group, so a change of members is a new round:
every member's trainers start again, in the round's cluster, from the newest checkpoint any member
holds (task/controller.py's resume sends it to those behind). Under parameter_server the members are
the master and the workers, and a round's first member coordinates it (Cluster.group): the machine
holding the newest checkpoint (each member follows the coordinator's checkpoint feed), so a lost
master's place goes to a worker, while the ps keep serving (task/server.py follows the round's lead).

The rules, for each trainer machine:
  - Its phase: forming (no trainer of its runs), ready (it took a proposal and waits for every
    member to take it), training, or done (its trainers finished).
  - The first machine in the cluster file's order (the master, worker 0, 1, ...) among those forming
    or ready leads the forming. Once the machines it sees forming have stayed the same for SETTLE_S,
    it proposes them as the next round (one past the highest any machine shows), if they are at least
    min_trainers and the global batch splits over their replicas (the same arithmetic, only slower).
    Before the job's first round it waits for every trainer, up to --wait_timeout.
  - A forming machine takes its lead's proposal when it is a member; a ready machine starts its
    trainers once every member shows the same round and members, and drops the proposal after
    CONFIRM_S otherwise.
  - A training machine that sees another forming (a member whose trainer was lost, a machine back)
    asks its trainers to stop: they save a checkpoint at one step (task/stop.py), and all form the
    next round from it.
Never two groups: min_trainers is more than half of the trainers (cluster/validate.py), a machine
trains in one round at a time, and a group trains only while every member does (the all-reduce), so
two groups would need a machine in both. No TensorFlow here.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from od_dist.cluster import hostport
from od_dist.cluster.spec import PARAMETER_SERVER, Cluster, Task
from od_dist.protocol import membership
from od_dist.protocol.membership import DONE, FORMING, READY, TRAINING, Group

SETTLE_S = 3.0  # the machines seen forming unchanged this long: none is still on its way
CONFIRM_S = 30.0  # a proposal not taken by every member within this is dropped
LOOK_EVERY_S = 1.0


@dataclass(frozen=True)
class Round:
    round: int
    members: tuple[str, ...]
    step: int  # the newest checkpoint it started from (0: none)


def _history_of(state: dict) -> list[Round]:
    """The rounds so far, as a machine's state (Elastic.state) lists them."""
    return [Round(r, tuple(m), step) for r, m, step in state["history"]]


def machines(cluster: Cluster) -> dict[str, tuple[str, ...]]:
    """The trainers of each machine (hostport.machine_of), in the cluster file's order."""
    out: dict[str, list[str]] = {}
    for t in cluster.members():
        out.setdefault(hostport.machine_of(t.address.host), []).append(t.name)
    return {m: tuple(names) for m, names in out.items()}


@dataclass
class Elastic:
    """This machine's side of the agreement. `here`: its trainers; `newest_step`: its newest
    checkpoint's step (None: none); `batch_problem(members)`: why the global batch cannot split
    over those trainers' replicas, or None; `addresses`: each machine's membership address
    (default: its first trainer's host and the cluster's membership_port)."""

    cluster: Cluster
    here: tuple[Task, ...]
    say: Callable[[str], None]
    wait_timeout: float
    newest_step: Callable[[], int | None]
    batch_problem: Callable[[tuple[str, ...]], str | None]
    addresses: dict[str, tuple[str, int]] | None = None
    settle_s: float = SETTLE_S
    confirm_s: float = CONFIRM_S
    look_every_s: float = LOOK_EVERY_S
    clock: Callable[[], float] = time.monotonic
    phase: str = FORMING
    round: int = 0
    members: tuple[str, ...] = ()
    history: list[Round] = field(default_factory=list)

    def __post_init__(self):
        self.names = [t.name for t in self.cluster.members()]
        self.tasks_of = machines(self.cluster)
        self.mine = next(m for m, names in self.tasks_of.items() if self.here[0].name in names)
        if self.addresses is None:
            self.addresses = self.cluster.membership_addresses()
        self.order = sorted(self.tasks_of, key=lambda m: self.names.index(self.tasks_of[m][0]))
        self.job = self.cluster.job_id()
        now = self.clock()
        self.started_at = self.forming_since = now
        self._alive: dict[str, dict] = {}
        self._looked_at = float("-inf")  # when the look behind _alive started
        self._look_now = threading.Event()  # wakes the looker: a fresh look wanted at once
        self._stopped = threading.Event()
        self._settled: tuple[frozenset, float] = (frozenset(), now)
        self._proposed_at = now
        self._said = ""

    # ----- what this machine says, what it reads ------------------------------------------------

    def address(self) -> tuple[str, int]:
        return self.addresses[self.mine]

    def serving(self) -> contextlib.ExitStack:
        """This machine's state served on its membership address, and the others' read in a thread
        of their own every look_every_s (a machine that is off costs a timeout, which the
        supervisor's loop does not wait for), until the returned stack is closed. Raises OSError
        now when the port is taken."""
        host, port = self.address()
        stack = contextlib.ExitStack()
        stack.enter_context(membership.StateServer(host, port, self.state))
        looker = threading.Thread(target=self._keep_looking, name="membership-looker", daemon=True)
        self._stopped.clear()
        looker.start()

        def stop_looking():
            self._stopped.set()
            self._look_now.set()
            looker.join(membership.TIMEOUT_S + 1)

        stack.callback(stop_looking)
        return stack

    def state(self) -> dict:
        return {
            "job": self.job,
            "trainers": list(self.tasks_of[self.mine]),
            "phase": self.phase,
            "round": self.round,
            "members": list(self.members),
            "step": self.newest_step() or 0,
            "history": [[r.round, list(r.members), r.step] for r in self.history],
        }

    def _read_others(self) -> dict[str, dict]:
        """The other machines that answer now, with their states (of this job)."""
        others = [m for m in self.order if m != self.mine]
        states = membership.read_all([self.addresses[m] for m in others])
        return {m: s for m, s in zip(others, states) if s and s.get("job") == self.job}

    def _keep_looking(self) -> None:
        while not self._stopped.is_set():
            started = self.clock()
            self._alive = self._read_others()
            self._looked_at = started
            self._look_now.wait(self.look_every_s)
            self._look_now.clear()

    def _look(self) -> dict[str, dict]:
        """The other machines that answered the last look, with their states."""
        return self._alive

    def _say_once(self, line: str) -> None:
        if line != self._said:
            self._said = line
            self.say(line)

    def _machines_of(self, members) -> list[str]:
        return [m for m in self.order if set(self.tasks_of[m]) & set(members)]

    # ----- forming --------------------------------------------------------------------------------

    def regroup(self, now: float | None = None) -> None:
        """This machine's trainers stopped (lost a peer, or asked to stop): it forms again."""
        self.phase, self.forming_since = FORMING, self.clock() if now is None else now
        self._settled = (frozenset(), self.forming_since)
        self._look_now.set()

    def finished_elsewhere(self) -> dict | None:
        """The state of a machine whose trainers finished the job (while this one formed)."""
        return next((s for s in self._alive.values() if s["phase"] == DONE), None)

    def form(self, now: float | None = None) -> Group | None:
        """One step of forming: the group to start this machine's trainers in, once agreed."""
        now = self.clock() if now is None else now
        alive = self._look()
        if self.phase == READY:
            return self._confirm(now, alive)
        rejoin = self._round_to_rejoin(alive)
        if rejoin is not None:
            self.history = _history_of(rejoin)
            self.phase, self.round, self.members = TRAINING, rejoin["round"], tuple(rejoin["members"])
            self.say(
                f"rejoining round {self.round} ({', '.join(self.members)}), which {self.members[0]} "
                "coordinates: TensorFlow's coordinator takes a worker back on its address"
            )
            return Group(self.round, self.members)
        training = [s for s in alive.values() if s["phase"] == TRAINING]
        if training or self.finished_elsewhere():
            if training:
                s = training[0]
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
        up = [m for m in self.order if m == self.mine or alive.get(m, {}).get("phase") in (FORMING, READY)]
        lead = up[0]
        if lead != self.mine:
            s = alive[lead]
            if (
                s["phase"] == READY
                and s["round"] > self.round
                and set(self.tasks_of[self.mine]) <= set(s["members"])
            ):
                self.history = _history_of(s)
                self._take(Group(s["round"], tuple(s["members"])), now)
            return None
        return self._propose(now, alive)

    def _round_to_rejoin(self, alive: dict[str, dict]) -> dict | None:
        """parameter_server: the state of the machine coordinating the round that this machine's
        trainers are members of, while it trains: a lost worker rejoins that round, as TensorFlow's
        coordinator runs its steps on the others meanwhile; no new round for the others."""
        if self.cluster.strategy != PARAMETER_SERVER or self._looked_at < self.forming_since:
            return None  # not a look from before this machine's loss: its coordinator may be gone
        mine = set(self.tasks_of[self.mine])
        for s in alive.values():
            members = s["members"]
            if (
                s["phase"] == TRAINING
                and members
                and members[0] in s["trainers"]
                and mine <= set(members[1:])
            ):
                return s
        return None

    def _propose(self, now: float, alive: dict[str, dict]) -> None:
        forming = [m for m in self.order if m == self.mine or alive.get(m, {}).get("phase") == FORMING]
        if frozenset(forming) != self._settled[0]:
            self._settled = (frozenset(forming), now)
            return None
        if now - self._settled[1] < self.settle_s:
            return None
        members = tuple(n for n in self.names if any(n in self.tasks_of[m] for m in forming))
        missing = [n for n in self.names if n not in members]
        histories = [self.history] + [_history_of(s) for s in alive.values()]
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
        self._take(Group(max(rounds) + 1, members), now)
        return None

    def _newest_first(self, members: tuple[str, ...], alive: dict[str, dict]) -> tuple[str, ...]:
        """parameter_server: the round's coordinator (its first member) is a trainer of the machine
        that holds the newest checkpoint (the file's order among equals), so it resumes from it
        without a fetch: a master back on an old disk joins as a worker."""
        steps = {m: (alive[m]["step"] if m in alive else 0) for m in self._machines_of(members)}
        steps[self.mine] = self.newest_step() or 0
        newest = max(steps.values())
        holder = next(m for m in self._machines_of(members) if steps[m] == newest)
        lead = next(n for n in members if n in self.tasks_of[holder])
        return (lead,) + tuple(n for n in members if n != lead)

    def _take(self, group: Group, now: float) -> None:
        self.phase, self.round, self.members = READY, group.round, group.members
        self._proposed_at = now
        self._look_now.set()  # the members' answers, at once

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
        if not waiting:
            step = max(
                [self.newest_step() or 0]
                + [alive[m]["step"] for m in self._machines_of(self.members) if m in alive]
            )
            self.history.append(Round(self.round, self.members, step))
            self.phase = TRAINING
            self.say(self.round_line())
            return Group(self.round, self.members)
        if now - self._proposed_at > self.confirm_s:
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

    def newcomer(self, members: bool = True) -> str | None:
        """While training: a machine forming (a member that lost its trainers, unless not
        `members`; a machine back), which the group stops for (a checkpoint, then a round with it);
        None while there is none."""
        for s in self._look().values():
            same = (s["round"], s["members"]) == (self.round, list(self.members))
            if s["phase"] == FORMING or (s["phase"] == READY and not same):
                names = ", ".join(s["trainers"])
                if set(s["trainers"]) & set(self.members):
                    if self.cluster.strategy == PARAMETER_SERVER and self.members[0] not in s["trainers"]:
                        continue  # a worker lost and back rejoins this round (form)
                    if members:
                        return f"{names} of round {self.round} is forming a new group"
                    continue
                return f"{names} is up and waiting to join"
        return None

    def done(self) -> None:
        self.phase = DONE

    def trained(self, final_step: int | None) -> str:
        """Who trained which steps: `trained steps 0-1,200 on 3 of 3 trainers, 1,200-3,000 on 2 of
        3 trainers (without worker:1)`. Rounds that trained no step are left out, and rounds of the
        same members one after another (a trainer lost and back before a save) said as one."""
        # The final step as the lead wrote it, which a member may not hold (parameter_server): read
        # now, as the last look may be from before the final save.
        states = list(self._read_others().values()) + list(self._alive.values())
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
