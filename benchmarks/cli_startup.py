"""How fast the commands that train nothing answer (they must not import TensorFlow).

    python benchmarks/cli_startup.py [--runs 10]

Times, side by side in one run: a bare `python -c pass`, `od-dist validate` on
clusters/local.yaml, `od-dist tf-config`, `od-dist scripts` for a cluster of --workers workers
(default 3,000, on one machine per 10; every task's arguments are checked as the task will check
them, which must stay linear in the tasks), and, for scale, `python -c "import tensorflow"`.
Prints the median wall time of each and the ratio to the bare interpreter.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "od-dist validate": [sys.executable, "-m", "od_dist", "validate", "--cluster", "clusters/local.yaml"],
    "od-dist tf-config": [
        sys.executable,
        "-m",
        "od_dist",
        "tf-config",
        "--cluster",
        "clusters/local.yaml",
        "--role",
        "worker",
        "--index",
        "1",
    ],
    "import tensorflow": [sys.executable, "-c", "import tensorflow"],
}


def median_seconds(argv: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def scripts_case(folder: str, workers: int) -> list[str]:
    """`od-dist scripts` for a parameter_server cluster of `workers` workers, 10 to a machine."""
    cluster = os.path.join(folder, "large.yaml")
    with open(cluster, "w", encoding="utf-8") as f:
        f.write("strategy: parameter_server\nmaster: 10.255.0.1:2222\nps:\n  - 10.255.0.2:2222\nworker:\n")
        for i in range(workers):
            machine = i // 10
            f.write(f"  - 10.{machine // 250}.{machine % 250}.1:{2222 + i % 10}\n")
    return [
        sys.executable,
        "-m",
        "od_dist",
        "scripts",
        f"--cluster={cluster}",
        "--pipeline=pipelines/shapes_retinanet.yaml",
        "--model_dir=runs/large",
        f"--out={os.path.join(folder, 'scripts')}",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--workers", type=int, default=3000, help="workers of the `scripts` case")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        cases = dict(CASES)
        cases[f"od-dist scripts, {args.workers} workers"] = scripts_case(folder, args.workers)
        slow = ("import tensorflow", f"od-dist scripts, {args.workers} workers")
        results = {
            name: median_seconds(argv, args.runs if name not in slow else 3) for name, argv in cases.items()
        }
    base = results["python -c pass"]
    for name, seconds in results.items():
        print(f"{name:<32} {seconds * 1000:8.0f} ms   x{seconds / base:5.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
