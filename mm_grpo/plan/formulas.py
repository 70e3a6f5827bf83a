"""Per-rank memory and seconds per iteration of a GRPO run of FLUX under TP x PP x SP x DP.

Every term is a named function below with its source: counted by hand from mm-grpo's code
(the file it follows is named), Megatron-LM's own estimate (megatron/training/
theoretical_memory_usage.py, "Megatron" below), or a measured constant (named where defined).
Units: bytes and seconds. Notation: D hidden size, F MLP width (4D), d head dim, S = T + I tokens
(T text, I image), C latent channels of the transformer, B samples per data-parallel rank,
m micro-batch size, N denoising steps, K trained steps per sample, tp/pp/sp/dp the layout.

What the trainer holds (mm_grpo/training/optim.py, trainable.py, grpo/schedule.py):
- parameters in fp32 (params_dtype fp32; `--bf16` is autocast around the blocks) or bf16
  (Megatron's --bf16 with fp32 master weights: `param_dtype="bf16"`, not mm-grpo's trainer today);
- main gradients in fp32 (DDP `grad_reduce_in_fp32=True`), a full buffer on every rank;
- Adam's two moments in fp32 (+ fp32 master weights for bf16 parameters), sharded over the
  data-parallel x context-parallel group by the distributed optimizer;
- the KL reference (`--kl-beta > 0`): a second, frozen copy of the policy's chunks;
- LoRA (models/flux/lora.py; rank r on the attention and MLP linears of every block, the
  recommended --lora-target-modules; base frozen: no main gradients or optimizer states for it;
  the KL reference is the base with adapters off, no copy; with --bf16 the frozen base's matrices
  in bf16). Frozen weights also change what autograd saves (`block_activation_values`).
"""
import dataclasses
from typing import Dict, List, Optional

from mm_grpo.encoders.latents import num_image_tokens
from mm_grpo.models.flux.config import FluxConfig
from mm_grpo.plan.devices import GB
from mm_grpo.settings import setting

TIME_CHANNELS = 256  # sinusoid width of the timestep / guidance embedders (models/flux/embeddings.py)
ADAM_STATES = 2  # exp_avg, exp_avg_sq


@dataclasses.dataclass(frozen=True)
class GRPOJob:
    """One GRPO iteration's shape, what FLUX's (`Job`) and Wan2.1's (`wan.VideoJob`) have alike: the
    group, the denoising and trained steps, the trainer's options; each adds its sample's size. Its
    fields with a help text are `mm-grpo plan`'s flags (--lora-rank: plan/flags.py, one or several)."""
    text_tokens: int = setting(512, "text tokens (FLUX: T5 max_sequence_length; Wan pads every prompt to "
                                    "umT5's text_len 512)", minimum=1)
    num_generations: int = setting(12, "G: images / videos per prompt", minimum=2)
    prompts_per_iteration: int = 1  # prompts per iteration, all data-parallel ranks together
    num_inference_steps: int = setting(16, "N: denoising steps", minimum=2)
    timestep_fraction: float = setting(0.6, "trained-step fraction (of the N - 1 steps: the last is dropped)")
    micro_batch_size: int = setting(1, "samples per forward/backward (Wan's WanDiT: 1)", minimum=1)
    lora_rank: int = 0  # 0: full fine-tuning
    recompute: bool = setting(True, "activation recompute, one block at a time")
    distributed_optimizer: bool = setting(True, "optimizer state (Adam moments, fp32 master weights) sharded "
                                                "over the data-parallel ranks")
    param_dtype: str = setting("fp32", "fp32: fp32 parameters (mm-grpo's FLUX trainer, bf16 autocast); bf16: "
                                       "Megatron's --bf16 (bf16 parameters, fp32 master weights and main "
                                       "gradients)", choices=("fp32", "bf16"))
    kl_reference: bool = setting(False, "--kl-beta > 0: a frozen reference copy (none with LoRA)")
    text_cache: bool = setting(True, "precomputed text embeddings (else the text encoders on every rank: "
                                     "T5-XXL + CLIP-L, umT5-XXL)")

    @property
    def batch(self) -> int:
        return self.num_generations * self.prompts_per_iteration

    @property
    def trained_steps(self) -> int:
        """K: DanceGRPO drops the last step and keeps int((N - 1) * fraction) (grpo/timesteps.py)."""
        return max(1, int((self.num_inference_steps - 1) * self.timestep_fraction))

    def on(self, layout: "Layout", group_per_dp_rank: bool = True) -> "GRPOJob":
        """The job a layout runs: one prompt group per data-parallel rank when `group_per_dp_rank`
        (no --prompts-per-iteration), else this one."""
        return dataclasses.replace(self, prompts_per_iteration=layout.dp) if group_per_dp_rank else self


