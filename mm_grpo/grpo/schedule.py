"""The GRPO schedule, algorithm only: a rollout becomes the micro-batches of its optimizer updates
(with statistics), and a micro-batch's model output becomes the objective's loss.

    updates, stats = schedule.prepare(iteration, prompts)     # rollout, reward, advantages
    for micro_batches in updates:                              # --updates-per-rollout of them
        ... forward-backward of micro_batches with schedule.loss_fn, one optimizer step ...

The optimizer step is the training loop's: mm-grpo's own trainer (`mm_grpo/training/train_grpo.py`)
and MindSpeed-MM's `pretrain` (`mm_grpo/mindspeed_mm/grpo.py`) drive the same micro-batches
and loss through megatron-core's forward-backward function and their optimizer.

Samples are numbered globally, group-major (sample s belongs to prompt s // G); data-parallel
rank r owns a contiguous slice of them. Every random draw (initial noise, step noise, trained
timesteps, the awm loss's forward-process noise) is seeded by (seed, iteration, global sample
index), so results do not depend on the parallel layout and a resumed run repeats exactly what
an uninterrupted one does.
"""
import concurrent.futures
import dataclasses
import math
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from mm_grpo.encoders.wan import WAN_NEGATIVE_PROMPT
from mm_grpo.flow import noisy_latents
from mm_grpo.grpo.advantages import NonFiniteRewardError, group_advantages, optimality_probability
from mm_grpo.grpo.loss import awm_loss, grpo_loss, guard_step_weight, nft_loss
from mm_grpo.grpo.timesteps import (SlidingWindow, branch_window, dance_grpo_timesteps, flow_grpo_timesteps,
                                    window_timesteps)
from mm_grpo.models.flux.config import FLUX_DEV_GUIDANCE
from mm_grpo.parallel.state import dp_mean, dp_reduce
from mm_grpo.rollout import (CONSTANT_FREE_LOG_PROB, SAMPLERS, SharedPrefix, Trajectory, get_sampler, rollout,
                             sde_steps, sigma_schedule, stochastic_steps)
from mm_grpo.runtime.denoiser import Denoiser, FluxDenoiser
from mm_grpo.seeding import DEFAULT_SEED, GRPOStream, seeded_generator
from mm_grpo.settings import setting

TIMESTEP_SELECTIONS = ("random", "ordered", "window", "branch")  # DanceGRPO, Flow-GRPO, MixGRPO, Flow-GRPO-Fast


# --- what --policy-loss decides ---------------------------------------------------------
class Objective:
    """What `--policy-loss` decides: `draw` (per-iteration randomness of the loss), `fields` (what a
    trained (sample, step) row holds), `attach_reference` (its KL target), `attach_old` (the
    sampling policy's velocity on the row, when `needs_old`) and `loss`."""
    needs_old = False

    def __init__(self, settings: "GRPOSettings", sampler, sigmas):
        self.s, self.sampler, self.sigmas = settings, sampler, sigmas

    def draw(self, iteration: int, samples: range, num_trained: int, traj):
        return None


class PPOObjective(Objective):
    """PPO-clip on log-probs: a trained row is the rollout's transition x_t -> x_t+1 and its log-prob
    (with --ratio-norm also the rollout policy's step mean, for GRPO-Guard's RatioNorm)."""

    def __init__(self, settings: "GRPOSettings", sampler, sigmas):
        super().__init__(settings, sampler, sigmas)
        self.needs_old = settings.ratio_norm
        # Per step of the schedule, once: whether it draws noise (decided on the host, so a row of
        # such steps is scored without reading its std back) and GRPO-Guard's weight.
        self.noisy = stochastic_steps(sampler, sigmas.detach().cpu())
        self.step_weights = guard_step_weight(sigmas[:-1], sigmas[1:]) if settings.step_reweight else None

    def attach_old(self, mb, v_old):
        mb["old_mean"] = self.step(mb, v_old).mean

    def fields(self, traj, r, t, k, drawn, host_t) -> dict:
        row = dict(hidden_states=traj.latents[r, t], x_next=traj.latents[r, t + 1], sigma_next=self.sigmas[t + 1],
                   old_log_prob=traj.log_probs[r, t])
        if all(self.noisy[i] for i in host_t.tolist()):
            row["stochastic"] = True
        if self.step_weights is not None:
            row["step_weight"] = self.step_weights[t]
        return row

    def attach_reference(self, mb, v_ref):
        mb["ref_mean"] = self.step(mb, v_ref).mean

    def step(self, mb, v):
        return self.sampler(mb["hidden_states"], v, mb["timestep"], mb["sigma_next"], x_next=mb["x_next"],
                            stochastic=mb.get("stochastic"))

    def loss(self, v, mb):
        step = self.step(mb, v)
        weight = mb.get("step_weight")
        if weight is None and self.s.step_reweight:
            weight = guard_step_weight(mb["timestep"], mb["sigma_next"])
        return grpo_loss(step.log_prob, mb["old_log_prob"], mb["advantages"], clip_range=self.s.clip_range,
                         kl_beta=self.s.kl_beta, mean=step.mean, ref_mean=mb.get("ref_mean"), std=step.std,
                         old_mean=mb.get("old_mean"), step_weight=weight)


