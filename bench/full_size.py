"""FLUX at its real shapes on one accelerator: GRPO iterations timed by phase, MFU, peak memory,
bf16 numerics, and `mm-grpo plan`'s prediction of the same job beside each.

    python -m bench.full_size --model flux-dev --lora-rank 64 --sizes 512:12 1024:4 --iters 1 --json out.json

Nothing is downloaded. The transformer is built on the device with Megatron's initialisation
(random weights at the model's shapes), LoRA adapters of `--lora-rank` go on the recommended
targets (the attention and MLP linears of every block) and the frozen base's matrices are cast to
bf16, as the trainer does with --bf16 (`lora.freeze_base_in_bf16`). The VAE is FLUX.1's
AutoencoderKL at its published config with random weights, the prompts' text embeddings are a
random precomputed cache at T5-XXL's / CLIP-L's widths (the trainer's `embeddings_cache`), and the
reward is jpeg_compressibility (no model). The GRPO schedule, DDP, optimizer and iteration are the
trainer's own functions (training/components.py, optim.py, train_grpo.grpo_iteration).

`--sizes H:M ...`: image side and micro-batch, run one after the other on the same model (one
warm-up iteration at the first size only, then `--iters` timed ones at each). Before the adapters,
`--check-bf16` compares the velocity of the fp32 weights under bf16 autocast with fp32 compute.
Every size's figures are written to `--json` as soon as they are measured.
"""
import argparse
import contextlib
import dataclasses
import functools
import io
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch

from bench.bench_grpo import matmul_throughput
from bench.flops import grpo_iteration_flops
from bench.grpo_setup import PROMPTS, Preset, optimizer_args
from mm_grpo.encoders.latents import num_image_tokens

# FLUX.1's AutoencoderKL (the vae/config.json of black-forest-labs/FLUX.1-dev).
FLUX_VAE_CONFIG = dict(
    in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[128, 256, 512, 512],
    down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
    layers_per_block=2, norm_num_groups=32, sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159,
    use_quant_conv=False, use_post_quant_conv=False)
REWARD = "jpeg_compressibility"  # no model: the figures are the transformer's and the VAE's
MATMUL_SIZE = 8192  # the bf16 yardstick on an accelerator, as bench_grpo measures it
LR = 1e-5  # DanceGRPO's FLUX learning rate; the timing does not depend on it


def write_frozen_parts(config, text_tokens: int, workdir: Path, tiny_vae: bool) -> dict:
    """A pipeline folder holding only vae/ (FLUX.1's config, random weights) and a text-embedding
    cache of random vectors at the model's text widths, one row per prompt."""
    from diffusers import AutoencoderKL

    from mm_grpo.encoders.text import save_text_embeddings
    from mm_grpo.tools.tiny import VAE_CONFIG
    pipeline = workdir / ("pipeline_tiny_vae" if tiny_vae else "pipeline_flux_vae")
    if not (pipeline / "vae" / "config.json").is_file():
        torch.manual_seed(0)
        AutoencoderKL(**(VAE_CONFIG if tiny_vae else FLUX_VAE_CONFIG)).save_pretrained(pipeline / "vae")
    cache = workdir / f"text_{config.joint_attention_dim}x{text_tokens}.safetensors"
    if not cache.is_file():
        class RandomText:  # what TextEncoders.encode returns, at the model's widths
            def encode(self, prompts):
                g = torch.Generator().manual_seed(len(prompts))
                return (torch.randn(len(prompts), text_tokens, config.joint_attention_dim, generator=g),
                        torch.randn(len(prompts), config.pooled_projection_dim, generator=g), None)
        save_text_embeddings(RandomText(), PROMPTS, cache)
    return dict(pipeline=str(pipeline), cache=str(cache))


def bf16_velocity_error(chunks, config, paths, height, device) -> dict:
    """Velocity of two samples under bf16 autocast against fp32 compute, same (fp32) weights."""
    from mm_grpo.encoders.latents import num_image_tokens, token_grid
    from mm_grpo.encoders.text import TextEmbeddingCache
    from mm_grpo.runtime.chunks import conditioning, make_velocity_fn
    text = TextEmbeddingCache(paths["cache"]).get(PROMPTS[:2], device=device)
    cond = conditioning(text, token_grid(height, height), 3.5, device)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(2, num_image_tokens(height, height), config.in_channels, device=device, generator=g)
    sigma = torch.tensor([1.0, 0.5], device=device)
    # Frozen for the check: autocast caches a bf16 copy of every weight that requires a gradient.
    trainable = [t for chunk in chunks for t in chunk.parameters() if t.requires_grad]
    for t in trainable:
        t.requires_grad_(False)
    out = {}
    for bf16 in (False, True):
        for chunk in chunks:
            chunk.flux_config = config.replace(bf16=bf16)
        out[bf16] = make_velocity_fn(chunks, cond, 2)(x, sigma).float()
    for chunk in chunks:
        chunk.flux_config = config
    for t in trainable:
        t.requires_grad_(True)
    diff = out[True] - out[False]
    return dict(rel_l2=(diff.norm() / out[False].norm()).item(),
                max_abs_over_max=(diff.abs().max() / out[False].abs().max()).item(),
                finite=bool(torch.isfinite(out[True]).all()))