def job_default(name: str, default):
    """GRPOJob's field `name`, its flag, help and checks, with another default: for a subclass
    whose recipe differs (a dataclass field is re-declared to change its default)."""
    field = next(x for x in dataclasses.fields(GRPOJob) if x.name == name)
    return dataclasses.field(default=default, metadata=field.metadata)


@dataclasses.dataclass(frozen=True)
class Job(GRPOJob):
    """FLUX text-to-image: GRPOJob and the image's size and compute dtype."""
    height: int = setting(1024, "image height", minimum=1)
    width: Optional[int] = setting(None, "image width (default: --height)")
    bf16: bool = setting(True, "bf16 compute (autocast)")

    def __post_init__(self):
        if self.width is None:
            object.__setattr__(self, "width", self.height)

    @property
    def image_tokens(self) -> int:
        return num_image_tokens(self.height, self.width)


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    sp: int = 1
    dp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.sp * self.dp


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


def dtype_bytes(name: str) -> int:
    return {"fp32": 4, "bf16": 2}[name]


def activation_bytes(job) -> int:
    """Bytes of one activation value (saved for backward, working set, communicated): the parameters'
    dtype, not the compute dtype. Megatron's parallel linears add their bias after the GEMM, outside
    autocast's cast, so with fp32 parameters (fp32 biases: mm-grpo's FLUX trainer, the LoRA base's
    biases too) the residual stream and every biased linear's output stay fp32 under bf16 autocast.
    Measured on one H100 (docs/scaling.md): FLUX.1-dev LoRA 64 at 512 px, micro-batch 12, recompute,
    peak 44.2 GiB; counted at 2 bytes the prediction was 35.2 GiB (-20%), at 4 bytes 43.7 (-1.2%)."""
    return dtype_bytes(job.param_dtype)


# --- parameters (count by hand: models/flux/layout.py's rules and the module shapes) ----------
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
def weights_bytes(base, lora, job):
    """Policy weights: base in the parameter dtype; LoRA adapters in fp32. With LoRA and bf16
    compute the trainer keeps the frozen base's matrices in bf16 (training/trainable.py
    `freeze_base_in_bf16`: autocast casts them anyway); its biases and norms stay fp32, less
    than 1 / D of the base, counted at 2 bytes here."""
    base_dtype = "bf16" if job.lora_rank and job.bf16 else job.param_dtype
    return base * dtype_bytes(base_dtype) + lora * 4


def trainable_params(base, lora, job):
    return lora if job.lora_rank else base


def main_grad_bytes(base, lora, job):
    """fp32 main gradients of the trainable parameters, unsharded (Megatron's DDP grad buffer,
    grad_reduce_in_fp32=True in training/optim.py)."""
    return 4 * trainable_params(base, lora, job)


def optimizer_bytes(base, lora, job, layout):
    """Adam's moments (8 bytes / trainable parameter) and, for bf16 parameters, fp32 master
    weights (4 bytes); the distributed optimizer shards them over DP x SP (Megatron: 18 bytes per
    parameter, or 6 + 12 / DP with the distributed optimizer)."""
    per_param = 4 * ADAM_STATES + (4 if job.param_dtype == "bf16" and not job.lora_rank else 0)
    shards = layout.dp * layout.sp if job.distributed_optimizer else 1
    return per_param * trainable_params(base, lora, job) / shards


