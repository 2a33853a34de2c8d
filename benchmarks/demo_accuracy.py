"""Demo accuracy benchmark: generate shapes, train the demo pipeline, evaluate.

    python benchmarks/demo_accuracy.py [--model_dir runs/demo_accuracy] [--steps N]
    python benchmarks/demo_accuracy.py --cluster clusters/local.yaml --runs 3 [--params_override ...]

Run from the repo root (the pipeline reads data/shapes/ relative to the working
directory). On one machine (the default) it prints data generation time, training wall time,
steps/s (overall and steady-state, the median of Model Garden's per-loop summaries, which
leaves out the first loop's graph tracing), and COCO AP/AP50 on the held-out validation split.

With --cluster it runs what the README's demo runs, --runs times, each from an empty model
folder: `od-dist launch` on that cluster file, then `od-dist eval`. Asynchronous training is
not repeatable run to run, so one run says little: it prints each run's AP50 and wall clock,
then the lowest, the median and how many runs reached --min_ap50.

Exit status 1 when AP50 (with --runs, any run's) is below --min_ap50 (default 0.9).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)


def _summary_values(logdir: str, tag: str) -> list[float]:
    import tensorflow as tf

    values = []
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for v in event.summary.value:
                if v.tag == tag:
                    values.append(
                        float(tf.make_ndarray(v.tensor)) if v.HasField("tensor") else v.simple_value
                    )
    return values


def _override(args) -> str:
    """The --params_override of every mode: this run's data, --steps and the user's own."""
    from od_dist.data import shapes

    parts = [
        f"task.train_data.input_path={os.path.join(args.data_dir, shapes.TRAIN_FILE)}",
        f"task.validation_data.input_path={os.path.join(args.data_dir, shapes.VAL_FILE)}",
    ]
    if args.steps:
        parts.append(f"trainer.train_steps={args.steps}")
        parts.append(f"trainer.optimizer_config.learning_rate.cosine.decay_steps={args.steps}")
    return ",".join(parts + ([args.params_override] if args.params_override else []))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pipeline", default=os.path.join(_REPO, "pipelines", "shapes_retinanet.yaml"))
    parser.add_argument("--data_dir", default=os.path.join("data", "shapes"))
    parser.add_argument("--model_dir", default=os.path.join("runs", "demo_accuracy"))
    parser.add_argument("--num_train", type=int, default=2000)
    parser.add_argument("--num_val", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="trainer.train_steps and the cosine's decay_steps (default: the pipeline's)",
    )
    parser.add_argument("--min_ap50", type=float, default=0.9)
    parser.add_argument(
        "--keep", action="store_true", help="resume from an existing model_dir instead of starting afresh"
    )
    parser.add_argument("--cluster", help="train with `od-dist launch` on this cluster file")
    parser.add_argument("--runs", type=int, default=1, help="with --cluster: how many runs")
    parser.add_argument("--params_override", default="", help="passed to train (and eval)")
    args = parser.parse_args(argv)
    if args.cluster:
        return _cluster_runs(args)

    t_start = time.time()
    from od_dist.data import shapes

    summary = shapes.write_dataset(
        args.data_dir, num_train=args.num_train, num_val=args.num_val, seed=args.seed
    )
    print(
        f"data: {summary['num_train']} train / {summary['num_val']} val images in "
        f"{summary['seconds']:.1f} s -> {args.data_dir}",
        flush=True,
    )

    import tensorflow as tf

    from od_dist.model.pipeline import load_pipeline
    from od_dist.task import trainer

    params = load_pipeline(args.pipeline, _override(args), "mirrored")
    steps = params.trainer.train_steps
    if os.path.isdir(args.model_dir) and not args.keep:
        shutil.rmtree(args.model_dir)

    strategy = tf.distribute.MirroredStrategy()
    t0 = time.time()
    trainer.train(params, args.model_dir, strategy)
    train_wall = time.time() - t0
    t1 = time.time()
    metrics = trainer.evaluate_latest(params, args.model_dir)
    eval_wall = time.time() - t1

    rates = _summary_values(os.path.join(args.model_dir, "train"), "steps_per_second")
    steady = statistics.median(rates[1:]) if len(rates) > 1 else float("nan")
    batch = params.task.train_data.global_batch_size
    result = {
        "steps": steps,
        "batch": batch,
        "train_wall_s": round(train_wall, 1),
        "steps_per_s_overall": round(steps / train_wall, 2),
        "steps_per_s_steady": round(steady, 2),
        "examples_per_s_steady": round(steady * batch, 1),
        "eval_wall_s": round(eval_wall, 1),
        "total_wall_s": round(time.time() - t_start, 1),
        "AP": round(metrics["AP"], 4),
        "AP50": round(metrics["AP50"], 4),
        "AP75": round(metrics["AP75"], 4),
    }
    print("demo_accuracy " + json.dumps(result), flush=True)
    ok = metrics["AP50"] >= args.min_ap50
    print(
        f"AP50 {metrics['AP50']:.3f} {'>=' if ok else '<'} {args.min_ap50} after "
        f"{steps} steps, {train_wall:.0f} s of training",
        flush=True,
    )
    return 0 if ok else 1


def _cluster_runs(args) -> int:
    sys.path.insert(0, os.path.join(_REPO, "tests"))
    from loopback import COCO_LINE

    od_dist = [sys.executable, "-m", "od_dist"]
    data = ["--num_train", str(args.num_train), "--num_val", str(args.num_val), "--seed", str(args.seed)]
    subprocess.run(od_dist + ["data", "shapes", "--out", args.data_dir] + data, check=True)
    common = ["--pipeline", args.pipeline, "--params_override", _override(args)]
    results = []
    for run in range(1, args.runs + 1):
        model_dir = os.path.join(args.model_dir, f"run{run}")
        shutil.rmtree(model_dir, ignore_errors=True)
        t0 = time.time()
        launch = subprocess.run(
            od_dist + ["launch", "--cluster", args.cluster, "--model_dir", model_dir] + common,
            capture_output=True,
            text=True,
        )
        launch_s = time.time() - t0
        with open(os.path.join(args.model_dir, f"run{run}.log"), "w") as log:
            log.write(launch.stdout + launch.stderr)
        if launch.returncode != 0:
            print(f"run {run}: launch exit {launch.returncode}; see {log.name}", flush=True)
            return 1
        ev = subprocess.run(
            od_dist + ["eval", "--model_dir", model_dir] + common, capture_output=True, text=True
        )
        m = COCO_LINE.search(ev.stdout + ev.stderr)
        if not m:
            print(
                f"run {run}: no COCO line from eval (exit {ev.returncode})\n{ev.stderr[-2000:]}", flush=True
            )
            return 1
        results.append(float(m["AP50"]))
        print(f"run {run}: launch {launch_s:.0f} s, {m.group(0)}", flush=True)
    reached = sum(ap50 >= args.min_ap50 for ap50 in results)
    print(
        f"demo_accuracy {args.cluster}, {f'{args.steps} steps' if args.steps else 'the pipeline as written'}"
        f"{', ' + args.params_override if args.params_override else ''}: AP50 "
        f"{' '.join(f'{a:.3f}' for a in results)}; lowest {min(results):.3f}, median "
        f"{statistics.median(results):.3f}; {reached} of {len(results)} runs >= {args.min_ap50}",
        flush=True,
    )
    return 0 if reached == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
