"""Demo accuracy benchmark: generate shapes, train the demo pipeline on one machine, evaluate.

    python benchmarks/demo_accuracy.py [--model_dir runs/demo_accuracy] [--steps N]

Run from the repo root (the pipeline reads data/shapes/ relative to the working
directory). Prints data generation time, training wall time, steps/s (overall and
steady-state, the median of Model Garden's per-loop summaries, which leaves out the
first loop's graph tracing), and COCO AP/AP50 on the held-out validation split.
Exit status 1 when AP50 is below --min_ap50 (default 0.9).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pipeline", default=os.path.join(_REPO, "pipelines", "shapes_retinanet.yaml"))
    parser.add_argument("--data_dir", default=os.path.join("data", "shapes"))
    parser.add_argument("--model_dir", default=os.path.join("runs", "demo_accuracy"))
    parser.add_argument("--num_train", type=int, default=2000)
    parser.add_argument("--num_val", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--steps", type=int, default=None, help="trainer.train_steps (default: the pipeline's)"
    )
    parser.add_argument("--min_ap50", type=float, default=0.9)
    parser.add_argument(
        "--keep", action="store_true", help="resume from an existing model_dir instead of starting afresh"
    )
    args = parser.parse_args(argv)

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

    overrides = [
        f"task.train_data.input_path={os.path.join(args.data_dir, shapes.TRAIN_FILE)}",
        f"task.validation_data.input_path={os.path.join(args.data_dir, shapes.VAL_FILE)}",
    ]
    if args.steps:
        overrides.append(f"trainer.train_steps={args.steps}")
    params = load_pipeline(args.pipeline, ",".join(overrides), "mirrored")
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


if __name__ == "__main__":
    sys.exit(main())
