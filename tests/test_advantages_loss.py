"""Group advantages, the PPO-clip loss (and GRPO-Guard's RatioNorm), advantage-weighted matching and
DiffusionNFT's optimality probability (advantages gathered over 2 ranks:
tests/distributed/test_grpo_distributed.py; DiffusionNFT's and GRPO-Guard's losses against their
authors' code: tests/test_objective_oracles.py)."""
import math

import pytest
import torch

from mm_grpo.grpo import NonFiniteRewardError, awm_loss, group_advantages, grpo_loss, optimality_probability
from tests.utils import assert_one_line_error


def test_hand_computed_advantages():
    rewards = torch.tensor([1.0, 10.0, 2.0, 10.0, 3.0, 13.0])
    groups = torch.tensor([0, 1, 0, 1, 0, 1])  # interleaved on purpose
    r3 = math.sqrt(3)  # group 1: mean 11, deviations -1, -1, 2, unbiased var 3
    expected = torch.tensor([-1.0, -1 / r3, 0.0, -1 / r3, 1.0, 2 / r3])
    torch.testing.assert_close(group_advantages(rewards, groups), expected, rtol=1e-6, atol=1e-6)
    # population std (Flow-GRPO): group 0 std sqrt(2/3), group 1 sqrt(2)
    pop = torch.tensor([-math.sqrt(1.5), -1 / math.sqrt(2), 0.0, -1 / math.sqrt(2), math.sqrt(1.5), math.sqrt(2)])
    torch.testing.assert_close(group_advantages(rewards, groups, unbiased=False), pop, rtol=1e-6, atol=1e-6)
    # prompt strings group the same way
    prompts = ["a cat", "a dog", "a cat", "a dog", "a cat", "a dog"]
    assert torch.equal(group_advantages(rewards, prompts), group_advantages(rewards, groups))
    # a group of equal rewards gets zero advantage, not a division by zero
    assert group_advantages(torch.ones(4), [0, 0, 1, 1]).tolist() == [0.0] * 4


def test_advantages_clip_and_global_std():
    rewards = torch.tensor([0.0] * 49 + [1.0])  # the outlier sits 7 population stds above the mean
    adv = group_advantages(rewards, torch.zeros(50, dtype=torch.long), unbiased=False)
    assert adv[-1].item() == 5.0
    assert adv[0].item() == pytest.approx(-0.02 / math.sqrt(0.02 * 0.98), rel=1e-6)
    assert group_advantages(rewards, [0] * 50, unbiased=False, clip_max=10.0)[-1].item() == pytest.approx(7.0)

    rewards = torch.tensor([1.0, 2.0, 3.0, 11.0, 12.0, 13.0])
    groups = [0, 0, 0, 1, 1, 1]
    std_all = rewards.double().std().item()  # about 5.5: the spread between the groups counts
    expected = torch.tensor([-1.0, 0.0, 1.0, -1.0, 0.0, 1.0]) / std_all
    torch.testing.assert_close(group_advantages(rewards, groups, global_std=True), expected.float())


def test_non_finite_rewards_and_bad_groups():
    with pytest.raises(NonFiniteRewardError, match="2 of 4 rewards are non-finite"):
        group_advantages(torch.tensor([1.0, float("nan"), float("inf"), 0.0]), [0, 0, 1, 1])
    with pytest.raises(ValueError, match=r"1 group\(s\) hold a single sample"):
        group_advantages(torch.tensor([1.0, 2.0, 3.0]), [0, 0, 1])
    with pytest.raises(ValueError, match="got 2 group ids for 3 rewards"):
        group_advantages(torch.tensor([1.0, 2.0, 3.0]), [0, 0])
    with pytest.raises(ValueError, match="rewards must be 1-D"):
        group_advantages(torch.ones(2, 2), [0, 0])


def test_ratio_is_exactly_one_before_the_first_update():
    old = torch.randn(6) * 40 - 100  # log-probs of realistic size
    new = old.clone().requires_grad_()
    adv = torch.randn(6)
    loss, stats = grpo_loss(new, old, adv)
    assert stats["ratio_min"].item() == 1.0 and stats["ratio_max"].item() == 1.0
    assert stats["clip_frac"].item() == 0.0 and stats["approx_kl"].item() == 0.0
    assert torch.equal(loss.detach(), (-adv).mean())
    loss.backward()
    torch.testing.assert_close(new.grad, -adv / 6)


