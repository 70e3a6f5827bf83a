"""GRPO fine-tuning of FLUX: the Megatron-style entry (run under torchrun).

    torchrun --nproc_per_node N -m mm_grpo.training.train_grpo \
        --mm-model model.json --mm-data data.json --train-iters 100 ... (see arguments.py)

Everything that can be wrong with the configuration is checked before the first rollout.
With held-out prompts (`eval_prompt_file` in data.json) and `--eval-interval`, the policy is
evaluated (ODE sampling from fixed noise) before the first iteration, every interval and at
the end; the run folder (`--tensorboard-dir`, else `--save`) then gets `reward_curve.png` and
`before_after.png`.
"""
import math
import os

import torch
from megatron.core import parallel_state

from mm_grpo import get_platform
from mm_grpo.grpo.schedule import GRPOSchedule, GRPOSettings
from mm_grpo.models.registry import load_pretrained
from mm_grpo.parallel import initialize_parallel
from mm_grpo.parallel.pipeline import build_model_chunks
from mm_grpo.rewards.combined import CombinedReward
from mm_grpo.training import components
from mm_grpo.training.entry import run_entry, train_and_report
from mm_grpo.training.arguments import parse_args
from mm_grpo.training.checkpointing import load_checkpoint, save_checkpoint
from mm_grpo.training.evaluation import Evaluator
from mm_grpo.training.logging_utils import TrainLogger, is_logging_rank
from mm_grpo.training.trainable import build_trainable, parallel_config, run_configs


