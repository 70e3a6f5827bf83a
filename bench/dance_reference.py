"""A GRPO iteration written the way DanceGRPO's `train_grpo_flux.py` does it (the benchmark's
reference; not part of mm-grpo).

diffusers' `FluxTransformer2DModel`; one generation at a time through the 16-step SDE
rollout (`run_sample_step` + `flux_step`), VAE decode and reward per image; group
advantages; then, per sample and per trained timestep, a forward, the PPO-clip loss and a
backward; an optimizer step (grad-norm clip 1.0, AdamW) every `accumulation` samples.
Activation checkpointing per block and bf16 autocast as DanceGRPO's FLUX script sets them.

Three deliberate differences, so that both benchmarks do the same work on the same numbers:
the timestep fed to the model is sigma itself (DanceGRPO rounds it to int(sigma * 1000) /
1000), the noises and trained timesteps are mm-grpo's seeded draws (DanceGRPO calls
`torch.randn_like` / `torch.randperm`), and text embeddings come from the same cache.
"""
import contextlib
import math
import time

import torch

from mm_grpo import get_platform
from mm_grpo.families.flux.denoiser import FluxGuidance
from mm_grpo.families.flux.transformer.latents import prepare_latent_image_ids
from mm_grpo.grpo.draws import draw_noise, draw_trained_steps
from mm_grpo.grpo.hyperparameters import GRPOSettings
from mm_grpo.rollout import sigma_schedule


def flux_step(model_output, latents, eta, sigmas, index, prev_sample, noise=None):
    """DanceGRPO's `flux_step` (grpo=True, sde_solver=True); `noise` replaces randn_like."""
    sigma = sigmas[index]
    dsigma = sigmas[index + 1] - sigma
    prev_sample_mean = latents + dsigma * model_output
    pred_original_sample = latents - sigma * model_output
    delta_t = sigma - sigmas[index + 1]
    std_dev_t = eta * math.sqrt(delta_t)
    score_estimate = -(latents - pred_original_sample * (1 - sigma)) / sigma ** 2
    log_term = -0.5 * eta ** 2 * score_estimate
    prev_sample_mean = prev_sample_mean + log_term * dsigma
    if prev_sample is None:
        prev_sample = prev_sample_mean + noise * std_dev_t
    log_prob = (-((prev_sample.detach().to(torch.float32) - prev_sample_mean.to(torch.float32)) ** 2)
                / (2 * (std_dev_t ** 2)) - math.log(std_dev_t) - math.log(math.sqrt(2 * math.pi)))
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample, pred_original_sample, log_prob


