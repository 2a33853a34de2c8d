"""Which strategy the measurements recommend for a cluster file's layout, and the speed-up they saw
on such a layout: the one line `validate` and `doctor` print. The figures are BENCHMARKS.md's
(docs/scaling.md reads them): simulated machines of 0.6 cores, links unshaped or at 100 Mbit/s,
each against one machine in the same run. No TensorFlow, no network.
"""

from __future__ import annotations

from od_dist.cluster import hostport
from od_dist.cluster.validate import PARAMETER_SERVER

SOURCE = "BENCHMARKS.md, docs/scaling.md"
# multi_worker_mirrored, one trainer per machine, 100 Mbit/s: trainer machines -> (the demo, a
# real-size detector: SSD MobileNet V2 FPNLite imported), against one machine.
MWM_100MBIT = {2: ("1.63x", "1.96x"), 3: ("1.87x", "2.67x")}
# parameter_server, 2 workers at 100 Mbit/s: one ps machine, a ps on each worker machine.
PS_100MBIT = ("0.81x", "0.99x")


def _machines(tasks) -> list[str]:
    return list(dict.fromkeys(hostport.machine_of(t.address.host) for t in tasks))


def advise(cluster) -> tuple[bool, str]:
    """(whether the file follows the advice, one line: the strategy the measurements recommend
    for this layout and the speed-up to expect over one machine, with the figures' source)."""
    trainers = _machines(cluster.members())
    n = len(trainers)
    if cluster.loopback_only() or n < 2:
        return True, (
            "every trainer is on one machine: no speed-up over one machine to expect; across machines "
            f"the measurements recommend multi_worker_mirrored, one trainer per machine ({SOURCE})"
        )
    if cluster.strategy == PARAMETER_SERVER:
        return False, (
            f"parameter_server trained slower than one machine at 100 Mbit/s ({PS_100MBIT[0]} with "
            f"one ps machine, {PS_100MBIT[1]} with a ps on each worker machine, 2 workers); for "
            f"speed the measurements recommend multi_worker_mirrored ({MWM_100MBIT[2][0]} on 2 "
            "machines): drop ps and set 'strategy: multi_worker_mirrored'; keep parameter_server "
            f"for asynchronous updates ({SOURCE})"
        )
    head = f"multi_worker_mirrored on {n} trainer machines is what the measurements recommend"
    if n > 3:
        demo, real = MWM_100MBIT[3]
        return True, (
            f"{head}; more than 3 were not measured (3 at 100 Mbit/s: {demo} the demo, {real} a "
            f"real-size detector) ({SOURCE})"
        )
    demo, real = MWM_100MBIT[n]
    return True, (
        f"{head}; expect about {demo} one machine's speed at 100 Mbit/s for the demo, {real} for a "
        f"real-size detector (SSD FPNLite), more on faster links ({SOURCE})"
    )
