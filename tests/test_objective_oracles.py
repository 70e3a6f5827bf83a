"""DiffusionNFT's loss and GRPO-Guard's PPO loss against float64 transcriptions of their authors'
code, over every step of a shifted 16-step schedule, through the objectives the GRPO schedule uses.

- DiffusionNFT: NVlabs/DiffusionNFT, scripts/train_nft_sd3.py (the training step: implicit positive /
  negative predictions, x0 = x_t - t v, the adaptive weight, adv_clip_max / beta, the KL term).
- GRPO-Guard: yifan123/flow_grpo, scripts/train_sd3_GRPO_Guard.py (RatioNorm: ratio_mean_bias, the
  ratio scaled by sqrt_dt * std_dev_t; the reweighting: policy_loss / sqrt_dt**2) on the `sde` step of
  flow_grpo/diffusers_patch/sd3_sde_with_logprob.py.
The transcriptions are written from those files' formulas, on float64 tensors, not from mm-grpo's code.
"""
import math

import pytest
import torch

from mm_grpo.flow import noisy_latents
from mm_grpo.grpo import nft_loss, optimality_probability
from mm_grpo.grpo.hyperparameters import GRPOSettings
from mm_grpo.grpo.objectives import NFTObjective, PPOObjective
from mm_grpo.rollout import get_sampler, sigma_schedule
from tests.utils import assert_one_line_error

B, S, C = 4, 8, 4
STEPS, SHIFT = 16, 3.0


def _draw(seed, *shape, n):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


# --- DiffusionNFT ------------------------------------------------------------------------
def _diffusion_nft64(x0, xt, t, forward_prediction, old_prediction, ref_prediction, advantages, *,
                     beta, adv_clip_max, train_beta):
    """The loss of one (micro-batch, timestep) in train_nft_sd3.py, float64 (adv_mode "all")."""
    t_expanded = t.view(-1, *([1] * (x0.ndim - 1)))
    dims = tuple(range(1, x0.ndim))
    advantages_clip = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    r = torch.clamp((advantages_clip / adv_clip_max) / 2.0 + 0.5, 0, 1)
    positive_prediction = beta * forward_prediction + (1 - beta) * old_prediction.detach()
    implicit_negative_prediction = (1.0 + beta) * old_prediction.detach() - beta * forward_prediction
    x0_prediction = xt - t_expanded * positive_prediction
    with torch.no_grad():
        weight_factor = torch.abs(x0_prediction - x0).mean(dim=dims, keepdim=True).clip(min=0.00001)
    positive_loss = ((x0_prediction - x0) ** 2 / weight_factor).mean(dim=dims)
    negative_x0_prediction = xt - t_expanded * implicit_negative_prediction
    with torch.no_grad():
        negative_weight_factor = torch.abs(negative_x0_prediction - x0).mean(dim=dims, keepdim=True).clip(min=0.00001)
    negative_loss = ((negative_x0_prediction - x0) ** 2 / negative_weight_factor).mean(dim=dims)
    ori_policy_loss = r * positive_loss / beta + (1.0 - r) * negative_loss / beta
    policy_loss = (ori_policy_loss * adv_clip_max).mean()
    kl_div_loss = ((forward_prediction - ref_prediction) ** 2).mean(dim=dims)
    return policy_loss + train_beta * torch.mean(kl_div_loss)


