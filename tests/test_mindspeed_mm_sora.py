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
                                write_configs, write_feature_dataset)
from tests.testbed import require_testbed
from tests.utils import random_reference

pytestmark = pytest.mark.mindspeed_mm
TINY = FluxConfig.preset("tiny")


@pytest.mark.parametrize("source", ["batch", "feature_files"])
def test_pretrain_sora_flow_step_equals_mm_grpo_flow_loss(parallel_1proc, tmp_path, source):
    """`batch`: the step on a batch handed to it; `feature_files`: on what MindSpeed-MM's own
    feature dataset and dataloader (pretrain_sora's datasets provider) read from feature files."""
    require_testbed(needs_megatron_training=True)
    ref = random_reference(TINY, seed=2)
    model_json, data_json = write_configs(tmp_path, TINY, ref.state_dict())
    batch = feature_batch(TINY)
    if source == "feature_files":
        write_feature_dataset(str(tmp_path / "features"), batch, data_json)
    args = set_megatron_args(model_json, data_json)
    sora = pretrain_sora()
    model = sora["model_provider"]()
    drawn = record_q_sample(model)
    x0, (t5, pooled) = batch["video"].clone(), batch["prompt_ids"]
    if source == "feature_files":
        args.consumed_train_samples = 0
        data_iterator = sora["train_valid_test_datasets_provider"]([2, 0, 0])[0]
    else:
        data_iterator = iter([batch])
    output, loss_func = sora["forward_step"](data_iterator, model)
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
