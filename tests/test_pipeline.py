"""Pipeline files: base experiment + strict overrides, strategy from the cluster, clear errors."""

import os

import pytest

from od_dist.model.pipeline import PipelineError, known_experiments, load_pipeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "pipelines", "shapes_retinanet.yaml")
ALL = ["shapes_retinanet", "retinanet_resnetfpn_coco", "retinanet_mobile_coco"]


def write(tmp_path, text, name="p.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def error(*args, **kwargs):
    with pytest.raises(PipelineError) as e:
        load_pipeline(*args, **kwargs)
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("strategy", [None, "mirrored", "parameter_server", "multi_worker_mirrored"])
def test_shipped_pipelines_load(name, strategy):
    params = load_pipeline(os.path.join(ROOT, "pipelines", name + ".yaml"), strategy=strategy)
    assert params.runtime.distribution_strategy == (strategy or "mirrored")
    assert params.trainer.eval_tf_while_loop is (strategy == "parameter_server")
    assert params.task.train_data.input_path and params.task.validation_data.input_path


# Settings that do nothing under od-dist: the trainers run Model Garden's mode `train`, which never
# evaluates (evaluation is the evaluator's or `od-dist eval`'s, docs/pipelines.md).
IDLE_TRAINER_KEYS = {"validation_interval"}


def test_shipped_pipelines_set_nothing_that_does_nothing():
    import glob

    import yaml

    paths = glob.glob(os.path.join(ROOT, "pipelines", "*.yaml"))
    assert len(paths) >= len(ALL)
    for path in paths:
        with open(path) as f:
            trainer = yaml.safe_load(f).get("trainer") or {}
        assert not IDLE_TRAINER_KEYS & set(trainer), path


def test_demo_values():
    p = load_pipeline(DEMO)
    m = p.task.model
    assert m.backbone.type == "mobilenet"
    assert m.backbone.mobilenet.model_id == "MobileNetV2"
    assert m.backbone.mobilenet.filter_size_scale == 0.35
    assert m.input_size == [128, 128, 3] and m.num_classes == 4
    assert p.task.train_data.global_batch_size == 8
    assert p.task.train_data.input_path == "data/shapes/train.tfrecord"
    assert p.task.init_checkpoint is None and p.task.annotation_file is None
    assert p.trainer.steps_per_loop == 100
    assert p.task.losses.l2_weight_decay == pytest.approx(3e-5)


def test_coco_pipelines_point_at_documented_paths():
    p = load_pipeline(os.path.join(ROOT, "pipelines", "retinanet_resnetfpn_coco.yaml"))
    assert p.task.train_data.input_path == "/data/coco/train-*"
    assert p.task.annotation_file == "/data/coco/instances_val2017.json"
    assert p.task.model.backbone.type == "resnet"
    p = load_pipeline(os.path.join(ROOT, "pipelines", "retinanet_mobile_coco.yaml"))
    assert p.task.model.backbone.type == "spinenet_mobile"


def test_override_after_file_csv_and_yaml():
    p = load_pipeline(DEMO, "trainer.train_steps=37,task.train_data.global_batch_size=4")
    assert p.trainer.train_steps == 37 and p.task.train_data.global_batch_size == 4
    p = load_pipeline(DEMO, "{trainer: {train_steps: 41}, task: {losses: {l2_weight_decay: 1e-4}}}")
    assert p.trainer.train_steps == 41
    assert p.task.losses.l2_weight_decay == pytest.approx(1e-4)


def test_scientific_notation_is_a_float_in_files(tmp_path):
    path = write(tmp_path, "experiment: retinanet_mobile_coco\ntask: {losses: {l2_weight_decay: 4e-5}}\n")
    assert load_pipeline(path).task.losses.l2_weight_decay == pytest.approx(4e-5)


def test_missing_file():
    msg = error("nope/missing.yaml")
    assert "nope/missing.yaml" in msg and "no such file" in msg


def test_unknown_experiment_lists_detection_ones(tmp_path):
    msg = error(write(tmp_path, "experiment: retinanet_mobile_cocoo\n"))
    assert "retinanet_mobile_cocoo" in msg and "did you mean 'retinanet_mobile_coco'" in msg
    for name in ("retinanet_resnetfpn_coco", "fasterrcnn_resnetfpn_coco", "maskrcnn_resnetfpn_coco"):
        assert name in msg
    assert "resnet_imagenet" not in msg
    msg = error(write(tmp_path, "experiment: resnet_imagenet\n"))
    assert "not a registered detection experiment" in msg
    assert "retinanet_resnetfpn_coco" in known_experiments()


def test_missing_experiment_key(tmp_path):
    msg = error(write(tmp_path, "task: {}\n"))
    assert "experiment" in msg and "retinanet_mobile_coco" in msg


def test_unknown_keys_name_the_path(tmp_path):
    msg = error(DEMO, "task.modle.num_classes=3")
    assert msg.startswith("params_override: task.modle: unknown key; did you mean 'model'?")
    msg = error(write(tmp_path, "experiment: retinanet\ntrainer: {train_stepz: 3}\n"))
    assert "trainer.train_stepz" in msg and "train_steps" in msg
    msg = error(write(tmp_path, "experiment: retinanet\ntrainr: {}\n"))
    assert "trainr" in msg and "trainer" in msg


def test_wrong_value_type():
    msg = error(DEMO, "trainer.train_steps=many")
    assert "trainer.train_steps" in msg and "'many'" in msg and "number" in msg


def test_bad_override_text():
    msg = error(DEMO, "[1, 2")
    assert msg.startswith("params_override:") and "key.sub=value" in msg


def test_bad_yaml_and_aliases(tmp_path):
    msg = error(write(tmp_path, "experiment: [unclosed\n"))
    assert "line" in msg and "YAML" in msg
    msg = error(write(tmp_path, "experiment: retinanet\ntask: &a {}\ntrainer: *a\n"))
    assert "alias" in msg
    msg = error(write(tmp_path, "experiment: retinanet\nexperiment: retinanet\n"))
    assert "duplicate" in msg


def test_strategy_from_cluster_contradiction(tmp_path):
    path = write(tmp_path, "experiment: retinanet_mobile_coco\nruntime: {distribution_strategy: mirrored}\n")
    msg = error(path, strategy="parameter_server")
    assert "runtime.distribution_strategy" in msg and "'mirrored'" in msg
    assert "parameter_server" in msg and "remove" in msg
    assert load_pipeline(path, strategy="mirrored").runtime.distribution_strategy == "mirrored"
    # One device is a single-machine strategy too.
    msg = error(DEMO, "runtime.distribution_strategy=one_device", strategy="multi_worker_mirrored")
    assert "params_override" in msg
    assert load_pipeline(DEMO, "runtime.distribution_strategy=one_device", strategy="mirrored")


def test_parameter_server_settings(tmp_path):
    p = load_pipeline(DEMO, strategy="parameter_server")
    assert p.runtime.distribution_strategy == "parameter_server"
    assert p.trainer.eval_tf_while_loop is True
    msg = error(DEMO, "trainer.eval_tf_while_loop=false", strategy="parameter_server")
    assert "trainer.eval_tf_while_loop" in msg and "true" in msg


def test_unknown_strategy():
    assert "one of parameter_server" in error(DEMO, strategy="horovod")


def test_checks_model_garden_would_find_late():
    msg = error(DEMO, "trainer.summary_interval=150")
    assert "trainer.summary_interval" in msg and "multiple" in msg and "set it to 100" in msg
    assert "train_steps" in error(DEMO, "trainer.train_steps=0")
    assert "input_path" in error(DEMO, "task.train_data.input_path=''")


def test_returns_a_fresh_unlocked_config():
    a = load_pipeline(DEMO)
    b = load_pipeline(DEMO)
    a.trainer.train_steps = 5
    assert b.trainer.train_steps != 5
