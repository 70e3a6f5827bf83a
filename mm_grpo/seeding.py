"""Random draws keyed by integers (seed, stream, iteration, sample...), so that a draw depends on
what it is for, not on how many draws came before it: results then do not depend on the parallel
layout, and a resumed run repeats an uninterrupted one.

Every stream is named here. A stream's number is part of every result drawn from it: changing
one changes the runs (and the figures measured with them), so the numbers stay as they are.
"""
import enum

import torch

DEFAULT_SEED = 1234  # Megatron's --seed default, which every mm-grpo seed defaults to

class GRPOStream(enum.IntEnum):
    """The draws of a GRPO iteration: `seeded_generator(seed, iteration, stream, sample)`."""
    INITIAL_NOISE = 0  # keyed by the group instead of the sample with --init-same-noise
    STEP_NOISE = 1  # the SDE steps' noise
    TRAINED_STEPS = 2  # DanceGRPO's random choice of trained transitions
    MATCHING_NOISE = 3  # advantage-weighted matching's forward-process noise
    BRANCH_WINDOW = 4  # Flow-GRPO-Fast's window position (no sample key: one per iteration)


class Stream(enum.IntEnum):
    """Other draws of a run: `seeded_generator(seed, stream, ...)`."""
    FLOW_TRAINING = 1  # flow matching's noise and sigma: (seed, stream, iteration, sample)
    LORA_INIT = 2  # a LoRA adapter's A: (seed, stream, crc32 of its weight's diffusers name)
    BOOTSTRAP = 3  # an evaluation's bootstrap intervals: (bootstrap seed, stream)
    EVALUATION = 7919  # held-out evaluation noise: (eval seed, stream, prompt, sample); apart from training draws


def seeded_generator(*keys: int) -> torch.Generator:
    """A CPU generator seeded from integers (stable across runs, processes and layouts)."""
    seed = 0
    for k in keys:
        seed = (seed * 1_000_003 + int(k)) % (2**63 - 1)
    return torch.Generator().manual_seed(seed)
