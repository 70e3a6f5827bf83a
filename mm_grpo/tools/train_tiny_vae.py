"""Train a tiny VAE for reconstruction: FLUX's layout (diffusers `AutoencoderKL`) on an image folder,
Qwen-Image's (`AutoencoderKLQwenImage`, `--family qwen-image`: a causal video VAE run on one frame) on
the same folder, or Wan2.1's (`AutoencoderKLWan`, `--family wan`) on a video-caption folder.

    python -m mm_grpo.tools.train_tiny_vae --data DATA_DIR --out VAE_DIR [--steps 1500 --seed 0]
    python -m mm_grpo.tools.train_tiny_vae --family qwen-image --latent-channels 4 --data DATA_DIR --out VAE_DIR
    python -m mm_grpo.tools.train_tiny_vae --family wan --data VIDEO_DIR --out VAE_DIR [--steps 1500]

FLUX's architecture is the tiny pipeline's (factor 8, 4 latent channels = 16 packed channels);
Wan's is the tiny Wan pipeline's (`mm_grpo.families.wan.tiny`: factor 8 in space and 4 in time, a
causal encoder that takes 4k + 1 frames) with Wan2.1's 16 latent channels; Qwen-Image's is the same
architecture (the tiny Qwen-Image pipeline's, `mm_grpo.families.qwen_image.tiny`) on one-frame videos.
Choices, each measured on the shapes data (docs/demo.md), the same for both:
- the decoder reads the posterior mean plus Gaussian noise of a fixed fraction of the latents'
  spread (`latent_noise`), instead of a sample with a learnt variance and a KL term: a learnt
  variance starts at 1 and drowns the signal for hundreds of steps, while no noise at all gives
  a decoder that turns the small errors of a diffusion model's latents into stray blobs;
  Qwen-Image's (Wan's layout, per-pixel RMS norms) learns far slower under that noise: on the shapes
  data, 1,500 steps gave held-out L1 0.037 at noise 0.05 and 0.015 at 0 (docs/qwen_image.md), so its
  recipe trains it with `--latent-noise 0`;
- the pixel loss (L1 + squared error in [-1, 1]) weighs object pixels (those away from the
  image's median colour) and pixels next to an edge more: objects cover a tenth of the image,
  and their outlines are what tells a square from a circle;
- three latent channels (of FLUX's four) are pulled towards the image's mean colour over each 8x8
  cell (`anchor_weight`): without it the tiny VAE kept hue in too small a signal, and under the
  latent noise red and yellow both came back orange. It also keeps the latents image-like
  (smooth), which the diffusion transformer finds easier to model.
For videos, "image" reads "frame": the weights are each frame's, and a latent cell's mean colour is
over the pixels it encodes (its 8x8 square in the first frame alone, or in the group of 4 frames
that one latent frame encodes, as Wan's causal encoder groups them).
Afterwards the posterior means of the training data set the latents' normalisation, so the
transformer sees zero-mean, unit-variance latents: FLUX's `shift_factor` (their mean) and
`scaling_factor` (1 / their std), as FLUX's own VAE config arranges; Wan's and Qwen-Image's per-channel
`latents_mean` and `latents_std`, which WanPipeline / QwenImagePipeline undo before decoding, as their
configs hold them.
"""
import argparse
import dataclasses
import math
import os
import time
from typing import Tuple

import torch
import torch.nn.functional as F

from mm_grpo.data.image_captions import ImageCaptionDataset, VideoCaptionDataset
from mm_grpo.families.wan.encoders import WAN_LATENT_CHANNELS, WAN_VAE_TEMPORAL, video_latent_shape
from mm_grpo.files.atomic import atomic_dir
from mm_grpo.settings import add_setting_args, from_args, setting
from mm_grpo.families.flux import tiny
from mm_grpo.families.qwen_image import tiny as tiny_qwen_image
from mm_grpo.families.wan import tiny as tiny_wan
from mm_grpo.tiny.pipeline import seeded

FAMILIES = ("flux", "wan", "qwen-image")
VIDEO_VAES = {"wan": tiny_wan.VAE_CONFIG, "qwen-image": tiny_qwen_image.VAE_CONFIG}  # causal 3D, one layout


