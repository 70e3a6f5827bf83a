"""Step functions of the flow-matching samplers GRPO trains through.

Every step maps (x, v) at sigma to a sample at sigma_next < sigma. One function serves both
phases: during rollout it is given `eps` and draws x' = mean + std * eps; during training it
is given the stored `x_next` and scores it under the current policy's v. Both paths run the
same floating-point operations, so the log-prob of an unchanged policy is reproduced bitwise
and the PPO ratio starts at exactly 1.

All arithmetic is float32 whatever the dtype of x and v (Flow-GRPO: "bf16 can overflow");
`prev_sample` comes back in the dtype of x and the log-prob scores that very tensor.
dance_sde and flow_sde score it with the Gaussian density; cps with Flow-GRPO's constant-free
squared error (`cps_log_prob`), as its authors' code does.

A step runs once per denoising step of every rollout and once per trained micro-batch, so it does
the little it must on the latents: the log-prob is one difference and its squares' per-sample mean,
and flow_sde's mean c_x x + c_v v (its coefficients per sample first); the x0 prediction of the
steps that do not need it for their mean is computed only when read. Whether a step draws noise (std > 0) is a property of its
sigmas: the caller that knows them on the host says so (`stochastic`), and the step then reads no
value back from the device; without it the step checks std itself (one host sync).
"""
import functools
import math
from typing import Callable, Optional, Union

import torch

Sigma = Union[float, torch.Tensor]

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


class StepOutput:
    """One sampler step. `mean`, `std`, `x0_hat` are float32; `std` is 0-d or [B, 1, ...]; `log_prob`
    [B], None when the step is deterministic. `x0_hat` is computed when first read (from the step's
    inputs, which must not be modified before): the rollout reads the last step's only."""
    __slots__ = ("prev_sample", "mean", "std", "log_prob", "_x0_hat")

    def __init__(self, prev_sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor,
                 log_prob: Optional[torch.Tensor], x0_hat: Union[torch.Tensor, Callable[[], torch.Tensor]]):
        self.prev_sample, self.mean, self.std, self.log_prob, self._x0_hat = prev_sample, mean, std, log_prob, x0_hat

    @property
    def x0_hat(self) -> torch.Tensor:
        if callable(self._x0_hat):
            self._x0_hat = self._x0_hat()
        return self._x0_hat

    def __repr__(self):
        shape = tuple(self.prev_sample.shape)
        return f"StepOutput(prev_sample={shape}, log_prob={'None' if self.log_prob is None else 'set'})"


