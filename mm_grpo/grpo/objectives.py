"""What `--policy-loss` decides: PPO-clip on the rollout's log-probs (DanceGRPO, Flow-GRPO, GRPO-Guard),
advantage-weighted flow matching (AWM) and DiffusionNFT; each turns a trained (sample, step) row and
the policy's velocity on it into a loss."""
from mm_grpo.flow import noisy_latents
from mm_grpo.grpo.advantages import optimality_probability
from mm_grpo.grpo.draws import draw_matching_noise
from mm_grpo.grpo.hyperparameters import GRPOSettings
from mm_grpo.grpo.loss import awm_loss, grpo_loss, guard_step_weight, nft_loss
from mm_grpo.rollout import stochastic_steps


class Objective:
    """What `--policy-loss` decides: `draw` (per-iteration randomness of the loss), `fields` (what a
    trained (sample, step) row holds), `attach_reference` (its KL target), `attach_old` (the
    sampling policy's velocity on the row, when `needs_old`) and `loss`."""
    needs_old = False

    def __init__(self, settings: GRPOSettings, sampler, sigmas):
        self.s, self.sampler, self.sigmas = settings, sampler, sigmas

    def draw(self, iteration: int, samples: range, num_trained: int, traj):
        return None


class PPOObjective(Objective):
    """PPO-clip on log-probs: a trained row is the rollout's transition x_t -> x_t+1 and its log-prob
    (with --ratio-norm also the rollout policy's step mean, for GRPO-Guard's RatioNorm)."""

    def __init__(self, settings: GRPOSettings, sampler, sigmas):
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
