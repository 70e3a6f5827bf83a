"""Qwen-Image's side of GRPO: its `Denoiser` (latents packed 2 x 2 into [tokens, 64], text as
Qwen2.5-VL features with their mask) and its guidance settings (QwenImagePipeline's true CFG: a
negative prompt, `true_cfg_scale`, the guided velocity rescaled to the conditional one's norm)."""
import dataclasses
from typing import Dict, Mapping, Optional, Tuple

import torch
from megatron.core.utils import get_attr_wrapped_model

from mm_grpo.families.qwen_image.chunks import FORWARD_KEYS, guided_inputs, make_velocity_fn, true_cfg
from mm_grpo.families.qwen_image.sigmas import sigma_schedule
from mm_grpo.grpo.denoiser import Denoiser
from mm_grpo.settings import setting

VAE_SCALE_FACTOR = 8  # AutoencoderKLQwenImage: 2 ** len(temperal_downsample) pixels per latent side
PATCH = 2  # latents packed 2 x 2 into a token, as QwenImagePipeline._pack_latents
TRUE_CFG_SCALE = 4.0  # QwenImagePipeline's default true_cfg_scale
NEGATIVE_PROMPT = " "  # QwenImagePipeline: true CFG needs a negative prompt, and " " is its advice


def token_grid(height: int, width: int) -> Tuple[int, int]:
    """(rows, columns) of the packed latent's tokens of an image, one per 2 x 2 latent patch."""
    step = VAE_SCALE_FACTOR * PATCH
    if height <= 0 or width <= 0 or height % step or width % step:
        raise ValueError(f"image size {height}x{width}: Qwen-Image needs both sides divisible by {step}")
    return height // step, width // step


@dataclasses.dataclass(frozen=True)
class QwenImageDenoiser(Denoiser):
    """Qwen-Image: latents packed 2 x 2 into [tokens, channels]; text as (features [N, L, D], mask [N, L]
    or None); with `true_cfg_scale` > 1, true CFG against `negative` (the negative prompt's features
    [1, L', D] and mask)."""
    height: int
    width: int
    channels: int  # the transformer's in_channels (packed)
    true_cfg_scale: float = 1.0
    negative: Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]] = dataclasses.field(
        default=None, compare=False, repr=False)
    scheduler: Optional[Mapping] = None  # the pipeline's scheduler_config.json (None: Qwen-Image's)

    per_sample_keys = ("encoder_hidden_states", "encoder_hidden_states_mask")

    def __post_init__(self):
        token_grid(self.height, self.width)
        if self.guided and self.negative is None:
            raise ValueError(f"true_cfg_scale {self.true_cfg_scale} needs the negative prompt's features")

    @classmethod
    def of(cls, chunks, height: int, width: int, true_cfg_scale: float = 1.0, negative=None,
           scheduler: Optional[Mapping] = None) -> "QwenImageDenoiser":
        config = get_attr_wrapped_model(chunks[0], "qwen_config")
        return cls(height, width, config.in_channels, true_cfg_scale, negative, scheduler)

    def sigmas(self, num_steps: int, shift: float) -> torch.Tensor:
        """QwenImagePipeline's schedule for this image size (its resolution-dependent shift and terminal
        stretch, `sigmas.py`), as flow_grpo's Qwen-Image rollouts take it; `shift` is FLUX's and unused."""
        rows, cols = token_grid(self.height, self.width)
        return sigma_schedule(num_steps, rows * cols, self.scheduler)

    def conditional(self) -> "QwenImageDenoiser":
        return dataclasses.replace(self, true_cfg_scale=1.0, negative=None)

    @property
    def guided(self) -> bool:
        return self.true_cfg_scale > 1

    @property
    def shared_keys(self) -> Tuple[str, ...]:
        negative = ("negative_encoder_hidden_states", "negative_encoder_hidden_states_mask") if self.guided else ()
        return ("img_shapes", *negative)

    @property
    def latent_shape(self) -> Tuple[int, int]:
        rows, cols = token_grid(self.height, self.width)
        return rows * cols, self.channels

    def conditioning(self, text, rows, device) -> Dict:
        embeds, mask = text
        if rows is not None:
            embeds = embeds[rows.to(embeds.device)]
            mask = None if mask is None else mask[rows.to(mask.device)]
        cond = {"encoder_hidden_states": embeds.to(device),
                "encoder_hidden_states_mask": None if mask is None else mask.to(device),
                "img_shapes": [[(1, *token_grid(self.height, self.width))]] * len(embeds)}
        if self.guided:
            neg, neg_mask = self.negative
            cond.update(negative_encoder_hidden_states=neg.to(device),
                        negative_encoder_hidden_states_mask=None if neg_mask is None else neg_mask.to(device))
        return cond

    def rows_of(self, cond: Dict, rows) -> Dict:
        picked = super().rows_of(cond, rows)
        picked["img_shapes"] = [cond["img_shapes"][0]] * len(picked["encoder_hidden_states"])
        return picked

    def velocity_fn(self, chunks, cond, micro_batch_size):
        return make_velocity_fn(chunks, cond, micro_batch_size, self.true_cfg_scale)

    def forward(self, model, batch):
        """A training micro-batch's velocity; under true CFG the conditional and the unconditional
        velocity in one call of 2 x the samples, combined on the last stage (its micro-batch is then
        twice the samples in Megatron's schedule)."""
        if not self.guided:
            return model(**{k: batch[k] for k in FORWARD_KEYS if k in batch})
        n = batch["hidden_states"].shape[0]
        out = model(**guided_inputs(batch, slice(None), self.true_cfg_scale),
                    hidden_states=batch["hidden_states"].repeat(2, 1, 1), timestep=batch["timestep"].repeat(2),
                    img_shapes=[batch["img_shapes"][0]] * (2 * n))
        if not get_attr_wrapped_model(model, "post_process"):
            return out
        return true_cfg(*out.chunk(2), self.true_cfg_scale)


@dataclasses.dataclass(frozen=True)
class QwenImageGuidance:
    """Qwen-Image's true classifier-free guidance (--true-cfg-scale, --negative-prompt)."""
    true_cfg_scale: float = setting(TRUE_CFG_SCALE, "true CFG scale (QwenImagePipeline's true_cfg_scale; 1 turns "
                                    "guidance off)", minimum=1)
    negative_prompt: Optional[str] = None  # --negative-prompt (mm_grpo/grpo/denoiser.py NegativePrompt)

    @property
    def unconditional_prompt(self) -> str:
        """--negative-prompt, by default QwenImagePipeline's advice for true CFG: at least a space."""
        return NEGATIVE_PROMPT if self.negative_prompt is None else self.negative_prompt
