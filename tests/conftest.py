"""Shared fixtures."""

import signal

import netns
import pytest


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
def _netns_available():
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    netns.remove_stale()
    # A SIGTERM (CI timeout, `kill`) would end the run without finalizers or atexit; as an
    # interruption it runs both, so the namespaces go too.
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupt)
    yield
    if previous == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@pytest.fixture
def machines(_netns_available):
    """`machines(n)` -> a tests/netns.Network of n simulated machines (root only; skips
    otherwise), removed with every process in it when the test ends, passed or failed."""
    made = []

    def make(n):
        network = netns.Network(n)
        made.append(network)
        return network

    yield make
    for network in made:
        network.close()
