"""On a phone: a trained model as a SavedModel and as float32, fp16 and int8 .tflite, side by side.

    python benchmarks/tflite_formats.py --pipeline pipelines/shapes_retinanet.yaml --model_dir runs/demo \\
        --out runs/demo_tflite [--params_override ...] [--runs 50] [--calibration_images 100] [--class_agnostic_nms]

Run from the repo root on a trained model_dir. It exports the latest checkpoint with `od-dist
export` (the SavedModel) and `od-dist export --format tflite` (the three .tflite: one SavedModel of
input type tflite converted three times, as the command does for each), evaluates each with `od-dist
eval` on the pipeline's validation records (the SavedModel's row: `od-dist eval --model_dir`, the
checkpoint it serves; each .tflite's: `od-dist eval --model`, through LiteRT's interpreter), and
times one image through each in a fresh process: the median of --runs calls after 5 warm-up calls,
with one thread and with every core (TensorFlow's intra- and inter-op threads for the SavedModel,
LiteRT's num_threads for a .tflite). The image is the first validation image: the SavedModel is
given it as uint8 and preprocesses it inside (as served); a .tflite is given it preprocessed (as
on a phone, where the camera's frame is resized and normalized before the interpreter).

Prints a Markdown table: file size, COCO AP and AP50, and milliseconds per image.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)
sys.path.insert(0, os.path.join(_REPO, "tests"))

WARM_UP = 5
ROWS = (("SavedModel", None), ("float32", "none"), ("fp16", "fp16"), ("int8", "int8"))


def _od_dist(*args: str) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "od_dist", *args], capture_output=True, text=True, cwd=os.getcwd()
    )
    if r.returncode:
        sys.exit(f"od-dist {' '.join(args)}: exit {r.returncode}\n{r.stderr[-3000:]}")
    return r.stdout


def _coco(*args: str) -> dict:
    from loopback import COCO_LINE

    found = COCO_LINE.search(_od_dist("eval", *args))
    if not found:
        sys.exit(f"od-dist eval {' '.join(args)}: no COCO line")
    return {k: float(v) for k, v in found.groupdict().items() if v is not None}


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    # The SavedModel's own files: its graph and variables (not the label map or params.yaml).
    files = [os.path.join(path, "saved_model.pb")]
    for root, _, names in os.walk(os.path.join(path, "variables")):
        files += [os.path.join(root, n) for n in names]
    return sum(os.path.getsize(f) for f in files)


def _inputs(params, out: str, keep_aspect_ratio: bool) -> tuple[str, str]:
    """The first validation image, as uint8 (the SavedModel's input) and preprocessed (a .tflite's)."""
    import numpy as np
    import tensorflow as tf

    from od_dist.data import records
    from od_dist.model import tflite

    path = records.match_files(params.task.validation_data.input_path)[0]
    example = next(iter(tf.data.TFRecordDataset(path)))
    encoded = tf.io.parse_single_example(example, {"image/encoded": tf.io.FixedLenFeature([], tf.string)})
    image = tf.io.decode_image(encoded["image/encoded"], channels=3).numpy()
    pre, _ = tflite.preprocess(image, list(params.task.model.input_size[:2]), keep_aspect_ratio)
    paths = os.path.join(out, "image_uint8.npy"), os.path.join(out, "image_input.npy")
    np.save(paths[0], image)
    np.save(paths[1], pre)
    return paths


def latency(model: str, image: str, threads: int, runs: int) -> float:
    """Milliseconds per image: the median of `runs` calls after the warm-up (this process only)."""
    import numpy as np

    data = np.load(image)
    if model.endswith(".tflite"):
        from ai_edge_litert.interpreter import Interpreter

        run = Interpreter(model_path=model, num_threads=threads).get_signature_runner("serving_default")

        def call():
            run(inputs=data)
    else:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
        serve = tf.saved_model.load(model).signatures["serving_default"]
        tensor = tf.constant(data[None])

        def call():
            serve(tensor)["num_detections"].numpy()

    for _ in range(WARM_UP):
        call()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def _latency_child(model: str, image: str, threads: int, runs: int) -> float:
    r = subprocess.run(
        [
            sys.executable,
            __file__,
            "--latency",
            model,
            "--image",
            image,
            f"--threads={threads}",
            f"--runs={runs}",
        ],
        capture_output=True,
        text=True,
    )
    if r.returncode:
        sys.exit(f"latency of {model}: exit {r.returncode}\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])["ms"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pipeline")
    parser.add_argument("--model_dir")
    parser.add_argument("--out", help="folder for the exports")
    parser.add_argument("--params_override", default="")
    parser.add_argument("--runs", type=int, default=50, help="timed calls per model and thread count")
    parser.add_argument("--calibration_images", type=int, default=100)
    parser.add_argument("--class_agnostic_nms", action="store_true", help="as the export flag")
    parser.add_argument("--latency", help=argparse.SUPPRESS)  # a child: time this model
    parser.add_argument("--image", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.latency:
        print(json.dumps({"ms": latency(args.latency, args.image, args.threads, args.runs)}))
        return 0
    if not (args.pipeline and args.model_dir and args.out):
        parser.error("--pipeline, --model_dir and --out are required")

    from od_dist.model import tflite
    from od_dist.model.pipeline import load_pipeline

    override = [f"--params_override={args.params_override}"] if args.params_override else []
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=_REPO
    ).stdout.strip()
    load = os.getloadavg()[0]
    os.makedirs(args.out, exist_ok=True)
    saved = os.path.join(args.out, "saved_model")
    started = time.monotonic()
    _od_dist(
        "export", f"--pipeline={args.pipeline}", f"--model_dir={args.model_dir}", f"--out={saved}", *override
    )
    paths = {q: os.path.join(args.out, f"model_{q}.tflite") for _, q in ROWS if q}
    tflite.export_tflite(
        load_pipeline(args.pipeline, args.params_override or None),
        args.model_dir,
        paths,
        calibration_images=args.calibration_images,
        pipeline_path=args.pipeline,
        class_agnostic_nms=args.class_agnostic_nms,
    )
    exported = time.monotonic() - started
    info = tflite.read_info(paths["none"])
    image_uint8, image_input = _inputs(
        load_pipeline(args.pipeline, args.params_override or None), args.out, info["keep_aspect_ratio"]
    )
    cores = os.cpu_count() or 1
    rows = []
    for name, q in ROWS:
        model = paths[q] if q else saved
        if q:
            coco = _coco(f"--pipeline={args.pipeline}", f"--model={model}", *override)
        else:
            coco = _coco(f"--pipeline={args.pipeline}", f"--model_dir={args.model_dir}", *override)
        image = image_input if q else image_uint8
        one = _latency_child(model, image, 1, args.runs)
        every = _latency_child(model, image, cores, args.runs)
        rows.append((name, _size(model), coco, one, every))
        print(f"{name}: done", file=sys.stderr, flush=True)

    base = rows[0][1]
    print(
        f"{args.pipeline}, step {info['step']}, input {info['input_size'][0]}x{info['input_size'][1]}, "
        f"NMS {'over every class' if args.class_agnostic_nms else 'per class'}; "
        f"commit {commit}; {cores} cores, load average {load:.1f} at the start; exports took "
        f"{exported:.0f} s; latency: median of {args.runs} calls"
    )
    print()
    print(
        f"| model | size | size / SavedModel's | AP | AP50 | ms/image, 1 thread | ms/image, {cores} threads |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, size, coco, one, every in rows:
        print(
            f"| {name} | {size / 1e6:.2f} MB | {size / base:.2f} | {coco['AP']:.3f} | {coco['AP50']:.3f} | "
            f"{one:.1f} | {every:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
