"""examples/qwen_image/build_tiny_shapes.sh as shipped, at toy sizes through the variables it reads: every
stage runs (data, VAE, init pipeline, 2-process flow-matching pretraining, export) and the folder it leaves
is a diffusers Qwen-Image pipeline that samples."""
import os
import subprocess

import pytest
import torch

from tests.test_build_tiny_shapes import STAGES, TOY
from tests.test_launch_env import REPO
from tests.testbed import has_megatron_training

# The recipe chains entry points that run in both environments' suites; the chain itself, once.
pytestmark = pytest.mark.skipif(has_megatron_training(), reason="the recipe runs once, in the default environment")


def test_the_recipe_builds_a_pipeline_diffusers_samples(tmp_path):
    from diffusers import QwenImagePipeline
    out, work = tmp_path / "tiny_shapes", tmp_path / "work"
    env = dict(os.environ, OUT=str(out), WORK=str(work), MM_GRPO_DEVICE="cpu", **TOY)
    proc = subprocess.run(["bash", "examples/qwen_image/build_tiny_shapes.sh"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stages = [line.split()[0] for line in (work / "times.txt").read_text().splitlines()]  # "data 21 s"
    assert stages == [*STAGES, "total"], stages
    assert not (tmp_path / "tiny_shapes.old").exists()
    pipe = QwenImagePipeline.from_pretrained(out, torch_dtype=torch.float32)
    images = pipe(["a red circle"], height=64, width=64, num_inference_steps=2, true_cfg_scale=1.0,
                  output_type="pt", generator=torch.Generator().manual_seed(0)).images
    assert images.shape == (1, 3, 64, 64) and torch.isfinite(images).all()
