"""FLUX's rectified-flow (flow-matching) objective: noising, shifted timestep sampling, loss.

Notation as in the GRPO samplers: sigma = 1 is noise, sigma = 0 is data, and FLUX's output v
is a velocity with x0_hat = x_sigma - sigma * v. So for
    x_sigma = (1 - sigma) * x0 + sigma * noise
the target is v* = noise - x0 (Esser et al. 2024, "Scaling Rectified Flow Transformers").

Timesteps: t is drawn uniformly or logit-normally (SD3 / FLUX training), then shifted,
sigma = s t / (1 + (s - 1) t). FLUX's shift depends on the image sequence length:
s = exp(mu), mu linear in the number of packed tokens from base_shift at base_seq_len to
max_shift at max_seq_len (diffusers' `calculate_shift`, FLUX.1's scheduler config); a fixed
shift can be given instead.
"""
import dataclasses
import math
from typing import Optional

import torch

from mm_grpo.settings import setting

WEIGHTING_SCHEMES = ("logit_normal", "uniform")


@dataclasses.dataclass(frozen=True)
class FlowMatchingSettings:
    weighting_scheme: str = setting("logit_normal", "distribution of t before the shift (SD3 / FLUX: logit_normal)",
                                    choices=WEIGHTING_SCHEMES)
    logit_mean: float = setting(0.0, "mean of the logit-normal t")
    logit_std: float = setting(1.0, "std of the logit-normal t")
    shift: Optional[float] = setting(None, "sigma shift s; default: FLUX's exp(mu) from the number of image tokens",
                                     flag="--flow-shift")
    base_shift: float = 0.5  # FLUX.1 scheduler_config.json
    max_shift: float = 1.15
    base_seq_len: int = 256
    max_seq_len: int = 4096

    def __post_init__(self):
        if self.weighting_scheme not in WEIGHTING_SCHEMES:
            raise ValueError(f"unknown weighting scheme {self.weighting_scheme!r}; choose {', '.join(WEIGHTING_SCHEMES)}")
        if self.shift is not None and not self.shift > 0:
            raise ValueError(f"flow shift must be > 0, got {self.shift}")
        if self.logit_std <= 0:
            raise ValueError(f"logit std must be > 0, got {self.logit_std}")

    def resolved_shift(self, image_seq_len: int) -> float:
        if self.shift is not None:
            return self.shift
        slope = (self.max_shift - self.base_shift) / (self.max_seq_len - self.base_seq_len)
        return math.exp(self.base_shift + slope * (image_seq_len - self.base_seq_len))


def shift_sigmas(t: torch.Tensor, shift: float) -> torch.Tensor:
    return shift * t / (1 + (shift - 1) * t)


def sample_sigmas(n: int, settings: FlowMatchingSettings, image_seq_len: int,
                  generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """n training sigmas in (0, 1), float32."""
    if settings.weighting_scheme == "logit_normal":
        t = torch.sigmoid(settings.logit_mean + settings.logit_std * torch.randn(n, generator=generator))
    else:
        t = torch.rand(n, generator=generator)
    return shift_sigmas(t, settings.resolved_shift(image_seq_len)).float()


def noisy_latents(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """x_sigma = (1 - sigma) x0 + sigma noise, sigma [B] broadcast over the other dims."""
    s = sigma.view(-1, *([1] * (x0.ndim - 1))).to(x0.dtype)
    return (1 - s) * x0 + s * noise


def flow_matching_loss(v_pred: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Per-sample mean squared error to the target velocity noise - x0, in float32 -> [B]."""
    err = (v_pred.float() - (noise.float() - x0.float())) ** 2
    return err.mean(dim=tuple(range(1, err.ndim)))
