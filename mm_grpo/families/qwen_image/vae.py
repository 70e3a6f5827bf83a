"""Qwen-Image's VAE (AutoencoderKLQwenImage, a video VAE run on one frame): images to the packed latents
the transformer is trained on (`encode_latents`), and packed latents back to images in [0, 1], as
QwenImagePipeline's last step does (`VaeDecoder`)."""
import torch

from mm_grpo.families.qwen_image.denoiser import PATCH
from mm_grpo.families.qwen_image.text import component_folder


def load_vae(pipeline_dir, device="cpu", dtype=torch.float32):
    """The AutoencoderKLQwenImage of a pipeline folder, frozen, in eval mode."""
    from diffusers import AutoencoderKLQwenImage

    vae = AutoencoderKLQwenImage.from_pretrained(component_folder(pipeline_dir, "vae"), torch_dtype=dtype)
    return vae.to(device).eval().requires_grad_(False)


def vae_scale_factor(vae) -> int:
    """Pixels per latent side: QwenImagePipeline's 2 ** len(temperal_downsample)."""
    return 2 ** len(vae.config.temperal_downsample)


def latent_size(vae, height: int, width: int):
    """(h, w) of the VAE latents of an image; both sides must split into whole 2 x 2 patches of latents."""
    step = vae_scale_factor(vae) * PATCH
    if height <= 0 or width <= 0 or height % step or width % step:
        raise ValueError(f"image size {height}x{width} must be positive multiples of {step} "
                         f"(VAE factor {vae_scale_factor(vae)} x {PATCH}x{PATCH} packing)")
    return height // vae_scale_factor(vae), width // vae_scale_factor(vae)


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, 1, h, w] -> [B, (h/2)(w/2), 4C]: each 2 x 2 patch one token, channels-major
    (QwenImagePipeline._pack_latents)."""
    b, c, _, h, w = latents.shape
    latents = latents.view(b, c, h // PATCH, PATCH, w // PATCH, PATCH).permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(b, (h // PATCH) * (w // PATCH), c * PATCH * PATCH)


def unpack_latents(latents: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of `pack_latents` for latents of h x w: -> [B, C, 1, h, w] (QwenImagePipeline._unpack_latents)."""
    b, _, channels = latents.shape
    c = channels // (PATCH * PATCH)
    latents = latents.view(b, h // PATCH, w // PATCH, c, PATCH, PATCH).permute(0, 3, 1, 4, 2, 5)
    return latents.reshape(b, c, 1, h, w)


def _normalisation(vae, like):
    """(mean, 1 / std) [1, C, 1, 1, 1] of the VAE config's per-channel latent normalisation, as
    QwenImagePipeline writes them (it divides by 1 / std), so that results match it bit for bit."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    return (torch.tensor(vae.config.latents_mean).view(shape).to(like),
            1.0 / torch.tensor(vae.config.latents_std).view(shape).to(like))


@torch.no_grad()
def encode_latents(vae, images):
    """Images [B, 3, H, W] in [0, 1] -> the packed latents Qwen-Image's transformer is trained on,
    [B, (H/16)(W/16), 4 z_dim]: the posterior mode of the one-frame video (deterministic), normalised
    per channel as QwenImageImg2ImgPipeline._encode_vae_image does, (z - mean) / std (the inverse of
    VaeDecoder's first step)."""
    latent_size(vae, *images.shape[-2:])
    x = images.to(vae.device, vae.dtype)[:, :, None] * 2 - 1  # [B, 3, 1, H, W] in [-1, 1]
    z = vae.encode(x).latent_dist.mode()
    mean, inv_std = _normalisation(vae, z)
    return pack_latents((z - mean) * inv_std)


class VaeDecoder:
    """Packed latents [B, S, 4 z_dim] -> images [B, 3, H, W] float32 in [0, 1], on the VAE's device."""

    def __init__(self, pipeline_dir, device="cpu", dtype=torch.float32):
        self.device = torch.device(device)
        self.vae = load_vae(pipeline_dir, self.device, dtype)

    @torch.no_grad()
    def __call__(self, packed_latents, height, width):
        latents = unpack_latents(packed_latents, *latent_size(self.vae, height, width)).to(self.device, self.vae.dtype)
        # Undo the per-channel normalisation the transformer's latent space was trained in.
        mean, inv_std = _normalisation(self.vae, latents)  # latents x std + mean
        images = self.vae.decode(latents / inv_std + mean, return_dict=False)[0][:, :, 0]  # frame 0, in [-1, 1]
        # VaeImageProcessor.denormalize: [-1, 1] -> [0, 1].
        return (images * 0.5 + 0.5).clamp(0, 1).float()
