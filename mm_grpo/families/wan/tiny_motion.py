"""The tiny "motion" Wan2.1 pipeline: the tiny Wan pipeline's layout (`tiny.py`) with a umT5
tokenizer learnt on the motion grammar (every word one token), a frozen random umT5, a VAE trained on
moving-shape videos and a DiT pretrained on them by flow matching in MindSpeed-MM's own
pretrain_sora.py. Here: its builders (the init pipeline, the files mm_to_hf needs, the trained DiT
swapped in), the diffusers DiT as a `Denoiser` and the held-out evaluation's settings and reference
levels. The command line (`python -m mm_grpo.tools.tiny_motion`) is a tool, since it evaluates with
training's `Evaluator`; examples/wan/build_tiny_motion.sh runs the whole recipe.
"""
import dataclasses
import glob
import json
import os
from pathlib import Path
from typing import Tuple

import numpy as np
import torch

from mm_grpo.data.motion import MIN_IMAGE_SIZE, enumerate_prompts, render_video
from mm_grpo.data.shapes import BACKGROUNDS
from mm_grpo.families.wan import tiny as tiny_wan
from mm_grpo.families.wan.encoders import (TIMESTEP_SCALE, WAN_LATENT_CHANNELS, component_folder,
                                           encode_video_latents, load_tokenizer, video_latent_shape)
from mm_grpo.files.atomic import atomic_dir
from mm_grpo.grpo.denoiser import Denoiser
from mm_grpo.grpo.hyperparameters import GRPOSettings
from mm_grpo.rewards.video import motion_scores
from mm_grpo.settings import setting
from mm_grpo.tiny.pipeline import seeded, write_pipeline
from mm_grpo.tiny.text import grammar_t5_tokenizer, t5_token_ids

# The tiny Wan DiT widened to learn the grammar: D = 4 heads x 24 = 96 (RoPE splits each head 8 / 8 / 8
# over frames / rows / columns), 4 blocks, a 4 x D feed-forward, a 64-wide sinusoidal time embedding;
# Wan2.1's 16 latent channels in and out.
TRANSFORMER_CONFIG = dict(tiny_wan.TRANSFORMER_CONFIG, num_attention_heads=4, ffn_dim=384, num_layers=4, freq_dim=64,
                          in_channels=WAN_LATENT_CHANNELS, out_channels=WAN_LATENT_CHANNELS)
TEXT_LEN = tiny_wan.TINY_TEXT_LEN  # the longest motion prompt is 10 words + </s>
# examples/wan/pretrain_model_motion.json's predictor block (tests/test_tiny_motion.py)
PREDICTOR = tiny_wan.wandit_predictor(TRANSFORMER_CONFIG, TEXT_LEN)
INDEX = "diffusion_pytorch_model.safetensors.index.json"  # what mm_to_hf's --cfg.hf_dir must hold
ONE_SHARD = "diffusion_pytorch_model-00001-of-00001.safetensors"  # mm_to_hf reads the shard number from the name


def grammar_corpus():
    """Every motion prompt, and one with each background phrase: the tokenizer's words."""
    prompts = enumerate_prompts()
    return [s.caption() for s in prompts] + [dataclasses.replace(prompts[0], background=b).caption()
                                             for b in BACKGROUNDS]


