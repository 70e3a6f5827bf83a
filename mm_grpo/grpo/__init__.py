"""Model-independent GRPO math: advantages, policy losses, trained-timestep selection."""
from mm_grpo.grpo.advantages import NonFiniteRewardError, group_advantages, optimality_probability
from mm_grpo.grpo.loss import awm_loss, grpo_loss, guard_step_weight, nft_loss
from mm_grpo.grpo.timesteps import (SlidingWindow, branch_window, dance_grpo_timesteps, flow_grpo_timesteps,
                                    window_timesteps)

__all__ = [
    "NonFiniteRewardError",
    "awm_loss",
    "SlidingWindow",
    "branch_window",
    "dance_grpo_timesteps",
    "flow_grpo_timesteps",
    "group_advantages",
    "grpo_loss",
    "guard_step_weight",
    "nft_loss",
    "optimality_probability",
    "window_timesteps",
]
