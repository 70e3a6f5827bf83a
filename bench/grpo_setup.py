"""Presets and builders shared by the GRPO benchmark and the time-to-reward runs.

A preset fixes the model, image and text sizes, G, N, the trained steps and the reward.
`prepare` writes what both implementations read: a diffusers pipeline folder (the tiny
pipeline's VAE and text encoders, the preset's transformer) and a text-embedding cache of
the prompts (precomputed, as DanceGRPO and mm-grpo's `embeddings_cache` do).
"""
import argparse
import dataclasses
import os
from pathlib import Path
from typing import Optional

import torch

from mm_grpo.recompute import EVERY_BLOCK, recompute_fields
from mm_grpo.seeding import DEFAULT_SEED

PROMPTS = ["a red circle on a white background", "a blue square on a black background",
           "a green triangle above a yellow circle", "two purple squares side by side",
           "a small orange circle in the corner", "a large cyan triangle",
           "a pink square below a grey circle", "three white circles on a blue background"]


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    transformer: Optional[dict]  # diffusers FluxTransformer2DModel fields; None = the tiny pipeline's
    height: int
    width: int
    text_tokens: int  # T5 sequence length (max_sequence_length)
    num_generations: int
    prompts_per_iteration: int
    num_inference_steps: int
    micro_batch_size: int  # mm-grpo's rollout and training micro-batch
    lr: float = 1e-5
    reward: str = "jpeg_compressibility"
    bf16: bool = False
    recompute: bool = False  # mm-grpo activation checkpointing (the reference always checkpoints)
    compile: bool = False  # mm-grpo with torch.compile'd blocks (--compile-blocks)
    timestep_fraction: float = 0.6

    @property
    def batch(self) -> int:
        return self.num_generations * self.prompts_per_iteration

    @property
    def dtype(self) -> torch.dtype:
        """The frozen parts' compute dtype, as the trainer's --bf16 sets it."""
        return torch.bfloat16 if self.bf16 else torch.float32

    def settings(self, **overrides):
        from mm_grpo.grpo.hyperparameters import GRPOSettings
        kwargs = dict(prompts_per_iteration=self.prompts_per_iteration, micro_batch_size=self.micro_batch_size,
                      num_generations=self.num_generations, num_inference_steps=self.num_inference_steps,
                      height=self.height, width=self.width, timestep_fraction=self.timestep_fraction, seed=DEFAULT_SEED)
        kwargs.update(overrides)
        return GRPOSettings(**kwargs)


PRESETS = {
    # The tiny pipeline (D = 64, 607k parameters): launch and Python overhead dominate.
    "tiny": Preset("tiny", None, 64, 64, 32, num_generations=8, prompts_per_iteration=2, num_inference_steps=8,
                   micro_batch_size=16, lr=3e-3),
    # 9.2M parameters (D = 256: 2 heads of FLUX's 128), 256 image + 32 text tokens: CPU matmuls
    # run near their peak here.
    "bench": Preset("bench", dict(num_layers=2, num_single_layers=4, attention_head_dim=128, num_attention_heads=2,
                                  axes_dims_rope=[16, 56, 56]),
                    256, 256, 32, num_generations=12, prompts_per_iteration=1, num_inference_steps=16,
                    micro_batch_size=12),
    # FLUX.1 width (D = 3072, 24 heads x 128) with a few blocks, bf16: for a GPU / NPU.
    "flux-width": Preset("flux-width", dict(num_layers=2, num_single_layers=4, attention_head_dim=128,
                                            num_attention_heads=24, axes_dims_rope=[16, 56, 56]),
                         512, 512, 128, num_generations=12, prompts_per_iteration=1, num_inference_steps=16,
                         micro_batch_size=12, bf16=True),
}


def build_pipeline(preset: Preset, path: Path, seed: int = 0) -> Path:
    """The tiny pipeline with the preset's transformer (seeded), written once to `path`."""
    from mm_grpo.families.flux.tiny import TRANSFORMER_CONFIG, build_tiny_components, build_tiny_pipeline
    if (path / "model_index.json").is_file():
        return path
    if preset.transformer is None:
        return build_tiny_pipeline(path, seed)
    from diffusers import FluxPipeline, FluxTransformer2DModel
    parts = build_tiny_components(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 3)
        parts["transformer"] = FluxTransformer2DModel(**dict(TRANSFORMER_CONFIG, **preset.transformer))
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    FluxPipeline(**parts).save_pretrained(tmp, safe_serialization=True)
    os.rename(tmp, path)
    return path


