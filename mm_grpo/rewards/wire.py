"""mm-grpo's reward-server protocol: JSON over HTTP, images as PNG or JPEG bytes (docs/rewards.md).

    POST /score   {"prompts": [str, ...], "images": [base64 PNG / JPEG, ...]}
              ->  {"scores": [float | null, ...], "terms": {reward name: [float | null, ...]}}
    GET /health   {"status": "ok", "rewards": {name: weight}, "queued": int, "max_batch": int}

Only JSON and image bytes are parsed on either side (nothing is unpickled); a non-finite score
travels as null. An image is 8-bit RGB: a float image in [0, 1] is sent as round(255 x), the
quantisation every CLIP reward applies itself. The server counts a request's images and reads
their headers (sizes) before it decodes any (`parse_request`): a request over its budget is
refused first. A server started with a token wants `Authorization: Bearer <token>` on every
request; the `remote` reward sends $MM_GRPO_REWARD_TOKEN when it is set.
"""
import base64
import binascii
import dataclasses
import io
import math
import re
import reprlib
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image

from mm_grpo.rewards.base import uint8_pixels

SCORE_PATH = "/score"
HEALTH_PATH = "/health"
FORMATS = ("png", "jpeg")
MAX_PIXELS = 4096 * 4096  # per image: a decompression bomb is refused before it is decoded
MPX = 2 ** 20  # pixels in the unit of the server's pixel budgets
TOKEN_ENV = "MM_GRPO_REWARD_TOKEN"  # the bearer token, read by the server (its default) and the `remote` reward
NOT_A_TOKEN = re.compile(r"[^!-~]")  # a bearer token is visible ASCII: a header carries nothing else unchanged


class BadRequest(ValueError):
    """A request the server refuses (HTTP 400), with the reason as its one-line message."""
    status = 400


class RequestTooLarge(BadRequest):
    """A request over the server's budget (HTTP 413), refused before its images are decoded."""
    status = 413


def encode_image(pixels: np.ndarray, fmt: str = "png", quality: int = 95) -> bytes:
    """One [H, W, 3] uint8 image as PNG (lossless) or JPEG (`quality`) bytes."""
    if fmt not in FORMATS:
        raise ValueError(f"image format must be one of {FORMATS}, got {fmt!r}")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt.upper(), **({"quality": quality} if fmt == "jpeg" else {}))
    return buffer.getvalue()


def _open(data: bytes, index: int) -> Image.Image:
    """The image in `data` with its header read and nothing decoded yet; BadRequest unless it is
    a PNG or JPEG of at most MAX_PIXELS."""
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only: the size costs nothing
    except Exception as e:  # PIL raises several kinds for bytes that are not an image
        raise BadRequest(f"image {index} does not decode as PNG or JPEG ({type(e).__name__})") from None
    if image.format not in ("PNG", "JPEG"):
        image.close()
        raise BadRequest(f"image {index} is {image.format}, not PNG or JPEG")
    if image.width * image.height > MAX_PIXELS:
        image.close()
        raise BadRequest(f"image {index} has {image.width}x{image.height} pixels, more than {MAX_PIXELS}")
    return image


def image_size(data: bytes, index: int) -> Tuple[int, int]:
    """(width, height) from the PNG / JPEG header alone."""
    with _open(data, index) as image:
        return image.size


def decode_image(data: bytes, index: int) -> np.ndarray:
    """PNG / JPEG bytes -> [H, W, 3] uint8; BadRequest naming the image."""
    with _open(data, index) as image:
        try:
            return np.asarray(image.convert("RGB"))
        except Exception as e:  # a header that reads, a body that does not
            raise BadRequest(f"image {index} does not decode as PNG or JPEG ({type(e).__name__})") from None


def encode_request(images: torch.Tensor, prompts: Sequence[str], fmt: str = "png") -> dict:
    return {"prompts": list(prompts),
            "images": [base64.b64encode(encode_image(p, fmt)).decode("ascii") for p in uint8_pixels(images)]}


@dataclasses.dataclass
class ScoreRequest:
    """A /score body checked up to the images' headers: nothing decoded yet."""
    images: List[bytes]  # PNG / JPEG bytes, one size
    prompts: List[str]
    width: int
    height: int

    @property
    def pixels(self) -> int:
        """Pixels of all its images once decoded (3 bytes each as 8-bit RGB)."""
        return len(self.images) * self.width * self.height


