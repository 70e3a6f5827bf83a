"""Flow-matching training of FLUX: the objective against diffusers' FLUX formulas, and the
training loop (loss decrease, exact resume, configuration errors), single process (CPU, fp32)."""
import json
import math

import pytest
import torch

from mm_grpo.data.image_captions import ImageCaptionDataset
from mm_grpo.flow import FlowMatchingSettings, flow_matching_loss, noisy_latents, sample_sigmas, shift_sigmas
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.grpo_helpers import flow_argv, run_flow, write_flow_configs


# --- the objective ---------------------------------------------------------------------
@pytest.mark.parametrize("seq_len", [16, 256, 1024, 4096])
def test_resolution_dependent_shift_matches_diffusers(seq_len):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift
    mu = calculate_shift(seq_len, 256, 4096, 0.5, 1.15)
    settings = FlowMatchingSettings()
    assert settings.resolved_shift(seq_len) == pytest.approx(math.exp(mu), rel=1e-12)
    t = torch.linspace(0.01, 0.99, 50, dtype=torch.float64)
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
    assert torch.allclose(shift_sigmas(t, settings.resolved_shift(seq_len)), scheduler.time_shift(mu, 1.0, t))
    assert FlowMatchingSettings(shift=3.0).resolved_shift(seq_len) == 3.0


def test_logit_normal_sigmas_follow_their_distribution():
    g = torch.Generator().manual_seed(0)
    sigmas = sample_sigmas(20000, FlowMatchingSettings(shift=1.0, logit_mean=0.5, logit_std=0.8), 16, g)
    logits = torch.logit(sigmas.double())
    assert logits.mean().item() == pytest.approx(0.5, abs=0.03) and logits.std().item() == pytest.approx(0.8, abs=0.02)
    shifted = sample_sigmas(20000, FlowMatchingSettings(weighting_scheme="uniform", shift=3.0), 16,
                            torch.Generator().manual_seed(0))
    # P(sigma <= shift(1/2)) = 1/2 for uniform t, and shift 3 maps t = 1/2 to 3/4
    assert (shifted <= 0.75).double().mean().item() == pytest.approx(0.5, abs=0.01)
    assert 0 < shifted.min() and shifted.max() < 1


