"""GRPO policy losses of one micro-batch (one trained step per row): PPO-clip on the rollout's
log-probabilities (optionally with GRPO-Guard's RatioNorm), advantage-weighted matching or
DiffusionNFT's negative-aware flow matching on its final samples."""
from typing import Dict, Optional, Tuple

import torch

from mm_grpo.flow import flow_matching_loss

# The floor of DiffusionNFT's adaptive weight (the authors' clip(min=0.00001)).
NFT_MIN_WEIGHT = 1e-5


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
    old_mean: Optional[torch.Tensor] = None,
    step_weight: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """L = mean(w * max(-A r, -A clip(r, 1-c, 1+c))) + beta * KL, r = exp(logp - logp_old), w = 1
    unless `step_weight` [B] is given.

    RatioNorm (GRPO-Guard, Wang et al. 2025, arXiv 2510.22319, Eq. 8), when the old policy's
    step mean `old_mean` is given: for a Gaussian step x' = mu_old + std eps, the log-ratio is
    log r = <eps, d>/std - |d|^2 / (2 std^2) with d = mu - mu_old (both averaged over the
    elements, as the log-probs are): its mean sits below 0 and its spread grows as 1/std at the
    low-noise steps, so clipping acts unevenly. The normalised ratio removes that bias and scale,
    log r_hat = std * (log r + |d|^2 / (2 std^2)) = <eps, d>,
    zero-mean under the old policy with a spread that does not depend on the step's std.
    GRPO-Guard's gradient reweighting passes each row's step weight 1/|dt| (`guard_step_weight`), so
    that no noise level's steps dominate the update. Both as flow_grpo's implementation
    (scripts/train_sd3_GRPO_Guard.py); rows of one micro-batch may sit at different steps here, so
    the weight is per row where flow_grpo divides a micro-batch of one step by its 1/|dt|.

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
    log_ratio = log_prob - old_log_prob
    if old_mean is not None:
        if mean is None or std is None or mean.shape != old_mean.shape or mean.shape[0] != log_prob.shape[0]:
            raise ValueError("RatioNorm needs mean and old_mean of the same [B, ...] shape and the step std")
        std_b = std.float().reshape(-1) if std.numel() > 1 else std.float().reshape(()).expand(len(log_prob))
        bias = ((mean.float() - old_mean.float()) ** 2).mean(dim=tuple(range(1, mean.ndim))) / (2 * std_b**2)
        log_ratio = std_b * (log_ratio + bias)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_range, 1 + clip_range)
    policy_term = torch.maximum(unclipped, clipped)
    if step_weight is not None:
        if step_weight.shape != log_prob.shape:
            raise ValueError(f"step_weight must be [B] like log_prob, got {tuple(step_weight.shape)}")
        policy_term = step_weight.to(policy_term.dtype) * policy_term
    loss = policy_term.mean()

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
            "approx_kl": 0.5 * (log_ratio**2).mean(),
            "kl": kl.detach(),
        }
    return loss, stats


def guard_step_weight(sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
    """GRPO-Guard's gradient reweighting (Wang et al. 2025, arXiv 2510.22319) as flow_grpo's
    implementation computes it (scripts/train_sd3_GRPO_Guard.py, `policy_loss / sqrt_dt**2`): a step's
    PPO term is divided by |dt| = sigma - sigma_next, which cancels the RatioNorm-scaled ratio's
    gradient growing with the step's noise (std = sigma_t sqrt|dt|)."""
    dt = sigma.double() - sigma_next.double()
    if not (dt > 0).all():
        raise ValueError("GRPO-Guard's step weight needs sigma_next < sigma on every row")
    return (1.0 / dt).float()


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


def nft_loss(
    v_pred: torch.Tensor,
    v_old: torch.Tensor,
    x_t: torch.Tensor,
    sigma: torch.Tensor,
    x0: torch.Tensor,
    optimality: torch.Tensor,
    *,
    beta: float = 1.0,
    adv_clip_max: float = 5.0,
    kl_beta: float = 0.0,
    ref_v: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """DiffusionNFT's negative-aware fine-tuning loss (Zheng et al. 2025, arXiv 2509.16117) as the
    authors' code computes it (NVlabs/DiffusionNFT, scripts/train_nft_sd3.py):

        v+ = beta v_theta + (1 - beta) v_old,   v- = (1 + beta) v_old - beta v_theta,
        x0+- = x_t - sigma v+-                  (each implicit policy's x0 prediction)
        l+- = mean((x0+- - x0)^2) / sg(max(mean|x0+- - x0|, 1e-5))   (the adaptive weight)
        L  = adv_clip_max / beta * mean(r l+ + (1 - r) l-) + kl_beta * mean((v_theta - v_ref)^2),

    with x_t = (1 - sigma) x0 + sigma noise the re-noised sample, v_old the old (sampling) policy's
    velocity there (no gradient), r in [0, 1] each sample's optimality probability
    (`optimality_probability`); means over a row's elements, then over the rows. The adaptive
    weight makes each row's loss a relative error (its gradient does not scale with how far the row
    is from x0); adv_clip_max / beta restores the scale of the unnormalised advantages.
    """
    if not (optimality.ndim == 1 and v_pred.shape == v_old.shape == x_t.shape == x0.shape
            and v_pred.shape[0] == len(optimality) and sigma.shape in ((), (len(optimality),))):
        raise ValueError(f"v_pred, v_old, x_t and x0 must be equal [B, ...] shapes, optimality [B] and sigma [B] or "
                         f"a scalar, got {tuple(v_pred.shape)}, {tuple(v_old.shape)}, {tuple(x_t.shape)}, "
                         f"{tuple(x0.shape)}, {tuple(optimality.shape)}, {tuple(sigma.shape)}")
    if not beta > 0 or not adv_clip_max > 0 or kl_beta < 0 or (kl_beta > 0 and ref_v is None):
        raise ValueError(f"need beta > 0, adv_clip_max > 0, kl_beta >= 0 and the reference velocity when kl_beta > 0 "
                         f"(got beta {beta!r}, adv_clip_max {adv_clip_max!r}, kl_beta {kl_beta!r})")
    v, v_old, x_t, x0 = v_pred.float(), v_old.float().detach(), x_t.float(), x0.float()
    sigma = sigma.float().reshape(-1, *([1] * (v.ndim - 1)))
    dims = tuple(range(1, v.ndim))

    def x0_error(velocity):
        error = x_t - sigma * velocity - x0
        with torch.no_grad():  # in float64 as the authors', so that the clamp acts on the true value
            weight = error.double().abs().mean(dim=dims, keepdim=True).clamp(min=NFT_MIN_WEIGHT)
        return (error**2 / weight.float()).mean(dim=dims)

    positive = x0_error(beta * v + (1 - beta) * v_old)
    negative = x0_error((1 + beta) * v_old - beta * v)
    r = optimality.float()
    unweighted = (r * positive + (1 - r) * negative) / beta
    loss = (adv_clip_max * unweighted).mean()
    kl = torch.zeros((), device=v_pred.device)
    if ref_v is not None:
        kl = ((v - ref_v.float()) ** 2).mean()
        loss = loss + kl_beta * kl
    with torch.no_grad():
        stats = {"loss": loss.detach().clone(), "unweighted_policy_loss": unweighted.mean(),
                 "old_deviate": ((v - v_old) ** 2).mean(),
                 "optimality_mean": r.mean(), "kl": kl.detach()}
    return loss, stats
