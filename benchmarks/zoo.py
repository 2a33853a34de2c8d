"""The TF2 Detection Zoo's families, imported and trained a step on the shapes data: on one machine,
and under `od-dist launch` with multi_worker_mirrored (a master and a worker on loopback).

    .venv/bin/python benchmarks/zoo.py [--families ssd_mobilenet,efficientdet,...] [--keep DIR]
    .venv/bin/python benchmarks/zoo.py --imports DIR    # `pipeline import` of every *.config in DIR

Per family, one config as published (tests/odapi_configs/ and test_odapi's), made small the same
way for each: 3 classes, 128x128 inputs, a batch of 2 (one image per trainer), one step, no warmup.
Then the commands a user runs: `pipeline import`, `train` and `eval` on one machine, `launch` of a
two-trainer multi_worker_mirrored cluster and `eval` of its checkpoint. Prints one Markdown row per
family: each command's exit status and wall time, and the COCO line's step and AP50 (after one step
AP50 is near 0: the row proves the family runs end to end, not that it learns).

With --imports: one row per config, its exit status, and the import's last line (what it refused,
or the pipeline it wrote); a traceback anywhere is flagged.
"""

from __future__ import annotations

import argparse
import glob
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
import test_odapi as configs  # noqa: E402 (the Zoo's configs the tests keep)
from loopback import COCO_LINE, write_cluster  # noqa: E402

FAMILIES = {  # name -> the config's Zoo name, and its text as published
    "ssd_mobilenet": (
        "ssd_mobilenet_v2_fpnlite_320x320_coco17_tpu-8",
        lambda: configs.SSD_MOBILENET_V2_FPNLITE_320,
    ),
    "ssd_resnet_fpn": ("ssd_resnet50_v1_fpn_640x640_coco17_tpu-8", lambda: configs.SSD_RESNET50_V1_FPN_640),
    "faster_rcnn": (
        "faster_rcnn_resnet50_v1_640x640_coco17_tpu-8",
        lambda: configs.FASTER_RCNN_RESNET50_V1_640,
    ),
    "efficientdet": (configs.EFFICIENTDET_D0, lambda: configs.zoo(configs.EFFICIENTDET_D0)),
    "centernet_hourglass": (configs.CENTERNET_HG104, lambda: configs.zoo(configs.CENTERNET_HG104)),
    "centernet_resnet": (configs.CENTERNET_RESNET50_V2, lambda: configs.zoo(configs.CENTERNET_RESNET50_V2)),
}
SMALL = [  # the same edits for every family (each pattern a whole field)
    (r"\bnum_classes: \d+", "num_classes: 3"),
    (r"\b(height|width|min_dimension|max_dimension): \d+", r"\1: 128"),
    (r"\bbatch_size: \d+", "batch_size: 2"),
    (r"\b(num_steps|total_steps): \d+", r"\1: 1"),
    (r"\bwarmup_steps: \d+", "warmup_steps: 0"),
]


def small(text: str) -> str:
    for pattern, repl in SMALL:
        text = re.sub(pattern, repl, text)
    return text


