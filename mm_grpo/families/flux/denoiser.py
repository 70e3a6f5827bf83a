"""FLUX's side of GRPO: its `Denoiser` (latents packed 2x2 into [tokens, channels], text as T5
embeddings, pooled CLIP and txt_ids) and its guidance setting (an embedding, FLUX.1-dev's 3.5)."""
import dataclasses
from typing import Dict, Sequence, Tuple

from megatron.core.utils import get_attr_wrapped_model

from mm_grpo.families.flux.chunks import FORWARD_KEYS, PER_SAMPLE_CONDITIONING, conditioning, make_velocity_fn
from mm_grpo.families.flux.transformer.config import FLUX_DEV_GUIDANCE
from mm_grpo.families.flux.transformer.latents import token_grid
from mm_grpo.grpo.denoiser import Denoiser
from mm_grpo.settings import setting


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


@dataclasses.dataclass(frozen=True)
class FluxGuidance:
    """FLUX.1's guidance: an embedding input, not classifier-free guidance (--guidance-scale)."""
    guidance_scale: float = setting(FLUX_DEV_GUIDANCE, "guidance embedding value (FLUX.1-dev)")
