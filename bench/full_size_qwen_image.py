"""Qwen-Image at its real shapes on one accelerator: one transformer call of diffusers beside mm-grpo,
and a GRPO iteration of the trainer (LoRA, G 12, 512 px, true CFG) with its phases, peak memory and
`mm-grpo plan`'s prediction of the same job.

    python -m bench.full_size_qwen_image anchors --model qwen-image --json anchors.json
    python -m bench.full_size_qwen_image grpo --model qwen-image --json grpo.json
    python -m bench.full_size_qwen_image anchors --model qwen-image-tiny --compile-backend eager --json a.json

Nothing is downloaded; every weight is random.

`anchors`: one call at the rollout's batch (`--batch` samples of `--height` px, `--text-tokens` prompt
features), timed for diffusers' `QwenImageTransformer2DModel` (as QwenImagePipeline runs it) and for
mm-grpo's `QwenImageTransformer` as the trainer builds it: the frozen base alone, then with LoRA
(`attach_lora`), each eager and compiled (diffusers' regional compilation
`compile_repeated_blocks(fullgraph=True)`, mm-grpo's blocks compiled one by one: Qwen-Image has no
`--compile-blocks`), no-grad forward and forward + backward to the input (per-block recompute, the
weights frozen), median of `--calls` after one warm-up (a compiled row's warm-up is the call that
compiles). bf16 on an accelerator, fp32 on the CPU. Both models hold the same weights (diffusers'
model's, loaded into mm-grpo by `load_hf_weights`), so the fp32 velocities of the two agree, and on an
accelerator each bf16 velocity is compared with fp32's.

`grpo`: the trainer's own functions (training/components.grpo_schedule, trainable.attach_lora and
optimize, train_grpo.grpo_iteration) on mm-grpo's transformer with Megatron's random initialisation
(no diffusers folder: 20B parameters written to disk and read back would time the disk), LoRA on
`lora.RECOMMENDED_TARGETS`, true CFG, one warm-up and `--iters` timed iterations. The text encoder is
replaced by a precomputed feature cache of random vectors at the transformer's text width (3584,
Qwen2.5-VL-7B's) in `text.save_text_embeddings`' format, the negative prompt included: Qwen2.5-VL-7B
is not needed to time the transformer, and the trainer reads such a cache (`embeddings_cache`) just
the same. The VAE is AutoencoderKLQwenImage at Qwen/Qwen-Image's config (diffusers' defaults), random;
the reward needs no model. Figures are written to `--json` as they are measured.
"""
import argparse
import dataclasses
import functools
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.full_size import (OnDevice, finite, fp32_matmuls, no_cudnn_attention, numbers, plan_device,
                             timed_iteration, use_compile_backend, velocity_error)
from bench.grpo_setup import PROMPTS, Preset, optimizer_args
from mm_grpo.families.qwen_image.denoiser import NEGATIVE_PROMPT, TRUE_CFG_SCALE, token_grid
from mm_grpo.families.qwen_image.plan import TEXT_TOKENS
from mm_grpo.families.qwen_image.transformer.config import QwenImageConfig
from mm_grpo.recompute import EVERY_BLOCK, recompute_fields


@dataclasses.dataclass(frozen=True)
class Size:
    """One model size's job: the transformer, the image, the group, LoRA and the VAE."""
    config: QwenImageConfig
    height: int
    batch: int  # the anchors' call, and G of the GRPO iteration (one prompt per iteration)
    text_tokens: int
    lora_rank: int
    num_inference_steps: int
    vae: dict  # AutoencoderKLQwenImage's arguments
    init_std: float = None  # the anchors' weights drawn N(0, std^2); None: diffusers' initialisation


def sizes():
    from mm_grpo.families.qwen_image import tiny
    return {
        # Qwen/Qwen-Image (20B) at issue's job: 512 px, G = 12 in one micro-batch, LoRA 64, a detailed
        # prompt's features (plan.TEXT_TOKENS); N = 16 as FLUX's full-size run.
        "qwen-image": Size(QwenImageConfig.preset("qwen-image"), height=512, batch=12, text_tokens=TEXT_TOKENS,
                           lora_rank=64, num_inference_steps=16, vae={}),
        # The tiny pipeline's transformer and VAE (Qwen-Image's 16 latent channels), 32 px: seconds on CPU;
        # its weights as tiny.py draws them, no zero-initialised gate hiding the text.
        "qwen-image-tiny": Size(tiny.TRANSFORMER, height=32, batch=4, text_tokens=8, lora_rank=4,
                                num_inference_steps=4, vae=tiny.VAE_CONFIG, init_std=tiny.TRANSFORMER_INIT_STD),
    }


