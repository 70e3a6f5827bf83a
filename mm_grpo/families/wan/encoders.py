"""Wan2.1's text encoder (umT5) and VAE, outside a pipeline object.

`UMT5Conditioner.encode` computes what `WanPipeline.encode_prompt` gives as prompt embeddings, and
`WanVaeDecoder` turns latents into frames in [0, 1] as WanPipeline's last step does, so the
trainer needs neither the pipeline nor its scheduler. `encode_video_latents` is the inverse of the
decoder's first step: the latents a Wan DiT is trained on.
"""
from pathlib import Path

import torch

from mm_grpo.versions import transformers_5

WAN_VAE_TEMPORAL = 4  # the VAE's stride in time: 4k + 1 frames <-> k + 1 latent frames
WAN_VAE_SPATIAL = 8  # and in height / width
WAN_LATENT_CHANNELS = 16  # Wan2.1's VAE
WAN_PATCH = (1, 2, 2)  # the DiT's patch (frames, rows, columns) over the latents
# The DiT's timestep is sigma x 1000: diffusers' WanTransformer3DModel and MindSpeed-MM's wan_flow_match_scheduler
# (num_train_timesteps 1000 in its configs) alike.
TIMESTEP_SCALE = 1000.0
# The unconditional prompt of classifier-free guidance: MindSpeed-MM's Wan2.1 default (its wan_pipeline.py's
# NEGATIVE_PROMOPT_DEFAULT, Wan2.1's own negative prompt in English).
WAN_NEGATIVE_PROMPT = ("Bright tones, overexposed, static, blurred details, subtitles, style, works, paintings, "
                       "images, static, overall gray, worst quality, low quality, JPEG compression residue, ugly, "
                       "incomplete, extra fingers, poorly drawn hands, poorly drawn faces, deformed, disfigured, "
                       "misshapen limbs, fused fingers, still picture, messy background, three legs, many people in "
                       "the background, walking backwards")
# The layouts MindSpeed-MM's WanDiT (wan_dit.py) does not run, for the launch check and the planner alike.
WANDIT_TP_REASON = ("MindSpeed-MM's wandit does not shard under tensor parallelism: its q / k RMSNorm spans the "
                    "whole hidden size (and its WanConverter has TP disabled)")
WANDIT_MICRO_BATCH_REASON = ("MindSpeed-MM's wandit computes one sample per micro-batch correctly: its head's "
                             "modulation has no sample axis")


def video_latent_shape(num_frames, height, width, channels=WAN_LATENT_CHANNELS):
    """(C, T, h, w) of the latents of a `num_frames` x `height` x `width` video."""
    if num_frames < 1 or (num_frames - 1) % WAN_VAE_TEMPORAL:
        raise ValueError(f"num_frames {num_frames}: Wan's VAE takes {WAN_VAE_TEMPORAL}k + 1 frames (77, 81, ...)")
    step = WAN_VAE_SPATIAL * WAN_PATCH[1]  # latent sides must split into whole 2x2 patches
    if height <= 0 or width <= 0 or height % step or width % step:
        raise ValueError(f"video size {height}x{width} must be positive multiples of {step}"
                         f" (VAE factor {WAN_VAE_SPATIAL} x the DiT's {WAN_PATCH[1]}x{WAN_PATCH[2]} patch)")
    return channels, (num_frames - 1) // WAN_VAE_TEMPORAL + 1, height // WAN_VAE_SPATIAL, width // WAN_VAE_SPATIAL


def video_token_grid(latent_grid, patch=WAN_PATCH):
    """(t, h, w) tokens of the DiT over a latent grid (T, h, w): one per patch (frames, rows, columns)."""
    t, h, w = latent_grid
    pt, ph, pw = patch
    if t % pt or h % ph or w % pw:
        raise ValueError(f"latent {t}x{h}x{w} does not split into patches {pt}x{ph}x{pw}")
    return t // pt, h // ph, w // pw


def component_folder(pipeline_dir, name, marker="config.json"):
    """`pipeline_dir`/`name`, a folder of a diffusers Wan pipeline; a one-line FileNotFoundError
    when it has no `marker` file."""
    folder = Path(pipeline_dir) / name
    if not (folder / marker).is_file():
        raise FileNotFoundError(f"no {name}/ in {pipeline_dir} (expected a diffusers Wan pipeline folder)")
    return folder


