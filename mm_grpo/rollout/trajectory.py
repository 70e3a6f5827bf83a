"""Model-independent batched rollout: runs a sampler over a velocity callable and records
everything GRPO training needs (latents at every step, per-step log-probs, SDE steps)."""
import dataclasses
import inspect
import itertools
import operator
from typing import Callable, Optional, Sequence, Tuple, Union

import torch

from mm_grpo.rollout.samplers import StepOutput, get_sampler, ode_step

VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass
class Transition:
    """One trained step per sample, gathered from a trajectory (all fields have B rows)."""

    x: torch.Tensor
    x_next: torch.Tensor
    sigma: torch.Tensor  # [B]
    sigma_next: torch.Tensor  # [B]
    log_prob: torch.Tensor  # [B], the rollout (old-policy) log-prob


@dataclasses.dataclass
class Trajectory:
    """A batch of rollouts over N steps.

    latents:   [B, N+1, ...] in the dtype of the initial latents (latents[:, 0] = noise)
    log_probs: [B, N] float32, NaN at deterministic (ODE) steps
    is_sde:    [N] bool, the steps that drew noise and have a log-prob
    x0_hat:    [B, ...] float32, the last step's x0 prediction: the latent to decode
    """

    sigmas: torch.Tensor
    latents: torch.Tensor
    log_probs: torch.Tensor
    is_sde: torch.Tensor
    x0_hat: torch.Tensor

    @classmethod
    def cat(cls, parts: "list[Trajectory]") -> "Trajectory":
        """Rollouts of consecutive samples on one schedule as one batch, in order."""
        return cls(parts[0].sigmas, torch.cat([p.latents for p in parts]), torch.cat([p.log_probs for p in parts]),
                   parts[0].is_sde, torch.cat([p.x0_hat for p in parts]))

    def transition(self, steps: Union[int, torch.Tensor]) -> Transition:
        """The transition steps[b] -> steps[b]+1 of every sample b (an int: the same for all)."""
        batch, num_steps = self.log_probs.shape
        steps = torch.as_tensor(steps, dtype=torch.long, device=self.latents.device)
        if steps.ndim > 1 or (steps.ndim == 1 and steps.shape[0] != batch):
            raise ValueError(f"steps must be an int or a [B={batch}] tensor, got shape {tuple(steps.shape)}")
        steps = steps.expand(batch)
        if bool(((steps < 0) | (steps >= num_steps)).any()):
            raise ValueError(f"step indices must lie in [0, {num_steps}), got {steps.tolist()}")
        if not bool(self.is_sde[steps].all()):
            ode = steps[~self.is_sde[steps]].unique().tolist()
            raise ValueError(f"steps {ode} are deterministic (ODE) steps: no log-prob to train")
        rows = torch.arange(batch, device=self.latents.device)
        return Transition(
            self.latents[rows, steps],
            self.latents[rows, steps + 1],
            self.sigmas[steps],
            self.sigmas[steps + 1],
            self.log_probs[rows, steps],
        )


@dataclasses.dataclass
class SharedPrefix:
    """Rows that start from the same noise (a group with init_same_noise) stay identical through
    the ODE steps before the SDE window, so the model runs once per group there and each row
    copies its group's velocity (Flow-GRPO-Fast's branching: the group splits at the window).

    velocity_fn: the velocity over the representative rows only (their conditioning);
    rows: [R] the representative row of each group; inverse: [B] the representative each row copies.
    """

    velocity_fn: VelocityFn
    rows: torch.Tensor
    inverse: torch.Tensor

    @classmethod
    def of_groups(cls, groups: torch.Tensor, make_velocity_fn: Callable[[torch.Tensor], VelocityFn]):
        """From [B] group ids of consecutive rows; make_velocity_fn(rows) builds the velocity over them."""
        _, inverse, counts = torch.unique_consecutive(groups, return_inverse=True, return_counts=True)
        rows = torch.cumsum(counts, 0) - counts
        return cls(make_velocity_fn(rows), rows, inverse)


def check_window(window: Optional[Sequence[int]], num_steps: int) -> Tuple[int, int]:
    """Validates an SDE window (start, end), steps start..end-1; None means every step."""
    if window is None:
        return 0, num_steps
    try:
        start, end = (operator.index(i) for i in window)
    except (TypeError, ValueError):
        raise ValueError(f"sde window must be two ints (start, end), got {window!r}") from None
    if not 0 <= start < end <= num_steps:
        raise ValueError(f"sde window {(start, end)} must satisfy 0 <= start < end <= {num_steps} (number of steps)")
    return start, end


