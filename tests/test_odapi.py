"""Coming from the Object Detection API: its records (file names as source ids, class/text beside
class/label, as generate_tfrecord.py writes them) rewritten by `od-dist data odapi`, its
pipeline.config (the TF2 Detection Zoo's shapes, written here) turned into a pipeline by
`od-dist pipeline import`; then, in one slow test, the README's commands from such a folder to a few
training steps and a COCO line from `od-dist eval`."""

import glob
import json
import os
import re

import loopback
import numpy as np
import pytest
from loopback import ROOT, run_cli

from od_dist.data import errors, records, shapes, textproto

# The TF2 Detection Zoo's pipeline.config files, as downloaded (placeholders included).
SSD_RESNET50_V1_FPN_640 = """# SSD with Resnet 50 v1 FPN feature extractor, shared box predictor and focal
# loss (a.k.a Retinanet).
model {
  ssd {
    inplace_batchnorm_update: true
    freeze_batchnorm: false
    num_classes: 90
    box_coder {
      faster_rcnn_box_coder {
        y_scale: 10.0
        x_scale: 10.0
        height_scale: 5.0
        width_scale: 5.0
      }
    }
    matcher {
      argmax_matcher {
        matched_threshold: 0.5
        unmatched_threshold: 0.5
        ignore_thresholds: false
        negatives_lower_than_unmatched: true
        force_match_for_each_row: true
        use_matmul_gather: true
      }
    }
    similarity_calculator {
      iou_similarity {
      }
    }
    encode_background_as_zeros: true
    anchor_generator {
      multiscale_anchor_generator {
        min_level: 3
        max_level: 7
        anchor_scale: 4.0
        aspect_ratios: [1.0, 2.0, 0.5]
        scales_per_octave: 2
      }
    }
    image_resizer {
      fixed_shape_resizer {
        height: 640
        width: 640
      }
    }
    box_predictor {
      weight_shared_convolutional_box_predictor {
        depth: 256
        class_prediction_bias_init: -4.6
        conv_hyperparams {
          activation: RELU_6,
          regularizer {
            l2_regularizer {
              weight: 0.00004
            }
          }
          initializer {
            random_normal_initializer {
              stddev: 0.01
              mean: 0.0
            }
          }
          batch_norm {
            scale: true,
            decay: 0.997,
            epsilon: 0.001,
          }
        }
        num_layers_before_predictor: 4
        share_prediction_tower: true
        kernel_size: 3
      }
    }
    feature_extractor {
      type: 'ssd_resnet50_v1_fpn_keras'
      fpn {
        min_level: 3
        max_level: 7
        additional_layer_depth: 256
      }
      min_depth: 16
      depth_multiplier: 1.0
      conv_hyperparams {
        activation: RELU_6,
        regularizer {
          l2_regularizer {
            weight: 0.00004
          }
        }
        initializer {
          random_normal_initializer {
            stddev: 0.01
            mean: 0.0
          }
        }
        batch_norm {
          scale: true,
          decay: 0.997,
          epsilon: 0.001,
        }
      }
      override_base_feature_extractor_hyperparams: true
    }
    loss {
      classification_loss {
        weighted_sigmoid_focal {
          alpha: 0.25
          gamma: 2.0
        }
      }
      localization_loss {
        weighted_smooth_l1 {
        }
      }
      classification_weight: 1.0
      localization_weight: 1.0
    }
    normalize_loss_by_num_matches: true
    normalize_loc_loss_by_codesize: true
    post_processing {
      batch_non_max_suppression {
        score_threshold: 1e-8
        iou_threshold: 0.6
        max_detections_per_class: 100
        max_total_detections: 100
      }
      score_converter: SIGMOID
    }
  }
}

train_config: {
  fine_tune_checkpoint_version: V2
  fine_tune_checkpoint: "PATH_TO_BE_CONFIGURED/resnet50.ckpt-1"
  fine_tune_checkpoint_type: "classification"
  batch_size: 64
  sync_replicas: true
  startup_delay_steps: 0
  replicas_to_aggregate: 8
  num_steps: 25000
  data_augmentation_options {
    random_horizontal_flip {
    }
  }
  data_augmentation_options {
    random_crop_image {
      min_object_covered: 0.0
      min_aspect_ratio: 0.75
      max_aspect_ratio: 3.0
      min_area: 0.75
      max_area: 1.0
      overlap_thresh: 0.0
    }
  }
  optimizer {
    momentum_optimizer: {
      learning_rate: {
        cosine_decay_learning_rate {
          learning_rate_base: .04
          total_steps: 25000
          warmup_learning_rate: .013333
          warmup_steps: 2000
        }
      }
      momentum_optimizer_value: 0.9
    }
    use_moving_average: false
  }
  max_number_of_boxes: 100
  unpad_groundtruth_tensors: false
}

train_input_reader: {
  label_map_path: "PATH_TO_BE_CONFIGURED/label_map.txt"
  tf_record_input_reader {
    input_path: "PATH_TO_BE_CONFIGURED/train2017-?????-of-00256.tfrecord"
  }
}

eval_config: {
  metrics_set: "coco_detection_metrics"
  use_moving_averages: false
}

eval_input_reader: {
  label_map_path: "PATH_TO_BE_CONFIGURED/label_map.txt"
  shuffle: false
  num_epochs: 1
  tf_record_input_reader {
    input_path: "PATH_TO_BE_CONFIGURED/val2017-?????-of-00032.tfrecord"
  }
}
"""

