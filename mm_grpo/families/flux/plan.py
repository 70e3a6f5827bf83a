"""Per-rank memory and seconds per iteration of a GRPO run of FLUX under TP x PP x SP x DP.

Every term is a named function below with its source: counted by hand from mm-grpo's code
(the file it follows is named), Megatron-LM's own estimate (megatron/training/
theoretical_memory_usage.py, "Megatron" below), or a measured constant (named where defined).
Units: bytes and seconds. Notation: D hidden size, F MLP width (4D), d head dim, H heads, S = T + I
tokens (T text, I image), C latent channels of the transformer, B samples per data-parallel rank,
m micro-batch size, N denoising steps, K trained steps per sample, tp/pp/sp/dp the layout, c the
bytes of one value in the compute dtype (`activation_bytes`: 2 under --bf16).

What the trainer holds (mm_grpo/training/optim.py, trainable.py, grpo/schedule.py):
- parameters in fp32 (params_dtype fp32; under `--bf16` the model computes in bf16 and casts a
  trainable fp32 weight to bf16 for each call, mm_grpo/layers.py `linear`) or bf16 (Megatron's
  --bf16 with fp32 master weights: `param_dtype="bf16"`, not mm-grpo's trainer today);
- main gradients in fp32 (DDP `grad_reduce_in_fp32=True`), a full buffer on every rank;
- Adam's two moments in fp32 (+ fp32 master weights for bf16 parameters), sharded over the
  data-parallel x context-parallel group by the distributed optimizer;
- the KL reference (`--kl-beta > 0`): a second, frozen copy of the policy's chunks;
- LoRA (families/flux/transformer/lora.py; rank r on the attention and MLP linears of every block, the
  recommended --lora-target-modules; base frozen: no main gradients or optimizer states for it;
  the KL reference is the base with adapters off, no copy; with --bf16 the frozen base in bf16,
  matrices and biases, `lora.freeze_base_in_bf16`). Frozen weights also change what autograd
  saves (`block_activation_bytes`).

The time model (`iteration_time`): each phase's FLOPs at a per-phase, per-path (eager or compiled
blocks) fraction of the device's measured bf16 matmul rate, derived from measured full-size
iterations (mm_grpo/families/flux/calibration.py, docs/scaling.md), plus communication at the device
profile's bandwidths.
"""
import dataclasses
import functools
import json
import os
from typing import Dict, List, Optional

from mm_grpo.families.flux.transformer.config import FluxConfig
from mm_grpo.families.flux.transformer.latents import num_image_tokens
from mm_grpo.plan.formulas import (GRPOJob, IterationTime, Layout, LayoutMemory, RankMemory, bandwidth, dtype_bytes,
                                   kl_reference_bytes, main_grad_bytes, optimizer_bytes, phase_memory, reward_bytes,
                                   trainable_params)
from mm_grpo.plan.frozen_parts import Components, reward_params, safetensors_params
from mm_grpo.settings import setting

TIME_CHANNELS = 256  # sinusoid width of the timestep / guidance embedders (families/flux/transformer/embeddings.py)


@dataclasses.dataclass(frozen=True)
class Job(GRPOJob):
    """FLUX text-to-image: GRPOJob and the image's size and compute dtype."""
    height: int = setting(1024, "image height", minimum=1)
    width: Optional[int] = setting(None, "image width (default: --height)")
    bf16: bool = setting(True, "bf16 compute: activations, the residual stream and every GEMM's output in bf16 "
                               "(families/flux/transformer/model.py compute_dtype)")
    compile_blocks: bool = setting(False, "torch.compile'd blocks, the trainer's --compile-blocks: the compiled "
                                          "path's time calibration (no effect on a device whose runtime does not "
                                          "compile: Ascend, where MindSpeed's adaptor makes torch.compile a no-op)")

    def __post_init__(self):
        if self.width is None:
            object.__setattr__(self, "width", self.height)

    @property
    def image_tokens(self) -> int:
        return num_image_tokens(self.height, self.width)


def check_layout(config: FluxConfig, job: Job, layout: Layout):
    """Why a layout cannot run at all (None if it can): the trainer's own checks, as one line."""
    if config.num_attention_heads % (layout.tp * layout.sp):
        return f"{config.num_attention_heads} heads do not split over TP x SP = {layout.tp * layout.sp}"
    if config.num_blocks < layout.pp:
        return f"{config.num_blocks} blocks cannot fill PP {layout.pp} stages"
    per_rank = job.batch // layout.dp if job.batch % layout.dp == 0 else 0
    if not per_rank or per_rank % job.micro_batch_size:
        return f"batch {job.batch} does not split into DP {layout.dp} x micro-batch {job.micro_batch_size}"
    return None


def activation_bytes(job) -> int:
    """Bytes of one activation value in the compute dtype (saved for backward, working sets,
    communicated: the TP all-reduces, Ulysses' all-to-alls and the pipeline's stage tensor,
    `pipeline_dtype`): families/flux/transformer/model.py `compute_dtype`, bf16 under --bf16 (no autocast: the
    residual stream, every linear's output with its bias inside the GEMM, the modulation vectors and
    silu(temb) are bf16) or with Megatron's bf16 parameters, else the parameters' fp32. The fp32
    values autograd keeps inside a bf16 block (statistics) are counted where they arise
    (`block_activation_bytes`). Before this layout (bf16 autocast over fp32 parameters) Megatron's
    linears added the fp32 bias after the bf16 GEMM and the residual stream stayed fp32: the formulas
    counted 4 bytes then, within 2% of three H100 peaks (docs/scaling.md)."""
    return 2 if job.bf16 or job.param_dtype == "bf16" else 4


