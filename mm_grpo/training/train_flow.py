"""Supervised flow-matching training of a family mm-grpo trains (FLUX, Qwen-Image; pretraining or
fine-tuning), the Megatron-style entry (run under torchrun), with the parallel layouts, checkpoints and
resume of GRPO.

    torchrun --nproc_per_node N -m mm_grpo.training.train_flow \
        --mm-model model.json --mm-data data.json --train-iters 1000 ... (see --help)

data.json: {"dataset_param": {"data_folder": DIR, "image_column": "file_name", "caption_column": "text",
            "cache_features": false, "eval_prompt_file": ..., "eval_samples_per_prompt": 1, "eval_seed": 0},
            "dataloader_param": {"shuffle": true, "seed": 1234}}
DIR is an image-caption folder (mm_grpo/data/image_captions.py), relative to data.json's folder. Each iteration takes the next
global batch of a per-epoch permutation; the batch of iteration i depends on i only, so a
resumed run reads exactly what an uninterrupted one would. Noise and timesteps are drawn per
(seed, iteration, global sample index): the run does not depend on the parallel layout.
The model is trained without classifier-free guidance (`Denoiser.conditional`); the family's guidance
flags set the held-out evaluation's sampling.
"""
import dataclasses
import functools
import os
from typing import Dict, List, Optional

import torch
from megatron.core import parallel_state

from mm_grpo import configs
from mm_grpo.checkpoint.resume import ResumeRefused
from mm_grpo.data.image_captions import ImageCaptionDataset
from mm_grpo.flow import FlowMatchingSettings, flow_matching_loss, noisy_latents, sample_sigmas
from mm_grpo.grpo.denoiser import NegativePrompt
from mm_grpo.parallel import initialize_parallel
from mm_grpo.seeding import DEFAULT_SEED, Stream, seeded_generator
from mm_grpo.settings import from_args, setting
from mm_grpo.training import arguments, components
from mm_grpo.training.checkpointing import check_resume
from mm_grpo.training.entry import run_entry, train_and_report
from mm_grpo.training.loop import optimizer_step
from mm_grpo.training.trainable import ConfiguredRun, build_trainable, parallel_config


@dataclasses.dataclass(frozen=True)
class FlowSettings:
    global_batch_size: int
    micro_batch_size: int
    flow: FlowMatchingSettings
    seed: int = DEFAULT_SEED

    @property
    def samples_per_iteration(self) -> int:
        return self.global_batch_size

    def check(self, dp_size: int):
        if self.micro_batch_size < 1 or self.global_batch_size < 1:
            raise ValueError(f"micro-batch and global batch sizes must be >= 1, got {self.micro_batch_size} and "
                             f"{self.global_batch_size}")
        if self.global_batch_size % (dp_size * self.micro_batch_size):
            raise ValueError(f"global batch size {self.global_batch_size} must be divisible by data-parallel size "
                             f"{dp_size} x micro-batch size {self.micro_batch_size}")


@dataclasses.dataclass(frozen=True)
class FlowRunSettings:
    """The flow trainer's image size and held-out evaluation (read from the arguments by name)."""
    height: Optional[int] = setting(None, "side of the square training images (default: model.json image_size)")
    eval_prompts: int = setting(64, "held-out prompts per evaluation")
    num_inference_steps: int = setting(16, "ODE steps of the evaluation")
    sigma_shift: float = setting(3.0, "shift of the evaluation's sigma schedule (FLUX's; Qwen-Image samples with "
                                      "its pipeline's)")

    @property
    def width(self) -> Optional[int]:
        return self.height  # square images (centre-cropped)


FLOW_GROUP = {"flow matching": (FlowMatchingSettings, *arguments.GUIDANCE, NegativePrompt, FlowRunSettings)}
# what FlowRun reads of data.json's dataset_param (any other key is refused: components.check_data_config)
FLOW_DATASET_KEYS = ("data_folder", "image_column", "caption_column", "cache_features", *components.EVAL_KEYS)


def parse_args(argv=None):
    return arguments.parse_args(argv, own_groups=FLOW_GROUP, dataset_keys=FLOW_DATASET_KEYS)


