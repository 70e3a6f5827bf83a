"""Bootstrap intervals of a held-out evaluation's mean score over prompts and noises.

An evaluation scores a table of P prompts x K noises. Its mean varies with which prompts were
held out and with which noises were drawn, so the interval resamples both (the two-stage, or
hierarchical, bootstrap; Davison & Hinkley 1997, section 3.8): draw P prompts with replacement,
then for each drawn prompt K of its noises with replacement, and take the mean of the P x K
drawn cells; the percentile interval of many such means. Evaluations before and after training
use the same noises, so the gain's interval resamples the same cells on both sides (a paired
bootstrap: the mean of after - before per cell), which removes what the two share.

A resample is a count per cell (how often it was drawn), so a batch of resamples is one matrix
product with the table: vectorised, and without materialising P x K values per resample.
"""
from typing import Tuple

import torch

from mm_grpo.seeding import Stream, seeded_generator

LEVEL = 0.95
RESAMPLES = 10_000  # Monte-Carlo error of the 2.5% percentile: about 3% of the bootstrap standard deviation
# Resample counts held at once (rows x cells, float64): bounds memory for large evaluations.
CELLS_PER_BATCH = 1 << 22


def check_table(values, what: str = "scores") -> torch.Tensor:
    """`values` as a float64 CPU tensor [..., prompts, noises], or a one-line ValueError."""
    values = torch.as_tensor(values)
    if values.dim() < 2:
        raise ValueError(f"{what}: need a table [prompts, noises], got shape {tuple(values.shape)}")
    prompts, noises = values.shape[-2:]
    if prompts * noises < 2:
        raise ValueError(f"{what}: {prompts} prompt(s) x {noises} noise(s) cannot be resampled: "
                         "need at least 2 samples")
    values = values.detach().to("cpu", torch.float64)
    bad = int((~torch.isfinite(values)).sum())
    if bad:
        raise ValueError(f"{what}: {bad} of {values.numel()} values are not finite")
    return values


def bootstrap_means(values, resamples: int = RESAMPLES, seed: int = 0) -> torch.Tensor:
    """Two-stage bootstrap means of `values` [..., P, K] -> [..., resamples]. Every leading index
    (e.g. rewards, or before / after) gets the same resampled cells; `seed` fixes the draws."""
    values = check_table(values)
    if resamples < 1:
        raise ValueError(f"need at least one resample, got {resamples}")
    prompts, noises = values.shape[-2:]
    cells = prompts * noises
    flat = values.reshape(-1, cells)
    generator = seeded_generator(seed, Stream.BOOTSTRAP)
    batch = max(1, CELLS_PER_BATCH // cells)
    means = []
    for start in range(0, resamples, batch):
        b = min(batch, resamples - start)
        drawn_prompts = torch.randint(prompts, (b, prompts, 1), generator=generator)
        drawn_noises = torch.randint(noises, (b, prompts, noises), generator=generator)
        index = drawn_noises.add_(drawn_prompts * noises).reshape(b, cells)
        # float32 counts are exact (a cell is drawn far fewer than 2**24 times) and half the memory traffic
        counts = torch.zeros(b, cells).scatter_add_(1, index, torch.ones(()).expand(b, cells))
        means.append(flat @ counts.T.double() / cells)
    return torch.cat(means, dim=1).reshape(*values.shape[:-2], resamples)


def percentile_interval(means: torch.Tensor, level: float = LEVEL) -> Tuple[torch.Tensor, torch.Tensor]:
    """The (low, high) percentiles of bootstrap means [..., resamples] holding `level` between them."""
    if not 0 < level < 1:
        raise ValueError(f"interval level must be in (0, 1), got {level}")
    tail = (1 - level) / 2
    low, high = torch.quantile(means, torch.tensor([tail, 1 - tail], dtype=means.dtype), dim=-1)
    return low, high


def interval(values, level: float = LEVEL, resamples: int = RESAMPLES, seed: int = 0) -> Tuple[float, float]:
    """The two-stage bootstrap percentile interval of the mean of a [prompts, noises] table."""
    low, high = percentile_interval(bootstrap_means(values, resamples, seed), level)
    return float(low), float(high)


def paired_gain_interval(before, after, level: float = LEVEL, resamples: int = RESAMPLES,
                         seed: int = 0) -> Tuple[float, float]:
    """The interval of mean(after) - mean(before) for two tables of the same prompts and noises:
    each resample draws the same cells on both sides."""
    before, after = check_table(before, "before"), check_table(after, "after")
    if before.shape != after.shape:
        raise ValueError(f"before and after must score the same prompts x noises, got shapes "
                         f"{tuple(before.shape)} and {tuple(after.shape)}")
    return interval(after - before, level, resamples, seed)
