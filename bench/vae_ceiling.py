"""What a shapes pipeline's VAE keeps of the reward: held-out images scored as rendered and after an
encode / decode round trip (the most a transformer trained in its latents can reach).

    python -m bench.vae_ceiling --pipeline examples/qwen_image/tiny_shapes --data DATA_DIR [--images 256]

DATA_DIR is a shapes image-caption folder (python -m mm_grpo.data.shapes generate); its last `--images`
images are the ones the recipes' VAE training holds out. The pipeline's family is read from its
model_index.json (FLUX or Qwen-Image). Prints the compositional reward's atoms met, full-prompt accuracy
and objects' F1 of the rendered and the reconstructed images, and the reconstruction's L1 (pixels in [0, 1]).
See docs/qwen_image.md ("The CPU demo").
"""
import argparse
import json
import os

import torch


def round_trip(pipeline_dir):
    """images [N, 3, H, W] in [0, 1] -> the same through the pipeline's VAE (posterior mean, decoded)."""
    with open(os.path.join(pipeline_dir, "model_index.json")) as f:
        pipeline_class = json.load(f)["_class_name"]
    if pipeline_class == "QwenImagePipeline":
        from diffusers import AutoencoderKLQwenImage
        vae = AutoencoderKLQwenImage.from_pretrained(pipeline_dir, subfolder="vae").eval()
        frames = lambda x: x[:, :, None]  # noqa: E731 -- one-frame videos
        image = lambda y: y[:, :, 0]  # noqa: E731
    else:
        from diffusers import AutoencoderKL
        vae = AutoencoderKL.from_pretrained(pipeline_dir, subfolder="vae").eval()
        frames = image = lambda x: x  # noqa: E731

    @torch.no_grad()
    def apply(x):
        z = vae.encode(frames(x) * 2 - 1).latent_dist.mode()
        return (image(vae.decode(z).sample) * 0.5 + 0.5).clamp(0, 1)
    return apply


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.vae_ceiling", description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", required=True, help="a shapes pipeline folder (FLUX or Qwen-Image)")
    parser.add_argument("--data", required=True, help="shapes image-caption folder")
    parser.add_argument("--images", type=int, default=256, help="the folder's last N images (held out of the VAE)")
    args = parser.parse_args(argv)
    from mm_grpo.data.image_captions import ImageCaptionDataset
    from mm_grpo.rewards.compositional import score
    data = ImageCaptionDataset(args.data)
    if not 0 < args.images <= len(data):
        parser.error(f"--images {args.images}: {args.data} has {len(data)} images")
    indices = range(len(data) - args.images, len(data))
    images, captions = data.images(indices), data.captions_of(indices)
    rebuilt = torch.cat([round_trip(args.pipeline)(images[i:i + 64]) for i in range(0, len(images), 64)])
    print("| images | atoms met | prompts met | objects' F1 |\n|---|---|---|---|")
    for name, x in (("rendered", images), ("through the VAE", rebuilt)):
        s = score(x, captions)
        print(f"| {name} | {s.fraction.float().mean():.3f} | {s.accuracy.float().mean():.3f} | "
              f"{s.f1.float().mean():.3f} |")
    print(f"reconstruction L1 {(rebuilt - images).abs().mean():.4f} on {args.images} held-out images")


if __name__ == "__main__":
    main()