def parse_request(body: object, max_images: Optional[int] = None, max_pixels: Optional[int] = None) -> ScoreRequest:
    """A parsed /score body -> ScoreRequest, checked before any pixel is decoded: the number of
    images (from the list's length) and then their pixels (from each header) against the
    server's budget (RequestTooLarge), their format and their one size (BadRequest)."""
    if not isinstance(body, dict) or set(body) != {"prompts", "images"}:
        keys = sorted(body) if isinstance(body, dict) else type(body).__name__
        raise BadRequest(f'the body must be a JSON object with keys "images" and "prompts", got {keys}')
    prompts, images = body["prompts"], body["images"]
    if max_images is not None and isinstance(images, list) and len(images) > max_images:
        raise RequestTooLarge(f"the request has {len(images)} images, more than --max-images-per-request {max_images}")
    if not (isinstance(prompts, list) and all(isinstance(p, str) for p in prompts)):
        raise BadRequest('"prompts" must be a list of strings')
    if not (isinstance(images, list) and all(isinstance(i, str) for i in images)):
        raise BadRequest('"images" must be a list of base64 strings')
    if len(images) != len(prompts) or not images:
        raise BadRequest(f"need one prompt per image and at least one image: {len(images)} images, "
                         f"{len(prompts)} prompts")
    data = [_base64(text, i) for i, text in enumerate(images)]
    sizes = [image_size(d, i) for i, d in enumerate(data)]
    if len(set(sizes)) > 1:
        raise BadRequest(f"the images of one request must have one size, got {sorted(set(sizes))}")
    request = ScoreRequest(data, prompts, *sizes[0])
    if max_pixels is not None and request.pixels > max_pixels:
        raise RequestTooLarge(f"the request's {len(data)} images of {request.width}x{request.height} are "
                              f"{request.pixels / MPX:g} Mpx decoded, more than --max-request-mpx {max_pixels / MPX:g}")
    return request


def _base64(text: str, index: int) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"image {index} is not valid base64") from None


def decode_images(request: ScoreRequest) -> torch.Tensor:
    """The request's images -> uint8 [B, 3, H, W] (8-bit RGB, 3 bytes a pixel: the scorer makes
    floats one batch at a time), each decoded straight into its row."""
    pixels = np.empty((len(request.images), request.height, request.width, 3), dtype=np.uint8)
    for i, data in enumerate(request.images):
        decoded = decode_image(data, i)
        if decoded.shape != pixels.shape[1:]:  # a header that lies about the size
            raise BadRequest(f"image {i} decodes to {decoded.shape[1]}x{decoded.shape[0]}, its header says "
                             f"{request.width}x{request.height}")
        pixels[i] = decoded
    return torch.from_numpy(pixels).permute(0, 3, 1, 2)


def _json_values(values: torch.Tensor) -> List[Optional[float]]:
    return [v if math.isfinite(v) else None for v in values.double().tolist()]


def encode_response(total: torch.Tensor, terms: dict) -> dict:
    return {"scores": _json_values(total), "terms": {name: _json_values(v) for name, v in terms.items()}}


def decode_scores(body: object, count: int) -> torch.Tensor:
    """A /score response -> float32 [count] (null -> NaN); ValueError when it is not one."""
    try:
        return reply_scores(body, "scores", count, nulls=True)
    except ValueError as e:
        raise ValueError(f"the response holds no list of {count} scores: {e}") from None


class _Brief(reprlib.Repr):
    """reprlib's short repr (a few levels, a few items each, every part cut short), with an
    integer too long to show named by its size: str() of one past 4300 digits raises."""

    def repr_int(self, x, level):
        if abs(x) >= 10 ** self.maxlong:
            return f"<an integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)


brief = _Brief().repr  # any value a reply holds, in a few dozen characters, whatever its size or depth


def reply_scores(reply: object, key: str, count: int, nulls: bool = False) -> torch.Tensor:
    """`reply[key]` as float32 [count]: real numbers, one per image (and None where `nulls`: NaN).
    A non-finite score, or one float32 cannot hold, becomes NaN: the iteration is skipped.
    ValueError (its message one line, whatever the reply holds) for anything else."""
    if not isinstance(reply, dict):
        raise ValueError(f"it is a {type(reply).__name__} ({brief(reply)}), not a dict holding {key!r}")
    if key not in reply:
        raise ValueError(f"it has no {key!r} (its keys: {', '.join(sorted(map(brief, reply))[:8]) or 'none'})")
    values = reply[key]
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"its {key!r} is a {type(values).__name__} ({brief(values)}), not a list of {count} numbers")
    if len(values) != count:
        raise ValueError(f"its {key!r} holds {len(values)} scores for {count} images")
    numbers = []
    for i, value in enumerate(values):
        if value is None and nulls:
            numbers.append(math.nan)
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"its {key!r}[{i}] is a {type(value).__name__} ({brief(value)}), "
                             f"not a number{' or null' if nulls else ''}")
        try:
            numbers.append(float(value))
        except OverflowError:
            raise ValueError(f"its {key!r}[{i}] is an integer of {value.bit_length()} bits, past any float") from None
    scores = torch.tensor(numbers, dtype=torch.float32)
    return scores.where(scores.isfinite(), math.nan)