# --- parameters (count by hand: families/flux/transformer/layout.py's rules and the module shapes) ----------
def _linear(fan_in, fan_out, shard, tp, lora_rank=0):
    """(parameters on this rank, LoRA adapter parameters on this rank) of one linear + bias.
    column: weight and bias split by tp; row: weight split, bias replicated; replicated: whole.
    LoRA (Megatron's LoRA on parallel linears): A [r, in] and B [out, r], the split side of each
    split like the base weight."""
    if shard == "column":
        base, lora = (fan_in * fan_out + fan_out) // tp, lora_rank * (fan_in + fan_out // tp)
    elif shard == "row":
        base, lora = fan_in * fan_out // tp + fan_out, lora_rank * (fan_in // tp + fan_out)
    else:
        base, lora = fan_in * fan_out + fan_out, 0
    return base, lora


def block_params(config: FluxConfig, tp: int, lora_rank: int = 0):
    """(double block, single block) parameters on one TP rank, and their LoRA adapters: on
    linear_qkv, linear_proj, linear_fc1, linear_fc2 (each stream), linear_in, linear_out, not on
    the modulation linears (`adaln`, not among lora.RECOMMENDED_TARGETS)."""
    D, F, d = config.hidden_size, config.mlp_hidden_size, config.attention_head_dim
    stream = [_linear(D, 6 * D, "column", tp), _linear(D, 3 * D, "column", tp, lora_rank),
              _linear(D, D, "row", tp, lora_rank), _linear(D, F, "column", tp, lora_rank),
              _linear(F, D, "row", tp, lora_rank)]
    double = [sum(x[i] for x in stream) * 2 + (2 * 2 * d if i == 0 else 0) for i in (0, 1)]
    single_parts = [_linear(D, 3 * D, "column", tp), _linear(D, 3 * D + F, "column", tp, lora_rank),
                    _linear(D + F, D, "row", tp, lora_rank)]
    single = [sum(x[i] for x in single_parts) + (2 * d if i == 0 else 0) for i in (0, 1)]
    return tuple(double), tuple(single)


