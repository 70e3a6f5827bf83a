"""GRPO of Qwen-Image through mm-grpo's own trainer (mm_grpo.training.train_grpo), on the tiny Qwen-Image
pipeline (mm_grpo/families/qwen_image/tiny.py): true CFG in the rollout and in the trained steps, the PPO
ratio exactly 1 on the first micro-batch, LoRA with an EMA old policy resumed bit for bit, and the
refusals of flags that are another family's."""
import json
import math
import os

import pytest
import torch

from mm_grpo.recompute import EVERY_BLOCK_FLAGS
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.grpo_helpers import grpo_argv, run_grpo, write_configs
from tests.utils import assert_one_line_error

QWEN_IMAGE = "mmgrpo_qwenimage"


@pytest.fixture(scope="module")
def configs(tiny_qwen_image_pipeline_dir, tmp_path_factory):
    model, data = write_configs(tmp_path_factory.mktemp("qwen_image_cfg"), tiny_qwen_image_pipeline_dir)
    with open(model) as f:
        cfg = json.load(f)
    cfg["predictor"] = {"model_id": QWEN_IMAGE,
                        "from_pretrained": os.path.join(str(tiny_qwen_image_pipeline_dir), "transformer")}
    cfg["text_encoder"]["max_sequence_length"] = 64
    with open(model, "w") as f:
        json.dump(cfg, f)
    return model, data


def _weights(run):
    return {n: p.detach().clone() for n, p in run.model.modules[0].named_parameters()}


@pytest.mark.parametrize("true_cfg", ["4.0", "1"])
def test_first_micro_batch_ratio_is_exactly_one_with_and_without_true_cfg(parallel_1proc, configs, true_cfg):
    history, run = run_grpo(grpo_argv(*configs, iters=1, extra=["--updates-per-rollout", "2",
                                                                 "--true-cfg-scale", true_cfg]))
    stats = history[0]
    assert run.schedule.denoiser.guided == (true_cfg != "1")
    assert stats["ratio_first_mb_min"] == 1.0 == stats["ratio_first_mb_max"]
    assert stats["ratio_max"] > 1.0 or stats["ratio_min"] < 1.0  # the second update sees the moved policy
    assert all(math.isfinite(stats[k]) for k in ("reward/mean", "loss", "grad_norm"))


def test_rollout_takes_the_pipelines_sigmas(parallel_1proc, configs):
    from mm_grpo.families.qwen_image.sigmas import load_scheduler_config, sigma_schedule
    _, run = run_grpo(grpo_argv(*configs, iters=0))
    pipeline = os.path.dirname(run.predictor["from_pretrained"])
    expected = sigma_schedule(6, 4, load_scheduler_config(pipeline))  # 32 x 32 px: 2 x 2 tokens
    assert torch.equal(run.schedule.sigmas, expected)


def test_lora_with_an_ema_old_policy_resumes_exactly(parallel_1proc, configs, tmp_path):
    extra = ["--lora-target-modules", "linear_qkv", "linear_proj", "--lora-r", "4", "--policy-loss", "nft",
             "--sampler", "ode", "--ema-decay", "0.5", "--ema-decay-ramp", "0.1", "--kl-beta", "0.1"]
    full, run_full = run_grpo(grpo_argv(*configs, iters=2, extra=extra))
    assert run_full.model.lora is not None
    trained = {n for n, p in run_full.model.modules[0].named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained)
    first, _ = run_grpo(grpo_argv(*configs, iters=1, extra=extra + ["--save", str(tmp_path / "ckpt")]))
    second, run_resumed = run_grpo(grpo_argv(*configs, iters=2, extra=extra + ["--load", str(tmp_path / "ckpt")]))
    assert [h["loss"] for h in first + second] == [h["loss"] for h in full]
    assert [h["reward/mean"] for h in first + second] == [h["reward/mean"] for h in full]
    a, b = _weights(run_full), _weights(run_resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)
    ema_a = {n: p for n, p in run_full.ema.modules[0].named_parameters()}
    ema_b = {n: p for n, p in run_resumed.ema.modules[0].named_parameters()}
    assert all(torch.equal(ema_a[n], ema_b[n]) for n in ema_a)


