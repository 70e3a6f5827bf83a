"""DDPO's JPEG rewards: file size at quality 95, in kB (incompressibility) or its negative.

No weights. The size is defined by PIL's encoder, so images go to the host once.
"""
import io

import torch

from mm_grpo.rewards.base import Reward, register_reward, uint8_pixels


def jpeg_size_kb(images, quality=95):
    """Per-image JPEG size in kB (1000 bytes) of the uint8 rendering of images [B, 3, H, W] in [0, 1]."""
    from PIL import Image

    sizes = []
    for array in uint8_pixels(images):
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000)
    return torch.tensor(sizes, dtype=torch.float32, device=images.device)


@register_reward("jpeg_incompressibility")
class JpegIncompressibility(Reward):
    sign = 1.0

    def score(self, images, prompts):
        return self.sign * jpeg_size_kb(images)


@register_reward("jpeg_compressibility")
class JpegCompressibility(JpegIncompressibility):
    sign = -1.0
