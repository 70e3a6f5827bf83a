"""GRPO under TP2 / SP2 / PP2 / DP2 equals the single-process run (losses, rewards, weights), with
the PPO loss, with advantage-weighted matching, with Flow-GRPO-Fast branching, with DiffusionNFT (its
EMA old policy too), with PPO + GRPO-Guard, with the cps sampler, with LoRA (also TP2 x PP2, and DP2 with the distributed
optimizer) and at PP2 with each stage's first block recomputed; the distributed optimizer's exact resume; group advantages gathered over two ranks."""
import os

import pytest
import torch

from mm_grpo.grpo import group_advantages
from tests.distributed.checks_grpo import ADVANTAGE_PROMPTS, ADVANTAGE_REWARDS, VARIANTS
from tests.distributed.conftest import check_result
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.grpo_helpers import ADAM_LINEAR, SMOOTH_REWARD, grpo_argv, run_grpo, write_configs
from tests.utils import rel_err

TOL = 1e-5


@pytest.fixture(scope="module")
def single_process(parallel_1proc, tiny_pipeline_dir, tmp_path_factory):
    """single_process(variant) -> (history, weights, adapters) of its single-process run, run once (nft:
    the EMA's weights too; adapters: LoRA's, else None)."""
    from tests.utils import gather_adapter_state, gather_hf_state_dict
    cfg = write_configs(tmp_path_factory.mktemp("grpo1"), tiny_pipeline_dir, reward=SMOOTH_REWARD)
    runs = {}

    def result(variant):
        if variant not in runs:
            history, run = run_grpo(grpo_argv(*cfg, iters=2, extra=ADAM_LINEAR + VARIANTS[variant]))
            weights = gather_hf_state_dict(run.model.chunks)
            if run.ema is not None:
                weights.update({"ema." + n: w for n, w in gather_hf_state_dict(run.ema.modules).items()})
            adapters = gather_adapter_state(run.model.chunks) if run.model.lora else None
            runs[variant] = history, weights, adapters
        return runs[variant]
    return result


# Every variant at TP2, SP2, PP2 and DP2, LoRA at TP2 x PP2, and block recompute per stage at PP2.
CHECKED_LAYOUTS = [("" if variant == "ppo" else variant + "_") + layout for variant in VARIANTS if variant != "recompute"
                   for layout in ("tp2", "sp2", "pp2", "dp2")] + ["lora_tp2pp2", "recompute_pp2"]


@pytest.mark.parametrize("layout", CHECKED_LAYOUTS)
def test_two_grpo_iterations_match_single_process(torchrun, grpo_out_dir, single_process, layout):
    check_result(torchrun(4 if layout.endswith("tp2pp2") else 2), f"grpo_{layout}")
    result = torch.load(os.path.join(grpo_out_dir, f"grpo_{layout}.pt"), weights_only=False)
    variant, _, _ = layout.rpartition("_")
    history, weights, adapters = single_process(variant or "ppo")
    assert len(result["history"]) == len(history) == 2
    for ours, ref in zip(result["history"], history):
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
        assert abs(ours["reward/mean"] - ref["reward/mean"]) <= TOL * max(1.0, abs(ref["reward/mean"]))
        # Relatively, and absolutely where the loss is about 0: PPO with ratio 1 (mean(-A)) and AWM
        # (mean(A * |v - v*|^2)) are near 0; NFT's flow-matching loss and GRPO-Guard's reweighted one are of order 1.
        assert abs(ours["loss"] - ref["loss"]) <= max(1e-6, TOL * abs(ref["loss"]))
        if "ratio_mean" in ref:  # RatioNorm's second update: the normalised ratio has moved
            assert abs(ours["ratio_mean"] - ref["ratio_mean"]) <= TOL
        if "fm_loss" in ref:
            assert abs(ours["fm_loss"] - ref["fm_loss"]) <= TOL * ref["fm_loss"]
    assert set(result["weights"]) == set(weights)
    errs = {n: rel_err(result["weights"][n], w) for n, w in weights.items()}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= TOL, worst
    # The run really trained: a non-zero gradient reached the optimizer in both iterations.
    assert min(h["grad_norm"] for h in history) > 0
    if adapters is not None:  # LoRA: the base stayed as it was (compared above), the adapters trained
        assert set(result["adapters"]) == set(adapters)
        errs = {n: rel_err(result["adapters"][n], a) for n, a in adapters.items()}
        worst = max(errs, key=errs.get)
        assert errs[worst] <= TOL, worst
        assert all(a.abs().max() > 0 for n, a in adapters.items() if n[0].endswith("lora_B.weight"))


def test_distributed_optimizer_resumes_exactly(torchrun):
    m = check_result(torchrun(2), "grpo_distributed_optimizer_resume")
    assert m["start_iteration"] == 2
    assert m["rewards_equal"]
    assert m["max_weight_diff"] == 0.0


def test_checkpoint_resumes_on_another_layout_without_the_optimizer(torchrun):
    m = check_result(torchrun(2), "grpo_resume_on_another_layout")
    assert m["start_iteration"] == 2 and m["max_weight_diff"] == 0.0


def test_advantages_gathered_across_two_ranks(torchrun):
    r0, r1 = check_result(torchrun(2), "advantages_gathered")["ranks"]
    rewards, prompts = torch.tensor(ADVANTAGE_REWARDS), ADVANTAGE_PROMPTS
    assert len(r0["group"]) == 3 and len(r1["group"]) == 5
    torch.testing.assert_close(torch.tensor(r0["group"] + r1["group"]), group_advantages(rewards, prompts))
    torch.testing.assert_close(torch.tensor(r0["global"] + r1["global"]),
                               group_advantages(rewards, prompts, global_std=True))
    assert r0["error"] == r1["error"] == "1 of 8 rewards are non-finite (NaN or inf)"