REWARD = "jpeg_compressibility"  # no model: the figures are the transformer's and the VAE's
LR = 1e-5  # the timing does not depend on it
DIFFUSERS_SEED = 0  # the anchors' random weights, shared by both models
INPUT_SEEDS = dict(timed=1, numerics=2, grad_output=3)
NUMERICS_BATCH = 2  # samples of the velocity comparisons

# --- anchors: one call of diffusers' QwenImageTransformer2DModel beside mm-grpo's QwenImageTransformer -
COLUMNS = ("forward", "forward_backward")  # no-grad forward; forward + backward to the input
# In the order they run, one model on the device at a time. mm_grpo_base: the frozen base alone, the
# same work as diffusers'; mm_grpo_lora: with the adapters the trainer adds.
ROWS = ("diffusers", "mm_grpo_base", "mm_grpo_lora", "mm_grpo_lora_compiled", "diffusers_compiled")
RATIOS = {"mm_grpo_base/diffusers": ("mm_grpo_base", "diffusers"),
          "mm_grpo_lora/diffusers": ("mm_grpo_lora", "diffusers"),
          "mm_grpo_lora_compiled/diffusers_compiled": ("mm_grpo_lora_compiled", "diffusers_compiled"),
          "diffusers_compiled/diffusers": ("diffusers_compiled", "diffusers"),
          "mm_grpo_lora_compiled/mm_grpo_lora": ("mm_grpo_lora_compiled", "mm_grpo_lora")}


def ratios(seconds: dict) -> dict:
    """{"a/b": {column: seconds[a][column] / seconds[b][column]}} for every pair both rows have."""
    out = {}
    for key, (a, b) in RATIOS.items():
        row = {c: seconds[a][c] / seconds[b][c] for c in COLUMNS if c in seconds.get(a, {}) and c in seconds.get(b, {})}
        if row:
            out[key] = row
    return out