class FeatureEncoder:
    """Images -> the family's packed, normalised VAE latents; captions -> the denoiser's conditioning.

    Latents are the posterior means (deterministic), so with `cache` each image is encoded once per run
    and every caption of the dataset once at the start (memory grows with the data: for small datasets)."""

    def __init__(self, family, ae_block, text, denoiser, dataset, device, cache=False):
        self.encode = family.latent_encoder(ae_block, device)
        self.text, self.denoiser, self.dataset, self.device, self.cache = text, denoiser, dataset, device, cache
        self.latent_cache = {}
        shape = tuple(self.latents([0]).shape[1:])
        if shape != tuple(denoiser.latent_shape):
            raise ValueError(f"the VAE's latents of a {dataset.resolution}-pixel image are {list(shape)} (tokens, "
                             f"channels), but the transformer takes {list(denoiser.latent_shape)}")
        if cache:
            captions = list(dict.fromkeys(dataset.captions_of(range(len(dataset)))))
            self.rows, self.all_text = {c: i for i, c in enumerate(captions)}, text(captions)

    @torch.no_grad()
    def latents(self, indices: List[int]) -> torch.Tensor:
        todo = [i for i in dict.fromkeys(indices) if i not in self.latent_cache]
        found = {}
        if todo:
            found = dict(zip(todo, self.encode(self.dataset.images(todo)).float()))
            if self.cache:
                self.latent_cache.update(found)
        return torch.stack([self.latent_cache.get(i, found.get(i)) for i in indices])

    def conditioning(self, captions: List[str]) -> Dict:
        if self.cache:
            return self.denoiser.conditioning(self.all_text, torch.tensor([self.rows[c] for c in captions]),
                                              self.device)
        return self.denoiser.conditioning(self.text(captions), None, self.device)


