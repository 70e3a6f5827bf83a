"""mm-grpo's reward-server protocol: JSON over HTTP, images as PNG or JPEG bytes (docs/rewards.md).

    POST /score   {"prompts": [str, ...], "images": [base64 PNG / JPEG, ...]}
              ->  {"scores": [float | null, ...], "terms": {reward name: [float | null, ...]}}
    GET /health   {"status": "ok", "rewards": {name: weight}, "queued": int, "max_batch": int}

Only JSON and image bytes are parsed on either side (nothing is unpickled); a non-finite score
travels as null. An image is 8-bit RGB: a float image in [0, 1] is sent as round(255 x), the
quantisation every CLIP reward applies itself.
"""
import base64
import binascii
import io
import math
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image

from mm_grpo.rewards.base import uint8_pixels

SCORE_PATH = "/score"
HEALTH_PATH = "/health"
FORMATS = ("png", "jpeg")
MAX_PIXELS = 4096 * 4096  # per image: a decompression bomb is refused before it is decoded


class BadRequest(ValueError):
    """A request the server refuses (HTTP 400), with the reason as its one-line message."""


def encode_image(pixels: np.ndarray, fmt: str = "png", quality: int = 95) -> bytes:
    """One [H, W, 3] uint8 image as PNG (lossless) or JPEG (`quality`) bytes."""
    if fmt not in FORMATS:
        raise ValueError(f"image format must be one of {FORMATS}, got {fmt!r}")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt.upper(), **({"quality": quality} if fmt == "jpeg" else {}))
    return buffer.getvalue()


def decode_image(data: bytes, index: int) -> np.ndarray:
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format not in ("PNG", "JPEG"):
                raise BadRequest(f"image {index} is {image.format}, not PNG or JPEG")
            if image.width * image.height > MAX_PIXELS:
                raise BadRequest(f"image {index} has {image.width}x{image.height} pixels, more than {MAX_PIXELS}")
            return np.asarray(image.convert("RGB"))
    except BadRequest:
        raise
    except Exception as e:  # PIL raises several kinds for bytes that are not an image
        raise BadRequest(f"image {index} does not decode as PNG or JPEG ({type(e).__name__})") from None


def encode_request(images: torch.Tensor, prompts: Sequence[str], fmt: str = "png") -> dict:
    return {"prompts": list(prompts),
            "images": [base64.b64encode(encode_image(p, fmt)).decode("ascii") for p in uint8_pixels(images)]}


def decode_request(body: object) -> Tuple[torch.Tensor, List[str]]:
    """A parsed /score body -> (images [B, 3, H, W] float in [0, 1], prompts); BadRequest naming
    what is wrong."""
    if not isinstance(body, dict) or set(body) != {"prompts", "images"}:
        keys = sorted(body) if isinstance(body, dict) else type(body).__name__
        raise BadRequest(f'the body must be a JSON object with keys "images" and "prompts", got {keys}')
    prompts, images = body["prompts"], body["images"]
    if not (isinstance(prompts, list) and all(isinstance(p, str) for p in prompts)):
        raise BadRequest('"prompts" must be a list of strings')
    if not (isinstance(images, list) and all(isinstance(i, str) for i in images)):
        raise BadRequest('"images" must be a list of base64 strings')
    if len(images) != len(prompts) or not images:
        raise BadRequest(f"need one prompt per image and at least one image: {len(images)} images, "
                         f"{len(prompts)} prompts")
    pixels = []
    for i, text in enumerate(images):
        try:
            data = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise BadRequest(f"image {i} is not valid base64") from None
        pixels.append(decode_image(data, i))
    sizes = {p.shape for p in pixels}
    if len(sizes) > 1:
        raise BadRequest(f"the images of one request must have one size, got {sorted(sizes)}")
    return torch.from_numpy(np.stack(pixels)).permute(0, 3, 1, 2).float() / 255, prompts


def _json_values(values: torch.Tensor) -> List[Optional[float]]:
    return [v if math.isfinite(v) else None for v in values.double().tolist()]


def encode_response(total: torch.Tensor, terms: dict) -> dict:
    return {"scores": _json_values(total), "terms": {name: _json_values(v) for name, v in terms.items()}}


def decode_scores(body: object, count: int) -> torch.Tensor:
    """A /score response -> float32 [count] (null -> NaN); ValueError when it is not one."""
    scores = body.get("scores") if isinstance(body, dict) else None
    if not (isinstance(scores, list) and len(scores) == count
            and all(s is None or isinstance(s, (int, float)) for s in scores)):
        raise ValueError(f"the response holds no list of {count} scores: {str(body)[:120]}")
    return torch.tensor([math.nan if s is None else float(s) for s in scores], dtype=torch.float32)