FASTER_RCNN_RESNET50_V1_640 = """# Faster R-CNN with Resnet-50 (v1)
# Trained on COCO, initialized from Imagenet classification checkpoint

model {
  faster_rcnn {
    num_classes: 90
    image_resizer {
      keep_aspect_ratio_resizer {
        min_dimension: 640
        max_dimension: 640
        pad_to_max_dimension: true
      }
    }
    feature_extractor {
      type: 'faster_rcnn_resnet50_keras'
      batch_norm_trainable: true
    }
    first_stage_anchor_generator {
      grid_anchor_generator {
        scales: [0.25, 0.5, 1.0, 2.0]
        aspect_ratios: [0.5, 1.0, 2.0]
        height_stride: 16
        width_stride: 16
      }
    }
    first_stage_box_predictor_conv_hyperparams {
      op: CONV
      regularizer {
        l2_regularizer {
          weight: 0.0
        }
      }
      initializer {
        truncated_normal_initializer {
          stddev: 0.01
        }
      }
    }
    first_stage_nms_score_threshold: 0.0
    first_stage_nms_iou_threshold: 0.7
    first_stage_max_proposals: 300
    first_stage_localization_loss_weight: 2.0
    first_stage_objectness_loss_weight: 1.0
    initial_crop_size: 14
    maxpool_kernel_size: 2
    maxpool_stride: 2
    second_stage_box_predictor {
      mask_rcnn_box_predictor {
        use_dropout: false
        dropout_keep_probability: 1.0
        fc_hyperparams {
          op: FC
          regularizer {
            l2_regularizer {
              weight: 0.0
            }
          }
          initializer {
            variance_scaling_initializer {
              factor: 1.0
              uniform: true
              mode: FAN_AVG
            }
          }
        }
        share_box_across_classes: true
      }
    }
    second_stage_post_processing {
      batch_non_max_suppression {
        score_threshold: 0.0
        iou_threshold: 0.6
        max_detections_per_class: 100
        max_total_detections: 300
      }
      score_converter: SOFTMAX
    }
    second_stage_localization_loss_weight: 2.0
    second_stage_classification_loss_weight: 1.0
    use_static_shapes: true
    use_matmul_crop_and_resize: true
    clip_anchors_to_image: true
    use_static_balanced_label_sampler: true
    use_matmul_gather_in_matcher: true
  }
}

train_config: {
  batch_size: 64
  sync_replicas: true
  startup_delay_steps: 0
  replicas_to_aggregate: 8
  num_steps: 25000
  optimizer {
    momentum_optimizer: {
      learning_rate: {
        cosine_decay_learning_rate {
          learning_rate_base: .04
          total_steps: 25000
          warmup_learning_rate: .013333
          warmup_steps: 2000
        }
      }
      momentum_optimizer_value: 0.9
    }
    use_moving_average: false
  }
  fine_tune_checkpoint_version: V2
  fine_tune_checkpoint: "PATH_TO_BE_CONFIGURED/resnet50.ckpt-1"
  fine_tune_checkpoint_type: "classification"
  data_augmentation_options {
    random_horizontal_flip {
    }
  }

  max_number_of_boxes: 100
  unpad_groundtruth_tensors: false
  use_bfloat16: true  # works only on TPUs
}

train_input_reader: {
  label_map_path: "PATH_TO_BE_CONFIGURED/label_map.txt"
  tf_record_input_reader {
    input_path: "PATH_TO_BE_CONFIGURED/train2017-?????-of-00256.tfrecord"
  }
}

eval_config: {
  metrics_set: "coco_detection_metrics"
  use_moving_averages: false
  batch_size: 1;
}

eval_input_reader: {
  label_map_path: "PATH_TO_BE_CONFIGURED/label_map.txt"
  shuffle: false
  num_epochs: 1
  tf_record_input_reader {
    input_path: "PATH_TO_BE_CONFIGURED/val2017-?????-of-00032.tfrecord"
  }
}
"""

# More of the Zoo's configs, as downloaded: SSD MobileNet V2 FPNLite 320 (which benchmarks/scaling.py
# also trains at its own size), EfficientDet D0, CenterNet Hourglass-104 and ResNet-50 V2 (whose input
# readers are an in-house extension), CenterNet ResNet-50 FPN with keypoints.
ZOO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "odapi_configs")
EFFICIENTDET_D0 = "ssd_efficientdet_d0_512x512_coco17_tpu-8"
CENTERNET_HG104 = "centernet_hourglass104_512x512_coco17_tpu-8"
CENTERNET_RESNET50_V2 = "centernet_resnet50_v2_512x512_coco17_tpu-8"
CENTERNET_RESNET50_KPTS = "centernet_resnet50_v1_fpn_512x512_kpts_coco17_tpu-8"


def zoo(name):
    with open(os.path.join(ZOO, name + ".config"), encoding="utf-8") as f:
        return f.read()


SSD_MOBILENET_V2_FPNLITE_320 = zoo("ssd_mobilenet_v2_fpnlite_320x320_coco17_tpu-8")

LABEL_MAP = "".join(f"item {{\n  id: {i}\n  name: '{n}'\n}}\n" for i, n in enumerate(shapes.CLASSES, 1))


def od_dist(*args, cwd=ROOT, timeout=600):
    return loopback.od_dist(*args, cwd=cwd, timeout=timeout)


def write_odapi_records(path, count, seed, size=96, with_labels=True, rename=None):
    """Records as the Object Detection API's generate_tfrecord.py writes them: the file name as
    image/source_id and image/filename, class/text and (unless ``with_labels`` is false) class/label
    from its class_text_to_int; ``rename`` = {old class name: new} to write unknown names."""
    import tensorflow as tf

    rng = np.random.default_rng(seed)

    def feature(kind, values):
        if kind == "bytes":
            return tf.train.Feature(bytes_list=tf.train.BytesList(value=values))
        if kind == "float":
            return tf.train.Feature(float_list=tf.train.FloatList(value=values))
        return tf.train.Feature(int64_list=tf.train.Int64List(value=values))

    with tf.io.TFRecordWriter(path) as writer:
        for i in range(count):
            image, boxes, labels, _ = shapes.make_image(rng, size)
            name = f"IMG_{seed}{i:03d}.jpg".encode()
            texts = [
                (rename or {}).get(shapes.CLASSES[c - 1], shapes.CLASSES[c - 1]).encode() for c in labels
            ]
            f = {
                "image/height": feature("int", [size]),
                "image/width": feature("int", [size]),
                "image/filename": feature("bytes", [name]),
                "image/source_id": feature("bytes", [name]),
                "image/encoded": feature("bytes", [shapes.encode_image(image, "jpeg")]),
                "image/format": feature("bytes", [b"jpg"]),
                "image/object/bbox/xmin": feature("float", [b[1] / size for b in boxes.tolist()]),
                "image/object/bbox/xmax": feature("float", [b[3] / size for b in boxes.tolist()]),
                "image/object/bbox/ymin": feature("float", [b[0] / size for b in boxes.tolist()]),
                "image/object/bbox/ymax": feature("float", [b[2] / size for b in boxes.tolist()]),
                "image/object/class/text": feature("bytes", texts),
            }
            if with_labels:
                f["image/object/class/label"] = feature("int", [int(c) for c in labels])
            writer.write(tf.train.Example(features=tf.train.Features(feature=f)).SerializeToString())


def read_examples(pattern):
    import tensorflow as tf

    out = []
    for path in sorted(glob.glob(pattern)):
        for data in tf.data.TFRecordDataset(path).as_numpy_iterator():
            out.append(tf.train.Example.FromString(data).features.feature)
    return out


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """An Object Detection API project folder: annotations/{train,test}.record, label_map.pbtxt."""
    root = tmp_path_factory.mktemp("odapi_project")
    os.makedirs(root / "annotations")
    write_odapi_records(str(root / "annotations" / "train.record"), 12, seed=1)
    write_odapi_records(str(root / "annotations" / "test.record"), 6, seed=2)
    (root / "annotations" / "label_map.pbtxt").write_text(LABEL_MAP)
    return root


# ----- the text-format reader -----------------------------------------------------------------


