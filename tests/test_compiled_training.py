"""GRPO with --compile-blocks (every FLUX block under torch.compile, inductor) through a whole run,
single process (CPU, fp32): save, exact resume, the EMA, the KL reference, LoRA and its diffusers
export, the held-out evaluation. Where MindSpeed's adaptor made torch.compile compile nothing
(MindSpeed-MM's environment, as on Ascend) the flag is refused in one line instead.

The compiles dominate the time (inductor compiles in this process, tests/conftest.py): 9 graphs,
each a block kind (double, single) in each of the ways the run calls it: no-grad with the EMA's
frozen adapters (evaluation) and the policy's trainable ones (rollout), adapters off (the KL
reference), with grad (training; the first double block also with an input that needs no grad,
as the embedders are frozen under LoRA). The evaluation's batch is the micro-batch, so no shape
recompiles. The resumed run reuses those graphs.

PPO's ratio on the first micro-batch: the rollout runs the blocks' no-grad graphs and the training
their training graphs, two inductor compiles of the same block. In fp32 on the CPU they agree bit
for bit and the ratio is exactly 1, as in eager (asserted below). Under --bf16 (with or without
every block recomputed, full or LoRA) they do not: the first micro-batch's ratio was 0.99925 to
1.00098 over 3 iterations of this tiny run on the CPU, 10x DanceGRPO's clip range of 1e-4 (inductor
fuses torch.addcmul, modulate's and gated_residual's, without the bf16 rounding eager does, and
rounds its output where a graph stores it: the training graph stores more); on an H200 at FLUX.1-dev
size, LoRA 64, 0.99991 to 1.00001 and 0.99995 to 1.000004 in two iterations (docs/performance.md).
Eager is exactly 1 in both dtypes (tests/test_lora_training.py)."""
import os

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from converters.convert_cli import main as convert
from mm_grpo.families.flux.transformer import lora
from mm_grpo.families.flux.transformer.lora_hf import LORA_FILE, read_diffusers_lora
from mm_grpo.platform.adaptor import torch_compile_replaced
from mm_grpo.recompute import EVERY_BLOCK_FLAGS
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.grpo_helpers import ADAM_LINEAR, SMOOTH_REWARD, grpo_argv, run_grpo, write_configs
from tests.utils import assert_one_line_error

TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "linear_in", "linear_out"]
# alpha / r = 2: the exported B (scaled by it) reads back exactly. The evaluation's 2 prompts are
# one batch of the micro-batch's size. Adam's epsilon large: the eager run it is compared with
# differs by rounding, which Adam's first steps would otherwise blow up to +-lr (grpo_helpers.py).
RUN = ["--lora-target-modules", *TARGETS, "--lora-r", "4", "--lora-alpha", "8", "--kl-beta", "0.1",
       "--ema-decay", "0.5", "--ema-decay-ramp", "0.25", "--eval-interval", "1", "--eval-prompts", "2", *ADAM_LINEAR]
COMPILED = RUN + ["--compile-blocks"]


@pytest.fixture(scope="module")
def configs(tiny_pipeline_dir, tmp_path_factory):
    return write_configs(tmp_path_factory.mktemp("compiled_cfg"), tiny_pipeline_dir, reward=SMOOTH_REWARD)


def _params(chunks):
    return {n: p.detach().clone() for c in chunks for n, p in c.named_parameters()}


def _blocks(chunks):
    return [b for c in chunks for b in (*c.double_blocks, *c.single_blocks)]