def call_inputs(config: QwenImageConfig, batch: int, height: int, text_tokens: int, device, seed: int) -> dict:
    """QwenImageTransformer2DModel.forward's inputs for `batch` images of `height` px: every prompt whole
    (no mask), sigma in (0, 1]; the floats hold bf16 values so that casting them loses nothing."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g).bfloat16().float().to(device)  # noqa: E731
    rows, columns = token_grid(height, height)
    return dict(hidden_states=rnd(batch, rows * columns, config.in_channels),
                encoder_hidden_states=rnd(batch, text_tokens, config.joint_attention_dim),
                encoder_hidden_states_mask=None,
                timestep=torch.linspace(1.0, 0.25, batch).bfloat16().float().to(device),
                img_shapes=[[(1, rows, columns)]] * batch)


def cast(inputs: dict, dtype, hidden_states=None) -> dict:
    out = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
    if hidden_states is not None:
        out["hidden_states"] = hidden_states
    return out


def compile_each(blocks, fullgraph: bool) -> str:
    for block in blocks:
        block.compile(fullgraph=fullgraph)
    return f"block.compile(fullgraph={fullgraph}) of each block"


def uncompile(blocks):
    torch._dynamo.reset()
    for block in blocks:
        block._compiled_call_impl = None


class Anchors:
    """The anchor step's state: the inputs, the device, the results (written after each row)."""

    def __init__(self, args, platform, size: Size, result: dict):
        self.args, self.platform, self.size, self.result = args, platform, size, result
        self.device = platform.device
        self.bf16 = platform.name != "cpu"
        self.dtype = torch.bfloat16 if self.bf16 else torch.float32
        self.config = size.config.replace(bf16=self.bf16, **recompute_fields(EVERY_BLOCK))
        self.inputs = call_inputs(self.config, size.batch, size.height, size.text_tokens, self.device,
                                  INPUT_SEEDS["timed"])
        self.numerics = call_inputs(self.config, NUMERICS_BATCH, size.height, size.text_tokens, self.device,
                                    INPUT_SEEDS["numerics"])
        g = torch.Generator().manual_seed(INPUT_SEEDS["grad_output"])
        self.grad_output = torch.randn(*self.inputs["hidden_states"].shape[:2], self.config.output_channels,
                                       generator=g).to(self.device)
        self.accelerator = getattr(torch, platform.name) if platform.name != "cpu" else None
        self.host_weights = self.mm_model = self.v32 = None

    def save(self):
        self.result["ratios"] = ratios(self.result["seconds"])
        write_json(self.args.json, self.result)

    def free(self):
        gc.collect()
        if self.accelerator:
            self.accelerator.empty_cache()

    def time_calls(self, fn, warmup: int) -> dict:
        times = []
        for _ in range(warmup + self.args.calls):
            self.platform.synchronize()
            start = time.perf_counter()
            fn()
            self.platform.synchronize()
            times.append(time.perf_counter() - start)
        return dict(median=statistics.median(times[warmup:]), warmup=times[:warmup], timed=times[warmup:])

    def row(self, name: str, forward, forward_backward):
        """Both columns of one row, each after one warm-up call (a compiled row's compiles)."""
        for column, fn in (("forward", forward), ("forward_backward", forward_backward)):
            if self.accelerator:
                self.accelerator.reset_peak_memory_stats(self.device)
            t = self.time_calls(fn, warmup=1)
            self.result["seconds"].setdefault(name, {})[column] = t["median"]
            self.result["calls_s"].setdefault(name, {})[column] = dict(warmup=t["warmup"], timed=t["timed"])
            self.result["peak_gib"].setdefault(name, {})[column] = self.platform.max_memory_allocated() / 2**30
            print(f"[anchors] {name} {column}: {t['median']:.4f} s (median of {len(t['timed'])}; warm-up "
                  f"{t['warmup'][0]:.2f} s)", flush=True)
            self.free()
        self.save()

    def guarded(self, name: str, fn):
        """Runs one part; an error is recorded under its name and the later parts go on."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001: the other rows' figures stand on their own
            self.result["errors"][name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"[anchors] {name} failed: {self.result['errors'][name]}", flush=True)
            import traceback
            traceback.print_exc()
            self.save()
        self.free()

    # --- diffusers -------------------------------------------------------------------------------
    def build_diffusers(self):
        """QwenImageTransformer2DModel at the config's shapes, initialised on the device in the compute
        dtype, frozen, eval (as QwenImagePipeline's transformer)."""
        from diffusers import QwenImageTransformer2DModel
        torch.manual_seed(DIFFUSERS_SEED)
        default = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = QwenImageTransformer2DModel(**self.config.to_diffusers_config())
                if self.size.init_std is not None:
                    with torch.no_grad():
                        for p in model.parameters():
                            p.normal_(0, self.size.init_std)
        finally:
            torch.set_default_dtype(default)
        return model.eval().requires_grad_(False)

    def diffusers_calls(self, model):
        g = self.grad_output.to(self.dtype)

        def forward():
            with torch.no_grad():
                model(**cast(self.inputs, self.dtype), return_dict=False)

        def forward_backward():
            h = self.inputs["hidden_states"].to(self.dtype).requires_grad_(True)
            with no_cudnn_attention(self.device):
                out = model(**cast(self.inputs, self.dtype, hidden_states=h), return_dict=False)[0]
                torch.autograd.grad(out, h, g)
        return forward, forward_backward

    def diffusers_eager(self):
        """The velocity in the compute dtype and in fp32 of the same weights, the eager timings, and
        the weights on the host for mm-grpo."""
        start = time.perf_counter()
        model = self.build_diffusers()
        self.platform.synchronize()
        self.result["build_s"]["diffusers"] = time.perf_counter() - start
        self.result["parameters"] = sum(t.numel() for t in model.parameters())
        print(f"[anchors] diffusers: {self.result['parameters'] / 1e9:.2f}B parameters", flush=True)
        self.host_weights = {k: v.to("cpu") for k, v in model.state_dict().items()}
        with torch.no_grad():
            if self.bf16:
                v16 = model(**cast(self.numerics, torch.bfloat16), return_dict=False)[0].float()
                model.float()
            with fp32_matmuls():
                self.v32 = model(**cast(self.numerics, torch.float32), return_dict=False)[0].float()
            model.to(self.dtype)  # the weights hold values of the compute dtype: exact
        if self.bf16:
            self.result["velocity"]["diffusers_bf16_vs_fp32"] = velocity_error(v16, self.v32)
        self.save()
        model.enable_gradient_checkpointing()
        self.row("diffusers", *self.diffusers_calls(model))

    def diffusers_compiled(self):
        """A fresh model, its repeated blocks compiled with fullgraph (each block kind compiles once),
        without fullgraph where that fails."""
        model = self.build_diffusers()
        model.enable_gradient_checkpointing()
        try:
            model.compile_repeated_blocks(fullgraph=True)
            self.row("diffusers_compiled", *self.diffusers_calls(model))
            how = dict(how="compile_repeated_blocks(fullgraph=True)", fullgraph=True)
        except Exception as e:  # noqa: BLE001: a graph break under fullgraph: compile with breaks
            error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"[anchors] diffusers' fullgraph compile failed ({error}); compiling without fullgraph", flush=True)
            uncompile(model.transformer_blocks)
            how = dict(how=compile_each(model.transformer_blocks, fullgraph=False), fullgraph=False,
                       fullgraph_error=error)
            self.row("diffusers_compiled", *self.diffusers_calls(model))
        self.result["compile"]["diffusers_compiled"] = how
        self.save()

    # --- mm-grpo ---------------------------------------------------------------------------------
    def mm_grpo(self):
        """The trainer's model (build_model_chunks, fp32 weights), diffusers' weights loaded, its fp32
        velocity; the frozen base (bf16 where the compute is) timed; then LoRA as the trainer attaches
        it, its velocity and its timings."""
        from mm_grpo.families.qwen_image.chunks import load_hf_weights_into_chunks
        from mm_grpo.families.qwen_image.family import FAMILY
        from mm_grpo.parallel import ParallelConfig, initialize_parallel
        from mm_grpo.seeding import DEFAULT_SEED
        from mm_grpo.training.trainable import attach_lora
        start = time.perf_counter()
        initialize_parallel(ParallelConfig(), seed=DEFAULT_SEED)
        with torch.device(self.device):  # 20B in fp32 beside the host copy would not fit the host
            chunks = FAMILY.build_model_chunks(self.config)
        load_hf_weights_into_chunks(chunks, OnDevice(self.host_weights, self.device))
        self.host_weights = None
        self.platform.synchronize()
        self.result["build_s"]["mm_grpo"] = time.perf_counter() - start
        (model,) = chunks
        model.qwen_config = self.config.replace(bf16=False)
        with torch.no_grad(), fp32_matmuls():
            v32 = model(**self.numerics).float()
        model.qwen_config = self.config
        self.result["velocity"]["mm_grpo_vs_diffusers_fp32"] = velocity_error(v32, self.v32)
        print(f"[anchors] fp32 mm-grpo vs fp32 diffusers: {self.result['velocity']['mm_grpo_vs_diffusers_fp32']}",
              flush=True)
        self.save()
        model.requires_grad_(False)
        if self.bf16:  # the frozen base as the trainer holds it under --bf16
            FAMILY.lora.freeze_base_in_bf16(model)
        self.free()
        self.row("mm_grpo_base", *self.mm_calls(model))
        attach_lora(chunks, FAMILY.lora.LoRAConfig(r=self.size.lora_rank, alpha=self.size.lora_rank), DEFAULT_SEED,
                    self.bf16, family=FAMILY)
        self.result["trainable_parameters"] = sum(t.numel() for t in model.parameters() if t.requires_grad)
        with torch.no_grad():
            v = model(**self.numerics).float()
        # LoRA's B starts at zero: the adapters leave the velocity as the base's
        self.result["velocity"]["mm_grpo_lora_vs_fp32"] = velocity_error(v, v32)
        del v, v32
        self.save()
        self.mm_model = model
        self.row("mm_grpo_lora", *self.mm_calls(model))

    def mm_calls(self, model):
        def forward():
            with torch.no_grad():
                model(**self.inputs)

        def forward_backward():  # the block inputs kept, each block's forward recomputed (EVERY_BLOCK)
            h = self.inputs["hidden_states"].clone().requires_grad_(True)
            out = model(**dict(self.inputs, hidden_states=h))
            torch.autograd.grad(out, h, self.grad_output.to(out.dtype))
        return forward, forward_backward

    def mm_grpo_compiled(self):
        """The LoRA model's blocks compiled one by one (regional, as diffusers'), fullgraph where it holds."""
        model, self.mm_model = self.mm_model, None
        try:
            how = dict(how=compile_each(model.blocks, fullgraph=True), fullgraph=True)
            self.row("mm_grpo_lora_compiled", *self.mm_calls(model))
        except Exception as e:  # noqa: BLE001: a graph break under fullgraph: compile with breaks
            error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"[anchors] mm-grpo's fullgraph compile failed ({error}); compiling without fullgraph", flush=True)
            uncompile(model.blocks)
            how = dict(how=compile_each(model.blocks, fullgraph=False), fullgraph=False, fullgraph_error=error)
            self.row("mm_grpo_lora_compiled", *self.mm_calls(model))
        self.result["compile"]["mm_grpo_lora_compiled"] = how
        self.save()

    def run(self):
        self.guarded("diffusers", self.diffusers_eager)
        if self.host_weights is not None:
            self.guarded("mm_grpo", self.mm_grpo)
        self.v32 = None
        if self.args.compile:
            if self.mm_model is not None:
                self.guarded("mm_grpo_lora_compiled", self.mm_grpo_compiled)
            self.mm_model = None
            torch._dynamo.reset()  # nothing of mm-grpo's model kept alive by the compiled code's caches
            self.free()
            self.guarded("diffusers_compiled", self.diffusers_compiled)
        self.save()


