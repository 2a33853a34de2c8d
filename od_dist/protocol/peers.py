"""How long a peer may stay unreachable before a task counts it lost, and how often it looks."""

from __future__ import annotations

PROBE_S = 2.0
# multi_worker_mirrored cannot go on without any trainer; a port closed this long is a lost peer
# (a peer that finished training stops this watch before it closes its port). --lost_peer_timeout.
# Measured (benchmarks/outage.py): TensorFlow's collectives ride out a 5 s outage and abort after a
# 10 s one (the coordination service's heartbeat), so od-dist ends no job that TensorFlow would
# carry on, and TensorFlow's own error names the loss of a longer one.
LOST_PEER_TIMEOUT_S = 10
