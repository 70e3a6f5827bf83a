"""Batched rollout loop, recompute from stored trajectories, MixGRPO window, timestep selection."""
import pytest
import torch

from mm_grpo.grpo import (SlidingWindow, branch_window, dance_grpo_timesteps, flow_grpo_timesteps, grpo_loss,
                          window_timesteps)
from mm_grpo.rollout import get_sampler, ode_step, rollout, sigma_schedule
from tests.utils import assert_one_line_error


B, N, S, C = 4, 6, 8, 4
_W = torch.linspace(-1.0, 1.0, S * C).view(S, C)


def velocity(x, sigma):
    """A deterministic toy velocity: elementwise plus a per-row mean, so rows never mix."""
    assert sigma.shape == (x.shape[0],)
    x = x.float()
    s = sigma.view(-1, 1, 1)
    return torch.tanh(_W * x + s) - 0.5 * x + 0.1 * x.mean(dim=(1, 2), keepdim=True)


def _noise(seed=0, batch=B, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, S, C, generator=g).to(dtype), torch.randn(batch, N, S, C, generator=g)


def _recompute(traj, step_fn, steps):
    tr = traj.transition(steps)
    out = step_fn(tr.x, velocity(tr.x, tr.sigma), tr.sigma, tr.sigma_next, x_next=tr.x_next)
    return out, tr


