"""LoRA runs on the tiny pipeline, single process (CPU, fp32; one in bf16): GRPO with every sampler and policy
loss (KL reference = adapters off), flow matching, adapter-only checkpoints and exact resume."""
import math
import os

import pytest
import torch

from mm_grpo.families.flux.transformer import lora
from mm_grpo.recompute import EVERY_BLOCK_FLAGS
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.grpo_helpers import (SMOOTH_REWARD, flow_argv, grpo_argv, run_flow, run_grpo, write_configs,
                                write_flow_configs)
from tests.utils import assert_one_line_error

LORA = ["--lora-target-modules", "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "linear_in", "linear_out",
        "--lora-r", "4"]


@pytest.fixture(scope="module")
def configs(tiny_pipeline_dir, tmp_path_factory):
    return write_configs(tmp_path_factory.mktemp("lora_cfg"), tiny_pipeline_dir, reward=SMOOTH_REWARD)


def _params(run):
    return {n: p.detach().clone() for c in run.model.modules for n, p in c.named_parameters()}


def _adapter_names(run):
    return {n for c in run.model.modules for n, p in c.named_parameters() if ".lora_" in n}


@pytest.mark.parametrize("extra", [
    ["--sampler", "dance_sde"], ["--sampler", "flow_sde", "--timestep-selection", "ordered"],
    ["--sampler", "cps"], ["--sampler", "ode", "--policy-loss", "awm"],
    ["--timestep-selection", "window", "--window-size", "2"]], ids=lambda e: "_".join(e[1::2]))
def test_grpo_trains_only_the_adapters_with_the_base_as_kl_reference(parallel_1proc, configs, extra):
    _, run = run_grpo(grpo_argv(*configs, iters=0, extra=LORA + ["--kl-beta", "0.1", *extra]))
    before = _params(run)
    # a second run from the same seed; `run` holds the starting weights
    history, run2 = run_grpo(grpo_argv(*configs, iters=2, extra=LORA + ["--kl-beta", "0.1", *extra]))
    after = _params(run2)
    adapters = _adapter_names(run2)
    assert adapters and all(torch.equal(after[n], before[n]) for n in before if n not in adapters)  # base frozen
    assert any(not torch.equal(after[n], before[n]) for n in adapters if ".lora_B." in n)
    assert all(h["grad_norm"] > 0 and h["skipped"] == 0.0 for h in history)
    # the reference is the policy's own chunks with adapters off: no second copy of the weights
    ref = run2.schedule.ref_policy
    assert [r.module for r in ref] == run2.model.modules and not list(ref[0].parameters(recurse=False))
    params = [p for group in run2.model.optimizer.param_groups for p in group["params"]]
    assert len(params) == len(adapters)  # only adapters in the optimizer


def test_kl_term_measures_the_distance_to_the_base(parallel_1proc, configs):
    """At the start the adapters are zero: the policy is the reference and the first KL term is 0;
    after an update it is not."""
    history, _ = run_grpo(grpo_argv(*configs, iters=2, extra=LORA + ["--kl-beta", "0.1", "--policy-loss", "awm",
                                                                      "--sampler", "ode"]))
    assert history[0]["kl"] == 0.0 and history[1]["kl"] > 0


def test_flow_matching_trains_the_adapters(parallel_1proc, tiny_pipeline_dir, tmp_path):
    cfg = write_flow_configs(tmp_path / "flow", tiny_pipeline_dir)
    _, start = run_flow(flow_argv(*cfg, iters=0, extra=LORA))
    history, run = run_flow(flow_argv(*cfg, iters=2, extra=LORA))
    before, after, adapters = _params(start), _params(run), _adapter_names(run)
    assert all(torch.equal(after[n], before[n]) for n in before if n not in adapters)
    assert any(not torch.equal(after[n], before[n]) for n in adapters)
    assert all(h["grad_norm"] > 0 for h in history)


