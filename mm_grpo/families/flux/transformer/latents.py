"""FLUX latent layout: 2x2 packing of VAE latents into image tokens, and their RoPE ids.

Same arithmetic as diffusers `FluxPipeline._pack_latents / _unpack_latents /
_prepare_latent_image_ids`, as plain functions so the trainer needs no pipeline object.
"""
import torch

VAE_SCALE_FACTOR = 8  # FLUX's VAE: three 2x downsamples
LATENT_FACTOR = 2 * VAE_SCALE_FACTOR  # image pixels per packed token side: the VAE's factor x 2x2 packing


def latent_size(height, width, vae_scale_factor=VAE_SCALE_FACTOR):
    """(h, w) of the VAE latent for an image; FLUX needs both sides divisible by 2x the VAE factor."""
    step = 2 * vae_scale_factor
    if height <= 0 or width <= 0 or height % step or width % step:
        raise ValueError(
            f"image size {height}x{width} must be positive multiples of {step}"
            f" (VAE factor {vae_scale_factor} x 2x2 packing)"
        )
    return height // vae_scale_factor, width // vae_scale_factor


def token_grid(height, width, vae_scale_factor=VAE_SCALE_FACTOR):
    """(rows, columns) of the packed latent's tokens for an image, one token per 2x2 latent patch."""
    h, w = latent_size(height, width, vae_scale_factor)
    return h // 2, w // 2


def num_image_tokens(height, width, vae_scale_factor=VAE_SCALE_FACTOR):
    """Sequence length of the packed latent."""
    rows, columns = token_grid(height, width, vae_scale_factor)
    return rows * columns


def pack_latents(latents):
    """[B, C, h, w] -> [B, (h/2)(w/2), 4C]: each 2x2 patch becomes one token, channels-major."""
    b, c, h, w = latents.shape
    latents = latents.view(b, c, h // 2, 2, w // 2, 2)
    latents = latents.permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(latents, height, width, vae_scale_factor=VAE_SCALE_FACTOR):
    """Inverse of `pack_latents` for an image of `height` x `width` pixels: -> [B, C, h, w]."""
    b, _, channels = latents.shape
    h, w = latent_size(height, width, vae_scale_factor)
    latents = latents.view(b, h // 2, w // 2, channels // 4, 2, 2)
    latents = latents.permute(0, 3, 1, 4, 2, 5)
    return latents.reshape(b, channels // 4, h, w)


def prepare_latent_image_ids(grid_height, grid_width, device=None, dtype=None):
    """RoPE positions of the packed tokens, [grid_h * grid_w, 3]: (0, row, column), row-major.

    `grid_*` are the packed grid sides (latent sides / 2). Built in float32 and cast,
    as diffusers does, so bf16 ids are bit-identical.
    """
    ids = torch.zeros(grid_height, grid_width, 3)
    ids[..., 1] = torch.arange(grid_height)[:, None]
    ids[..., 2] = torch.arange(grid_width)[None, :]
    return ids.reshape(grid_height * grid_width, 3).to(device=device, dtype=dtype)