def test_textproto_reads_the_zoo_syntax():
    msg = textproto.parse(
        "a: 1  # comment\nb: -4.6 c: .04 d: 1e-8 e: 'x\\'y' f: \"z\"\ng: SIGMOID h: true\n"
        "m: { n { } } m { k: [0.25, 0.5] k: 2 }\nr <s: 1>; t: [{u: 1}, {u: 2}]"
    )
    assert msg.get("a") == 1 and msg.get("b") == -4.6 and msg.get("c") == 0.04 and msg.get("d") == 1e-8
    assert msg.get("e") == "x'y" and msg.get("f") == "z" and msg.get("h") is True
    assert isinstance(msg.get("g"), textproto.Enum) and msg.get("g") == "SIGMOID"
    assert len(msg.all("m")) == 2 and msg.all("m")[1].all("k") == [0.25, 0.5, 2]
    assert msg.message("r").get("s") == 1 and [t.get("u") for t in msg.all("t")] == [1, 2]
    for text in (SSD_MOBILENET_V2_FPNLITE_320, SSD_RESNET50_V1_FPN_640, FASTER_RCNN_RESNET50_V1_640):
        assert textproto.parse(text).message("train_config").get("num_steps") in (25000, 50000)


@pytest.mark.parametrize(
    "text, line, column, words",
    [
        ("model {\n  ssd {\n    num_classes: 90\n  }\n", 5, 1, "missing '}' for the block opened on line 1"),
        ("model {\n  ssd {\n    num_classes 90\n", 3, 17, "expected ':' or '{' after 'num_classes'"),
        ("a: 1\nb: [1, 2\n", 3, 1, "expected ',' or ']'"),
        ("a: 1\n  b: 'open\n", 2, 6, "string not closed on its line"),
        ("a: 1 $\n", 1, 6, "unexpected character '$'"),
        ("a: 1\n}\n", 2, 1, "expected a field name"),
        ("a: 12abc\n", 1, 4, "bad number"),
        ("a: 1\n[x y] { }\n", 2, 4, "expected ']' after '[x'"),
        ("[x.y]\n", 2, 1, "expected ':' or '{' after '[x.y]'"),
        ("[]: 1\n", 1, 2, "expected an extension's full name"),
    ],
)
def test_textproto_errors_name_line_and_column(text, line, column, words):
    with pytest.raises(textproto.TextFormatError) as e:
        textproto.parse(text)
    assert (e.value.line, e.value.column) == (line, column), str(e.value)
    assert words in str(e.value) and str(e.value).startswith(f"line {line}, column {column}: ")


def test_textproto_skips_extension_fields():
    """An extension (a field of another proto, named in brackets) is read to its end and left out,
    named with its line, in each of its forms."""
    msg = textproto.parse(
        "r {\n  [a.b.C.ext] { x: 1 inner { y: [1, 2] } }\n  k: 2\n  [a.b.d]: 'v'\n"
        "  [type.googleapis.com/a.B] < z: 1 >\n  [a.b.e]: { }\n}\n"
    )
    r = msg.message("r")
    assert r.fields == {"k": [2]}
    assert r.extensions == [("a.b.C.ext", 2), ("a.b.d", 4), ("type.googleapis.com/a.B", 5), ("a.b.e", 6)]
    assert msg.extensions == []


# ----- pipeline import ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, experiment, size, batch, steps, lr, warmup",
    [
        (SSD_MOBILENET_V2_FPNLITE_320, "retinanet_mobile_coco", [384, 384, 3], 128, 50000, 0.08, 1000),
        (SSD_RESNET50_V1_FPN_640, "retinanet_resnetfpn_coco", [640, 640, 3], 64, 25000, 0.04, 2000),
        (FASTER_RCNN_RESNET50_V1_640, "fasterrcnn_resnetfpn_coco", [640, 640, 3], 64, 25000, 0.04, 2000),
    ],
)
def test_import_zoo_configs(tmp_path, capsys, text, experiment, size, batch, steps, lr, warmup):
    from od_dist.model.pipeline import load_pipeline

    (tmp_path / "pipeline.config").write_text(text)
    out = tmp_path / "pipelines" / "imported.yaml"
    code, stdout, err = run_cli(
        capsys, "pipeline", "import", f"--config={tmp_path / 'pipeline.config'}", f"--out={out}"
    )
    assert code == 0, err
    params = load_pipeline(str(out))
    assert params.task.model.num_classes == 91  # 90 classes + Model Garden's background
    assert list(params.task.model.input_size) == size
    assert params.task.train_data.global_batch_size == batch and params.trainer.train_steps == steps
    assert params.task.train_data.parser.aug_rand_hflip is True
    opt = params.trainer.optimizer_config
    assert opt.optimizer.type == "sgd" and opt.optimizer.sgd.momentum == 0.9
    assert opt.learning_rate.type == "cosine" and opt.learning_rate.cosine.initial_learning_rate == lr
    # The Object Detection API's cosine ends at total_steps and starts after the warmup.
    assert (
        opt.learning_rate.cosine.offset == warmup and opt.learning_rate.cosine.decay_steps == steps - warmup
    )
    assert opt.warmup.linear.warmup_steps == warmup
    assert params.task.init_checkpoint in (None, "")
    assert "val2017-?????-of-00032.tfrecord" in params.task.validation_data.input_path
    lines = stdout.splitlines()
    dropped = [ln for ln in lines if ln.startswith("not carried over: ")]
    # The Zoo checkpoint is said first, with how to start from a Model Garden one.
    assert lines[0].startswith("not carried over: train_config.fine_tune_checkpoint ")
    assert "variable names" in lines[0] and "starts from scratch" in lines[0]
    assert "init_checkpoint_modules: backbone" in lines[0] and "resnet50_imagenet/ckpt-28080" in lines[0]
    assert any("sync_replicas" in ln for ln in dropped)
    assert all(": " in ln[len("not carried over: ") :] for ln in dropped)  # each says why
    if experiment.startswith("retinanet"):
        assert params.task.model.backbone.type in ("mobilenet", "resnet")
        assert params.task.losses.focal_loss_alpha == 0.25 and params.task.model.anchor.num_scales == 2
        assert any("random_crop_image" in ln for ln in dropped)
        # fixed_shape_resizer stretches, in training and in evaluation alike (the export reads training's)
        assert params.task.train_data.parser.keep_aspect_ratio is False
        assert params.task.validation_data.parser.keep_aspect_ratio is False
    if experiment == "retinanet_mobile_coco":
        assert params.task.model.backbone.mobilenet.model_id == "MobileNetV2"
        assert params.task.model.decoder.fpn.use_separable_conv and params.task.model.head.num_filters == 128
        assert any("320x320" in ln and "384x384" in ln for ln in dropped)
    else:
        assert params.task.model.backbone.resnet.model_id == 50
    assert experiment in open(out).read() and f"experiment {experiment}" in stdout
    assert os.listdir(out.parent) == ["imported.yaml"]  # no temporary file left
    assert "validation_interval" not in open(out).read()  # training never evaluates: it would do nothing