def run_anchors(args, platform, size: Size) -> dict:
    import diffusers
    rows, columns = token_grid(size.height, size.height)
    result = dict(step="anchors", model=args.model, device=str(platform.device), device_name=device_name(platform),
                  torch=torch.__version__, diffusers=diffusers.__version__,
                  dtype="bf16" if platform.name != "cpu" else "fp32", lora_rank=size.lora_rank,
                  call=dict(batch=size.batch, height=size.height, width=size.height, image_tokens=rows * columns,
                            text_tokens=size.text_tokens),
                  calls=args.calls, compile_backend=args.compile_backend or "inductor",
                  seconds={}, calls_s={}, peak_gib={}, compile={}, build_s={}, velocity={}, errors={})
    if not args.compile:
        result["unmeasured"] = ["the compiled rows (--no-compile)"]
    anchors = Anchors(args, platform, size, result)
    anchors.save()
    anchors.run()
    print(json.dumps({k: result[k] for k in ("seconds", "ratios", "velocity", "errors")}, indent=1, default=float))
    return result


# --- grpo: the trainer's iteration -------------------------------------------------------------------
def write_frozen_parts(config: QwenImageConfig, size: Size, workdir: Path) -> dict:
    """A pipeline folder holding only vae/ (random weights) and a feature cache of random vectors at the
    transformer's text width, one row of `text_tokens` per prompt and for the negative prompt; the
    transformer's config.json, which `mm-grpo plan` reads."""
    from diffusers import AutoencoderKLQwenImage

    from mm_grpo.families.qwen_image.text import save_text_embeddings
    tag = f"{config.num_layers}x{config.hidden_size}"
    pipeline = workdir / f"pipeline_{tag}"
    if not (pipeline / "vae" / "config.json").is_file():
        torch.manual_seed(0)
        AutoencoderKLQwenImage(**size.vae).save_pretrained(pipeline / "vae")
    transformer = pipeline / "transformer"
    transformer.mkdir(parents=True, exist_ok=True)
    (transformer / "config.json").write_text(json.dumps(dict(_class_name="QwenImageTransformer2DModel",
                                                             **config.to_diffusers_config())))
    cache = workdir / f"text_{config.joint_attention_dim}x{size.text_tokens}.safetensors"
    if not cache.is_file():
        class RandomText:  # what QwenImageTextEncoder.encode returns: features, no mask (none padded)
            def encode(self, prompts):
                g = torch.Generator().manual_seed(len(prompts))
                return torch.randn(len(prompts), size.text_tokens, config.joint_attention_dim, generator=g), None
        save_text_embeddings(RandomText(), [*PROMPTS, NEGATIVE_PROMPT], cache)
    return dict(pipeline=str(pipeline), transformer=str(transformer), cache=str(cache))


