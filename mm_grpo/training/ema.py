"""An exponential moving average of the policy (--ema-decay): DiffusionNFT's old policy, which
samples its rollouts, and the weights the held-out evaluation scores.

After iteration i (0-based), every parameter theta_old <- eta_i theta_old + (1 - eta_i) theta with
eta_i = min(--ema-decay-ramp * i, --ema-decay): DiffusionNFT's soft update of the sampling policy
(Zheng et al. 2025, arXiv 2509.16117; its schedule rises by 0.001 per step up to 0.5), so early
iterations follow the trained policy closely and later ones move more slowly. Each rank keeps the
average of its own model chunks (its TP / PP shard); it is saved in that rank's checkpoint shard.
Only what trains is averaged: a LoRA policy's EMA has its own adapters and shares the frozen base
tensors with the policy (no second copy), and saves its adapters only, like the policy.
"""
from typing import List

import torch

from mm_grpo.families import Family


class PolicyEMA:
    def __init__(self, policy: List[torch.nn.Module], family: Family, config, pp_layers, decay: float, ramp: float):
        if not 0 < decay < 1 or not ramp > 0:
            raise ValueError(f"need 0 < --ema-decay < 1 and --ema-decay-ramp > 0, got {decay} and {ramp}")
        self.policy, self.decay, self.ramp = list(policy), decay, ramp
        self.adapters = family.lora
        self.lora = self.adapters.has_adapters(self.policy[0])
        self.modules = family.build_model_chunks(config, pp_layers)
        for chunk, source in zip(self.modules, self.policy):
            self.adapters.mirror_adapters(source, chunk)
            chunk.load_state_dict(source.state_dict())
            params = dict(chunk.named_parameters())
            for name, p in source.named_parameters():
                if not p.requires_grad:  # frozen: the policy's own tensor serves the average too
                    params[name].data = p.data
            chunk.requires_grad_(False)

    def eta(self, iteration: int) -> float:
        """The weight of the old average after iteration `iteration` (0-based)."""
        return min(self.ramp * iteration, self.decay)

    @torch.no_grad()
    def update(self, iteration: int):
        eta = self.eta(iteration)
        for chunk, source in zip(self.modules, self.policy):
            for avg, p in zip(chunk.parameters(), source.parameters()):
                if p.requires_grad:
                    avg.mul_(eta).add_(p.detach().to(avg.dtype), alpha=1 - eta)

    def state_dict(self) -> list:
        if self.lora:
            return [self.adapters.adapter_state_dict(chunk) for chunk in self.modules]
        return [chunk.state_dict() for chunk in self.modules]

    def load_state_dict(self, state: list):
        if len(state) != len(self.modules):
            raise ValueError(f"the checkpoint's EMA has {len(state)} model chunks, this layout {len(self.modules)}: "
                             "the EMA resumes only on the layout it was saved with")
        try:
            for chunk, s in zip(self.modules, state):
                if self.lora:  # adapters only; the base is the policy's
                    expected = set(self.adapters.adapter_state_dict(chunk))
                    if set(s) != expected:
                        raise RuntimeError(f"adapters {sorted(set(s) ^ expected)[:3]} differ")
                    chunk.load_state_dict(s, strict=False)
                else:
                    chunk.load_state_dict(s)
        except RuntimeError as e:
            raise ValueError("the checkpoint's EMA does not fit this rank's model chunks (saved with another "
                             f"TP / PP layout): {str(e).splitlines()[0]}") from None