def test_import_bad_input(tmp_path):
    """Refused in one line, exit 2, before TensorFlow is imported; nothing written or replaced."""
    config = tmp_path / "pipeline.config"
    out = tmp_path / "out.yaml"
    config.write_text(SSD_MOBILENET_V2_FPNLITE_320.replace("num_classes: 90", "num_classes 90"))
    r = od_dist("pipeline", "import", f"--config={config}", f"--out={out}")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "line 7, column 17: expected ':' or '{' after 'num_classes'" in r.stderr
    config.write_text("model {\n  experimental_model {\n    name: 'mine'\n  }\n}\n")
    r = od_dist("pipeline", "import", f"--config={config}", f"--out={out}")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "an experimental model" in r.stderr and "supported families: SSD with a MobileNet" in r.stderr
    assert "Faster R-CNN" in r.stderr and "EfficientDet" in r.stderr and "CenterNet" in r.stderr
    config.write_text(SSD_MOBILENET_V2_FPNLITE_320.replace("ssd_mobilenet_v2_fpn_keras", "ssd_inception_v2"))
    r = od_dist("pipeline", "import", f"--config={config}", f"--out={out}")
    assert r.returncode == 2 and "'ssd_inception_v2'" in r.stderr and "supported:" in r.stderr
    assert "ssd_efficientnet-b0..b7_bifpn_keras" in r.stderr
    config.write_text(SSD_MOBILENET_V2_FPNLITE_320.replace("num_steps: 50000", "num_steps: 'many'"))
    r = od_dist("pipeline", "import", f"--config={config}", f"--out={out}")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "train_config.num_steps: 'many'" in r.stderr
    assert os.listdir(tmp_path) == ["pipeline.config"]
    out.write_text("mine\n")
    config.write_text(SSD_MOBILENET_V2_FPNLITE_320)
    r = od_dist("pipeline", "import", f"--config={config}", f"--out={out}")
    assert r.returncode == 2 and "exists" in r.stderr and "--force" in r.stderr
    assert out.read_text() == "mine\n"


@pytest.mark.parametrize(
    "change, said",
    [
        (
            ("num_classes: 90", "num_classes: 90 extra " + "{ x " * 5000 + "}" * 5000),
            "nested more than 100 deep",
        ),
        (("num_classes: 90", "num_classes: " + "9" * 5000), "(5000 digits) out of range"),
        (("num_steps: 50000", "num_steps: " + "9" * 4000), "(4000 digits) out of range"),
        (("batch_size: 128", "batch_size: 18446744073709551616"), "18446744073709551616 out of range"),
    ],
    ids=["5000 levels", "5000 digits", "4000 digits", "2^64"],
)
def test_import_refuses_text_no_config_holds(tmp_path, capsys, change, said):
    """Deep nesting (a RecursionError in a recursive reader) and integers wider than any protobuf
    field (Python refuses to convert more than 4300 digits; fewer went into the YAML) are one line,
    exit 2, with where they are."""
    config = tmp_path / "pipeline.config"
    config.write_text(SSD_MOBILENET_V2_FPNLITE_320.replace(*change))
    code, _, err = run_cli(capsys, "pipeline", "import", f"--config={config}", f"--out={tmp_path / 'p.yaml'}")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err[-2000:]
    assert said in err and re.search(r"line \d+, column \d+", err), err
    assert len(err) < 400 and os.listdir(tmp_path) == ["pipeline.config"]


@pytest.mark.parametrize(
    "name, experiment, backbone, size, batch, steps",
    [
        (EFFICIENTDET_D0, "retinanet_resnetfpn_coco", ("efficientnet", "model_id", "b0"), 512, 128, 300000),
        (CENTERNET_HG104, "centernet_hourglass_coco", ("hourglass", "model_id", 52), 512, 128, 140000),
        (
            CENTERNET_RESNET50_V2,
            "centernet_hourglass_coco",
            ("dilated_resnet", "model_id", 50),
            512,
            128,
            250000,
        ),
        (
            CENTERNET_RESNET50_KPTS,
            "centernet_hourglass_coco",
            ("dilated_resnet", "model_id", 50),
            512,
            128,
            250000,
        ),
    ],
    ids=["efficientdet_d0", "centernet_hg104", "centernet_resnet50_v2", "centernet_resnet50_kpts"],
)
def test_import_zoo_families(tmp_path, capsys, name, experiment, backbone, size, batch, steps):
    """EfficientDet and CenterNet configs of the Zoo, as downloaded, import to a pipeline that loads,
    with what carries over carried and each thing that does not said in one line."""
    from od_dist.model.pipeline import load_pipeline

    (tmp_path / "pipeline.config").write_text(zoo(name))
    out = tmp_path / "p.yaml"
    code, stdout, err = run_cli(
        capsys, "pipeline", "import", f"--config={tmp_path / 'pipeline.config'}", f"--out={out}"
    )
    assert code == 0, err
    assert f"experiment {experiment}" in stdout and "Traceback" not in stdout + err
    params = load_pipeline(str(out))
    task = params.task
    kind, key, value = backbone
    assert task.model.backbone.type == kind and getattr(task.model.backbone.get(), key) == value
    assert list(task.model.input_size) == [size, size, 3]
    assert task.train_data.global_batch_size == batch and params.trainer.train_steps == steps
    assert task.train_data.parser.aug_rand_hflip is True
    dropped = [
        ln[len("not carried over: ") :] for ln in stdout.splitlines() if ln.startswith("not carried over: ")
    ]
    assert all(": " in ln for ln in dropped)  # each says why
    opt = params.trainer.optimizer_config
    if name == EFFICIENTDET_D0:
        assert task.model.num_classes == 91  # + Model Garden's background
        assert task.model.decoder.type == "fpn" and task.model.decoder.fpn.num_filters == 64
        assert task.model.decoder.fpn.use_separable_conv and task.model.norm_activation.activation == "swish"
        assert task.model.head.num_filters == 64 and task.model.head.num_convs == 3
        assert task.model.anchor.num_scales == 3 and task.losses.focal_loss_gamma == 1.5
        assert (task.train_data.parser.aug_scale_min, task.train_data.parser.aug_scale_max) == (0.1, 2.0)
        assert opt.optimizer.type == "sgd" and opt.learning_rate.cosine.initial_learning_rate == 0.08
        assert opt.learning_rate.cosine.offset == 2500 and opt.warmup.linear.warmup_steps == 2500
        bifpn = [ln for ln in dropped if ln.startswith("model.ssd.feature_extractor.bifpn ")]
        assert len(bifpn) == 1 and "an FPN" in bifpn[0] and "no BiFPN" in bifpn[0], dropped
        return
    # CenterNet: classes from 1 without a background class, the boxes a config keeps, its losses.
    assert task.model.num_classes == 90 and task.model.max_num_instances == 100
    assert task.model.detection_generator.max_detections == 100 and task.losses.gaussian_iou == 0.7
    assert task.losses.detection.scale_weight == 0.1 and task.losses.detection.offset_weight == 1.0
    assert task.weight_decay == 0.0 and task.gradient_clip_norm == 0.0
    parser = task.train_data.parser
    assert parser.aug_rand_hue and parser.aug_rand_contrast and parser.aug_rand_saturation
    assert parser.aug_rand_brightness
    assert opt.optimizer.type == "adam" and opt.optimizer.adam.epsilon == 1e-7
    # The images are normalised alike in training and evaluation.
    for field in ("bgr_ordering", "channel_means", "channel_stds"):
        assert getattr(task.validation_data.parser, field) == getattr(parser, field)
    if name == CENTERNET_HG104:
        assert task.model.backbone.hourglass.num_hourglasses == 2 and list(task.model.head.input_levels) == [
            "2_0",
            "2",
        ]
        assert parser.bgr_ordering and list(parser.channel_means) == [104.01362025, 114.03422265, 119.9165958]
        assert opt.learning_rate.type == "stepwise"
        assert list(opt.learning_rate.stepwise.boundaries) == [90000, 120000]
        assert list(opt.learning_rate.stepwise.values) == [1e-3, 1e-4, 1e-5]
        assert task.validation_data.input_path.endswith("val2017-?????-of-00032.tfrecord")
        return
    assert task.model.backbone.dilated_resnet.output_stride == 8 and list(task.model.head.input_levels) == [
        "3"
    ]
    assert parser.bgr_ordering is False and list(parser.channel_means) == [127.5] * 3
    resnet = [ln for ln in dropped if ln.startswith("model.center_net.feature_extractor.type ")]
    assert len(resnet) == 1 and "dilated ResNet-50" in resnet[0], dropped
    if name == CENTERNET_RESNET50_V2:
        extension = "[object_detection.protos.GoogleInputReader.google_input_reader]"
        lines = [ln for ln in dropped if extension in ln]
        assert [ln.split(extension)[0] for ln in lines] == [
            "train_input_reader.external_input_reader.",
            "eval_input_reader.external_input_reader.",
        ], dropped
        assert "(line 127)" in lines[0] and "left out" in lines[0]
        assert opt.learning_rate.cosine.offset == 5000 and opt.warmup.linear.warmup_steps == 5000
        assert task.train_data.input_path == "PATH_TO_BE_CONFIGURED"
    else:
        keypoints = [ln for ln in dropped if "keypoint" in ln.split(" ")[0]]
        assert keypoints == [
            "model.center_net.keypoint_estimation_task: the keypoint heads are not carried: Model Garden's "
            "CenterNet detects boxes; the box detection is imported"
        ], dropped


