"""GRPO fine-tuning of FLUX or Qwen-Image (model.json's predictor): the Megatron-style entry (run under torchrun).

    torchrun --nproc_per_node N -m mm_grpo.training.train_grpo \
        --mm-model model.json --mm-data data.json --train-iters 100 ... (see arguments.py)

Everything that can be wrong with the configuration is checked before the first rollout.
With held-out prompts (`eval_prompt_file` in data.json) and `--eval-interval`, the policy is
evaluated (ODE sampling from fixed noise) before the first iteration, every interval and at
the end; the run folder (`--tensorboard-dir`, else `--save`) then gets `reward_curve.png` and
`before_after.png`.
"""
import functools
import math
import os
import time

import torch
from megatron.core import parallel_state

from mm_grpo.checkpoint.paths import EMA_KEY
from mm_grpo.checkpoint.resume import ResumeRefused
from mm_grpo.grpo.hyperparameters import GRPOSettings
from mm_grpo.grpo.schedule import GRPOSchedule
from mm_grpo.parallel import initialize_parallel
from mm_grpo.settings import from_args
from mm_grpo.training import components, evaluation
from mm_grpo.training.arguments import family_guidance, parse_args
from mm_grpo.training.checkpointing import check_resume
from mm_grpo.training.ema import PolicyEMA
from mm_grpo.training.entry import run_entry, train_and_report
from mm_grpo.training.logging_utils import is_logging_rank
from mm_grpo.training.loop import optimizer_step
from mm_grpo.training.trainable import ConfiguredRun, build_trainable, parallel_config


def grpo_iteration(schedule: GRPOSchedule, chunks, optimizer, scheduler, iteration: int, prompts,
                   forward_backward) -> dict:
    """One GRPO iteration: the schedule's rollout, reward and advantages, then each of its updates
    through the one optimizer step (`chunks`: this rank's DDP-wrapped policy; `forward_backward`: the
    family's, the model called as the schedule's denoiser calls it)."""
    updates, stats = schedule.prepare(iteration, prompts)
    if updates is None:  # non-finite rewards: skipped
        return stats
    start = time.time()
    per_update = []
    for micro_batches in updates:
        per_mb, step = optimizer_step(chunks, optimizer, scheduler, micro_batches, schedule.loss_fn,
                                      forward_backward=forward_backward)
        per_update.append({**schedule.update_statistics(per_mb), **step})
    stats.update(schedule.merge_updates(per_update), time_train=time.time() - start,
                 lr=optimizer.param_groups[0]["lr"])
    return stats


