"""GRPO policy losses of one micro-batch (one trained step per row): PPO-clip on the rollout's
log-probabilities, or advantage-weighted matching on its final samples."""
from typing import Dict, Optional, Tuple

import torch

from mm_grpo.flow import flow_matching_loss


def grpo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float = 1e-4,
    kl_beta: float = 0.0,
    mean: Optional[torch.Tensor] = None,
    ref_mean: Optional[torch.Tensor] = None,
    std: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """L = mean(max(-A r, -A clip(r, 1-c, 1+c))) + beta * KL, r = exp(logp - logp_old).

    KL to a reference policy (given mean, ref_mean and the step std from the sampler outputs):
    mean over non-batch dims of (mean - ref_mean)^2 / (2 std^2), then over the micro-batch.
    The loss is a mean over the rows of this micro-batch: the caller divides it by the number
    of micro-batches (and trained timesteps) it accumulates. Stats are detached 0-d tensors.
    """
    if not (log_prob.ndim == 1 and log_prob.shape == old_log_prob.shape == advantages.shape):
        raise ValueError(
            "log_prob, old_log_prob and advantages must be equal 1-D [B] shapes, got "
            f"{tuple(log_prob.shape)}, {tuple(old_log_prob.shape)}, {tuple(advantages.shape)}"
        )
    if not clip_range > 0 or kl_beta < 0:
        raise ValueError(f"need clip_range > 0 and kl_beta >= 0, got {clip_range!r} and {kl_beta!r}")
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_range, 1 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()

    kl = torch.zeros((), device=log_prob.device)
    if ref_mean is not None:
        if mean is None or std is None or mean.shape != ref_mean.shape or mean.shape[0] != log_prob.shape[0]:
            raise ValueError("the KL term needs mean and ref_mean of the same [B, ...] shape and the step std")
        per_element = (mean - ref_mean) ** 2 / (2 * std**2)
        kl = per_element.mean(dim=tuple(range(1, per_element.ndim))).mean()
        loss = loss + kl_beta * kl
    elif kl_beta > 0:
        raise ValueError("kl_beta > 0 needs mean, ref_mean and std from the policy and reference steps")

    with torch.no_grad():
        stats = {
            "loss": loss.detach().clone(),  # a copy: megatron-core divides the loss in place
            "ratio_mean": ratio.mean(),
            "ratio_min": ratio.min(),
            "ratio_max": ratio.max(),
            "clip_frac": ((ratio - 1).abs() > clip_range).float().mean(),
            "approx_kl": 0.5 * ((log_prob - old_log_prob) ** 2).mean(),
            "kl": kl.detach(),
        }
    return loss, stats


def awm_loss(
    v_pred: torch.Tensor,
    x0: torch.Tensor,
    noise: torch.Tensor,
    advantages: torch.Tensor,
    *,
    kl_beta: float = 0.0,
    ref_v: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Advantage-weighted matching: L = mean(A * |v - (noise - x0)|^2) + beta * |v - v_ref|^2.

    The flow-matching loss of the rollout's own samples x0, re-noised by the forward process, weighted
    by their group advantages (AWM, Xue et al. 2025; on-policy it is also DiffusionNFT's gradient, Zheng
    et al. 2025). No log-probabilities: the gradient is a regression towards better samples and away
    from worse ones, instead of a score-function estimate over every SDE noise the rollout drew.
    """
    if not (advantages.ndim == 1 and v_pred.shape == x0.shape == noise.shape and v_pred.shape[0] == len(advantages)):
        raise ValueError(f"v_pred, x0 and noise must be equal [B, ...] shapes and advantages [B], got "
                         f"{tuple(v_pred.shape)}, {tuple(x0.shape)}, {tuple(noise.shape)}, {tuple(advantages.shape)}")
    if kl_beta < 0 or (kl_beta > 0 and ref_v is None):
        raise ValueError(f"need kl_beta >= 0, and the reference velocity when kl_beta > 0 (got {kl_beta!r})")
    fm = flow_matching_loss(v_pred, x0, noise)
    loss = (advantages.float() * fm).mean()
    kl = torch.zeros((), device=v_pred.device)
    if ref_v is not None:
        kl = ((v_pred.float() - ref_v.float()) ** 2).mean()
        loss = loss + kl_beta * kl
    with torch.no_grad():
        stats = {"loss": loss.detach().clone(), "fm_loss": fm.mean(), "kl": kl.detach()}
    return loss, stats