class DanceGRPOReference:
    """One DanceGRPO-style GRPO iteration per `iteration()` call (single process)."""

    def __init__(self, settings: GRPOSettings, transformer_dir, conditioner, decoder, reward, *, lr=1e-5,
                 accumulation=None, eta=0.3, checkpointing=True, bf16=False, device="cpu"):
        from diffusers import FluxTransformer2DModel
        self.s, self.device, self.eta = settings, torch.device(device), eta
        self.transformer = FluxTransformer2DModel.from_pretrained(transformer_dir).to(self.device)
        if self.device.type == "cuda":
            # cuDNN's SDPA backward fails on diffusers' attention here (torch 2.11, H100:
            # "mha_graph.execute(...).is_good()" in the first backward); flash attention runs it.
            torch.backends.cuda.enable_cudnn_sdp(False)
        if checkpointing:
            self.transformer.enable_gradient_checkpointing()
        self.optimizer = torch.optim.AdamW(self.transformer.parameters(), lr=lr, betas=(0.9, 0.999),
                                           eps=1e-8, weight_decay=1e-4)
        self.accumulation = accumulation or settings.num_generations
        self.conditioner, self.decoder, self.reward = conditioner, decoder, reward
        self.sigmas = sigma_schedule(settings.num_inference_steps, settings.sigma_shift).tolist()
        self.grid = (settings.height // 16, settings.width // 16)
        self.img_ids = prepare_latent_image_ids(*self.grid, device=self.device)
        self.bf16 = bf16

    def _autocast(self):
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, torch.bfloat16)

    def _forward(self, z, sigma, embeds, pooled, txt_ids):
        with self._autocast():
            return self.transformer(
                hidden_states=z, encoder_hidden_states=embeds, timestep=torch.full((z.shape[0],), sigma, device=z.device),
                guidance=torch.full((z.shape[0],), FluxGuidance().guidance_scale, device=z.device),
                txt_ids=txt_ids, pooled_projections=pooled, img_ids=self.img_ids, return_dict=False)[0]

    @torch.no_grad()
    def run_sample_step(self, z, noise, embeds, pooled, txt_ids):
        """One generation through every step: (x0_hat, latents [1, N+1, ...], log-probs [1, N])."""
        self.transformer.eval()
        all_latents, all_log_probs = [z], []
        for i in range(len(self.sigmas) - 1):
            pred = self._forward(z, self.sigmas[i], embeds, pooled, txt_ids)
            z, pred_original, log_prob = flux_step(pred.float(), z.float(), self.eta, self.sigmas, i, None, noise[:, i])
            all_latents.append(z)
            all_log_probs.append(log_prob)
        return pred_original, torch.stack(all_latents, dim=1), torch.stack(all_log_probs, dim=1)

    def iteration(self, iteration: int, prompts):
        """prompts: this iteration's prompts; returns timings and what the equal-work check needs."""
        s, sync = self.s, get_platform().synchronize
        samples = range(s.samples_per_iteration)
        t_rollout = t_reward = 0.0
        x0, noise = draw_noise(s, iteration, samples, (self.grid[0] * self.grid[1], self.transformer.config.in_channels))
        latents, log_probs, rewards, conds = [], [], [], []
        for i in samples:  # DanceGRPO samples one generation at a time
            t0 = time.perf_counter()
            prompt = prompts[i // s.num_generations]
            embeds, pooled, txt_ids = (t.to(self.device) for t in self.conditioner([prompt]))
            x0_hat, traj, logp = self.run_sample_step(x0[i:i + 1].to(self.device), noise[i:i + 1].to(self.device),
                                                      embeds, pooled, txt_ids)
            sync()
            t1 = time.perf_counter()
            image = self.decoder(x0_hat, s.height, s.width)
            rewards.append(self.reward(image, [prompt])[0].float().cpu())
            t_rollout, t_reward = t_rollout + t1 - t0, t_reward + time.perf_counter() - t1
            latents.append(traj)
            log_probs.append(logp)
            conds.append((embeds, pooled, txt_ids))
        t0 = time.perf_counter()
        rewards = torch.cat(rewards)
        advantages = torch.zeros_like(rewards)
        for g in range(0, len(rewards), s.num_generations):  # DanceGRPO's per-group loop
            group = rewards[g:g + s.num_generations]
            advantages[g:g + s.num_generations] = (group - group.mean()) / (group.std() + 1e-8)
        steps = draw_trained_steps(s, iteration, samples)
        grad_norms, losses = self.train(latents, log_probs, advantages, conds, steps)
        sync()
        t_train = time.perf_counter() - t0
        return dict(time_rollout=t_rollout, time_reward=t_reward, time_train=t_train,
                    rewards=rewards, log_probs=torch.cat(log_probs).cpu(), grad_norms=grad_norms, loss=sum(losses))

    def train(self, latents, log_probs, advantages, conds, steps):
        s, train_timesteps = self.s, steps.shape[1]
        self.transformer.train()
        self.optimizer.zero_grad()
        grad_norms, losses = [], []
        for i in range(len(latents)):
            embeds, pooled, txt_ids = conds[i]
            for k in range(train_timesteps):
                t = int(steps[i, k])
                pred = self._forward(latents[i][:, t], self.sigmas[t], embeds, pooled, txt_ids)
                _, _, new_log_prob = flux_step(pred.float(), latents[i][:, t].float(), self.eta, self.sigmas, t,
                                               latents[i][:, t + 1])
                adv = torch.clamp(advantages[i:i + 1].to(self.device), -s.adv_clip_max, s.adv_clip_max)
                ratio = torch.exp(new_log_prob - log_probs[i][:, t])
                unclipped = -adv * ratio
                clipped = -adv * torch.clamp(ratio, 1.0 - s.clip_range, 1.0 + s.clip_range)
                loss = torch.mean(torch.maximum(unclipped, clipped)) / (self.accumulation * train_timesteps)
                loss.backward()
                losses.append(loss.item())
            if (i + 1) % self.accumulation == 0:
                grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.transformer.parameters(), 1.0)))
                self.optimizer.step()
                self.optimizer.zero_grad()
        return grad_norms, losses
