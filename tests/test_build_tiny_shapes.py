"""examples/flux/build_tiny_shapes.sh as shipped, at toy sizes through the variables it reads: every
stage runs (data, VAE, init pipeline, 2-process pretraining, export) and the folder it leaves is a
diffusers FLUX pipeline that samples. The shipped sizes take 11.6 min on 2 cores (README)."""
import os
import subprocess

import pytest
import torch

from mm_grpo.families.flux.text import load_tokenizers
from tests.test_launch_env import REPO
from tests.testbed import has_megatron_training

# The recipe chains entry points that run in both environments' suites; the chain itself, once.
pytestmark = pytest.mark.skipif(has_megatron_training(), reason="the recipe runs once, in the default environment")

STAGES = ("data", "vae", "init", "pretrain", "export")
TOY = {"NUM_IMAGES": "264", "VAE_STEPS": "2", "ITERS": "2", "GBS": "4", "WARMUP": "0", "SAVE_INTERVAL": "2",
       "EVAL_INTERVAL": "2"}  # 264 images: the VAE's 256 held-out ones and 8 to train on


def test_the_recipe_builds_a_pipeline_diffusers_samples(tmp_path):
    from diffusers import FluxPipeline
    out, work = tmp_path / "tiny_shapes", tmp_path / "work"
    env = dict(os.environ, OUT=str(out), WORK=str(work), MM_GRPO_DEVICE="cpu", **TOY)
    proc = subprocess.run(["bash", "examples/flux/build_tiny_shapes.sh"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stages = [line.split()[0] for line in (work / "times.txt").read_text().splitlines()]  # "data 21 s"
    assert stages == [*STAGES, "total"], stages
    assert not (tmp_path / "tiny_shapes.old").exists()
    pipe = FluxPipeline.from_pretrained(out, torch_dtype=torch.float32, tokenizer=None, tokenizer_2=None)
    pipe.register_modules(**load_tokenizers(out))
    images = pipe(["a red circle"], height=64, width=64, num_inference_steps=2, max_sequence_length=16,
                  output_type="pt", generator=torch.Generator().manual_seed(0)).images
    assert images.shape == (1, 3, 64, 64) and torch.isfinite(images).all()