def kl_reference_bytes(base, job):
    """A frozen second copy of the policy chunks (training/train_grpo.py builds one with
    `build_model_chunks` + `load_pretrained`); with LoRA the reference is the base itself."""
    return base * dtype_bytes(job.param_dtype) if job.kl_reference and not job.lora_rank else 0


def block_activation_values(config: FluxConfig, tp: int, lora_rank: int = 0):
    """Values per token saved for backward by one (double, single) block, its input included,
    counted from models/flux/blocks.py with torch's kernels (kernels.py) and a fused attention
    (no S x S scores; its output is laid out so that the flatten to [S, B, H*d] is a view).
    Replicated across TP ranks (no Megatron sequence parallelism): block input, layer-norm and
    modulation outputs, row-parallel outputs, residual stream; split by TP: q/k/v, QK-norm, RoPE,
    attention, MLP. Not saved: the RoPE inputs (multiplied by a constant table) and the
    concatenated q / k.
      double, per token of either stream: replicated 8D (input, ln1, mod1, attention proj out,
        residual, ln2, mod2, fc2 out), split 9D + 2F (qkv 3D, QK-norm x*rsqrt 2D, concatenated v D,
        RoPE q/k 2D, attention out D; fc1 out F, GELU out F) = 25D;
      single: replicated 4D (input, ln, mod, out), split 8D + 2F (fused [qkv | mlp] 3D + F,
        QK-norm 2D, RoPE q/k 2D, attention out D; GELU out F) = 20D.
    Checked against the tensors autograd saves (bench/bench_parallel_memory.py's meter: 25.3D and
    20.2D per token at D = 256, the rest being norm statistics). Megatron's per-layer count for
    GPT (sbh(10 + 24/t + 5as/(ht)), Korthikanti et al. table 2, without sequence parallelism) has
    the same replicated / split structure.

    With LoRA (`lora_rank` > 0) the base is frozen and autograd saves only what the gradient of
    an activation or an adapter needs: not the layer-norm outputs (inputs of `modulate`, whose
    scale comes from the frozen time embedding), nor the attention / MLP outputs multiplied by the
    frozen gates, nor the QK-norm's x*rsqrt (for its frozen weight); the inputs of the adapted
    linears stay (the adapters' A needs them), and each adapter adds its r-wide A x (for B):
      double 4D + 4r + (7D + 2F) / TP (input, mod1, residual, mod2; qkv, v, RoPE q/k, attention,
        fc1, GELU; A x of qkv, proj, fc1, fc2), single 2D + 2r + (6D + 2F) / TP.
    Checked against the tensors autograd saves (the same meter on one block with adapters of
    r = 8: 19.3D and 16.2D per token at D = 256)."""
    D, F, r = config.hidden_size, config.mlp_hidden_size, lora_rank
    if lora_rank:
        return 4 * D + 4 * r + (7 * D + 2 * F) / tp, 2 * D + 2 * r + (6 * D + 2 * F) / tp
    double = 8 * D + (9 * D + 2 * F) / tp
    single = 4 * D + (8 * D + 2 * F) / tp
    return double, single


def final_layer_values(config: FluxConfig, job: Job) -> float:
    """The last stage's head (models/flux/model.py FinalLayer), values per micro-batch sample: its
    input (the last block's output, all S tokens' storage) and the image tokens' layer-norm and
    modulation outputs (replicated); with LoRA only the input (the head's linears are frozen and
    not adapted, so neither output is needed for a gradient)."""
    S, I = job.text_tokens + job.image_tokens, job.image_tokens
    return (S + (0 if job.lora_rank else 2 * I)) * config.hidden_size


def _stage_blocks(config, layout, stage):
    start, end = _stage_range(config, layout.pp, stage)
    n_double = max(0, min(end, config.num_layers) - start)
    return n_double, end - start - n_double


