"""Train a tiny FLUX-layout VAE (diffusers `AutoencoderKL`) for reconstruction on an image folder.

    python -m mm_grpo.tools.train_tiny_vae --data DATA_DIR --out VAE_DIR [--steps 1500 --seed 0]

The architecture is the tiny pipeline's (factor 8, 4 latent channels = 16 packed channels).
Choices, each measured on the shapes data (docs/demo.md):
- the decoder reads the posterior mean plus Gaussian noise of a fixed fraction of the latents'
  spread (`latent_noise`), instead of a sample with a learnt variance and a KL term: a learnt
  variance starts at 1 and drowns the signal for hundreds of steps, while no noise at all gives
  a decoder that turns the small errors of a diffusion model's latents into stray blobs;
- the pixel loss (L1 + squared error in [-1, 1]) weighs object pixels (those away from the
  image's median colour) and pixels next to an edge more: objects cover a tenth of the image,
  and their outlines are what tells a square from a circle;
- three of the four latent channels are pulled towards the image's mean colour over each 8x8
  cell (`anchor_weight`): without it the tiny VAE kept hue in too small a signal, and under the
  latent noise red and yellow both came back orange. It also keeps the latents image-like
  (smooth), which the diffusion transformer finds easier to model.
Afterwards the posterior means of the training images set `shift_factor` (their mean) and
`scaling_factor` (1 / their std), so the transformer sees zero-mean, unit-variance latents, as
FLUX's own VAE config arranges.
"""
import argparse
import dataclasses
import math
import time
from typing import Tuple

import torch
import torch.nn.functional as F

from mm_grpo.data.image_captions import ImageCaptionDataset
from mm_grpo.files.atomic import atomic_dir
from mm_grpo.settings import add_setting_args, from_args, setting
from mm_grpo.tools.tiny import VAE_CONFIG


@dataclasses.dataclass(frozen=True)
class VaeTraining:
    steps: int = setting(2000, "optimizer steps", minimum=1)
    batch_size: int = setting(8, "images per step", minimum=1)
    lr: float = setting(2e-3, "AdamW's learning rate, cosine decay to 0")
    latent_noise: float = setting(0.15, "noise std / std of the latents, added before decoding")
    anchor_weight: float = setting(1.0, "pull latent channels 0-2 to the image's 8x8 mean colours")
    foreground_weight: float = 10.0
    edge_weight: float = 20.0
    block_out_channels: Tuple[int, ...] = (8, 16, 32, 32)
    seed: int = setting(0, "seed of the initial weights and the batches")


def build_vae(block_out_channels=(8, 16, 32, 32), seed=0):
    from diffusers import AutoencoderKL

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoencoderKL(**dict(VAE_CONFIG, block_out_channels=list(block_out_channels)))


def pixel_weights(x, foreground_weight, edge_weight):
    """[B, 1, H, W] loss weights for images x in [-1, 1]: 1, + foreground_weight on pixels away
    from the image's median colour (the background), + edge_weight within a pixel of an edge."""
    background = x.flatten(2).median(-1).values[:, :, None, None]
    foreground = ((x - background).abs().sum(1, keepdim=True) > 0.2).float()
    dx = (x[..., :, 1:] - x[..., :, :-1]).abs().amax(1, keepdim=True) > 0.2
    dy = (x[..., 1:, :] - x[..., :-1, :]).abs().amax(1, keepdim=True) > 0.2
    edge = F.pad(dx, (0, 1)) | F.pad(dx, (1, 0)) | F.pad(dy, (0, 0, 0, 1)) | F.pad(dy, (0, 0, 1, 0))
    edge = F.max_pool2d(edge.float(), 3, stride=1, padding=1)
    return 1 + foreground_weight * foreground + edge_weight * edge


@torch.no_grad()
def latent_statistics(vae, images, batch_size=256):
    """(mean, std) of the posterior means of `images` [N, 3, H, W] in [0, 1]."""
    means = torch.cat([vae.encode(images[i:i + batch_size] * 2 - 1).latent_dist.mode()
                       for i in range(0, len(images), batch_size)])
    return means.mean().item(), means.std().item()


def train_vae(images, settings: VaeTraining = VaeTraining(), log_every=100):
    """A VAE trained on `images` [N, 3, H, W] in [0, 1]; deterministic for a seed (CPU)."""
    vae = build_vae(settings.block_out_channels, settings.seed)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=settings.lr, weight_decay=0.0)
    steps = settings.steps
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    generator = torch.Generator().manual_seed(settings.seed)
    start = time.time()
    for step in range(1, steps + 1):
        x = images[torch.randint(len(images), (settings.batch_size,), generator=generator)] * 2 - 1
        z = vae.encode(x).latent_dist.mode()
        anchor = ((z[:, :3] - F.avg_pool2d(x, x.shape[-1] // z.shape[-1])) ** 2).mean()
        z = z + settings.latent_noise * z.std().detach() * torch.randn(z.shape, generator=generator)
        err = vae.decode(z).sample - x
        weights = pixel_weights(x, settings.foreground_weight, settings.edge_weight)
        loss = (weights * (err.abs() + err ** 2)).mean() + settings.anchor_weight * anchor
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % log_every == 0 or step == steps:
            print(f"vae step {step:5d}/{steps} | loss {loss.item():.4f} | l1 {err.abs().mean().item():.4f} | "
                  f"{time.time() - start:.0f}s", flush=True)
    vae.eval().requires_grad_(False)
    shift, std = latent_statistics(vae, images)
    vae.register_to_config(shift_factor=round(shift, 4), scaling_factor=round(1 / std, 4))
    return vae


def save_vae(vae, out):
    """vae/ folder written to a temporary sibling and renamed into place."""
    with atomic_dir(out) as tmp:
        vae.save_pretrained(tmp, safe_serialization=True)
    return out


@torch.no_grad()
def reconstruct(vae, images):
    """Encode (posterior mean) and decode images in [0, 1]."""
    return (vae.decode(vae.encode(images * 2 - 1).latent_dist.mode()).sample * 0.5 + 0.5).clamp(0, 1)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mm_grpo.tools.train_tiny_vae",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="image-caption folder (metadata.jsonl + images)")
    parser.add_argument("--out", required=True, help="VAE folder to create (e.g. PIPELINE/vae)")
    add_setting_args(parser, VaeTraining)
    parser.add_argument("--held-out", type=int, default=256, help="last N images: not trained on, reported")
    args = parser.parse_args(argv)
    try:
        training = from_args(VaeTraining, args)
        dataset = ImageCaptionDataset(args.data)
        n = len(dataset) - args.held_out
        if n < 1:
            raise ValueError(f"{args.data} has {len(dataset)} images: too few for --held-out {args.held_out}")
        start = time.time()
        vae = train_vae(dataset.images(range(n)), training)
        save_vae(vae, args.out)
        report = f"vae: {sum(p.numel() for p in vae.parameters()):,} parameters"
        if args.held_out:
            images = dataset.images(range(n, len(dataset)))
            err = (reconstruct(vae, images) - images).abs().mean().item()
            report += f"; reconstruction L1 {err:.4f} on {args.held_out} held-out images (pixels in [0, 1])"
        print(f"{report}; {time.time() - start:.0f}s -> {args.out}", flush=True)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")


if __name__ == "__main__":
    main()
