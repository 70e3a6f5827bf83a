"""On-device CLIP preprocessing vs the PIL reference paths (open_clip's transform, transformers' PIL processor)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from mm_grpo.rewards import ClipPreprocess, pil_bicubic_resize
from tests.utils import clip_pil_image_processor

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


def _image(kind, h, w, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "noise":  # worst case: PIL clips its intermediate rows
        return torch.rand(1, 3, h, w, generator=g)
    coarse = torch.rand(1, 3, max(h // 16, 2), max(w // 16, 2), generator=g)
    return F.interpolate(coarse, size=(h, w), mode="bicubic", align_corners=False).clamp(0, 1)


def _pil(image):
    return Image.fromarray((image[0] * 255).round().to(torch.uint8).permute(1, 2, 0).numpy())


# 224x299: no resize and an odd crop margin, where open_clip's and transformers' offsets differ.
SHAPES = [("noise", 64, 96), ("smooth", 333, 250), ("noise", 400, 300), ("smooth", 512, 512), ("noise", 224, 299)]


@pytest.mark.parametrize("kind,h,w", SHAPES)
def test_matches_open_clip_transform(kind, h, w):
    from open_clip.transform import image_transform

    image = _image(kind, h, w)
    ref = image_transform(224, is_train=False, mean=OPENAI_MEAN, std=OPENAI_STD)(_pil(image))[None]
    ours = ClipPreprocess(224, OPENAI_MEAN, OPENAI_STD, crop_offset="round")(image)
    assert ours.shape == ref.shape == (1, 3, 224, 224)
    assert (ours - ref).abs().max() <= 1e-3  # in practice ~1e-7: same uint8 pixels


@pytest.mark.parametrize("kind,h,w", SHAPES)
def test_matches_transformers_pil_processor(kind, h, w):
    image = _image(kind, h, w, seed=1)
    ref = clip_pil_image_processor()()(images=_pil(image), return_tensors="pt").pixel_values
    ours = ClipPreprocess(224, OPENAI_MEAN, OPENAI_STD, crop_offset="floor")(image)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max() <= 1e-3


def test_float_resize_would_not_pass():
    # Why the PIL resampler is reproduced: a plain float bicubic resize misses by far more than 1e-3.
    image = _image("smooth", 333, 250)
    ref = torch.from_numpy(np.array(_pil(image).resize((224, 298), Image.BICUBIC))).permute(2, 0, 1)[None] / 255.0
    plain = F.interpolate((image * 255).round() / 255, size=(298, 224), mode="bicubic", antialias=True).clamp(0, 1)
    ours = pil_bicubic_resize((image * 255).round(), (298, 224)) / 255.0
    assert (plain - ref).abs().max() > 1e-3
    assert torch.equal(ours, ref)


def test_pil_resize_exact_over_random_sizes():
    g = torch.Generator().manual_seed(2)
    sizes = torch.randint(3, 160, (40, 4), generator=g).tolist()
    for h, w, out_h, out_w in sizes:  # enlarging, shrinking and mixed: both of PIL's pass orders
        image = torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8)
        ref = np.array(Image.fromarray(image.permute(1, 2, 0).numpy()).resize((out_w, out_h), Image.BICUBIC))
        ours = pil_bicubic_resize(image.float(), (out_h, out_w))
        assert torch.equal(ours, torch.from_numpy(ref).permute(2, 0, 1).float()), (h, w, out_h, out_w)


def test_preprocess_batch_and_bf16_input():
    images = torch.cat([_image("smooth", 96, 128, seed=s) for s in range(3)])
    pp = ClipPreprocess(224, OPENAI_MEAN, OPENAI_STD)
    batched = pp(images)
    assert torch.equal(batched[1:2], pp(images[1:2]))
    assert batched.dtype == torch.float32
    half = images.bfloat16()
    assert torch.equal(pp(half), pp(half.float()))
    with pytest.raises(ValueError, match="crop_offset"):
        ClipPreprocess(224, OPENAI_MEAN, OPENAI_STD, crop_offset="ceil")
