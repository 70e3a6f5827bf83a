"""MindSpeed-MM's own LoRA (`--lora-target-modules`: its lora_patch wraps the model provider in
peft's LoRA) on mm-grpo's FLUX, built by pretrain_sora.py's model provider through Megatron's
`get_model` as MindSpeed-MM patches it. The oracle is mm-grpo's own LoRA (families/flux/transformer/lora.py,
written without peft) holding the same A and B: the flow-matching step's loss and every adapter's
gradient agree, peft adapts exactly the linears mm-grpo's LoRA adapts for the same names, and only
adapters train. GRPO with this LoRA inside `pretrain` (its KL reference, save and resume):
tests/test_mindspeed_grpo.py."""
import pytest
import torch

from mm_grpo.families.flux.transformer import FluxConfig, FluxTransformer, lora
from mm_grpo.families.flux.transformer.hf_weights import load_hf_weights
from mm_grpo.families.flux.transformer.latents import pack_latents, prepare_latent_image_ids
from mm_grpo.flow.matching import flow_matching_loss
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.sora_helpers import (PEFT_ADAPTER, feature_batch, peft_adapters, pretrain_sora, record_q_sample,
                                set_megatron_args, write_configs)
from tests.testbed import require_testbed
from tests.utils import random_reference

pytestmark = pytest.mark.mindspeed_mm
TINY = FluxConfig.preset("tiny")
R, ALPHA = 4, 8  # MindSpeed-MM parses --lora-alpha as an int


def test_mindspeed_mm_lora_on_flux_equals_mm_grpo_lora(parallel_1proc, tmp_path):
    require_testbed(needs_megatron_training=True)
    ref = random_reference(TINY, seed=2)
    model_json, data_json = write_configs(tmp_path, TINY, ref.state_dict())
    set_megatron_args(model_json, data_json, extra=("--lora-target-modules", *lora.RECOMMENDED_TARGETS,
                                                    "--lora-r", str(R), "--lora-alpha", str(ALPHA)))
    sora = pretrain_sora()
    from megatron.training import training  # after MindSpeed-MM's import patched its get_model
    wrapped = training.get_model(sora["model_provider"], wrap_with_ddp=False)[0]  # MindSpeed-MM's get_model_wrapper
    theirs = peft_adapters(wrapped)

    ours = load_hf_weights(FluxTransformer(TINY), ref.state_dict())
    lora.add_adapters(ours, lora.LoRAConfig(r=R, alpha=ALPHA), seed=0)
    params = dict(ours.named_parameters())
    assert set(theirs) == {n for n, p in params.items() if p.requires_grad} and len(theirs) > 20
    assert {n for n, p in wrapped.named_parameters() if p.requires_grad} == {
        n for n, p in wrapped.named_parameters() if PEFT_ADAPTER.match(n)}  # the base frozen
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in theirs.items():  # B random too, so that the adapters change the output
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            params[name].copy_(p)

    batch = feature_batch(TINY)
    x0, (t5, pooled) = batch["video"].clone(), batch["prompt_ids"]  # forward_step takes them out of the batch
    drawn = record_q_sample(wrapped.module if hasattr(wrapped, "module") else wrapped)
    output, loss_func = sora["forward_step"](iter([batch]), wrapped)
    loss, _ = loss_func(output)
    loss.sum().backward()
    noised, noise, timestep = drawn[0]
    sigma = (timestep / 1000).expand(2)
    v = ours(pack_latents(noised), t5, pooled, sigma, prepare_latent_image_ids(4, 4), torch.zeros(7, 3),
             guidance=torch.full((2,), 3.5))
    diffusion = (wrapped.module if hasattr(wrapped, "module") else wrapped).diffusion
    expected = diffusion._training_weight(timestep) * flow_matching_loss(
        v, pack_latents(x0), pack_latents(noise)).mean()
    expected.backward()
    assert torch.allclose(loss, expected, rtol=1e-5, atol=0), (loss, expected)
    for name, p in theirs.items():
        assert torch.allclose(p.grad, params[name].grad, rtol=1e-4, atol=1e-7), name
