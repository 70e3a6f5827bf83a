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

`--anchors`: instead of GRPO iterations, one transformer call at the rollout's batch (the first of
`--sizes`, side:batch; default 12 x 512 px, `--text-tokens` 512), timed for diffusers'
`FluxTransformer2DModel` with bf16 weights (how FluxPipeline, flow_grpo and DanceGRPO run it) and for
mm-grpo's `FluxTransformer` as the trainer runs it under --bf16 with LoRA (`attach_lora`: frozen bf16
base, adapters of `--lora-rank` on the recommended targets, the config's bf16), each eager and compiled
(diffusers' regional compilation `compile_repeated_blocks(fullgraph=True)`, mm-grpo's
`compile_blocks`), no-grad forward and forward + backward to the input (per-block recompute, the
weights frozen), median of `--anchor-calls` after `--anchor-warmup` (a compiled row's first warm-up
call is the one that compiles), in one process on one device, one model on the device at a time;
the ratios mm-grpo / diffusers are printed with every run. The two models hold the same weights
(diffusers' random initialisation, in bf16, loaded into mm-grpo by `load_hf_weights` through the
host), so `--numerics-batch` samples also give both bf16 paths' velocity error against an fp32
forward of those weights, and the two fp32 forwards' agreement.
"""
import argparse
import contextlib
import dataclasses
import functools
import gc
import io
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from bench.bench_grpo import matmul_throughput
from bench.flops import flux_flops, grpo_iteration_flops
from bench.grpo_setup import PROMPTS, Preset, optimizer_args
from mm_grpo.families.flux.transformer.latents import num_image_tokens
from mm_grpo.recompute import EVERY_BLOCK, recompute_fields

# FLUX.1's AutoencoderKL (the vae/config.json of black-forest-labs/FLUX.1-dev).
FLUX_VAE_CONFIG = dict(
    in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[128, 256, 512, 512],
    down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
    layers_per_block=2, norm_num_groups=32, sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159,
    use_quant_conv=False, use_post_quant_conv=False)
REWARD = "jpeg_compressibility"  # no model: the figures are the transformer's and the VAE's
MATMUL_SIZE = 8192  # the bf16 yardstick on an accelerator, as bench_grpo measures it
LR = 1e-5  # DanceGRPO's FLUX learning rate; the timing does not depend on it
DIFFUSERS_SEED = 0  # the anchors' random weights (diffusers' initialisation), shared by both models


def write_frozen_parts(config, text_tokens: int, workdir: Path, tiny_vae: bool) -> dict:
    """A pipeline folder holding only vae/ (FLUX.1's config, random weights) and a text-embedding
    cache of random vectors at the model's text widths, one row per prompt."""
    from diffusers import AutoencoderKL

    from mm_grpo.families.flux.text import save_text_embeddings
    from mm_grpo.families.flux.tiny import VAE_CONFIG
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
    """Velocity of two samples in bf16 against fp32 compute, same (fp32) weights."""
    from mm_grpo.families.flux.transformer.latents import num_image_tokens, token_grid
    from mm_grpo.families.flux.text import TextEmbeddingCache
    from mm_grpo.families.flux.chunks import conditioning, make_velocity_fn
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
    return velocity_error(out[True], out[False])


def plan_device(platform) -> str:
    """devices.py's profile of the card this runs on (the H100's where it has none)."""
    name = torch.cuda.get_device_name() if platform.name == "cuda" else ""
    return "h200" if "H200" in name else "h100"


def planned(model: str, size: int, micro_batch: int, lora_rank: int, text_tokens: int, recompute: bool,
            compiled: bool, device: str, matmul_flops=None) -> dict:
    """`mm-grpo plan`'s row for this job on one card (TP = PP = SP = 1), at the matmul rate measured in
    this run where there is one."""
    from mm_grpo.families.flux.plan_cli import build_parser, plan
    argv = ["--model", model, "--height", str(size), "--micro-batch-size", str(micro_batch),
            "--lora-rank", str(lora_rank), "--text-tokens", str(text_tokens), "--reward", REWARD,
            "--devices", "1", "--device", device, "--tp", "1", "--pp", "1", "--sp", "1",
            "--recompute" if recompute else "--no-recompute"]
    argv += ["--matmul-tflops", str(matmul_flops / 1e12)] if matmul_flops else []
    argv += ["--compile-blocks"] if compiled else []
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
    from mm_grpo.families.flux.transformer import lora
    from mm_grpo.parallel import ParallelConfig, initialize_parallel
    from mm_grpo.families.flux.chunks import build_model_chunks
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
    from mm_grpo.families.flux.denoiser import FluxGuidance
    from mm_grpo.training import components as trainer_components
    from mm_grpo.training.train_grpo import grpo_iteration
    args, device = run.args, run.platform.device
    preset = Preset(f"{args.model}-{size}", None, size, size, args.text_tokens, args.num_generations, 1,
                    args.num_inference_steps, micro_batch, bf16=run.config.bf16, recompute=run.config.recompute is not None)
    reward = trainer_components.grpo_reward(run.blocks, PROMPTS, device)
    schedule = trainer_components.grpo_schedule(preset.settings(), run.chunks, run.blocks, reward, device, preset.dtype,
                                                FluxGuidance())
    from mm_grpo.families.flux.chunks import forward_backward
    step = functools.partial(grpo_iteration, schedule, run.policy, run.optimizer, run.scheduler,
                             forward_backward=functools.partial(forward_backward, denoiser=schedule.denoiser))
    runs, key = [], size_key(size, micro_batch)
    for _ in range(args.iters + warmup):
        runs.append(timed_iteration(step, iteration, run.platform))
        r, iteration = runs[-1], iteration + 1
        print(f"[full_size] {size}px micro-batch {micro_batch}, iteration {iteration - 1}: {r['time_total']:.1f} s "
              f"(rollout {r['time_rollout']:.1f}, decode+reward {r['time_reward']:.1f}, train {r['time_train']:.1f}), "
              f"peak {r['peak_allocated'] / 2**30:.1f} GiB, ratio first mb [{r.get('ratio_first_mb_min', math.nan):.6f}, "
              f"{r.get('ratio_first_mb_max', math.nan):.6f}], finite {finite(r)}", flush=True)
        # written as each iteration ends: a step stopped at its time bound keeps the iterations it ran
        run.result["sizes"][key] = dict(partial=True, iterations=[numbers(r) for r in runs])
        run.save()
    if profile:
        profile_iteration(step, iteration, run.platform, args.profile)
        iteration += 1
    run.result["sizes"][key] = summary(run, preset, runs[1:] if warmup and len(runs) > 1 else runs, runs)
    return iteration


def size_key(size: int, micro_batch: int) -> str:
    return f"{size}px m={micro_batch}"


def numbers(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if isinstance(v, (int, float))}


def summary(run: Run, preset: Preset, timed: list, runs: list) -> dict:
    """Medians of the timed iterations, MFU against the measured matmul rate, peaks, the plan's row."""
    args = run.args
    med = lambda key: statistics.median(r[key] for r in timed)  # noqa: E731
    n_img = num_image_tokens(preset.height, preset.width)
    trained = preset.settings().trained_steps_per_sample  # K, as the schedule draws it
    flops = grpo_iteration_flops(run.config, args.text_tokens, n_img, preset.batch, args.num_inference_steps,
                                 trained, lora_rank=args.lora_rank)
    row = dict(micro_batch=preset.micro_batch_size, image_tokens=n_img, trained_steps=trained,
               iterations=[numbers(r) for r in runs],
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
                              run.config.recompute is not None, run.config.compile_blocks, plan_device(run.platform), rate)
    return row


def run_fitting(run: Run, size: int, micro_batch: int, iteration: int, warmup: bool, profile: bool) -> int:
    """`run_size` at the largest micro-batch that fits, from the one asked for down through G's divisors."""
    while True:
        try:
            return run_size(run, size, micro_batch, iteration, warmup, profile)
        except torch.OutOfMemoryError as e:
            run.result["sizes"].pop(size_key(size, micro_batch), None)  # an iteration that fitted, then one not
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



# --- per-call anchors: diffusers' FluxTransformer2DModel beside mm-grpo's FluxTransformer ----------
ANCHOR_COLUMNS = ("forward", "forward_backward")  # no-grad forward; forward + backward to the input
# in the order they run: eager first (the figures that matter most), compiled last
# mm_grpo_base: the frozen bf16 base alone (no adapters), the same work as diffusers' row; mm_grpo: with
# the LoRA adapters the trainer adds, as it runs the model.
ANCHOR_ROWS = ("diffusers_bf16", "mm_grpo_base", "mm_grpo", "mm_grpo_compiled", "diffusers_bf16_compiled")
ANCHOR_RATIOS = {"mm_grpo_base/diffusers_bf16": ("mm_grpo_base", "diffusers_bf16"),
                 "mm_grpo/diffusers_bf16": ("mm_grpo", "diffusers_bf16"),
                 "mm_grpo_compiled/diffusers_bf16_compiled": ("mm_grpo_compiled", "diffusers_bf16_compiled"),
                 "mm_grpo_compiled/diffusers_bf16": ("mm_grpo_compiled", "diffusers_bf16"),
                 "diffusers_bf16_compiled/diffusers_bf16": ("diffusers_bf16_compiled", "diffusers_bf16"),
                 "mm_grpo_compiled/mm_grpo": ("mm_grpo_compiled", "mm_grpo")}


def anchor_ratios(seconds: dict) -> dict:
    """{"a/b": {column: seconds[a][column] / seconds[b][column]}} for every pair both rows have."""
    out = {}
    for key, (a, b) in ANCHOR_RATIOS.items():
        row = {c: seconds[a][c] / seconds[b][c] for c in ANCHOR_COLUMNS
               if c in seconds.get(a, {}) and c in seconds.get(b, {})}
        if row:
            out[key] = row
    return out


@dataclasses.dataclass
class CallInputs:
    """One transformer call's inputs, diffusers' names; the float tensors hold bf16 values (fp32
    storage), so that casting them to bf16 loses nothing and the bf16 paths' error is the model's."""
    hidden_states: torch.Tensor  # [B, S_img, C]
    encoder_hidden_states: torch.Tensor  # [B, L, joint_attention_dim]
    pooled_projections: torch.Tensor  # [B, pooled_projection_dim]
    timestep: torch.Tensor  # [B], sigma in (0, 1]
    img_ids: torch.Tensor  # [S_img, 3]
    txt_ids: torch.Tensor  # [L, 3]
    guidance: object  # [B] or None

    @classmethod
    def make(cls, config, batch: int, height: int, text_tokens: int, device, seed: int = 0) -> "CallInputs":
        from mm_grpo.families.flux.transformer.latents import prepare_latent_image_ids, token_grid
        g = torch.Generator(device="cpu").manual_seed(seed)
        rnd = lambda *shape: torch.randn(*shape, generator=g).bfloat16().float().to(device)  # noqa: E731
        return cls(hidden_states=rnd(batch, num_image_tokens(height, height), config.in_channels),
                   encoder_hidden_states=rnd(batch, text_tokens, config.joint_attention_dim),
                   pooled_projections=rnd(batch, config.pooled_projection_dim),
                   timestep=torch.linspace(1.0, 0.25, batch).bfloat16().float().to(device),
                   img_ids=prepare_latent_image_ids(*token_grid(height, height), device=device),
                   txt_ids=torch.zeros(text_tokens, 3, device=device),
                   guidance=torch.full((batch,), 3.5, device=device) if config.guidance_embeds else None)

    def kwargs(self, dtype=torch.float32, hidden_states=None) -> dict:
        """FluxPipeline passes every float input, the ids too, in the transformer's dtype."""
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        kw = {k: v.to(dtype) if torch.is_tensor(v) else v for k, v in kw.items()}
        if hidden_states is not None:
            kw["hidden_states"] = hidden_states
        return kw


class OnDevice(Mapping):
    """Host tensors as a mapping that hands each one out on the device in fp32 (load_hf_weights'
    input), with `shape_of` so that the names and shapes are checked without copying."""

    def __init__(self, tensors: dict, device):
        self.tensors, self.device = tensors, device

    def __getitem__(self, key):
        return self.tensors[key].to(self.device, torch.float32)

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self):
        return len(self.tensors)

    def shape_of(self, key):
        return tuple(self.tensors[key].shape)