def build_init_pipeline(vae_dir, seed=0, transformer_config=TRANSFORMER_CONFIG):
    """WanPipeline with the trained VAE, a random (seeded) umT5 and DiT, and the tiny Wan scheduler."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    vae = AutoencoderKLWan.from_pretrained(vae_dir)
    if vae.config.z_dim != transformer_config["in_channels"]:
        raise ValueError(f"{vae_dir}: the VAE has {vae.config.z_dim} latent channels, the DiT takes "
                         f"{transformer_config['in_channels']} (train one with mm_grpo.tools.train_tiny_vae "
                         "--family wan)")
    tokenizer = grammar_t5_tokenizer(grammar_corpus())
    umt5_config = UMT5Config(**t5_token_ids(tokenizer), **tiny_wan.UMT5_CONFIG)
    return WanPipeline(
        scheduler=UniPCMultistepScheduler(**tiny_wan.SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=seeded(seed + 1, lambda: UMT5EncoderModel(umt5_config)),
        tokenizer=tokenizer,
        transformer=seeded(seed + 2, lambda: WanTransformer3DModel(**transformer_config)))


def write_converter_reference(init_dir, out):
    """`out`/config.json (the DiT's) and `out`/INDEX naming every weight in one shard: the files
    MindSpeed-MM's mm_to_hf copies from --cfg.hf_dir and splits its output by."""
    from safetensors import safe_open

    transformer = component_folder(init_dir, "transformer")
    with safe_open(str(transformer / "diffusion_pytorch_model.safetensors"), "pt") as f:
        names = sorted(f.keys())
    with atomic_dir(out) as tmp:
        Path(tmp, "config.json").write_text((transformer / "config.json").read_text())
        index = {"metadata": {}, "weight_map": {name: ONE_SHARD for name in names}}
        Path(tmp, INDEX).write_text(json.dumps(index, indent=1))
    return Path(out)


def load_converted(init_dir, converted_dir):
    """The init pipeline's DiT with the weights of every .safetensors file in `converted_dir`, which
    must hold exactly its parameters (mm_to_hf names its files model-NNNNN-of-NNNNN.safetensors,
    whatever the index it copies says)."""
    from diffusers import WanTransformer3DModel
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(converted_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {converted_dir} (the output of mm-convert WanConverter "
                                "mm_to_hf)")
    state = {}
    for file in files:
        state.update(load_file(file))
    config = WanTransformer3DModel.load_config(component_folder(init_dir, "transformer"))
    transformer = WanTransformer3DModel.from_config(config)
    missing, unexpected = transformer.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{converted_dir} does not hold the DiT of {init_dir}: {len(missing)} weights missing "
                         f"(e.g. {missing[:1]}), {len(unexpected)} unexpected (e.g. {unexpected[:1]})")
    return transformer


def finish_pipeline(init_dir, converted_dir, out):
    """The init pipeline with its DiT replaced by the trained one, saved to `out` (atomically)."""
    from diffusers import WanPipeline

    return write_pipeline(out, lambda: WanPipeline.from_pretrained(
        init_dir, transformer=load_converted(init_dir, converted_dir), tokenizer=load_tokenizer(init_dir)))


# --- held-out motion accuracy ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MotionEvaluation:
    num_frames: int = setting(9, "frames per video (4k + 1)", minimum=1)
    image_size: int = setting(32, "video side in pixels (a multiple of 16)", minimum=1)
    samples: int = setting(32, "ODE samples per prompt, from fixed noises", minimum=1)
    num_inference_steps: int = setting(GRPOSettings.num_inference_steps, "ODE steps (GRPO's held-out evaluation's)",
                                       minimum=1)
    sigma_shift: float = setting(GRPOSettings.sigma_shift, "shift of the sigma schedule (GRPO's)")
    seed: int = setting(0, "noise seed (a GRPO run's eval_seed: the same noises)")
    max_sequence_length: int = setting(TEXT_LEN, "umT5 tokens per prompt (model.json's text encoder's)", minimum=1)
    batch_size: int = setting(64, "videos per DiT call", minimum=1)


@dataclasses.dataclass(frozen=True)
class DiffusersWanDenoiser(Denoiser):
    """diffusers' WanTransformer3DModel behind the GRPO schedule's interface: the velocity of a batch
    in one call (it keeps samples apart, unlike MindSpeed-MM's wandit: docs/video.md)."""
    transformer: object
    latent_shape: Tuple[int, int, int, int]

    per_sample_keys = ("prompt",)
    shared_keys = ()

    def conditioning(self, text, rows, device):
        return {"prompt": (text if rows is None else text[rows.to(text.device)]).to(device)}

    def velocity_fn(self, chunks, cond, micro_batch_size):
        def velocity(x, sigma):
            with torch.no_grad():
                return self.transformer(x, sigma * TIMESTEP_SCALE, cond["prompt"], return_dict=False)[0].to(x.dtype)
        return velocity


def motion_breakdown(videos, prompts):
    """(motion [B], {motion, full credit, presence, travel}): the reward and its parts per video."""
    presence, travel, score = motion_scores(videos, prompts)
    return score, {"motion": score, "full_credit": (score >= 1).float(), "presence": presence, "travel": travel}


def reference_levels(prompts, settings: MotionEvaluation, vae=None):
    """{level: mean motion} over `settings.samples` rendered videos per prompt: `ceiling`, the
    renderer's videos of the prompt (what the detector confirms at best); `vae_ceiling` (with a Wan
    VAE), the same through the VAE (what perfect latents reach); `chance`, the prompt scored on videos
    of a random prompt of the grammar (a model that draws moving shapes but ignores the prompt)."""
    grammar = [s.caption() for s in enumerate_prompts()]
    asked = [p for p in prompts for _ in range(settings.samples)]
    drawn = {}
    for name in ("ceiling", "chance"):
        videos = []
        for i, prompt in enumerate(asked):
            rng = np.random.default_rng([settings.seed, i, name == "chance"])
            shown = prompt if name == "ceiling" else grammar[rng.integers(len(grammar))]
            seed = int(rng.integers(2 ** 31))
            videos.append(render_video(shown, settings.num_frames, settings.image_size, seed=seed))
        drawn[name] = torch.stack(videos)
    if vae is not None:
        videos = drawn["ceiling"].split(settings.batch_size)
        drawn["vae_ceiling"] = torch.cat([vae(encode_video_latents(vae.vae, v)) for v in videos])
    return {name: motion_scores(drawn[name], asked)[2].mean().item() for name in ("ceiling", "vae_ceiling", "chance")
            if name in drawn}


def check_video(num_frames: int, image_size: int):
    """The latent grid (T, h, w) of the video size; a one-line ValueError if Wan's VAE and DiT (4k + 1
    frames, sides multiples of 16) or the motion renderer cannot take it."""
    if image_size < MIN_IMAGE_SIZE:
        raise ValueError(f"image size {image_size}: the motion videos need >= {MIN_IMAGE_SIZE} pixels")
    return video_latent_shape(num_frames, image_size, image_size)[1:]
