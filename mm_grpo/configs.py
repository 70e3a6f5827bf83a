"""What every family reads of model.json, below the families and the trainers: the flag that names
the file in errors, a required block, the generated size before any family checks it (FLUX's latent
packing in training/components.py `image_size`, Wan's VAE and patch in families/wan `video_size`), and
the schemas of what every family's model.json holds (mm_grpo/settings.py `read_block` reads them): its
own values (`ModelFile`), and the text encoder and VAE blocks, whose `model_id` each family narrows
to its own names (`ModelBlocks`)."""
import dataclasses
from typing import Annotated, Callable, Optional, Tuple

from pydantic import Field

MODEL_FLAG = "--mm-model"  # the flag that names model.json, in errors
DEFAULT_IMAGE_SIZE = (64, 64)  # when neither the flags nor model.json's image_size name one: the tiny demo's
# A stated maximum, not a layout's (FLUX's RoPE has no table to outgrow; Wan's, 1024 positions an axis,
# allows 16384): 4096 pixels is 256 x 256 = 65,536 tokens a sample (FLUX's VAE factor 8 x its 2x2
# packing, Wan's VAE 8 x its 2x2 patch), 16 times the sequence of FLUX.1's 1024 x 1024 and 4 times that of
# 2048 x 2048, beyond the sizes either family generates at. A side past it is a typo: 100000 x 100000
# (39 million tokens, 10 GB of fp32 latents a sample) failed deep in the first rollout allocating 80 GB;
# it is now one line before any model is built.
MAX_IMAGE_SIDE = 4096
ImageSide = Annotated[int, Field(ge=1, le=MAX_IMAGE_SIDE)]
ImageSize = Annotated[Tuple[ImageSide, ImageSide],
                      Field(description=f"[height, width]: two whole numbers of pixels from 1 to {MAX_IMAGE_SIDE}")]
MODEL_BLOCKS = ("ae", "text_encoder", "predictor", "reward")  # model.json's blocks: each has its own schema


@dataclasses.dataclass(frozen=True)
class ModelFile:
    """model.json's own values, beside its blocks (MODEL_BLOCKS)."""
    comment: str = ""
    image_size: Optional[ImageSize] = None
    num_frames: Optional[Annotated[int, Field(ge=1)]] = None  # Wan's video length (families/wan)


MODEL_KEYS = (*(f.name for f in dataclasses.fields(ModelFile)), *MODEL_BLOCKS)


@dataclasses.dataclass(frozen=True)
class TextEncoderBlock:
    """model.json's text_encoder: `model_id` is MindSpeed-MM's name for it, read by nobody here."""
    model_id: Optional[str] = None
    from_pretrained: Optional[str] = None
    max_sequence_length: Optional[Annotated[int, Field(ge=1)]] = None
    embeddings_cache: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class AeBlock:
    """model.json's ae (the VAE)."""
    model_id: Optional[str] = None
    from_pretrained: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class ModelBlocks:
    """A family's model.json blocks: the schemas of its text_encoder and ae (subclasses of the two
    above, `model_id` a `Literal` of its names), and the check of its predictor block
    (`predictor(block, where)`, one line for a wrong value)."""
    text_encoder: type
    ae: type
    predictor: Callable[[dict, str], object]


def block(config, name, source):
    """config[name], refused in one line naming `source` (the file or flag) when it is missing."""
    if name not in config:
        raise ValueError(f"{source} has no {name!r} block")
    return config[name]


def configured_size(model_cfg, height=None, width=None) -> tuple:
    """(height, width): the flags, else model.json's image_size (its type checked with the file), else
    the default; refused in one line beyond MAX_IMAGE_SIDE (a flag's too)."""
    default = model_cfg.get("image_size", DEFAULT_IMAGE_SIZE)
    height, width = height or default[0], width or default[1]
    if max(height, width) > MAX_IMAGE_SIDE:
        raise ValueError(f"image size {height}x{width}: at most {MAX_IMAGE_SIDE} pixels a side, 65,536 tokens "
                         "a sample")
    return height, width
