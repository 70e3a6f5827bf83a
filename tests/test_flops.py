"""The benchmark's analytic FLOP counter (bench/flops.py) against torch's FlopCounterMode."""
import pytest
import torch

from bench.flops import counted_flops, flux_flops, grpo_iteration_flops
from mm_grpo.families.flux.transformer import FluxConfig, FluxTransformer
from mm_grpo.families.flux.transformer.latents import prepare_latent_image_ids
from tests.fixtures import parallel_1proc  # noqa: F401

# Text and image lengths that differ, so swapping them in a formula would show.
N_TXT, GRID, BATCH = 7, (3, 4), 2


def _inputs(config):
    g = torch.Generator().manual_seed(0)
    n_img = GRID[0] * GRID[1]
    return dict(
        hidden_states=torch.randn(BATCH, n_img, config.in_channels, generator=g),
        encoder_hidden_states=torch.randn(BATCH, N_TXT, config.joint_attention_dim, generator=g),
        pooled_projections=torch.randn(BATCH, config.pooled_projection_dim, generator=g),
        timestep=torch.rand(BATCH, generator=g), img_ids=prepare_latent_image_ids(*GRID),
        txt_ids=torch.zeros(N_TXT, 3),
        guidance=torch.full((BATCH,), 3.5) if config.guidance_embeds else None)


@pytest.mark.parametrize("guidance", [True, False])
def test_forward_and_backward_flops_match_flop_counter(parallel_1proc, guidance):
    config = FluxConfig.preset("tiny", guidance_embeds=guidance, num_layers=1, num_single_layers=2)
    model = FluxTransformer(config)
    inputs = _inputs(config)
    expected = flux_flops(config, N_TXT, GRID[0] * GRID[1])
    with torch.no_grad():
        assert counted_flops(model, **inputs) == BATCH * expected.forward
    total = counted_flops(lambda: model(**inputs).square().sum().backward())
    assert total == BATCH * (expected.forward + expected.backward)


def test_diffusers_model_does_the_same_matmul_work(parallel_1proc):
    """The DanceGRPO-style reference runs diffusers' model: same FLOPs as mm-grpo's."""
    from diffusers import FluxTransformer2DModel
    config = FluxConfig.preset("tiny")
    model = FluxTransformer2DModel(**config.to_diffusers_config())
    with torch.no_grad():
        counted = counted_flops(lambda: model(**_inputs(config), return_dict=False))
    assert counted == BATCH * flux_flops(config, N_TXT, GRID[0] * GRID[1]).forward


def test_flux_dev_forward_flops_at_1024px():
    """FLUX.1-dev, 512 text + 4096 image tokens: an independent hand count."""
    config = FluxConfig.preset("flux-dev")
    d, s = 3072, 4608
    per_token = 19 * 24 * d * d + 38 * 24 * d * d  # both block kinds: 12 D^2 MACs per token
    attention = 57 * 4 * s * s * d
    embed = 2 * 4096 * 64 * d + 2 * 512 * 4096 * d + 2 * 4096 * d * 64
    vectors = 2 * (2 * 256 * d + 768 * d + 3 * d * d) + 2 * d * d * (19 * 12 + 38 * 3 + 2)
    flops = flux_flops(config, 512, 4096)
    assert flops.forward == s * per_token + attention + embed + vectors  # about 74 TFLOP


def test_iteration_flops_add_up():
    config = FluxConfig.preset("tiny")
    one = flux_flops(config, 32, 16)
    it = grpo_iteration_flops(config, 32, 16, batch=12, num_steps=16, trained_steps=9, decode_flops_per_image=1000)
    assert it.rollout == 12 * 16 * one.forward
    assert it.train == 12 * 9 * (one.forward + one.backward)
    assert it.total == it.rollout + it.train + 12 * 1000


@pytest.mark.parametrize("num_layers", [1, 0])
def test_lora_flops_on_a_frozen_base_match_flop_counter(parallel_1proc, num_layers):
    """LoRA on the recommended targets, base frozen: the adapters' products in the forward, no
    weight gradient of the base, nothing before the first block's input projection in the backward
    (first block double, or single when there is none)."""
    from mm_grpo.families.flux.transformer import lora
    config = FluxConfig.preset("tiny", num_layers=num_layers, num_single_layers=2)
    model = FluxTransformer(config)
    rank = 3
    lora.add_adapters(model, lora.LoRAConfig(r=rank), seed=0)
    inputs = _inputs(config)
    expected = flux_flops(config, N_TXT, GRID[0] * GRID[1], lora_rank=rank)
    assert expected.lora > 0
    with torch.no_grad():
        assert counted_flops(model, **inputs) == BATCH * expected.forward
    total = counted_flops(lambda: model(**inputs).square().sum().backward())
    assert total == BATCH * (expected.forward + expected.lora_backward)
    with pytest.raises(ValueError, match="lora_backward"):
        expected.backward
