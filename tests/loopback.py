"""Loopback clusters for the tests that start real TensorFlow servers (and for the benchmark)."""

import socket


def free_ports(n):
    """n ports free on 127.0.0.1 now: all bound at once, so they differ, then released for the
    servers (a test retries if another program takes one in between)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def write_cluster(tmp_path, ps=1, workers=2, strategy=None, evaluator=False):
    """<tmp_path>/cluster.yaml: the master, `workers` workers and `ps` ps on free loopback ports."""
    ports = iter(free_ports(1 + workers + ps))
    lines = [f"strategy: {strategy}"] if strategy else []
    if evaluator:
        lines.append("evaluator: 127.0.0.1")
    lines.append(f"master: 127.0.0.1:{next(ports)}")
    lines.append("worker: [" + ", ".join(f"127.0.0.1:{next(ports)}" for _ in range(workers)) + "]")
    if ps:
        lines.append("ps: [" + ", ".join(f"127.0.0.1:{next(ports)}" for _ in range(ps)) + "]")
    path = tmp_path / "cluster.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)
