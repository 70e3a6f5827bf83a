"""Flow-matching training of Qwen-Image (mm_grpo.training.train_flow through the family interface): the
micro-batches are the pipeline's latents and masked text features, a few steps reduce the loss, resume
repeats the run exactly, the cached features train as the encoder's do, and the conditional velocity
is what is trained whatever guidance the evaluation samples with (single process, CPU, fp32)."""
import json
from pathlib import Path

import pytest
import torch

from mm_grpo.data.image_captions import ImageCaptionDataset
from mm_grpo.families.qwen_image.vae import encode_latents, load_vae
from mm_grpo.recompute import EVERY_BLOCK_FLAGS
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.grpo_helpers import flow_argv, run_flow, write_flow_configs


@pytest.fixture(scope="module")
def configs(tiny_qwen_image_pipeline_dir, tmp_path_factory):
    return write_flow_configs(tmp_path_factory.mktemp("qwen_flow_cfg"), tiny_qwen_image_pipeline_dir,
                              model_id="mmgrpo_qwenimage")


def _without_cache(configs):
    """The configs with the features encoded per batch (data.json's cache_features false), beside the others."""
    model, data = configs
    cfg = json.loads(Path(data).read_text())
    cfg["dataset_param"]["cache_features"] = False
    path = Path(data).with_name("data_no_cache.json")
    path.write_text(json.dumps(cfg))
    return model, str(path)


def test_micro_batches_are_the_pipelines_latents_and_masked_text(parallel_1proc, configs, tiny_qwen_image_pipeline_dir):
    _, run = run_flow(flow_argv(*configs, iters=0, extra=["--true-cfg-scale", "4"]))
    assert run.sampler.guided and not run.denoiser.guided  # guidance samples the evaluation; training is conditional
    mbs = run.micro_batches(1)
    indices = [run.dataset_index(s) for s in run.local_samples(1)]
    vae = load_vae(tiny_qwen_image_pipeline_dir)
    x0 = encode_latents(vae, ImageCaptionDataset(run.dataset.folder, resolution=64).images(indices))
    assert torch.allclose(torch.cat([mb["x0"] for mb in mbs]), x0, atol=1e-5)  # encoded in other batches
    captions = run.dataset.captions_of(indices)
    embeds, mask = run.features.text(captions)
    for i, mb in enumerate(mbs):
        rows = slice(2 * i, 2 * i + 2)
        s = mb["timestep"].view(-1, 1, 1)
        assert torch.allclose(mb["hidden_states"], (1 - s) * mb["x0"] + s * mb["noise"])
        assert "negative_encoder_hidden_states" not in mb and mb["img_shapes"] == [[(1, 4, 4)]] * 2
        length = int(mb["encoder_hidden_states_mask"].sum(1).max())  # padding past the longest caption is masked
        assert torch.equal(mb["encoder_hidden_states_mask"][:, :length], mask[rows, :length])
        assert torch.allclose(mb["encoder_hidden_states"][:, :length], embeds[rows, :length])
    lengths = {len(c.split()) for c in captions}
    assert len(lengths) > 1, "the batch should mix caption lengths, so that the mask matters"


def test_a_few_steps_reduce_the_loss_on_a_fixed_batch(parallel_1proc, configs):
    _, run = run_flow(flow_argv(*configs, iters=0, extra=["--lr", "3e-3"]))
    batch = run.micro_batches(0)
    losses = [run.train_on(batch)["loss"] for _ in range(8)]
    assert losses[-1] < 0.7 * losses[0], losses


def test_cached_features_train_as_the_encoder_does(parallel_1proc, configs):
    cached, _ = run_flow(flow_argv(*configs, iters=2))
    encoded, _ = run_flow(flow_argv(*_without_cache(configs), iters=2))
    for a, b in zip(cached, encoded):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)


# The trainer's speed / memory flags for Qwen-Image, each through train, save and exact resume.
FLAGS = {"plain": [], "recompute": EVERY_BLOCK_FLAGS, "bf16": ["--bf16"],
         "lora": ["--lora-target-modules", "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "--lora-r", "4",
                  "--lora-alpha", "4"]}


@pytest.mark.parametrize("flags", FLAGS.values(), ids=FLAGS.keys())
def test_resume_repeats_the_uninterrupted_run_exactly(parallel_1proc, configs, tmp_path, flags):
    full, run_full = run_flow(flow_argv(*configs, iters=4, extra=flags))
    first, _ = run_flow(flow_argv(*configs, iters=2, extra=[*flags, "--save", str(tmp_path / "ckpt")]))
    second, run_resumed = run_flow(flow_argv(*configs, iters=4, extra=[*flags, "--load", str(tmp_path / "ckpt")]))
    assert run_resumed.start_iteration == 2
    assert [h["loss"] for h in first + second] == [h["loss"] for h in full]
    a = dict(run_full.model.modules[0].named_parameters())
    b = dict(run_resumed.model.modules[0].named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_configuration_errors(parallel_1proc, configs):
    from mm_grpo.training.train_flow import FlowRun, parse_args
    with pytest.raises(ValueError, match="image size 40x40: Qwen-Image needs both sides divisible by 16"):
        FlowRun(parse_args(flow_argv(*configs, extra=["--height", "40"])))
    with pytest.raises(ValueError, match="--guidance-scale"):
        FlowRun(parse_args(flow_argv(*configs, extra=["--guidance-scale", "2"])))
    with pytest.raises(ValueError, match="--sigma-shift 2.0: Qwen-Image's rollout takes QwenImagePipeline's schedule"):
        FlowRun(parse_args(flow_argv(*configs, extra=["--sigma-shift", "2"])))
