"""Group-normalised GRPO advantages, identical on every data-parallel rank."""
import hashlib
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

GroupIds = Union[torch.Tensor, Sequence[Union[int, str]]]


class NonFiniteRewardError(RuntimeError):
    """A reward is NaN or inf. Raised on every rank alike (the check runs on the gathered
    rewards), so the trainer can catch it and skip the iteration without a collective hang."""


def _group_keys(group_ids: GroupIds, device) -> torch.Tensor:
    """int64 keys; prompt strings are hashed so equal prompts on different ranks share a group."""
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dtype.is_floating_point or group_ids.dtype.is_complex or group_ids.ndim != 1:
            raise ValueError(f"group ids must be a 1-D integer tensor, got {group_ids.dtype} {tuple(group_ids.shape)}")
        return group_ids.to(device=device, dtype=torch.long)
    keys = [
        int.from_bytes(hashlib.blake2b(g.encode(), digest_size=8).digest(), "little", signed=True)
        if isinstance(g, str)
        else int(g)
        for g in group_ids
    ]
    return torch.tensor(keys, dtype=torch.long, device=device)


def _all_gather_rows(tensors: Sequence[torch.Tensor], process_group) -> Tuple[list, int]:
    """Concatenates each 1-D tensor over the ranks of `process_group` (ranks may hold different
    row counts); returns the gathered tensors and this rank's first row in them."""
    world = dist.get_world_size(process_group)
    count = torch.tensor([tensors[0].shape[0]], device=tensors[0].device)
    counts = [torch.empty_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=process_group)
    counts = [int(c) for c in counts]
    gathered = []
    for t in tensors:
        padded = t.new_zeros(max(counts))
        padded[: t.shape[0]] = t
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded, group=process_group)
        gathered.append(torch.cat([p[:c] for p, c in zip(parts, counts)]))
    return gathered, sum(counts[: dist.get_rank(process_group)])


def group_advantages(
    rewards: torch.Tensor,
    group_ids: GroupIds,
    *,
    eps: float = 1e-8,
    clip_max: float = 5.0,
    global_std: bool = False,
    unbiased: bool = True,
    process_group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """A = (r - mean_group) / (std + eps), clamped to [-clip_max, clip_max], float32 [B_local].

    group_ids: one group index or prompt string per reward. std is the group's own, or with
    global_std the std of all rewards (Flow-GRPO's option). unbiased=True is torch.std as in
    DanceGRPO; False is numpy's population std as in Flow-GRPO. With a process group the
    rewards of all its ranks form the statistics (a group may span ranks) and each rank gets
    back the advantages of its own rows; None means not distributed.
    """
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    keys = _group_keys(group_ids, rewards.device)
    if keys.shape != rewards.shape:
        raise ValueError(f"got {keys.shape[0]} group ids for {rewards.shape[0]} rewards; need one per reward")
    if not clip_max > 0 or not eps >= 0:
        raise ValueError(f"need clip_max > 0 and eps >= 0, got clip_max={clip_max!r}, eps={eps!r}")
    if process_group is None:
        all_rewards, all_keys, offset = rewards, keys, 0
    else:  # gathered in the rewards' own dtype: HCCL has no float64 collectives
        (all_rewards, all_keys), offset = _all_gather_rows([rewards, keys], process_group)
    all_rewards = all_rewards.double()

    bad = int((~torch.isfinite(all_rewards)).sum())
    if bad:
        raise NonFiniteRewardError(f"{bad} of {all_rewards.numel()} rewards are non-finite (NaN or inf)")
    _, inverse, counts = torch.unique(all_keys, return_inverse=True, return_counts=True)
    if bool((counts < 2).any()):
        raise ValueError(f"{int((counts < 2).sum())} group(s) hold a single sample; GRPO needs >= 2 per group")

    ddof = 1 if unbiased else 0
    sums = torch.zeros(counts.shape, dtype=torch.float64, device=counts.device).index_add_(0, inverse, all_rewards)
    centred = all_rewards - (sums / counts)[inverse]
    if global_std:
        std = all_rewards.std(correction=ddof)
    else:
        var = torch.zeros_like(sums).index_add_(0, inverse, centred**2) / (counts - ddof)
        std = var.sqrt()[inverse]
    advantages = (centred / (std + eps)).clamp(-clip_max, clip_max)
    return advantages[offset : offset + rewards.shape[0]].float()


def optimality_probability(advantages: torch.Tensor, scale: float) -> torch.Tensor:
    """DiffusionNFT's optimality probability r = 1/2 + 1/2 clip((R - E[R]) / Z, -1, 1) (Zheng et al.
    2025, arXiv 2509.16117) from group-normalised advantages A = (R - mean) / std, with Z = std *
    `scale` (the authors' code: `scale` = the advantage clip, 5): in [0, 1], 1/2 at the group's mean
    reward. A scale the advantages rarely exceed keeps sum(2r - 1) = sum(A) / scale = 0 per group;
    scale 1 would clip a sparse reward's lone success (A = 2.6 for 1 in 8) but not its failures
    (A = -0.38), and the group would push the policy away from its own samples on balance."""
    if not scale > 0:
        raise ValueError(f"the optimality probability's scale must be > 0, got {scale}")
    return 0.5 + 0.5 * (advantages.float() / scale).clamp(-1.0, 1.0)