def test_target_velocity_recovers_the_data():
    g = torch.Generator().manual_seed(1)
    x0, noise, sigma = torch.randn(3, 16, 8, generator=g), torch.randn(3, 16, 8, generator=g), torch.rand(3, generator=g)
    x_t = noisy_latents(x0, noise, sigma)
    assert torch.allclose(x_t, (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * noise)
    v = noise - x0
    assert flow_matching_loss(v, x0, noise).abs().max() == 0
    assert torch.allclose(x_t - sigma[:, None, None] * v, x0, atol=1e-6)  # FLUX's x0_hat = x - sigma v
    assert torch.allclose(flow_matching_loss(torch.zeros_like(v), x0, noise), (v ** 2).mean((1, 2)))


def test_bad_settings():
    with pytest.raises(ValueError, match="unknown weighting scheme 'cosmap'"):
        FlowMatchingSettings(weighting_scheme="cosmap")
    with pytest.raises(ValueError, match="flow shift must be > 0"):
        FlowMatchingSettings(shift=0.0)


# --- the dataset folder -----------------------------------------------------------------
def test_image_caption_folder_errors_and_resizing(tmp_path):
    from PIL import Image
    with pytest.raises(FileNotFoundError, match="no metadata.jsonl"):
        ImageCaptionDataset(str(tmp_path))
    Image.new("RGB", (80, 40), (255, 0, 0)).save(tmp_path / "a.png")
    (tmp_path / "metadata.jsonl").write_text(json.dumps({"file_name": "a.png", "text": "red"}) + "\n")
    image, caption = ImageCaptionDataset(str(tmp_path), resolution=32)[0]
    assert image.shape == (3, 32, 32) and caption == "red" and torch.allclose(image[0], torch.ones(32, 32))
    (tmp_path / "metadata.jsonl").write_text('{"file_name": "a.png", "caption": "red"}\n')
    with pytest.raises(ValueError, match=r"metadata.jsonl:1: needs string fields 'file_name' and 'text'"):
        ImageCaptionDataset(str(tmp_path))
    assert ImageCaptionDataset(str(tmp_path), caption_column="caption").captions == ["red"]
    (tmp_path / "metadata.jsonl").write_text('{"file_name": "b.png", "text": "x"}\nnot json\n')
    with pytest.raises(ValueError, match="metadata.jsonl:2: not a JSON object"):
        ImageCaptionDataset(str(tmp_path))
    (tmp_path / "metadata.jsonl").write_text('{"file_name": "b.png", "text": "x"}\n')
    with pytest.raises(FileNotFoundError, match="1 image.s. listed .* do not exist, e.g. .*b.png"):
        ImageCaptionDataset(str(tmp_path))


# --- the training loop --------------------------------------------------------------------
@pytest.fixture(scope="module")
def configs(tiny_pipeline_dir, tmp_path_factory):
    return write_flow_configs(tmp_path_factory.mktemp("flow_cfg"), tiny_pipeline_dir)


def _weights(run):
    return {n: p.detach().clone() for n, p in run.model.modules[0].named_parameters()}


def test_a_few_steps_reduce_the_loss_on_a_fixed_batch(parallel_1proc, configs):
    _, run = run_flow(flow_argv(*configs, iters=0, extra=["--lr", "3e-3"]))
    batch = run.micro_batches(0)
    losses = [run.train_on(batch)["loss"] for _ in range(8)]
    assert losses[-1] < 0.7 * losses[0], losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


def test_batches_follow_the_data_order_and_the_flow_objective(parallel_1proc, configs):
    _, run = run_flow(flow_argv(*configs, iters=0))
    assert list(run.local_samples(3)) == [12, 13, 14, 15]  # global batch 4, one data-parallel rank
    order = [run.dataset_index(s) for s in range(16)]
    assert sorted(order[:8]) == list(range(8)) and sorted(order[8:]) == list(range(8)) and order[:8] != order[8:]
    mbs = run.micro_batches(1)
    assert [mb["hidden_states"].shape for mb in mbs] == [torch.Size([2, 16, 16])] * 2
    for mb in mbs:
        s = mb["timestep"].view(-1, 1, 1)
        assert torch.allclose(mb["hidden_states"], (1 - s) * mb["x0"] + s * mb["noise"])
        assert ((0 < mb["timestep"]) & (mb["timestep"] < 1)).all() and (mb["guidance"] == 3.5).all()
    again = run.micro_batches(1)
    assert all(torch.equal(a["noise"], b["noise"]) and torch.equal(a["x0"], b["x0"]) for a, b in zip(mbs, again))


def test_resume_repeats_the_uninterrupted_run_exactly(parallel_1proc, configs, tmp_path):
    full, run_full = run_flow(flow_argv(*configs, iters=4))
    first, _ = run_flow(flow_argv(*configs, iters=2, extra=["--save", str(tmp_path / "ckpt")]))
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "2"
    second, run_resumed = run_flow(flow_argv(*configs, iters=4, extra=["--load", str(tmp_path / "ckpt")]))
    assert run_resumed.start_iteration == 2
    assert [h["loss"] for h in first + second] == [h["loss"] for h in full]
    a, b = _weights(run_full), _weights(run_resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_evaluation_samples_and_scores_held_out_prompts(parallel_1proc, tiny_pipeline_dir, tmp_path):
    reward = [{"name": "compositional", "weight": 1.0}, {"name": "compositional_accuracy", "weight": 0.0}]
    model, data = write_flow_configs(tmp_path, tiny_pipeline_dir, reward=reward)
    (tmp_path / "eval.txt").write_text("a red circle\ntwo blue squares\na green triangle\n")
    cfg = json.loads((tmp_path / "data.json").read_text())
    cfg["dataset_param"].update(eval_prompt_file="eval.txt", eval_samples_per_prompt=2)
    (tmp_path / "data.json").write_text(json.dumps(cfg))
    history, run = run_flow(flow_argv(model, data, iters=1, extra=["--eval-interval", "1", "--eval-prompts", "2",
                                                                   "--num-inference-steps", "4"]))
    assert run.evaluator.prompts == ["a red circle"] * 2 + ["two blue squares"] * 2
    assert {"eval/reward_mean", "eval/compositional", "eval/compositional_accuracy"} <= set(history[0])
    result = run.evaluator(run.model.modules)
    assert result.images.shape == (4, 3, 64, 64)
    again = run.evaluator(run.model.modules)  # fixed noise: the same images every time
    assert torch.equal(result.images, again.images)
    assert not torch.equal(result.images[0], result.images[1])  # two samples of a prompt differ


def _error(argv):
    from mm_grpo.training.train_flow import FlowRun, parse_args
    FlowRun(parse_args(argv))


def test_configuration_errors(parallel_1proc, configs, tmp_path):
    model, data = configs
    cfg = json.loads(open(data).read())
    cfg["dataset_param"].pop("data_folder")
    (tmp_path / "data.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="dataset_param needs 'data_folder'"):
        _error(flow_argv(model, str(tmp_path / "data.json")))
    with pytest.raises(ValueError, match="global batch size 4 must be divisible by data-parallel size 1 x "
                                         "micro-batch size 3"):
        _error(flow_argv(model, data, extra=["--micro-batch-size", "3"]))
    with pytest.raises(ValueError, match="image size 40x40 must be positive multiples of 16"):
        _error(flow_argv(model, data, extra=["--height", "40"]))