def planned(size: Size, transformer_dir: str, platform) -> dict:
    """`mm-grpo plan`'s row for this job on one card (TP = PP = SP = 1)."""
    import contextlib
    import io

    from mm_grpo.families.qwen_image.plan_cli import build_parser, plan
    argv = ["--model", transformer_dir, "--height", str(size.height), "--micro-batch-size", str(size.batch),
            "--num-generations", str(size.batch), "--prompts-per-iteration", "1",
            "--num-inference-steps", str(size.num_inference_steps), "--lora-rank", str(size.lora_rank),
            "--text-tokens", str(size.text_tokens), "--true-cfg-scale", str(TRUE_CFG_SCALE), "--reward", REWARD,
            "--devices", "1", "--device", plan_device(platform), "--tp", "1", "--pp", "1", "--sp", "1", "--recompute"]
    with contextlib.redirect_stdout(io.StringIO()):
        rows = plan(build_parser().parse_args(argv))[3]
    return dict(rows[0], argv=argv)


def run_grpo(args, platform, size: Size) -> dict:
    from mm_grpo.families.qwen_image import predictor_block
    from mm_grpo.families.qwen_image.denoiser import QwenImageGuidance
    from mm_grpo.families.qwen_image.family import FAMILY
    from mm_grpo.parallel import ParallelConfig, initialize_parallel
    from mm_grpo.seeding import DEFAULT_SEED
    from mm_grpo.training import components
    from mm_grpo.training.train_grpo import grpo_iteration
    from mm_grpo.training.trainable import attach_lora, optimize
    bf16 = platform.name != "cpu"
    config = size.config.replace(bf16=bf16, **recompute_fields(EVERY_BLOCK))
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    paths = write_frozen_parts(config, size, workdir)
    result = dict(step="grpo", model=args.model, device=str(platform.device), device_name=device_name(platform),
                  torch=torch.__version__, dtype="bf16" if bf16 else "fp32", height=size.height,
                  num_generations=size.batch, micro_batch=size.batch, lora_rank=size.lora_rank,
                  lora_targets=list(FAMILY.lora.RECOMMENDED_TARGETS), true_cfg_scale=TRUE_CFG_SCALE,
                  text_tokens=size.text_tokens, num_inference_steps=size.num_inference_steps,
                  text="random feature cache (text.save_text_embeddings format), Qwen2.5-VL not run",
                  weights="Megatron's random initialisation", iterations=[])
    start = time.perf_counter()
    initialize_parallel(ParallelConfig(), seed=DEFAULT_SEED)
    with torch.device(platform.device):  # initialised on the device: no 80 GB fp32 copy on the host
        chunks = FAMILY.build_model_chunks(config)
    platform.synchronize()
    result.update(build_s=time.perf_counter() - start, parameters=sum(t.numel() for t in chunks[0].parameters()))
    attach_lora(chunks, FAMILY.lora.LoRAConfig(r=size.lora_rank, alpha=size.lora_rank), DEFAULT_SEED, bf16,
                family=FAMILY)
    if platform.name != "cpu":  # the fp32 copies are gone: reserved memory as the run needs it
        getattr(torch, platform.name).empty_cache()
    result["trainable_parameters"] = sum(t.numel() for t in chunks[0].parameters() if t.requires_grad)
    policy, optimizer, scheduler = optimize(chunks, optimizer_args(LR))
    model_cfg = {"predictor": {"model_id": predictor_block.MODEL_ID},
                 "text_encoder": {"embeddings_cache": paths["cache"]}, "ae": {"from_pretrained": paths["pipeline"]},
                 "reward": [{"name": REWARD}]}
    preset = Preset(f"{args.model}-{size.height}", None, size.height, size.height, size.text_tokens, size.batch, 1,
                    size.num_inference_steps, size.batch, bf16=bf16, recompute=True)
    reward = components.grpo_reward(model_cfg, PROMPTS, platform.device)
    schedule = components.grpo_schedule(preset.settings(), chunks, model_cfg, reward, platform.device, preset.dtype,
                                        QwenImageGuidance(true_cfg_scale=TRUE_CFG_SCALE), parts=FAMILY.parts)
    step = functools.partial(grpo_iteration, schedule, policy, optimizer, scheduler,
                             forward_backward=functools.partial(FAMILY.forward_backward, denoiser=schedule.denoiser))
    write_json(args.json, result)
    for iteration in range(1 + args.iters):  # the first warms up
        r = timed_iteration(step, iteration, platform)
        result["iterations"].append(numbers(r))
        print(f"[grpo] iteration {iteration}: {r['time_total']:.1f} s (rollout {r['time_rollout']:.1f}, decode+reward "
              f"{r['time_reward']:.1f}, train {r['time_train']:.1f}), peak {r['peak_allocated'] / 2**30:.2f} GiB, "
              f"ratio first mb [{r.get('ratio_first_mb_min', math.nan):.6f}, "
              f"{r.get('ratio_first_mb_max', math.nan):.6f}], finite {finite(r)}", flush=True)
        write_json(args.json, result)  # a step stopped at its bound keeps the iterations it ran
    timed = result["iterations"][1:]
    med = lambda key: statistics.median(r[key] for r in timed)  # noqa: E731
    result["timed"] = dict(iteration=med("time_total"), rollout=med("time_rollout"), decode_reward=med("time_reward"),
                           train=med("time_train"), images_per_s=size.batch / med("time_total"),
                           all_finite=all(finite(r) for r in result["iterations"]))
    try:
        result["plan"] = planned(size, paths["transformer"], platform)
    except ImportError as e:
        result["plan"] = f"unavailable: {e}"
    if platform.name != "cpu":
        peak = max(r["peak_allocated"] for r in timed)
        result["timed"].update(peak_allocated_gib=peak / 2**30,
                               peak_reserved_gib=max(r["peak_reserved"] for r in timed) / 2**30)
        if isinstance(result["plan"], dict):
            result["timed"]["peak_over_plan"] = peak / result["plan"]["peak_bytes_per_rank"]
    else:  # the iterations' peak_allocated is then the process's peak RSS, host memory of another kind
        result["unmeasured"] = ["peak device memory and its ratio to the plan (no accelerator)",
                                "the plan's seconds against a device (the plan is of an H100's)"]
    write_json(args.json, result)
    plan = result["plan"] if isinstance(result["plan"], dict) else {}
    print(f"[grpo] timed: {result['timed']}; plan: peak {(plan.get('peak_bytes_per_rank') or math.nan) / 2**30:.1f} "
          f"GiB, {plan.get('seconds_per_iteration') or math.nan:.1f} s", flush=True)
    return result


def device_name(platform) -> str:
    return torch.cuda.get_device_name() if platform.name == "cuda" else platform.name


def write_json(path, result: dict):
    if path:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1, default=float)
        os.replace(tmp, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", choices=("anchors", "grpo"))
    p.add_argument("--model", default="qwen-image", choices=("qwen-image", "qwen-image-tiny"))
    p.add_argument("--calls", type=int, default=4, help="anchors: timed calls per figure (their median)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="anchors: the eager rows only")
    p.add_argument("--compile-backend", default=None,
                   help="torch.compile's backend wherever the call names none (default inductor); 'eager': "
                        "dynamo's capture alone, fullgraph checks included, in a CPU test's seconds")
    p.add_argument("--iters", type=int, default=1, help="grpo: timed iterations (after one warm-up)")
    p.add_argument("--workdir", default="/tmp/mm_grpo_full_size_qwen_image")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import mm_grpo
    platform = mm_grpo.get_platform()
    if args.compile_backend:
        use_compile_backend(args.compile_backend)
    size = sizes()[args.model]
    (run_anchors if args.step == "anchors" else run_grpo)(args, platform, size)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