def planned(model: str, size: int, micro_batch: int, lora_rank: int, text_tokens: int, recompute: bool) -> dict:
    """`mm-grpo plan`'s row for this job on one H100 (TP = PP = SP = 1)."""
    from mm_grpo.plan.cli import build_parser, plan
    argv = ["--model", model, "--height", str(size), "--micro-batch-size", str(micro_batch),
            "--lora-rank", str(lora_rank), "--text-tokens", str(text_tokens), "--reward", REWARD,
            "--devices", "1", "--device", "h100", "--tp", "1", "--pp", "1", "--sp", "1",
            "--recompute" if recompute else "--no-recompute"]
    with contextlib.redirect_stdout(io.StringIO()):
        rows = plan(build_parser().parse_args(argv))[3]
    return rows[0]


def timed_iteration(step, iteration, platform) -> dict:
    accelerator = getattr(torch, platform.name) if platform.name != "cpu" else None
    if accelerator:
        accelerator.reset_peak_memory_stats(platform.device)
    platform.synchronize()
    start = time.perf_counter()
    stats = step(iteration, PROMPTS[:1])
    platform.synchronize()
    peak = platform.max_memory_allocated()
    return dict(stats, time_total=time.perf_counter() - start, peak_allocated=peak,
                peak_reserved=accelerator.max_memory_reserved(platform.device) if accelerator else peak)


def profile_iteration(step, iteration, platform, path):
    """One more iteration under torch.profiler: its ops by device time (CPU time on CPU), top 40."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if platform.name == "cuda" else [])
    with profile(activities=activities) as prof:
        step(iteration, PROMPTS[:1])
        platform.synchronize()
    key = "device_time_total" if platform.name == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=60)
    Path(path).write_text(table)
    print(table[:6000], flush=True)


def finite(stats: dict) -> bool:
    return all(math.isfinite(v) for v in stats.values() if isinstance(v, float))


@dataclasses.dataclass
class Run:
    """What every size shares: the arguments, the model and its optimizer, the frozen parts' blocks
    (model.json's), and the results so far (written to --json after each size)."""
    args: argparse.Namespace
    platform: object
    config: object  # FluxConfig
    chunks: list
    policy: list  # the chunks in DDP
    optimizer: object
    scheduler: object
    blocks: dict
    result: dict

    def save(self):
        if self.args.json:
            tmp = self.args.json + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.result, f, indent=1, default=float)
            os.replace(tmp, self.args.json)


def build(args, platform, config, paths, result) -> Run:
    """The model on the device, the bf16 check before the adapters, LoRA on the frozen base, DDP,
    the optimizer: as the trainer builds them (training/trainable.py), with random weights."""
    from mm_grpo.models.flux import lora
    from mm_grpo.parallel import ParallelConfig, initialize_parallel
    from mm_grpo.runtime.chunks import build_model_chunks
    from mm_grpo.seeding import DEFAULT_SEED
    from mm_grpo.training.trainable import attach_lora, optimize
    accelerator = getattr(torch, platform.name) if platform.name != "cpu" else None
    start = time.perf_counter()
    initialize_parallel(ParallelConfig(), seed=DEFAULT_SEED)
    chunks = [chunk.to(platform.device) for chunk in build_model_chunks(config)]
    platform.synchronize()
    result.update(build_s=time.perf_counter() - start, parameters=sum(t.numel() for t in chunks[0].parameters()))
    print(f"[full_size] built {result['parameters'] / 1e9:.2f}B parameters in {result['build_s']:.1f} s", flush=True)
    if args.check_bf16 and config.bf16:
        try:
            result["bf16_velocity"] = bf16_velocity_error(chunks, config, paths, args.sizes[0][0], platform.device)
        except torch.OutOfMemoryError as e:
            result["bf16_velocity"] = f"out of memory: {str(e).splitlines()[0]}"
        print(f"[full_size] bf16 vs fp32 velocity: {result['bf16_velocity']}", flush=True)
    if args.lora_rank:
        attach_lora(chunks, lora.LoRAConfig(r=args.lora_rank, alpha=args.lora_rank), DEFAULT_SEED, config.bf16)
    if accelerator:  # the fp32 copies are gone: reserved memory as the run needs it
        accelerator.empty_cache()
    result["trainable_parameters"] = sum(t.numel() for t in chunks[0].parameters() if t.requires_grad)
    policy, optimizer, scheduler = optimize(chunks, optimizer_args(LR))
    blocks = {"text_encoder": {"embeddings_cache": paths["cache"]}, "ae": {"from_pretrained": paths["pipeline"]},
              "reward": [{"name": REWARD}]}
    return Run(args, platform, config, chunks, policy, optimizer, scheduler, blocks, result)


