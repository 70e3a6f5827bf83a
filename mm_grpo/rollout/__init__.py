"""Sampling side of GRPO: sigma schedule, sampler steps with log-probs, batched rollout."""
from mm_grpo.rollout.samplers import (
    CONSTANT_FREE_LOG_PROB,
    SAMPLERS,
    StepOutput,
    cps_log_prob,
    cps_step,
    dance_sde_step,
    flow_sde_step,
    gaussian_log_prob,
    get_sampler,
    ode_step,
    sde_steps,
)
from mm_grpo.rollout.sigmas import sigma_schedule
from mm_grpo.rollout.trajectory import SharedPrefix, Trajectory, Transition, check_window, rollout, stochastic_steps

__all__ = [
    "CONSTANT_FREE_LOG_PROB",
    "SAMPLERS",
    "SharedPrefix",
    "StepOutput",
    "Trajectory",
    "Transition",
    "check_window",
    "cps_log_prob",
    "cps_step",
    "dance_sde_step",
    "flow_sde_step",
    "gaussian_log_prob",
    "get_sampler",
    "ode_step",
    "rollout",
    "sde_steps",
    "sigma_schedule",
    "stochastic_steps",
]