class GRPORun:
    """Everything one GRPO training run holds, built from the arguments."""

    def __init__(self, args):
        self.args = args
        # Cheap checks first: configs, prompt files, rewards (weights paths), batch sizes.
        configs = run_configs(args)
        self.model_cfg, self.data_cfg, self.flux_config = configs.model, configs.data, configs.flux_config
        predictor = configs.predictor
        self.device = get_platform().device
        self.prompts, self.eval_prompts = components.prompt_streams(self.data_cfg, "--mm-data", args.seed)
        height, width = args.height or self.model_cfg.get("image_size", [64, 64])[0], \
            args.width or self.model_cfg.get("image_size", [64, 64])[1]
        if height % 16 or width % 16:
            raise ValueError(f"image size {height}x{width} must be a multiple of 16 (VAE 8 x packing 2)")
        self.reward = CombinedReward.from_configs(components.block(self.model_cfg, "reward", "--mm-model"),
                                                  device=self.device)
        components.check_prompts(components.block(self.model_cfg, "text_encoder", "--mm-model"), self.reward,
                                 self.prompts.prompts + (self.eval_prompts or [])[:args.eval_prompts])
        parallel = parallel_config(args, predictor)
        initialize_parallel(parallel, seed=args.seed, timeout_minutes=args.distributed_timeout_minutes)
        self.settings = GRPOSettings(
            global_batch_size=args.global_batch_size or args.num_generations,
            micro_batch_size=args.micro_batch_size, num_generations=args.num_generations,
            num_inference_steps=args.num_inference_steps, sigma_shift=args.sigma_shift, sampler=args.sampler,
            noise_level=args.noise_level, init_same_noise=args.init_same_noise,
            guidance_scale=args.guidance_scale, height=height, width=width,
            timestep_selection=args.timestep_selection, timestep_fraction=args.timestep_fraction,
            window_size=args.window_size, window_shift_every=args.window_shift_every,
            ode_reuse=args.ode_reuse,
            clip_range=args.clip_range, adv_clip_max=args.adv_clip_max, global_std=args.global_std,
            kl_beta=args.kl_beta, policy_loss=args.policy_loss, updates_per_rollout=args.updates_per_rollout, seed=args.seed)
        self.settings.check(parallel_state.get_data_parallel_world_size())
        # The policy.
        trainable = build_trainable(args, self.flux_config, predictor, parallel)
        self.policy, self.optimizer, self.scheduler = trainable.chunks, trainable.optimizer, trainable.scheduler
        self.meta, self.pp_layers = trainable.meta, trainable.pp_layers
        self.ref_policy = None
        if args.kl_beta > 0:  # the frozen reference is the starting policy
            if trainable.initial is None:
                raise ValueError("--kl-beta > 0 needs the starting weights: predictor.from_pretrained in --mm-model")
            self.ref_policy = load_pretrained(build_model_chunks(self.flux_config, self.pp_layers), trainable.initial)
            for chunk in self.ref_policy:
                chunk.requires_grad_(False)
        dtype = torch.bfloat16 if args.bf16 else torch.float32
        text = components.block(self.model_cfg, "text_encoder", "--mm-model")
        self.schedule = GRPOSchedule(
            self.settings, self.policy, self.optimizer, self.scheduler,
            conditioner=components.conditioner(text, self.device, dtype),
            decoder=components.decoder(components.block(self.model_cfg, "ae", "--mm-model"), self.device, dtype),
            reward=self.reward, ref_policy=self.ref_policy, device=self.device)
        self.evaluator = self._evaluator(height, width)
        # For the figures, across resumes: iteration -> held-out stats, and reward/mean per iteration.
        self.evaluations, self.train_rewards = {}, []
        self.start_iteration = 0
        if trainable.resume:
            self.start_iteration, extra = load_checkpoint(
                args.load, self.policy, self.optimizer, self.scheduler,
                load_optim=not args.no_load_optim, load_rng=not args.no_load_rng)
            self.prompts.load_state_dict({"consumed": extra.get("consumed_prompts", 0)})
            self.evaluations = dict(extra.get("evaluations", {}))
            past = list(extra.get("train_rewards", []))[:self.start_iteration]  # none in older checkpoints
            self.train_rewards = [math.nan] * (self.start_iteration - len(past)) + past

    def _evaluator(self, height, width):
        """Held-out prompts x `eval_samples_per_prompt` (data.json, default 1) from fixed noise
        (`eval_seed`, default 0: the same for runs with different --seed)."""
        if not self.eval_prompts:
            return None
        s, params = self.schedule, self.data_cfg["dataset_param"]
        return Evaluator(self.eval_prompts[:self.args.eval_prompts], s.conditioner, s.decoder, s.reward, s.sigmas,
                         height, width, self.flux_config.in_channels, self.settings.guidance_scale,
                         params.get("eval_samples_per_prompt", 1), seed=params.get("eval_seed", 0), device=self.device)

    # --- the loop -----------------------------------------------------------------------
    def train(self):
        args, logger = self.args, None
        logger = TrainLogger(args.tensorboard_dir, args.train_iters, self.start_iteration,
                             progress_bar=not args.no_progress_bar, log_interval=args.log_interval)
        history, first, last = [], None, None
        try:
            if self.evaluator and args.eval_interval and self.start_iteration < args.train_iters:
                first = self.evaluate(self.start_iteration, logger)  # before training
            for it in range(self.start_iteration, args.train_iters):
                prompts = self.prompts.next_batch(self.settings.prompts_per_iteration)
                stats = self.schedule.iteration(it, prompts)
                history.append(stats)
                self.train_rewards.append(stats.get("reward/mean", math.nan))
                logger.log(it + 1, stats)
                done = it + 1
                eval_due = bool(args.eval_interval) and (done % args.eval_interval == 0 or done == args.train_iters)
                image_due = bool(args.save_image_interval) and done % args.save_image_interval == 0
                if (eval_due or image_due) and self.evaluator:
                    last = self.evaluate(done, logger, log_stats=eval_due, save_images=image_due)
                if args.save and args.save_interval and done % args.save_interval == 0:
                    self.save(done)
            ran = self.start_iteration < args.train_iters  # a resume past --train-iters trains nothing
            if args.save and ran and (not args.save_interval or args.train_iters % args.save_interval):
                self.save(args.train_iters)
            if first is not None and last is not None and is_logging_rank() and self.run_dir:
                self.write_figures(first, last)
        finally:
            logger.close()
        return history

    def save(self, iteration):
        save_checkpoint(self.args.save, iteration, self.policy, self.optimizer, self.scheduler, self.meta,
                        {"consumed_prompts": self.prompts.consumed, "iteration": iteration,
                         "evaluations": self.evaluations, "train_rewards": self.train_rewards})

    @property
    def run_dir(self):
        return self.args.tensorboard_dir or self.args.save

    @property
    def image_dir(self):
        return os.path.join(self.run_dir, "samples") if self.run_dir else None

    def evaluate(self, iteration, logger=None, log_stats=True, save_images=False):
        """Held-out evaluation of the current policy (recorded in `evaluations`); the EvalResult.
        With a logger: its stats logged (`log_stats`) and / or its first 16 images saved as a grid."""
        result = self.evaluator(self.schedule.policy_modules)
        self.evaluations[iteration] = result.stats
        if logger is not None and log_stats:
            logger.log_eval(iteration, result.stats)
        if logger is not None and save_images and self.image_dir:
            logger.image_grid(iteration, result.images[:16], os.path.join(self.image_dir, f"eval_{iteration:06d}.png"))
        return result

    def write_figures(self, before, after):
        """reward_curve.png (from iteration 0, resumes included) and before_after.png: the first
        held-out samples at this run's start and end, framed by the accuracy-like reward when there
        is one (the last weight-0 reward, else the total)."""
        from mm_grpo.training import figures
        curve = [{"reward/mean": r} for r in self.train_rewards]
        figures.reward_curve(curve, self.evaluations, os.path.join(self.run_dir, "reward_curve.png"))
        ok = None
        for name, weight in self.reward.weights.items():
            if weight == 0 and name in before.values:
                ok = name
        start = "before" if self.start_iteration == 0 else f"iteration {self.start_iteration}"
        figures.before_after_grid(before.prompts, before.images, after.images,
                                  os.path.join(self.run_dir, "before_after.png"),
                                  before.values.get(ok), after.values.get(ok), labels=(start, "after"))


def main(argv=None):
    run = GRPORun(parse_args(argv))

    def report(history, seconds):
        first, last = history[0].get("reward/mean"), history[-1].get("reward/mean")
        print(f"[mm-grpo] {len(history)} iterations in {seconds:.1f}s; "
              f"mean reward first {first:.4f} -> last {last:.4f}", flush=True)
        if len(run.evaluations) > 1:
            its = sorted(run.evaluations)
            before, after = run.evaluations[its[0]], run.evaluations[its[-1]]
            n = len(run.evaluator.prompts)
            print(f"[mm-grpo] held-out evaluation ({n} samples, ODE, fixed noise), iteration {its[0]} -> "
                  f"{its[-1]}: " + "; ".join(f"{k[5:]} {before[k]:.4f} -> {after[k]:.4f}" for k in before),
                  flush=True)

    train_and_report(run, report)


if __name__ == "__main__":
    run_entry(main)