def run_size(run: Run, size: int, micro_batch: int, iteration: int, warmup: bool, profile: bool) -> int:
    """Iterations at one size and micro-batch (a warm-up first if `warmup`), summarised into
    result["sizes"]; returns the next iteration number."""
    from mm_grpo.training import components as trainer_components
    from mm_grpo.training.train_grpo import grpo_iteration
    args, device = run.args, run.platform.device
    preset = Preset(f"{args.model}-{size}", None, size, size, args.text_tokens, args.num_generations, 1,
                    args.num_inference_steps, micro_batch, bf16=run.config.bf16, recompute=run.config.recompute_blocks)
    reward = trainer_components.grpo_reward(run.blocks, PROMPTS, device)
    schedule = trainer_components.grpo_schedule(preset.settings(), run.chunks, run.blocks, reward, device, preset.dtype)
    step = functools.partial(grpo_iteration, schedule, run.policy, run.optimizer, run.scheduler)
    runs = []
    for _ in range(args.iters + warmup):
        runs.append(timed_iteration(step, iteration, run.platform))
        r, iteration = runs[-1], iteration + 1
        print(f"[full_size] {size}px micro-batch {micro_batch}, iteration {iteration - 1}: {r['time_total']:.1f} s "
              f"(rollout {r['time_rollout']:.1f}, decode+reward {r['time_reward']:.1f}, train {r['time_train']:.1f}), "
              f"peak {r['peak_allocated'] / 2**30:.1f} GiB, ratio first mb [{r.get('ratio_first_mb_min', math.nan):.6f}, "
              f"{r.get('ratio_first_mb_max', math.nan):.6f}], finite {finite(r)}", flush=True)
    if profile:
        profile_iteration(step, iteration, run.platform, args.profile)
        iteration += 1
    run.result["sizes"][f"{size}px m={micro_batch}"] = summary(run, preset, runs[1:] if warmup and len(runs) > 1 else runs,
                                                              runs)
    return iteration


def summary(run: Run, preset: Preset, timed: list, runs: list) -> dict:
    """Medians of the timed iterations, MFU against the measured matmul rate, peaks, the plan's row."""
    args = run.args
    med = lambda key: statistics.median(r[key] for r in timed)  # noqa: E731
    n_img = num_image_tokens(preset.height, preset.width)
    trained = preset.settings().trained_steps_per_sample  # K, as the schedule draws it
    flops = grpo_iteration_flops(run.config, args.text_tokens, n_img, preset.batch, args.num_inference_steps,
                                 trained, lora_rank=args.lora_rank)
    row = dict(micro_batch=preset.micro_batch_size, image_tokens=n_img, trained_steps=trained,
               iterations=[{k: v for k, v in r.items() if isinstance(v, (int, float))} for r in runs],
               rollout=med("time_rollout"), decode_reward=med("time_reward"), train=med("time_train"),
               iteration=med("time_total"), images_per_s=preset.batch / med("time_total"),
               peak_allocated_gib=max(r["peak_allocated"] for r in timed) / 2**30,
               peak_reserved_gib=max(r["peak_reserved"] for r in timed) / 2**30,
               transformer_tflop=(flops.rollout + flops.train) / 1e12, all_finite=all(finite(r) for r in runs))
    rate = run.result.get("matmul_bf16_flops")
    if rate:
        row.update(mfu=(flops.rollout + flops.train) / (row["iteration"] * rate),
                   mfu_rollout=flops.rollout / (row["rollout"] * rate), mfu_train=flops.train / (row["train"] * rate))
    if args.model != "tiny" and not args.depth:  # the planner knows the whole model only
        row["plan"] = planned(args.model, preset.height, preset.micro_batch_size, args.lora_rank, args.text_tokens,
                              run.config.recompute_blocks)
    return row


