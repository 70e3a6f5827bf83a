"""Sampler steps: Gaussian log-probs, mean/std formulas, recompute parity, CPS coefficients and
Flow-GRPO's CPS log-prob."""
import math

import pytest
import torch

from mm_grpo.rollout import SAMPLERS, get_sampler, ode_step, sigma_schedule
from tests.utils import assert_one_line_error


SDE_SAMPLERS = ["dance_sde", "flow_sde", "cps"]
GAUSSIAN_SAMPLERS = ["dance_sde", "flow_sde"]  # cps scores with Flow-GRPO's constant-free squared error
B, S, C = 3, 8, 4
# cps_step computes in float32: its values against a float64 transcription agree to float32 rounding
FLOAT32_ATOL, FLOAT32_RTOL = 1e-6, 1e-6


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, C, generator=g).to(dtype)
    v = torch.randn(B, S, C, generator=g).to(dtype)
    eps = torch.randn(B, S, C, generator=g)
    return x, v, eps


def _reference_mean_std(name, x, v, s, s_next, a):
    """The reference §3 formulas, re-derived in float64 on plain numbers."""
    x, v = x.double(), v.double()
    if name == "dance_sde":
        d = s_next - s
        x0_hat = x - s * v
        score = -(x - (1 - s) * x0_hat) / s**2
        return x + d * v + d * (-0.5 * a**2 * score), a * math.sqrt(s - s_next)
    if name == "flow_sde":
        dt = s_next - s
        std_t = a * math.sqrt(s / (1 - (s_next if s == 1 else s)))  # sigma_1 at sigma = 1
        mean = x * (1 + std_t**2 / (2 * s) * dt) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
        return mean, std_t * math.sqrt(-dt)
    std = s_next * math.sin(a * math.pi / 2)
    x0_hat, x1_hat = x - s * v, x + (1 - s) * v
    return (1 - s_next) * x0_hat + math.sqrt(s_next**2 - std**2) * x1_hat, std


def test_sigma_schedule_matches_shift_formula():
    sigmas = sigma_schedule(16, 3.0)
    assert sigmas.dtype == torch.float32 and sigmas.shape == (17,)
    expected = [3 * (1 - i / 16) / (1 + 2 * (1 - i / 16)) for i in range(17)]
    torch.testing.assert_close(sigmas, torch.tensor(expected, dtype=torch.float32), rtol=0, atol=1e-7)
    assert sigmas[0].item() == 1.0 and sigmas[-1].item() == 0.0
    assert bool((sigmas[1:] < sigmas[:-1]).all())
    torch.testing.assert_close(sigma_schedule(1, 1.0), torch.tensor([1.0, 0.0]))