def stage_blocks(num_blocks: int, pp: int) -> List[int]:
    """Blocks per pipeline stage: an even split when PP divides the blocks (`resolve_pp_layers`),
    else the remainder one block each on the last stages (the first stage holds the embedders and
    the most in-flight micro-batches); the trainer takes such a split as `pipeline_num_layers`."""
    return [num_blocks // pp + (1 if s >= pp - num_blocks % pp else 0) for s in range(pp)]


def _stage_range(config: FluxConfig, pp: int, stage: int):
    counts = stage_blocks(config.num_blocks, pp)
    start = sum(counts[:stage])
    return start, start + counts[stage]


def stage_params(config: FluxConfig, tp: int, pp: int, stage: int, lora_rank: int = 0):
    """(base parameters, LoRA parameters) of pipeline stage `stage` on one TP rank: its blocks
    (an even split, as `resolve_pp_layers`), the embedders on the first, the final layer on the last."""
    D = config.hidden_size
    start, end = _stage_range(config, pp, stage)
    n_double = max(0, min(end, config.num_layers) - start)
    n_single = end - start - n_double
    (dbl, dbl_lora), (sgl, sgl_lora) = block_params(config, tp, lora_rank)
    base, lora = n_double * dbl + n_single * sgl, n_double * dbl_lora + n_single * sgl_lora
    if stage == 0:  # x / context embedders and the time / guidance / pooled-text MLPs: replicated
        mlps = (2 if config.guidance_embeds else 1) * (TIME_CHANNELS * D + D + D * D + D) + \
            config.pooled_projection_dim * D + D + D * D + D
        base += config.in_channels * D + D + config.joint_attention_dim * D + D + mlps
    if stage == pp - 1:  # AdaLayerNormContinuous (column) and the replicated output projection
        base += _linear(D, 2 * D, "column", tp)[0] + D * config.output_channels + config.output_channels
    return base, lora


def total_params(config: FluxConfig) -> int:
    return stage_params(config, 1, 1, 0)[0]


# --- memory terms ---------------------------------------------------------------------------
def weights_bytes(base, lora, job, qk_norm=0):
    """Policy weights: base in the parameter dtype; LoRA adapters in fp32. With LoRA and bf16
    compute the trainer holds the frozen base in bf16, its matrices and biases (lora.py
    `freeze_base_in_bf16`: the model computes in bf16, so they are used as they are); only the
    QK-norm weights (`qk_norm`: head_dim values each, `qk_norm_params`) stay fp32."""
    if job.lora_rank and job.bf16:
        return 2 * base + 2 * qk_norm + 4 * lora
    return base * dtype_bytes(job.param_dtype) + lora * 4


def qk_norm_params(config: FluxConfig, pp: int, stage: int) -> int:
    """The QK-norm weights of a stage's blocks (replicated): q and k of each stream of a double block
    (4d), of a single block (2d)."""
    start, end = _stage_range(config, pp, stage)
    n_double = max(0, min(end, config.num_layers) - start)
    return config.attention_head_dim * (4 * n_double + 2 * (end - start - n_double))


# fp32 statistics autograd keeps inside a block, whatever the compute dtype: per head and token the
# rsqrt of q's and of k's mean square (kernels.qk_norm_rope_torch keeps only these and q / k
# themselves: the norm, the weight and RoPE are recomputed in its backward) and attention's
# log-sum-exp (3); per LayerNorm and token the mean and rstd (2; bf16 on CPU, fp32 on GPUs).
HEAD_STATS_PER_BLOCK = 3

LAYER_NORM_STATS = 2

FP32 = 4


def block_activation_bytes(config: FluxConfig, tp: int, lora_rank: int = 0, value_bytes: int = 2):
    """Bytes per token saved for backward by one (double, single) block, its input included, counted
    from families/flux/transformer/blocks.py with torch's eager kernels (kernels.py: a fused attention with no
    S x S scores; the QK norm + RoPE chain `qk_norm_rope_torch`, whose backward recomputes its fp32
    chain from q / k and their rsqrt), values of the compute dtype at `value_bytes` (c: 2 under
    --bf16), the fp32 statistics at 4. A tensor that is a view of another saved one costs nothing:
    q / k / v are views of the qkv output (of a single block's fused [qkv | mlp] output), which
    autograd keeps whole for the QK norm; the attention output's flatten is a view.
    Replicated across TP ranks (no Megatron sequence parallelism): block input, layer-norm and
    modulation outputs, row-parallel outputs, residual stream; split by TP: qkv, q / k / v,
    attention, MLP. Not saved: the RoPE table (the forward's constant, shared by every block), the
    normalised and rotated q / k of one stream (their concatenation is).
      double, per token of either stream: replicated 8D c (input, ln1, mod1, attention proj out,
        residual, ln2, mod2, fc2 out); split (7D + 2F) c (qkv 3D, concatenated q / k after norm and
        RoPE 2D, concatenated v D, attention out D, fc1 out F, GELU out F) + 3H x 4 (the rsqrt of
        q and k, attention's log-sum-exp); 2 LayerNorms' statistics 2 x 2 x 4;
      single: replicated 4D c (input, ln, mod, out); split (6D + 2F) c (fused [qkv | mlp] 3D + F,
        q / k after norm and RoPE 2D, attention out D, GELU out F) + 3H x 4; 2 x 4.
    Under bf16 (c = 2), D = 256, F = 4D, 4 heads: 46.2 and 36.2 bytes per token per hidden unit,
    half of fp32's 92.3 and 72.2. Checked against the tensors autograd saves
    (bench/bench_parallel_memory.py's SavedActivationMeter on one block of each kind, the per-token
    slope between two sequence lengths: `python bench/bench_parallel_memory.py --block-bytes`;
    tests/test_plan.py): equal to 0.03 bytes per hidden unit (the LayerNorm statistics, bf16 on
    CPU). Megatron's per-layer count for GPT (sbh(10 + 24/t + 5as/(ht)), Korthikanti et al. table 2,
    without sequence parallelism) has the same replicated / split structure.

    With LoRA (`lora_rank` > 0) the base is frozen and autograd saves only what the gradient of
    an activation or an adapter needs: not the layer-norm outputs (inputs of `modulate`, whose
    scale comes from the frozen time embedding), nor the attention / MLP outputs multiplied by the
    frozen gates; the inputs of the adapted linears stay (the adapters' A needs them), and each
    adapter adds its r-wide A x (for B); the split part is the full block's:
      double (4D + 4r) c + split + stats (input, mod1, residual, mod2; A x of qkv, proj, fc1, fc2),
      single (2D + 2r) c + split + stats (input, mod; A x of linear_in, linear_out).
    Checked the same way with adapters of r = 8: 38.5 and 32.3 bytes per token per hidden unit at
    D = 256 in bf16."""
    D, F, r, c = config.hidden_size, config.mlp_hidden_size, lora_rank, value_bytes
    head_stats = HEAD_STATS_PER_BLOCK * config.num_attention_heads / tp * FP32
    split_double = (7 * D + 2 * F) / tp * c + head_stats
    split_single = (6 * D + 2 * F) / tp * c + head_stats
    ln_stats = LAYER_NORM_STATS * FP32  # one LayerNorm's
    if lora_rank:
        return ((4 * D + 4 * r) * c + split_double + 2 * ln_stats,
                (2 * D + 2 * r) * c + split_single + ln_stats)
    return 8 * D * c + split_double + 2 * ln_stats, 4 * D * c + split_single + ln_stats


def weight_cast_bytes(job, params) -> float:
    """bf16 copies of trainable fp32 weights that autograd saves: under --bf16 with fp32 parameters
    every call casts a trainable weight to bf16 (layers.py `linear`; LoRA's A and B, lora.py
    `Adapter.add_to`), and the product keeps the copy for its input's gradient: 2 bytes per trainable
    parameter `params` of the linears a forward runs with a gradient. Full fine-tuning of FLUX.1-dev
    without recompute: 23.8 GB per micro-batch in flight. Checked with the meter (the intercept of
    the same runs as `block_activation_bytes`: equal to the block's matrices at 2 bytes, biases
    excepted, which are not saved)."""
    return 2 * params if job.bf16 and job.param_dtype == "fp32" else 0


def final_layer_values(config: FluxConfig, job: Job) -> float:
    """The last stage's head (families/flux/transformer/model.py FinalLayer), values per micro-batch sample: its
    input (the last block's output, all S tokens' storage) and the image tokens' layer-norm and
    modulation outputs (replicated); with LoRA only the input (the head's linears are frozen and
    not adapted, so neither output is needed for a gradient)."""
    S, I = job.text_tokens + job.image_tokens, job.image_tokens
    return (S + (0 if job.lora_rank else 2 * I)) * config.hidden_size


def _stage_blocks(config, layout, stage):
    start, end = _stage_range(config, layout.pp, stage)
    n_double = max(0, min(end, config.num_layers) - start)
    return n_double, end - start - n_double


def _tokens(job, layout) -> float:
    """Tokens of one micro-batch on a rank: SP splits the sequence (Ulysses keeps S/sp tokens per
    rank outside attention and S x heads/sp inside, the same count)."""
    return (job.text_tokens + job.image_tokens) * job.micro_batch_size / layout.sp


def _trainable_in_blocks(config, job, layout, stage):
    """(trainable parameters of one double block, of one single block, of the stage outside its blocks)."""
    (dbl, dbl_lora), (sgl, sgl_lora) = block_params(config, layout.tp, job.lora_rank)
    n_double, n_single = _stage_blocks(config, layout, stage)
    base, lora = stage_params(config, layout.tp, layout.pp, stage, job.lora_rank)
    if job.lora_rank:
        return dbl_lora, sgl_lora, lora - n_double * dbl_lora - n_single * sgl_lora
    return dbl, sgl, base - n_double * dbl - n_single * sgl


def activation_bytes_per_microbatch(config, job, layout, stage):
    """Saved activations one micro-batch keeps on a stage until its backward: every block's
    (`block_activation_bytes`), the head's, and the bf16 copies of the trainable weights
    (`weight_cast_bytes`); with recompute only each block's input (D c per token) and the copies of
    the trainable weights outside the checkpointed blocks (embedders, head)."""
    tokens, c = _tokens(job, layout), activation_bytes(job)
    n_double, n_single = _stage_blocks(config, layout, stage)
    double, single = block_activation_bytes(config, layout.tp, job.lora_rank, c)
    dbl_train, sgl_train, outside = _trainable_in_blocks(config, job, layout, stage)
    if job.recompute:
        per_token = (n_double + n_single) * config.hidden_size * c
        casts = weight_cast_bytes(job, outside)
    else:
        per_token = n_double * double + n_single * single
        casts = weight_cast_bytes(job, outside + n_double * dbl_train + n_single * sgl_train)
    head = final_layer_values(config, job) * job.micro_batch_size / layout.sp * c if stage == layout.pp - 1 else 0
    return tokens * per_token + head + casts


def _block_kinds(config, job, layout, stage):
    """The block kinds on a stage as (saved bytes per token, working bytes per token, trainable
    parameters of one block): `block_activation_bytes`, BACKWARD_WORKING_BYTES_PER_TOKEN."""
    c = activation_bytes(job)
    n_double, n_single = _stage_blocks(config, layout, stage)
    saved = block_activation_bytes(config, layout.tp, job.lora_rank, c)
    working = [w * config.hidden_size / layout.tp for w in BACKWARD_WORKING_BYTES_PER_TOKEN[c, bool(job.lora_rank)]]
    trainable = _trainable_in_blocks(config, job, layout, stage)[:2]
    return [kind for kind, n in zip(zip(saved, working, trainable), (n_double, n_single)) if n]


def _peak_block(config, job, layout, stage):
    """The block kind whose backward peaks highest: with recompute its recomputed activations (less
    the input), weight copies and working set together; without, its working set."""
    tokens, D, c = _tokens(job, layout), config.hidden_size, activation_bytes(job)
    kinds = _block_kinds(config, job, layout, stage)
    if not job.recompute:
        return max(kinds, key=lambda k: k[1])
    return max(kinds, key=lambda k: tokens * (k[0] - D * c + k[1]) + weight_cast_bytes(job, k[2]))


def recompute_bytes(config, job, layout, stage):
    """With recompute, one block's activations (less its input, already kept) and its bf16 weight
    copies exist while that block is recomputed for its backward, one micro-batch at a time: the
    block kind whose backward peaks highest (`_peak_block`)."""
    if not job.recompute:
        return 0
    saved, _, params = _peak_block(config, job, layout, stage)
    return _tokens(job, layout) * (saved - config.hidden_size * activation_bytes(job)) + weight_cast_bytes(job, params)


# Bytes per token and hidden unit alive at the peak of a recomputed block's forward + backward beyond
# the recomputed saved activations (`block_activation_bytes` less the input) and the block's output,
# (double block, single block) by (compute value bytes, LoRA): measured with the live-tensor meter on
# one block of each kind (bench/bench_parallel_memory.py `block_bytes`: D = 256, F = 4D, 4 heads,
# LoRA r = 8; the slope between two sequence lengths; `python bench/bench_parallel_memory.py
# --block-bytes`). The single block's is the gradient of linear_out's GELU part (F wide); with LoRA
# the frozen linear's and the adapter's contributions to it and their sum are alive at once. These
# are split by TP (the MLP's width is): counted / TP (bench/plan_validate.py's TP2 rows: +0.1% and
# +1.5% in the training phase, +1.8% and +7.4% when counted whole).
BACKWARD_WORKING_BYTES_PER_TOKEN = {(2, False): (12.0, 24.1), (2, True): (19.9, 26.0),
                                    (4, False): (24.0, 24.1), (4, True): (39.9, 43.9)}


def backward_working_bytes(config, job, layout, stage=0):
    """Activation gradients alive during the backward (the gradient of the block output and of the
    block being differentiated) beyond the saved activations: BACKWARD_WORKING_BYTES_PER_TOKEN x D / TP
    per token (measured constants), of the block kind whose backward peaks highest (`_peak_block`)."""
    return _tokens(job, layout) * _peak_block(config, job, layout, stage)[1]


def in_flight_microbatches(job, layout, stage) -> int:
    """1F1B keeps pp - stage micro-batches' activations on a stage (Megatron: pp on the first
    stage), fewer when there are fewer micro-batches."""
    m = micro_batches_per_update(job, layout)
    return min(layout.pp - stage, m) if layout.pp > 1 else 1


def micro_batches_per_update(job, layout) -> int:
    return job.trained_steps * (job.batch // layout.dp) // job.micro_batch_size


def rollout_buffer_bytes(config, job, layout):
    """The rollout of this rank's B samples (grpo/schedule.py, rollout/): latents of every step
    [B, N+1, I, C], step noise [B, N, I, C], initial noise and x0 [B, I, C] (fp32), and the
    per-sample text conditioning [B, T, joint] + pooled (rows of the cache, fp32)."""
    B, N, I, C = job.batch // layout.dp, job.num_inference_steps, job.image_tokens, config.in_channels
    latents = B * ((N + 1) + N + 2) * I * C
    cond = B * (job.text_tokens * config.joint_attention_dim + config.pooled_projection_dim)
    return 4 * (latents + cond)


def training_rows_bytes(config, job, layout):
    """The trained rows, built for all micro-batches of the update at once (schedule.micro_batches):
    per (sample, trained step) x_t and x_t+1 [I, C] and the sample's conditioning [T, joint] + pooled,
    fp32 copies; with the KL term the reference's mean [I, C] too."""
    rows = job.trained_steps * job.batch // layout.dp
    I, C = job.image_tokens, config.in_channels
    per_row = (3 if job.kl_reference else 2) * I * C + job.text_tokens * config.joint_attention_dim + \
        config.pooled_projection_dim
    return 4 * rows * per_row


def rollout_forward_working_bytes(config, job, layout):
    """No-grad forward of one micro-batch: the block input (held by the caller) and what a double
    block holds at its last GEMM (its locals stay alive until it returns; families/flux/transformer/blocks.py):
    replicated, the new image residual, the MLP's input and output (3D), with LoRA the adapter's
    addmm output beside the frozen linear's (D); split by TP, the qkv outputs (3D, views of which v
    keeps), the normalised and rotated q / k of each stream and their concatenation (4D), the
    concatenated v and the attention output (2D), fc1 and GELU outputs (2F); all in the compute
    dtype; with full fine-tuning under --bf16 the largest bf16 weight copy (linear_in) as well.
    Checked against the live tensors of a no-grad block forward (bench/bench_parallel_memory.py
    `block_bytes`, D = 256; bytes per token per hidden unit): LoRA r = 8 44.1 (bf16) and 88.1 (fp32),
    the formula 44 and 88; full fine-tuning 42.0 and 84.0, the formula's; a single block holds less
    (34 and 68)."""
    D, F, c = config.hidden_size, config.mlp_hidden_size, activation_bytes(job)
    live = D + 3 * D + (D if job.lora_rank else 0) + (9 * D + 2 * F) / layout.tp
    cast = 0 if job.lora_rank else weight_cast_bytes(job, D * (3 * D + F) / layout.tp)
    return _tokens(job, layout) * live * c + cast


def vae_bytes(comps, job):
    """VAE weights (the whole AutoencoderKL is loaded, mm_grpo/families/flux/vae.py) in the compute dtype."""
    return comps.vae_params * (2 if job.bf16 else 4)


def vae_decode_bytes(comps, job, layout):
    """Decode of this rank's B images at once (mm_grpo/families/flux/vae.py decodes the batch in one call):
    B x H x W x values-per-pixel (measured constant, `VAE_DECODE_VALUES_PER_PIXEL`) x element size."""
    B = job.batch // layout.dp
    return B * job.height * job.width * comps.vae_decode_values_per_pixel * (2 if job.bf16 else 4)


def text_encoder_bytes(comps, job):
    """T5-XXL + CLIP-L on the device when there is no text-embedding cache."""
    return 0 if job.text_cache else comps.text_encoder_params * (2 if job.bf16 else 4)


def stage_memory(config, comps, job, layout, stage) -> RankMemory:
    base, lora = stage_params(config, layout.tp, layout.pp, stage, job.lora_rank)
    static = {
        "weights": weights_bytes(base, lora, job, qk_norm_params(config, layout.pp, stage)),
        "main_grads": main_grad_bytes(base, lora, job),
        "optimizer": optimizer_bytes(base, lora, job, layout),
        "kl_reference": kl_reference_bytes(base, job),
        "vae": vae_bytes(comps, job),
        "reward_model": reward_bytes(comps),
        "text_encoders": text_encoder_bytes(comps, job),
    }
    act = activation_bytes_per_microbatch(config, job, layout, stage)
    return phase_memory(static,
                        activations_per_microbatch=act,
                        activations=act * in_flight_microbatches(job, layout, stage),
                        recompute_block=recompute_bytes(config, job, layout, stage),
                        backward_working=backward_working_bytes(config, job, layout, stage),
                        training_rows=training_rows_bytes(config, job, layout),
                        rollout_buffers=rollout_buffer_bytes(config, job, layout),
                        rollout_forward=rollout_forward_working_bytes(config, job, layout),
                        vae_decode=vae_decode_bytes(comps, job, layout))


def rank_memory(config: FluxConfig, comps, job: Job, layout: Layout) -> LayoutMemory:
    return LayoutMemory([stage_memory(config, comps, job, layout, s) for s in range(layout.pp)])


def model_of(path_or_name) -> FluxConfig:
    """A preset name (flux-dev, flux-schnell, tiny) or a diffusers config.json / transformer folder."""
    from mm_grpo.families.flux.transformer.config import PRESETS
    if path_or_name in PRESETS:
        return FluxConfig.preset(path_or_name)
    import os
    if not os.path.exists(path_or_name):
        raise ValueError(f"unknown model {path_or_name!r}: a preset ({', '.join(PRESETS)}) or a diffusers "
                         f"config.json / transformer folder")
    return FluxConfig.from_diffusers_config(path_or_name)


# --- time ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SampleFlops:
    """Matrix-product and attention FLOPs of one sample's forward and of its backward."""
    forward: float
    backward: float


def sample_flops(config: FluxConfig, job: Job) -> SampleFlops:
    """bench/flops.py's count (tests/test_plan.py checks they agree; bench/ is not installed with the
    package): 2 FLOPs per multiply-add of every linear (token-wise, and the per-sample adaLN and
    embedder vectors) and of attention's two products, LoRA's adapters included; element-wise work
    left out. Backward: full fine-tuning twice the forward less the products whose inputs need no
    gradient (the x / context embedders and the embedders' first layers: weight gradient only); LoRA
    on a frozen base the input gradients of the token linears from the first block's output
    projection on, attention's twice, and the adapters' weight and input gradients."""
    D, F, T, I = config.hidden_size, config.mlp_hidden_size, job.text_tokens, job.image_tokens
    S, r, L, Ls = T + I, job.lora_rank, config.num_layers, config.num_single_layers
    mm = lambda rows, fan_in, fan_out: 2 * rows * fan_in * fan_out  # noqa: E731
    embed_in = mm(I, config.in_channels, D) + mm(T, config.joint_attention_dim, D)
    tokens = (L * S * (mm(1, D, 3 * D) + mm(1, D, D) + mm(1, D, F) + mm(1, F, D))
              + Ls * S * (mm(1, D, 3 * D + F) + mm(1, D + F, D)) + embed_in + mm(I, D, config.output_channels))
    mlp_first = mm(1, TIME_CHANNELS, D) * (2 if config.guidance_embeds else 1) + mm(1, config.pooled_projection_dim, D)
    vectors = (mlp_first + mm(1, D, D) * (3 if config.guidance_embeds else 2)
               + L * 2 * mm(1, D, 6 * D) + Ls * mm(1, D, 3 * D) + mm(1, D, 2 * D))
    attention = config.num_blocks * 2 * mm(S, S, D)
    adapter = lambda fan_in, fan_out: mm(S, fan_in, r) + mm(S, r, fan_out)  # noqa: E731
    lora = (L * (adapter(D, 3 * D) + adapter(D, D) + adapter(D, F) + adapter(F, D))
            + Ls * (adapter(D, 3 * D + F) + adapter(D + F, D))) if r else 0
    forward = tokens + vectors + attention + lora
    if r:
        first_projection = S * mm(1, D, 3 * D if L else 3 * D + F)
        backward = tokens - embed_in - first_projection + 2 * attention + 2 * lora - mm(S, D, r)
    else:
        backward = 2 * forward - embed_in - mlp_first
    return SampleFlops(forward, backward)


def phase_flops(config: FluxConfig, job: Job, samples: int) -> Dict[str, float]:
    """FLOPs each phase of one iteration executes for `samples` images: the rollout N forwards per
    sample; the training K rows per sample, each forward + backward and, with recompute, the
    forward again (bench/flops.py's MFU leaves the recompute out: it is overhead, not model work);
    decode + reward the VAE decode and the reward model's forward per image."""
    one = sample_flops(config, job)
    train_row = one.forward * (2 if job.recompute else 1) + one.backward
    return dict(rollout=samples * job.num_inference_steps * one.forward,
                train=samples * job.trained_steps * train_row,
                decode_reward=samples * vae_decode_flops(job))


def reward_flops(comps) -> float:
    """One image through the reward model: 2 FLOPs per parameter and token, 257 tokens (a ViT-H-14's
    256 patches + class token at 224 px)."""
    return 2 * comps.reward_params * 257


def vae_decode_flops(job: Job) -> float:
    """FLUX.1 VAE decoder convolutions per image, counted from diffusers' Decoder with
    block_out_channels (128, 256, 512, 512), 3 ResNets per up block (2 convs of 3x3 each) and an
    upsampling 3x3 conv after the first three: 2 x 9 x C_in x C_out per output pixel."""
    px = job.height * job.width
    flops, scale = 0.0, 1 / 64
    for i, (c_in, c) in enumerate(((512, 512), (512, 512), (512, 256), (256, 128))):  # H/8 .. H
        convs = [(c_in, c), (c, c)] + [(c, c)] * 4  # 3 ResNets, 2 convs each (first changes channels)
        flops += sum(2 * 9 * a * b for a, b in convs) * px * scale
        if i < 3:
            scale *= 4
            flops += 2 * 9 * c * c * px * scale  # upsampler conv at the next resolution
    return flops + 2 * 9 * 512 * 512 * px / 64 * 4  # mid block's 2 ResNets


def weight_traffic_bytes(config: FluxConfig, job: Job, layout: "Layout", samples: int) -> Dict[str, float]:
    """Bytes the weights move in each phase of one iteration on a rank, besides the FLOPs (hand count,
    mm_grpo/layers.py `linear`, lora.py, training/optim.py), per parameter of the stage and pass
    of a micro-batch: a forward's GEMMs read every matrix once (c bytes: bf16 under --bf16; a
    trainable fp32 weight under --bf16 is first cast, 4 read + 2 written, so 8); a backward's input
    gradients read the (saved) copies again (c) and a trainable weight's gradient is written (c),
    cast to fp32 under --bf16 (c + 4) and added to the fp32 main gradient (Megatron's DDP,
    grad_reduce_in_fp32, no fused accumulation: 4 + 4 read, 4 written). The rollout runs N passes per
    micro-batch, the training K forward (+ recompute) + backward passes. Negligible at the
    calibration's micro-batch 12 with LoRA (0.2 s of 40.8); at micro-batch 1 with full fine-tuning it
    is most of what a FLOP count misses (docs/scaling.md)."""
    c = activation_bytes(job)
    base, lora = max((stage_params(config, layout.tp, layout.pp, s, job.lora_rank) for s in range(layout.pp)),
                     key=sum)  # the slowest rank's stage
    trainable = trainable_params(base, lora, job)
    frozen = base + lora - trainable
    cast = 6 if job.bf16 and job.param_dtype == "fp32" else 0  # fp32 read + bf16 written, per trainable weight
    grad = c + (c + 4 if c == 2 and job.param_dtype == "fp32" else 0) + 12
    forward = frozen * c + trainable * (c + cast)
    backward = (base + lora) * c + trainable * grad
    micro_batches = samples // job.micro_batch_size
    return dict(rollout=micro_batches * job.num_inference_steps * forward,
                train=micro_batches * job.trained_steps * (forward * (2 if job.recompute else 1) + backward))


def time_path(job: Job, device) -> str:
    """The calibrated path a job runs: compiled blocks (--compile-blocks) where the device compiles,
    else eager."""
    return "compiled" if job.compile_blocks and device.compiles else "eager"


@functools.lru_cache(maxsize=None)
def efficiency(path: str, phase: str) -> float:
    """The fraction of the matmul rate a phase reaches on `path` (eager or compiled): the FLOPs the
    calibration job executes in it (`phase_flops`) / ((its measured seconds less its weight traffic
    at the calibration card's HBM bandwidth) x the matmul rate measured with it), from
    calibration.py. On issue 48's H200 run (the fp32-residual layout): eager rollout 0.373, train
    0.357; compiled 0.634, 0.563; decode + reward 0.173 (the VAE's convolutions; the jpeg reward's
    CPU time counts against them)."""
    from mm_grpo.families.flux import calibration
    from mm_grpo.plan.devices import DEVICES
    config = model_of(calibration.CALIBRATION_MODEL)
    job = Job(**calibration.CALIBRATION_JOB)
    measured = calibration.PHASES[path][phase]
    traffic = weight_traffic_bytes(config, job, Layout(), job.batch).get(phase, 0.0)
    seconds = measured.seconds - traffic / DEVICES[calibration.CALIBRATION_DEVICE].hbm_bw
    return phase_flops(config, job, job.batch)[phase] / (seconds * measured.matmul_tflops * 1e12)


def phase_rates(job: Job, device, mfu: Optional[float] = None) -> Dict[str, float]:
    """FLOP/s of each compute phase: the device's bf16 matmul rate (devices.py: measured, else the
    calibration's fraction of the peak) x the phase's calibrated efficiency on the job's path
    (`efficiency`); with `mfu` (--mfu) every phase at that fraction of the datasheet peak instead."""
    if mfu is not None:
        return dict.fromkeys(("rollout", "train", "decode_reward"), device.peak_bf16_flops * mfu)
    path = time_path(job, device)
    return {phase: device.matmul_rate * efficiency(path, phase) for phase in ("rollout", "train", "decode_reward")}


def iteration_time(config, comps, job, layout, device, mfu: Optional[float] = None) -> IterationTime:
    """Seconds of one iteration on the slowest rank: each phase's FLOPs (`phase_flops`) at its rate
    (`phase_rates`: calibrated on measured full-size phases, or `mfu` x the peak) plus the weights'
    traffic (`weight_traffic_bytes`) at the device's HBM bandwidth, and communication at the device
    profile's bandwidths, not overlapped. Rollout: B samples x N forwards, the pipeline
    filled once per micro-batch sweep; train: K rows per sample forward + backward (+ the recompute
    forward), the 1F1B bubble (pp - 1) / m of it; decode + reward once per sample. TP, SP and PP split
    the FLOPs evenly (their GEMMs' lower efficiency is not modelled)."""
    B, N, K = job.batch // layout.dp, job.num_inference_steps, job.trained_steps
    rates = phase_rates(job, device, mfu)
    model_par = layout.tp * layout.sp * layout.pp
    flops = phase_flops(config, job, B)
    mbs = job.micro_batch_size
    fill = (layout.pp - 1) / max(1, B // mbs)
    traffic = weight_traffic_bytes(config, job, layout, B)
    rollout = (flops["rollout"] / model_par / rates["rollout"] + traffic["rollout"] / device.hbm_bw) * (1 + fill)
    m = micro_batches_per_update(job, layout)
    train = (flops["train"] / model_par / rates["train"] + traffic["train"] / device.hbm_bw) * (1 + (layout.pp - 1) / m)
    decode = (flops["decode_reward"] + B * reward_flops(comps)) / rates["decode_reward"]
    bytes_ = activation_bytes(job)
    tokens = (job.text_tokens + job.image_tokens) * mbs
    D = config.hidden_size
    blocks_per_stage = config.num_blocks / layout.pp
    # Passes of one micro-batch through this stage: N per sample in the rollout, K x (fwd + bwd) in training.
    passes = (B // mbs) * (N + 2 * K + (K if job.recompute else 0))
    tp_comm = sp_comm = pp_comm = dp_comm = 0.0
    if layout.tp > 1:  # per block 2 row-parallel all-reduces over the block's tokens (double: one per
        # stream covering its tokens, attention proj + fc2; single: one), ring: 2 (tp-1)/tp x bytes
        per_block = (2 * config.num_layers + config.num_single_layers) / config.num_blocks
        volume = per_block * tokens / layout.sp * D * bytes_ * 2 * (layout.tp - 1) / layout.tp
        tp_comm = passes * blocks_per_stage * volume / bandwidth(device, layout.tp)
    if layout.sp > 1:  # Ulysses: q, k, v to heads and the output back, all-to-all of (sp-1)/sp
        volume = 4 * tokens / layout.sp * D / layout.tp * bytes_ * (layout.sp - 1) / layout.sp
        sp_comm = passes * blocks_per_stage * volume / bandwidth(device, layout.tp * layout.sp)
    if layout.pp > 1:  # one [S/sp + 1, m, D] tensor per stage boundary and pass
        volume = (tokens / layout.sp + mbs) * D * bytes_
        pp_comm = passes * volume / bandwidth(device, layout.world)
    dp_group = layout.dp * layout.sp
    if dp_group > 1:  # fp32 gradients: all-reduce, or reduce-scatter + parameter all-gather
        base, lora = stage_params(config, layout.tp, layout.pp, 0, job.lora_rank)
        volume = 4 * trainable_params(base, lora, job) * 2 * (dp_group - 1) / dp_group
        dp_comm = volume / bandwidth(device, layout.tp * layout.sp * layout.dp)
    return IterationTime(dict(rollout=rollout, train=train, decode_reward=decode, tp_allreduce=tp_comm,
                              ulysses_all_to_all=sp_comm, pp_p2p=pp_comm, dp_grad_sync=dp_comm))


def layouts(config: FluxConfig, devices: int):
    """Every TP x PP x SP x DP of `devices` whose TP x SP divides the heads (PP up to the blocks:
    an uneven split is `stage_blocks`')."""
    out = []
    for tp in range(1, devices + 1):
        for sp in range(1, devices // tp + 1):
            for pp in range(1, devices // (tp * sp) + 1):
                if devices % (tp * sp * pp):
                    continue
                if config.num_attention_heads % (tp * sp) or pp > config.num_blocks:
                    continue
                out.append(Layout(tp=tp, pp=pp, sp=sp, dp=devices // (tp * sp * pp)))
    return out


# --- frozen parts: the VAE and text encoders (mm_grpo/plan/frozen_parts.py: the rewards) ----------
# Public parameter counts.
FLUX_VAE_PARAMS = 83_821_011  # FLUX.1 AutoencoderKL (encoder + decoder); count of diffusers' model at its config
T5_XXL_ENCODER_PARAMS = 4_762_310_656  # google/t5-v1_1-xxl encoder (FLUX.1's text_encoder_2)
CLIP_L_TEXT_PARAMS = 123_060_480  # openai/clip-vit-large-patch14 text model (FLUX.1's text_encoder)
# Largest live set of one image's no-grad VAE decode, in values per output pixel (bytes = values
# x element size), measured with the live-tensor meter (`python bench/plan_validate.py --probe-vae`).
# FLUX.1's VAE: 768 = 3 x 256 channels at full resolution (the last up block's input, its first
# ResNet's GroupNorm and SiLU outputs), which is also the hand count. The tiny pipeline's VAE: 40
# (its hand count gives 32; CPU convolutions add a copy of their input in another memory format).
VAE_DECODE_VALUES_PER_PIXEL = {((128, 256, 512, 512), 2): 768.0, ((8, 8, 16, 16), 1): 40.1}


def vae_decode_values(block_out_channels, layers_per_block) -> float:
    """Measured constant when known, else the hand count: 3 x the last up block's input channels."""
    key = (tuple(block_out_channels), int(layers_per_block))
    if key in VAE_DECODE_VALUES_PER_PIXEL:
        return VAE_DECODE_VALUES_PER_PIXEL[key]
    return 3.0 * list(reversed(block_out_channels))[-2] if len(block_out_channels) > 1 else 3.0 * block_out_channels[0]


def components(reward: str = "hps", text_cache: bool = True) -> Components:
    """FLUX.1 (dev or schnell): its VAE, T5-XXL + CLIP-L unless cached, and the reward."""
    return Components(FLUX_VAE_PARAMS, VAE_DECODE_VALUES_PER_PIXEL[((128, 256, 512, 512), 2)],
                      0 if text_cache else T5_XXL_ENCODER_PARAMS + CLIP_L_TEXT_PARAMS, reward_params(reward))


def components_of_pipeline(pipeline_dir: str, reward: str = "hps", text_cache: bool = True) -> Components:
    """A diffusers pipeline folder's VAE and text encoders (counted from their files)."""
    vae_dir = os.path.join(pipeline_dir, "vae")
    with open(os.path.join(vae_dir, "config.json")) as f:
        vae = json.load(f)
    text = 0 if text_cache else sum(safetensors_params(os.path.join(pipeline_dir, d))
                                    for d in ("text_encoder", "text_encoder_2"))
    return Components(safetensors_params(vae_dir), vae_decode_values(vae["block_out_channels"], vae["layers_per_block"]),
                      text, reward_params(reward), latent_channels=vae["latent_channels"])
