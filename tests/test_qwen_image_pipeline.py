"""Qwen-Image's text encoder, embedding cache, VAE, sigma schedule and tiny pipeline against diffusers'
QwenImagePipeline on the tiny folder (mm_grpo.families.qwen_image.tiny); the headline: mm-grpo's ODE
rollout (its sampler, QwenImageDenoiser's true CFG, the Megatron transformer with the folder's weights)
samples the pipeline's own latents and images from the same noise."""
import json
import math
import os

import numpy as np
import pytest
import torch

from mm_grpo.families.qwen_image import sigmas as qwen_sigmas
from mm_grpo.families.qwen_image import tiny
from mm_grpo.families.qwen_image.denoiser import QwenImageDenoiser, token_grid
from mm_grpo.families.qwen_image.text import (PROMPT_TEMPLATE, TEMPLATE_START_IDX, QwenImageTextEncoder,
                                              TextEmbeddingCache, save_text_embeddings)
from mm_grpo.families.qwen_image.transformer import QwenImageConfig, QwenImageTransformer
from mm_grpo.families.qwen_image.transformer.hf_weights import load_hf_weights
from mm_grpo.families.qwen_image.vae import VaeDecoder, encode_latents, load_vae, pack_latents
from mm_grpo.rollout import rollout, sigma_schedule
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.utils import assert_one_line_error, rel_err

# Prompts of different lengths (padded and masked in one batch), words outside the corpus, and the
# negative prompt QwenImagePipeline advises for true CFG.
PROMPTS = ["a photo of a cat sitting on a red chair", "owl",
           "A fox running through the autumn forest at night, digital art!"]
NEGATIVE = " "
HEIGHT, WIDTH = 48, 64  # 3 x 4 packed tokens
TRUE_CFG_SCALE = 4.0
STEPS = 4
TOL = 1e-5


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny.build_tiny_pipeline(tmp_path_factory.mktemp("tiny_qwen_image") / "pipeline", seed=0)


@pytest.fixture(scope="module")
def pipe(folder):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def encoder(folder):
    return QwenImageTextEncoder(folder)


def _mask_equal(a, b):
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


# --- the tiny folder ---------------------------------------------------------------------------------
def test_tiny_folder_is_a_qwen_image_pipeline(folder, pipe):
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImagePipeline"
    assert set(index) >= {"scheduler", "vae", "text_encoder", "tokenizer", "transformer"}
    assert QwenImageConfig.from_diffusers_config(folder) == tiny.TRANSFORMER
    assert pipe.text_encoder.config.text_config.hidden_size == tiny.TRANSFORMER.joint_attention_dim
    assert pipe.vae.config.z_dim * 4 == pipe.transformer.config.in_channels and pipe.vae_scale_factor == 8
    for key, value in qwen_sigmas.SCHEDULER_CONFIG.items():
        assert pipe.scheduler.config[key] == value, key
    # The template's system prefix is the 34 tokens the pipeline drops, every word one token.
    prefix = PROMPT_TEMPLATE.split("{}")[0]
    assert (pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx) == (PROMPT_TEMPLATE, TEMPLATE_START_IDX)
    assert len(pipe.tokenizer(prefix).input_ids) == TEMPLATE_START_IDX
    ids = pipe.tokenizer(PROMPTS[2]).input_ids
    assert pipe.tokenizer.decode(ids) == PROMPTS[2]
    # Deterministic from the seed.
    again = tiny.build_tiny_pipeline(folder.parent / "again", seed=0)
    for name in ("transformer/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors",
                 "vae/diffusion_pytorch_model.safetensors", "tokenizer/tokenizer.json"):
        assert (again / name).read_bytes() == (folder / name).read_bytes(), name
    with pytest.raises(FileExistsError):
        tiny.build_tiny_pipeline(folder)  # atomic: never over an existing folder


# --- (a) the text encoder and its cache --------------------------------------------------------------
def test_text_encoder_is_the_pipelines_encode_prompt(pipe, encoder):
    with torch.no_grad():  # as in QwenImagePipeline.__call__
        for prompts in (PROMPTS, PROMPTS[1:2], [PROMPTS[0], PROMPTS[0]]):
            expected = pipe.encode_prompt(prompts, device="cpu")
            embeds, mask = encoder.encode(prompts)
            assert embeds.shape == expected[0].shape and embeds.dtype == expected[0].dtype
            assert torch.equal(embeds, expected[0]) and _mask_equal(mask, expected[1]), prompts
    embeds, mask = encoder.encode(PROMPTS)
    lengths = mask.sum(1).tolist()
    assert embeds.shape == (3, max(lengths), tiny.TRANSFORMER.joint_attention_dim) and len(set(lengths)) == 3
    assert torch.all(embeds[1, lengths[1]:] == 0)