@contextlib.contextmanager
def no_cudnn_attention(device):
    """cuDNN's SDPA backward raises an illegal memory access on diffusers' attention layout under
    torch 2.11 (docs/performance.md): diffusers' grad calls run with it off (flash attention then)."""
    if device.type != "cuda":
        yield
        return
    enabled = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(enabled)


@contextlib.contextmanager
def fp32_matmuls():
    """The fp32 reference in IEEE fp32 (no TF32)."""
    try:
        precision = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
    except RuntimeError as e:  # torch refuses the legacy switch where TF32 was set by the new API
        print(f"[anchors] fp32 matmul precision left as it is: {e}", flush=True)
        precision = None
    try:
        yield
    finally:
        if precision is not None:
            torch.set_float32_matmul_precision(precision)


def velocity_error(v: torch.Tensor, reference: torch.Tensor) -> dict:
    v, reference = v.float(), reference.float()
    diff = v - reference
    return dict(rel_l2=(diff.norm() / reference.norm()).item(),
                max_abs_over_max=(diff.abs().max() / reference.abs().max()).item(),
                finite=bool(torch.isfinite(v).all()), reference_rms=reference.pow(2).mean().sqrt().item())


class Anchors:
    """The anchor step's state: one call's inputs, the device, the results (written after each row)."""

    def __init__(self, args, platform, config, result):
        self.args, self.platform, self.config, self.result = args, platform, config, result
        self.device = platform.device
        self.accelerator = getattr(torch, platform.name) if platform.name != "cpu" else None
        height, batch = args.sizes[0]
        self.inputs = CallInputs.make(config, batch, height, args.text_tokens, self.device, seed=1)
        self.numerics_inputs = (CallInputs.make(config, args.numerics_batch, height, args.text_tokens, self.device,
                                                seed=2) if args.numerics_batch else None)
        g = torch.Generator(device="cpu").manual_seed(3)
        self.grad_output = torch.randn(batch, num_image_tokens(height, height), config.output_channels,
                                       generator=g).to(self.device)

    def save(self):
        self.result["ratios"] = anchor_ratios(self.result["seconds"])
        flops, rate = self.result.get("model_tflop"), self.result.get("matmul_bf16_flops")
        if flops and rate:
            self.result["mfu"] = {row: {c: flops[c] * 1e12 / (t * rate) for c, t in cols.items()}
                                  for row, cols in self.result["seconds"].items()}
        if self.args.json:
            tmp = self.args.json + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.result, f, indent=1, default=float)
            os.replace(tmp, self.args.json)

    def free(self):
        gc.collect()
        if self.accelerator:
            self.accelerator.empty_cache()

    def peak_reset(self):
        if self.accelerator:
            self.accelerator.reset_peak_memory_stats(self.device)

    def time_calls(self, fn, warmup: int) -> dict:
        times = []
        for _ in range(warmup + self.args.anchor_calls):
            self.platform.synchronize()
            start = time.perf_counter()
            fn()
            self.platform.synchronize()
            times.append(time.perf_counter() - start)
        return dict(median=statistics.median(times[warmup:]), warmup=times[:warmup], timed=times[warmup:])

    def row(self, name: str, forward, forward_backward, warmup: int, done=None):
        """Times one row's two columns (each after its `warmup` calls, of which `done[column]` lists
        those made already), records them and saves."""
        seconds = self.result["seconds"].setdefault(name, {})
        for column, fn in (("forward", forward), ("forward_backward", forward_backward)):
            self.peak_reset()
            made = list((done or {}).get(column, []))
            t = self.time_calls(fn, warmup - len(made))
            seconds[column] = t["median"]
            self.result["calls_s"].setdefault(name, {})[column] = dict(warmup=made + t["warmup"], timed=t["timed"])
            self.result["peak_gib"].setdefault(name, {})[column] = self.platform.max_memory_allocated() / 2**30
            print(f"[anchors] {name} {column}: {t['median']:.4f} s (median of {len(t['timed'])}; warm-up "
                  f"{', '.join(f'{w:.2f}' for w in made + t['warmup'])} s)", flush=True)
            self.free()
        self.save()
        print_anchors(self.result)

    def guarded(self, name: str, fn):
        """Runs one part; an error is recorded under its name and the later parts go on."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001: the figures of the other rows stand on their own
            message = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self.result["errors"][name] = message
            print(f"[anchors] {name} failed: {message}", flush=True)
            import traceback
            traceback.print_exc()
            self.save()
        self.free()

    # --- diffusers -----------------------------------------------------------------------------
    def build_diffusers(self):
        """FluxTransformer2DModel at the config's shapes, its random initialisation done on the device
        in bf16, frozen, eval (as FluxPipeline's transformer)."""
        from diffusers import FluxTransformer2DModel
        torch.manual_seed(DIFFUSERS_SEED)
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(self.device):
                model = FluxTransformer2DModel(**self.config.to_diffusers_config())
        finally:
            torch.set_default_dtype(default)
        return model.eval().requires_grad_(False)

    def diffusers_calls(self, model):
        x = self.inputs
        g = self.grad_output.to(torch.bfloat16)

        def forward():
            with torch.no_grad():
                model(**x.kwargs(torch.bfloat16), return_dict=False)

        def forward_backward():
            h = x.hidden_states.to(torch.bfloat16).requires_grad_(True)
            with no_cudnn_attention(self.device):
                out = model(**x.kwargs(torch.bfloat16, hidden_states=h), return_dict=False)[0]
                torch.autograd.grad(out, h, g)
        return forward, forward_backward

    def diffusers_eager(self):
        """Numerics (bf16, then the same weights in fp32), the eager timings, and the weights on the
        host for mm-grpo."""
        start = time.perf_counter()
        model = self.build_diffusers()
        self.platform.synchronize()
        self.result["build_s"]["diffusers"] = time.perf_counter() - start
        self.result["parameters"] = sum(t.numel() for t in model.parameters())
        print(f"[anchors] diffusers: {self.result['parameters'] / 1e9:.2f}B parameters in "
              f"{self.result['build_s']['diffusers']:.1f} s", flush=True)
        self.host_weights = {k: v.to("cpu") for k, v in model.state_dict().items()}  # for mm-grpo
        if self.numerics_inputs is not None:
            n = self.numerics_inputs
            with torch.no_grad():
                v16 = model(**n.kwargs(torch.bfloat16), return_dict=False)[0].float()
                model.float()
                with fp32_matmuls():
                    self.v32 = model(**n.kwargs(torch.float32), return_dict=False)[0].float()
                model.to(torch.bfloat16)  # the weights hold bf16 values: exact
            self.free()
            self.result["bf16_velocity"]["diffusers_bf16"] = velocity_error(v16, self.v32)
            print(f"[anchors] diffusers bf16 vs fp32 velocity: {self.result['bf16_velocity']['diffusers_bf16']}",
                  flush=True)
            self.save()
        model.enable_gradient_checkpointing()
        self.row("diffusers_bf16", *self.diffusers_calls(model), warmup=self.args.anchor_warmup)

    def diffusers_compiled(self):
        """A fresh bf16 model, its repeated blocks compiled (regional compilation: each block kind
        compiles once instead of the whole model) with fullgraph, else without where that fails; the
        first call of each column compiles (its first warm-up)."""
        model = self.build_diffusers()
        model.enable_gradient_checkpointing()
        forward, forward_backward = self.diffusers_calls(model)
        blocks = [*model.transformer_blocks, *model.single_transformer_blocks]

        def compile_and_call(fullgraph: bool) -> dict:
            if fullgraph and hasattr(model, "compile_repeated_blocks") and getattr(model, "_repeated_blocks", None):
                model.compile_repeated_blocks(fullgraph=True)
                how = "compile_repeated_blocks(fullgraph=True)"
            else:  # an older diffusers, or a graph break: each block, as regional compilation does
                for block in blocks:
                    block.compile(fullgraph=fullgraph)
                how = f"block.compile(fullgraph={fullgraph}) of each block"
            self.result["compile"]["diffusers_bf16_compiled"] = dict(how=how, fullgraph=fullgraph)
            made = {}
            for column, fn in (("forward", forward), ("forward_backward", forward_backward)):
                start = time.perf_counter()
                fn()
                self.platform.synchronize()
                made[column] = [time.perf_counter() - start]
            return made

        try:
            made = compile_and_call(fullgraph=True)
        except Exception as e:  # noqa: BLE001: a graph break under fullgraph: compile with breaks
            error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"[anchors] diffusers' fullgraph compile failed ({error}); compiling without fullgraph", flush=True)
            torch._dynamo.reset()
            for block in blocks:
                block._compiled_call_impl = None
            made = compile_and_call(fullgraph=False)
            self.result["compile"]["diffusers_bf16_compiled"]["fullgraph_error"] = error
        self.row("diffusers_bf16_compiled", forward, forward_backward, warmup=self.args.anchor_warmup, done=made)

    # --- mm-grpo -------------------------------------------------------------------------------
    def mm_grpo(self):
        """The trainer's model (build_model_chunks, fp32), diffusers' weights loaded, its fp32 velocity,
        then LoRA as the trainer attaches it under --bf16 (frozen bf16 base) and the eager timings."""
        from mm_grpo.families.flux.transformer import lora
        from mm_grpo.parallel import ParallelConfig, initialize_parallel
        from mm_grpo.families.flux.chunks import build_model_chunks, load_hf_weights_into_chunks
        from mm_grpo.seeding import DEFAULT_SEED
        from mm_grpo.training.trainable import attach_lora
        start = time.perf_counter()
        initialize_parallel(ParallelConfig(), seed=DEFAULT_SEED)
        chunks = [chunk.to(self.device) for chunk in build_model_chunks(self.config)]
        if getattr(self, "host_weights", None) is not None:
            load_hf_weights_into_chunks(chunks, OnDevice(self.host_weights, self.device))
            self.result["same_weights"] = True
        self.host_weights = None
        self.platform.synchronize()
        self.result["build_s"]["mm_grpo"] = time.perf_counter() - start
        (model,) = chunks
        if self.numerics_inputs is not None:
            n = self.numerics_inputs
            model.flux_config = self.config.replace(bf16=False)
            with torch.no_grad(), fp32_matmuls():
                v32 = model(**n.kwargs()).float()
            model.flux_config = self.config
            if getattr(self, "v32", None) is not None and self.result.get("same_weights"):
                self.result["bf16_velocity"]["fp32_mm_grpo_vs_diffusers"] = velocity_error(v32, self.v32)
        self.free()
        if self.config.bf16:  # the base alone, frozen in bf16 as the trainer holds it: diffusers' work
            model.requires_grad_(False)
            lora.freeze_base_in_bf16(model)
            self.free()
            self.row("mm_grpo_base", *self.mm_calls(model), warmup=self.args.anchor_warmup)
        if self.args.lora_rank:
            attach_lora(chunks, lora.LoRAConfig(r=self.args.lora_rank, alpha=self.args.lora_rank), DEFAULT_SEED,
                        self.config.bf16)
        self.free()
        self.result["trainable_parameters"] = sum(t.numel() for t in model.parameters() if t.requires_grad)
        if self.numerics_inputs is not None:
            with torch.no_grad():
                v16 = model(**self.numerics_inputs.kwargs()).float()
            self.result["bf16_velocity"]["mm_grpo"] = velocity_error(v16, v32)
            print(f"[anchors] mm-grpo bf16 vs fp32 velocity: {self.result['bf16_velocity']['mm_grpo']}", flush=True)
            print(f"[anchors] fp32 mm-grpo vs fp32 diffusers: "
                  f"{self.result['bf16_velocity'].get('fp32_mm_grpo_vs_diffusers')}", flush=True)
            del v32
            self.save()
        self.mm_model = model
        self.row("mm_grpo", *self.mm_calls(model), warmup=self.args.anchor_warmup)

    def mm_calls(self, model):
        x = self.inputs

        def forward():
            with torch.no_grad():
                model(**x.kwargs())

        def forward_backward():  # the block inputs kept, each block's forward recomputed (EVERY_BLOCK)
            h = x.hidden_states.clone().requires_grad_(True)
            out = model(**x.kwargs(hidden_states=h))
            torch.autograd.grad(out, h, self.grad_output.to(out.dtype))
        return forward, forward_backward

    def mm_grpo_compiled(self):
        model, self.mm_model = self.mm_model, None
        model.flux_config = self.config.replace(compile_blocks=True)  # what --compile-blocks sets
        model.compile_blocks()
        self.result["compile"]["mm_grpo_compiled"] = dict(how="FluxTransformer with compile_blocks")
        self.row("mm_grpo_compiled", *self.mm_calls(model), warmup=self.args.anchor_warmup)  # the first compiles

    def run(self):
        self.guarded("diffusers_bf16", self.diffusers_eager)
        self.guarded("mm_grpo", self.mm_grpo)
        if self.args.anchor_compile:
            if getattr(self, "mm_model", None) is not None:
                self.guarded("mm_grpo_compiled", self.mm_grpo_compiled)
            self.mm_model = None
            torch._dynamo.reset()  # nothing of mm-grpo's model kept alive by the compiled code's caches
            self.free()
            self.guarded("diffusers_bf16_compiled", self.diffusers_compiled)
        self.save()