def _x0_prediction(x32: torch.Tensor, v32: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return x32 - s * v32


def _lazy_x0(x32, v32, s) -> Callable[[], torch.Tensor]:
    return functools.partial(_x0_prediction, x32, v32, s)


def _squared_error(sample: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """mean((sample - mean)^2) over all non-batch dims, float32 -> [B]: one difference (the sample
    detached), squared in place unless autograd needs it."""
    diff = sample.detach().float() - mean
    squared = diff.square() if diff.requires_grad else diff.square_()
    return squared.mean(dim=tuple(range(1, squared.ndim)))


def _per_row(std: torch.Tensor) -> torch.Tensor:
    """A 0-d std as is, a [B, 1, ...] one as [B]."""
    return std if std.ndim == 0 else std.reshape(-1)


def gaussian_log_prob(sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """log N(sample; mean, std^2) averaged over all non-batch dims, in float32 -> [B].

    With std one value per sample (0-d or [B, 1, ...]), the average is
    -mean((sample - mean)^2) / (2 std^2) - log std - log sqrt(2 pi): the latents are read in one
    pass (`_squared_error`), the rest is per-sample arithmetic on [B].
    The sample is detached, as in DanceGRPO / Flow-GRPO: gradients flow through the mean only.
    """
    std = _per_row(std)
    return -_squared_error(sample, mean) / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI


def cps_log_prob(sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """-(sample - mean)^2 averaged over all non-batch dims, in float32 -> [B]; `std` is not read.

    Flow-GRPO's CPS log-prob (yifan123/flow_grpo, flow_grpo/diffusers_patch/sd3_sde_with_logprob.py,
    sde_type "cps"): every constant removed, 1/(2 std^2) included, so its log-ratios and the clip
    ranges tuned on them carry over. The sample is detached, as in `gaussian_log_prob`.
    """
    return -_squared_error(sample, mean)


def _per_sample(value: Sigma, x: torch.Tensor, name: str) -> torch.Tensor:
    """A scalar stays 0-d; a [B] tensor becomes [B, 1, ...] to broadcast over x."""
    t = torch.as_tensor(value, dtype=torch.float32, device=x.device)
    if t.ndim == 0:
        return t
    if t.ndim == 1 and t.shape[0] == x.shape[0]:
        return t.view(-1, *([1] * (x.ndim - 1)))
    raise ValueError(f"{name} must be a scalar or a [B={x.shape[0]}] tensor, got shape {tuple(t.shape)}")


def _prepare(x, v, sigma, sigma_next, eps, x_next):
    if x.ndim < 2:
        raise ValueError(f"x must be batched [B, ...] with at least 2 dims, got shape {tuple(x.shape)}")
    for name, t in (("v", v), ("eps", eps), ("x_next", x_next)):
        if t is not None and t.shape != x.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but x has {tuple(x.shape)}; they must match")
    if eps is not None and x_next is not None:
        raise ValueError("pass either eps (rollout) or x_next (training) to a sampler step, not both")
    return x.float(), v.float(), _per_sample(sigma, x, "sigma"), _per_sample(sigma_next, x, "sigma_next")


def _check_noise_level(name: str, noise_level: float) -> None:
    upper = 1.0 if name == "cps" else math.inf  # cps: std = sigma_next * sin(a*pi/2) needs a <= 1
    if not 0 < noise_level <= upper:
        raise ValueError(f"{name} noise_level must be in (0, {upper}], got {noise_level!r}")


def _deterministic(x, mean, std, x0_hat, x_next) -> StepOutput:
    prev = x_next if x_next is not None else mean.to(x.dtype)
    return StepOutput(prev, mean, std, None, x0_hat)


def _draws_noise(std: torch.Tensor) -> bool:
    """Whether a step with this std is stochastic, read from the device (one host sync): std > 0 for
    every sample, or 0 for every one (e.g. cps into sigma = 0); anything else is an error."""
    positive = std > 0
    if bool(positive.all()):
        return True
    if bool((std == 0).all()):
        return False
    bad = int((~positive).sum())
    raise ValueError(
        f"sampler std is not > 0 for {bad} of {positive.numel()} samples: "
        "sigma_next must be < sigma, and a zero-noise step (cps into sigma=0) cannot be trained"
    )


def _stochastic(x, mean, std, x0_hat, eps, x_next, stochastic: Optional[bool],
                log_prob=gaussian_log_prob) -> StepOutput:
    """The step's output; `stochastic` None: decided from std (`_draws_noise`)."""
    if not (_draws_noise(std) if stochastic is None else stochastic):
        return _deterministic(x, mean, std, x0_hat, x_next)
    if x_next is None:
        if eps is None:
            raise ValueError("a stochastic sampler step needs eps (rollout) or x_next (training)")
        drawn = std * eps.float()
        drawn += mean  # = mean + std * eps, in the product's buffer
        x_next = drawn.to(x.dtype)
    return StepOutput(x_next, mean, std, log_prob(x_next, mean, std), x0_hat)


def _combine(x32: torch.Tensor, c_x: torch.Tensor, v32: torch.Tensor, c_v: torch.Tensor) -> torch.Tensor:
    """c_x x + c_v v with per-sample coefficients: three passes over the latents."""
    mean = x32 * c_x
    return mean.add_(v32 * c_v)


def dance_sde_step(x, v, sigma, sigma_next, *, eps=None, x_next=None, noise_level: float = 0.3,
                   stochastic: Optional[bool] = None) -> StepOutput:
    """DanceGRPO's SDE step; noise_level is its eta. Its mean as DanceGRPO writes it (x + d v - 0.5 eta^2
    d score, d = s_next - s): substituted into c_x x + c_v v it moved a Wan run's trained layouts apart
    (tests/test_wan_grpo.py), so it is kept in this form. `stochastic`: see the module's docstring."""
    _check_noise_level("dance_sde", noise_level)
    x32, v32, s, s_next = _prepare(x, v, sigma, sigma_next, eps, x_next)
    d = s_next - s
    x0_hat = x32 - s * v32
    score = -(x32 - (1 - s) * x0_hat) / s**2
    mean = x32 + d * v32 + d * (-0.5 * noise_level**2 * score)
    std = noise_level * torch.sqrt(s - s_next)
    return _stochastic(x, mean, std, x0_hat, eps, x_next, stochastic)


def flow_sde_step(x, v, sigma, sigma_next, *, eps=None, x_next=None, noise_level: float = 0.7,
                  stochastic: Optional[bool] = None) -> StepOutput:
    """Flow-GRPO's SDE step; noise_level is its a.

    std_t = a * sqrt(sigma / (1 - sigma)) is infinite at sigma = 1, where Flow-GRPO puts the
    schedule's sigma_1 in the denominator. The step out of sigma = 1 always goes to sigma_1,
    so sigma_next stands in for it and the function needs no schedule.
    """
    _check_noise_level("flow_sde", noise_level)
    x32, v32, s, s_next = _prepare(x, v, sigma, sigma_next, eps, x_next)
    dt = s_next - s
    std_t = noise_level * torch.sqrt(s / (1 - torch.where(s == 1, s_next, s)))
    mean = _combine(x32, 1 + std_t**2 / (2 * s) * dt, v32, (1 + std_t**2 * (1 - s) / (2 * s)) * dt)
    std = std_t * torch.sqrt(-dt)
    return _stochastic(x, mean, std, _lazy_x0(x32, v32, s), eps, x_next, stochastic)


def cps_step(x, v, sigma, sigma_next, *, eps=None, x_next=None, noise_level: float = 0.7,
             stochastic: Optional[bool] = None) -> StepOutput:
    """Coefficient-preserving step: the noise in x' keeps total variance sigma_next^2.

    x' = (1 - sigma_next) x0_hat + sqrt(sigma_next^2 - std^2) x1_hat + std * eps with
    std = sigma_next * sin(a pi / 2), x0_hat = x - sigma v and x1_hat = x + (1 - sigma) v, scored by
    Flow-GRPO's constant-free `cps_log_prob`. Into sigma_next = 0 the step has no noise (log_prob None).
    """
    _check_noise_level("cps", noise_level)
    x32, v32, s, s_next = _prepare(x, v, sigma, sigma_next, eps, x_next)
    std = s_next * math.sin(noise_level * math.pi / 2)
    # clamp: at a = 1 rounding could leave a tiny negative under the root
    x0_hat = x32 - s * v32
    x1_hat = x32 + (1 - s) * v32
    mean = (1 - s_next) * x0_hat + torch.sqrt((s_next**2 - std**2).clamp_min(0)) * x1_hat
    return _stochastic(x, mean, std, x0_hat, eps, x_next, stochastic, log_prob=cps_log_prob)


def ode_step(x, v, sigma, sigma_next, *, eps=None, x_next=None, stochastic: Optional[bool] = None) -> StepOutput:
    """Deterministic Euler step x + (sigma_next - sigma) v; log_prob None (not trainable).

    `eps` and `stochastic` are accepted and ignored so that the rollout loop can call every step alike.
    """
    x32, v32, s, s_next = _prepare(x, v, sigma, sigma_next, None, x_next)
    mean = x32 + (s_next - s) * v32
    return _deterministic(x, mean, torch.zeros_like(s), _lazy_x0(x32, v32, s), x_next)


SAMPLERS = {"dance_sde": dance_sde_step, "flow_sde": flow_sde_step, "cps": cps_step, "ode": ode_step}
NOISELESS_LAST_STEP = ("cps",)  # its step into sigma = 0 draws no noise: no log-prob to train
# log-probs without Gaussian's 1/(2 std^2) and constants: a log-ratio is not that of a Gaussian step
CONSTANT_FREE_LOG_PROB = ("cps",)


def sde_steps(name: str, num_steps: int) -> int:
    """k: steps 0 .. k-1 of a `num_steps` rollout can be SDE steps with a log-prob under sampler `name`."""
    return num_steps - 1 if name in NOISELESS_LAST_STEP else num_steps


def get_sampler(name: str, noise_level: Optional[float] = None) -> Callable[..., StepOutput]:
    """The step function registered as `name`, with `noise_level` bound (None keeps its default)."""
    if name not in SAMPLERS:
        raise ValueError(f"unknown sampler {name!r}; valid samplers: {', '.join(SAMPLERS)}")
    step = SAMPLERS[name]
    if noise_level is None:
        return step
    if step is ode_step:
        raise ValueError("the ode sampler is deterministic and takes no noise_level")
    _check_noise_level(name, noise_level)
    return functools.partial(step, noise_level=noise_level)
