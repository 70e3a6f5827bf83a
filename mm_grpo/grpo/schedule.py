"""The GRPO schedule, algorithm only: a rollout becomes the micro-batches of its optimizer updates
(with statistics), and a micro-batch's model output becomes the objective's loss.

    updates, stats = schedule.prepare(iteration, prompts)     # rollout, reward, advantages
    for micro_batches in updates:                              # --updates-per-rollout of them
        ... forward-backward of micro_batches with schedule.loss_fn, one optimizer step ...

The optimizer step is the training loop's: mm-grpo's own trainer (`mm_grpo/training/train_grpo.py`)
and MindSpeed-MM's `pretrain` (`mm_grpo/mindspeed_mm/grpo.py`) drive the same micro-batches
and loss through megatron-core's forward-backward function and their optimizer. The model comes in
through a `Denoiser` (grpo/denoiser.py): nothing here knows a model family.

Samples are numbered globally, group-major (sample s belongs to prompt s // G); data-parallel
rank r owns a contiguous slice of them. Every random draw is seeded per global sample
(grpo/draws.py), so results do not depend on the parallel layout.
"""
import concurrent.futures
import math
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from mm_grpo.grpo.advantages import NonFiniteRewardError, group_advantages
from mm_grpo.grpo.denoiser import Denoiser
from mm_grpo.grpo.draws import draw_noise, draw_trained_steps
from mm_grpo.grpo.hyperparameters import GRPOSettings
from mm_grpo.grpo.objectives import OBJECTIVES
from mm_grpo.grpo.timesteps import SlidingWindow, branch_window
from mm_grpo.parallel.state import dp_mean, dp_reduce
from mm_grpo.rollout import SharedPrefix, Trajectory, get_sampler, rollout, sde_steps
from mm_grpo.seeding import GRPOStream, seeded_generator


class GRPOSchedule:
    """GRPO's rollouts and losses for this rank's model chunks.

    policy: the bare model chunks (not their DDP wrappers) the rollout runs, without gradients;
    the training loop trains their wrappers. ref_policy: the frozen reference of the KL term.
    old_policy: nft's old policy (an EMA of the trained one, kept by the trainer), which then also
    samples the rollouts; None: the policy itself as it is at the rollout.
    denoiser: what the schedule needs from the model family (grpo/denoiser.py).
    conditioner(prompts) -> the text features the denoiser reads (FLUX: prompt_embeds, pooled,
    txt_ids); decoder(x0, height, width) -> images (or videos) in [0, 1];
    reward(images, prompts) -> (total [B], {name: [B]})."""

    def __init__(self, settings: GRPOSettings, policy: list, conditioner: Callable, decoder: Callable,
                 reward: Callable, denoiser: Denoiser, ref_policy: Optional[list] = None, device=None,
                 old_policy: Optional[list] = None):
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
        if settings.kl_beta > 0 and ref_policy is None:
            raise ValueError("--kl-beta > 0 needs a reference policy")
        self.sampler = get_sampler(settings.sampler, settings.noise_level)
        self.sigmas = denoiser.sigmas(settings.num_inference_steps, settings.sigma_shift).to(self.device)
        self.objective = OBJECTIVES[settings.policy_loss](settings, self.sampler, self.sigmas)
        self.window = SlidingWindow(size=settings.window_size, every=settings.window_shift_every)
        self.denoiser = denoiser

    # --- sample bookkeeping -------------------------------------------------------
    def local_samples(self) -> range:
        per_rank = self.s.samples_per_iteration // self.dp_size
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
                    **{key: None if cond[key] is None else cond[key][r] for key in self.denoiser.per_sample_keys},
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
