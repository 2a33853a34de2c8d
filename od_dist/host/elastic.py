"""An elastic job (the cluster file's min_trainers): the group that trains is agreed by the trainer
machines' own od-dist supervisors, over their membership ports, without a shared folder or a service
outside the job. The rules are host/agreement.py's, with no I/O; here, this machine's state served
on its membership address and the others' read in a thread of their own. No TensorFlow here.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

from od_dist.host.agreement import (  # noqa: F401 - the supervisor's words for a machine's phase
    DONE,
    FORMING,
    READY,
    TRAINING,
    Agreement,
    Round,
    RunConflict,
    machines,
)
from od_dist.host.lease import LEASE_LOOKS, LOOK_EVERY_S
from od_dist.protocol import membership


@dataclass
class Elastic(Agreement):
    """Agreement, served and looking. `addresses`: each machine's membership address (default: its
    first trainer's host and the cluster's membership_port)."""

    addresses: dict[str, tuple[str, int]] | None = None
    look_every_s: float = LOOK_EVERY_S

    def __post_init__(self):
        super().__post_init__()
        # The lease is renewed by looks: one shorter than two of this machine's look cycles (a
        # silent machine's timeout and the pause) runs out between the looks of a healthy round.
        cycle = self.look_every_s + membership.TIMEOUT_S
        if self.lease_s < LEASE_LOOKS * cycle - 1e-9:
            raise ValueError(
                f"the coordinator's lease ({self.lease_s:.1f} s) is shorter than {LEASE_LOOKS} looks at "
                f"the other machines ({LEASE_LOOKS} x {cycle:.1f} s)"
            )
        if self.addresses is None:
            self.addresses = self.cluster.membership_addresses()
        self._look_now = threading.Event()  # wakes the looker: a fresh look wanted at once
        self._stopped = threading.Event()
        self.on_change = self._look_now.set
        self._look_failed = ""

    def address(self) -> tuple[str, int]:
        return self.addresses[self.mine]

    def serving(self) -> contextlib.ExitStack:
        """This machine's state served on its membership address, and the others' read in a thread
        of their own every look_every_s (a machine that is off costs a timeout, which the
        supervisor's loop does not wait for), until the returned stack is closed. Raises OSError
        now when the port is taken."""
        host, port = self.address()
        stack = contextlib.ExitStack()
        # The other trainer machines have slots of their own there; strangers share the rest.
        others = [self.addresses[m][0] for m in self.order if m != self.mine]
        stack.enter_context(membership.StateServer(host, port, self.state, others=others))
        looker = threading.Thread(target=self._keep_looking, name="membership-looker", daemon=True)
        self._stopped.clear()
        looker.start()

        def stop_looking():
            self._stopped.set()
            self._look_now.set()
            looker.join(membership.TIMEOUT_S + 1)

        stack.callback(stop_looking)
        return stack

    def _read_others(self) -> dict[str, dict]:
        """The other machines that answer now, with their states (of this job)."""
        others = [m for m in self.order if m != self.mine]
        states = membership.read_all([self.addresses[m] for m in others])
        return {m: s for m, s in zip(others, states) if s and s.get("job") == self.job}

    def _keep_looking(self) -> None:
        while not self._stopped.is_set():
            started = self.clock()
            try:
                self.seen(self._read_others(), started)
                self._look_failed = ""
            except Exception as e:  # noqa: BLE001 - one look's error: the others are as unseen
                # A look that fails is a look that saw no one: the lease and the forming read it so,
                # rather than a view frozen at the last look that worked.
                line = (
                    f"membership: a look at the other machines failed ({type(e).__name__}: {e}); trying again"
                )
                if line != self._look_failed:
                    self._look_failed = line
                    self.say(line)
                self.seen({}, started)
            self._look_now.wait(self.look_every_s)
            self._look_now.clear()

    def trained(self, final_step: int | None) -> str:
        # The final step as the lead wrote it, which a member may not hold (parameter_server): read
        # now, as the last look may be from before the final save.
        states = list(self._read_others().values()) + list(self._alive.values())
        return super().trained(final_step, states)