def test_text_encoder_cuts_at_max_sequence_length(folder, pipe):
    with torch.no_grad():
        expected = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=5)
    embeds, mask = QwenImageTextEncoder(folder, max_sequence_length=5).encode(PROMPTS)
    assert embeds.shape[1] == 5 and torch.equal(embeds, expected[0]) and _mask_equal(mask, expected[1])
    for bad in (0, 1025, 2.0):
        assert_one_line_error(lambda: QwenImageTextEncoder(folder, max_sequence_length=bad),
                              r"^max_sequence_length must be an integer in 1\.\.1024")
    assert_one_line_error(lambda: QwenImageTextEncoder(folder / "nowhere"),
                          r"^no tokenizer/ in .*nowhere \(expected a diffusers Qwen-Image pipeline folder\)$",
                          FileNotFoundError)


def test_cache_serves_what_the_encoder_gives(encoder, tmp_path):
    path = save_text_embeddings(encoder, PROMPTS + PROMPTS[:1], tmp_path / "text.safetensors", batch_size=2)
    assert [p.name for p in tmp_path.iterdir()] == ["text.safetensors"]  # no temporary file left
    cache = TextEmbeddingCache(path)
    assert len(cache) == 3 and PROMPTS[1] in cache
    for prompts in (PROMPTS, PROMPTS[::-1], PROMPTS[1:2], [PROMPTS[2], PROMPTS[2]]):
        embeds, mask = cache.get(prompts)
        expected = encoder.encode(prompts)
        # saved in batches of 2: padded in another batch, the features differ by rounding only
        assert embeds.shape == expected[0].shape and _mask_equal(mask, expected[1])
        assert rel_err(embeds, expected[0]) <= 1e-6, prompts
    # One prompt alone is its features as encoded alone, with no mask.
    alone = cache.get(PROMPTS[0])
    assert alone[1] is None and rel_err(alone[0], encoder.encode(PROMPTS[:1])[0]) <= 1e-6


def test_cache_errors_are_one_line(encoder, tmp_path):
    from safetensors.torch import save_file

    path = save_text_embeddings(encoder, PROMPTS[:2], tmp_path / "text.safetensors")
    cache = TextEmbeddingCache(path)
    assert_one_line_error(lambda: cache.check(["owl", "a dragon"]),
                          r"^1 prompt\(s\) not in text-embedding cache .*text\.safetensors, e\.g\. 'a dragon'$")
    assert_one_line_error(lambda: cache.get(["a dragon"]), r"not in text-embedding cache")
    assert_one_line_error(lambda: TextEmbeddingCache(tmp_path / "none.safetensors"),
                          r"^no text-embedding cache at .*none\.safetensors", FileNotFoundError)
    save_file({"prompt_embeds": torch.zeros(1, 2)}, tmp_path / "other.safetensors")
    assert_one_line_error(lambda: TextEmbeddingCache(tmp_path / "other.safetensors"),
                          r"is not a Qwen-Image text-embedding cache")
    assert_one_line_error(lambda: save_text_embeddings(encoder, [], tmp_path / "empty.safetensors"),
                          r"^no prompts to encode$")


