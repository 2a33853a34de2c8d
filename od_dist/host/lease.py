"""The coordinator's lease in an elastic parameter_server job, and the look cycle it is counted in,
with no I/O. The rule (host/agreement.py): the coordinator needs no member to go on, so it trains
only while its last look within lease_s saw min_trainers trainers in its round. Here its length:
lease_s is two look cycles (a look's timeout for a silent machine and the pause between looks:
LEASE_S), so that a healthy coordinator's next look renews it in time, and at most LEASE_SHARE of
the workers' patience (--lost_peer_timeout), so a coordinator cut off stops before the others can
form a round without it; a --lost_peer_timeout that cannot give both is refused (lease_problem).
No TensorFlow here.
"""

from __future__ import annotations

from od_dist.cluster import messages
from od_dist.protocol import membership, peers

LOOK_EVERY_S = 1.0  # host/elastic.py looks at the others this long after its last look ended
# The look cycle: the longest from one look's start to the next one's while a machine is silent (a
# look waits membership.TIMEOUT_S for it, then LOOK_EVERY_S), 3 s.
LOOK_CYCLE_S = LOOK_EVERY_S + membership.TIMEOUT_S
# The coordinator's lease (parameter_server), in look cycles. A look that saw the quorum renews it
# from its start; the next one renews it once it has ended, up to a cycle and a look's timeout later
# (5 s and a little with one machine silent: 5.0 s on loopback, tests/test_fences.py). Two cycles (6 s)
# cover that; 3 s (what --lost_peer_timeout 5 gave) ran out between looks and killed a healthy
# coordinator every few seconds.
LEASE_LOOKS = 2
LEASE_S = LEASE_LOOKS * LOOK_CYCLE_S
# ...and at most this share of the workers' patience (--lost_peer_timeout): they form without the
# coordinator no sooner than --lost_peer_timeout + SETTLE_S (host/agreement.py) after its last look
# that saw them, so a coordinator cut off is killed well before. A --lost_peer_timeout that leaves
# less than LEASE_S is refused (lease_problem, exit 2 before anything starts), never taken with a
# shorter lease.
LEASE_SHARE = 0.6


def lease_for(lost_peer_timeout: float) -> float:
    """The coordinator's lease for --lost_peer_timeout: two look cycles (LEASE_S), at most
    LEASE_SHARE of the workers' patience; lease_problem says when that is less than two cycles."""
    return min(LEASE_S, LEASE_SHARE * lost_peer_timeout)


def least_lost_peer_timeout() -> int:
    """The least --lost_peer_timeout (whole seconds) that leaves the coordinator a lease of LEASE_S."""
    n = 1
    while LEASE_SHARE * n < LEASE_S - 1e-9:
        n += 1
    return n


def lease_problem(lost_peer_timeout: float) -> str | None:
    """Why --lost_peer_timeout is refused for an elastic parameter_server job (its coordinator's
    lease would be shorter than two looks at the others), or None. One line, as config.py's."""
    lease = LEASE_SHARE * lost_peer_timeout
    if lease >= LEASE_S - 1e-9:
        return None
    return messages.problem(
        "--lost_peer_timeout",
        lost_peer_timeout,
        f"an elastic parameter_server job's coordinator would hold a lease of {lease:.1f} s "
        f"({LEASE_SHARE:g} x it), shorter than two of its looks at the other machines ({LEASE_S:.0f} s "
        "with one of them silent): a healthy coordinator would be killed without a save",
        f"pass --lost_peer_timeout {least_lost_peer_timeout()} or more (the default is {peers.LOST_PEER_TIMEOUT_S})",
    )
