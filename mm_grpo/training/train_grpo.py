"""GRPO fine-tuning of FLUX: the Megatron-style entry (run under torchrun).

    torchrun --nproc_per_node N -m mm_grpo.training.train_grpo \
        --mm-model model.json --mm-data data.json --train-iters 100 ... (see arguments.py)

Everything that can be wrong with the configuration is checked before the first rollout.
"""
import os
import sys
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from mm_grpo import get_platform
from mm_grpo.checkpoint.metadata import CheckpointMeta
from mm_grpo.checkpoint.paths import is_megatron_checkpoint
from mm_grpo.grpo.schedule import GRPOSchedule, GRPOSettings
from mm_grpo.models.registry import flux_config_from_block, load_pretrained
from mm_grpo.parallel import ParallelConfig, initialize_parallel
from mm_grpo.parallel.pipeline import build_model_chunks, resolve_pp_layers
from mm_grpo.rewards.combined import CombinedReward
from mm_grpo.rollout import rollout
from mm_grpo.training import components
from mm_grpo.training.arguments import parse_args
from mm_grpo.training.checkpointing import load_checkpoint, save_checkpoint
from mm_grpo.training.logging_utils import TrainLogger
from mm_grpo.training.optim import build_optimizer, build_scheduler, wrap_ddp