def activation_bytes_per_microbatch(config, job, layout, stage):
    """Saved activations one micro-batch keeps on a stage until its backward: tokens split by SP
    (Ulysses keeps S/sp tokens per rank outside attention and S x heads/sp inside, the same
    count); with recompute only each block's input (D per token)."""
    tokens = (job.text_tokens + job.image_tokens) * job.micro_batch_size / layout.sp
    n_double, n_single = _stage_blocks(config, layout, stage)
    double, single = block_activation_values(config, layout.tp, job.lora_rank)
    if job.recompute:
        values = (n_double + n_single) * config.hidden_size
    else:
        values = n_double * double + n_single * single
    head = final_layer_values(config, job) * job.micro_batch_size / layout.sp if stage == layout.pp - 1 else 0
    return (tokens * values + head) * activation_bytes(job)


def recompute_bytes(config, job, layout, stage):
    """With recompute, one block's activations (less its input, already kept) exist while that
    block is recomputed for its backward, one micro-batch at a time."""
    if not job.recompute:
        return 0
    tokens = (job.text_tokens + job.image_tokens) * job.micro_batch_size / layout.sp
    n_double, n_single = _stage_blocks(config, layout, stage)
    double, single = block_activation_values(config, layout.tp, job.lora_rank)
    largest = max(double if n_double else 0, single if n_single else 0)
    return tokens * (largest - config.hidden_size) * activation_bytes(job)


# Gradients alive at the peak of a micro-batch's backward beyond the saved activations, in values
# per token of hidden size D: measured, the train-phase peak of the single-rank bench run less the
# held memory and the saved activations above (bench/plan_validate.py, docs/scaling.md): 3.9D.
BACKWARD_WORKING_VALUES_PER_TOKEN = 4


def backward_working_bytes(config, job, layout):
    """Activation gradients alive during the backward (the gradient of the block output and of the
    block being differentiated): BACKWARD_WORKING_VALUES_PER_TOKEN x D per token (a measured constant)."""
    tokens = (job.text_tokens + job.image_tokens) * job.micro_batch_size / layout.sp
    return tokens * BACKWARD_WORKING_VALUES_PER_TOKEN * config.hidden_size * activation_bytes(job)


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
    """No-grad forward of one micro-batch: the block input and output and the largest block
    intermediate alive at once, a single block's fused [qkv | mlp] ((3D + F) / tp) and its
    attention output (D / tp), per token."""
    D, F = config.hidden_size, config.mlp_hidden_size
    tokens = (job.text_tokens + job.image_tokens) * job.micro_batch_size / layout.sp
    return tokens * (3 * D + (4 * D + F) / layout.tp) * activation_bytes(job)


def vae_bytes(comps, job):
    """VAE weights (the whole AutoencoderKL is loaded, encoders/vae.py) in the compute dtype."""
    return comps.vae_params * (2 if job.bf16 else 4)


def vae_decode_bytes(comps, job, layout):
    """Decode of this rank's B images at once (encoders/vae.py decodes the batch in one call):
    B x H x W x values-per-pixel (measured constant, plan/frozen_parts.py) x element size."""
    B = job.batch // layout.dp
    return B * job.height * job.width * comps.vae_decode_values_per_pixel * (2 if job.bf16 else 4)


def reward_bytes(comps):
    return comps.reward_params * comps.reward_bytes_per_param


def text_encoder_bytes(comps, job):
    """T5-XXL + CLIP-L on the device when there is no text-embedding cache."""
    return 0 if job.text_cache else comps.text_encoder_params * (2 if job.bf16 else 4)


@dataclasses.dataclass
class RankMemory:
    """Memory of one rank (one pipeline stage): the terms and the peak of each phase."""
    terms: Dict[str, float]
    phases: Dict[str, float]

    @property
    def peak_bytes(self) -> float:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)


@dataclasses.dataclass
class LayoutMemory:
    stages: List[RankMemory]

    def for_stage(self, stage: int) -> RankMemory:
        return self.stages[stage]

    @property
    def worst(self) -> RankMemory:
        return max(self.stages, key=lambda m: m.peak_bytes)

    @property
    def peak_bytes(self) -> float:
        return self.worst.peak_bytes