@pytest.mark.parametrize("beta, kl_beta", [(1.0, 0.0), (0.1, 1e-4), (0.5, 0.1)])  # the authors' configs, and one more
def test_nft_equals_diffusion_nft_over_a_shifted_schedule(beta, kl_beta):
    """Loss and gradient of NFTObjective at every step's sigma (1 included) against the transcription;
    advantages beyond the clip included."""
    clip = 5.0
    settings = GRPOSettings(prompts_per_iteration=B // 2, num_generations=2, policy_loss="nft", sampler="ode",
                            nft_beta=beta, adv_clip_max=clip, kl_beta=kl_beta)
    sigmas = sigma_schedule(STEPS, SHIFT)
    objective = NFTObjective(settings, get_sampler("ode"), sigmas)
    x0, noise, v_old, ref_v, dv = _draw(3, B, S, C, n=5)
    advantages = torch.tensor([7.0, 1.5, -0.4, -6.0])  # as group_advantages clips them: within +-clip
    for i in range(STEPS):
        sigma = sigmas[i].expand(B)
        v = (v_old + 0.3 * dv).requires_grad_()
        mb = dict(hidden_states=noisy_latents(x0, noise, sigmas[i]), timestep=sigma, x0=x0, noise=noise,
                  advantages=advantages.clamp(-clip, clip), old_v=v_old, ref_v=ref_v)
        loss, stats = objective.loss(v, mb)
        loss.backward()
        v64 = v.detach().double().requires_grad_()
        t = sigma.double()
        xt = (1 - t.view(-1, 1, 1)) * x0.double() + t.view(-1, 1, 1) * noise.double()
        expected = _diffusion_nft64(x0.double(), xt, t, v64, v_old.double(), ref_v.double(), advantages.double(),
                                    beta=beta, adv_clip_max=clip, train_beta=kl_beta)
        expected.backward()
        assert loss.item() == pytest.approx(expected.item(), rel=2e-6), i
        torch.testing.assert_close(v.grad.double(), v64.grad, rtol=2e-5, atol=1e-5 * v64.grad.abs().max().item())
        assert stats["optimality_mean"].item() == pytest.approx(
            optimality_probability(advantages, clip).mean().item(), rel=1e-6)


def test_nft_adaptive_weight_floor_and_direction():
    """A row already at x0 (error at float32 rounding) meets the 1e-5 floor, not a division by ~0; at v = v_old a
    gradient step moves a positive sample's x0 prediction towards x0 and a negative one's away."""
    x0, noise, v_old = _draw(4, 2, S, C, n=3)
    sigma = torch.tensor([0.6, 0.6])
    xt = noisy_latents(x0, noise, sigma)
    exact = (noise - x0).clone()  # v* : x0 prediction exact
    at_x0 = exact.clone().requires_grad_()
    loss, _ = nft_loss(at_x0, exact, xt, sigma, x0, torch.tensor([1.0, 1.0]))
    loss.backward()
    assert 0 <= loss.item() < 1e-8 and at_x0.grad.abs().max().item() < 1e-2  # ~0.1 without the floor
    v = v_old.clone().requires_grad_()
    loss, _ = nft_loss(v, v_old, xt, sigma, x0, torch.tensor([1.0, 0.0]))
    loss.backward()
    stepped = v.detach() - 0.1 * v.grad
    err = lambda w, b: ((xt[b] - 0.6 * w[b] - x0[b]) ** 2).mean().item()  # noqa: E731
    assert err(stepped, 0) < err(v_old, 0)
    assert err(stepped, 1) > err(v_old, 1)


def test_nft_loss_bad_input():
    z, s = torch.zeros(2, 3), torch.full((2,), 0.5)
    assert_one_line_error(lambda: nft_loss(z, torch.zeros(2, 4), z, s, z, torch.zeros(2)), "equal \\[B, ...\\] shapes")
    assert_one_line_error(lambda: nft_loss(z, z, z, torch.zeros(3), z, torch.zeros(2)), "sigma \\[B\\] or a scalar")
    with pytest.raises(ValueError, match="beta > 0"):
        nft_loss(z, z, z, s, z, torch.zeros(2), beta=0.0)
    with pytest.raises(ValueError, match="adv_clip_max > 0"):
        nft_loss(z, z, z, s, z, torch.zeros(2), adv_clip_max=0.0)
    with pytest.raises(ValueError, match="reference velocity when kl_beta > 0"):
        nft_loss(z, z, z, s, z, torch.zeros(2), kl_beta=0.1)