# --- (c) the sigma schedule ----------------------------------------------------------------------------
def _pipeline_sigmas(scheduler, steps, image_seq_len):
    """QwenImagePipeline.__call__'s step 5, on the scheduler `scheduler`."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

    cfg = scheduler.config
    mu = calculate_shift(image_seq_len, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                         cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
    timesteps, _ = retrieve_timesteps(scheduler, steps, "cpu", sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    return scheduler.sigmas, timesteps


@pytest.mark.parametrize("steps, height, width", [(STEPS, HEIGHT, WIDTH), (50, 1328, 1328), (16, 1664, 928)],
                         ids=["tiny", "1328", "1664x928"])
def test_sigmas_are_the_pipelines(pipe, steps, height, width):
    seq_len = int(np.prod(token_grid(height, width)))
    expected, timesteps = _pipeline_sigmas(pipe.scheduler, steps, seq_len)
    ours = qwen_sigmas.sigma_schedule(steps, seq_len)
    assert ours.dtype == torch.float32 and ours.shape == (steps + 1,)
    assert ours[0] == 1 and ours[-1] == 0 and torch.all(ours[1:] < ours[:-1])
    # float64 here, float32 in the scheduler (numpy): a few float32 roundings apart
    assert (ours - expected).abs().max() <= 4e-7
    assert abs(ours[-2].item() - qwen_sigmas.SCHEDULER_CONFIG["shift_terminal"]) <= 1e-7
    # The pipeline calls the transformer at timestep / 1000 with timesteps = sigmas x 1000 (float32):
    # sigma itself to within a float32 rounding.
    assert (timesteps / 1000 - expected[:-1]).abs().max() <= 6e-8


@pytest.mark.parametrize("config", [
    {"shift_terminal": None, "time_shift_type": "linear"},  # no stretch, the linear time shift
    {"use_dynamic_shifting": False, "shift": 3.0, "shift_terminal": None},  # FLUX-style static shift
], ids=["linear", "static"])
def test_sigmas_follow_other_scheduler_configs(config):
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(**{**qwen_sigmas.SCHEDULER_CONFIG, **config})
    expected, _ = _pipeline_sigmas(scheduler, 8, 1024)
    assert (qwen_sigmas.sigma_schedule(8, 1024, config) - expected).abs().max() <= 4e-7


def test_the_shared_schedule_is_qwen_images_without_its_terminal_stretch():
    """GRPOSchedule's sigmas (mm_grpo.rollout.sigma_schedule: linspace(1, 0, N + 1) under a fixed shift) at
    shift = exp(mu) are Qwen-Image's exponential time shift at mu, but not stretched to end at
    shift_terminal: a Qwen-Image run needs the family's schedule."""
    seq_len = int(np.prod(token_grid(HEIGHT, WIDTH)))
    cfg = qwen_sigmas.SCHEDULER_CONFIG
    mu = qwen_sigmas.calculate_shift(seq_len, cfg["base_image_seq_len"], cfg["max_image_seq_len"], cfg["base_shift"],
                                     cfg["max_shift"])
    shared = sigma_schedule(STEPS, shift=math.exp(mu))
    assert (shared - qwen_sigmas.sigma_schedule(STEPS, seq_len, {"shift_terminal": None})).abs().max() <= 1e-7
    assert (shared - qwen_sigmas.sigma_schedule(STEPS, seq_len)).abs().max() > 0.1


def test_sigmas_refuse_in_one_line():
    assert_one_line_error(lambda: qwen_sigmas.sigma_schedule(0, 12), r"^num_steps must be an integer >= 1, got 0$")
    assert_one_line_error(lambda: qwen_sigmas.sigma_schedule(4, 0), r"^image_seq_len must be an integer >= 1")
    assert_one_line_error(lambda: qwen_sigmas.sigma_schedule(1, 12), r"^num_steps must be >= 2 with shift_terminal")
    assert_one_line_error(lambda: qwen_sigmas.sigma_schedule(4, 12, {"use_karras_sigmas": True}),
                          r"^scheduler config use_karras_sigmas: True: not Qwen-Image's schedule")
    assert_one_line_error(lambda: qwen_sigmas.sigma_schedule(4, 12, {"time_shift_type": "cosine"}),
                          r"^scheduler config time_shift_type 'cosine'")


# --- (b) + (d) the pipeline's sampling, and mm-grpo's -------------------------------------------------
@pytest.fixture(scope="module")
def sampled(pipe):
    """QwenImagePipeline's true-CFG sampling of two prompts of different lengths from fixed noise: its
    latents and, the same sampling again, its images."""
    seq_len = int(np.prod(token_grid(HEIGHT, WIDTH)))
    noise = torch.randn(2, seq_len, pipe.transformer.config.in_channels, generator=torch.Generator().manual_seed(5))
    run = dict(prompt=PROMPTS[:2], negative_prompt=[NEGATIVE] * 2, true_cfg_scale=TRUE_CFG_SCALE, height=HEIGHT,
               width=WIDTH, num_inference_steps=STEPS, latents=noise)
    latents = pipe(**run, output_type="latent").images
    images = pipe(**run, output_type="pt").images
    return noise, latents, images


def test_vae_decoder_is_the_pipelines_last_step(folder, sampled):
    _, latents, images = sampled
    decoded = VaeDecoder(folder)(latents, HEIGHT, WIDTH)
    assert decoded.shape == images.shape == (2, 3, HEIGHT, WIDTH) and decoded.dtype == torch.float32
    assert torch.equal(decoded, images)
    assert 0 <= decoded.min() and decoded.max() <= 1 and decoded.std() > 0
    assert_one_line_error(lambda: VaeDecoder(folder)(latents, HEIGHT + 8, WIDTH),
                          r"^image size 56x64 must be positive multiples of 16")
    assert_one_line_error(lambda: VaeDecoder(folder / "transformer"),
                          r"^no vae/ in .*transformer \(expected a diffusers Qwen-Image pipeline folder\)$",
                          FileNotFoundError)