@torch.no_grad()
def rollout(
    velocity_fn: VelocityFn,
    latents: torch.Tensor,
    sigmas: torch.Tensor,
    sampler: Union[str, Callable[..., StepOutput]] = "dance_sde",
    *,
    sde_window: Optional[Sequence[int]] = None,
    generator: Optional[torch.Generator] = None,
    noise: Optional[torch.Tensor] = None,
    ode_reuse: int = 1,
    shared_prefix: Optional[SharedPrefix] = None,
) -> Trajectory:
    """Samples the whole batch from sigmas[0] to sigmas[-1].

    velocity_fn(x, sigma[B]) -> v closes over the conditioning (text embeddings, ids, guidance).
    Steps inside sde_window = (start, end) use `sampler`; the others are ODE (MixGRPO).
    Step noise comes from `noise` [B, N, ...] if given, else from `generator`; it is drawn
    for every step, ODE ones included, so the noise of step i does not depend on the window.
    ode_reuse = k > 1 evaluates the model at every k-th step of each run of ODE steps and
    reuses the last velocity in between (the coarsest DiT cache). Steps inside the window
    always get a fresh velocity, so their latents and log-probs are what training recomputes.
    shared_prefix evaluates the steps before the window once per group of identical rows.

    The loop queues its work without reading anything back from the device: whether each step
    draws noise is decided on the host before the first step (`stochastic_steps`; an invalid
    schedule fails there), the per-sample sigmas are made once.
    """
    step_fn = get_sampler(sampler) if isinstance(sampler, str) else sampler
    if sigmas.ndim != 1 or sigmas.numel() < 2:
        raise ValueError(f"sigmas must be 1-D with N+1 >= 2 entries, got shape {tuple(sigmas.shape)}")
    if latents.ndim < 2:
        raise ValueError(f"latents must be batched [B, ...], got shape {tuple(latents.shape)}")
    host_sigmas = sigmas.detach().to("cpu", torch.float32)  # read once; the loop reads none back
    sigmas = sigmas.to(device=latents.device, dtype=torch.float32)
    batch, num_steps = latents.shape[0], sigmas.numel() - 1
    start, end = check_window(sde_window, num_steps)
    if noise is not None and noise.shape != (batch, num_steps, *latents.shape[1:]):
        raise ValueError(
            f"noise must have shape {(batch, num_steps, *latents.shape[1:])} [B, N, ...], got {tuple(noise.shape)}"
        )
    if ode_reuse < 1:
        raise ValueError(f"ode_reuse must be >= 1 (1 = a model evaluation at every step), got {ode_reuse}")
    if shared_prefix is not None and not torch.equal(latents, latents[shared_prefix.rows][shared_prefix.inverse]):
        raise ValueError("a shared prefix needs the same initial latents within each group (init_same_noise)")
    draw_device = generator.device if generator is not None else latents.device
    stochastic = stochastic_steps(step_fn, host_sigmas, start, end)  # host decisions, checked once

    x = latents
    states = [x]
    log_probs = torch.full((batch, num_steps), float("nan"), device=x.device)
    sigma_rows = sigmas.repeat_interleave(batch).view(num_steps + 1, batch)  # row i: sigma_i per sample
    pass_flag = _takes_stochastic(step_fn)
    ode_run = 0  # position in the current run of ODE steps
    for i in range(num_steps):
        ode_run = ode_run + 1 if not start <= i < end else 0
        fresh = ode_run == 0 or (ode_run - 1) % ode_reuse == 0
        if fresh and shared_prefix is not None and i < start:
            rows = shared_prefix.rows
            v = shared_prefix.velocity_fn(x[rows], sigma_rows[i, :len(rows)])[shared_prefix.inverse]
        elif fresh:
            v = velocity_fn(x, sigma_rows[i])
        if noise is not None:
            eps = noise[:, i]
        else:
            eps = torch.randn(x.shape, generator=generator, device=draw_device).to(x.device)
        if start <= i < end:
            out = step_fn(x, v, sigmas[i], sigmas[i + 1], eps=eps,
                          **({"stochastic": stochastic[i]} if pass_flag else {}))
        else:
            out = ode_step(x, v, sigmas[i], sigmas[i + 1])
        if out.log_prob is not None:
            log_probs[:, i] = out.log_prob
        x = out.prev_sample
        states.append(x)
    return Trajectory(sigmas, torch.stack(states, dim=1), log_probs, _step_mask(stochastic, x.device), out.x0_hat)


def _takes_stochastic(step_fn) -> bool:
    """Whether a step function takes the `stochastic` keyword (mm-grpo's samplers all do)."""
    try:
        parameters = inspect.signature(step_fn).parameters
    except (TypeError, ValueError):
        return False
    return "stochastic" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def stochastic_steps(step_fn, host_sigmas: torch.Tensor, start: int = 0, end: Optional[int] = None) -> list:
    """[N] whether each step of a schedule draws noise under `step_fn`, decided on the host: the steps
    of the window start..end-1 (default: all) are asked on a one-element latent at the step's sigmas
    (the step's own std and its checks, on the CPU), the others are ODE steps. A loop that knows this
    passes it to its steps (`stochastic`), which then read nothing back from the device."""
    end = host_sigmas.numel() - 1 if end is None else end
    one = torch.zeros(1, 1)
    return [start <= i < end and step_fn(one, one, host_sigmas[i], host_sigmas[i + 1], eps=one).log_prob is not None
            for i in range(host_sigmas.numel() - 1)]


def _step_mask(flags: list, device) -> torch.Tensor:
    """The [N] bool tensor of `flags` on `device`, filled by runs (no host-to-device copy)."""
    mask = torch.zeros(len(flags), dtype=torch.bool, device=device)
    start = 0
    for flag, run in itertools.groupby(flags):
        length = len(list(run))
        if flag:
            mask[start:start + length] = True
        start += length
    return mask
