"""FLUX trained by flow matching through MindSpeed-MM's own pretrain_sora.py: its model provider
(SoRAModel + PredictModel), forward step and loss, against mm-grpo's own flow-matching loss."""
import pytest
import torch

from mm_grpo.flow.matching import flow_matching_loss
from mm_grpo.models.flux import FluxConfig, FluxTransformer
from mm_grpo.models.flux.hf_weights import load_hf_weights
from mm_grpo.pipeline.latents import pack_latents, prepare_latent_image_ids
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.sora_helpers import (feature_batch, pretrain_sora, record_q_sample, set_megatron_args,
                                write_configs)
from tests.testbed import require_testbed
from tests.utils import random_reference

pytestmark = pytest.mark.mindspeed_mm
TINY = FluxConfig.preset("tiny")


def test_pretrain_sora_flow_step_equals_mm_grpo_flow_loss(parallel_1proc, tmp_path):
    require_testbed(needs_megatron_training=True)
    ref = random_reference(TINY, seed=2)
    set_megatron_args(*write_configs(tmp_path, TINY, ref.state_dict()))
    sora = pretrain_sora()
    model = sora["model_provider"]()
    drawn = record_q_sample(model)
    batch = feature_batch(TINY)
    x0, (t5, pooled) = batch["video"].clone(), batch["prompt_ids"]
    output, loss_func = sora["forward_step"](iter([batch]), model)
    loss, reported = loss_func(output)
    loss.sum().backward()
    noised, noise, timestep = drawn[0]

    # mm-grpo's flow trainer on the same batch: packed latents, sigma = t / 1000, guidance 3.5.
    ours = load_hf_weights(FluxTransformer(TINY), ref.state_dict())
    sigma = (timestep / 1000).expand(2)
    v = ours(pack_latents(noised), t5, pooled, sigma, prepare_latent_image_ids(4, 4), torch.zeros(7, 3),
             guidance=torch.full((2,), 3.5))
    expected = flow_matching_loss(v, pack_latents(x0), pack_latents(noise)).mean()
    weight = model.diffusion._training_weight(timestep)  # the scheduler's timestep weighting
    assert torch.allclose(loss, weight * expected, rtol=1e-5, atol=0), (loss, weight, expected)
    assert torch.allclose(reported["loss"], loss[0])
    grads = [p.grad for p in model.predictor.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads) and len(grads) > 50