def print_anchors(result: dict):
    call = result["call"]
    print(f"one transformer call, {call['batch']} x {call['height']} px ({call['image_tokens']} image + "
          f"{call['text_tokens']} text tokens), median of {result['calls']}, {result['device_name']}:")
    print(f"{'':28s} {'forward s':>12s} {'fwd+bwd s':>12s}")
    for row in ANCHOR_ROWS:
        s = result["seconds"].get(row, {})
        print(f"{row:28s} " + " ".join(f"{s[c]:12.4f}" if c in s else f"{'-':>12s}" for c in ANCHOR_COLUMNS))
    for key, r in anchor_ratios(result["seconds"]).items():
        print(f"{key:44s} " + " ".join(f"{c} {r[c]:.3f}x" for c in ANCHOR_COLUMNS if c in r))
    if result.get("bf16_velocity"):
        print("bf16 velocity vs fp32 (rel. L2):", {k: v["rel_l2"] for k, v in result["bf16_velocity"].items()})
    if result.get("errors"):
        print("errors:", result["errors"])
    sys.stdout.flush()


def run_anchors(args, platform, config) -> dict:
    import diffusers
    import megatron.core
    height, batch = args.sizes[0]
    result = dict(mode="anchors", model=args.model, depth=args.depth, lora_rank=args.lora_rank,
                  device=str(platform.device),
                  device_name=torch.cuda.get_device_name() if platform.name == "cuda" else platform.name,
                  torch=torch.__version__, diffusers=diffusers.__version__, megatron_core=megatron.core.__version__,
                  call=dict(batch=batch, height=height, width=height, image_tokens=num_image_tokens(height, height),
                            text_tokens=args.text_tokens),
                  warmup=args.anchor_warmup, calls=args.anchor_calls, numerics_batch=args.numerics_batch,
                  compile_backend=args.compile_backend or "inductor",
                  same_weights=False, seconds={}, calls_s={}, peak_gib={}, compile={}, build_s={}, bf16_velocity={},
                  errors={})
    # the same work for both models: the base model's FLOPs (LoRA's count against mm-grpo); the
    # backward to the input: the token linears' input gradients and attention's, no weight gradient
    one = flux_flops(config, args.text_tokens, result["call"]["image_tokens"])
    result["model_tflop"] = dict(forward=batch * one.forward / 1e12,
                                 forward_backward=batch * (one.forward + one.lora_backward) / 1e12)
    if platform.name != "cpu":
        rates = [matmul_throughput(platform.device, torch.bfloat16, MATMUL_SIZE)[0] for _ in range(3)]
        result["matmul_bf16_flops"] = statistics.median(rates)
    anchors = Anchors(args, platform, config, result)
    anchors.save()
    anchors.run()
    print_anchors(result)
    return result


