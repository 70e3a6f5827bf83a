"""Held-out evaluation: deterministic ODE sampling of fixed prompts from fixed noise, decoded
and scored. The noise of sample j of prompt i depends on (seed, i, j) only, so evaluations
before and after training (or of two runs) compare the same starting points, and the result
does not depend on the parallel layout.
"""
import dataclasses
from typing import Callable, Dict, List

import torch

from mm_grpo.pipeline.latents import prepare_latent_image_ids
from mm_grpo.rollout import rollout
from mm_grpo.seeding import Stream, seeded_generator


def conditioning(conditioner: Callable, prompts: List[str], grid, guidance: float, device) -> dict:
    """The forward kwargs that depend on the prompts only (text, ids, guidance) for a batch."""
    embeds, pooled, txt_ids = conditioner(prompts)
    return dict(encoder_hidden_states=embeds.to(device), pooled_projections=pooled.to(device),
                txt_ids=txt_ids.to(device),
                img_ids=prepare_latent_image_ids(*grid, device=device, dtype=txt_ids.dtype),
                guidance=torch.full((len(prompts),), float(guidance), device=device))


@dataclasses.dataclass
class EvalResult:
    stats: Dict[str, float]  # eval/reward_mean and eval/<reward name>: means over all samples
    prompts: List[str]  # one per sample, prompt-major (sample j of prompt i at i * K + j)
    images: torch.Tensor  # [N, 3, H, W] in [0, 1]
    values: Dict[str, torch.Tensor]  # per-sample reward values, by name


class Evaluator:
    """`evaluator(model_chunks)` -> EvalResult over `prompts` x `samples_per_prompt` images.

    conditioner(prompts) -> (embeds, pooled, txt_ids); decoder(latents, height, width) -> images;
    reward(images, prompts) -> (total [B], {name: [B]}). Every model-parallel rank calls it."""

    def __init__(self, prompts: List[str], conditioner: Callable, decoder: Callable, reward: Callable,
                 sigmas: torch.Tensor, height: int, width: int, channels: int, guidance: float = 3.5,
                 samples_per_prompt: int = 1, seed: int = 0, batch_size: int = 64, device=None):
        if not prompts:
            raise ValueError("evaluation needs at least one prompt")
        if samples_per_prompt < 1 or batch_size < 1:
            raise ValueError(f"samples per prompt and batch size must be >= 1, got {samples_per_prompt}, {batch_size}")
        self.prompts = [p for p in prompts for _ in range(samples_per_prompt)]
        self.keys = [(i, j) for i in range(len(prompts)) for j in range(samples_per_prompt)]
        self.conditioner, self.decoder, self.reward = conditioner, decoder, reward
        self.sigmas, self.height, self.width, self.channels = sigmas, height, width, channels
        self.guidance, self.seed, self.batch_size = guidance, seed, batch_size
        self.device = device or torch.device("cpu")
        self.grid = (height // 16, width // 16)

    def noise(self, keys) -> torch.Tensor:
        tokens = self.grid[0] * self.grid[1]
        return torch.stack([torch.randn(tokens, self.channels, generator=seeded_generator(self.seed, Stream.EVALUATION, i, j))
                            for i, j in keys]).to(self.device)

    @torch.no_grad()
    def __call__(self, model_chunks) -> EvalResult:
        from mm_grpo.parallel.pipeline import make_velocity_fn
        images, totals, values = [], [], {}
        for start in range(0, len(self.prompts), self.batch_size):
            prompts = self.prompts[start:start + self.batch_size]
            cond = conditioning(self.conditioner, prompts, self.grid, self.guidance, self.device)
            traj = rollout(make_velocity_fn(model_chunks, cond, len(prompts)), self.noise(self.keys[start:start + len(prompts)]),
                           self.sigmas, "ode")
            batch = self.decoder(traj.x0_hat, self.height, self.width)
            total, per_reward = self.reward(batch, prompts)
            images.append(batch.cpu())
            totals.append(total.float().cpu())
            for name, v in per_reward.items():
                values.setdefault(name, []).append(v.float().cpu())
        values = {k: torch.cat(v) for k, v in values.items()}
        stats = {"eval/reward_mean": torch.cat(totals).mean().item(),
                 **{f"eval/{k}": v.mean().item() for k, v in values.items()}}
        return EvalResult(stats, list(self.prompts), torch.cat(images), values)


def held_out_evaluator(prompts: List[str], schedule, dataset_param: dict, channels: int, device=None) -> Evaluator:
    """A GRPO run's held-out evaluation: `prompts` x `eval_samples_per_prompt` (data.json's
    dataset_param, default 1) from fixed noise (`eval_seed`, default 0: the same for runs with
    different --seed), with the schedule's conditioner, decoder, rewards, sigmas, image size and guidance."""
    s = schedule
    return Evaluator(prompts, s.conditioner, s.decoder, s.reward, s.sigmas, s.s.height, s.s.width, channels,
                     s.s.guidance_scale, dataset_param.get("eval_samples_per_prompt", 1),
                     seed=dataset_param.get("eval_seed", 0), device=device)
