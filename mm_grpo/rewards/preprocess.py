"""CLIP-family image preprocessing on the device, bit-exact with the PIL reference.

The reward models were trained (and their reference scorers run) on uint8 PIL images:
images are quantised to uint8 (as diffusers' `numpy_to_pil`), resized with PIL's bicubic
filter on the short side, center-cropped, then normalised. A float resize differs from
that by up to half a uint8 level everywhere (0.0075 after CLIP normalisation) and by
much more where PIL clips its intermediate rows, so this module reproduces PIL's
resampler itself (Pillow 13's Resample.c): the same separable filter weights in 22-bit
fixed point, the same pass order, round-half-up and clipping to uint8 after each pass.
The sums run as float32 matmuls over the weights split into two 11-bit halves, so they
are exact (every partial sum stays below 2^24) on any device, with or without TF32.
"""
import functools
from dataclasses import dataclass

import torch

_PRECISION_BITS = 22  # PIL's Resample.c, 8-bit images: 32 - 8 - 2
_SPLIT = 2**11
_EXACT_LIMIT = 2**24


def _bicubic(x):
    # PIL's bicubic kernel, a = -0.5, same operation order as Resample.c.
    a = -0.5
    x = abs(x)
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    if x < 2.0:
        return (((x - 5) * x + 8) * x - 4) * a
    return 0.0


@functools.lru_cache(maxsize=64)
def _pil_weights(in_size, out_size):
    """PIL's fixed-point bicubic weights as an [out, in] int64 matrix (precompute_coeffs + normalize_coeffs_8bpc)."""
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support = 2.0 * filterscale
    ss = 1.0 / filterscale
    rows = []
    for xx in range(out_size):
        center = (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), in_size)
        k = [_bicubic((x - center + 0.5) * ss) for x in range(xmin, xmax)]
        total = 0.0
        for w in k:  # left to right as PIL (Python >= 3.12's sum() compensates)
            total += w
        k = [w / total for w in k] if total != 0.0 else k
        row = [0] * in_size
        row[xmin:xmax] = [int(w * (1 << _PRECISION_BITS) + (0.5 if w >= 0 else -0.5)) for w in k]
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64)


@functools.lru_cache(maxsize=64)
def _split_weights(in_size, out_size, device):
    """(hi, lo) float32 matrices with weights = hi * 2^11 + lo, |hi|, |lo| <= 2^11 (exact in fp32 and tf32)."""
    w = _pil_weights(in_size, out_size)
    lo = torch.remainder(w + _SPLIT // 2, _SPLIT) - _SPLIT // 2
    hi = (w - lo) // _SPLIT
    # 255 * sum|row| bounds every partial sum of the matmul.
    if 255 * max(hi.abs().sum(1).max(), lo.abs().sum(1).max()) >= _EXACT_LIMIT:
        raise ValueError(f"resize {in_size} -> {out_size} is too large a reduction (over ~30x) for the exact resampler")
    return hi.float().to(device), lo.float().to(device)


def _resample_last_dim(x, out_size):
    """One PIL pass along the last dim of uint8-valued float32 `x`; returns uint8-valued float32."""
    hi, lo = _split_weights(x.shape[-1], out_size, x.device)
    with torch.autocast(x.device.type, enabled=False):
        acc = torch.matmul(x, hi.T).long() * _SPLIT + torch.matmul(x, lo.T).long()
    acc = (acc + (1 << (_PRECISION_BITS - 1))) >> _PRECISION_BITS  # round half up, as PIL
    return acc.clamp_(0, 255).float()


def pil_bicubic_resize(x, size):
    """Resize uint8-valued float [..., H, W] to `size` (h, w) exactly as PIL's Image.resize(BICUBIC)."""
    h, w = size
    in_h, in_w = x.shape[-2:]

    def horizontal(x):
        return _resample_last_dim(x, w) if x.shape[-1] != w else x

    def vertical(x):
        return _resample_last_dim(x.transpose(-1, -2), h).transpose(-1, -2) if x.shape[-2] != h else x

    # Pillow's pass order (Resample.c): vertical first when the height shrinks by more
    # than twice as many pixels as the width. The order changes the rounded result.
    if in_h - h > 0 and in_h - h > 2 * (in_w - w):
        return horizontal(vertical(x))
    return vertical(horizontal(x))


@dataclass(frozen=True)
class ClipPreprocess:
    """Short side -> `size` (bicubic), center crop `crop_size` (default `size`) square, normalise.

    `crop_offset`: "round" puts the crop where torchvision's CenterCrop does (open_clip),
    "floor" where transformers' image processors do; they differ by one pixel only
    when the margin is odd.
    """

    size: int
    mean: tuple
    std: tuple
    crop_offset: str = "round"
    crop_size: int | None = None

    def __post_init__(self):
        if self.crop_offset not in ("round", "floor"):
            raise ValueError(f"crop_offset must be 'round' or 'floor', got {self.crop_offset!r}")
        if (self.crop_size or self.size) > self.size:
            raise ValueError(f"crop_size {self.crop_size} is larger than the resized short side {self.size}")

    def resized_shape(self, height, width):
        # torchvision / transformers: the long side is truncated, not rounded.
        if height <= width:
            return self.size, int(self.size * width / height)
        return int(self.size * height / width), self.size

    def _offset(self, margin):
        return int(round(margin / 2.0)) if self.crop_offset == "round" else margin // 2

    def __call__(self, images):
        """images: float [B, 3, H, W] in [0, 1] -> normalised float32 [B, 3, crop, crop] on the same device."""
        crop = self.crop_size or self.size
        x = (images.float().clamp(0, 1) * 255).round()  # the uint8 image the reference scorers see
        x = pil_bicubic_resize(x, self.resized_shape(*x.shape[-2:]))
        top, left = self._offset(x.shape[-2] - crop), self._offset(x.shape[-1] - crop)
        x = x[..., top : top + crop, left : left + crop] / 255.0
        mean = torch.tensor(self.mean, device=x.device).view(3, 1, 1)
        std = torch.tensor(self.std, device=x.device).view(3, 1, 1)
        return (x - mean) / std
