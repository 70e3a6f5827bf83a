"""Held-out evaluation: deterministic ODE sampling of fixed prompts from fixed noise, decoded
and scored. The noise of sample j of prompt i depends on (seed, i, j) only, so evaluations
before and after training (or of two runs) compare the same starting points, and the result
does not depend on the parallel layout. Each mean comes with its two-stage bootstrap 95%
interval over prompts and noises (`intervals.py`), logged as eval/<name>_ci_low / _ci_high.
"""
import dataclasses
from typing import Callable, Dict, List, Optional, Tuple

import torch

from mm_grpo.grpo.denoiser import Denoiser
from mm_grpo.rollout import rollout
from mm_grpo.seeding import Stream, seeded_generator
from mm_grpo.settings import Count, NonNegative, read_block
from mm_grpo.training import intervals

PREFIX = "eval/"  # of every stat's key
TOTAL = "reward_mean"  # the weighted total's name among the stats (eval/reward_mean)
CI_LOW, CI_HIGH = "_ci_low", "_ci_high"  # suffixes of a stat's interval bounds


@dataclasses.dataclass
class EvalResult:
    stats: Dict[str, float]  # eval/reward_mean and eval/<reward name>: means over all samples; their intervals
    prompts: List[str]  # one per sample, prompt-major (sample j of prompt i at i * K + j)
    images: torch.Tensor  # [N, 3, H, W] in [0, 1]
    values: Dict[str, torch.Tensor]  # per-sample reward values, by name
    totals: Optional[torch.Tensor] = None  # per-sample weighted total
    samples_per_prompt: int = 1  # K

    def tables(self) -> Dict[str, torch.Tensor]:
        """{stat name: [prompts, noises] per-sample scores}: the total, then each reward."""
        named = {TOTAL: self.totals, **self.values} if self.totals is not None else dict(self.values)
        return {k: v.reshape(-1, self.samples_per_prompt) for k, v in named.items()}


def _row_intervals(rows: torch.Tensor):
    """(lows, highs) of the bootstrap interval of each row's mean, rows [n, prompts, noises] resampled
    with the same cells; None where it is not defined: fewer than 2 samples, or a non-finite score
    (which already shows as a non-finite mean)."""
    if rows[0].numel() < 2 or not bool(torch.isfinite(rows).all()):
        return None
    low, high = intervals.percentile_interval(intervals.bootstrap_means(rows))
    return low.tolist(), high.tolist()