@pytest.mark.parametrize("name", ["dance_sde", "flow_sde", "cps"])
def test_rollout_of_video_latents_equals_the_same_numbers_packed(name):
    """Latents of any rank: a video's [C, T, h, w] rolled out is its [S, C] packing rolled out,
    element for element, with the same log-probs (means over every non-batch element)."""
    shape = (C, 2, 2, S // 4)  # C channels, 2 frames of 2 x S/4 latents: S * C elements, as [S, C]

    def as_video(x):
        return x.transpose(1, 2).reshape(x.shape[0], *shape)

    def video_velocity(x, sigma):  # the packed velocity, seen through the video layout
        packed = x.reshape(x.shape[0], C, S).transpose(1, 2)
        return as_video(velocity(packed, sigma))

    latents, noise = _noise()
    packed = rollout(velocity, latents, sigma_schedule(N), name, noise=noise)
    video = rollout(video_velocity, as_video(latents), sigma_schedule(N), name,
                    noise=noise.transpose(2, 3).reshape(B, N, *shape))
    assert video.latents.shape == (B, N + 1, *shape)
    assert torch.equal(video.latents, packed.latents.transpose(2, 3).reshape(B, N + 1, *shape))
    torch.testing.assert_close(video.log_probs, packed.log_probs, rtol=1e-6, atol=0, equal_nan=True)  # NaN: ODE steps


@pytest.mark.parametrize("name", ["dance_sde", "flow_sde", "cps"])
def test_batched_rollout_equals_single_rollouts(name):
    sigmas = sigma_schedule(N)
    latents, noise = _noise()
    batched = rollout(velocity, latents, sigmas, name, noise=noise)
    assert batched.latents.shape == (B, N + 1, S, C) and batched.log_probs.shape == (B, N)
    for b in range(B):
        one = rollout(velocity, latents[b : b + 1], sigmas, name, noise=noise[b : b + 1])
        torch.testing.assert_close(batched.latents[b : b + 1], one.latents, rtol=0, atol=1e-6)
        torch.testing.assert_close(batched.x0_hat[b : b + 1], one.x0_hat, rtol=0, atol=1e-6)
        torch.testing.assert_close(batched.log_probs[b : b + 1], one.log_probs, rtol=0, atol=1e-6, equal_nan=True)
    # cps has no noise into sigma = 0: that last step is deterministic, the others are SDE
    expected_sde = [True] * (N - 1) + [name != "cps"]
    assert batched.is_sde.tolist() == expected_sde
    assert bool(batched.log_probs[:, batched.is_sde].isfinite().all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_probs_recomputed_from_trajectory_are_bitwise(dtype):
    sigmas = sigma_schedule(N)
    latents, noise = _noise(seed=1, dtype=dtype)
    step_fn = get_sampler("dance_sde")
    traj = rollout(velocity, latents, sigmas, step_fn, noise=noise)
    assert traj.latents.dtype == dtype and traj.log_probs.dtype == torch.float32
    for i in range(N):
        out, tr = _recompute(traj, step_fn, i)
        assert torch.equal(out.log_prob, traj.log_probs[:, i])
    # DanceGRPO's per-sample random steps: same log-probs, and the PPO ratio is exactly 1
    steps = dance_grpo_timesteps(B, N, 0.6, generator=torch.Generator().manual_seed(0))
    for k in range(steps.shape[1]):
        out, tr = _recompute(traj, step_fn, steps[:, k])
        assert torch.equal(out.log_prob, tr.log_prob)
        _, stats = grpo_loss(out.log_prob, tr.log_prob, torch.randn(B))
        assert stats["ratio_min"].item() == 1.0 and stats["ratio_max"].item() == 1.0


def test_rollout_follows_the_step_function():
    sigmas = sigma_schedule(N)
    latents, noise = _noise(seed=2)
    traj = rollout(velocity, latents, sigmas, "flow_sde", noise=noise)
    x = latents
    for i in range(N):  # the loop written out by hand
        out = get_sampler("flow_sde")(x, velocity(x, sigmas[i].repeat(B)), sigmas[i], sigmas[i + 1], eps=noise[:, i])
        x = out.prev_sample
        assert torch.equal(traj.latents[:, i + 1], x)
    assert torch.equal(traj.x0_hat, out.x0_hat)  # the last step's x0 prediction is what gets decoded


def test_mixgrpo_window_is_sde_inside_ode_outside():
    sigmas = sigma_schedule(N)
    latents, noise = _noise(seed=3)
    traj = rollout(velocity, latents, sigmas, "dance_sde", sde_window=(2, 4), noise=noise)
    assert traj.is_sde.tolist() == [False, False, True, True, False, False]
    assert bool(traj.log_probs[:, 2:4].isfinite().all()) and bool(traj.log_probs[:, [0, 1, 4, 5]].isnan().all())
    for i in range(N):
        x, x_next = traj.latents[:, i], traj.latents[:, i + 1]
        v = velocity(x, sigmas[i].repeat(B))
        if i in (2, 3):
            expected = get_sampler("dance_sde")(x, v, sigmas[i], sigmas[i + 1], eps=noise[:, i]).prev_sample
        else:
            expected = x + (sigmas[i + 1] - sigmas[i]) * v  # Euler
        assert torch.equal(x_next, expected)
    # an ODE last step lands exactly on its x0 prediction
    assert torch.equal(traj.latents[:, -1], traj.x0_hat)
    # the ODE prefix matches a pure ODE rollout
    ode = rollout(velocity, latents, sigmas, "ode", noise=noise)
    assert not bool(ode.is_sde.any())
    assert torch.equal(traj.latents[:, :3], ode.latents[:, :3])
    with pytest.raises(ValueError, match=r"steps \[0\] are deterministic \(ODE\) steps"):
        traj.transition(0)
    steps = window_timesteps(B, (2, 4), N)
    for k in range(steps.shape[1]):
        out, tr = _recompute(traj, get_sampler("dance_sde"), steps[:, k])
        assert torch.equal(out.log_prob, tr.log_prob)


def test_generator_noise_is_reproducible():
    sigmas = sigma_schedule(N)
    latents = torch.randn(4, S, C, generator=torch.Generator().manual_seed(7))
    a = rollout(velocity, latents, sigmas, generator=torch.Generator().manual_seed(1))
    b = rollout(velocity, latents, sigmas, generator=torch.Generator().manual_seed(1))
    c = rollout(velocity, latents, sigmas, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs)
    assert not torch.equal(a.latents[:, 1:], c.latents[:, 1:])
    # one draw per step, ODE steps included: the noise of step i does not depend on the window
    g = torch.Generator().manual_seed(3)
    drawn = torch.stack([torch.randn(latents.shape, generator=g) for _ in range(N)], dim=1)
    windowed = rollout(velocity, latents, sigmas, sde_window=(2, 4), generator=torch.Generator().manual_seed(3))
    assert torch.equal(windowed.latents, rollout(velocity, latents, sigmas, sde_window=(2, 4), noise=drawn).latents)


def test_initial_noise_same_within_group_and_independent_of_the_rank_slice():
    from mm_grpo.grpo.draws import draw_noise
    from mm_grpo.grpo.hyperparameters import GRPOSettings
    same = GRPOSettings(prompts_per_iteration=3, num_generations=4, num_inference_steps=N, init_same_noise=True)
    init, steps = draw_noise(same, 0, range(12), (S, C))
    assert init.shape == (12, S, C) and steps.shape == (12, N, S, C)
    groups = init.view(3, 4, S, C)
    assert torch.equal(groups, groups[:, :1].expand_as(groups))  # equal within a group
    assert not torch.equal(groups[0, 0], groups[1, 0])  # different across groups
    assert not torch.equal(steps[0], steps[1])  # the SDE noise is each sample's own
    part = draw_noise(same, 0, range(4, 8), (S, C))  # a data-parallel rank's slice draws the same rows
    assert torch.equal(part[0], init[4:8]) and torch.equal(part[1], steps[4:8])
    free, _ = draw_noise(GRPOSettings(prompts_per_iteration=3, num_generations=4, num_inference_steps=N), 0, range(12), (S, C))
    assert not torch.equal(free[0], free[1]) and not torch.equal(draw_noise(same, 1, range(12), (S, C))[0], init)


def test_dance_grpo_timesteps():
    steps = dance_grpo_timesteps(5, 16, 0.6, generator=torch.Generator().manual_seed(0))
    assert steps.shape == (5, 9) and steps.dtype == torch.long  # int(15 * 0.6) = 9
    assert bool(((steps >= 0) & (steps < 15)).all())  # the last transition (15) is never trained
    assert all(len(set(row)) == 9 for row in steps.tolist())
    assert len({tuple(row) for row in steps.tolist()}) > 1  # a permutation per sample
    assert torch.equal(steps, dance_grpo_timesteps(5, 16, 0.6, generator=torch.Generator().manual_seed(0)))
    assert not torch.equal(steps, dance_grpo_timesteps(5, 16, 0.6, generator=torch.Generator().manual_seed(1)))


def test_flow_grpo_and_window_timesteps():
    assert flow_grpo_timesteps(2, 16, 0.5).tolist() == [list(range(8))] * 2
    assert flow_grpo_timesteps(1, 10, 0.99).tolist() == [list(range(9))]
    assert window_timesteps(3, (5, 8), 16).tolist() == [[5, 6, 7]] * 3


def test_sliding_window_schedule():
    w = SlidingWindow()  # size 3, shift 1, every 25
    assert [w.bounds(it, 16) for it in (0, 24, 25, 49, 50)] == [(0, 3), (0, 3), (1, 4), (1, 4), (2, 5)]
    assert w.bounds(13 * 25, 16) == (13, 16)  # the last position
    assert w.bounds(14 * 25, 16) == (0, 3)  # rolls back
    assert SlidingWindow(wrap=False).bounds(14 * 25, 16) == (13, 16)  # stays
    # MixGRPO's own numbers: 4 of 25 steps
    assert SlidingWindow(size=4).bounds(21 * 25, 25) == (21, 25)
    two = SlidingWindow(size=3, shift=2, every=10)
    assert [two.bounds(it, 16)[0] for it in range(0, 80, 10)] == [0, 2, 4, 6, 8, 10, 12, 0]


def test_branch_window_is_drawn_uniformly_and_reproducibly():
    starts = [branch_window(3, 16, torch.Generator().manual_seed(i))[0] for i in range(400)]
    assert set(starts) == set(range(14))  # every position 0..13 of a 3-step window in 16 steps
    assert branch_window(3, 16, torch.Generator().manual_seed(7)) == branch_window(3, 16, torch.Generator().manual_seed(7))
    assert branch_window(16, 16) == (0, 16)
    with pytest.raises(ValueError, match=r"window size must be in \[1, 16\]"):
        branch_window(17, 16)


def test_bad_input_gives_one_line_errors():
    sigmas = sigma_schedule(N)
    latents, noise = _noise()
    assert_one_line_error(lambda: rollout(velocity, latents, sigmas, "euler"), "unknown sampler 'euler'")
    assert_one_line_error(lambda: rollout(velocity, latents, sigmas, sde_window=(4, 7)), r"0 <= start < end <= 6")
    assert_one_line_error(lambda: rollout(velocity, latents, sigmas, sde_window=(-1, 2)), r"0 <= start < end <= 6")
    assert_one_line_error(lambda: rollout(velocity, latents, sigmas, sde_window=(3, 3)), r"0 <= start < end <= 6")
    assert_one_line_error(lambda: rollout(velocity, latents, sigmas, sde_window=(1,)), "two ints")
    assert_one_line_error(lambda: rollout(velocity, latents, sigmas, noise=noise[:, :3]), r"noise must have shape")
    assert_one_line_error(lambda: rollout(velocity, latents, sigmas[:1]), "N\\+1 >= 2")
    traj = rollout(velocity, latents, sigmas, noise=noise)
    assert_one_line_error(lambda: traj.transition(N), r"step indices must lie in \[0, 6\)")
    assert_one_line_error(lambda: traj.transition(torch.zeros(B + 1, dtype=torch.long)), r"\[B=4\] tensor")
    assert_one_line_error(lambda: dance_grpo_timesteps(B, 16, 0.0), r"fraction must be in \(0, 1\]")
    assert_one_line_error(lambda: flow_grpo_timesteps(B, 16, 1.5), r"fraction must be in \(0, 1\]")
    assert_one_line_error(lambda: flow_grpo_timesteps(B, 16, 0.05), "selects none")
    assert_one_line_error(lambda: flow_grpo_timesteps(B, 0), "num_steps must be >= 1")
    assert_one_line_error(lambda: dance_grpo_timesteps(B, 1), "num_steps must be >= 2")
    assert_one_line_error(lambda: window_timesteps(B, (14, 17), 16), r"0 <= start < end <= 16")
    assert_one_line_error(lambda: SlidingWindow(size=17).bounds(0, 16), r"window size must be in \[1, 16\]")
    assert ode_step(latents, latents, 0.5, 0.5).log_prob is None  # a zero step is legal and deterministic