def prepare(preset: Preset, workdir: Path) -> dict:
    """Pipeline folder and text-embedding cache under `workdir` (reused when present)."""
    from mm_grpo.families.flux.text import TextEncoders, save_text_embeddings
    workdir.mkdir(parents=True, exist_ok=True)
    pipeline = build_pipeline(preset, workdir / f"pipeline_{preset.name}")
    cache = workdir / f"text_{preset.name}.safetensors"
    if not cache.is_file():
        save_text_embeddings(TextEncoders(pipeline, max_sequence_length=preset.text_tokens), PROMPTS, cache)
    return dict(pipeline=str(pipeline), transformer=str(pipeline / "transformer"), cache=str(cache))


def iteration_prompts(preset: Preset, iteration: int):
    n = preset.prompts_per_iteration
    return [PROMPTS[(iteration * n + j) % len(PROMPTS)] for j in range(n)]


def model_json(preset: Preset, paths: dict, reward: Optional[list] = None) -> dict:
    """The model.json blocks a trainer would read for the preset: its text cache, VAE and reward
    (`reward`: another reward block than the preset's)."""
    return {"text_encoder": {"embeddings_cache": paths["cache"]}, "ae": {"from_pretrained": paths["pipeline"]},
            "reward": reward or [{"name": preset.reward}]}


def components(preset: Preset, paths: dict, device):
    """(conditioner, decoder, reward) as the trainer builds them."""
    from mm_grpo.families.flux import parts
    from mm_grpo.training import components as trainer_components
    blocks = model_json(preset, paths)
    return (parts.conditioner(blocks["text_encoder"], device, preset.dtype),
            parts.decoder(blocks["ae"], device, preset.dtype),
            trainer_components.grpo_reward(blocks, PROMPTS, device))


def optimizer_args(lr: float, iterations: int = 10_000):
    """The trainer's optimizer arguments (DanceGRPO's AdamW settings)."""
    return argparse.Namespace(lr=lr, min_lr=0.0, weight_decay=1e-4, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8,
                              clip_grad=1.0, use_distributed_optimizer=False, train_iters=iterations,
                              lr_decay_iters=None, lr_warmup_iters=0, lr_decay_style="constant")


def build_mm_grpo(preset: Preset, paths: dict, device, schedule_cls=None, lora_config=None, reward=None,
                  **setting_overrides):
    """mm-grpo's GRPO schedule for one process, built as the trainer builds it, and its iteration
    `step(iteration, prompts) -> stats` (the trainer's `grpo_iteration`). `lora_config`: a
    `lora.LoRAConfig` trains adapters on the frozen base instead of the whole model; `reward`:
    a model.json reward block instead of the preset's reward."""
    import functools
    from mm_grpo.grpo.schedule import GRPOSchedule
    from mm_grpo.families.flux.transformer import FluxConfig
    from mm_grpo.families.flux.chunks import load_pretrained
    from mm_grpo.parallel import ParallelConfig, initialize_parallel
    from mm_grpo.families.flux.chunks import build_model_chunks
    from mm_grpo.families.flux.denoiser import FluxGuidance
    from mm_grpo.training import components as trainer_components
    from mm_grpo.training.train_grpo import grpo_iteration
    from mm_grpo.training.trainable import attach_lora, optimize
    initialize_parallel(ParallelConfig(), seed=DEFAULT_SEED)
    config = FluxConfig.from_diffusers_config(paths["transformer"], bf16=preset.bf16, **recompute_fields(EVERY_BLOCK if preset.recompute else None),
                                             compile_blocks=preset.compile)
    chunks = [chunk.to(device) for chunk in build_model_chunks(config)]
    load_pretrained(chunks, paths["transformer"])
    if lora_config is not None:
        attach_lora(chunks, lora_config, setting_overrides.get("seed", DEFAULT_SEED), preset.bf16)
    policy, optimizer, scheduler = optimize(chunks, optimizer_args(preset.lr))
    blocks = model_json(preset, paths, reward)
    schedule = trainer_components.grpo_schedule(
        preset.settings(**setting_overrides), chunks, blocks, trainer_components.grpo_reward(blocks, PROMPTS, device),
        device, preset.dtype, FluxGuidance(), schedule_cls=schedule_cls or GRPOSchedule)
    from mm_grpo.families.flux.chunks import forward_backward
    return schedule, functools.partial(grpo_iteration, schedule, policy, optimizer, scheduler,
                                       forward_backward=functools.partial(forward_backward, denoiser=schedule.denoiser))


def default_workdir() -> Path:
    return Path(os.environ.get("MM_GRPO_BENCH_DIR", "/tmp/mm_grpo_bench"))