@dataclasses.dataclass(frozen=True)
class VaeTraining:
    family: str = setting("flux", "flux: FLUX's AutoencoderKL on an image folder; qwen-image: Qwen-Image's "
                                  "AutoencoderKLQwenImage on an image folder; wan: Wan2.1's AutoencoderKLWan on a "
                                  "video-caption folder", choices=list(FAMILIES))
    steps: int = setting(2000, "optimizer steps", minimum=1)
    batch_size: int = setting(8, "images (videos) per step", minimum=1)
    lr: float = setting(2e-3, "AdamW's learning rate, cosine decay to 0")
    latent_noise: float = setting(0.15, "noise std / std of the latents, added before decoding")
    anchor_weight: float = setting(1.0, "pull latent channels 0-2 to the mean colours of their 8x8 cells")
    foreground_weight: float = 10.0
    edge_weight: float = 20.0
    block_out_channels: Tuple[int, ...] = (8, 16, 32, 32)
    latent_channels: int = setting(WAN_LATENT_CHANNELS, "latent channels of Wan's or Qwen-Image's VAE (FLUX's "
                                                        "has the tiny transformer's 4)", minimum=4)  # 3 are colour-anchored
    seed: int = setting(0, "seed of the initial weights and the batches")


def build_vae(block_out_channels=(8, 16, 32, 32), seed=0, family="flux", latent_channels=WAN_LATENT_CHANNELS):
    """A random VAE of `family` whose stages have `block_out_channels` channels; Wan's and Qwen-Image's:
    those channels as a base width and multipliers, `latent_channels` latent channels, and a neutral
    normalisation (mean 0, std 1) until `train_vae` measures it."""
    from diffusers import AutoencoderKL, AutoencoderKLQwenImage, AutoencoderKLWan

    if family == "flux":
        config = dict(tiny.VAE_CONFIG, block_out_channels=list(block_out_channels))
        return seeded(seed, lambda: AutoencoderKL(**config))
    base, layout = block_out_channels[0], VIDEO_VAES[family]
    if any(c % base for c in block_out_channels) or len(block_out_channels) != len(layout["dim_mult"]):
        raise ValueError(f"{family}'s VAE takes {len(layout['dim_mult'])} stage widths, each a multiple "
                         f"of the first, got {tuple(block_out_channels)}")
    config = dict(layout, base_dim=base, dim_mult=[c // base for c in block_out_channels],
                  z_dim=latent_channels, latents_mean=[0.0] * latent_channels, latents_std=[1.0] * latent_channels)
    return seeded(seed, lambda: (AutoencoderKLWan if family == "wan" else AutoencoderKLQwenImage)(**config))


def per_frame(weigh, x):
    """`weigh` (images [N, 3, H, W] -> [N, 1, H, W]) applied to images, or to each frame of videos
    [B, 3, F, H, W] (-> [B, 1, F, H, W])."""
    if x.dim() == 4:
        return weigh(x)
    frames = x.transpose(1, 2).flatten(0, 1)
    return weigh(frames).unflatten(0, (x.shape[0], x.shape[2])).transpose(1, 2)


def cell_means(x, z):
    """The mean of `x` over the pixels each latent cell of `z` encodes: [B, 3, *z's grid]. Images:
    squares of the spatial factor; Wan's videos: the same squares in the first frame alone, then in
    each group of WAN_VAE_TEMPORAL frames (the chunks its causal encoder compresses into one
    latent frame)."""
    factor = x.shape[-1] // z.shape[-1]
    if x.dim() == 4:
        return F.avg_pool2d(x, factor)
    first = F.avg_pool3d(x[:, :, :1], (1, factor, factor))
    if x.shape[2] == 1:  # Qwen-Image's images: one frame
        return first
    return torch.cat([first, F.avg_pool3d(x[:, :, 1:], (WAN_VAE_TEMPORAL, factor, factor))], 2)


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
def posterior_means(vae, images, batch_size=256):
    """The posterior means of `images` [N, 3, H, W] (or videos [N, 3, F, H, W]) in [0, 1]."""
    return torch.cat([vae.encode(images[i:i + batch_size] * 2 - 1).latent_dist.mode()
                      for i in range(0, len(images), batch_size)])


def latent_statistics(vae, images, batch_size=256):
    """(mean, std) of the posterior means of `images` [N, 3, H, W] in [0, 1]."""
    means = posterior_means(vae, images, batch_size)
    return means.mean().item(), means.std().item()


def channel_statistics(vae, videos, batch_size=64):
    """(means, stds) per latent channel of the posterior means of `videos` [N, 3, F, H, W] in [0, 1]."""
    means = posterior_means(vae, videos, batch_size).transpose(0, 1).flatten(1)
    return means.mean(1).tolist(), means.std(1).tolist()


def normalise_latents(vae, data, family):
    """Register the latents' normalisation measured on `data` in the VAE's config (see the module docstring)."""
    if family == "flux":
        shift, std = latent_statistics(vae, data)
        vae.register_to_config(shift_factor=round(shift, 4), scaling_factor=round(1 / std, 4))
    else:
        means, stds = channel_statistics(vae, data)
        vae.register_to_config(latents_mean=[round(m, 4) for m in means], latents_std=[round(s, 4) for s in stds])


def train_vae(images, settings: VaeTraining = VaeTraining(), log_every=100):
    """A VAE trained on `images` [N, 3, H, W] (Wan: videos [N, 3, F, H, W]) in [0, 1]; deterministic
    for a seed (CPU)."""
    vae = build_vae(settings.block_out_channels, settings.seed, settings.family, settings.latent_channels)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=settings.lr, weight_decay=0.0)
    steps = settings.steps
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    generator = torch.Generator().manual_seed(settings.seed)
    start = time.time()
    for step in range(1, steps + 1):
        x = images[torch.randint(len(images), (settings.batch_size,), generator=generator)] * 2 - 1
        z = vae.encode(x).latent_dist.mode()
        anchor = ((z[:, :3] - cell_means(x, z)) ** 2).mean()
        z = z + settings.latent_noise * z.std().detach() * torch.randn(z.shape, generator=generator)
        err = vae.decode(z).sample - x
        weights = per_frame(lambda frames: pixel_weights(frames, settings.foreground_weight, settings.edge_weight), x)
        loss = (weights * (err.abs() + err ** 2)).mean() + settings.anchor_weight * anchor
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % log_every == 0 or step == steps:
            print(f"vae step {step:5d}/{steps} | loss {loss.item():.4f} | l1 {err.abs().mean().item():.4f} | "
                  f"{time.time() - start:.0f}s", flush=True)
    vae.eval().requires_grad_(False)
    normalise_latents(vae, images, settings.family)
    return vae


