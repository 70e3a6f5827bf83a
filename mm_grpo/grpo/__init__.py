"""GRPO for flow-matching models, knowing no model family: the batch, hyperparameters, seeded draws,
objectives, advantages and losses, trained-timestep selection, and the schedule that joins them
around a family's `Denoiser`."""
from mm_grpo.grpo.advantages import NonFiniteRewardError, group_advantages, optimality_probability
from mm_grpo.grpo.batch import GRPOBatch
from mm_grpo.grpo.denoiser import Denoiser
from mm_grpo.grpo.loss import awm_loss, grpo_loss, guard_step_weight, nft_loss
from mm_grpo.grpo.timesteps import (SlidingWindow, branch_window, dance_grpo_timesteps, flow_grpo_timesteps,
                                    trained_steps_per_sample, window_timesteps)

__all__ = [
    "Denoiser",
    "GRPOBatch",
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
    "trained_steps_per_sample",
    "window_timesteps",
]
