"""The recipes of docs/migration_dancegrpo.md (flow_grpo's FLUX and SD3 GRPO, GRPO-Guard, DiffusionNFT
mapped to mm-grpo's flags), read from the doc itself so that the two cannot drift apart: their numbers
against the source configs' fields, and two iterations of each through the trainer on the tiny
pipeline (single process, CPU, fp32) with only the sizes the tiny model cannot run replaced."""
import dataclasses
import math
import os
import re
import shlex

import pytest
import torch

from mm_grpo.grpo.hyperparameters import GRPOSettings
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.grpo_helpers import SMOOTH_REWARD, run_grpo, write_configs

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "migration_dancegrpo.md")
RECIPE = re.compile(r"^#### Recipe `(\w+)`\n+```bash\n(.*?)^```", re.M | re.S)
LAUNCHER = "examples/flux/grpo_flux.sh"
ROUNDING = 5e-3  # the doc writes derived values (shift, KL weight, EMA decay and ramp) to 2-4 digits

# The sizes the tiny pipeline cannot run, replaced; everything else runs as the doc gives it.
TINY_SIZES = {
    "--prompts-per-iteration": "1",  # 48 prompts per iteration: one here
    "--num-generations": "4",  # 24 per prompt
    "--micro-batch-size": "2",  # 3 or 9 do not divide an update's 4 / --updates-per-rollout samples
    "--height": "32", "--width": "32",  # 512 x 512 (1024 latent tokens): the tiny VAE's 32 x 32
    "--num-inference-steps": "4",  # 6 or 10: each step is a forward of every sample, on a shared CPU
}
# bf16 on a CPU: refused with TP > 1 (megatron-core's linear backward re-enters CUDA autocast), and at TP 1
# slower than fp32 here; bf16 training on one TP rank is tested in tests/test_lora_training.py.
ACCELERATOR_ONLY = {"--bf16"}
ITERATIONS = 2  # the recipes name no --train-iters: the sources train until stopped by hand


def read_recipes() -> dict:
    """name -> (launch environment, the trainer flags after grpo_flux.sh) of every recipe in the doc."""
    with open(DOC) as f:
        text = f.read()
    recipes = {}
    for name, body in RECIPE.findall(text):
        tokens = shlex.split(body.replace("\\\n", " "))
        at = tokens.index(LAUNCHER)
        env = dict(t.split("=", 1) for t in tokens[:at] if "=" in t)
        recipes[name] = env, tokens[at + 1:]
    return recipes


def flag_values(tokens) -> dict:
    """--flag -> its values ([] for a switch), in order; a repeated flag is a recipe error."""
    flags, current = {}, None
    for token in tokens:
        if token.startswith("--"):
            assert token not in flags, f"{token} given twice"
            current = flags[token] = []
        else:
            assert current is not None, f"{token!r} before any flag"
            current.append(token)
    return flags


# --- the sources (fields as the doc's tables cite them) and the doc's rules ----------------------
def flow_grpo_batches(gpus, batch, group):
    """flow_grpo's configs: num_batches_per_epoch for 48 prompts per epoch, 2 optimizer steps per epoch."""
    per_epoch = int(48 / (gpus * batch / group))
    return per_epoch, per_epoch // 2


def nft_batches(gpus, group, steps_per_epoch):
    """DiffusionNFT's _get_config: the per-GPU batch searched down from 9 for 48 groups per epoch."""
    for batch in range(9, 0, -1):
        if 48 * group % (gpus * batch) == 0 and batch * gpus % group == 0:
            per_epoch = 48 * group // (gpus * batch)
            if per_epoch % steps_per_epoch == 0:
                return batch, per_epoch, per_epoch // steps_per_epoch
    raise AssertionError("no batch size")


