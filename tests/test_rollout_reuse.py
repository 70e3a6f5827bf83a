"""Model evaluations saved outside the SDE window: velocity reuse at ODE steps (ode_reuse=k) and
one evaluation per group over the shared ODE prefix (shared_prefix, Flow-GRPO-Fast's branching)."""
import pytest
import torch

from mm_grpo.rollout import SharedPrefix, get_sampler, rollout, sigma_schedule


N, WINDOW = 8, (2, 4)


class CountingVelocity:
    """A row-wise velocity (v = x @ A + sigma) that records the steps it is called at."""

    def __init__(self, sigmas):
        self.a = torch.randn(6, 6, generator=torch.Generator().manual_seed(0)) / 3
        self.sigmas, self.steps, self.rows = sigmas, [], []

    def __call__(self, x, sigma):
        self.steps.append(int((self.sigmas - sigma[0]).abs().argmin()))
        self.rows.append(x.shape[0])
        return x @ self.a + sigma[:, None, None]


def _run(ode_reuse, window=WINDOW):
    sigmas = sigma_schedule(N)
    velocity = CountingVelocity(sigmas)
    g = torch.Generator().manual_seed(1)
    x0, noise = torch.randn(3, 5, 6, generator=g), torch.randn(3, N, 5, 6, generator=g)
    traj = rollout(velocity, x0, sigmas, "dance_sde", sde_window=window, noise=noise, ode_reuse=ode_reuse)
    return traj, velocity


def test_model_is_evaluated_every_kth_ode_step_and_at_every_sde_step():
    _, velocity = _run(2)
    assert velocity.steps == [0, 2, 3, 4, 6]  # prefix 0-1, window 2-3, tail 4-7
    _, velocity = _run(3, window=(0, 1))
    assert velocity.steps == [0, 1, 4, 7]
    _, velocity = _run(1)
    assert velocity.steps == list(range(N))


def test_reused_steps_are_euler_with_the_last_velocity_and_window_log_probs_are_exact():
    traj, velocity = _run(2)
    plain, _ = _run(1)
    x, sigmas = traj.latents, traj.sigmas
    assert torch.equal(x[:, :2], plain.latents[:, :2]) and not torch.allclose(x[:, 2], plain.latents[:, 2])
    v0 = velocity(x[:, 0], sigmas[0].repeat(3))  # step 1 reuses step 0's velocity
    torch.testing.assert_close(x[:, 2], x[:, 1] + (sigmas[2] - sigmas[1]) * v0, rtol=0, atol=1e-6)
    v4 = velocity(x[:, 4], sigmas[4].repeat(3))  # step 5 reuses step 4's velocity
    torch.testing.assert_close(x[:, 6], x[:, 5] + (sigmas[6] - sigmas[5]) * v4, rtol=0, atol=1e-6)
    step = get_sampler("dance_sde")
    for i in range(*WINDOW):  # what training recomputes from the stored latents: bitwise equal
        v = velocity(x[:, i], sigmas[i].repeat(3))
        out = step(x[:, i], v, sigmas[i], sigmas[i + 1], x_next=x[:, i + 1])
        assert torch.equal(out.log_prob, traj.log_probs[:, i])


def test_bad_reuse_is_a_clear_error():
    with pytest.raises(ValueError, match="ode_reuse must be >= 1"):
        _run(0)


def _branched(ode_reuse, groups=(0, 0, 0, 1, 1), window=(3, 5)):
    """Rows of a group start from the same noise; rollout with and without the shared prefix."""
    sigmas = sigma_schedule(N)
    g = torch.Generator().manual_seed(2)
    groups = torch.tensor(groups)
    x0 = torch.randn(int(groups.max()) + 1, 5, 6, generator=g)[groups]
    noise = torch.randn(len(groups), N, 5, 6, generator=g)
    plain, shared = CountingVelocity(sigmas), CountingVelocity(sigmas)
    prefix = SharedPrefix.of_groups(groups, lambda rows: shared)
    kwargs = dict(sde_window=window, noise=noise, ode_reuse=ode_reuse)
    return (rollout(plain, x0, sigmas, "dance_sde", **kwargs), plain,
            rollout(shared, x0, sigmas, "dance_sde", shared_prefix=prefix, **kwargs), shared)


@pytest.mark.parametrize("ode_reuse", [1, 2])
def test_shared_prefix_runs_the_model_once_per_group_and_changes_nothing(ode_reuse):
    traj, plain, branched, shared = _branched(ode_reuse)
    assert shared.steps == plain.steps
    prefix_calls = sum(step < 3 for step in plain.steps)
    assert shared.rows == [2] * prefix_calls + [5] * (len(plain.steps) - prefix_calls)  # 2 groups, then 5 rows
    torch.testing.assert_close(branched.latents, traj.latents, rtol=0, atol=1e-6)
    torch.testing.assert_close(branched.log_probs, traj.log_probs, rtol=0, atol=1e-6, equal_nan=True)
    assert torch.equal(branched.latents[:3, 3], branched.latents[0, 3].expand(3, 5, 6))  # identical up to the branch
    assert not torch.equal(branched.latents[0, 4], branched.latents[1, 4])  # and apart after it


def test_shared_prefix_needs_the_same_initial_noise_within_a_group():
    sigmas = sigma_schedule(N)
    x0 = torch.randn(4, 5, 6, generator=torch.Generator().manual_seed(0))
    velocity = CountingVelocity(sigmas)
    prefix = SharedPrefix.of_groups(torch.tensor([0, 0, 1, 1]), lambda rows: velocity)
    with pytest.raises(ValueError, match="same initial latents within each group"):
        rollout(velocity, x0, sigmas, sde_window=(2, 4), shared_prefix=prefix)
