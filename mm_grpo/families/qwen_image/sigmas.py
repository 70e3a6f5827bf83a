"""Qwen-Image's sigma schedule: what QwenImagePipeline's FlowMatchEulerDiscreteScheduler makes for N steps at an
image's token count, without a pipeline or a scheduler object.

QwenImagePipeline.__call__ passes sigmas = linspace(1, 1/N, N) and mu = calculate_shift(image tokens, ...) to
`set_timesteps`, which shifts them (the exponential time shift at mu), stretches them to end at
`shift_terminal` and appends a final 0. The transformer is then called at t = (sigma x 1000) / 1000: sigma
itself, to a float32 rounding.
"""
import math
import os
from typing import Mapping, Optional

import torch

from mm_grpo.files.jsonfile import load_json

# Qwen/Qwen-Image's scheduler/scheduler_config.json on the Hugging Face hub (the schedule's keys; its other
# keys, stochastic_sampling and the karras / exponential / beta switches all off, do not change the sigmas).
SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "invert_sigmas": False,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
}
# Switches of FlowMatchEulerDiscreteScheduler that give other sigmas than this module makes: refused by name.
UNSUPPORTED = ("invert_sigmas", "use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas")
TIME_SHIFT_TYPES = ("exponential", "linear")


def calculate_shift(image_seq_len: int, base_seq_len: int, max_seq_len: int, base_shift: float,
                    max_shift: float) -> float:
    """QwenImagePipeline's `calculate_shift`: mu on the line through (base_seq_len, base_shift) and
    (max_seq_len, max_shift), extrapolated past either end."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * m + base_shift - m * base_seq_len


def load_scheduler_config(pipeline_dir) -> dict:
    """The scheduler/scheduler_config.json of a diffusers pipeline folder."""
    return load_json(os.path.join(pipeline_dir, "scheduler", "scheduler_config.json"), "scheduler config")


def sigma_schedule(num_steps: int, image_seq_len: int, config: Optional[Mapping] = None) -> torch.Tensor:
    """The N + 1 sigmas, 1 down to 0 (float32, computed in float64), of QwenImagePipeline's N steps for an
    image of `image_seq_len` packed tokens ((H / 16) x (W / 16)). `config`: a FlowMatchEulerDiscreteScheduler
    config (a scheduler_config.json's dict; absent keys take Qwen-Image's values)."""
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be an integer >= 1, got {num_steps!r}")
    if isinstance(image_seq_len, bool) or not isinstance(image_seq_len, int) or image_seq_len < 1:
        raise ValueError(f"image_seq_len must be an integer >= 1 (the packed image tokens), got {image_seq_len!r}")
    cfg = {**SCHEDULER_CONFIG, **(config or {})}
    if cfg["shift_terminal"] and num_steps < 2:
        raise ValueError(f"num_steps must be >= 2 with shift_terminal {cfg['shift_terminal']} (one step has no "
                         "last sigma below 1 to stretch), got 1")
    if on := [k for k in UNSUPPORTED if cfg[k]]:
        raise ValueError(f"scheduler config {', '.join(f'{k}: {cfg[k]!r}' for k in on)}: not Qwen-Image's schedule "
                         "(these switches are off in its scheduler_config.json)")
    if cfg["time_shift_type"] not in TIME_SHIFT_TYPES:
        raise ValueError(f"scheduler config time_shift_type {cfg['time_shift_type']!r}: choose one of {TIME_SHIFT_TYPES}")

    sigmas = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float64)
    if cfg["use_dynamic_shifting"]:
        mu = calculate_shift(image_seq_len, cfg["base_image_seq_len"], cfg["max_image_seq_len"], cfg["base_shift"],
                             cfg["max_shift"])
        # FlowMatchEulerDiscreteScheduler.time_shift(mu, 1.0, t), its exponent sigma being 1
        shift = math.exp(mu) if cfg["time_shift_type"] == "exponential" else mu
        sigmas = shift / (shift + (1 / sigmas - 1))
    else:
        sigmas = cfg["shift"] * sigmas / (1 + (cfg["shift"] - 1) * sigmas)
    if cfg["shift_terminal"]:
        # stretch_shift_to_terminal: 1 - sigma scaled so that the last sigma is shift_terminal
        one_minus = 1 - sigmas
        sigmas = 1 - one_minus / (one_minus[-1] / (1 - cfg["shift_terminal"]))
    return torch.cat([sigmas, sigmas.new_zeros(1)]).float()