class AWMObjective(Objective):
    """Advantage-weighted matching: a trained row is the sample's x0 re-noised to the step's sigma
    by forward-process noise drawn per (seed, iteration, sample)."""

    def draw(self, iteration: int, samples: range, num_trained: int, traj):
        noise = draw_matching_noise(self.s, iteration, samples, num_trained, *traj.x0_hat.shape[1:])
        return noise.to(traj.x0_hat.device, traj.x0_hat.dtype)

    def fields(self, traj, r, t, k, drawn, host_t) -> dict:
        x0, noise = traj.x0_hat[r], drawn[r, k]
        return dict(hidden_states=noisy_latents(x0, noise, self.sigmas[t]).to(traj.latents.dtype), x0=x0, noise=noise)

    def attach_reference(self, mb, v_ref):
        mb["ref_v"] = v_ref

    def loss(self, v, mb):
        return awm_loss(v, mb["x0"], mb["noise"], mb["advantages"], kl_beta=self.s.kl_beta, ref_v=mb.get("ref_v"))


class NFTObjective(AWMObjective):
    """DiffusionNFT: the rows of AWM (x0 re-noised by forward-process noise) and the sampling (old)
    policy's velocity on each; the loss weighs the implicit positive and negative policies' x0
    predictions by the sample's optimality probability (`nft_loss`)."""
    needs_old = True

    def attach_old(self, mb, v_old):
        mb["old_v"] = v_old

    def loss(self, v, mb):
        return nft_loss(v, mb["old_v"], mb["hidden_states"], mb["timestep"], mb["x0"],
                        optimality_probability(mb["advantages"], self.s.adv_clip_max), beta=self.s.nft_beta,
                        adv_clip_max=self.s.adv_clip_max, kl_beta=self.s.kl_beta, ref_v=mb.get("ref_v"))


OBJECTIVES = {"ppo": PPOObjective, "awm": AWMObjective, "nft": NFTObjective}  # --policy-loss


