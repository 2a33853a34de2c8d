"""The scaling benchmark's machines are really constrained (benchmarks/scaling.py): a capped busy
loop gets about its cap's share of a CPU, and a shaped transfer between two simulated machines runs
near the link rate. Without these, the benchmark could silently measure unconstrained machines.
No TensorFlow; root only (skips naming why)."""

import subprocess
import sys

import capped
import pytest

pytestmark = pytest.mark.skipif(capped.unavailable() is not None, reason=str(capped.unavailable()))

# Spins for argv[1] seconds of wall time, then prints its CPU seconds / wall seconds (the
# kernel's per-process accounting, not the cgroup's).
BUSY = (
    "import sys, time\n"
    "t0, c0 = time.monotonic(), time.process_time()\n"
    "while time.monotonic() < t0 + float(sys.argv[1]): pass\n"
    "print((time.process_time() - c0) / (time.monotonic() - t0))\n"
)


def test_a_capped_busy_loop_gets_about_its_share(machines):
    net = machines(1)
    cap = capped.CpuCap("test-busy", cores=0.3)
    try:
        before = cap.throttled()
        proc = net[0].popen([sys.executable, "-c", BUSY, "3"], preexec_fn=cap.enter, stdout=subprocess.PIPE)
        share = float(proc.communicate(timeout=60)[0])
        # A loop alone on a core would get ~1.0; the cap allows 0.3 (less when the box is busy).
        assert share < 0.3 * 1.25, f"busy loop got {share:.2f} of a CPU under a 0.3 cap"
        assert share > 0.05, f"busy loop got only {share:.2f} of a CPU"
        assert cap.throttled() > before, "the cgroup never throttled the loop"
        assert cap.usage_s() > 0
    finally:
        cap.close()


RECEIVE = (
    "import socket, sys, time\n"
    "s = socket.socket(); s.bind(('0.0.0.0', 5555)); s.listen(); print('ready', flush=True)\n"
    "c, _ = s.accept(); n = 0; t0 = None\n"
    "while True:\n"
    "    b = c.recv(1 << 16)\n"
    "    if not b: break\n"
    "    t0 = t0 or time.monotonic(); n += len(b)\n"
    "print(n, time.monotonic() - t0, flush=True)\n"
)
SEND = (
    "import socket, sys\n"
    "s = socket.create_connection((sys.argv[1], 5555)); s.sendall(b'x' * int(sys.argv[2])); s.close()\n"
)


def transfer_bits_per_s(net, size: int) -> float:
    receiver = net[1].popen([sys.executable, "-c", RECEIVE], stdout=subprocess.PIPE, text=True)
    assert receiver.stdout.readline().strip() == "ready"
    net[0].run([sys.executable, "-c", SEND, net[1].ip, str(size)], timeout=60, check=True)
    received, seconds = receiver.stdout.readline().split()
    receiver.wait(timeout=30)
    assert int(received) == size
    return size * 8 / float(seconds)


def test_a_shaped_link_runs_near_its_rate(machines):
    net = machines(2)
    unshaped = transfer_bits_per_s(net, 4_000_000)
    for machine in net:
        capped.shape(machine, "20mbit")
        assert "tbf" in capped.qdisc(machine) and "20Mbit" in capped.qdisc(machine)
    sent = capped.tx_bytes(net[0])
    shaped = transfer_bits_per_s(net, 4_000_000)
    assert capped.tx_bytes(net[0]) - sent >= 4_000_000  # the counter the benchmark reads sees it
    assert 0.6 * 20e6 < shaped < 1.1 * 20e6, f"shaped transfer ran at {shaped / 1e6:.1f} Mbit/s"
    assert unshaped > 3 * shaped, f"unshaped {unshaped / 1e6:.0f} Mbit/s vs shaped {shaped / 1e6:.1f}"


def test_rates_in_tc_units():
    assert capped.rate_bits("100mbit") == 1e8 and capped.rate_bits("1gbit") == 1e9
    with pytest.raises(ValueError):
        capped.rate_bits("fast")
