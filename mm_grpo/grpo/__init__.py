"""Model-independent GRPO math: advantages, PPO-clip loss, trained-timestep selection."""
from mm_grpo.grpo.advantages import NonFiniteRewardError, group_advantages
from mm_grpo.grpo.loss import grpo_loss
from mm_grpo.grpo.timesteps import SlidingWindow, dance_grpo_timesteps, flow_grpo_timesteps, window_timesteps

__all__ = [
    "NonFiniteRewardError",
    "SlidingWindow",
    "dance_grpo_timesteps",
    "flow_grpo_timesteps",
    "group_advantages",
    "grpo_loss",
    "window_timesteps",
]
