"""Which rollout steps GRPO trains on: DanceGRPO, Flow-GRPO, MixGRPO and Flow-GRPO-Fast selections.

Each selector returns a [B, K] long tensor of step indices i (transition i -> i+1), one row
per sample, to be fed to `Trajectory.transition(steps[:, k])` for k = 0..K-1.
"""
import dataclasses
from typing import Optional, Tuple

import torch

from mm_grpo.rollout.samplers import sde_steps
from mm_grpo.rollout.trajectory import check_window

WINDOWED = ("window", "branch")  # selections that train every step of an SDE window (MixGRPO, Flow-GRPO-Fast)


def _check_args(batch_size: int, num_steps: int, fraction: float, min_steps: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if num_steps < min_steps:
        raise ValueError(f"num_steps must be >= {min_steps}, got {num_steps}")
    if not 0 < fraction <= 1:
        raise ValueError(f"timestep fraction must be in (0, 1], got {fraction!r}")


def _check_window_size(size: int, num_steps: int) -> None:
    if not 1 <= size <= num_steps:
        raise ValueError(f"window size must be in [1, {num_steps}] (the number of steps), got {size}")


def _count(trainable: int, fraction: float) -> int:
    count = int(trainable * fraction)
    if count < 1:
        raise ValueError(f"timestep fraction {fraction} of {trainable} steps selects none; use >= {1 / trainable:.4g}")
    return count


def trained_steps_per_sample(num_inference_steps: int, timestep_selection: str = "random",
                             timestep_fraction: float = 0.6, window_size: int = 3, sampler: str = "dance_sde") -> int:
    """K, the transitions every sample trains, as the selectors below choose them: the window's size
    (window, branch), the first int(k * fraction) of the sampler's k SDE steps (ordered), or
    int((N - 1) * fraction) of the N - 1 steps before the last (random)."""
    if timestep_selection in WINDOWED:
        _check_window_size(window_size, sde_steps(sampler, num_inference_steps))
        return window_size
    if timestep_selection == "ordered":
        return _count(sde_steps(sampler, num_inference_steps), timestep_fraction)
    return _count(num_inference_steps - 1, timestep_fraction)


def dance_grpo_timesteps(
    batch_size: int, num_steps: int, fraction: float = 0.6, *, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """DanceGRPO: drop the last transition, permute the remaining N-1 per sample, keep the
    first int((N-1) * fraction) (9 of 15 for N = 16)."""
    _check_args(batch_size, num_steps, fraction, min_steps=2)
    trainable = num_steps - 1
    count = _count(trainable, fraction)
    return torch.stack([torch.randperm(trainable, generator=generator)[:count] for _ in range(batch_size)])


def flow_grpo_timesteps(batch_size: int, num_steps: int, fraction: float = 1.0) -> torch.Tensor:
    """Flow-GRPO: the first int(N * fraction) steps, in order, for every sample."""
    _check_args(batch_size, num_steps, fraction, min_steps=1)
    return torch.arange(_count(num_steps, fraction)).repeat(batch_size, 1)


@dataclasses.dataclass(frozen=True)
class SlidingWindow:
    """MixGRPO's SDE window: `size` steps whose start moves by `shift` every `every` iterations.

    MixGRPO uses 4 of 25 steps, moved 1 step every 25 iterations. For N = 16 the default keeps
    the trained share (3/16 ~ 4/25) and the pace. When the window would run past the last step
    it rolls back to step 0 (wrap=True) or stays on the last position (wrap=False).
    """

    size: int = 3
    shift: int = 1
    every: int = 25
    wrap: bool = True

    def bounds(self, iteration: int, num_steps: int) -> Tuple[int, int]:
        """(start, end) of the window at `iteration`: steps start..end-1 are SDE and trained."""
        _check_window_size(self.size, num_steps)
        if self.shift < 0 or self.every < 1 or iteration < 0:
            raise ValueError(
                f"need shift >= 0, every >= 1, iteration >= 0; got {self.shift}, {self.every}, {iteration}"
            )
        last = num_steps - self.size
        moves = iteration // self.every
        if self.shift == 0:
            start = 0
        elif self.wrap:
            start = moves % (last // self.shift + 1) * self.shift
        else:
            start = min(moves * self.shift, last)
        return start, start + self.size


def branch_window(size: int, num_steps: int, generator: Optional[torch.Generator] = None) -> Tuple[int, int]:
    """Flow-GRPO-Fast: the group branches at a random step. An SDE window of `size` steps whose
    start is drawn uniformly over all positions (once per iteration); ODE before it (the group's
    shared prefix, see `rollout.SharedPrefix`) and after it."""
    _check_window_size(size, num_steps)
    start = int(torch.randint(0, num_steps - size + 1, (1,), generator=generator))
    return start, start + size


def window_timesteps(batch_size: int, window: Tuple[int, int], num_steps: int) -> torch.Tensor:
    """MixGRPO / Flow-GRPO-Fast: every step of the SDE window, in order, for every sample."""
    _check_args(batch_size, num_steps, 1.0, min_steps=1)
    start, end = check_window(window, num_steps)
    return torch.arange(start, end).repeat(batch_size, 1)
