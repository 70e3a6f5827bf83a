"""bench/full_size.sh MODEL=qwen-image-tiny on CPU: both of bench/full_size_qwen_image.py's steps end to
end, through the script's dispatch. The anchors: diffusers' QwenImageTransformer2DModel beside
mm-grpo's QwenImageTransformer on the same weights, eager and compiled (dynamo's capture alone here,
fullgraph included; the accelerator run compiles with inductor); the GRPO iteration: the trainer's
functions with LoRA and true CFG, on policy on its first micro-batch."""
import json
import math
import os
import statistics
import subprocess
import sys

import pytest

from bench import full_size_qwen_image as bench

FP32_VELOCITY_TOLERANCE = 1e-4  # two fp32 implementations of the same weights agree to rounding


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("full_size_qwen_image")
    env = dict(os.environ, MODEL="qwen-image-tiny", OUT_DIR=str(out), COMPILE_BACKEND="eager", ANCHOR_CALLS="3",
               OMP_NUM_THREADS="1", PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    subprocess.run(["bash", "bench/full_size.sh"], check=True, env=env, capture_output=True, timeout=300)
    return out


def test_anchors_time_every_row_on_the_same_weights(out_dir):
    result = json.loads((out_dir / "anchors.json").read_text())
    assert result["errors"] == {} and result["dtype"] == "fp32"
    assert set(result["seconds"]) == set(bench.ROWS)
    for row, columns in result["seconds"].items():
        assert set(columns) == set(bench.COLUMNS)
        for column, seconds in columns.items():
            timed = result["calls_s"][row][column]["timed"]
            assert len(timed) == 3 and seconds == statistics.median(timed) > 0
    assert set(result["ratios"]) == set(bench.RATIOS)
    for key, (a, b) in bench.RATIOS.items():
        for column in bench.COLUMNS:
            ratio = result["ratios"][key][column]
            assert math.isfinite(ratio) and ratio == pytest.approx(
                result["seconds"][a][column] / result["seconds"][b][column], rel=1e-12)
    assert all(how["fullgraph"] for how in result["compile"].values())
    velocity = result["velocity"]
    assert velocity["mm_grpo_vs_diffusers_fp32"]["finite"]
    assert velocity["mm_grpo_vs_diffusers_fp32"]["rel_l2"] <= FP32_VELOCITY_TOLERANCE
    assert velocity["mm_grpo_lora_vs_fp32"]["rel_l2"] == 0  # LoRA's B starts at zero
    assert 0 < result["trainable_parameters"] < result["parameters"]


def test_grpo_iteration_is_on_policy_on_its_first_micro_batch(out_dir):
    result = json.loads((out_dir / "grpo.json").read_text())
    assert len(result["iterations"]) == 2  # the warm-up, then the timed one
    for stats in result["iterations"]:
        assert stats["ratio_first_mb_min"] == stats["ratio_first_mb_max"] == 1.0
        assert all(math.isfinite(stats[k]) for k in ("reward/mean", "loss", "grad_norm"))
    timed = result["timed"]
    assert timed["all_finite"]
    assert all(math.isfinite(timed[k]) and timed[k] > 0 for k in ("iteration", "rollout", "decode_reward", "train"))
    assert result["true_cfg_scale"] > 1 and result["lora_rank"] == 4 and result["num_generations"] == 4
    assert 0 < result["trainable_parameters"] < result["parameters"]
    assert result["plan"]["fits"] and result["plan"]["peak_bytes_per_rank"] > 0
    assert result["unmeasured"]  # no accelerator: its peak memory named as not measured