def phase_memory(static: Dict[str, float], **working: float) -> RankMemory:
    """A rank's memory from the terms it holds throughout (`static`: weights, gradients, optimizer
    states, frozen parts) and its working sets (`working`, by name as stage_memory gives them): each
    phase's peak is the held terms and the working sets alive in it (FLUX's and Wan's alike)."""
    terms = dict(static, **working)
    held = sum(static.values())
    phases = {
        # Sampling: buffers of the whole rollout plus one micro-batch's no-grad forward.
        "rollout": held + terms["rollout_buffers"] + terms["rollout_forward"],
        # Decode + reward: the rollout's buffers are still alive (x0 is decoded).
        "decode": held + terms["rollout_buffers"] + terms["vae_decode"],
        # Training: the update's rows, the in-flight activations and one block's backward.
        "train": held + terms["rollout_buffers"] + terms["training_rows"] + terms["activations"]
        + terms["recompute_block"] + terms["backward_working"],
    }
    return RankMemory(terms, phases)


def stage_memory(config, comps, job, layout, stage) -> RankMemory:
    base, lora = stage_params(config, layout.tp, layout.pp, stage, job.lora_rank)
    static = {
        "weights": weights_bytes(base, lora, job),
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
                        backward_working=backward_working_bytes(config, job, layout),
                        training_rows=training_rows_bytes(config, job, layout),
                        rollout_buffers=rollout_buffer_bytes(config, job, layout),
                        rollout_forward=rollout_forward_working_bytes(config, job, layout),
                        vae_decode=vae_decode_bytes(comps, job, layout))


def rank_memory(config: FluxConfig, comps, job: Job, layout: Layout) -> LayoutMemory:
    return LayoutMemory([stage_memory(config, comps, job, layout, s) for s in range(layout.pp)])


def model_of(path_or_name) -> FluxConfig:
    """A preset name (flux-dev, flux-schnell, tiny) or a diffusers config.json / transformer folder."""
    from mm_grpo.models.flux.config import PRESETS
    if path_or_name in PRESETS:
        return FluxConfig.preset(path_or_name)
    import os
    if not os.path.exists(path_or_name):
        raise ValueError(f"unknown model {path_or_name!r}: a preset ({', '.join(PRESETS)}) or a diffusers "
                         f"config.json / transformer folder")
    return FluxConfig.from_diffusers_config(path_or_name)


# --- time ---------------------------------------------------------------------------------
def flux_forward_flops(config: FluxConfig, job: Job) -> float:
    """Matrix-product and attention FLOPs of one sample's forward (bench/flops.py's count)."""
    D, F, S = config.hidden_size, config.mlp_hidden_size, job.text_tokens + job.image_tokens
    double = 2 * S * (3 * D * D + D * D + 2 * D * F)
    single = 2 * S * (D * (3 * D + F) + (D + F) * D)
    attention = 4 * S * S * D
    embed = 2 * job.image_tokens * config.in_channels * D + 2 * job.text_tokens * config.joint_attention_dim * D + \
        2 * job.image_tokens * D * config.output_channels
    return config.num_layers * (double + attention) + config.num_single_layers * (single + attention) + embed


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


@dataclasses.dataclass
class IterationTime:
    parts: Dict[str, float]

    @property
    def seconds(self) -> float:
        return sum(self.parts.values())


COMPUTE_PARTS = ("rollout", "train", "decode_reward", "text_encode")  # the rest of IterationTime.parts: comm


def comm_seconds(parts: Dict[str, float]) -> float:
    """The communication of an iteration (`IterationTime.parts`): every part but the compute ones."""
    return sum(v for k, v in parts.items() if k not in COMPUTE_PARTS)


def _bw(device, span: int):
    """Bandwidth of a group whose ranks span `span` consecutive ranks (Megatron orders TP, SP
    (context), DP, PP from the innermost): within a node when the span fits one."""
    return device.intra_node_bw if span <= device.devices_per_node else device.inter_node_bw


