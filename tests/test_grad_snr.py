"""bench/grad_snr.py recovers a known signal-to-noise ratio from synthetic gradients."""
import pytest
import torch

from bench.grad_snr import report, t_chance


def test_t_chance_matches_known_tail_probabilities():
    assert t_chance(15) == pytest.approx(0.00896, abs=2e-4)  # P(|T_15| > 3)
    assert t_chance(10_000) == pytest.approx(0.0027, abs=1e-4)  # the normal limit


@pytest.mark.parametrize("rho", [0.0, 1e-3, 1e-2])
def test_report_recovers_the_per_sample_snr(rho):
    # A batch of n samples: gradient = signal + mean of n unit-variance noises per coordinate,
    # so per-sample |signal|^2 / E|noise|^2 = rho.
    dims, n, batches = 20_000, 64, 16
    g = torch.Generator().manual_seed(0)
    signal = torch.randn(dims, generator=g)
    signal *= (rho * dims) ** 0.5 / signal.norm()
    grads = signal + torch.randn(batches, dims, generator=g) / n ** 0.5
    out = report(grads, n)
    if rho == 0:
        assert out["raw"]["rho"] < 2e-4 and abs(out["pair_cos_mean"]) < 0.01
        assert out["t_gt_3"] == pytest.approx(out["t_gt_3_chance"], abs=0.003)
    else:
        assert out["raw"]["rho"] == pytest.approx(rho, rel=0.25)
        assert out["raw"]["samples_for_cos_0.5"] == pytest.approx(1 / (3 * rho), rel=0.25)