def save_vae(vae, out):
    """vae/ folder written to a temporary sibling and renamed into place."""
    with atomic_dir(out) as tmp:
        vae.save_pretrained(tmp, safe_serialization=True)
    return out


@torch.no_grad()
def reconstruct(vae, images):
    """Encode (posterior mean) and decode images (or Wan's videos [N, 3, F, H, W]) in [0, 1]."""
    return (vae.decode(vae.encode(images * 2 - 1).latent_dist.mode()).sample * 0.5 + 0.5).clamp(0, 1)


def training_data(folder, family, indices):
    """The data a family's VAE trains on: images [N, 3, H, W] of an image folder (Qwen-Image: as
    one-frame videos [N, 3, 1, H, W]); for Wan, videos [N, 3, F, H, W] of a video-caption folder, whose
    frame count and size are checked against the tiny Wan pipeline first (one line)."""
    if family == "flux":
        return ImageCaptionDataset(folder).images(indices)
    if family == "qwen-image":
        return ImageCaptionDataset(folder).images(indices)[:, :, None]
    dataset = VideoCaptionDataset(folder)
    frames, _, height, width = dataset.videos([0]).shape[1:]
    video_latent_shape(frames, height, width)  # 4k + 1 frames, sides the DiT's 2 x 2 patches split
    return dataset.videos(indices).transpose(1, 2)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mm_grpo.tools.train_tiny_vae",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="image-caption folder (metadata.jsonl + images); --family wan: "
                                                      "a video-caption folder (mm_grpo.data.motion generate)")
    parser.add_argument("--out", required=True, help="VAE folder to create (e.g. PIPELINE/vae)")
    add_setting_args(parser, VaeTraining)
    parser.add_argument("--held-out", type=int, default=256, help="last N images (videos): not trained on, reported")
    args = parser.parse_args(argv)
    try:
        training = from_args(VaeTraining, args)
        if training.family == "flux" and training.latent_channels != WAN_LATENT_CHANNELS:
            raise ValueError("--latent-channels sets Wan's or Qwen-Image's VAE (--family wan | qwen-image); "
                             "FLUX's tiny VAE has the tiny transformer's 4")
        total = len(ImageCaptionDataset(args.data))
        n = total - args.held_out
        if n < 1:
            raise ValueError(f"{args.data} has {total} examples: too few for --held-out {args.held_out}")
        if os.path.lexists(args.out):
            raise FileExistsError(f"{args.out} already exists: remove it or choose another --out")
        start = time.time()
        vae = train_vae(training_data(args.data, training.family, range(n)), training)
        save_vae(vae, args.out)
        report = f"vae: {sum(p.numel() for p in vae.parameters()):,} parameters"
        if args.held_out:
            images = training_data(args.data, training.family, range(n, total))
            err = (reconstruct(vae, images) - images).abs().mean().item()
            report += f"; reconstruction L1 {err:.4f} on {args.held_out} held-out examples (pixels in [0, 1])"
        print(f"{report}; {time.time() - start:.0f}s -> {args.out}", flush=True)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")


if __name__ == "__main__":
    main()