def test_full_fine_tuning_resumes_exactly(parallel_1proc, configs, tmp_path):
    full, run_full = run_grpo(grpo_argv(*configs, iters=2, extra=EVERY_BLOCK_FLAGS))
    first, _ = run_grpo(grpo_argv(*configs, iters=1, extra=[*EVERY_BLOCK_FLAGS, "--save", str(tmp_path / "c")]))
    second, run_resumed = run_grpo(grpo_argv(*configs, iters=2, extra=[*EVERY_BLOCK_FLAGS,
                                                                         "--load", str(tmp_path / "c")]))
    assert [h["loss"] for h in first + second] == [h["loss"] for h in full]
    a, b = _weights(run_full), _weights(run_resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("flags, match", [
    (["--guidance-scale", "2"], r"^--guidance-scale: the guidance of another model family; model.json's predictor "
                                r"is 'mmgrpo_qwenimage', whose guidance flags are --true-cfg-scale, --negative-prompt$"),
    (["--compile-blocks"], r"^--compile-blocks compiles FLUX's blocks"),
    (["--sigma-shift", "2"], r"^--sigma-shift 2.0: Qwen-Image's rollout takes QwenImagePipeline's schedule"),
    (["--lora-target-modules", "linear_in"], r"unknown --lora-target-modules \['linear_in'\]"),
])
def test_flags_of_another_family_are_refused_in_one_line(parallel_1proc, configs, flags, match):
    assert_one_line_error(lambda: run_grpo(grpo_argv(*configs, iters=0, extra=flags)), match)


def test_true_cfg_flags_are_refused_for_flux(parallel_1proc, tiny_pipeline_dir, tmp_path):
    flux = write_configs(tmp_path, tiny_pipeline_dir)
    assert_one_line_error(lambda: run_grpo(grpo_argv(*flux, iters=0, extra=["--true-cfg-scale", "3"])),
                          r"^--true-cfg-scale: the guidance of another model family; model.json's predictor is 'flux'")


def test_prompts_of_one_length_have_no_mask(parallel_1proc, configs, tmp_path):
    """The pipeline's mask is None when no prompt of a batch is padded: the run trains all the same."""
    same = write_configs(tmp_path, os.path.dirname(os.path.dirname(json_model(configs)["predictor"]["from_pretrained"])),
                         prompts=["a red circle", "a blue circle"])
    model = json_model(configs)
    with open(same[0], "w") as f:
        json.dump(model, f)
    history, run = run_grpo(grpo_argv(*same, iters=1, extra=["--true-cfg-scale", "1"]))
    assert run.schedule.conditioning(["a red circle", "a blue circle"])["encoder_hidden_states_mask"] is None
    assert history[0]["ratio_first_mb_min"] == 1.0 == history[0]["ratio_first_mb_max"]


def json_model(configs):
    with open(configs[0]) as f:
        return json.load(f)


def test_the_shipped_script_trains_the_cpu_demo(tmp_path):
    """examples/qwen_image/grpo_qwen_image.sh as shipped, with no PIPELINE_DIR on a CPU: the demo of the
    shipped tiny shapes Qwen-Image, only its sizes through its variables (one process, one iteration of one
    prompt's 16 generations, one held-out prompt x its 64 noises). It trains, evaluates, saves and draws."""
    import re
    import subprocess
    import sys
    from tests.ports import free_port
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "qwen_image",
                          "grpo_qwen_image.sh")
    env = dict(os.environ, MM_GRPO_DEVICE="cpu", MM_GRPO_PYTHON=sys.executable, RUN_DIR=str(tmp_path),
               NPUS_PER_NODE="1", ITERS="1", PROMPTS="1", MBS="16", EVAL_PROMPTS="1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "[mm-grpo] 1 iterations in" in log
    assert re.search(r"held-out evaluation \(64 samples, ODE, fixed noise\), iteration 0 -> 1", log), log[-3000:]
    assert (tmp_path / "ckpt" / "iter_0000001").is_dir()
    assert all((tmp_path / f).is_file() for f in ("train.log", "reward_curve.png", "before_after.png"))
