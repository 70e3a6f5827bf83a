"""Weighted sum of several rewards, keeping each one's values for logging."""
import math

import torch

from mm_grpo.rewards.base import RewardConfig, build_reward


class CombinedReward:
    """`__call__(images, prompts)` -> (total [B], {name: values [B]}); total = sum of weight x values.

    Rewards with weight 0 are computed and returned for logging but left out of the
    total, so a non-finite value there cannot poison it.
    """

    def __init__(self, rewards, weights):
        if not rewards:
            raise ValueError("CombinedReward needs at least one reward")
        names = [r.name for r in rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"reward listed twice in {names}: each name may appear once")
        if len(weights) != len(rewards) or not all(math.isfinite(w) for w in weights):
            raise ValueError(f"need one finite weight per reward, got {weights} for {names}")
        self.rewards = dict(zip(names, rewards))
        self.weights = dict(zip(names, (float(w) for w in weights)))

    @classmethod
    def from_configs(cls, configs, device="cpu"):
        configs = [RewardConfig.from_any(c) for c in configs]
        return cls([build_reward(c, device) for c in configs], [c.weight for c in configs])

    def check_prompts(self, prompts):
        for reward in self.rewards.values():
            reward.check_prompts(prompts)

    def __call__(self, images, prompts):
        values = {name: reward(images, prompts) for name, reward in self.rewards.items()}
        terms = [self.weights[n] * v for n, v in values.items() if self.weights[n] != 0]
        total = torch.stack(terms).sum(0) if terms else torch.zeros(images.shape[0], device=images.device)
        return total, values
