"""What a parameter_server step costs per variable: a real ps and a real worker server on loopback,
this process their coordinator, and a step that reads every variable on the ps, computes its
gradient on the worker and applies it on the ps (as a parameter_server worker's training step
does: one transfer of each variable to the worker, one of each gradient back).

    .venv/bin/python benchmarks/ps_transfers.py [--cases 40x12000,400x1200,800x600,400x2400]
        [--steps 200] [--steps_per_closure 10]

A case NxS: N float32 variables of S values each; NxSp: the same, each step's gradients sent to the
ps as one tensor and cut back there (what --ps_pack_gradients does). The cases keep the bytes a step moves alike
(40x12000, 400x1200 and 800x600: 1.9 MB each way, the demo's RetinaNet model's size) while the
number of variables changes, and one doubles the bytes: whichever of the two the CPU follows is
what a parameter_server step pays for. Per case: the wall time of a step, and the CPU the ps and
the worker processes spent per step (psutil, over the timed closures), and per transfer
(CPU / 2N). The demo's model has 379 variables (235 trainable, 144 batch-norm statistics).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import traceback

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
from loopback import free_ports  # noqa: E402 (the tests' free ports)

# A server of the cluster, in a process of its own, one thread a pool as od-dist gives a small
# machine's server (task/devices.py applies the same two settings).
SERVER = """
import sys, tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)
cluster = tf.train.ClusterSpec({"chief": [sys.argv[3]], "ps": [sys.argv[4]], "worker": [sys.argv[5]]})
tf.distribute.Server(cluster, job_name=sys.argv[1], task_index=int(sys.argv[2]), protocol="grpc").join()
"""


def run_case(strategy, coordinator, case: str, steps: int, per_closure: int, procs) -> dict:
    import tensorflow as tf

    packed = case.endswith("p")
    n, size = (int(x) for x in case.rstrip("p").split("x"))
    with strategy.scope():
        variables = [tf.Variable(tf.fill([size], 0.5), name=f"v{i}") for i in range(n)]

    @tf.function
    def closure(k):
        for _ in tf.range(k):
            with tf.GradientTape() as tape:
                loss = tf.add_n([tf.reduce_sum(v * v) for v in variables])
            grads = tape.gradient(loss, variables)
            if packed:  # one transfer of every gradient, cut back into each on the ps
                flat = tf.concat([tf.reshape(g, [-1]) for g in grads], 0)
                with tf.device(variables[0].device):
                    grads = tf.split(tf.identity(flat), [size] * n)
            for v, g in zip(variables, grads):
                with tf.device(v.device):  # the update on the variable's ps, as an optimizer's is
                    v.assign_sub(1e-9 * g)
        return loss

    k = tf.constant(per_closure)
    coordinator.schedule(closure, args=(k,))  # traced and run once, left out
    coordinator.join()
    before = {name: p.cpu_times() for name, p in procs.items()}
    start = time.monotonic()
    for _ in range(steps // per_closure):
        coordinator.schedule(closure, args=(k,))
    coordinator.join()
    wall = time.monotonic() - start
    done = (steps // per_closure) * per_closure
    out = {"case": case, "MB": 4 * n * size / 1e6, "step_ms": 1000 * wall / done}
    for name, p in procs.items():
        after = p.cpu_times()
        cpu = (after.user + after.system) - (before[name].user + before[name].system)
        out[f"{name}_ms"] = 1000 * cpu / done
        out[f"{name}_us_per_transfer"] = 1e6 * cpu / done / (n + (1 if packed else n))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", default="40x12000,400x1200,800x600,400x2400")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--steps_per_closure", type=int, default=10)
    args = parser.parse_args()

    chief, ps, worker = (f"127.0.0.1:{p}" for p in free_ports(3))
    servers = {
        job: subprocess.Popen(
            [sys.executable, "-c", SERVER, job, "0", chief, ps, worker],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for job in ("ps", "worker")
    }
    done = False
    try:
        import tensorflow as tf

        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec({"chief": [chief], "ps": [ps], "worker": [worker]}),
            task_type="chief",
            task_id=0,
            rpc_layer="grpc",
        )
        strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
        coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
        procs = {job: psutil.Process(p.pid) for job, p in servers.items()}
        rows = [
            run_case(strategy, coordinator, c, args.steps, args.steps_per_closure, procs)
            for c in args.cases.split(",")
        ]
        report(rows)
        done = True
    except Exception:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for p in servers.values():
            p.kill()
        # Without TensorFlow's teardown, whose remote calls to the servers just stopped fail loudly.
        os._exit(0 if done else 1)


def report(rows) -> None:
    print()
    print(
        "| variables x values | MB each way | step ms | ps CPU ms a step | worker CPU ms a step | ps / worker CPU us a transfer |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['case']} | {r['MB']:.1f} | {r['step_ms']:.1f} | {r['ps_ms']:.1f} | {r['worker_ms']:.1f} | "
            f"{r['ps_us_per_transfer']:.0f} / {r['worker_us_per_transfer']:.0f} |"
        )
    print(f"\nmachine: {os.cpu_count()} cores; load average after: {os.getloadavg()}")
    print("command: python benchmarks/ps_transfers.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
