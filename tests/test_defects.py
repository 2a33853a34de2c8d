"""Defects a new user meets: shipped pipelines that must train, checkpoints that must survive,
exit codes that must say what happened, inputs and outputs that must be what they claim."""

import glob
import os

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PIPELINES = sorted(glob.glob(os.path.join(ROOT, "pipelines", "*.yaml")))


@pytest.fixture(scope="module")
def shapes_dir(tmp_path_factory):
    from od_dist.data import shapes

    out = str(tmp_path_factory.mktemp("shapes"))
    shapes.write_dataset(out, num_train=8, num_val=4, seed=1)
    return out


def small_override(data_dir: str) -> str:
    """What turns any shipped pipeline into a one-step CPU run on the shapes data: 128x128 (a
    multiple of 2^7, the largest max_level shipped), batch 2, no downloaded weights, float32."""
    return yaml.safe_dump(
        {
            "runtime": {"mixed_precision_dtype": "float32"},
            "task": {
                "init_checkpoint": None,
                "annotation_file": None,
                "model": {"input_size": [128, 128, 3]},
                "train_data": {
                    "input_path": f"{data_dir}/train.tfrecord",
                    "global_batch_size": 2,
                    "shuffle_buffer_size": 8,
                },
                "validation_data": {"input_path": f"{data_dir}/val.tfrecord", "global_batch_size": 2},
            },
            "trainer": {
                "train_steps": 1,
                "steps_per_loop": 1,
                "summary_interval": 1,
                "checkpoint_interval": 1,
                "validation_interval": 1,
            },
        },
        default_flow_style=True,
    )


# ----- 1: every shipped pipeline trains --------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("path", PIPELINES, ids=[os.path.basename(p) for p in PIPELINES])
def test_every_shipped_pipeline_trains_one_step(path, shapes_dir, tmp_path):
    tf = pytest.importorskip("tensorflow")
    from od_dist.job import trainer
    from od_dist.model.pipeline import load_pipeline

    params = load_pipeline(path, small_override(shapes_dir), strategy="mirrored")
    model_dir = str(tmp_path / "run")
    # Eagerly: the build, the input pipeline, loss, gradients and a checkpoint are all exercised,
    # in a third of the time tracing the step takes.
    tf.config.run_functions_eagerly(True)
    try:
        assert trainer.train(params, model_dir, tf.distribute.MirroredStrategy(["/cpu:0"])) == 1
    finally:
        tf.config.run_functions_eagerly(False)
    assert tf.train.latest_checkpoint(model_dir).endswith("ckpt-1")