def test_loss_and_gradient_match_hand_computation():
    c = 0.2
    ratios = [1.5, 0.5, 1.5, 0.5, 1.1, 0.9]
    advs = [1.0, 1.0, -1.0, -1.0, 2.0, -0.5]
    old = torch.tensor([-3.0, 1.0, 0.5, -2.0, 4.0, 0.0])
    new = (old + torch.tensor(ratios).log()).requires_grad_()
    loss, stats = grpo_loss(new, old, torch.tensor(advs), clip_range=c)
    loss.backward()
    # per row: max(-A r, -A clip(r)); the gradient d/dlogp is -A r where the unclipped term wins, else 0
    expected_terms, expected_grad = [], []
    for r, a in zip(ratios, advs):
        unclipped, clipped = -a * r, -a * min(max(r, 1 - c), 1 + c)
        expected_terms.append(max(unclipped, clipped))
        expected_grad.append(-a * r if unclipped >= clipped else 0.0)
    # A > 0 above 1+c and A < 0 below 1-c are clipped (no gradient); the others are not
    assert [g == 0.0 for g in expected_grad] == [True, False, False, True, False, False]
    assert loss.item() == pytest.approx(sum(expected_terms) / 6, rel=1e-6)
    torch.testing.assert_close(new.grad, torch.tensor(expected_grad) / 6, rtol=1e-5, atol=1e-7)
    assert stats["clip_frac"].item() == pytest.approx(4 / 6)
    assert stats["ratio_max"].item() == pytest.approx(1.5) and stats["ratio_min"].item() == pytest.approx(0.5)
    assert stats["approx_kl"].item() == pytest.approx(0.5 * sum(math.log(r) ** 2 for r in ratios) / 6, rel=1e-5)


def test_default_clip_range_bounds():
    old = torch.zeros(4)
    new = torch.tensor([2e-4, -2e-4, 2e-4, -2e-4]).requires_grad_()  # ratios just outside 1 +- 1e-4
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, stats = grpo_loss(new, old, adv)
    loss.backward()
    r = new.detach().exp()
    # float32 terms near 1 cancel to 5e-5; an unclipped row 0 would give 2.5e-5
    assert loss.item() == pytest.approx((-(1 + 1e-4) - r[1].item() + r[2].item() + (1 - 1e-4)) / 4, abs=1e-7)
    torch.testing.assert_close(new.grad, torch.stack([0 * r[0], -r[1], r[2], 0 * r[3]]) / 4)
    assert stats["clip_frac"].item() == 1.0


def test_kl_term_to_reference_policy():
    g = torch.Generator().manual_seed(0)
    mean = torch.randn(2, 3, 4, generator=g).requires_grad_()
    ref_mean = torch.randn(2, 3, 4, generator=g)
    std = torch.tensor([0.1, 0.2]).view(2, 1, 1)
    logp = torch.zeros(2)
    loss, stats = grpo_loss(logp, logp, torch.zeros(2), kl_beta=0.5, mean=mean, ref_mean=ref_mean, std=std)
    per_sample = [((mean[b] - ref_mean[b]) ** 2).mean().item() / (2 * std[b].item() ** 2) for b in range(2)]
    assert stats["kl"].item() == pytest.approx(sum(per_sample) / 2, rel=1e-6)
    assert loss.item() == pytest.approx(0.5 * sum(per_sample) / 2, rel=1e-6)
    loss.backward()  # d/dmean = beta * (mean - ref) / std^2 / (elements per sample * B)
    torch.testing.assert_close(mean.grad, 0.5 * (mean - ref_mean).detach() / std**2 / (12 * 2))
    loss /= 4  # megatron-core scales the returned loss in place; the reported stat must not follow
    assert stats["loss"].item() == pytest.approx(0.5 * sum(per_sample) / 2, rel=1e-6)


def test_loss_bad_input():
    assert_one_line_error(lambda: grpo_loss(torch.zeros(3), torch.zeros(3), torch.zeros(2)), "equal 1-D")
    with pytest.raises(ValueError, match="kl_beta > 0 needs mean, ref_mean and std"):
        grpo_loss(torch.zeros(3), torch.zeros(3), torch.zeros(3), kl_beta=0.1)
    with pytest.raises(ValueError, match="clip_range > 0"):
        grpo_loss(torch.zeros(3), torch.zeros(3), torch.zeros(3), clip_range=0.0)


def test_awm_loss_is_the_advantage_weighted_flow_matching_loss():
    g = torch.Generator().manual_seed(0)
    v, x0, noise, ref_v = (torch.randn(3, 5, 4, generator=g) for _ in range(4))
    adv = torch.tensor([1.5, -0.5, 0.0])
    v.requires_grad_()
    loss, stats = awm_loss(v, x0, noise, adv, kl_beta=0.1, ref_v=ref_v)
    fm = [((v[b] - (noise[b] - x0[b])) ** 2).mean().item() for b in range(3)]
    kl = ((v - ref_v) ** 2).mean().item()
    assert loss.item() == pytest.approx(sum(a * f for a, f in zip(adv.tolist(), fm)) / 3 + 0.1 * kl, rel=1e-6)
    assert stats["fm_loss"].item() == pytest.approx(sum(fm) / 3, rel=1e-6)
    assert stats["kl"].item() == pytest.approx(kl, rel=1e-6)
    loss.backward()  # a zero advantage leaves only the KL pull on its row
    torch.testing.assert_close(v.grad[2], 0.1 * 2 * (v[2] - ref_v[2]).detach() / v.numel())


