"""Conversion of a large labelImg folder: time and peak memory of `od-dist data voc`.

    python benchmarks/convert_large.py [--counts 1000,10000] [--image_size 256] [--work /tmp/od-dist-large]

For each count, makes that many shapes images (JPEG; --unique distinct ones, the rest copies under
new names) with labelImg-style XML, then runs
`od-dist data voc` on them as a user would (a subprocess) and prints wall time, images/s and the
converter's peak resident memory. Memory that stays flat from 1,000 to 10,000 images shows the
conversion streams. The work folder is removed at the end unless --keep.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)
sys.path.insert(0, os.path.join(_REPO, "tests"))


# `python -m od_dist ARGS` that reports its own peak resident memory when it ends.
_MEASURED = (
    "import resource, runpy, sys\n"
    'sys.argv = ["od-dist"] + sys.argv[1:]\n'
    "try:\n"
    '    runpy.run_module("od_dist", run_name="__main__")\n'
    "finally:\n"
    '    print("PEAK_KIB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n'
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--counts", default="1000,10000")
    parser.add_argument("--image_size", type=int, default=256)
    parser.add_argument("--work", default="/tmp/od-dist-large")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument(
        "--unique",
        type=int,
        default=500,
        help="distinct images drawn; the rest are "
        "copies under new names (conversion reads every file either way)",
    )
    args = parser.parse_args(argv)
    import labelimg  # the tests' labelImg-style folders

    try:
        for count in (int(c) for c in args.counts.split(",")):
            src = os.path.join(args.work, f"src-{count}")
            out = os.path.join(args.work, f"out-{count}")
            shutil.rmtree(src, ignore_errors=True)
            shutil.rmtree(out, ignore_errors=True)
            t0 = time.time()
            unique = min(count, args.unique)
            images, anns = labelimg.write_shapes_folder(
                src, unique, seed=count, image_size=args.image_size, difficult_every=20
            )
            for i in range(unique, count):  # copies under new names: drawing 10,000 takes long
                j = i % unique
                shutil.copyfile(
                    os.path.join(images, f"img_{j:05d}.jpg"), os.path.join(images, f"img_{i:05d}.jpg")
                )
                with open(os.path.join(anns, f"img_{j:05d}.xml"), encoding="utf-8") as f:
                    text = f.read().replace(f"img_{j:05d}.jpg", f"img_{i:05d}.jpg")
                with open(os.path.join(anns, f"img_{i:05d}.xml"), "w", encoding="utf-8") as f:
                    f.write(text)
            made = time.time() - t0
            t0 = time.time()
            r = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    _MEASURED,
                    "data",
                    "voc",
                    "--images",
                    images,
                    "--annotations",
                    anns,
                    "--out",
                    out,
                ],
                capture_output=True,
                text=True,
                cwd=_REPO,
            )
            wall = time.time() - t0
            peak = int(r.stderr.rsplit("PEAK_KIB ", 1)[-1].split()[0])
            if r.returncode:
                print(r.stdout + r.stderr)
                return 1
            progress = [ln for ln in r.stderr.splitlines() if ln.startswith("od-dist data voc: writing |")]
            size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
            print(
                f"{count} images of {args.image_size}x{args.image_size}: drawn in {made:.0f} s; "
                f"`od-dist data voc` {wall:.1f} s in all ({count / wall:.0f} images/s, TensorFlow import "
                f"included), peak RSS {peak / 1024:.0f} MiB, {size / 2**20:.0f} MiB of records; "
                f"last progress line: {progress[-1]}",
                flush=True,
            )
    finally:
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