def iteration_time(config, comps, job, layout, device, mfu: float = 0.4) -> IterationTime:
    """Seconds of one iteration on the slowest rank: compute at `mfu` x peak (an assumption, not a
    measurement: --mfu), plus communication at the device profile's bandwidths, not overlapped.
    Rollout: B samples x N forwards, the pipeline filled once per micro-batch sweep; train: K rows
    per sample forward + backward (backward = 2 forwards, 1 with LoRA; recompute adds one), the 1F1B bubble
    (pp - 1) / m of it; decode + reward once per sample."""
    B, N, K = job.batch // layout.dp, job.num_inference_steps, job.trained_steps
    flops_per_s = device.peak_bf16_flops * mfu
    model_par = layout.tp * layout.sp * layout.pp
    fwd = flux_forward_flops(config, job)
    mbs = job.micro_batch_size
    fill = (layout.pp - 1) / max(1, B // mbs)
    rollout = B * N * fwd / model_par / flops_per_s * (1 + fill)
    m = micro_batches_per_update(job, layout)
    # forward + backward (input and weight gradients, 2 forwards; LoRA: the frozen base's weight
    # gradients are not computed, 1 forward) + the recompute forward
    train_factor = (2 if job.lora_rank else 3) + (1 if job.recompute else 0)
    train = B * K * fwd * train_factor / model_par / flops_per_s * (1 + (layout.pp - 1) / m)
    decode = B * vae_decode_flops(job) / flops_per_s + B * 2 * comps.reward_params * 257 / flops_per_s
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
        tp_comm = passes * blocks_per_stage * volume / _bw(device, layout.tp)
    if layout.sp > 1:  # Ulysses: q, k, v to heads and the output back, all-to-all of (sp-1)/sp
        volume = 4 * tokens / layout.sp * D / layout.tp * bytes_ * (layout.sp - 1) / layout.sp
        sp_comm = passes * blocks_per_stage * volume / _bw(device, layout.tp * layout.sp)
    if layout.pp > 1:  # one [S/sp + 1, m, D] tensor per stage boundary and pass
        volume = (tokens / layout.sp + mbs) * D * bytes_
        pp_comm = passes * volume / _bw(device, layout.world)
    dp_group = layout.dp * layout.sp
    if dp_group > 1:  # fp32 gradients: all-reduce, or reduce-scatter + parameter all-gather
        base, lora = stage_params(config, layout.tp, layout.pp, 0, job.lora_rank)
        volume = 4 * trainable_params(base, lora, job) * 2 * (dp_group - 1) / dp_group
        dp_comm = volume / _bw(device, layout.tp * layout.sp * layout.dp)
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


# --- a layout's row of `mm-grpo plan` (FLUX's and Wan's) -----------------------------------------
def measured_row(row: dict, memory: LayoutMemory, time: IterationTime, device, per_sample: str) -> dict:
    """`row` (a layout's, with its `batch`) given its worst rank's memory and the iteration's seconds:
    the peak and its phase, the terms, the seconds in all, per sample (the key `per_sample`) and by
    part; whether the peak fits `device`, and if not, why: the three largest terms."""
    worst = memory.worst
    row.update(peak_bytes_per_rank=int(worst.peak_bytes), peak_phase=worst.peak_phase,
               terms_bytes={k: int(v) for k, v in worst.terms.items()},
               seconds_per_iteration=time.seconds, **{per_sample: time.seconds / row["batch"]},
               seconds=dict(time.parts))
    row["fits"] = worst.peak_bytes <= device.memory_bytes
    if not row["fits"]:
        big = sorted(((v, k) for k, v in worst.terms.items() if k != "activations_per_microbatch"),
                     reverse=True)[:3]
        row["reason"] = (f"{worst.peak_bytes / GB:.1f} GB > {device.memory_bytes / GB:.0f} GB in "
                         f"{worst.peak_phase}; largest: " + ", ".join(f"{k} {v / GB:.1f}" for v, k in big))
    return row


def ranked(rows: List[dict], per_sample: str) -> List[dict]:
    """The fitting rows by seconds per sample (the key `per_sample`), then the others by memory."""
    return sorted(rows, key=lambda r: (not r["fits"], r[per_sample] if r["fits"] else
                                       (r["peak_bytes_per_rank"] or float("inf"))))