# --- GRPO-Guard ----------------------------------------------------------------------------
def _flow_grpo_sde64(x, v, sigma, sigma_prev, sigma_max, noise_level, *, variance_noise=None, prev_sample=None):
    """sde_step_with_logprob, sde_type "sde", float64: (prev_sample, log_prob, prev_sample_mean, std_dev_t, sqrt_dt)."""
    dt = sigma_prev - sigma
    std_dev_t = math.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma))) * noise_level
    prev_sample_mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    if prev_sample is None:
        prev_sample = prev_sample_mean + std_dev_t * math.sqrt(-dt) * variance_noise
    log_prob = (-((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * (std_dev_t * math.sqrt(-dt)) ** 2)
                - math.log(std_dev_t * math.sqrt(-dt)) - math.log(math.sqrt(2 * math.pi)))
    return prev_sample, log_prob.mean(dim=tuple(range(1, log_prob.ndim))), prev_sample_mean, std_dev_t, math.sqrt(-dt)


def _grpo_guard64(log_prob, old_log_prob, prev_sample_mean, old_prev_sample_mean, std_dev_t, sqrt_dt, advantages,
                  clip_range):
    """The policy loss of train_sd3_GRPO_Guard.py with config.rationorm (one timestep j per micro-batch)."""
    ratio_mean_bias = (prev_sample_mean - old_prev_sample_mean).pow(2).mean(dim=tuple(range(1, prev_sample_mean.ndim)))
    ratio_mean_bias = ratio_mean_bias / (2 * (sqrt_dt * std_dev_t) ** 2)
    ratio = torch.exp((log_prob - old_log_prob + ratio_mean_bias) * (sqrt_dt * std_dev_t))
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.mean(torch.maximum(unclipped_loss, clipped_loss)) / sqrt_dt**2


@pytest.mark.parametrize("clip_range", [2e-6, 1e-3, 0.2])  # the authors' OCR / GenEval config, and wider
def test_grpo_guard_equals_flow_grpo_over_a_shifted_schedule(clip_range):
    """Every step of a shift-3 16-step flow_sde rollout (noise level 0.7): the old policy samples
    x_t+1 and its log-prob and mean, a moved policy is trained on it with --ratio-norm
    --step-reweight through PPOObjective; loss and gradient against the transcription."""
    a = 0.7
    settings = GRPOSettings(prompts_per_iteration=B // 2, num_generations=2, sampler="flow_sde", noise_level=a,
                            clip_range=clip_range, ratio_norm=True, step_reweight=True, num_inference_steps=STEPS)
    sigmas = sigma_schedule(STEPS, SHIFT)
    sampler = get_sampler("flow_sde", a)
    objective = PPOObjective(settings, sampler, sigmas)
    x, v_old, eps, dv = _draw(5, B, S, C, n=4)
    advantages = torch.tensor([1.2, -0.7, 0.3, -2.0])
    sigma_max = sigmas[1].item()
    for i in range(STEPS):
        s, s_next = sigmas[i].item(), sigmas[i + 1].item()
        old = sampler(x, v_old, sigmas[i], sigmas[i + 1], eps=eps)
        v = (v_old + 0.02 * dv).requires_grad_()
        mb = dict(hidden_states=x, x_next=old.prev_sample, timestep=sigmas[i].expand(B),
                  sigma_next=sigmas[i + 1].expand(B), old_log_prob=old.log_prob, advantages=advantages)
        objective.attach_old(mb, v_old)
        loss, _ = objective.loss(v, mb)
        loss.backward()
        # flow_grpo: the rollout stores next_latents, log_probs and prev_sample_mean of the old policy
        x64, v64 = x.double(), v.detach().double().requires_grad_()
        sample, old_logp, old_mean, _, _ = _flow_grpo_sde64(x64, v_old.double(), s, s_next, sigma_max, a,
                                                            variance_noise=eps.double())
        torch.testing.assert_close(old.prev_sample.double(), sample, rtol=0, atol=1e-5)
        _, logp, mean, std_dev_t, sqrt_dt = _flow_grpo_sde64(x64, v64, s, s_next, sigma_max, a,
                                                             prev_sample=old.prev_sample.double())
        expected = _grpo_guard64(logp, old_logp, mean, old_mean, std_dev_t, sqrt_dt, advantages.double(), clip_range)
        expected.backward()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-4, abs=1e-9), i
        torch.testing.assert_close(v.grad.double(), v64.grad, rtol=1e-3, atol=1e-4 * v64.grad.abs().max().item())
