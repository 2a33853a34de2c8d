"""How fast the commands that train nothing answer (they must not import TensorFlow).

    python benchmarks/cli_startup.py [--runs 10]

Times, side by side in one run: a bare `python -c pass`, `od-dist validate` on
clusters/local.yaml, `od-dist tf-config`, and, for scale, `python -c "import tensorflow"`.
Prints the median wall time of each and the ratio to the bare interpreter.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    results = {
        name: median_seconds(argv, args.runs if name != "import tensorflow" else 3)
        for name, argv in CASES.items()
    }
    base = results["python -c pass"]
    for name, seconds in results.items():
        print(f"{name:<20} {seconds * 1000:8.0f} ms   x{seconds / base:5.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