def covered(image):
    """(rows, columns) of a model input that a solid-coloured picture covers: its pixels equal the
    top-left one (a letterbox pads the rest, a stretch covers it all)."""
    image = np.asarray(image)
    same = np.all(np.abs(image - image[0, 0]) < 1e-3, axis=-1)
    return int(same[:, 0].sum()), int(same[0, :].sum())


@pytest.mark.parametrize("name", sorted(f[: -len(".config")] for f in os.listdir(ZOO)))
def test_imported_pipelines_resize_alike_in_training_evaluation_and_export(tmp_path, capsys, name):
    """Each Zoo config's import resizes a 64x128 picture alike in its training parser, its
    validation parser (`eval`, the evaluator) and its export, as the Object Detection API's resizer
    does: a fixed_shape_resizer stretches, a keep_aspect_ratio_resizer letterboxes."""
    import tensorflow as tf
    from official.core import task_factory
    from official.vision.serving import detection

    from od_dist.model import export
    from od_dist.model.pipeline import load_pipeline

    picture = np.zeros((64, 128, 3), np.uint8) + np.array([200, 60, 30], np.uint8)
    record = str(tmp_path / "one.tfrecord")
    with tf.io.TFRecordWriter(record) as writer:
        f = {
            "image/encoded": [shapes.encode_image(picture, "png")],
            "image/source_id": [b"1"],
            "image/height": [64],
            "image/width": [128],
            "image/object/bbox/xmin": [0.25],
            "image/object/bbox/xmax": [0.75],
            "image/object/bbox/ymin": [0.25],
            "image/object/bbox/ymax": [0.75],
            "image/object/class/label": [1],
        }
        feature = {
            k: tf.train.Feature(bytes_list=tf.train.BytesList(value=v))
            if isinstance(v[0], bytes)
            else tf.train.Feature(float_list=tf.train.FloatList(value=v))
            if isinstance(v[0], float)
            else tf.train.Feature(int64_list=tf.train.Int64List(value=v))
            for k, v in f.items()
        }
        writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    (tmp_path / "pipeline.config").write_text(zoo(name))
    out = tmp_path / "p.yaml"
    code, _, err = run_cli(
        capsys, "pipeline", "import", f"--config={tmp_path / 'pipeline.config'}", f"--out={out}"
    )
    assert code == 0, err
    params = load_pipeline(str(out))
    for data in (params.task.train_data, params.task.validation_data):
        data.input_path, data.global_batch_size = record, 1
    # Resizing only: the training parser's random augmentations off.
    parser = params.task.train_data.parser
    for flag in (
        "aug_rand_hflip",
        "aug_rand_hue",
        "aug_rand_contrast",
        "aug_rand_saturation",
        "aug_rand_brightness",
    ):
        if flag in parser.as_dict():
            setattr(parser, flag, False)
    parser.aug_scale_min = parser.aug_scale_max = 1.0
    if "aug_type" in parser.as_dict():
        parser.aug_type = None
    task = task_factory.get_task(params.task)
    seen = {}
    for what, data in (("training", params.task.train_data), ("validation", params.task.validation_data)):
        images, _ = next(iter(task.build_inputs(data)))
        seen[what] = covered(images[0])
    size = list(params.task.model.input_size[:2])
    picture = tf.constant(picture)

    class NoModel(tf.Module):  # the export's preprocessing needs no model
        def __call__(self, images, training=False):
            return images

    if export._is_centernet(params):
        module = export._centernet_module(params, size, 0.1, model=NoModel())
        seen["export"] = covered(module._one(picture)[0])
    else:
        module = detection.DetectionModule(params, batch_size=1, input_image_size=size, model=NoModel())
        seen["export"] = covered(module._build_inputs(picture)[0])
    stretched = "fixed_shape_resizer" in zoo(name)
    side = size[0]
    assert seen == dict.fromkeys(seen, (side, side) if stretched else (side // 2, side)), seen


@pytest.mark.parametrize(
    "block, params, aspect, area",
    [
        # No operations: the Object Detection API's seven, each skipped 15% of the time.
        (
            "ssd_random_crop {\n    }",
            [(c, c, 0.85) for c in (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0)],
            [0.5, 2.0],
            [0.1, 1.0],
        ),
        (
            "ssd_random_crop {\n operations { min_object_covered: 0.3 min_aspect_ratio: 0.5 max_aspect_ratio: 2.0 "
            "min_area: 0.2 max_area: 1.0 overlap_thresh: 0.4 random_coef: 0.25 }\n"
            " operations { min_object_covered: 0.9 min_aspect_ratio: 0.5 max_aspect_ratio: 2.0 "
            "min_area: 0.2 max_area: 1.0 overlap_thresh: 0.6 random_coef: 0.0 } }",
            [(0.3, 0.4, 0.75), (0.9, 0.6, 1.0)],
            [0.5, 2.0],
            [0.2, 1.0],
        ),
        (
            "ssd_random_crop_fixed_aspect_ratio {\n operations { min_object_covered: 0.5 min_area: 0.1 "
            "max_area: 1.0 overlap_thresh: 0.5 random_coef: 0.1 }\n aspect_ratio: 1.0 }",
            [(0.5, 0.5, 0.9)],
            [1.0, 1.0],
            [0.1, 1.0],
        ),
    ],
    ids=["defaults", "operations", "fixed_aspect_ratio"],
)
def test_import_maps_ssd_random_crop(tmp_path, capsys, block, params, aspect, area):
    """The SSD family's IoU-constrained crop becomes Model Garden RetinaNet's ssd_random_crop, with the
    config's operations, and is no longer reported as dropped."""
    from od_dist.model.pipeline import load_pipeline

    before = "  data_augmentation_options {\n    random_crop_image {"
    text = SSD_MOBILENET_V2_FPNLITE_320.replace(
        before, f"  data_augmentation_options {{\n    {block}\n  }}\n{before}"
    )
    (tmp_path / "pipeline.config").write_text(text)
    out = tmp_path / "p.yaml"
    code, stdout, err = run_cli(
        capsys, "pipeline", "import", f"--config={tmp_path / 'pipeline.config'}", f"--out={out}"
    )
    assert code == 0, err
    aug = load_pipeline(str(out)).task.train_data.parser.aug_type
    assert aug.type == "ssd_random_crop"
    crop = aug.ssd_random_crop
    got = [
        (p.min_object_covered, p.min_box_overlap, round(p.prob_to_apply, 6))
        for p in crop.ssd_random_crop_params
    ]
    assert got == params and list(crop.aspect_ratio_range) == aspect and list(crop.area_range) == area
    dropped = [ln for ln in stdout.splitlines() if ln.startswith("not carried over: ")]
    assert not any(ln.split(" ")[3].endswith(".ssd_random_crop") for ln in dropped), dropped
    assert any(ln.split(" ")[3].endswith(".random_crop_image") for ln in dropped), dropped


def test_import_refuses_deepmac(tmp_path, capsys):
    """DeepMAC (CenterNet with a mask head): one line saying why, exit 2, nothing written."""
    config = tmp_path / "pipeline.config"
    config.write_text(
        zoo(CENTERNET_HG104).replace(
            "    object_center_params {",
            "    deepmac_mask_estimation {\n      dim: 32\n    }\n    object_center_params {",
        )
    )
    code, _, err = run_cli(capsys, "pipeline", "import", f"--config={config}", f"--out={tmp_path / 'p.yaml'}")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "model.center_net.deepmac_mask_estimation: DeepMAC predicts instance masks" in err
    assert os.listdir(tmp_path) == ["pipeline.config"]


def test_import_never_leaves_a_pipeline_that_does_not_load(tmp_path, capsys):
    config = tmp_path / "pipeline.config"
    config.write_text(SSD_RESNET50_V1_FPN_640.replace("batch_size: 64", "batch_size: 0"))
    out = tmp_path / "p.yaml"
    code, _, err = run_cli(capsys, "pipeline", "import", f"--config={config}", f"--out={out}")
    assert code == 2 and "global_batch_size" in err and "nothing written" in err
    assert sorted(os.listdir(tmp_path)) == ["pipeline.config"]


def test_import_warns_when_the_label_map_disagrees(tmp_path, capsys):
    (tmp_path / "label_map.pbtxt").write_text(LABEL_MAP)
    config = tmp_path / "pipeline.config"
    config.write_text(
        SSD_RESNET50_V1_FPN_640.replace(
            "PATH_TO_BE_CONFIGURED/label_map.txt", str(tmp_path / "label_map.pbtxt")
        )
    )
    code, out, err = run_cli(
        capsys, "pipeline", "import", f"--config={config}", f"--out={tmp_path / 'p.yaml'}"
    )
    assert code == 0, err
    assert "warning: model.ssd.num_classes is 90 but the label map" in out and "set it to 4" in out


# ----- records --------------------------------------------------------------------------------


def test_data_check_points_at_data_odapi(project, capsys):
    code, out, _ = run_cli(capsys, "data", "check", f"--records={project / 'annotations' / 'test.record'}")
    assert code == 2
    assert "image/source_id 'IMG_2000.jpg' is not a number" in out and "od-dist data odapi" in out
    assert "write 1, 2, 3" not in out


def test_data_odapi_rewrites_records(project, tmp_path, capsys):
    out = tmp_path / "data"
    ann = project / "annotations"
    code, stdout, err = run_cli(
        capsys,
        "data",
        "odapi",
        f"--train={ann / 'train.record'}",
        f"--val={ann / 'test.record'}",
        f"--labels={ann / 'label_map.pbtxt'}",
        f"--out={out}",
    )
    assert code == 0, err
    assert sorted(os.listdir(out)) == [
        "label_map.pbtxt",
        "train-00000-of-00001.tfrecord",
        "val-00000-of-00001.tfrecord",
    ]
    before = read_examples(str(ann / "train.record")) + read_examples(str(ann / "test.record"))
    after = read_examples(str(out / "train-*.tfrecord")) + read_examples(str(out / "val-*.tfrecord"))
    assert [f["image/source_id"].bytes_list.value[0] for f in after] == [
        str(i).encode() for i in range(1, 19)
    ]
    for old, new in zip(before, after):
        assert new["image/filename"].bytes_list.value == old["image/source_id"].bytes_list.value
        assert new["image/encoded"].bytes_list.value == old["image/encoded"].bytes_list.value
        assert (
            new["image/object/bbox/xmin"].float_list.value == old["image/object/bbox/xmin"].float_list.value
        )
        assert (
            new["image/object/class/label"].int64_list.value
            == old["image/object/class/label"].int64_list.value
        )
    assert (out / "label_map.pbtxt").read_text() == LABEL_MAP
    assert "next: od-dist pipeline import" in stdout
    code, out_check, _ = run_cli(capsys, "data", "check", f"--records={out}/*.tfrecord", "--num_classes=4")
    assert code == 0, out_check
    # Without a label map: class/label as written, the names from class/text.
    code, _, err = run_cli(
        capsys,
        "data",
        "odapi",
        f"--train={ann / 'train.record'}",
        f"--val={ann / 'test.record'}",
        f"--out={out}2",
    )
    assert code == 0, err
    assert (tmp_path / "data2" / "label_map.pbtxt").read_text() == LABEL_MAP


def test_data_odapi_labels_from_class_text(tmp_path, capsys):
    """Records with class/text only: ids through the label map; without --labels: refused."""
    write_odapi_records(str(tmp_path / "train.record"), 4, seed=3, with_labels=False)
    write_odapi_records(str(tmp_path / "val.record"), 2, seed=4, with_labels=False)
    (tmp_path / "label_map.pbtxt").write_text(LABEL_MAP)
    args = [f"--train={tmp_path / 'train.record'}", f"--val={tmp_path / 'val.record'}"]
    code, _, err = run_cli(capsys, "data", "odapi", *args, f"--out={tmp_path / 'no'}")
    assert code == 2 and "pass --labels label_map.pbtxt" in err
    assert not os.path.exists(tmp_path / "no")
    code, _, err = run_cli(
        capsys,
        "data",
        "odapi",
        *args,
        f"--labels={tmp_path / 'label_map.pbtxt'}",
        f"--out={tmp_path / 'out'}",
    )
    assert code == 0, err
    by_name = {n: i for i, n in enumerate(shapes.CLASSES, 1)}
    for f in read_examples(str(tmp_path / "out" / "*.tfrecord")):
        texts = [t.decode() for t in f["image/object/class/text"].bytes_list.value]
        assert list(f["image/object/class/label"].int64_list.value) == [by_name[t] for t in texts]


def test_data_odapi_keeps_tensorflow_s_log_off_the_console(tmp_path):
    """TensorFlow reads and writes the records on no device: its C++ lines (a machine without a GPU
    logs its failed cuInit as an ERROR) say nothing of the work and stay off the console."""
    write_odapi_records(str(tmp_path / "train.record"), 2, seed=3)
    write_odapi_records(str(tmp_path / "val.record"), 1, seed=4)
    (tmp_path / "label_map.pbtxt").write_text(LABEL_MAP)
    r = loopback.od_dist(*odapi_args(tmp_path), env={"TF_CPP_MIN_LOG_LEVEL": None})
    assert r.returncode == 0, r.stderr
    assert not re.search(r"^\S+ \S+: [IWE] |cuInit", r.stderr, re.M), r.stderr


def odapi_args(tmp_path) -> list[str]:
    """`data odapi` of tmp_path's train.record and val.record with its label_map.pbtxt, into out."""
    return [
        "data",
        "odapi",
        f"--train={tmp_path / 'train.record'}",
        f"--val={tmp_path / 'val.record'}",
        f"--labels={tmp_path / 'label_map.pbtxt'}",
        f"--out={tmp_path / 'out'}",
    ]


def odapi_with_labels(capsys, tmp_path):
    """odapi_args, run in this process."""
    return run_cli(capsys, *odapi_args(tmp_path))


def test_data_odapi_writes_nothing_on_a_problem(tmp_path, capsys):
    write_odapi_records(
        str(tmp_path / "train.record"), 4, seed=5, rename={"circle": "cirlce"}, with_labels=False
    )
    write_odapi_records(str(tmp_path / "val.record"), 2, seed=6)
    (tmp_path / "label_map.pbtxt").write_text(LABEL_MAP)
    code, _, err = odapi_with_labels(capsys, tmp_path)
    assert code == 2 and "class 'cirlce' is not in --labels" in err and "nothing written" in err
    assert sorted(os.listdir(tmp_path)) == ["label_map.pbtxt", "train.record", "val.record"]


def test_data_odapi_refuses_a_class_the_label_map_does_not_have(tmp_path, capsys):
    """A record's class/text not in --labels, with a class/label beside it: refused, one line per
    record, rather than kept as an id beyond the num_classes the label map gives."""
    # 'circle' renamed 'ellipse' in the records; its class/label (1) stays. The map lacks 'ellipse'.
    write_odapi_records(str(tmp_path / "train.record"), 4, seed=5, rename={"circle": "ellipse"})
    write_odapi_records(str(tmp_path / "val.record"), 2, seed=6)
    (tmp_path / "label_map.pbtxt").write_text(LABEL_MAP)
    with_ellipse = [
        n
        for n, f in enumerate(read_examples(str(tmp_path / "train.record")))
        if b"ellipse" in f["image/object/class/text"].bytes_list.value
    ]
    assert with_ellipse  # the seed draws circles
    code, _, err = odapi_with_labels(capsys, tmp_path)
    assert code == 2, err
    refused = [
        line for line in err.splitlines() if "class 'ellipse' (class/label 1) is not in --labels" in line
    ]
    assert [int(re.search(r"record (\d+)", line).group(1)) for line in refused] == with_ellipse, err
    assert "nothing written" in err and not os.path.exists(tmp_path / "out")


# ----- the README's path, end to end ----------------------------------------------------------


@pytest.mark.slow
def test_odapi_project_trains_and_evaluates(project, tmp_path, capsys, monkeypatch):
    """A folder with a pipeline.config (the FPNLite shape, CPU-sized), label_map.pbtxt and records
    in the Object Detection API's layout -> the README's commands -> a COCO line. Imported without
    --data first: the import names the rewrite, and evaluating those records is one line, exit 2."""
    folder = tmp_path / "project"
    os.makedirs(folder / "annotations")
    for name in ("train.record", "test.record", "label_map.pbtxt"):
        os.link(project / "annotations" / name, folder / "annotations" / name)
    small = (
        SSD_MOBILENET_V2_FPNLITE_320.replace("num_classes: 90", "num_classes: 3")
        .replace("height: 320", "height: 128")
        .replace("width: 320", "width: 128")
        .replace("max_level: 7", "max_level: 5")
        .replace("batch_size: 128", "batch_size: 4")
        .replace("num_steps: 50000", "num_steps: 4")
        .replace("total_steps: 50000", "total_steps: 4")
        .replace("warmup_steps: 1000", "warmup_steps: 2")
        .replace("depth_multiplier: 1.0", "depth_multiplier: 0.35")
        .replace("PATH_TO_BE_CONFIGURED/label_map.txt", "annotations/label_map.pbtxt")
        .replace("PATH_TO_BE_CONFIGURED/train2017-?????-of-00256.tfrecord", "annotations/train.record")
        .replace("PATH_TO_BE_CONFIGURED/val2017-?????-of-00032.tfrecord", "annotations/test.record")
    )
    (folder / "pipeline.config").write_text(small)
    monkeypatch.chdir(folder)  # the config's paths are relative, as in a real project
    code, out, err = run_cli(capsys, "pipeline", "import", "--config=pipeline.config", "--out=raw.yaml")
    assert code == 0, err
    assert (
        "records: annotations/test.record holds file names as image/source_id ('IMG_2000.jpg'), the Object "
        "Detection API's layout" in out
    ), out
    assert (
        "od-dist data odapi --config pipeline.config --out data/raw && od-dist pipeline import --config "
        "pipeline.config --data data/raw --out raw.yaml --force" in out
    ), out
    code, out, err = run_cli(capsys, "eval", "--pipeline=raw.yaml", "--model_dir=runs/none")
    assert code == 2, out + err
    assert err.splitlines() == [
        "od-dist: pipeline 'raw.yaml': task.validation_data.input_path: 'annotations/test.record': its "
        "records hold file names as image/source_id ('IMG_2000.jpg' in annotations/test.record), the "
        "Object Detection API's layout, and COCO evaluation needs numbers; rewrite them once with "
        '\'od-dist data odapi --train "annotations/train.record" --val "annotations/test.record" --out '
        "DIR' and point the pipeline's input paths at DIR"
    ], err
    code, out, err = run_cli(capsys, "data", "odapi", "--config=pipeline.config", "--out=data/records")
    assert code == 0, err
    code, out, err = run_cli(
        capsys, "pipeline", "import", "--config=pipeline.config", "--data=data/records", "--out=my.yaml"
    )
    assert code == 0, err
    assert "not carried over: train_config.fine_tune_checkpoint" in out
    code, out, err = run_cli(capsys, "data", "check", "--pipeline=my.yaml")
    assert code == 0, out + err
    assert "train: 1 file(s)" in out and "12 images" in out and "6 images" in out
    code, out, err = run_cli(capsys, "train", "--pipeline=my.yaml", "--model_dir=runs/m")
    assert code == 0, out[-3000:] + err[-3000:]
    assert glob.glob(str(folder / "runs" / "m" / "ckpt-4*"))
    code, out, err = run_cli(capsys, "eval", "--pipeline=my.yaml", "--model_dir=runs/m")
    assert code == 0, out[-3000:] + err[-3000:]
    line = [ln for ln in (out + err).splitlines() if "AP50" in ln]
    assert line and "step 4" in line[0], out[-3000:] + err[-3000:]


def small_zoo(tmp_path, capsys, name, *edits):
    """The Zoo's config on the shapes data's 3 classes, 128x128 images, one image and one step,
    imported into NAME.yaml in tmp_path."""
    text = zoo(name)
    for old, new in [
        ("num_classes: 90", "num_classes: 3"),
        ("dimension: 512", "dimension: 128"),
        ("batch_size: 128", "batch_size: 1"),
        (re.search(r"num_steps: \d+", text).group(), "num_steps: 1"),
        *edits,
    ]:
        text = text.replace(old, new)
    (tmp_path / f"{name}.config").write_text(text)
    code, _, err = run_cli(capsys, "pipeline", "import", f"--config={name}.config", f"--out={name}.yaml")
    assert code == 0, err
    return f"{name}.yaml"


@pytest.mark.slow
def test_zoo_families_train_and_evaluate(data_dir, tmp_path, capsys, monkeypatch):
    """Imported from the Zoo's configs, in this one process: EfficientDet D0 (with the SSD family's
    ssd_random_crop) trains a step;
    CenterNet (Hourglass-10 for the config's Hourglass-104: the same mapping at a tenth of the cost)
    trains a step, `eval` prints its COCO line, and its export draws detections with `predict` on an
    image of another size; CenterNet ResNet-50 V2's model builds."""
    from od_dist.model.pipeline import check_model, load_pipeline

    monkeypatch.chdir(tmp_path)
    inputs = (
        "--params_override="
        f"task.train_data.input_path={data_dir}/train.tfrecord,"
        f"task.validation_data.input_path={data_dir}/val.tfrecord"
    )
    efficientdet = small_zoo(
        tmp_path,
        capsys,
        EFFICIENTDET_D0,
        ("total_steps: 300000", "total_steps: 1"),
        ("warmup_steps: 2500", "warmup_steps: 0"),
        # The SSD family's IoU-constrained crop, which Model Garden's augmenter runs through AutoGraph.
        (
            "data_augmentation_options {\n    random_horizontal_flip",
            "data_augmentation_options {\n    ssd_random_crop {\n    }\n  }\n"
            "  data_augmentation_options {\n    random_horizontal_flip",
        ),
    )
    assert load_pipeline(efficientdet).task.train_data.parser.aug_type.type == "ssd_random_crop"
    centernet = small_zoo(tmp_path, capsys, CENTERNET_HG104, ("hourglass_104", "hourglass_10"))
    for pipeline in (efficientdet, centernet):
        code, out, err = run_cli(
            capsys, "train", f"--pipeline={pipeline}", f"--model_dir=runs/{pipeline}", inputs
        )
        assert code == 0, out[-3000:] + err[-3000:]
        assert glob.glob(f"runs/{pipeline}/ckpt-1.index"), os.listdir(f"runs/{pipeline}")
    # RetinaNet's evaluation and export are tested with the demo's; CenterNet's are the project's.
    code, out, err = run_cli(
        capsys, "eval", f"--pipeline={centernet}", f"--model_dir=runs/{centernet}", inputs
    )
    line = [ln for ln in (out + err).splitlines() if "AP50" in ln]
    assert code == 0 and line and "step 1" in line[0], out[-3000:] + err[-3000:]
    code, out, err = run_cli(
        capsys,
        "export",
        f"--pipeline={centernet}",
        f"--model_dir=runs/{centernet}",
        inputs,
        "--out=exported",
        "--min_score=0",
    )
    assert code == 0, out[-3000:] + err[-3000:]
    image, _, _, _ = shapes.make_image(np.random.default_rng(7), 96)
    from PIL import Image

    Image.fromarray(image[:80]).save("shapes.png")  # 80x96: resized inside, boxes mapped back
    code, out, err = run_cli(capsys, "predict", "--model=exported", "--images=shapes.png", "--out=drawn")
    assert code == 0, out[-3000:] + err[-3000:]
    with open("drawn/detections.json", encoding="utf-8") as f:
        (result,) = json.load(f)
    assert (result["width"], result["height"]) == (96, 80) and result["detections"], result
    for det in result["detections"]:
        x0, y0, x1, y1 = det["box"]
        assert 0 <= x0 <= x1 <= 96 and 0 <= y0 <= y1 <= 80 and 1 <= det["class_id"] <= 3, det
        assert det["class"] in shapes.CLASSES
    resnet = small_zoo(tmp_path, capsys, CENTERNET_RESNET50_V2)
    check_model(load_pipeline(resnet), resnet)  # its head on the dilated ResNet's level 3


def test_textproto_octal_escapes_spell_utf8():
    # protoc writes non-ASCII bytes of a name as octal escapes: 'caf\303\251' is 'café'.
    doc = textproto.parse("item { name: 'caf\\303\\251' id: 1 }")
    assert doc.message("item").get("name") == "café"


def test_label_maps_are_read_by_the_one_text_format_reader(tmp_path):
    path = tmp_path / "label_map.pbtxt"
    path.write_text(
        "item {\n  id: 2\n  name: 'a \\'b\\''  # quoted\n  keypoints { id: 0 }\n}\nitem { id: 1 name: \"c\" }\n"
    )
    assert records.read_labels(str(path)) == {2: "a 'b'", 1: "c"}
    path.write_text("item { id: 1 name: 'open }\n")
    with pytest.raises(errors.DatasetError, match=r"line 1, column \d+"):
        records.read_labels(str(path))