def flux_dynamic_shift(resolution):
    """FluxPipeline at this resolution: e^mu, mu from FLUX.1-dev's scheduler config (calculate_shift)."""
    tokens = (resolution // 16) ** 2
    slope = (1.15 - 0.5) / (4096 - 256)
    return math.exp(tokens * slope + 0.5 - slope * 256)


def mean_trained_dt(steps, shift, trained):
    """Mean |dt| of the first `trained` steps of mm-grpo's grid, linspace(1, 0, N + 1) shifted."""
    u = 1 - trained / steps
    return (1 - shift * u / (1 + (shift - 1) * u)) / trained


def flow_grpo_ema(batches_per_epoch, updates, ceiling=0.9, interval=8):
    """flow_grpo's EMAModuleWrapper(decay=ceiling, update_step_interval=interval) as one decay per
    iteration: applied batches / interval times per epoch on average, and its min((1 + s) / (10 + s),
    ceiling) reaches the ceiling after s = (10 ceiling - 1) / (1 - ceiling) optimizer steps."""
    decay = ceiling ** (batches_per_epoch / interval)
    iterations_to_ceiling = (10 * ceiling - 1) / (1 - ceiling) / updates
    return decay, decay / iterations_to_ceiling


def flow_grpo_expected(gpus, batch, group, steps, shift, noise_level, clip_range, beta, global_std, lr,
                       lora_r, lora_alpha, eval_freq, save_freq, guard=False, guidance=None):
    batches, accumulation = flow_grpo_batches(gpus, batch, group)
    updates = batches // accumulation
    decay, ramp = flow_grpo_ema(batches, updates)
    # flow_grpo's KL is |dt| x the Gaussian KL mm-grpo weighs: the mean |dt| of the trained steps
    kl = beta * mean_trained_dt(steps, shift, int(steps * 0.99)) if beta else 0.0
    expected = {
        "--sampler": "flow_sde", "--noise-level": noise_level, "--num-inference-steps": steps, "--sigma-shift": shift,
        "--num-generations": group, "--prompts-per-iteration": batch * gpus * batches // group,
        "--micro-batch-size": batch,
        "--updates-per-rollout": updates, "--timestep-selection": "ordered", "--timestep-fraction": 0.99,
        "--policy-loss": "ppo", "--clip-range": clip_range, "--adv-clip-max": 5, "--global-std": global_std,
        "--init-same-noise": False, "--kl-beta": kl, "--ratio-norm": guard, "--step-reweight": guard,
        "--lr": lr, "--weight-decay": 1e-4, "--clip-grad": 1.0, "--adam-beta1": 0.9, "--adam-beta2": 0.999,
        "--adam-eps": 1e-8, "--lora-r": lora_r, "--lora-alpha": lora_alpha, "--ema-decay": decay,
        "--ema-decay-ramp": ramp, "--height": 512, "--width": 512, "--seed": 42,
        "--eval-interval": eval_freq, "--save-interval": save_freq}
    if guidance is not None:
        expected["--guidance-scale"] = guidance
    return expected, gpus


def nft_expected():
    gpus, group, steps_per_epoch = 8, 24, 1  # sd3_pickscore: _get_config(n_gpus=8, gradient_step_per_epoch=1)
    batch, batches, accumulation = nft_batches(gpus, group, steps_per_epoch)
    expected = {
        "--sampler": "ode", "--num-inference-steps": 10, "--sigma-shift": 3.0, "--num-generations": group,
        "--prompts-per-iteration": batch * gpus * batches // group, "--micro-batch-size": batch,
        "--updates-per-rollout": batches // accumulation, "--timestep-selection": "ordered",
        "--timestep-fraction": 0.99, "--policy-loss": "nft", "--nft-beta": 1.0, "--adv-clip-max": 5,
        "--global-std": True, "--init-same-noise": False, "--kl-beta": 1e-4,
        # decay_type 1: min(0.001 x optimizer steps, 0.5), one optimizer step per iteration here
        "--ema-decay": 0.5, "--ema-decay-ramp": 0.001 * steps_per_epoch,
        "--lr": 3e-4, "--weight-decay": 1e-4, "--clip-grad": 1.0, "--adam-beta1": 0.9, "--adam-beta2": 0.999,
        "--adam-eps": 1e-8, "--lora-r": 32, "--lora-alpha": 64, "--height": 512, "--width": 512, "--seed": 42,
        "--eval-interval": 10, "--save-interval": 30}
    return expected, gpus


# The sources' LoraConfig target_modules (PEFT matches a module whose name ends with one of them).
FLOW_GRPO_FLUX_LORA = ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
                       "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                       "ff_context.net.2")
SD3_LORA = ("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k", "attn.to_out.0",
            "attn.to_q", "attn.to_v")  # flow_grpo's train_sd3.py, GRPO-Guard's and DiffusionNFT's
SOURCE_LORA = {"flow_grpo_pickscore_flux": FLOW_GRPO_FLUX_LORA, "flow_grpo_pickscore_sd3": SD3_LORA,
               "grpo_guard_ocr_sd3": SD3_LORA, "diffusionnft_pickscore_sd3": SD3_LORA}
# What mm-grpo's fused single-block input adapts besides q, k, v (docs: the shared LoRA rule).
LORA_EXTRA = re.compile(r"single_transformer_blocks\.\d+\.proj_mlp")

SOURCES = {  # recipe -> (mm-grpo flags the source's fields give, the source's GPUs)
    "flow_grpo_pickscore_flux": flow_grpo_expected(
        gpus=32, batch=3, group=24, steps=6, shift=flux_dynamic_shift(512), noise_level=0.9, clip_range=1e-4,
        beta=0.0, global_std=True, lr=3e-4, lora_r=64, lora_alpha=128, eval_freq=30, save_freq=30, guidance=3.5),
    "flow_grpo_pickscore_sd3": flow_grpo_expected(
        gpus=32, batch=9, group=24, steps=10, shift=3.0, noise_level=0.7, clip_range=1e-4, beta=0.01,
        global_std=True, lr=3e-4, lora_r=32, lora_alpha=64, eval_freq=60, save_freq=60),
    "grpo_guard_ocr_sd3": flow_grpo_expected(
        gpus=16, batch=9, group=24, steps=10, shift=3.0, noise_level=0.7, clip_range=2e-6, beta=0.0,
        global_std=False, lr=1e-4, lora_r=32, lora_alpha=64, eval_freq=30, save_freq=30, guard=True),
    "diffusionnft_pickscore_sd3": nft_expected(),
}
RECIPES = read_recipes()


def test_the_doc_holds_a_recipe_per_source():
    assert sorted(RECIPES) == sorted(SOURCES)


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_recipe_numbers_follow_from_the_source_config(name):
    env, tokens = RECIPES[name]
    flags = flag_values(tokens)
    expected, gpus = SOURCES[name]
    assert int(env["NNODES"]) * int(env["NPUS_PER_NODE"]) == gpus
    for flag, want in expected.items():
        if isinstance(want, bool):
            assert (flag in flags) == want and flags.get(flag, []) == [], flag
        elif isinstance(want, str):
            assert flags[flag] == [want], flag
        else:
            assert len(flags[flag]) == 1 and math.isclose(float(flags[flag][0]), want, rel_tol=ROUNDING, abs_tol=0), \
                f"{flag} {flags[flag]} != {want}"


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_recipe_lora_adapts_the_modules_the_source_adapts(name):
    """PEFT's suffix match of the source's targets on diffusers' FLUX against the diffusers modules the
    recipe's --lora-target-modules adapt (their names in an exported LoRA file)."""
    from diffusers import FluxTransformer2DModel
    from mm_grpo.families.flux.transformer import FluxConfig
    from mm_grpo.families.flux.transformer.lora import base_rules
    config = FluxConfig.preset("tiny")
    linears = [n for n, m in FluxTransformer2DModel(**config.to_diffusers_config()).named_modules()
               if isinstance(m, torch.nn.Linear)]
    source = {n for n in linears if any(n == t or n.endswith("." + t) for t in SOURCE_LORA[name])}
    targets = flag_values(RECIPES[name][1])["--lora-target-modules"]
    recipe = {w[:-len(".weight")] for rule in base_rules(config, targets) for w in rule.hf}
    assert source <= recipe, sorted(source - recipe)[:3]
    extra = recipe - source
    assert extra and all(LORA_EXTRA.fullmatch(n) for n in extra), sorted(extra)[:3]


@pytest.fixture(scope="module")
def configs(tiny_pipeline_dir, tmp_path_factory):
    return write_configs(tmp_path_factory.mktemp("recipes_cfg"), tiny_pipeline_dir, reward=SMOOTH_REWARD)


def tiny_argv(model_json, data_json, tokens):
    """The recipe's flags with TINY_SIZES in place of its sizes and without ACCELERATOR_ONLY."""
    flags = flag_values(tokens)
    kept = {f: v for f, v in flags.items() if f not in TINY_SIZES and f not in ACCELERATOR_ONLY}
    argv = ["--mm-model", model_json, "--mm-data", data_json, "--train-iters", str(ITERATIONS),
            "--no-progress-bar", "--log-interval", "1000"]
    for flag, values in (*kept.items(), *((f, [v]) for f, v in TINY_SIZES.items())):
        argv += [flag, *values]
    return argv, kept


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_recipe_trains_on_the_tiny_pipeline(parallel_1proc, configs, name):
    _, tokens = RECIPES[name]
    argv, kept = tiny_argv(*configs, tokens)
    history, run = run_grpo(argv)
    assert len(history) == ITERATIONS
    for stats in history:
        assert stats["skipped"] == 0.0 and math.isfinite(stats["loss"]), stats
        assert math.isfinite(stats["grad_norm"]) and stats["grad_norm"] > 0, stats

    # the run holds the recipe's settings
    s = run.schedule.s
    fields = {f.name for f in dataclasses.fields(GRPOSettings)}
    for flag, values in kept.items():
        field = flag[2:].replace("-", "_")
        if field in fields:
            held = getattr(s, field)
            assert held == (True if not values else type(held)(values[0])), flag
    for flag, field in (("--init-same-noise", "init_same_noise"), ("--global-std", "global_std"),
                        ("--ratio-norm", "ratio_norm"), ("--step-reweight", "step_reweight")):
        assert getattr(s, field) == (flag in kept), flag
    steps, fraction = int(TINY_SIZES["--num-inference-steps"]), float(kept["--timestep-fraction"][0])
    assert s.trained_steps_per_sample == int(steps * fraction)  # the sources' num_train_timesteps
    for group in run.model.optimizer.param_groups:
        assert group["lr"] == float(kept["--lr"][0])
    assert {g["weight_decay"] for g in run.model.optimizer.param_groups} == {float(kept["--weight-decay"][0])}
    lora = run.model.lora["config"]
    assert (lora["r"], lora["alpha"], lora["targets"]) == (
        int(kept["--lora-r"][0]), float(kept["--lora-alpha"][0]), kept["--lora-target-modules"])
    assert (run.ema.decay, run.ema.ramp) == (float(kept["--ema-decay"][0]), float(kept["--ema-decay-ramp"][0]))
    # DiffusionNFT samples with its old policy, the EMA; PPO's rollouts are the policy's own
    sampler_is_ema = run.schedule.sampling_policy == run.ema.modules
    assert sampler_is_ema == (s.policy_loss == "nft")