@pytest.mark.parametrize("name", GAUSSIAN_SAMPLERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_prob_is_gaussian_density_of_drawn_step(name, dtype):
    sigmas = sigma_schedule(16, 3.0)
    x, v, eps = _inputs(dtype)
    step = get_sampler(name)
    for i in (0, 7, 14):  # sigma = 1 (flow_sde's special case), middle, near the end
        out = step(x, v, sigmas[i], sigmas[i + 1], eps=eps)
        assert out.prev_sample.dtype == dtype and out.mean.dtype == torch.float32
        assert out.log_prob.dtype == torch.float32 and out.log_prob.shape == (B,)
        normal = torch.distributions.Normal(out.mean.double(), out.std.double())
        expected = normal.log_prob(out.prev_sample.double()).mean(dim=(1, 2))
        torch.testing.assert_close(out.log_prob.double(), expected, rtol=1e-5, atol=1e-5)
        # the drawn sample is mean + std * eps (up to the cast to x's dtype)
        drawn = out.mean.double() + out.std.double() * eps.double()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.prev_sample.double(), drawn, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", SDE_SAMPLERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mean_and_std_match_rederivation(name, dtype):
    sigmas = sigma_schedule(16, 3.0)
    x, v, eps = _inputs(dtype, seed=1)
    a = {"dance_sde": 0.3, "flow_sde": 0.7, "cps": 0.7}[name]  # the defaults
    for i in (0, 5, 15):
        s, s_next = sigmas[i].item(), sigmas[i + 1].item()
        out = get_sampler(name)(x, v, sigmas[i], sigmas[i + 1], eps=eps)
        mean, std = _reference_mean_std(name, x, v, s, s_next, a)
        torch.testing.assert_close(out.mean.double(), mean, rtol=1e-5, atol=1e-5)
        assert out.std.item() == pytest.approx(std, rel=1e-6)
        torch.testing.assert_close(out.x0_hat.double(), x.double() - s * v.double(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", SDE_SAMPLERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recompute_from_x_next_is_bitwise(name, dtype):
    sigmas = sigma_schedule(16, 3.0)
    x, v, eps = _inputs(dtype, seed=2)
    step = get_sampler(name, noise_level=0.5)
    for i in (0, 9):
        rolled = step(x, v, sigmas[i], sigmas[i + 1], eps=eps)
        # training gathers per-sample sigmas as [B] tensors: still the same floats
        trained = step(x, v, sigmas[i].repeat(B), sigmas[i + 1].repeat(B), x_next=rolled.prev_sample)
        assert torch.equal(trained.log_prob, rolled.log_prob)
        assert torch.equal(trained.mean.expand_as(rolled.mean), rolled.mean)


def test_per_sample_sigmas_equal_scalar_calls():
    sigmas = sigma_schedule(16, 3.0)
    x, v, eps = _inputs(torch.float32, seed=3)
    idx = torch.tensor([0, 4, 11])
    out = get_sampler("flow_sde")(x, v, sigmas[idx], sigmas[idx + 1], eps=eps)
    for b, i in enumerate(idx.tolist()):
        one = get_sampler("flow_sde")(x[b : b + 1], v[b : b + 1], sigmas[i], sigmas[i + 1], eps=eps[b : b + 1])
        assert torch.equal(out.log_prob[b : b + 1], one.log_prob)
        assert torch.equal(out.prev_sample[b : b + 1], one.prev_sample)


def test_log_prob_gradient_reaches_v_through_the_mean():
    s, s_next, eta = 0.6, 0.5, 0.3
    x, v, eps = _inputs(torch.float32, seed=4)
    x_next = get_sampler("dance_sde")(x, v, s, s_next, eps=eps).prev_sample
    v = (v + 0.1).requires_grad_()  # a moved policy
    out = get_sampler("dance_sde")(x, v, s, s_next, x_next=x_next)
    out.log_prob.sum().backward()
    # d mean / d v = d (1 + 0.5 eta^2 (1 - s) / s) with d = s_next - s
    dmean_dv = (s_next - s) * (1 + 0.5 * eta**2 * (1 - s) / s)
    expected = (x_next - out.mean.detach()) / out.std**2 * dmean_dv / (S * C)
    torch.testing.assert_close(v.grad, expected, rtol=1e-4, atol=1e-6)


def test_ode_step_is_deterministic_euler():
    x, v, eps = _inputs(torch.float32, seed=5)
    a = ode_step(x, v, 0.7, 0.4, eps=eps)
    b = ode_step(x, v, 0.7, 0.4, eps=torch.randn_like(eps))
    assert a.log_prob is None and torch.equal(a.prev_sample, b.prev_sample)
    assert torch.equal(a.prev_sample, x + (torch.tensor(0.4) - torch.tensor(0.7)) * v)
    assert get_sampler("ode") is ode_step


def test_cps_preserves_coefficients():
    # x0, x1 and eps are orthogonal unit vectors, so x' reads out its own coefficients
    x0, x1, eps = torch.eye(3).unsqueeze(0).unbind(1)
    x0, x1, eps = x0.unsqueeze(1), x1.unsqueeze(1), eps.unsqueeze(1)  # [1, 1, 3]
    for a in (0.3, 0.7, 1.0):
        for s, s_next in ((1.0, 0.9), (0.6, 0.45), (0.2, 0.05)):
            x = (1 - s) * x0 + s * x1
            out = get_sampler("cps", noise_level=a)(x, x1 - x0, s, s_next, eps=eps)
            c_data, c_x1, c_eps = out.prev_sample.flatten().double().tolist()
            assert c_data == pytest.approx(1 - s_next, abs=1e-6)
            assert c_x1**2 + c_eps**2 == pytest.approx(s_next**2, abs=1e-6)
            assert c_eps == pytest.approx(s_next * math.sin(a * math.pi / 2), abs=1e-6)


def _flow_grpo_cps(x, v, sigma, sigma_prev, noise_level, variance_noise=None, prev_sample=None):
    """Flow-GRPO's cps branch (yifan123/flow_grpo, flow_grpo/diffusers_patch/sd3_sde_with_logprob.py,
    sde_step_with_logprob, sde_type "cps"), transcribed in float64: (prev_sample, log_prob, mean)."""
    std_dev_t = sigma_prev * math.sin(noise_level * math.pi / 2)
    pred_original_sample = x - sigma * v
    noise_estimate = x + v * (1 - sigma)
    prev_sample_mean = (pred_original_sample * (1 - sigma_prev)
                        + noise_estimate * math.sqrt(sigma_prev**2 - std_dev_t**2))
    if prev_sample is None:
        prev_sample = prev_sample_mean + std_dev_t * variance_noise
    log_prob = -((prev_sample - prev_sample_mean) ** 2)  # every constant removed
    return prev_sample, log_prob.mean(dim=tuple(range(1, log_prob.ndim))), prev_sample_mean


@pytest.mark.parametrize("noise_level", [0.3, 0.7, 1.0])
def test_cps_equals_flow_grpo_over_a_shifted_schedule(noise_level):
    """Mean, drawn sample and log-prob of every step but the noiseless last against the float64
    transcription, on the rollout path (eps) and the training path (x_next, a moved policy)."""
    sigmas = sigma_schedule(16, 3.0)
    x, v, eps = _inputs(torch.float32, seed=7)
    step = get_sampler("cps", noise_level=noise_level)
    for i in range(15):
        s, s_next = sigmas[i].item(), sigmas[i + 1].item()
        out = step(x, v, sigmas[i], sigmas[i + 1], eps=eps)
        sample, log_prob, mean = _flow_grpo_cps(x.double(), v.double(), s, s_next, noise_level, eps.double())
        torch.testing.assert_close(out.mean.double(), mean, rtol=0, atol=FLOAT32_ATOL)
        torch.testing.assert_close(out.prev_sample.double(), sample, rtol=0, atol=FLOAT32_ATOL)
        torch.testing.assert_close(out.log_prob.double(), log_prob, rtol=FLOAT32_RTOL, atol=FLOAT32_ATOL)
        moved = v + 0.1 * eps
        trained = step(x, moved, sigmas[i], sigmas[i + 1], x_next=out.prev_sample)
        _, log_prob, _ = _flow_grpo_cps(x.double(), moved.double(), s, s_next, noise_level,
                                        prev_sample=out.prev_sample.double())
        torch.testing.assert_close(trained.log_prob.double(), log_prob, rtol=FLOAT32_RTOL, atol=FLOAT32_ATOL)


def test_cps_log_ratio_is_not_scaled_by_one_over_two_std_squared():
    """Flow-GRPO's clip ranges for cps act on differences of -|x' - mu|^2: a Gaussian log-ratio
    would be those divided by 2 std^2, 3 times larger at step 11 (std 0.41) and 36 times at step 14
    (std 0.12)."""
    sigmas = sigma_schedule(16, 3.0)
    x, v, eps = _inputs(torch.float32, seed=8)
    step = get_sampler("cps", noise_level=0.5)
    for i in (11, 14):
        old = step(x, v, sigmas[i], sigmas[i + 1], eps=eps)
        new = step(x, v + 0.01 * eps, sigmas[i], sigmas[i + 1], x_next=old.prev_sample)
        x_next, mu_old, mu_new = old.prev_sample.double(), old.mean.double(), new.mean.double()
        squared_error_change = ((x_next - mu_old) ** 2).mean(dim=(1, 2)) - ((x_next - mu_new) ** 2).mean(dim=(1, 2))
        log_ratio = (new.log_prob - old.log_prob).double()
        torch.testing.assert_close(log_ratio, squared_error_change, rtol=1e-4, atol=1e-9)
        gaussian = squared_error_change / (2 * old.std.double() ** 2)
        assert not torch.allclose(log_ratio, gaussian, rtol=0.5)


def test_cps_into_zero_is_deterministic():
    x, v, eps = _inputs(torch.float32, seed=6)
    out = get_sampler("cps")(x, v, 0.2, 0.0, eps=eps)
    assert out.log_prob is None and torch.equal(out.prev_sample, out.x0_hat)
    with pytest.raises(ValueError, match="cannot be trained"):
        get_sampler("cps")(x, v, torch.tensor([0.2, 0.2, 0.3]), torch.tensor([0.0, 0.1, 0.2]), eps=eps)


def test_bad_input_gives_one_line_errors():
    x, v, eps = _inputs(torch.float32)
    step = get_sampler("dance_sde")
    assert_one_line_error(lambda: get_sampler("ddim"), "unknown sampler 'ddim'; valid samplers: " + ", ".join(SAMPLERS))
    assert_one_line_error(lambda: step(x, v[:, :4], 0.5, 0.4, eps=eps), r"v has shape \(3, 4, 4\) but x has \(3, 8, 4\)")
    assert_one_line_error(lambda: step(x, v, 0.5, 0.4, eps=eps[:2]), "eps has shape")
    assert_one_line_error(lambda: step(x, v, torch.ones(2), 0.4, eps=eps), r"sigma must be a scalar or a \[B=3\]")
    assert_one_line_error(lambda: step(x, v, 0.5, 0.4), "needs eps")
    assert_one_line_error(lambda: step(x, v, 0.5, 0.4, eps=eps, x_next=x), "not both")
    assert_one_line_error(lambda: step(x, v, 0.4, 0.5, eps=eps), "sigma_next must be < sigma")
    assert_one_line_error(lambda: step(x[0, 0], v[0, 0], 0.5, 0.4, eps=eps[0, 0]), "at least 2 dims")
    assert_one_line_error(lambda: get_sampler("cps", noise_level=1.5), r"cps noise_level must be in \(0, 1.0\]")
    assert_one_line_error(lambda: get_sampler("flow_sde", noise_level=0.0), "flow_sde noise_level")
    assert_one_line_error(lambda: get_sampler("ode", noise_level=0.3), "takes no noise_level")
    assert_one_line_error(lambda: sigma_schedule(0), "num_steps must be an integer >= 1")
    assert_one_line_error(lambda: sigma_schedule(16, shift=0.0), "shift must be > 0")