def od_dist(args: list[str], cwd: str, timeout: float = 3600) -> tuple[int, float, str]:
    """Runs `od-dist ARGS` in cwd: exit status, wall seconds, its output (stdout and stderr)."""
    start = time.monotonic()
    try:
        r = subprocess.run(
            [sys.executable, "-m", "od_dist", *args],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        code, out = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        code, out = -1, f"timed out after {timeout:.0f} s: {e.stdout or ''}{e.stderr or ''}"
    return code, time.monotonic() - start, out


def cell(code: int, seconds: float, out: str, evaluated: bool = False) -> str:
    if code:
        last = [ln for ln in out.splitlines() if ln.strip()][-1:] or ["(no output)"]
        return f"**exit {code}**, {seconds:.0f} s: {last[0][:160].replace('|', '/')}"
    if evaluated:
        m = COCO_LINE.search(out)
        return f"step {m['step']}, AP50 {m['AP50']}, {seconds:.0f} s" if m else "no COCO line"
    return f"exit 0, {seconds:.0f} s"


def families(work: str, names: list[str]) -> int:
    data = os.path.join(work, "data")
    code, _, out = od_dist(
        ["data", "shapes", f"--out={data}", "--num_train=32", "--num_val=8", "--image_size=128"], work
    )
    if code:
        print(out)
        return 1
    inputs = (
        f"--params_override=task.train_data.input_path={data}/train.tfrecord,"
        f"task.validation_data.input_path={data}/val.tfrecord"
    )
    cluster = write_cluster(pathlib.Path(work), ps=0, workers=1, strategy="multi_worker_mirrored")
    print(
        "| family | config | import | one machine: train | eval | launch, multi_worker_mirrored x2: train | eval |\n"
        "|---|---|---|---|---|---|---|",
        flush=True,
    )
    failed = 0
    for name in names:
        config, text = FAMILIES[name]
        with open(os.path.join(work, f"{name}.config"), "w", encoding="utf-8") as f:
            f.write(small(text()))
        row = [name, config]
        steps = [
            (["pipeline", "import", f"--config={name}.config", f"--out={name}.yaml"], False),
            (["train", f"--pipeline={name}.yaml", f"--model_dir=one/{name}", inputs], False),
            (["eval", f"--pipeline={name}.yaml", f"--model_dir=one/{name}", inputs], True),
            (
                [
                    "launch",
                    f"--cluster={cluster}",
                    f"--pipeline={name}.yaml",
                    f"--model_dir=mwm/{name}",
                    inputs,
                ],
                False,
            ),
            (["eval", f"--pipeline={name}.yaml", f"--model_dir=mwm/{name}", inputs], True),
        ]
        for args, evaluated in steps:
            code, seconds, out = od_dist(args, work)
            with open(os.path.join(work, f"{name}.log"), "a", encoding="utf-8") as log:
                log.write(f"$ od-dist {' '.join(args)}\n{out}\nexit {code}, {seconds:.1f} s\n\n")
            row.append(cell(code, seconds, out, evaluated))
            failed += bool(code) or (evaluated and not COCO_LINE.search(out))
        print("| " + " | ".join(row) + " |", flush=True)
    print(f"\nlogs in {work}")
    return 1 if failed else 0


def imports(work: str, folder: str) -> int:
    paths = sorted(glob.glob(os.path.join(folder, "*.config")))
    print("| config | exit | last line |\n|---|---|---|")
    counts = {"imported": 0, "refused": 0, "traceback": 0}
    for path in paths:
        name = os.path.basename(path)[: -len(".config")]
        code, _, out = od_dist(["pipeline", "import", f"--config={path}", f"--out={name}.yaml"], work, 600)
        kind = "traceback" if "Traceback" in out else "imported" if code == 0 else "refused"
        counts[kind] += 1
        last = [ln for ln in out.splitlines() if ln.strip()][-1:] or [""]
        print(
            f"| {name} | {code}{' (traceback)' if kind == 'traceback' else ''} | {last[0][:200]} |",
            flush=True,
        )
    print(
        f"\n{counts['imported']} of {len(paths)} import, {counts['refused']} refused in one line, "
        f"{counts['traceback']} end in a traceback"
    )
    return 1 if counts["traceback"] else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--families", default=",".join(FAMILIES), help="comma-separated, of " + ", ".join(FAMILIES)
    )
    parser.add_argument("--imports", metavar="DIR", help="import every *.config in DIR instead")
    parser.add_argument("--keep", help="work in this directory (kept)")
    args = parser.parse_args(argv)
    work = args.keep or tempfile.mkdtemp(prefix="od-dist-zoo-")
    os.makedirs(work, exist_ok=True)
    if args.imports:
        return imports(work, os.path.abspath(args.imports))
    names = args.families.split(",")
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        parser.error(f"--families: unknown {', '.join(unknown)}; known: {', '.join(FAMILIES)}")
    return families(work, names)


if __name__ == "__main__":
    sys.exit(main())