def test_encode_latents_is_the_normalised_posterior_mode(folder, pipe, sampled):
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_img2img import retrieve_latents

    images = sampled[2]
    vae = load_vae(folder)
    packed = encode_latents(vae, images)
    assert packed.shape == sampled[0].shape
    # QwenImageImg2ImgPipeline._encode_vae_image, the posterior's mode (its "argmax"), transcribed
    cfg, h, w = pipe.vae.config, HEIGHT // pipe.vae_scale_factor, WIDTH // pipe.vae_scale_factor
    with torch.no_grad():
        z = retrieve_latents(pipe.vae.encode(images[:, :, None] * 2 - 1), sample_mode="argmax")
    mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1)
    expected = pipe._pack_latents((z - mean) * inv_std, 2, cfg.z_dim, h, w)
    assert torch.equal(packed, expected)
    # pack_latents is the pipeline's packing, and VaeDecoder undoes the normalisation: the decoded
    # latents are the VAE's own decoding of the posterior mode.
    assert torch.equal(pack_latents(z), pipe._pack_latents(z, 2, cfg.z_dim, h, w))
    with torch.no_grad():
        direct = (pipe.vae.decode(z, return_dict=False)[0][:, :, 0] * 0.5 + 0.5).clamp(0, 1)
    assert rel_err(VaeDecoder(folder)(packed, HEIGHT, WIDTH), direct) <= 1e-5


def test_mm_grpo_ode_rollout_samples_the_pipelines_images(parallel_1proc, folder, pipe, encoder, sampled):
    """The GRPO schedule's rollout (`rollout` with the ode sampler) over QwenImageDenoiser's true-CFG
    velocity of the Megatron transformer, on the pipeline's sigmas, from the pipeline's noise: the
    pipeline's latents after every step's transformer call at sigma (it passes (sigma x 1000) / 1000),
    and its images."""
    noise, latents, images = sampled
    config = QwenImageConfig.from_diffusers_config(folder)
    model = load_hf_weights(QwenImageTransformer(config), folder).eval()
    negative = encoder.encode([NEGATIVE])
    assert negative[1] is None  # one prompt: no padding, no mask (as the pipeline's)
    denoiser = QwenImageDenoiser(HEIGHT, WIDTH, config.in_channels, TRUE_CFG_SCALE, negative)
    cond = denoiser.conditioning(encoder.encode(PROMPTS[:2]), None, torch.device("cpu"))
    assert cond["encoder_hidden_states_mask"] is not None  # the two prompts differ in length
    sigmas = qwen_sigmas.sigma_schedule(STEPS, noise.shape[1], qwen_sigmas.load_scheduler_config(folder))
    with torch.no_grad():
        traj = rollout(denoiser.velocity_fn([model], cond, micro_batch_size=2), noise, sigmas, "ode")
    assert denoiser.latent_shape == tuple(noise.shape[1:]) and not traj.is_sde.any()
    assert rel_err(traj.latents[:, -1], latents) <= TOL
    assert rel_err(traj.x0_hat, latents) <= TOL  # what the GRPO schedule decodes
    assert rel_err(traj.latents[:, -1], noise) > 0.1  # it moved
    decoded = VaeDecoder(folder)(traj.x0_hat, HEIGHT, WIDTH)
    assert rel_err(decoded, images) <= TOL
    # The sampling depends on what is matched here: GRPOSchedule's default sigmas (FLUX's shift 3) or no
    # true CFG miss the pipeline's latents.
    with torch.no_grad():
        flux_sigmas = rollout(denoiser.velocity_fn([model], cond, 2), noise, sigma_schedule(STEPS), "ode")
        unguided = rollout(QwenImageDenoiser(HEIGHT, WIDTH, config.in_channels).velocity_fn([model], cond, 2), noise,
                           sigmas, "ode")
    assert rel_err(flux_sigmas.latents[:, -1], latents) > 0.05 and rel_err(unguided.latents[:, -1], latents) > 0.05


def test_the_shipped_tiny_shapes_model_loads_and_samples_in_this_environment():
    """examples/qwen_image/tiny_shapes, written with transformers 5, is read by this environment's
    transformers (MindSpeed-MM's 4.57 reads the text encoder's `rope_scaling`) and diffusers' pipeline."""
    from diffusers import QwenImagePipeline
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "qwen_image",
                          "tiny_shapes")
    embeds, mask = QwenImageTextEncoder(folder).encode(["a red circle", "two blue squares on a white background"])
    assert embeds.shape == (2, 12, 32) and mask.sum(1).tolist() == [8, 12]
    assert embeds[0, 0, :3].tolist() == pytest.approx([-2.4328, -1.4211, -0.9599], abs=1e-4)  # either transformers
    pipe = QwenImagePipeline.from_pretrained(folder, torch_dtype=torch.float32)
    images = pipe(["a red circle"], height=64, width=64, num_inference_steps=2, true_cfg_scale=1.0,
                  output_type="pt", generator=torch.Generator().manual_seed(0)).images
    assert images.shape == (1, 3, 64, 64) and torch.isfinite(images).all()
