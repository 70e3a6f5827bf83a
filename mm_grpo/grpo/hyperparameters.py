"""GRPO's hyperparameters: one frozen dataclass whose `setting` fields are both trainers' flags
(mm_grpo/settings.py), checked once per entry (`check`, which needs the data-parallel size)."""
import dataclasses
from typing import Optional

from mm_grpo.grpo.batch import GRPOBatch
from mm_grpo.grpo.timesteps import WINDOWED, trained_steps_per_sample
from mm_grpo.rollout import CONSTANT_FREE_LOG_PROB, SAMPLERS, sde_steps
from mm_grpo.seeding import DEFAULT_SEED
from mm_grpo.settings import setting

TIMESTEP_SELECTIONS = ("random", "ordered", *WINDOWED)  # DanceGRPO, Flow-GRPO, MixGRPO, Flow-GRPO-Fast
POLICY_LOSSES = ("ppo", "awm", "nft")  # --policy-loss: grpo/objectives.py's OBJECTIVES


@dataclasses.dataclass(frozen=True)
class GRPOSettings:
    prompts_per_iteration: int = setting(1, "P: prompts per iteration, all data-parallel ranks together (each "
                                            "rolled out --num-generations times)", minimum=1)
    micro_batch_size: int = 1  # rollout forward and training micro-batch (equal: ratio == 1 exactly)
    num_generations: int = setting(12, "G: images / videos per prompt", minimum=2)
    num_inference_steps: int = setting(16, "N: denoising steps", minimum=2)
    sigma_shift: float = setting(3.0, "shift of the sigma schedule")
    sampler: str = setting("dance_sde", "the rollout's step", choices=sorted(SAMPLERS))
    noise_level: Optional[float] = setting(None, "eta / noise level (sampler default)")
    init_same_noise: bool = setting(False, "same initial noise within a group")
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
        choices=POLICY_LOSSES)
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
        g, n = self.num_generations, self.samples_per_iteration
        if self.micro_batch_size < 1 or self.updates_per_rollout < 1:
            raise ValueError(f"--micro-batch-size and --updates-per-rollout must be >= 1, got "
                             f"{self.micro_batch_size} and {self.updates_per_rollout}")
        if self.timestep_selection not in TIMESTEP_SELECTIONS:
            raise ValueError(f"unknown --timestep-selection {self.timestep_selection!r}; "
                             f"choose {', '.join(TIMESTEP_SELECTIONS)}")
        if not 0 < self.timestep_fraction <= 1:
            raise ValueError(f"--timestep-fraction must be in (0, 1], got {self.timestep_fraction}")
        trainable = sde_steps(self.sampler, self.num_inference_steps)
        if self.timestep_selection in WINDOWED and not 1 <= self.window_size <= trainable:
            raise ValueError(f"--window-size must be in [1, {trainable}] (the steps that can draw noise), "
                             f"got {self.window_size}")
        try:  # before the model is built: otherwise the first rollout's step selection says it
            self.trained_steps_per_sample
        except ValueError as e:
            raise ValueError(f"--timestep-fraction {self.timestep_fraction} with --num-inference-steps "
                             f"{self.num_inference_steps} (--timestep-selection {self.timestep_selection}): "
                             f"{e}") from None
        if not self.clip_range > 0 or self.kl_beta < 0:
            raise ValueError(f"need --clip-range > 0 and --kl-beta >= 0, got {self.clip_range} and {self.kl_beta}")
        per_update = n // self.updates_per_rollout
        if n % self.updates_per_rollout or per_update % (dp_size * self.micro_batch_size):
            raise ValueError(
                f"the {n} samples per iteration ({self.prompts_per_iteration} prompts x {g} generations) must split "
                f"into --updates-per-rollout {self.updates_per_rollout} parts, each divisible by data-parallel size "
                f"{dp_size} x micro-batch size {self.micro_batch_size}")
        if self.ode_reuse < 1:
            raise ValueError(f"--ode-reuse must be >= 1, got {self.ode_reuse}")
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"unknown --policy-loss {self.policy_loss!r}; choose {', '.join(POLICY_LOSSES)}")
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
    def samples_per_iteration(self) -> int:
        """P x G: the rollouts of one iteration."""
        return self.prompts_per_iteration * self.num_generations

    @property
    def trained_steps_per_sample(self) -> int:
        """K: every sample trains the same number of steps (the window's, or a fraction of the rest)."""
        return trained_steps_per_sample(self.num_inference_steps, self.timestep_selection, self.timestep_fraction,
                                        self.window_size, self.sampler)

    @property
    def batch(self) -> GRPOBatch:
        return GRPOBatch(self.prompts_per_iteration, self.num_generations, self.trained_steps_per_sample,
                         self.updates_per_rollout)