# --- settings (each `setting` is also a command-line flag: mm_grpo/settings.py) ---------------
@dataclasses.dataclass(frozen=True)
class GRPOSettings:
    global_batch_size: int  # generations per iteration, all data-parallel ranks together
    micro_batch_size: int = 1  # rollout forward and training micro-batch (equal: ratio == 1 exactly)
    num_generations: int = setting(12, "G: images per prompt")
    num_inference_steps: int = setting(16, "N denoising steps")
    sigma_shift: float = setting(3.0, "shift of the sigma schedule")
    sampler: str = setting("dance_sde", "the rollout's step", choices=sorted(SAMPLERS))
    noise_level: Optional[float] = setting(None, "eta / noise level (sampler default)")
    init_same_noise: bool = setting(False, "same initial noise within a group")
    guidance_scale: float = setting(FLUX_DEV_GUIDANCE, "guidance embedding value (FLUX.1-dev)")
    cfg_scale: float = setting(
        1.0, "classifier-free guidance of a model without a guidance embedding (Wan): the velocity v_uncond + "
             "s (v_cond - v_uncond) in the rollout and in the trained steps, DanceGRPO's --cfg_infer (its Wan "
             "recipe: 5); 1: none", minimum=1.0)
    negative_prompt: str = setting(WAN_NEGATIVE_PROMPT, "the unconditional prompt of --cfg-scale (default: "
                                                        "MindSpeed-MM's Wan2.1 negative prompt)")
    height: int = 64  # image size (the trainer's --height / --width, else model.json)
    width: int = 64
    timestep_selection: str = setting(
        "random", "DanceGRPO (random), Flow-GRPO (ordered), MixGRPO sliding window, or Flow-GRPO-Fast branching "
                  "(a --window-size SDE window at a random step per iteration; needs --init-same-noise)",
        choices=TIMESTEP_SELECTIONS)
    timestep_fraction: float = setting(0.6, "fraction of the steps trained (random, ordered)")
    window_size: int = setting(3, "MixGRPO SDE window (steps; 4 of 25 in MixGRPO)")
    window_shift_every: int = setting(25, "iterations per window move")
    ode_reuse: int = setting(1, "window / branch: evaluate the model every k-th ODE step outside the window "
                                "(MixGRPO-Flash style; 1 = every step); trained steps and their log-probs are unchanged")
    clip_range: float = setting(1e-4, "PPO clip range c: the ratio is clipped to [1 - c, 1 + c]")
    adv_clip_max: float = setting(5.0, "advantages clipped to +- this")
    global_std: bool = setting(False, "normalise advantages by the global std")
    kl_beta: float = setting(0.0, "weight of the KL term to the frozen starting policy")
    policy_loss: str = setting(
        "ppo", "ppo: PPO-clip on the rollout's log-probs (DanceGRPO / Flow-GRPO); awm: advantage-weighted flow "
               "matching on the rollout's samples (AWM); nft: DiffusionNFT's negative-aware flow matching around "
               "the sampling policy (awm and nft: any sampler, ode included)",
        choices=tuple(OBJECTIVES))
    ratio_norm: bool = setting(False, "ppo: GRPO-Guard's RatioNorm (the log-ratio's mean bias removed, scaled by "
                                      "the step std)")
    step_reweight: bool = setting(False, "ppo: GRPO-Guard's gradient reweighting (each step's term divided by "
                                         "|dt|); GRPO-Guard is --ratio-norm --step-reweight")
    nft_beta: float = setting(1.0, "nft: beta, the mixing coefficient of the implicit positive / negative policies")
    updates_per_rollout: int = setting(1, "optimizer steps per rollout (update u trains the samples s with "
                                          "s mod U == u)")
    reward_overlap_groups: int = setting(
        0, "roll out this many groups at a time, each part decoded and scored in a second thread while the next "
           "is rolled out: a remote reward's latency hides behind the rollout (0: the whole batch, then its "
           "scores)")
    seed: int = DEFAULT_SEED

    def check(self, dp_size: int):
        g, n = self.num_generations, self.global_batch_size
        if g < 2:
            raise ValueError(f"--num-generations must be >= 2 (advantages compare a prompt's generations), got {g}")
        if self.micro_batch_size < 1 or self.updates_per_rollout < 1:
            raise ValueError(f"--micro-batch-size and --updates-per-rollout must be >= 1, got "
                             f"{self.micro_batch_size} and {self.updates_per_rollout}")
        if self.timestep_selection not in TIMESTEP_SELECTIONS:
            raise ValueError(f"unknown --timestep-selection {self.timestep_selection!r}; "
                             f"choose {', '.join(TIMESTEP_SELECTIONS)}")
        if not 0 < self.timestep_fraction <= 1:
            raise ValueError(f"--timestep-fraction must be in (0, 1], got {self.timestep_fraction}")
        trainable = sde_steps(self.sampler, self.num_inference_steps)
        if self.timestep_selection in ("window", "branch") and not 1 <= self.window_size <= trainable:
            raise ValueError(f"--window-size must be in [1, {trainable}] (the steps that can draw noise), "
                             f"got {self.window_size}")
        if not self.clip_range > 0 or self.kl_beta < 0:
            raise ValueError(f"need --clip-range > 0 and --kl-beta >= 0, got {self.clip_range} and {self.kl_beta}")
        if n % g:
            raise ValueError(f"global batch size {n} must be a multiple of --num-generations {g}")
        per_update = n // self.updates_per_rollout
        if n % self.updates_per_rollout or per_update % (dp_size * self.micro_batch_size):
            raise ValueError(
                f"global batch size {n} must split into --updates-per-rollout {self.updates_per_rollout} "
                f"parts, each divisible by data-parallel size {dp_size} x micro-batch size {self.micro_batch_size}")
        if self.ode_reuse < 1:
            raise ValueError(f"--ode-reuse must be >= 1, got {self.ode_reuse}")
        if self.policy_loss not in OBJECTIVES:
            raise ValueError(f"unknown --policy-loss {self.policy_loss!r}; choose {', '.join(OBJECTIVES)}")
        if self.timestep_selection == "branch" and not self.init_same_noise:
            raise ValueError("--timestep-selection branch needs --init-same-noise: a group branches from one "
                             "shared ODE prefix")
        if self.ratio_norm and self.policy_loss != "ppo":
            raise ValueError("--ratio-norm normalises PPO's importance ratio: it needs --policy-loss ppo")
        if self.ratio_norm and self.sampler in CONSTANT_FREE_LOG_PROB:
            raise ValueError(f"--ratio-norm removes the bias of a Gaussian step's log-ratio; {self.sampler}'s log-prob "
                             "is Flow-GRPO's constant-free squared error: use --sampler dance_sde or flow_sde")
        if self.step_reweight and self.policy_loss != "ppo":
            raise ValueError("--step-reweight weighs PPO's per-step terms: it needs --policy-loss ppo")
        if self.negative_prompt != WAN_NEGATIVE_PROMPT and self.cfg_scale == 1:
            raise ValueError("--negative-prompt is the unconditional prompt of classifier-free guidance, which is "
                             "off: add --cfg-scale > 1")
        if not self.nft_beta > 0:
            raise ValueError(f"--nft-beta must be > 0, got {self.nft_beta}")
        part = self.reward_overlap_groups * g
        if self.reward_overlap_groups < 0 or (part and ((n // dp_size) % part or part % self.micro_batch_size)):
            raise ValueError(f"--reward-overlap-groups {self.reward_overlap_groups}: its {part} samples must divide "
                             f"a data-parallel rank's {n // dp_size} and be a multiple of --micro-batch-size "
                             f"{self.micro_batch_size} (0: no overlap)")
        if self.sampler == "ode" and self.policy_loss == "ppo":
            raise ValueError("the ode sampler has no log-probabilities: choose an SDE sampler, or --policy-loss awm "
                             "or nft")
        if self.sampler == "ode" and self.init_same_noise:
            raise ValueError("--sampler ode with --init-same-noise draws the same image G times (every advantage 0): "
                             "drop --init-same-noise (SAME_NOISE=0)")

    @property
    def prompts_per_iteration(self) -> int:
        return self.global_batch_size // self.num_generations

    @property
    def trained_steps_per_sample(self) -> int:
        """K: every sample trains the same number of steps (the window's, or a fraction of the rest)."""
        return draw_trained_steps(self, 0, range(1), (0, self.window_size) if self.timestep_selection in
                                  ("window", "branch") else None).shape[1]


# --- seeded draws -----------------------------------------------------------------------
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


# --- the schedule -------------------------------------------------------------------------
class GRPOSchedule:
    """GRPO's rollouts and losses for this rank's model chunks.

    policy: the bare model chunks (not their DDP wrappers) the rollout runs, without gradients;
    the training loop trains their wrappers. ref_policy: the frozen reference of the KL term.
    old_policy: nft's old policy (an EMA of the trained one, kept by the trainer), which then also
    samples the rollouts; None: the policy itself as it is at the rollout.
    denoiser: what the schedule needs from the model family (runtime/denoiser.py; default FLUX's).
    conditioner(prompts) -> the text features the denoiser reads (FLUX: prompt_embeds, pooled,
    txt_ids); decoder(x0, height, width) -> images (or videos) in [0, 1];
    reward(images, prompts) -> (total [B], {name: [B]})."""

    def __init__(self, settings: GRPOSettings, policy: list, conditioner: Callable, decoder: Callable,
                 reward: Callable, ref_policy: Optional[list] = None, device=None,
                 old_policy: Optional[list] = None, denoiser: Optional[Denoiser] = None):
        self.s = settings
        self.policy, self.ref_policy = list(policy), ref_policy
        # Who samples (and gives nft's v_old): PPO's log-probs must be the trained policy's own.
        self.sampling_policy = list(old_policy) if old_policy is not None and settings.policy_loss == "nft" \
            else self.policy
        self.conditioner, self.decoder, self.reward = conditioner, decoder, reward
        self.device = device or torch.device("cpu")
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        settings.check(self.dp_size)
        if settings.kl_beta > 0 and ref_policy is None:
            raise ValueError("--kl-beta > 0 needs a reference policy")
        self.sampler = get_sampler(settings.sampler, settings.noise_level)
        self.sigmas = sigma_schedule(settings.num_inference_steps, settings.sigma_shift).to(self.device)
        self.objective = OBJECTIVES[settings.policy_loss](settings, self.sampler, self.sigmas)
        self.window = SlidingWindow(size=settings.window_size, every=settings.window_shift_every)
        self.denoiser = denoiser or FluxDenoiser.of(self.policy, settings.height, settings.width,
                                                    settings.guidance_scale)

    # --- sample bookkeeping -------------------------------------------------------
    def local_samples(self) -> range:
        per_rank = self.s.global_batch_size // self.dp_size
        return range(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank)

    def group_ids(self, samples: range) -> torch.Tensor:
        """[B] the group (prompt) of each sample."""
        return torch.tensor([s // self.s.num_generations for s in samples], device=self.device)

    def conditioning(self, prompts: List[str]):
        # A prompt appears G times in a batch: encode (or look up) each one once.
        unique = list(dict.fromkeys(prompts))
        rows = torch.tensor([unique.index(p) for p in prompts])
        return self.denoiser.conditioning(self.conditioner(unique), rows, self.device)

    def noise(self, iteration: int, samples: range):
        """Initial noise [B, *latent] and step noise [B, N, *latent], per global sample index: drawn
        on the CPU, copied to a CUDA device asynchronously (from page-locked memory)."""
        pinned = self.device.type == "cuda"
        init, steps = draw_noise(self.s, iteration, samples, self.denoiser.latent_shape, pin_memory=pinned)
        return init.to(self.device, non_blocking=pinned), steps.to(self.device, non_blocking=pinned)

    def sde_window(self, iteration: int):
        n, sel = sde_steps(self.s.sampler, self.s.num_inference_steps), self.s.timestep_selection
        if sel == "window":
            return self.window.bounds(iteration, n)
        if sel == "branch":
            return branch_window(self.s.window_size, n,
                                 generator=seeded_generator(self.s.seed, iteration, GRPOStream.BRANCH_WINDOW))
        return None

    def trained_steps(self, iteration: int, samples: range) -> torch.Tensor:
        """[B, K] indices of the transitions trained for each sample."""
        return draw_trained_steps(self.s, iteration, samples, self.sde_window(iteration))

    # --- the phases ---------------------------------------------------------------------
    @torch.no_grad()
    def sample(self, iteration: int, prompts: List[str], samples: range, cond: dict, window=None):
        x0, step_noise = self.noise(iteration, samples)
        velocity = self.denoiser.velocity_fn(self.sampling_policy, cond, self.s.micro_batch_size)
        return rollout(velocity, x0, self.sigmas, self.sampler, sde_window=window, noise=step_noise,
                       ode_reuse=self.s.ode_reuse, shared_prefix=self.shared_prefix(samples, cond, window))

    def shared_prefix(self, samples: range, cond: dict, window):
        """With the same initial noise per group, the ODE steps before the window are the same for
        the whole group: run them once per group (on the group's first local sample)."""
        if not (self.s.init_same_noise and window is not None and window[0] > 0):
            return None

        def velocity_over(rows):
            return self.denoiser.velocity_fn(self.sampling_policy, self.denoiser.rows_of(cond, rows),
                                             math.gcd(len(rows), self.s.micro_batch_size))

        return SharedPrefix.of_groups(self.group_ids(samples), velocity_over)

    def sample_and_score(self, iteration: int, prompts: List[str], samples: range, cond: dict, window=None):
        """(trajectory, rewards, {name: values}, time the rollout ended). With --reward-overlap-groups
        the rollout runs in parts of that many groups, each part decoded and scored in a second
        thread while the next is rolled out; randomness is drawn per sample and the model runs the
        same micro-batches, so the parts make the whole batch's rollout."""
        part = self.s.reward_overlap_groups * self.s.num_generations
        if not part or part >= len(samples):
            traj = self.sample(iteration, prompts, samples, cond, window)
            t1 = time.time()
            return (traj, *self.score(traj.x0_hat, prompts)[1:], t1)
        trajs, pending = [], []
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mm-grpo-reward") as scorer:
            for start in range(0, len(samples), part):
                rows = slice(start, start + part)
                part_cond = self.denoiser.rows_of(cond, rows)
                trajs.append(self.sample(iteration, prompts[rows], samples[rows], part_cond, window))
                pending.append(scorer.submit(self.score, trajs[-1].x0_hat, prompts[rows]))
            t1 = time.time()
            scored = [p.result() for p in pending]
        return (Trajectory.cat(trajs), torch.cat([s[1] for s in scored]),
                {k: torch.cat([s[2][k] for s in scored]) for k in scored[0][2]}, t1)

    @torch.no_grad()  # grad mode is per thread: the scoring thread's too
    def score(self, x0_hat, prompts):
        images = self.decoder(x0_hat, self.s.height, self.s.width)
        total, per_reward = self.reward(images, prompts)
        return images, total.float().to(self.device), {k: v.float().to(self.device) for k, v in per_reward.items()}

    def micro_batches(self, traj, cond, advantages, steps, rows, drawn=None):
        """(trajectory, timestep) pairs as forward kwargs: the k-th trained step of `mbs` samples;
        what a row holds besides the conditioning is the objective's (`drawn`: its `draw`). The rows
        and steps cross to the device once; each micro-batch gathers there."""
        mbs, out = self.s.micro_batch_size, []
        host_steps = steps.cpu()
        device_rows = torch.as_tensor(rows, dtype=torch.long).to(self.device)
        device_steps = host_steps.to(self.device)
        for k in range(steps.shape[1]):
            for j in range(0, len(rows), mbs):
                r = device_rows[j:j + mbs]
                t = device_steps[r, k]
                host_t = host_steps[rows[j:j + mbs], k]
                out.append(dict(
                    self.objective.fields(traj, r, t, k, drawn, host_t), timestep=self.sigmas[t],
                    advantages=advantages[r],
                    **{key: cond[key][r] for key in self.denoiser.per_sample_keys},
                    **{key: cond[key] for key in self.denoiser.shared_keys}))
        return out

    @torch.no_grad()
    def attach_reference(self, micro_batches):
        """The reference policy's velocity on each row, for the objective's KL term (forward-only)."""
        for mb in micro_batches:
            self.objective.attach_reference(mb, self._velocity(self.ref_policy, mb))

    @torch.no_grad()
    def attach_old(self, micro_batches):
        """The sampling policy's velocity on each row, before any update of this rollout (forward-only)."""
        for mb in micro_batches:
            self.objective.attach_old(mb, self._velocity(self.sampling_policy, mb))

    def _velocity(self, chunks, mb):
        cond = {k: mb[k] for k in (*self.denoiser.per_sample_keys, *self.denoiser.shared_keys)}
        return self.denoiser.velocity_fn(chunks, cond, self.s.micro_batch_size)(mb["hidden_states"], mb["timestep"])

    def prepare(self, iteration: int, prompts: List[str]):
        """Rollout, reward and advantages: (micro-batches of each optimizer update, stats).

        The micro-batches are None when the iteration is skipped (non-finite rewards)."""
        if len(prompts) != self.s.prompts_per_iteration:
            raise ValueError(f"expected {self.s.prompts_per_iteration} prompts, got {len(prompts)}")
        t0 = time.time()
        samples = self.local_samples()
        local_prompts = [prompts[s // self.s.num_generations] for s in samples]
        cond = self.conditioning(local_prompts)
        window = self.sde_window(iteration)
        traj, rewards, per_reward, t1 = self.sample_and_score(iteration, local_prompts, samples, cond, window)
        stats = {f"reward/{k}": self._dp_mean(v.mean()) for k, v in per_reward.items()}
        stats.update({"reward/mean": self._dp_mean(rewards.mean()), "reward/std": self._dp_std(rewards)})
        if window is not None:  # MixGRPO's position or Flow-GRPO-Fast's branch point
            stats["sde_window_start"] = float(window[0])
        try:
            adv = group_advantages(rewards, self.group_ids(samples), clip_max=self.s.adv_clip_max,
                                   global_std=self.s.global_std,
                                   process_group=self.dp_group if self.dp_size > 1 else None)
        except NonFiniteRewardError as e:
            return None, dict(stats, skipped=1.0, skip_reason=str(e), time_rollout=t1 - t0,
                              time_reward=time.time() - t1)
        stats.update({"adv/mean": self._dp_mean(adv.mean()), "adv/abs_max": self._dp_max(adv.abs().max())})
        steps = draw_trained_steps(self.s, iteration, samples, window)
        drawn = self.objective.draw(iteration, samples, steps.shape[1], traj)
        # Update u trains the global samples s with s % U == u: the same samples under every
        # data-parallel layout (a rank's share of each update is the part of its slice that is there).
        u_count = self.s.updates_per_rollout
        parts = [[i for i, s in enumerate(samples) if s % u_count == u] for u in range(u_count)]
        updates = [self.micro_batches(traj, cond, adv, steps, part, drawn) for part in parts]
        if self.ref_policy is not None and self.s.kl_beta > 0:  # frozen: its velocities do not change
            for micro_batches in updates:
                self.attach_reference(micro_batches)
        if self.objective.needs_old:  # before the first update: the policy that sampled
            for micro_batches in updates:
                self.attach_old(micro_batches)
        stats.update(time_rollout=t1 - t0, time_reward=time.time() - t1)
        return updates, stats

    def loss_fn(self, v, mb):
        """The objective's (loss, stats) of one micro-batch, given the policy's output `v`."""
        return self.objective.loss(v, mb)

    # --- statistics ---------------------------------------------------------------------
    def update_statistics(self, per_mb: List[Dict]) -> Dict[str, float]:
        """One update's loss statistics: *_min / *_max over its micro-batches and the data-parallel
        ranks, the rest averaged; and the first micro-batch's ratio (exactly 1 when on-policy)."""
        out = {}
        for key in per_mb[0]:
            values = torch.stack([torch.as_tensor(m[key]).float() for m in per_mb])
            out[key] = (-self._dp_max(-values.min()) if key.endswith("_min") else
                        self._dp_max(values.max()) if key.endswith("_max") else self._dp_mean(values.mean()))
        if "ratio_min" in per_mb[0]:
            out.update(ratio_first_mb_min=float(per_mb[0]["ratio_min"]),
                       ratio_first_mb_max=float(per_mb[0]["ratio_max"]))
        return out

    @staticmethod
    def merge_updates(per_update: List[Dict]) -> Dict:
        """The statistics of a rollout's updates as one: averages, except what belongs to the first."""
        merged = {}
        for key in dict.fromkeys(k for u in per_update for k in u):
            values = [u[key] for u in per_update if key in u]
            first_only = key.startswith("ratio_first") or key == "skip_reason"
            merged[key] = values[0] if first_only else sum(values) / len(values)
        return merged

    # --- reductions over data-parallel ranks -----------------------------------------
    def _dp_mean(self, value):
        return dp_mean(value, self.device)

    def _dp_max(self, value):
        return dp_reduce(value, dist.ReduceOp.MAX, self.device)

    def _dp_std(self, values):
        n = dp_reduce(values.numel(), device=self.device)
        mean = dp_reduce(values.double().sum(), device=self.device) / n
        var = dp_reduce(((values.double() - mean) ** 2).sum(), device=self.device) / max(n - 1, 1)
        return var ** 0.5