def use_compile_backend(backend: str):
    """Every torch.compile (nn.Module.compile calls it: mm-grpo's compiled blocks, diffusers'
    compile_repeated_blocks) with `backend` unless the call names one."""
    original = torch.compile

    def compile(*args, **kwargs):
        kwargs.setdefault("backend", backend)
        return original(*args, **kwargs)
    torch.compile = compile


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
    p.add_argument("--anchors", action="store_true",
                   help="time one transformer call (the first of --sizes as side:batch), diffusers' bf16 model "
                        "beside mm-grpo's, eager and compiled, instead of GRPO iterations")
    p.add_argument("--anchor-calls", type=int, default=4, help="timed calls per figure (their median)")
    p.add_argument("--anchor-warmup", type=int, default=1,
                   help="untimed calls first (compiled rows: the first of them compiles)")
    p.add_argument("--no-anchor-compile", dest="anchor_compile", action="store_false",
                   help="the eager rows only")
    p.add_argument("--numerics-batch", type=int, default=2,
                   help="--anchors: samples of the bf16 velocity's error against fp32 (0: none)")
    p.add_argument("--compile-backend", default=None,
                   help="torch.compile's backend wherever the call names none (default inductor); 'eager': "
                        "dynamo's capture alone, fullgraph checks included, in a CPU test's seconds")
    p.add_argument("--workdir", default="/tmp/mm_grpo_full_size")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import mm_grpo
    from mm_grpo.families.flux.transformer import FluxConfig
    platform = mm_grpo.get_platform()
    if args.compile_backend:
        use_compile_backend(args.compile_backend)
    depth = dict(num_layers=args.depth[0], num_single_layers=args.depth[1]) if args.depth else {}
    if args.anchors:
        config = FluxConfig.preset(args.model, bf16=not args.no_bf16, **recompute_fields(None if args.no_recompute else EVERY_BLOCK), **depth)
        run_anchors(args, platform, config)
        return
    config = FluxConfig.preset(args.model, bf16=not args.no_bf16, **recompute_fields(None if args.no_recompute else EVERY_BLOCK),
                               compile_blocks=args.compile, **depth)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    paths = write_frozen_parts(config, args.text_tokens, workdir, tiny_vae=config.in_channels != 64)
    result = dict(model=args.model, depth=args.depth, lora_rank=args.lora_rank, compile=args.compile,
                  text_tokens=args.text_tokens, num_generations=args.num_generations,
                  num_inference_steps=args.num_inference_steps, device=str(platform.device),
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
