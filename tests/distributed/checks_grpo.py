"""Two GRPO iterations under TP2, SP2, PP2 and DP2 (world size 2) on the tiny pipeline, with the
PPO loss, with advantage-weighted matching (ode rollout), with Flow-GRPO-Fast branching, with
DiffusionNFT (ode rollout by an EMA old policy), with PPO + GRPO-Guard and with flow_grpo's cps sampler; at PP2 with each stage's first block recomputed.

Each layout writes its losses, rewards and final weights (diffusers names) to
$MM_GRPO_TEST_OUT; tests/distributed/test_grpo_distributed.py compares them with a
single-process run. Also: group advantages gathered over the two ranks.
"""
import os

import torch
import torch.distributed as dist

from mm_grpo.recompute import Recompute, recompute_flags
from tests.distributed.worker import check
from tests.grpo_helpers import ADAM_LINEAR, LAYOUTS, SMOOTH_REWARD, grpo_argv, run_grpo, write_configs
from tests.utils import gather_adapter_state, gather_hf_state_dict

AWM = ["--policy-loss", "awm", "--sampler", "ode"]
# Seed 3 puts the 3-step window at steps 3-5 of 6 (a shared 3-step ODE prefix, its middle step
# reused) and then at steps 0-2 (no prefix).
BRANCH = ["--timestep-selection", "branch", "--init-same-noise", "--window-size", "3", "--ode-reuse", "2"]
# LoRA on every kind of target linear (adaLN too), the KL term's reference = adapters off.
LORA = ["--lora-target-modules", "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "linear_in", "linear_out",
        "adaln", "--lora-r", "4", "--kl-beta", "0.05"]
LORA_LAYOUTS = {"tp2pp2": LAYOUTS["tp2"] + LAYOUTS["pp2"], "dp2": ["--use-distributed-optimizer"]}
# The EMA's decay is 0.5 from the second iteration on: its rollout comes from an average that
# differs from the trained policy. GRPO-Guard (RatioNorm and the 1/|dt| step weights) with two
# updates: the second one's ratio moves.
NFT = ["--policy-loss", "nft", "--sampler", "ode", "--ema-decay", "0.5", "--ema-decay-ramp", "0.5"]
GUARD = ["--ratio-norm", "--step-reweight", "--updates-per-rollout", "2", "--clip-range", "0.2"]
# flow_grpo's cps sampler, its constant-free log-probs, on Flow-GRPO's ordered steps.
CPS = ["--sampler", "cps", "--timestep-selection", "ordered"]
# Megatron's block recompute of each pipeline stage's first block (counted per stage: at PP2 one block of each).
RECOMPUTE = recompute_flags(Recompute("block", 1))
VARIANTS = {"ppo": [], "awm": AWM, "branch": BRANCH, "nft": NFT, "guard": GUARD, "cps": CPS, "lora": LORA,
            "recompute": RECOMPUTE}
# Group advantages gathered over 2 ranks: unequal row counts, groups spanning both ranks.
ADVANTAGE_REWARDS = [0.3, 0.9, 0.1, 0.4, 0.8, 0.2, 0.7, 0.6]
ADVANTAGE_PROMPTS = ["p0", "p1", "p0", "p1", "p0", "p1", "p0", "p1"]


@check(2)
def advantages_gathered():
    from mm_grpo.grpo import NonFiniteRewardError, group_advantages
    rows = slice(0, 3) if dist.get_rank() == 0 else slice(3, 8)
    rewards, prompts = torch.tensor(ADVANTAGE_REWARDS)[rows], ADVANTAGE_PROMPTS[rows]
    mine = {"group": group_advantages(rewards, prompts, process_group=dist.group.WORLD).tolist(),
            "global": group_advantages(rewards, prompts, global_std=True, process_group=dist.group.WORLD).tolist()}
    bad = rewards.clone()
    if dist.get_rank() == 1:
        bad[0] = float("nan")
    try:
        group_advantages(bad, prompts, process_group=dist.group.WORLD)
    except NonFiniteRewardError as err:  # must be raised on rank 0 too, which holds no NaN
        mine["error"] = str(err)
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    return {"ranks": ranks}


def _layout_argv(name):
    """'tp2' / 'awm_tp2' / 'branch_tp2' -> the layout's extra trainer arguments."""
    variant, _, layout = name.rpartition("_")
    layouts = dict(LAYOUTS, **LORA_LAYOUTS) if variant == "lora" else LAYOUTS
    return layouts[layout] + ADAM_LINEAR + VARIANTS[variant or "ppo"]


def _run_layout(name):
    out = os.environ["MM_GRPO_TEST_OUT"]
    model_json, data_json = os.path.join(out, "cfg", "model.json"), os.path.join(out, "cfg", "data.json")
    if dist.get_rank() == 0 and not os.path.exists(model_json):
        write_configs(os.path.join(out, "cfg"), os.environ["MM_GRPO_TEST_PIPELINE"], reward=SMOOTH_REWARD)
    dist.barrier()
    history, run = run_grpo(grpo_argv(model_json, data_json, iters=2,
                                      extra=_layout_argv(name) + ["--save", os.path.join(out, f"ckpt_{name}")]))
    weights = gather_hf_state_dict(run.model.chunks)
    if run.ema is not None:  # the old policy (nft's sampler) is gathered like the policy
        weights.update({"ema." + n: w for n, w in gather_hf_state_dict(run.ema.modules).items()})
    adapters = gather_adapter_state(run.model.chunks) if run.model.lora else None
    if dist.get_rank() == 0:
        torch.save({"history": history, "weights": weights, "adapters": adapters}, os.path.join(out, f"grpo_{name}.pt"))
    return {"losses": [h["loss"] for h in history]}


