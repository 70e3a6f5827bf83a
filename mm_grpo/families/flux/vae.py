"""FLUX's VAE: images to the latents the transformer is trained on (`encode_latents`), and packed
latents back to images in [0, 1], as FluxPipeline's last step does (`VaeDecoder`)."""
from pathlib import Path

import torch

from mm_grpo.families.flux.transformer.latents import unpack_latents


def load_vae(pipeline_dir, device="cpu", dtype=torch.float32):
    from diffusers import AutoencoderKL

    folder = Path(pipeline_dir) / "vae"
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"no VAE at {folder} (expected a diffusers pipeline folder with vae/config.json)")
    return AutoencoderKL.from_pretrained(folder, torch_dtype=dtype).to(device).eval().requires_grad_(False)


@torch.no_grad()
def encode_latents(vae, images):
    """Images [B, 3, H, W] in [0, 1] -> the latents FLUX's transformer is trained on, [B, C, H/8, W/8]:
    the posterior mode (deterministic), shifted and scaled (the inverse of VaeDecoder's first step;
    MindSpeed-MM's flux_vae: scale x (z - shift))."""
    z = vae.encode(images.to(vae.device, vae.dtype) * 2 - 1).latent_dist.mode()
    return (z - vae.config.shift_factor) * vae.config.scaling_factor


class VaeDecoder:
    """Packed latents [B, S, 4C] -> images [B, 3, H, W] float32 in [0, 1], on the VAE's device."""

    def __init__(self, pipeline_dir, device="cpu", dtype=torch.float32):
        self.vae = load_vae(pipeline_dir, device, dtype)
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.device = torch.device(device)

    @torch.no_grad()
    def __call__(self, packed_latents, height, width):
        cfg = self.vae.config
        latents = unpack_latents(packed_latents, height, width, self.vae_scale_factor)
        # Undo the normalisation the transformer's latent space was trained in.
        latents = latents / cfg.scaling_factor + cfg.shift_factor
        images = self.vae.decode(latents.to(self.device, self.vae.dtype), return_dict=False)[0]
        # VaeImageProcessor.denormalize: [-1, 1] -> [0, 1].
        return (images * 0.5 + 0.5).clamp(0, 1).float()