def test_awm_step_pulls_towards_better_samples_and_away_from_worse():
    """A gradient step on a learnable velocity moves it towards the target of the sample with the
    positive advantage and away from the one with the negative advantage."""
    g = torch.Generator().manual_seed(1)
    x0, noise = torch.randn(2, 6, 4, generator=g), torch.randn(2, 6, 4, generator=g)
    v = torch.zeros(2, 6, 4, requires_grad=True)
    loss, _ = awm_loss(v, x0, noise, torch.tensor([1.0, -1.0]))
    loss.backward()
    stepped = v.detach() - 0.1 * v.grad
    err = lambda w, b: ((w[b] - (noise[b] - x0[b])) ** 2).mean().item()  # noqa: E731
    assert err(stepped, 0) < err(v.detach(), 0)
    assert err(stepped, 1) > err(v.detach(), 1)


def test_awm_loss_bad_input():
    assert_one_line_error(lambda: awm_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2)),
                          "equal \\[B, ...\\] shapes")
    with pytest.raises(ValueError, match="reference velocity when kl_beta > 0"):
        awm_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), kl_beta=0.1)


# --- GRPO-Guard's RatioNorm and DiffusionNFT, against a direct float64 evaluation ------------
def _gaussian_logp64(x, mean, std):
    """log N(x; mean, std^2) averaged over the elements of each row, float64."""
    x, mean, std = x.double(), mean.double(), std.double().view(-1, *[1] * (x.ndim - 1))
    return (-((x - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)).flatten(1).mean(1)


def test_ratio_norm_matches_the_published_formula_in_float64():
    """log r_hat = std * (log r + mean|mu - mu_old|^2 / (2 std^2)), which for x' = mu_old + std eps
    equals mean(eps * (mu - mu_old)): the bias removed and the 1/std scale gone."""
    g = torch.Generator().manual_seed(0)
    B, shape = 6, (5, 4)
    std = torch.tensor([0.05, 0.1, 0.3, 0.05, 0.2, 0.8])
    old_mean = torch.randn(B, *shape, generator=g)
    eps = torch.randn(B, *shape, generator=g)
    x = old_mean + std.view(-1, 1, 1) * eps
    mean = (old_mean + 0.02 * torch.randn(B, *shape, generator=g)).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    c = 0.01
    logp = _gaussian_logp64(x, mean, std).float()
    old_logp = _gaussian_logp64(x, old_mean, std).float()
    loss, stats = grpo_loss(logp, old_logp, adv, clip_range=c, mean=mean, std=std.view(-1, 1, 1), old_mean=old_mean)
    # direct float64 evaluation of the formulas
    d = mean.detach().double() - old_mean.double()
    log_r = _gaussian_logp64(x, mean.detach(), std) - _gaussian_logp64(x, old_mean, std)
    log_r_hat = std.double() * (log_r + (d**2).flatten(1).mean(1) / (2 * std.double() ** 2))
    eps64 = (x.double() - old_mean.double()) / std.double().view(-1, 1, 1)  # x' = mu_old + std eps, read back
    torch.testing.assert_close(log_r_hat, (eps64 * d).flatten(1).mean(1), rtol=1e-9, atol=1e-12)
    r = log_r_hat.exp()
    a = adv.double()
    expected = torch.maximum(-a * r, -a * r.clamp(1 - c, 1 + c)).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-4, abs=1e-7)
    assert stats["ratio_mean"].item() == pytest.approx(r.mean().item(), rel=1e-5)
    # the plain ratio of the low-noise rows is far from 1, the normalised one is not
    assert (log_r.abs().max() > 10 * log_r_hat.abs().max()).item()
    loss.backward()
    assert torch.isfinite(mean.grad).all() and mean.grad.abs().sum() > 0
    # on-policy (mean == old mean): exactly ratio 1, as without RatioNorm
    _, on = grpo_loss(old_logp, old_logp, adv, mean=old_mean, std=std.view(-1, 1, 1), old_mean=old_mean.clone())
    assert on["ratio_min"].item() == on["ratio_max"].item() == 1.0
    with pytest.raises(ValueError, match="RatioNorm needs mean and old_mean"):
        grpo_loss(logp, old_logp, adv, old_mean=old_mean)


def test_optimality_probability_is_the_clipped_normalised_reward():
    rewards = torch.tensor([0.0, 1.0, 2.0, 10.0, 4.0, 4.0, 4.0, 4.0])
    adv = group_advantages(rewards, [0, 0, 0, 0, 1, 1, 1, 1])
    g = rewards[:4].double()
    z = (g - g.mean()) / g.std()
    for scale in (1.0, 0.5, 5.0):
        r = optimality_probability(adv, scale)
        expected = 0.5 + 0.5 * (z / scale).clamp(-1, 1)
        torch.testing.assert_close(r[:4].double(), expected, rtol=1e-6, atol=1e-6)
        assert r[4:].tolist() == [0.5] * 4  # equal rewards: neither positive nor negative
        assert r.min() >= 0 and r.max() <= 1
    # a sparse binary reward (1 success in 8) at the advantage clip's scale: the group's pushes cancel
    sparse = optimality_probability(group_advantages(torch.tensor([1.0] + [0.0] * 7), [0] * 8), 5.0)
    assert (2 * sparse - 1).sum().abs().item() < 1e-5
    with pytest.raises(ValueError, match="scale must be > 0"):
        optimality_probability(adv, 0.0)