class FlowRun(ConfiguredRun):
    """Everything one flow-matching run holds, built from the arguments."""

    def __init__(self, args):
        super().__init__(args)
        family = self.family
        if family.latent_encoder is None:
            raise ValueError(f"flow-matching training (mm_grpo.training.train_flow) does not train {family.name}")
        check_resume(args)  # the iteration to resume: intact, before --train-iters
        height, width = configs.configured_size(self.model_cfg)
        if height != width and not args.height:
            raise ValueError(f"image_size {height}x{width}: flow-matching training reads square images "
                             "(centre-cropped); set a square image_size or --height")
        size = args.height or height
        family.token_grid(size, size)  # the size splits into whole latent tokens, else one line
        self.size = size
        guidance = arguments.family_guidance(args, family)
        params = configs.block(self.data_cfg, "dataset_param", "--mm-data")
        if "data_folder" not in params:
            raise ValueError("--mm-data: dataset_param needs 'data_folder' (an image-caption folder)")
        folder = os.path.join(os.path.dirname(os.path.abspath(args.mm_data)), params["data_folder"])
        self.dataset = ImageCaptionDataset(folder, params.get("image_column", "file_name"),
                                           params.get("caption_column", "text"), resolution=size)
        loader = self.data_cfg.get("dataloader_param", {})
        self.shuffle, self.data_seed = loader.get("shuffle", True), loader.get("seed", args.seed)
        parallel = parallel_config(args, self.predictor)
        initialize_parallel(parallel, seed=args.seed, timeout_minutes=args.distributed_timeout_minutes)
        dp_size = parallel_state.get_data_parallel_world_size()
        self.settings = from_args(FlowSettings, args, global_batch_size=args.global_batch_size or
                                  args.micro_batch_size * dp_size, flow=from_args(FlowMatchingSettings, args))
        self.settings.check(dp_size)
        self.model = build_trainable(args, family, self.config, self.predictor, parallel)
        dtype = torch.bfloat16 if args.bf16 else torch.float32
        run = dataclasses.replace(from_args(FlowRunSettings, args), height=size)
        text, decoder, self.sampler = family.parts(self.model_cfg, run, self.model.chunks, self.device, dtype,
                                                   guidance)
        self.denoiser = self.sampler.conditional()  # what flow matching trains: no classifier-free guidance
        self.features = FeatureEncoder(family, configs.block(self.model_cfg, "ae", "--mm-model"), text,
                                       self.denoiser, self.dataset, self.device,
                                       cache=bool(params.get("cache_features", False)))
        self.evaluator = self._evaluator(params, text, decoder)
        if self.model.resume:
            self.resume()

    def _evaluator(self, params, text, decoder):
        """ODE samples of the held-out prompts, scored by model.json's rewards (if both are given), with the
        family's guidance."""
        if not params.get("eval_prompt_file") or "reward" not in self.model_cfg:
            return None
        from mm_grpo.data import read_prompts
        from mm_grpo.rewards.combined import CombinedReward
        from mm_grpo.training.evaluation import Evaluator, eval_settings
        samples_per_prompt, seed = eval_settings(params)
        prompts = read_prompts(params["eval_prompt_file"])[:self.args.eval_prompts]
        reward = CombinedReward.from_configs(self.model_cfg["reward"], device=self.device)
        reward.check_prompts(prompts)  # before training, not at the first evaluation
        sigmas = self.sampler.sigmas(self.args.num_inference_steps, self.args.sigma_shift).to(self.device)
        return Evaluator(prompts, text, decoder, reward, sigmas, self.sampler, self.size, self.size,
                         samples_per_prompt, seed=seed, device=self.device)

    # --- data -------------------------------------------------------------------------
    def local_samples(self, iteration: int) -> range:
        """Global sample numbers of this data-parallel rank's share of iteration's batch."""
        n, dp = self.settings.global_batch_size, parallel_state.get_data_parallel_world_size()
        start = iteration * n + parallel_state.get_data_parallel_rank() * (n // dp)
        return range(start, start + n // dp)

    def dataset_index(self, sample: int) -> int:
        epoch, pos = divmod(sample, len(self.dataset))
        if not self.shuffle:
            return pos
        if getattr(self, "_epoch", None) != epoch:
            self._epoch = epoch
            self._order = torch.randperm(len(self.dataset), generator=seeded_generator(self.data_seed, epoch)).tolist()
        return self._order[pos]

    def micro_batches(self, iteration: int) -> List[Dict]:
        samples = list(self.local_samples(iteration))
        indices = [self.dataset_index(s) for s in samples]
        x0 = self.features.latents(indices).to(self.device)
        tokens = x0.shape[1]
        noise, sigma = [], []
        for s in samples:
            g = seeded_generator(self.settings.seed, Stream.FLOW_TRAINING, iteration, s)
            noise.append(torch.randn(x0.shape[1:], generator=g))
            sigma.append(sample_sigmas(1, self.settings.flow, tokens, generator=g))
        noise, sigma = torch.stack(noise).to(self.device), torch.cat(sigma).to(self.device)
        cond = self.features.conditioning(self.dataset.captions_of(indices))
        x_t = noisy_latents(x0, noise, sigma)
        mbs = self.settings.micro_batch_size
        return [dict(self.denoiser.rows_of(cond, slice(i, i + mbs)), hidden_states=x_t[i:i + mbs],
                     timestep=sigma[i:i + mbs], x0=x0[i:i + mbs], noise=noise[i:i + mbs])
                for i in range(0, len(samples), mbs)]

    # --- training ---------------------------------------------------------------------
    def batch_sizes(self):
        return {"--global-batch-size": self.settings.global_batch_size,
                "--micro-batch-size": self.settings.micro_batch_size}

    @staticmethod
    def loss_fn(v, mb):
        return flow_matching_loss(v, mb["x0"], mb["noise"]).mean(), {}

    def step(self, iteration: int) -> Dict[str, float]:
        return self.train_on(self.micro_batches(iteration))

    def train_on(self, micro_batches) -> Dict[str, float]:
        """One optimizer step on `micro_batches` -> its statistics."""
        m = self.model
        forward_backward = functools.partial(self.family.forward_backward, denoiser=self.denoiser)
        return optimizer_step(m.chunks, m.optimizer, m.scheduler, micro_batches, self.loss_fn,
                              forward_backward=forward_backward)[1]


def main(argv=None):
    def report(history, seconds):
        evaluated = [h for h in history if any(k.startswith("eval/") for k in h)]
        held_out = "; ".join(f"{k[5:]} {v:.4f}" for k, v in evaluated[-1].items()
                             if k.startswith("eval/")) if evaluated else ""
        print(f"[mm-grpo] flow matching: {len(history)} iterations in {seconds:.1f}s; "
              f"loss first {history[0]['loss']:.4f} -> last {history[-1]['loss']:.4f}"
              + (f"; held-out evaluation: {held_out}" if held_out else ""), flush=True)

    train_and_report(FlowRun(parse_args(argv)), report)


def cli():
    """`python -m`: main() on the command line; a refusal that is the same on every process (the
    iteration to resume) is printed once per launch."""
    run_entry(main, agreed=(ResumeRefused,))


if __name__ == "__main__":
    cli()