def run_fitting(run: Run, size: int, micro_batch: int, iteration: int, warmup: bool, profile: bool) -> int:
    """`run_size` at the largest micro-batch that fits, from the one asked for down through G's divisors."""
    while True:
        try:
            return run_size(run, size, micro_batch, iteration, warmup, profile)
        except torch.OutOfMemoryError as e:
            run.result["sizes"].setdefault("out_of_memory", []).append(f"{size}:{micro_batch}: {str(e).splitlines()[0]}")
        # outside the handler: its traceback no longer holds the failed iteration's tensors
        print(f"[full_size] {size}px micro-batch {micro_batch}: out of memory", flush=True)
        getattr(torch, run.platform.name).empty_cache()
        smaller = [m for m in range(micro_batch - 1, 0, -1) if run.args.num_generations % m == 0]
        if not smaller:
            raise SystemExit(f"{size}px does not fit even at micro-batch 1")
        micro_batch = smaller[0]


def print_summary(result: dict):
    print(json.dumps({k: v for k, v in result.items() if k != "sizes"}, default=float))
    for key, row in result["sizes"].items():
        if key == "out_of_memory":
            print("out of memory:", row)
            continue
        plan = row.get("plan") or {}
        print(f"{key}: iteration {row['iteration']:.1f} s (rollout {row['rollout']:.1f}, decode+reward "
              f"{row['decode_reward']:.1f}, train {row['train']:.1f}), {row['images_per_s']:.2f} images/s, MFU "
              f"{row.get('mfu', math.nan):.1%}, peak {row['peak_allocated_gib']:.1f} GiB allocated / "
              f"{row['peak_reserved_gib']:.1f} reserved; plan: {plan.get('peak_bytes_per_rank', math.nan) / 2**30:.1f} "
              f"GiB, {plan.get('seconds_per_iteration', math.nan):.1f} s")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="flux-dev", help="a FluxConfig preset (flux-dev, flux-schnell, tiny)")
    p.add_argument("--depth", type=int, nargs=2, default=None, metavar=("DOUBLE", "SINGLE"),
                   help="fewer blocks than the preset (a smoke run of the same path)")
    p.add_argument("--sizes", nargs="+", default=["512:12"], type=lambda s: tuple(int(v) for v in s.split(":")),
                   help="image side:micro-batch, run in this order")
    p.add_argument("--lora-rank", type=int, default=64, help="0: full fine-tuning")
    p.add_argument("--text-tokens", type=int, default=512)
    p.add_argument("--num-generations", type=int, default=12)
    p.add_argument("--num-inference-steps", type=int, default=16)
    p.add_argument("--iters", type=int, default=1, help="timed iterations per size (after one warm-up)")
    p.add_argument("--no-recompute", action="store_true")
    p.add_argument("--no-bf16", action="store_true", help="fp32 compute (CPU)")
    p.add_argument("--check-bf16", action="store_true", help="bf16 against fp32 velocity before training")
    p.add_argument("--compile", action="store_true", help="torch.compile'd blocks (the trainer's --compile-blocks)")
    p.add_argument("--profile", default=None, help="profile the last timed iteration (torch.profiler): "
                   "write its top kernels by device time to this file")
    p.add_argument("--workdir", default="/tmp/mm_grpo_full_size")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import mm_grpo
    from mm_grpo.models.flux import FluxConfig
    platform = mm_grpo.get_platform()
    depth = dict(num_layers=args.depth[0], num_single_layers=args.depth[1]) if args.depth else {}
    config = FluxConfig.preset(args.model, bf16=not args.no_bf16, recompute_blocks=not args.no_recompute,
                               compile_blocks=args.compile, **depth)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    paths = write_frozen_parts(config, args.text_tokens, workdir, tiny_vae=config.in_channels != 64)
    result = dict(model=args.model, depth=args.depth, lora_rank=args.lora_rank, device=str(platform.device),
                  device_name=torch.cuda.get_device_name() if platform.name == "cuda" else platform.name,
                  torch=torch.__version__, sizes={})
    if platform.name != "cpu":
        rates = [matmul_throughput(platform.device, torch.bfloat16, MATMUL_SIZE)[0] for _ in range(3)]
        result["matmul_bf16_flops"] = statistics.median(rates)
    run = build(args, platform, config, paths, result)
    run.save()
    iteration = 0
    for n, (size, micro_batch) in enumerate(args.sizes):
        iteration = run_fitting(run, size, micro_batch, iteration, warmup=n == 0,
                                profile=bool(args.profile) and n == len(args.sizes) - 1)
        run.save()
    print_summary(result)


if __name__ == "__main__":
    main()