def test_adapter_only_checkpoint_resumes_exactly(parallel_1proc, configs, tmp_path):
    extra = LORA + ["--kl-beta", "0.1"]
    full, run_full = run_grpo(grpo_argv(*configs, iters=3, extra=extra))
    ckpt = str(tmp_path / "ckpt")
    first, run_first = run_grpo(grpo_argv(*configs, iters=2, extra=extra + ["--save", ckpt]))
    shard = torch.load(os.path.join(ckpt, "iter_0000002", "mp_rank_00", "model_optim_rng.pt"), weights_only=False)
    assert set(shard["model"]) == _adapter_names(run_first)  # adapters only
    assert shard["lora"]["config"] == lora.LoRAConfig(4, 16.0, tuple(LORA[1:7])).to_json()
    second, run_resumed = run_grpo(grpo_argv(*configs, iters=3, extra=extra + ["--load", ckpt]))
    assert run_resumed.start_iteration == 2
    assert [h["reward/mean"] for h in first + second] == [h["reward/mean"] for h in full]
    assert [h["loss"] for h in first + second] == [h["loss"] for h in full]
    a, b = _params(run_full), _params(run_resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_bf16_lora_run_stays_on_policy_finite_and_resumes_exactly(parallel_1proc, configs, tmp_path):
    """The full-size GPU job's setting on the tiny model (on CPU, one TP rank): bf16 compute, the
    frozen base's matrices and biases in bf16, recompute. The training recomputation of the first micro-batch
    gives the rollout's log-probs exactly (ratio 1), 20 iterations stay finite, and a run saved at 2
    and resumed repeats the uninterrupted one bit for bit."""
    extra = LORA + ["--bf16", *EVERY_BLOCK_FLAGS]
    full, run_full = run_grpo(grpo_argv(*configs, iters=20, extra=extra))
    assert all(h["ratio_first_mb_min"] == h["ratio_first_mb_max"] == 1.0 for h in full)
    assert all(math.isfinite(v) for h in full for v in h.values() if isinstance(v, float))
    base = {n: p for n, p in _params(run_full).items() if n not in _adapter_names(run_full)}
    assert {p.dtype for n, p in base.items() if p.dim() >= 2 or n.endswith(".bias")} == {torch.bfloat16}
    ckpt = str(tmp_path / "ckpt")
    first, _ = run_grpo(grpo_argv(*configs, iters=2, extra=extra + ["--save", ckpt]))
    second, run_resumed = run_grpo(grpo_argv(*configs, iters=4, extra=extra + ["--load", ckpt]))
    assert [h["loss"] for h in first + second] == [h["loss"] for h in full[:4]]
    assert [h["reward/mean"] for h in first + second] == [h["reward/mean"] for h in full[:4]]


def test_lora_configuration_errors(parallel_1proc, configs, tmp_path):
    assert_one_line_error(lambda: run_grpo(grpo_argv(*configs, iters=0, extra=["--lora-load", "x.safetensors"])),
                          "--lora-load given without --lora-target-modules: add --lora-target-modules")
    ckpt = str(tmp_path / "ckpt")
    run_grpo(grpo_argv(*configs, iters=1, extra=LORA + ["--save", ckpt]))
    assert_one_line_error(lambda: run_grpo(grpo_argv(*configs, iters=2, extra=LORA[:-1] + ["8", "--load", ckpt])),
                          "was trained with LoRA")
    assert_one_line_error(lambda: run_grpo(grpo_argv(*configs, iters=2, extra=["--load", ckpt])),
                          "LoRA checkpoint")


def test_nft_with_lora_averages_the_adapters_and_shares_the_base(parallel_1proc, configs, tmp_path):
    """DiffusionNFT's old policy (the EMA) of a LoRA run: its own adapters, the policy's base tensors
    (no second copy), adapter-only in the checkpoint, and an exact resume."""
    extra = LORA + ["--policy-loss", "nft", "--sampler", "ode", "--ema-decay", "0.5", "--ema-decay-ramp", "0.5"]
    full, run_full = run_grpo(grpo_argv(*configs, iters=3, extra=extra))
    policy = dict(run_full.model.modules[0].named_parameters())
    ema = dict(run_full.ema.modules[0].named_parameters())
    assert set(ema) == set(policy)
    for name, p in policy.items():
        if ".lora_" in name:
            assert ema[name].data_ptr() != p.data_ptr()
        else:
            assert ema[name].data_ptr() == p.data_ptr()  # shared, not copied
    assert any(not torch.equal(ema[n], policy[n]) for n in _adapter_names(run_full) if ".lora_B." in n)
    ckpt = str(tmp_path / "ckpt")
    first, _ = run_grpo(grpo_argv(*configs, iters=2, extra=extra + ["--save", ckpt]))
    shard = torch.load(os.path.join(ckpt, "iter_0000002", "mp_rank_00", "model_optim_rng.pt"), weights_only=False)
    assert all(set(s) == set(shard["model"]) for s in shard["ema"])  # adapters only, like the policy
    second, resumed = run_grpo(grpo_argv(*configs, iters=3, extra=extra + ["--load", ckpt]))
    assert [h["reward/mean"] for h in first + second] == [h["reward/mean"] for h in full]
    for n, p in resumed.ema.modules[0].named_parameters():
        assert torch.equal(p, ema[n]), n