class GRPORun(ConfiguredRun):
    """Everything one GRPO training run holds, built from the arguments."""

    def __init__(self, args):
        # Cheap checks first: configs, prompt files, rewards (weights paths), batch sizes.
        super().__init__(args)
        check_resume(args)  # the iteration to resume: intact, before --train-iters
        self.prompts, self.eval_prompts = components.prompt_streams(self.data_cfg, "--mm-data", args.seed)
        if self.eval_prompts:
            evaluation.eval_settings(self.data_cfg["dataset_param"])
        height, width = components.image_size(self.model_cfg, args.height, args.width)
        self.reward = components.grpo_reward(self.model_cfg, self.prompts.prompts
                                             + (self.eval_prompts or [])[:args.eval_prompts], self.device)
        parallel = parallel_config(args, self.predictor)
        initialize_parallel(parallel, seed=args.seed, timeout_minutes=args.distributed_timeout_minutes)
        self.settings = from_args(GRPOSettings, args, height=height, width=width)
        self.settings.check(parallel_state.get_data_parallel_world_size())
        if args.global_batch_size is not None:
            self.settings.batch.check_global_batch_size(args.global_batch_size)
        # The policy.
        family = self.family
        guidance = family_guidance(args, family)
        self.model = build_trainable(args, family, self.config, self.predictor, parallel)
        ref_policy = None
        if args.kl_beta > 0 and self.model.lora:  # the base: the policy's own weights, adapters off
            ref_policy = family.lora.reference_policy(self.model.modules)
        elif args.kl_beta > 0:  # the frozen reference is the starting policy
            if self.model.initial is None:
                raise ValueError("--kl-beta > 0 needs the starting weights: predictor.from_pretrained in --mm-model")
            ref_policy = family.load_pretrained(family.build_model_chunks(self.config, self.model.pp_layers),
                                                self.model.initial)
            for chunk in ref_policy:
                chunk.requires_grad_(False)
        self.ema = None
        if args.ema_decay:  # built from the starting weights; a resume loads the checkpoint's average
            self.ema = PolicyEMA(self.model.modules, family, self.config, self.model.pp_layers, args.ema_decay,
                                 args.ema_decay_ramp)
        dtype = torch.bfloat16 if args.bf16 else torch.float32
        self.schedule = components.grpo_schedule(self.settings, self.model.modules, self.model_cfg, self.reward,
                                                 self.device, dtype, guidance, ref_policy=ref_policy,
                                                 old_policy=self.ema.modules if self.ema else None,
                                                 parts=family.parts)
        self.forward_backward = functools.partial(family.forward_backward, denoiser=self.schedule.denoiser)
        self.evaluator = self._evaluator()
        self.train_rewards = []  # reward/mean per iteration from iteration 0, across resumes (the figures)
        if self.model.resume:
            extra = self.resume()
            self.prompts.load_state_dict({"consumed": extra.get("consumed_prompts", 0)})
            past = list(extra.get("train_rewards", []))[:self.start_iteration]  # none in older checkpoints
            self.train_rewards = [math.nan] * (self.start_iteration - len(past)) + past
            if self.ema is not None:
                if EMA_KEY not in extra:
                    raise ValueError(f"--ema-decay: {args.load} holds no EMA of the policy (saved without "
                                     "--ema-decay); the run could not continue exactly")
                self.ema.load_state_dict(extra[EMA_KEY])

    def _evaluator(self):
        if not self.eval_prompts:
            return None
        return evaluation.held_out_evaluator(self.eval_prompts[:self.args.eval_prompts], self.schedule,
                                             self.data_cfg["dataset_param"], self.device)

    # --- what the loop calls ---------------------------------------------------------------
    def step(self, iteration):
        prompts = self.prompts.next_batch(self.settings.prompts_per_iteration)
        m = self.model
        stats = grpo_iteration(self.schedule, m.chunks, m.optimizer, m.scheduler, iteration, prompts,
                               self.forward_backward)
        if self.ema is not None:
            self.ema.update(iteration)
            stats["ema_decay"] = self.ema.eta(iteration)
        self.train_rewards.append(stats.get("reward/mean", math.nan))
        return stats

    def batch_sizes(self):
        s = self.settings
        return {"--prompts-per-iteration": s.prompts_per_iteration, "--num-generations": s.num_generations,
                "--micro-batch-size": s.micro_batch_size}

    def checkpoint_extras(self):
        extras = {"consumed_prompts": self.prompts.consumed, "train_rewards": self.train_rewards}
        if self.ema is not None:  # this rank's chunks: each TP x PP shard holds its own
            extras[EMA_KEY] = self.ema.state_dict()
        return extras

    def evaluated_policy(self):
        return self.ema.modules if self.ema is not None else self.model.modules

    def finish(self):
        if self.first_eval is not None and is_logging_rank() and self.run_dir:
            self.write_figures(self.first_eval, self.last_eval)

    def write_figures(self, before, after):
        """reward_curve.png (from iteration 0, resumes included) and before_after.png: the first
        held-out samples at this run's start and end, framed by the accuracy-like reward when there
        is one (the last weight-0 reward, else the total)."""
        from mm_grpo.training import figures
        curve = [{"reward/mean": r} for r in self.train_rewards]
        means = sorted({k for s in self.evaluations.values() for k in s if not evaluation.is_interval_key(k)})
        figures.reward_curve(curve, self.evaluations, os.path.join(self.run_dir, "reward_curve.png"), eval_keys=means)
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
            # The per-sample scores of both, for the paired gain: this run's first and last evaluations,
            # unless it resumed after iteration its[0] (whose scores are then in the checkpoint's stats only).
            first, last = (r if r is not None and r.stats == s else None
                           for r, s in ((run.first_eval, before), (run.last_eval, after)))
            n = len(run.evaluator.prompts)
            print(f"[mm-grpo] held-out evaluation ({n} samples, ODE, fixed noise), iteration {its[0]} -> "
                  f"{its[-1]}: " + evaluation.compare(before, after, first, last), flush=True)

    train_and_report(run, report)


def cli():
    """`python -m`: main() on the command line; a refusal that is the same on every process (the
    iteration to resume) is printed once per launch."""
    run_entry(main, agreed=(ResumeRefused,))


if __name__ == "__main__":
    cli()