def with_intervals(stats: Dict[str, float], tables: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """`stats` plus eval/<name>_ci_low / _ci_high for each table, where the bootstrap is defined."""
    found = _row_intervals(torch.stack(list(tables.values()))) if tables else None
    if found is None:
        return stats
    bounds = {PREFIX + name: (lo, hi) for name, lo, hi in zip(tables, *found)}
    out = {}
    for key, value in stats.items():  # each mean followed by its bounds (the logged line reads in order)
        out[key] = value
        if key in bounds:
            out[key + CI_LOW], out[key + CI_HIGH] = bounds[key]
    return out


def is_interval_key(key: str) -> bool:
    return key.endswith((CI_LOW, CI_HIGH))


def _name(key: str) -> str:
    return key.removeprefix(PREFIX)


def compare(before_stats: Dict[str, float], after_stats: Dict[str, float], before: Optional[EvalResult] = None,
            after: Optional[EvalResult] = None) -> str:
    """Each mean before -> after with its interval, and the gain, e.g.
    "compositional 0.2560 [0.213, 0.301] -> 0.4060 [0.361, 0.452], gain +0.1500 [+0.108, +0.193]; ...
    (95% bootstrap over 11 prompts x 64 noises)". The gain's interval is the paired bootstrap of the
    two EvalResults (the same prompts and noises); without them the gain is given alone."""
    def mean_and_interval(stats, key):
        text = f"{stats[key]:.4f}"
        if key + CI_LOW in stats:
            text += f" [{stats[key + CI_LOW]:.3f}, {stats[key + CI_HIGH]:.3f}]"
        return text

    keys = [k for k in before_stats if not is_interval_key(k) and k in after_stats]
    gains = {}
    if before is not None and after is not None:
        old, new = before.tables(), after.tables()
        paired = [k for k in keys if _name(k) in old and _name(k) in new]
        found = _row_intervals(torch.stack([new[_name(k)] - old[_name(k)] for k in paired])) if paired else None
        if found is not None:
            gains = {k: f" [{lo:+.3f}, {hi:+.3f}]" for k, lo, hi in zip(paired, *found)}
    parts = [f"{_name(k)} {mean_and_interval(before_stats, k)} -> {mean_and_interval(after_stats, k)}, "
             f"gain {after_stats[k] - before_stats[k]:+.4f}{gains.get(k, '')}" for k in keys]
    result = before or after
    if any(k + CI_LOW in before_stats for k in keys) and result is not None:
        noises = result.samples_per_prompt
        note = f"{intervals.LEVEL:.0%} bootstrap over {len(result.prompts) // noises} prompts x {noises} noises"
        if not gains:
            note += "; the gain without interval: the first evaluation's samples are not in this run"
        parts[-1] += f" ({note})"
    return "; ".join(parts)


class Evaluator:
    """`evaluator(model_chunks)` -> EvalResult over `prompts` x `samples_per_prompt` images.

    conditioner(prompts) -> the text features `denoiser` reads; decoder(latents, height, width) ->
    images; reward(images, prompts) -> (total [B], {name: [B]}). Every model-parallel rank calls it."""

    def __init__(self, prompts: List[str], conditioner: Callable, decoder: Callable, reward: Callable,
                 sigmas: torch.Tensor, denoiser: Denoiser, height: int, width: int, samples_per_prompt: int = 1,
                 seed: int = 0, batch_size: int = 64, device=None):
        if not prompts:
            raise ValueError("evaluation needs at least one prompt")
        if samples_per_prompt < 1 or batch_size < 1:
            raise ValueError(f"samples per prompt and batch size must be >= 1, got {samples_per_prompt}, {batch_size}")
        self.samples_per_prompt = samples_per_prompt
        self.prompts = [p for p in prompts for _ in range(samples_per_prompt)]
        self.keys = [(i, j) for i in range(len(prompts)) for j in range(samples_per_prompt)]
        self.conditioner, self.decoder, self.reward = conditioner, decoder, reward
        self.sigmas, self.denoiser, self.height, self.width = sigmas, denoiser, height, width
        self.seed, self.batch_size = seed, batch_size
        self.device = device or torch.device("cpu")

    def noise(self, keys) -> torch.Tensor:
        shape = self.denoiser.latent_shape
        return torch.stack([torch.randn(*shape, generator=seeded_generator(self.seed, Stream.EVALUATION, i, j))
                            for i, j in keys]).to(self.device)

    @torch.no_grad()
    def __call__(self, model_chunks) -> EvalResult:
        images, totals, values = [], [], {}
        for start in range(0, len(self.prompts), self.batch_size):
            prompts = self.prompts[start:start + self.batch_size]
            cond = self.denoiser.conditioning(self.conditioner(prompts), None, self.device)
            traj = rollout(self.denoiser.velocity_fn(model_chunks, cond, len(prompts)),
                           self.noise(self.keys[start:start + len(prompts)]),
                           self.sigmas, "ode")
            batch = self.decoder(traj.x0_hat, self.height, self.width)
            total, per_reward = self.reward(batch, prompts)
            images.append(batch.cpu())
            totals.append(total.float().cpu())
            for name, v in per_reward.items():
                values.setdefault(name, []).append(v.float().cpu())
        values = {k: torch.cat(v) for k, v in values.items()}
        totals = torch.cat(totals)
        stats = {PREFIX + TOTAL: totals.mean().item(), **{PREFIX + k: v.mean().item() for k, v in values.items()}}
        result = EvalResult(stats, list(self.prompts), torch.cat(images), values, totals, self.samples_per_prompt)
        result.stats = with_intervals(stats, result.tables())
        return result


@dataclasses.dataclass(frozen=True)
class HeldOutParam:
    """What a held-out evaluation reads of data.json's dataset_param (both trainers'). grpo_flux.sh gives
    the numbers as "$EVAL_SAMPLES" and "$EVAL_SEED": a whole variable's text is read as the number."""
    eval_prompt_file: Optional[str] = None  # "" (an empty variable): no evaluation
    eval_samples_per_prompt: Count = 1
    eval_seed: NonNegative = 0


def eval_settings(dataset_param: dict, source: str = "--mm-data") -> Tuple[int, int]:
    """(eval_samples_per_prompt, eval_seed) of data.json's dataset_param (HeldOutParam), checked; its
    other keys are the trainer's."""
    held_out = read_block(HeldOutParam, dataset_param, f"{source} dataset_param", known=dataset_param)
    return held_out.eval_samples_per_prompt, held_out.eval_seed


def held_out_evaluator(prompts: List[str], schedule, dataset_param: dict, device=None) -> Evaluator:
    """A GRPO run's held-out evaluation: `prompts` x `eval_samples_per_prompt` (data.json's
    dataset_param, default 1) from fixed noise (`eval_seed`, default 0: the same for runs with
    different --seed), with the schedule's conditioner, decoder, rewards, sigmas, denoiser and image size."""
    s = schedule
    samples_per_prompt, seed = eval_settings(dataset_param)
    return Evaluator(prompts, s.conditioner, s.decoder, s.reward, s.sigmas, s.denoiser, s.s.height, s.s.width,
                     samples_per_prompt, seed=seed, device=device)
