"""GRPO's seeded draws: every random number of an iteration (initial and step noise, trained
timesteps, the awm loss's forward-process noise) is drawn from a generator seeded by (seed,
iteration, stream, global sample index), so results do not depend on the parallel layout and a
resumed run repeats exactly what an uninterrupted one does."""
import torch

from mm_grpo.grpo.hyperparameters import GRPOSettings
from mm_grpo.grpo.timesteps import dance_grpo_timesteps, flow_grpo_timesteps, window_timesteps
from mm_grpo.rollout import sde_steps
from mm_grpo.seeding import GRPOStream, seeded_generator


def draw_noise(s: GRPOSettings, iteration: int, samples: range, shape: tuple, pin_memory: bool = False):
    """Initial noise [B, *shape] and step noise [B, N, *shape] of global samples `samples` (CPU);
    `shape`: one sample's latents. Each sample's draws are written in place into the batch's tensors
    (page-locked with `pin_memory`, for an asynchronous copy to the accelerator)."""
    init = torch.empty(len(samples), *shape, pin_memory=pin_memory)
    steps = torch.empty(len(samples), s.num_inference_steps, *shape, pin_memory=pin_memory)
    for row, i in enumerate(samples):
        key = i // s.num_generations if s.init_same_noise else i
        initial = seeded_generator(s.seed, iteration, GRPOStream.INITIAL_NOISE, key)
        torch.randn(*shape, generator=initial, out=init[row])
        stepwise = seeded_generator(s.seed, iteration, GRPOStream.STEP_NOISE, i)
        torch.randn(s.num_inference_steps, *shape, generator=stepwise, out=steps[row])
    return init, steps


def draw_matching_noise(s: GRPOSettings, iteration: int, samples: range, num_trained: int, tokens: int,
                        channels: int) -> torch.Tensor:
    """[B, K, S, C] forward-process noise re-noising each sample's x0 at its K trained steps (awm)."""
    return torch.stack([torch.randn(num_trained, tokens, channels,
                                    generator=seeded_generator(s.seed, iteration, GRPOStream.MATCHING_NOISE, i))
                        for i in samples])


def draw_trained_steps(s: GRPOSettings, iteration: int, samples: range, window=None) -> torch.Tensor:
    """[B, K] indices of the transitions trained for each of `samples`: the steps of the
    iteration's SDE `window` when there is one (`GRPOSchedule.sde_window`), else drawn."""
    n = s.num_inference_steps
    if window is not None:
        return window_timesteps(len(samples), window, n)
    if s.timestep_selection == "ordered":
        return flow_grpo_timesteps(len(samples), sde_steps(s.sampler, n), s.timestep_fraction)
    return torch.cat([dance_grpo_timesteps(1, n, s.timestep_fraction,
                                           generator=seeded_generator(s.seed, iteration, GRPOStream.TRAINED_STEPS, i))
                      for i in samples])
