"""What GRPO needs from a flow-matching model family, behind one small interface.

The schedule, its rollout and the held-out evaluation ask a `Denoiser` for one sample's latent
shape, the forward arguments of a batch of prompts, the velocity of this rank's model chunks and
a training micro-batch's forward; samplers, log-probs and objectives act on latents of any rank.
Each family implements it (FLUX packs its latents into [S, C] tokens; Wan's DiT takes video
latents [C, T, h, w]); docs/design.md says where a new family goes.
"""
import dataclasses
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from mm_grpo.rollout.sigmas import sigma_schedule
from mm_grpo.settings import setting


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

    def sigmas(self, num_steps: int, shift: float) -> torch.Tensor:
        """The rollout's num_steps + 1 sigmas from 1 to 0: DanceGRPO / Flow-GRPO's schedule shifted by
        `shift` (--sigma-shift; FLUX's and Wan's), unless the family's pipeline schedules otherwise."""
        return sigma_schedule(num_steps, shift)

    def conditional(self) -> "Denoiser":
        """The denoiser without classifier-free guidance: the prediction supervised flow matching trains."""
        return self

    def rows_of(self, cond: Dict, rows) -> Dict:
        """The conditioning of some samples of a batch."""
        return {k: v[rows] if k in self.per_sample_keys and v is not None else v for k, v in cond.items()}


@dataclasses.dataclass(frozen=True)
class NegativePrompt:
    """The unconditional prompt of classifier-free guidance: one flag for every family that guides against
    one (their guidance settings hold it as a plain field); unset, each family's own default."""
    negative_prompt: Optional[str] = setting(
        None, "the unconditional prompt of classifier-free guidance (default: the model family's: MindSpeed-MM's "
              "Wan2.1 negative prompt, Qwen-Image's \" \")")