class GRPORun:
    """Everything one GRPO training run holds, built from the arguments."""

    def __init__(self, args):
        self.args = args
        base = os.path.dirname(os.path.abspath(args.mm_model))
        self.model_cfg = components.resolve_paths(args.mm_model_config, base)
        self.data_cfg = components.resolve_paths(args.mm_data_config, os.path.dirname(os.path.abspath(args.mm_data)))
        self.platform = get_platform()
        self.device = self.platform.device
        if args.bf16 and self.platform.name == "cpu":
            raise ValueError("--bf16 training needs an accelerator: megatron-core's linear layers restore CUDA "
                             "autocast in their backward, so bf16 autocast fails on CPU (train in fp32 there)")
        # Cheap checks first: configs, prompt files, rewards (weights paths), batch sizes.
        predictor = components.block(self.model_cfg, "predictor", "--mm-model")
        self.flux_config = flux_config_from_block(
            dict(predictor, recompute_blocks=args.recompute_activations, bf16=args.bf16))
        self.prompts, self.eval_prompts = components.prompt_streams(self.data_cfg, "--mm-data", args.seed)
        height, width = args.height or self.model_cfg.get("image_size", [64, 64])[0], \
            args.width or self.model_cfg.get("image_size", [64, 64])[1]
        if height % 16 or width % 16:
            raise ValueError(f"image size {height}x{width} must be a multiple of 16 (VAE 8 x packing 2)")
        self.reward = CombinedReward.from_configs(components.block(self.model_cfg, "reward", "--mm-model"),
                                                  device=self.device)
        parallel = ParallelConfig(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                                  cp=args.context_parallel_size, cp_algo=args.context_parallel_algo,
                                  vpp=self._vpp(predictor))
        initialize_parallel(parallel, seed=args.seed)
        self.settings = GRPOSettings(
            global_batch_size=args.global_batch_size or args.num_generations,
            micro_batch_size=args.micro_batch_size, num_generations=args.num_generations,
            num_inference_steps=args.num_inference_steps, sigma_shift=args.sigma_shift, sampler=args.sampler,
            noise_level=args.noise_level, init_same_noise=args.init_same_noise,
            guidance_scale=args.guidance_scale, height=height, width=width,
            timestep_selection=args.timestep_selection, timestep_fraction=args.timestep_fraction,
            window_size=args.window_size, window_shift_every=args.window_shift_every,
            clip_range=args.clip_range, adv_clip_max=args.adv_clip_max, global_std=args.global_std,
            kl_beta=args.kl_beta, updates_per_rollout=args.updates_per_rollout, seed=args.seed)
        self.settings.check(parallel_state.get_data_parallel_world_size())
        # The policy.
        self.pp_layers = resolve_pp_layers(predictor.get("pipeline_num_layers"), self.flux_config.num_blocks,
                                           parallel.pp, parallel.vpp or 1)
        resume = bool(args.load) and self._is_training_checkpoint(args.load)
        initial = predictor.get("from_pretrained") if resume or not args.load else args.load
        if initial is None and not resume:
            raise ValueError("no starting weights: give --load or predictor.from_pretrained in --mm-model")
        chunks = build_model_chunks(self.flux_config, self.pp_layers)
        if not resume:  # a resumed run takes its weights from the training checkpoint below
            load_pretrained(chunks, initial)
        self.ref_policy = None
        if args.kl_beta > 0:  # the frozen reference is the starting policy
            if initial is None:
                raise ValueError("--kl-beta > 0 needs the starting weights: predictor.from_pretrained in --mm-model")
            self.ref_policy = load_pretrained(build_model_chunks(self.flux_config, self.pp_layers), initial)
            for chunk in self.ref_policy:
                chunk.requires_grad_(False)
        self.policy = wrap_ddp(chunks, args.use_distributed_optimizer)
        self.optimizer = build_optimizer(self.policy, args)
        self.scheduler = build_scheduler(self.optimizer, args)
        self.meta = CheckpointMeta(self.flux_config, tp_size=parallel.tp, pp_layers=self._meta_pp_layers())
        dtype = torch.bfloat16 if args.bf16 else torch.float32
        text = components.block(self.model_cfg, "text_encoder", "--mm-model")
        self.schedule = GRPOSchedule(
            self.settings, self.policy, self.optimizer, self.scheduler,
            conditioner=components.conditioner(text, self.device, dtype),
            decoder=components.decoder(components.block(self.model_cfg, "ae", "--mm-model"), self.device, dtype),
            reward=self.reward, ref_policy=self.ref_policy, device=self.device)
        self.start_iteration = 0
        if resume:
            self.start_iteration, extra = load_checkpoint(
                args.load, self.policy, self.optimizer, self.scheduler,
                load_optim=not args.no_load_optim, load_rng=not args.no_load_rng)
            self.prompts.load_state_dict({"consumed": extra.get("consumed_prompts", 0)})

    def _vpp(self, predictor):
        layers = predictor.get("pipeline_num_layers")
        if layers and all(isinstance(x, (list, tuple)) for x in layers) and len(layers) > 1:
            return len(layers)
        return None

    def _meta_pp_layers(self):
        return self.pp_layers[0] if len(self.pp_layers) == 1 else self.pp_layers

    @staticmethod
    def _is_training_checkpoint(path):
        from mm_grpo.checkpoint.paths import RELEASE, iteration_dir
        return is_megatron_checkpoint(path) and os.path.basename(iteration_dir(path)) != RELEASE

    # --- the loop -----------------------------------------------------------------------
    def train(self):
        args, logger = self.args, None
        logger = TrainLogger(args.tensorboard_dir, args.train_iters, self.start_iteration,
                             progress_bar=not args.no_progress_bar, log_interval=args.log_interval)
        history = []
        try:
            for it in range(self.start_iteration, args.train_iters):
                prompts = self.prompts.next_batch(self.settings.prompts_per_iteration)
                stats = self.schedule.iteration(it, prompts)
                history.append(stats)
                logger.log(it + 1, stats)
                done = it + 1
                eval_due = bool(args.eval_interval) and done % args.eval_interval == 0
                image_due = bool(args.save_image_interval) and done % args.save_image_interval == 0
                if (eval_due or image_due) and self.eval_prompts:
                    eval_stats, images = self.evaluate()
                    if eval_due:
                        logger.log(done, eval_stats)
                    if image_due and self.image_dir:
                        logger.image_grid(done, images, os.path.join(self.image_dir, f"eval_{done:06d}.png"))
                if args.save and args.save_interval and done % args.save_interval == 0:
                    self.save(done)
            if args.save and (not args.save_interval or args.train_iters % args.save_interval):
                self.save(args.train_iters)
        finally:
            logger.close()
        return history

    def save(self, iteration):
        save_checkpoint(self.args.save, iteration, self.policy, self.optimizer, self.scheduler, self.meta,
                        {"consumed_prompts": self.prompts.consumed, "iteration": iteration})

    @property
    def image_dir(self):
        root = self.args.tensorboard_dir or self.args.save
        return os.path.join(root, "samples") if root else None

    @torch.no_grad()
    def evaluate(self):
        """Deterministic ODE sampling of held-out prompts with fixed seeds: (stats, images)."""
        from mm_grpo.parallel.pipeline import make_velocity_fn
        s = self.schedule
        prompts = self.eval_prompts[:self.args.eval_prompts]
        cond = s.conditioning(prompts)
        x0, _ = s.noise(-1, range(len(prompts)), self.flux_config.in_channels)  # the same noise every time
        traj = rollout(make_velocity_fn(s.policy_modules, cond, 1), x0, s.sigmas, "ode")
        images, total, per_reward = s.score(traj.x0_hat, prompts)
        return ({"eval/reward_mean": total.mean().item(),
                 **{f"eval/{k}": v.mean().item() for k, v in per_reward.items()}}, images)


def main(argv=None):
    args = parse_args(argv)
    run = GRPORun(args)
    start = time.time()
    history = run.train()
    if dist.get_rank() == dist.get_world_size() - 1 and history:
        first, last = history[0].get("reward/mean"), history[-1].get("reward/mean")
        print(f"[mm-grpo] {len(history)} iterations in {time.time() - start:.1f}s; "
              f"mean reward first {first:.4f} -> last {last:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as e:  # configuration problems: one line, non-zero exit
        print(f"mm-grpo: error: {e}", file=sys.stderr)
        sys.exit(2)