def test_compiled_run_trains_as_eager_resumes_exactly_and_exports_its_lora(parallel_1proc, configs, tmp_path):
    if torch_compile_replaced():
        assert torch.compile.__module__.startswith("mindspeed")
        assert_one_line_error(lambda: run_grpo(grpo_argv(*configs, iters=1, extra=COMPILED)), "replaced torch.compile")
        return
    eager, eager_run = run_grpo(grpo_argv(*configs, iters=2, extra=RUN))
    ckpt = tmp_path / "ckpt"
    torch._dynamo.reset()
    counters.clear()
    try:
        # A block that reached dynamo's recompile limit would run eager from then on, unannounced.
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            full, run = run_grpo(grpo_argv(*configs, iters=2, extra=COMPILED + ["--save", str(ckpt),
                                                                                  "--save-interval", "1"]))
            graphs, breaks = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
            second, resumed = run_grpo(grpo_argv(*configs, iters=2, extra=COMPILED + ["--load",
                                                                                      str(ckpt / "iter_0000001")]))
            recompiled = counters["stats"]["unique_graphs"] - graphs
    finally:
        torch._dynamo.reset()

    # Compiled for real: every block of the policy and of its EMA, each block whole (no graph break),
    # blocks of a kind sharing their graphs (the counts above: 9 graphs for 12 blocks in 4 ways).
    assert all(b._compiled_call_impl is not None for b in _blocks(run.model.modules + run.ema.modules))
    assert 0 < graphs <= 10 and not breaks, (graphs, breaks)
    assert recompiled == 0  # the resumed run, a new model, runs the same graphs
    # On-policy at the first micro-batch, as in eager (the module docstring: not under bf16).
    assert all(h["ratio_first_mb_min"] == h["ratio_first_mb_max"] == 1.0 for h in full + second)
    # The KL reference (the policy with its adapters off, another graph) is the policy until it trains.
    assert full[0]["kl"] == 0.0 and full[1]["kl"] > 0
    assert [h["ema_decay"] for h in full] == [0.0, 0.25]
    # The same training as eager, to fp32 rounding: rollouts, losses, KL, evaluations, weights.
    for key, rel in (("reward/mean", 1e-5), ("grad_norm", 1e-5), ("kl", 1e-3)):  # kl: 6e-8, a difference
        assert [h[key] for h in full] == pytest.approx([h[key] for h in eager], rel=rel), key
    # (PPO's loss at ratio 1 is -mean(advantages) = 0 up to rounding, 1e-9 here)
    assert [h["loss"] for h in full] == pytest.approx([h["loss"] for h in eager], abs=1e-7)
    assert sorted(run.evaluations) == sorted(eager_run.evaluations) == [0, 1, 2]
    for it, stats in eager_run.evaluations.items():
        assert run.evaluations[it] == pytest.approx(stats, abs=1e-5), it  # means and bootstrap bounds
    assert run.evaluations[0] != run.evaluations[2]  # the evaluated EMA moved
    policy, ema = _params(run.model.modules), _params(run.ema.modules)
    for name, p in _params(eager_run.model.modules).items():
        torch.testing.assert_close(policy[name], p, rtol=1e-5, atol=1e-7, msg=name)
    adapters = set(lora.adapter_state_dict(eager_run.model.modules[0]))
    assert any(not torch.equal(ema[n], policy[n]) for n in adapters if ".lora_B." in n)

    # Saved under eager's names, adapters only; resumed from iteration 1, the run repeats the
    # uninterrupted one bit for bit: its second iteration, policy, EMA and evaluations.
    shard = torch.load(ckpt / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert set(shard["model"]) == adapters and all(set(s) == adapters for s in shard["ema"])
    assert resumed.start_iteration == 1
    assert [h["reward/mean"] for h in second] == [full[1]["reward/mean"]]
    assert [h["loss"] for h in second] == [full[1]["loss"]] and [h["kl"] for h in second] == [full[1]["kl"]]
    for a, b in ((policy, _params(resumed.model.modules)), (ema, _params(resumed.ema.modules))):
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert resumed.evaluations == run.evaluations  # 1 and 2 evaluated again, 0 from the checkpoint

    # The diffusers LoRA file of the latest checkpoint holds the trained adapters exactly.
    convert(["FluxConverter", "lora_mm_to_hf", "--cfg.source_path", str(ckpt), "--cfg.target_path",
             str(tmp_path / "lora")])
    loaded = read_diffusers_lora(str(tmp_path / "lora"), run.config, lora.LoRAConfig(4, 8.0, tuple(TARGETS)))
    for base in lora.base_rules(run.config, TARGETS):
        for rule, tensor in zip(lora.adapter_rules(base), loaded[base.hf[0]]):
            assert torch.equal(tensor, policy[rule.megatron]), rule.megatron
    assert any(t.abs().max() > 0 for base in loaded.values() for t in base[1:])  # B trained
    assert os.path.isfile(tmp_path / "lora" / LORA_FILE)


def test_compiled_bf16_run_with_recompute_resumes_exactly(parallel_1proc, configs, tmp_path):
    """--compile-blocks with --bf16 and every block recomputed (LoRA over the frozen bf16 base): the
    run saved at 1 and resumed repeats the uninterrupted one bit for bit. Its first micro-batch's ratio
    is not exactly 1 (the module docstring): within twice the worst measured on the CPU (9.8e-4)."""
    if torch_compile_replaced():
        pytest.skip("torch.compile compiles nothing here (MindSpeed's adaptor): the refusal is tested above")
    extra = COMPILED + ["--bf16", *EVERY_BLOCK_FLAGS]
    ckpt = tmp_path / "ckpt"
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            full, run = run_grpo(grpo_argv(*configs, iters=2, extra=extra + ["--save", str(ckpt), "--save-interval", "1"]))
            second, resumed = run_grpo(grpo_argv(*configs, iters=2, extra=extra + ["--load", str(ckpt / "iter_0000001")]))
    finally:
        torch._dynamo.reset()
    assert all(abs(h[k] - 1) <= 2e-3 for h in full for k in ("ratio_first_mb_min", "ratio_first_mb_max"))
    assert all(h["skipped"] == 0.0 for h in full)
    assert [h["loss"] for h in second] == [full[1]["loss"]] and [h["kl"] for h in second] == [full[1]["kl"]]
    policy, again = _params(run.model.modules), _params(resumed.model.modules)
    assert policy.keys() == again.keys() and all(torch.equal(policy[n], again[n]) for n in policy)
    assert resumed.evaluations == run.evaluations
