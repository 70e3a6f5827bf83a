"""What GRPO needs from a flow-matching model, behind one small interface.

The schedule, its rollout and the held-out evaluation ask a `Denoiser` for one sample's latent
shape, the forward arguments of a batch of prompts, the velocity of this rank's model chunks and
a training micro-batch's forward; samplers, log-probs and objectives act on latents of any rank.
FLUX (`FluxDenoiser`, below) packs its latents into [S, C] tokens; MindSpeed-MM's Wan DiT
(`mm_grpo/mindspeed_mm/wan.py`) takes video latents [C, T, h, w].
"""
import dataclasses
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
from megatron.core.utils import get_attr_wrapped_model

from mm_grpo.encoders.latents import token_grid
from mm_grpo.models.flux.config import FLUX_DEV_GUIDANCE
from mm_grpo.runtime.chunks import FORWARD_KEYS, PER_SAMPLE_CONDITIONING, conditioning, make_velocity_fn


class Denoiser:
    """latent_shape: one sample's latents; per_sample_keys: the conditioning with one row per
    sample; shared_keys: the conditioning every sample of a batch shares."""
    latent_shape: Tuple[int, ...]
    per_sample_keys: Tuple[str, ...]
    shared_keys: Tuple[str, ...]

    def conditioning(self, text, rows: Optional[torch.Tensor], device) -> Dict:
        """The forward arguments of the prompts `rows` of a conditioner's output `text` (None: all)."""
        raise NotImplementedError

    def velocity_fn(self, chunks: Sequence, cond: Dict, micro_batch_size: int) -> Callable:
        """velocity(x [B, *latent_shape], sigma [B]) -> v on every model-parallel rank."""
        raise NotImplementedError

    def forward(self, model, batch: Dict) -> torch.Tensor:
        """A training micro-batch's velocity (inside Megatron's forward_step)."""
        raise NotImplementedError

    def rows_of(self, cond: Dict, rows) -> Dict:
        """The conditioning of some samples of a batch."""
        return {k: v[rows] if k in self.per_sample_keys and v is not None else v for k, v in cond.items()}


@dataclasses.dataclass(frozen=True)
class FluxDenoiser(Denoiser):
    """FLUX: latents packed 2x2 into [tokens, channels], text as (T5 embeds, pooled CLIP, txt_ids)."""
    height: int
    width: int
    channels: int  # the transformer's in_channels (packed)
    guidance: float = FLUX_DEV_GUIDANCE

    per_sample_keys = PER_SAMPLE_CONDITIONING
    shared_keys = ("txt_ids", "img_ids")

    @classmethod
    def of(cls, chunks: Sequence, height: int, width: int, guidance: float = FLUX_DEV_GUIDANCE) -> "FluxDenoiser":
        config = get_attr_wrapped_model(chunks[0], "flux_config")
        return cls(height, width, config.in_channels, guidance)

    @property
    def latent_shape(self) -> Tuple[int, int]:
        rows, cols = token_grid(self.height, self.width)
        return rows * cols, self.channels

    def conditioning(self, text, rows, device) -> Dict:
        embeds, pooled, txt_ids = text
        if rows is not None:
            embeds, pooled = embeds[rows.to(embeds.device)], pooled[rows.to(pooled.device)]
        return conditioning((embeds, pooled, txt_ids), token_grid(self.height, self.width), self.guidance, device)

    def velocity_fn(self, chunks, cond, micro_batch_size):
        return make_velocity_fn(chunks, cond, micro_batch_size)

    def forward(self, model, batch):
        return model(**{k: batch[k] for k in FORWARD_KEYS if k in batch})
