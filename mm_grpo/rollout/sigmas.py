"""The shifted sigma schedule used by DanceGRPO / Flow-GRPO for FLUX."""
import torch


def sigma_schedule(num_steps: int = 16, shift: float = 3.0) -> torch.Tensor:
    """Returns the N+1 sigmas from 1 (noise) down to 0 (data), float32.

    sigma = linspace(1, 0, N+1), then sigma <- s*sigma / (1 + (s-1)*sigma). Computed in
    float64 so that the endpoints are exactly 1 and 0 (flow_sde tests `sigma == 1`).
    The timestep fed to the model is sigma itself.
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be an integer >= 1, got {num_steps!r}")
    if not shift > 0:
        raise ValueError(f"shift must be > 0, got {shift!r}")
    sigmas = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    return sigmas.float()