def load_tokenizer(pipeline_dir):
    """The umT5 tokenizer of a Wan pipeline folder, as the fast class: it reads tokenizer.json under
    transformers 4.x and 5 alike. A folder written under transformers 5 names T5Tokenizer in its
    model_index, a slow class in 4.x: there, load the pipeline with `tokenizer=None`, then
    `pipe.register_modules(tokenizer=load_tokenizer(folder))`."""
    from transformers import T5TokenizerFast

    # transformers 5 writes "extra_special_tokens": [] where 4.x expects a mapping.
    kwargs = {} if transformers_5() else {"extra_special_tokens": {}}
    folder = component_folder(pipeline_dir, "tokenizer", "tokenizer_config.json")
    return T5TokenizerFast.from_pretrained(folder, **kwargs)


class UMT5Conditioner:
    """umT5 from a Wan pipeline folder; `encode(prompts)` -> prompt_embeds [B, L, d_model]."""

    def __init__(self, pipeline_dir, device="cpu", dtype=torch.float32, max_sequence_length=512):
        from transformers import UMT5EncoderModel

        if max_sequence_length < 1:
            raise ValueError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
        self.device = torch.device(device)
        self.max_sequence_length = max_sequence_length
        self.tokenizer = load_tokenizer(pipeline_dir)
        encoder = UMT5EncoderModel.from_pretrained(component_folder(pipeline_dir, "text_encoder"), dtype=dtype)
        self.text_encoder = encoder.to(self.device).eval().requires_grad_(False)

    @torch.no_grad()
    def encode(self, prompts):
        return self.encode_with_mask(prompts)[0]

    @torch.no_grad()
    def encode_with_mask(self, prompts):
        """`encode`'s embeddings and the tokenizer's attention mask [B, L] (1: a prompt token)."""
        # WanPipeline's own text cleaning (ftfy when installed, HTML unescaping, whitespace).
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        if isinstance(prompts, str):
            prompts = [prompts]
        tokens = self.tokenizer(
            [prompt_clean(p) for p in prompts],
            padding="max_length",
            max_length=self.max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        ).to(self.device)
        # Unlike FLUX, Wan masks the padding in umT5's attention, then zeroes its outputs: the
        # DiT's cross-attention sees exact zeros past each prompt's end.
        prompt_embeds = self.text_encoder(tokens.input_ids, tokens.attention_mask).last_hidden_state
        seq_lens = tokens.attention_mask.gt(0).sum(dim=1)
        past_end = torch.arange(self.max_sequence_length, device=self.device)[None, :] >= seq_lens[:, None]
        prompt_embeds = prompt_embeds.to(self.text_encoder.dtype).masked_fill(past_end[..., None], 0)
        return prompt_embeds, tokens.attention_mask


def load_wan_vae(pipeline_dir, device="cpu", dtype=torch.float32):
    """The AutoencoderKLWan of a Wan pipeline folder, frozen, in eval mode."""
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan.from_pretrained(component_folder(pipeline_dir, "vae"), torch_dtype=dtype)
    return vae.to(device).eval().requires_grad_(False)


def _normalisation(vae, like):
    """(mean, 1 / std) [1, C, 1, 1, 1] of the VAE's per-channel latent normalisation, as WanPipeline
    writes them (it multiplies by 1 / std), so that results match it bit for bit."""
    cfg = vae.config
    mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(like)
    inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(like)
    return mean, inv_std


@torch.no_grad()
def encode_video_latents(vae, videos):
    """Videos [B, F, 3, H, W] in [0, 1] (F = 4k + 1) -> the latents a Wan DiT is trained on, [B, C, k + 1,
    H/8, W/8]: the posterior mode (deterministic), normalised per channel (the inverse of
    `WanVaeDecoder`'s first step; MindSpeed-MM's `channel_specified_shift_scale`: (z - mean) / std)."""
    x = videos.to(vae.device, vae.dtype).transpose(1, 2) * 2 - 1  # [B, 3, F, H, W] in [-1, 1]
    z = vae.encode(x).latent_dist.mode()
    mean, inv_std = _normalisation(vae, z)
    return (z - mean) * inv_std


class WanVaeDecoder:
    """Latents [B, C, T, h, w] -> frames [B, 4(T - 1) + 1, 3, 8h, 8w] float32 in [0, 1], on the VAE's device."""

    def __init__(self, pipeline_dir, device="cpu", dtype=torch.float32):
        self.device = torch.device(device)
        self.vae = load_wan_vae(pipeline_dir, self.device, dtype)

    @torch.no_grad()
    def __call__(self, latents):
        latents = latents.to(self.device, self.vae.dtype)
        # Undo the per-channel normalisation the DiT's latent space was trained in.
        mean, inv_std = _normalisation(self.vae, latents)
        video = self.vae.decode(latents / inv_std + mean, return_dict=False)[0]  # [B, 3, F, H, W] in [-1, 1]
        # VideoProcessor.postprocess_video(output_type="pt"): [-1, 1] -> [0, 1], frames first.
        return (video * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4).float().contiguous()