@check(2)
def grpo_tp2():
    return _run_layout("tp2")


@check(2)
def grpo_sp2():
    return _run_layout("sp2")


@check(2)
def grpo_pp2():
    return _run_layout("pp2")


@check(2)
def grpo_dp2():
    return _run_layout("dp2")


@check(2)
def grpo_awm_tp2():
    return _run_layout("awm_tp2")


@check(2)
def grpo_awm_sp2():
    return _run_layout("awm_sp2")


@check(2)
def grpo_awm_pp2():
    return _run_layout("awm_pp2")


@check(2)
def grpo_awm_dp2():
    return _run_layout("awm_dp2")


@check(2)
def grpo_branch_tp2():
    return _run_layout("branch_tp2")


@check(2)
def grpo_branch_sp2():
    return _run_layout("branch_sp2")


@check(2)
def grpo_branch_pp2():
    return _run_layout("branch_pp2")


@check(2)
def grpo_branch_dp2():
    return _run_layout("branch_dp2")


@check(2)
def grpo_nft_tp2():
    return _run_layout("nft_tp2")


@check(2)
def grpo_nft_sp2():
    return _run_layout("nft_sp2")


@check(2)
def grpo_nft_pp2():
    return _run_layout("nft_pp2")


@check(2)
def grpo_nft_dp2():
    return _run_layout("nft_dp2")


@check(2)
def grpo_guard_tp2():
    return _run_layout("guard_tp2")


@check(2)
def grpo_guard_sp2():
    return _run_layout("guard_sp2")


@check(2)
def grpo_guard_pp2():
    return _run_layout("guard_pp2")


@check(2)
def grpo_guard_dp2():
    return _run_layout("guard_dp2")


@check(2)
def grpo_cps_tp2():
    return _run_layout("cps_tp2")


@check(2)
def grpo_cps_sp2():
    return _run_layout("cps_sp2")


@check(2)
def grpo_cps_pp2():
    return _run_layout("cps_pp2")


@check(2)
def grpo_cps_dp2():
    return _run_layout("cps_dp2")


@check(2)
def grpo_lora_tp2():
    return _run_layout("lora_tp2")


@check(2)
def grpo_lora_sp2():
    return _run_layout("lora_sp2")


@check(2)
def grpo_lora_pp2():
    return _run_layout("lora_pp2")


@check(2)
def grpo_lora_dp2():
    return _run_layout("lora_dp2")


@check(2)
def grpo_recompute_pp2():
    return _run_layout("recompute_pp2")


@check(4)
def grpo_lora_tp2pp2():
    return _run_layout("lora_tp2pp2")


@check(2)
def grpo_resume_on_another_layout():
    """The DP2 run's checkpoint (TP1: one model shard) loaded under TP2 with --no-load-optim: the
    weights and the iteration carry over although rank 1's shard name does not exist."""
    out = os.environ["MM_GRPO_TEST_OUT"]
    model_json, data_json = os.path.join(out, "cfg", "model.json"), os.path.join(out, "cfg", "data.json")
    saved = torch.load(os.path.join(out, "grpo_dp2.pt"), weights_only=False)["weights"]
    _, run = run_grpo(grpo_argv(model_json, data_json, iters=2, extra=LAYOUTS["tp2"] + [
        "--load", os.path.join(out, "ckpt_dp2"), "--no-load-optim"]))
    weights = gather_hf_state_dict(run.model.chunks)
    return {"start_iteration": run.start_iteration,
            "max_weight_diff": max((weights[n] - w).abs().max().item() for n, w in saved.items())}


@check(2)
def grpo_distributed_optimizer_resume():
    """DP2 with the distributed optimizer: 2 iterations, save, resume for 2 == 4 straight."""
    out = os.environ["MM_GRPO_TEST_OUT"]
    cfg = os.path.join(out, "cfg_resume")
    if dist.get_rank() == 0:
        write_configs(cfg, os.environ["MM_GRPO_TEST_PIPELINE"])
    dist.barrier()
    argv = lambda iters, *extra: grpo_argv(os.path.join(cfg, "model.json"), os.path.join(cfg, "data.json"),  # noqa
                                           iters=iters, extra=["--use-distributed-optimizer", *extra])
    full, run_full = run_grpo(argv(4))
    weights_full = gather_hf_state_dict(run_full.model.chunks)
    ckpt = os.path.join(out, "ckpt_distopt")
    first, _ = run_grpo(argv(2, "--save", ckpt))
    second, run_resumed = run_grpo(argv(4, "--load", ckpt))
    weights = gather_hf_state_dict(run_resumed.model.chunks)
    return {"rewards_equal": [h["reward/mean"] for h in first + second] == [h["reward/mean"] for h in full],
            "max_weight_diff": max((weights[n] - w).abs().max().item() for n, w in weights_full.items()),
            "start_iteration": run_resumed.start_iteration}
