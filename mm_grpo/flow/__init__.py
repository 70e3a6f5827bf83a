"""FLUX's rectified-flow objective (noising, timestep sampling, loss): shared by the
flow-matching trainer and GRPO's advantage-weighted matching."""
from mm_grpo.flow.matching import (WEIGHTING_SCHEMES, FlowMatchingSettings, flow_matching_loss, noisy_latents,
                                   sample_sigmas, shift_sigmas)

__all__ = ["WEIGHTING_SCHEMES", "FlowMatchingSettings", "flow_matching_loss", "noisy_latents", "sample_sigmas",
           "shift_sigmas"]
