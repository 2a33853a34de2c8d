"""od_dist/patches.py: a library whose private attribute a patch needs is gone (as after an upgrade)
ends a real `od-dist train` at its start, in one line naming the patch and the installed version."""

import glob
import os

import pytest
from loopback import PIPELINE, ROOT, od_dist, site_hook, tiny

# Injected into the real `od-dist train` process: Orbit as if a release had renamed the method the
# training loop's hook overrides.
WITHOUT_TRAIN_N_STEPS = """
import orbit

del orbit.Controller._train_n_steps
"""


@pytest.mark.slow
def test_a_missing_private_attribute_ends_the_task_at_its_start_in_one_line(data_dir, tmp_path):
    from importlib.metadata import version

    model_dir = tmp_path / "run"
    env = {"PYTHONPATH": site_hook(tmp_path, WITHOUT_TRAIN_N_STEPS) + os.pathsep + ROOT}
    r = od_dist("train", f"--pipeline={PIPELINE}", f"--model_dir={model_dir}", tiny(data_dir), env=env)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("od-dist: ")]
    assert line.startswith("od-dist: patch 'orbit-train-loop' needs orbit.Controller._train_n_steps, "), line
    assert (
        f"missing in tf-models-official {version('tf-models-official')} (written against 2.20.0)" in line
    ), line
    assert line.endswith("exit 2"), line
    # Before training: no step, no checkpoint.
    assert "od-dist train | step" not in r.stdout, r.stdout[-2000:]
    assert not glob.glob(str(model_dir / "ckpt-*")), os.listdir(model_dir)
