"""What each trainer machine of an elastic job (the cluster file's min_trainers) says of itself to
the others, and what its supervisor tells the trainers it starts: the group they train in.

Each trainer machine's od-dist serves its state, read-only JSON, on the cluster file's
membership_port (`GET /`: the job, its trainers, its phase, the round and members it trains in, its
newest checkpoint's step, the rounds so far) and reads the others'. The rules that agree one group
from what they read are host/elastic.py's. No TensorFlow here.
"""

from __future__ import annotations

import json
import os
import socket
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from od_dist.protocol import serving

TIMEOUT_S = 2.0  # a machine that does not answer within this is not up, for this look
# A machine's phase: forming (no trainer of its runs), ready (it took a proposal and waits for every
# member to take it), training, or done (its trainers finished). host/elastic.py says when.
FORMING, READY, TRAINING, DONE = "forming", "ready", "training", "done"
# The supervisor's word to the trainers it starts: the round and its members (by their names in
# the cluster file), as JSON.
GROUP_ENV = "OD_DIST_GROUP"


@dataclass(frozen=True)
class Group:
    round: int
    members: tuple[str, ...]  # the trainers, by their names in the cluster file

    def to_env(self) -> str:
        return json.dumps({"round": self.round, "members": list(self.members)})


def group_from_env() -> Group | None:
    """The group this trainer was started in by its supervisor, None outside an elastic job."""
    text = os.environ.get(GROUP_ENV)
    if not text:
        return None
    value = json.loads(text)
    return Group(int(value["round"]), tuple(value["members"]))


class StateServer:
    """Serves `state()` on (host, port) while entered. `others`: the other trainer machines' hosts,
    whose addresses have slots of their own (serving.Server's `named`)."""

    def __init__(self, host: str, port: int, state: Callable[[], dict], others=()):
        named = {serving.address(info[4][0]) for other in others for info in _resolved(other)}
        answer = lambda request: self._answer(request, state)  # noqa: E731
        self._server = serving.Server(host, port, answer, "membership", named=named)
        self.everywhere = self._server.everywhere

    @staticmethod
    def _answer(request: serving.Request, state) -> serving.Answer:
        if request.path.partition("?")[0] not in ("", "/"):
            return serving.error(404)
        return serving.json_answer(state())

    def __enter__(self):
        self._server.__enter__()
        return self

    def __exit__(self, *exc):
        self._server.__exit__(*exc)


def _resolved(host: str) -> list:
    try:
        return socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return []


def read(host: str, port: int, timeout: float = TIMEOUT_S) -> dict | None:
    """A machine's state, None when it does not answer (or answers with no state, or no HTTP: any
    error of one read is that machine not up for this look, never the end of the looker's thread)."""
    try:
        with urllib.request.urlopen(serving.url(host, port, ""), timeout=timeout) as answer:
            state = json.loads(answer.read(1 << 20))
    except Exception:  # noqa: BLE001 - OSError, ValueError, http.client.HTTPException (BadStatusLine), ...
        return None
    return state if isinstance(state, dict) else None


def read_all(addresses, timeout: float = TIMEOUT_S) -> list[dict | None]:
    """read() of every (host, port), at once: one silent machine costs one timeout, not one each."""
    if not addresses:
        return []
    with ThreadPoolExecutor(max_workers=len(addresses)) as pool:
        return list(pool.map(lambda a: read(a[0], a[1], timeout), addresses))


def rounds_seen(addresses, job: str) -> tuple[str | None, bool]:
    """Read from the machines at `addresses`: the first member of the newest round a machine of `job`
    trains in (under parameter_server, its coordinator), None while none trains; and whether a
    machine of it forms the next round."""
    states = [s for s in read_all(addresses) if s and s.get("job") == job]
    training = [s for s in states if s.get("phase") == TRAINING and s.get("members")]
    newest = max(training, key=lambda s: s.get("round", 0), default=None)
    forming = any(s.get("phase") in (FORMING, READY) for s in states)
    return (newest["members"][0] if newest else None), forming
