"""Per-rank memory and seconds per iteration of a GRPO run of Qwen-Image under TP x PP x SP x DP.

Every term is a named function below, counted by hand from mm-grpo's Qwen-Image code (the file it
follows is named) or a measured constant (named where defined, with how it was measured); the
shared terms (main gradients, Adam's states, the KL reference, the rewards, a rank's phases) are
mm_grpo/plan/formulas.py's. tests/test_qwen_image_plan.py holds the counts to the built model.
Units: bytes and seconds. Notation: D hidden size (24 heads x 128), F MLP width (4D), d head dim,
H heads, J the prompt features' width (Qwen2.5-VL-7B's 3584), S = T + I tokens of the joint sequence
(T text, I = (height / 16)(width / 16) image), C the transformer's latent channels (16 VAE channels
packed 2 x 2: 64), B samples per data-parallel rank, m micro-batch size, N denoising steps, K trained
steps per sample, tp/pp/sp/dp the layout, c the bytes of one value in the compute dtype (2 under
--bf16), g the transformer's passes per sample and step: 2 under true CFG, else 1.

The model (transformer/model.py, blocks.py): dual-stream blocks (60 in the 20B), each with its own
weights per stream (text, image) and one joint attention over [text ; image]. A block is FLUX's
double block in structure (the same layers, mm_grpo/layers.py), so its terms have the same form; the
model's last block leaves the text stream after attention (its text projection and MLP feed nothing).

True CFG (denoiser.py): with --true-cfg-scale > 1 every velocity of the rollout and of the trained
steps is one call of 2 x the samples (conditional and unconditional, the negative prompt padded to
the prompts' length): g = 2 doubles the tokens a micro-batch runs, its activations and its FLOPs.

What the trainer holds is assumed to be what it holds for FLUX (mm_grpo/training: parameters fp32,
fp32 main gradients, Adam sharded over DP x SP by the distributed optimizer; LoRA on the attention
and MLP linears of both streams with the frozen base in bf16 under --bf16, as FLUX's lora.py).
Qwen-Image's trainer and LoRA are not built yet (docs/qwen_image.md): these are its plan.

Time: each phase's FLOPs at --mfu x the device's peak (an assumption: nothing of Qwen-Image is
measured on an accelerator yet), plus communication at the device profile's bandwidths.
"""
import dataclasses
import os
from typing import Dict, List, NamedTuple, Optional

from mm_grpo.families.qwen_image.denoiser import PATCH, VAE_SCALE_FACTOR, QwenImageGuidance, token_grid
from mm_grpo.families.qwen_image.transformer.config import PRESETS, QwenImageConfig
from mm_grpo.families.qwen_image.transformer.embeddings import TIME_CHANNELS
from mm_grpo.files.jsonfile import load_json
from mm_grpo.plan.formulas import (GRPOJob, IterationTime, Layout, LayoutMemory, RankMemory, bandwidth, dtype_bytes,
                                   kl_reference_bytes, main_grad_bytes, optimizer_bytes, phase_memory, reward_bytes,
                                   trainable_params)
from mm_grpo.plan.frozen_parts import Components, reward_params
from mm_grpo.settings import setting

# `--model` names: the 20B model and the test preset (FLUX's planner already answers to "tiny").
MODELS = {"qwen-image": "qwen-image", "qwen-image-tiny": "tiny"}
DIFFUSERS_CLASS = "QwenImageTransformer2DModel"
# QwenImagePipeline's tokenizer_max_length: it refuses a longer max_sequence_length.
MAX_TEXT_TOKENS = 1024
# Prompt features per prompt: the prompt's own Qwen2.5-VL tokens plus the template's closing 5
# ("<|im_end|>", "\n", "<|im_start|>", "assistant", "\n"; the system prefix is dropped), padded to the
# batch's longest. 256: a detailed prompt (Qwen-Image's model-card example is about 100 tokens; a
# rewritten, enhanced prompt a few hundred); the pipeline's __call__ cuts at max_sequence_length 512.
TEXT_TOKENS = 256


def _guidance_field(name: str):
    """QwenImageGuidance's setting `name` (its default, flag, help and bounds), the trainer's flag."""
    field = next(f for f in dataclasses.fields(QwenImageGuidance) if f.name == name)
    return dataclasses.field(default=field.default, metadata=field.metadata)


@dataclasses.dataclass(frozen=True)
class Job(GRPOJob):
    """Qwen-Image text-to-image: GRPOJob and the image's size, the compute dtype and true CFG."""
    text_tokens: int = setting(TEXT_TOKENS, f"T: prompt feature tokens, the prompt's Qwen2.5-VL tokens + 5 of the "
                                            f"template (at most {MAX_TEXT_TOKENS}; default a detailed prompt)",
                               minimum=1)
    text_cache: bool = setting(True, "precomputed Qwen2.5-VL features (else Qwen2.5-VL-7B on every rank)")
    height: int = setting(1024, "image height (a multiple of 16: VAE 8 x 2 x 2 packing)", minimum=1)
    width: Optional[int] = setting(None, "image width (default: --height)")
    bf16: bool = setting(True, "bf16 compute: activations, the residual stream and every GEMM's output in bf16 "
                               "(transformer/model.py compute_dtype)")
    true_cfg_scale: float = _guidance_field("true_cfg_scale")

    def __post_init__(self):
        if self.width is None:
            object.__setattr__(self, "width", self.height)

    @property
    def image_tokens(self) -> int:
        rows, columns = token_grid(self.height, self.width)
        return rows * columns

    @property
    def passes(self) -> int:
        """g: the transformer's samples per sample and step, 2 under true CFG (one call of 2 x the samples)."""
        return 2 if self.true_cfg_scale > 1 else 1


def check_job(job: Job):
    """One line for a job no layout can run: an image size the latent packing does not divide, a
    prompt longer than the pipeline takes."""
    token_grid(job.height, job.width)
    if job.text_tokens > MAX_TEXT_TOKENS:
        raise ValueError(f"--text-tokens {job.text_tokens} is more than Qwen-Image's {MAX_TEXT_TOKENS} "
                         f"(QwenImagePipeline's tokenizer_max_length)")


def check_layout(config: QwenImageConfig, job: Job, layout: Layout):
    """Why a layout cannot run at all (None if it can), as one line: model.py's check_parallel_sizes,
    the blocks per stage, the batch per data-parallel rank. Ulysses pads the text and the image
    tokens (parallel/ulysses.py), so SP needs no token count to divide."""
    if config.num_attention_heads % (layout.tp * layout.sp):
        return f"{config.num_attention_heads} heads do not split over TP x SP = {layout.tp * layout.sp}"
    if config.num_blocks < layout.pp:
        return f"{config.num_blocks} blocks cannot fill PP {layout.pp} stages"
    per_rank = job.batch // layout.dp if job.batch % layout.dp == 0 else 0
    if not per_rank or per_rank % job.micro_batch_size:
        return f"batch {job.batch} does not split into DP {layout.dp} x micro-batch {job.micro_batch_size}"
    return None


def activation_bytes(job: Job) -> int:
    """c: bytes of one activation value, the compute dtype's (model.py compute_dtype: bf16 under
    --bf16, else the parameters' dtype)."""
    return 2 if job.bf16 or job.param_dtype == "bf16" else 4


# --- parameters (counted from transformer/blocks.py, model.py, layout.py's TP rules) --------------
class Linear(NamedTuple):
    """One linear + bias: its shape, its TP split (layout.py: column, row or replicated) and whether
    LoRA adapts it (the attention and MLP linears, FLUX's recommended targets; not the modulation)."""
    fan_in: int
    fan_out: int
    shard: str
    adapted: bool = False

    def params(self, tp: int) -> int:
        """On one TP rank: column splits weight and bias, row the weight (its bias replicated)."""
        if self.shard == "column":
            return (self.fan_in * self.fan_out + self.fan_out) // tp
        if self.shard == "row":
            return self.fan_in * self.fan_out // tp + self.fan_out
        return self.fan_in * self.fan_out + self.fan_out

    def matrix(self, tp: int) -> int:
        """The weight's share on one TP rank (what a bf16 cast copies)."""
        return self.fan_in * self.fan_out // (1 if self.shard == "replicated" else tp)

    def adapter(self, tp: int, r: int) -> int:
        """LoRA's A [r, in] and B [out, r] on one TP rank, the split side of each split like the
        base weight (column: B's rows; row: A's columns)."""
        if not (self.adapted and r):
            return 0
        if self.shard == "column":
            return r * (self.fan_in + self.fan_out // tp)
        return r * (self.fan_in // tp + self.fan_out)


def modulation_linear(config: QwenImageConfig) -> Linear:
    """A stream's adaLN modulation: 6 vectors (shift, scale, gate for attention, then the MLP) per sample."""
    return Linear(config.hidden_size, 6 * config.hidden_size, "column")


def attention_linears(config: QwenImageConfig) -> List[Linear]:
    """A stream's fused q / k / v."""
    return [Linear(config.hidden_size, 3 * config.hidden_size, "column", True)]


def tail_linears(config: QwenImageConfig) -> List[Linear]:
    """A stream's linears after the joint attention: the output projection and the MLP."""
    D, F = config.hidden_size, config.mlp_hidden_size
    return [Linear(D, D, "row", True), Linear(D, F, "column", True), Linear(F, D, "row", True)]


def stream_linears(config: QwenImageConfig, text_out: bool = True) -> List[Linear]:
    """One stream's linears a block runs: all, but for the model's last block's text stream
    (`text_out=False`), which holds its tail and runs none of it."""
    return [modulation_linear(config)] + attention_linears(config) + (tail_linears(config) if text_out else [])


def block_norms(config: QwenImageConfig) -> int:
    """A block's QK RMSNorm weights: q and k of each stream, head_dim each, replicated."""
    return 2 * 2 * config.attention_head_dim


def block_params(config: QwenImageConfig, tp: int, lora_rank: int = 0):
    """(base parameters, LoRA adapter parameters) of one block on one TP rank: both streams' linears
    (the last block holds the same; its text tail runs nothing) and the QK-norm weights."""
    linears = 2 * stream_linears(config)
    return (sum(x.params(tp) for x in linears) + block_norms(config),
            sum(x.adapter(tp, lora_rank) for x in linears))


def embedder_linears(config: QwenImageConfig) -> List[Linear]:
    """The first stage's linears, replicated (model.py): img_in, txt_in and the timestep MLP."""
    D = config.hidden_size
    return [Linear(config.in_channels, D, "replicated"), Linear(config.joint_attention_dim, D, "replicated"),
            Linear(TIME_CHANNELS, D, "replicated"), Linear(D, D, "replicated")]


def head_linears(config: QwenImageConfig) -> List[Linear]:
    """The last stage's: AdaLayerNormContinuous's modulation (column) and proj_out (replicated)."""
    D = config.hidden_size
    return [Linear(D, 2 * D, "column"), Linear(D, config.output_channels, "replicated")]


def stage_blocks(num_blocks: int, pp: int) -> List[int]:
    """Blocks per pipeline stage: even when PP divides the blocks (chunks.py's resolve_pp_layers),
    else the remainder one block each on the last stages (the first holds the embedders and the most
    micro-batches in flight); such a split is the trainer's pp_layers."""
    return [num_blocks // pp + (1 if s >= pp - num_blocks % pp else 0) for s in range(pp)]


def stage_range(config: QwenImageConfig, pp: int, stage: int):
    counts = stage_blocks(config.num_blocks, pp)
    start = sum(counts[:stage])
    return start, start + counts[stage]


def stage_params(config: QwenImageConfig, tp: int, pp: int, stage: int, lora_rank: int = 0):
    """(base parameters, LoRA parameters) of pipeline stage `stage` on one TP rank: its blocks, the
    embedders and the prompt features' RMSNorm (J) on the first, the head on the last."""
    start, end = stage_range(config, pp, stage)
    block, adapters = block_params(config, tp, lora_rank)
    base, lora = (end - start) * block, (end - start) * adapters
    if stage == 0:
        base += sum(x.params(tp) for x in embedder_linears(config)) + config.joint_attention_dim
    if stage == pp - 1:
        base += sum(x.params(tp) for x in head_linears(config))
    return base, lora


def total_params(config: QwenImageConfig) -> int:
    return stage_params(config, 1, 1, 0)[0]


def fp32_norm_params(config: QwenImageConfig, pp: int, stage: int) -> int:
    """The 1-D norm weights a frozen bf16 base keeps in fp32 (FLUX's lora.freeze_base_in_bf16 casts
    matrices and biases): the blocks' QK norms and, on the first stage, the features' RMSNorm."""
    start, end = stage_range(config, pp, stage)
    return (end - start) * block_norms(config) + (config.joint_attention_dim if stage == 0 else 0)


# --- memory terms ---------------------------------------------------------------------------
def weights_bytes(base, lora, job: Job, fp32_norms: int = 0):
    """Policy weights: base in the parameter dtype, LoRA adapters fp32; with LoRA and bf16 compute
    the frozen base in bf16 but its norm weights (`fp32_norms`)."""
    if job.lora_rank and job.bf16:
        return 2 * base + 2 * fp32_norms + 4 * lora
    return base * dtype_bytes(job.param_dtype) + lora * 4


# fp32 statistics autograd keeps inside a block whatever the compute dtype: per head and token the
# rsqrt of q's and of k's mean square (kernels.qk_norm_rope_torch keeps only these and q / k) and
# attention's log-sum-exp (3); per LayerNorm and token its mean and rstd (2; bf16 on CPU).
HEAD_STATS_PER_BLOCK = 3
LAYER_NORM_STATS = 2
FP32 = 4


class BlockBytes(NamedTuple):
    """Bytes per token one block saves for its backward: `attention` up to and with the joint
    attention (every token of both streams), `tail` the output projection and the MLP (every token
    but the last block's text tokens)."""
    attention: float
    tail: float

    def of(self, text: float, image: float, text_out: bool = True) -> float:
        """The block's bytes for `text` and `image` tokens."""
        return (text + image) * self.attention + ((text if text_out else 0) + image) * self.tail


def block_activation_bytes(config: QwenImageConfig, tp: int, lora_rank: int = 0, value_bytes: int = 2) -> BlockBytes:
    """Bytes per token saved for backward by one dual-stream block (blocks.py with torch's eager
    kernels: a fused attention, no S x S scores; kernels.qk_norm_rope_torch), values at c =
    `value_bytes`, statistics at 4; a view of a saved tensor costs nothing (q / k / v are views of
    the qkv output, the attention output's flatten is one). Replicated over TP: the block input,
    layer-norm and modulation outputs, row-parallel outputs and the residual stream; split by TP:
    qkv, the concatenated q / k and v, attention, MLP.
      attention, per token of either stream: replicated 3D c (input, ln1, mod1); split 7D c / tp
        (qkv 3D, the streams' normalised and rotated q / k concatenated 2D, v concatenated D,
        attention out D) + 3H x 4 / tp; one LayerNorm's statistics 2 x 4;
      tail: replicated 5D c (attention projection out, residual, ln2, mod2, fc2 out); split 2F c / tp
        (fc1 out, GELU out); 2 x 4.
    The sum is FLUX's double block (8D c + (7D + 2F) c / tp + 3H x 4 / tp + 16): 46.2 bytes per token
    per hidden unit under bf16 at D = 256, 4 heads, 92.3 in fp32 (the meter in the test).
    With LoRA the base is frozen: no layer-norm outputs (inputs of `modulate`, whose scale comes from
    the frozen timestep embedding) nor the gated outputs; the adapted linears' inputs stay (A needs
    them) and each adapter adds its r-wide A x: attention (2D + r) c (input, mod1; qkv's A x), tail
    (2D + 3r) c (residual, mod2; A x of the projection, fc1, fc2), the split parts as above."""
    D, F, r, c = config.hidden_size, config.mlp_hidden_size, lora_rank, value_bytes
    ln_stats = LAYER_NORM_STATS * FP32
    head_stats = HEAD_STATS_PER_BLOCK * config.num_attention_heads / tp * FP32
    attention = ((2 * D + r) if r else 3 * D) * c + 7 * D / tp * c + head_stats + ln_stats
    tail = ((2 * D + 3 * r) if r else 5 * D) * c + 2 * F / tp * c + ln_stats
    return BlockBytes(attention, tail)


# Bytes per token and hidden unit alive at the peak of a recomputed block's forward + backward beyond
# its recomputed saved activations (less the input) and its output, by (c, LoRA): the live-tensor
# meter on one block (D = 256, 4 heads, LoRA r = 8, the slope between 512 and 1024 image tokens at
# 64 text tokens; tests/test_qwen_image_plan.py measures it again). The same as FLUX's double block's
# (the same layers): the gradients of the MLP's F-wide activations, with LoRA the frozen linear's
# and the adapter's contributions alive at once. Split by TP as the MLP's width is.
BACKWARD_WORKING_BYTES_PER_TOKEN = {(2, False): 12.0, (2, True): 19.9, (4, False): 24.0, (4, True): 39.9}


def weight_cast_bytes(job: Job, params) -> float:
    """bf16 copies of trainable fp32 weights autograd saves: under --bf16 with fp32 parameters every
    call casts a trainable weight to bf16 (layers.py `linear`), and the product keeps the copy for
    its input's gradient: 2 bytes per matrix value `params` a forward runs with a gradient."""
    return 2 * params if job.bf16 and job.param_dtype == "fp32" else 0


def _tokens(job: Job, layout: Layout):
    """(text, image) tokens of one micro-batch on a rank: g x m samples, SP's share (Ulysses keeps
    S / sp tokens per rank outside attention and S x heads / sp inside, the same count)."""
    samples = job.passes * job.micro_batch_size / layout.sp
    return job.text_tokens * samples, job.image_tokens * samples


def trainable_block_matrices(config: QwenImageConfig, job: Job, layout: Layout, text_out: bool = True) -> int:
    """The trainable matrix values one block's forward casts (`weight_cast_bytes`): its linears' (the
    last block's text tail runs none), or with LoRA its adapters'."""
    linears = stream_linears(config) + stream_linears(config, text_out)
    if job.lora_rank:
        return sum(x.adapter(layout.tp, job.lora_rank) for x in linears)
    return sum(x.matrix(layout.tp) for x in linears)


def embedder_bytes(config: QwenImageConfig, job: Job, layout: Layout) -> float:
    """What the first stage's embedders save (model.py `embed`), full fine-tuning only (with LoRA they
    are frozen and their inputs need no gradient): for txt_norm's weight gradient the RMS-normalised
    prompt features, in fp32 with an fp32 weight (kernels.rms_norm_torch's statistics are fp32, so is
    its product), their cast to c (txt_in's input; the same tensor when c is theirs), img_in's input,
    and the bf16 copies of the embedders' weights."""
    if job.lora_rank:
        return 0
    text, image = _tokens(job, layout)
    c, normalised = activation_bytes(job), dtype_bytes(job.param_dtype)
    J = config.joint_attention_dim
    casts = weight_cast_bytes(job, sum(x.matrix(layout.tp) for x in embedder_linears(config)))
    return text * J * (normalised + (c if c != normalised else 0)) + image * config.in_channels * c + casts


def head_bytes(config: QwenImageConfig, job: Job, layout: Layout) -> float:
    """What the last stage's head (model.py FinalLayer) saves per micro-batch: its input, the image
    tokens of the last block's output (a view: the whole [S, D] storage), their LayerNorm's
    statistics; with full fine-tuning the layer-norm and modulation outputs and the bf16 copies of
    its trainable weights too (with LoRA it is frozen and not adapted: neither is needed)."""
    text, image = _tokens(job, layout)
    c, D = activation_bytes(job), config.hidden_size
    saved = (text + image) * D * c + image * LAYER_NORM_STATS * FP32
    if job.lora_rank:
        return saved
    return saved + 2 * image * D * c + weight_cast_bytes(job, sum(x.matrix(layout.tp) for x in head_linears(config)))


def activation_bytes_per_microbatch(config: QwenImageConfig, job: Job, layout: Layout, stage: int) -> float:
    """Saved activations one micro-batch keeps on a stage until its backward: every block's
    (`block_activation_bytes`; the model's last block without its text tail) with the bf16 copies of
    its trainable weights (`weight_cast_bytes`), the embedders' on the first stage and the head's on
    the last; with recompute each block only its input (D c per token)."""
    text, image = _tokens(job, layout)
    c = activation_bytes(job)
    start, end = stage_range(config, layout.pp, stage)
    blocks = end - start
    last = int(stage == layout.pp - 1 and blocks > 0)  # the model's last block: no text tail
    if job.recompute:
        saved = blocks * (text + image) * config.hidden_size * c
    else:
        per_token = block_activation_bytes(config, layout.tp, job.lora_rank, c)
        saved = ((blocks - last) * per_token.of(text, image) + last * per_token.of(text, image, text_out=False)
                 + weight_cast_bytes(job, (blocks - last) * trainable_block_matrices(config, job, layout)
                                     + last * trainable_block_matrices(config, job, layout, text_out=False)))
    first = embedder_bytes(config, job, layout) if stage == 0 else 0
    head = head_bytes(config, job, layout) if stage == layout.pp - 1 else 0
    return saved + first + head


def activations_at_peak(config: QwenImageConfig, job: Job, layout: Layout, stage: int) -> float:
    """Saved activations alive at the training's peak, the backward of a block: the in-flight
    micro-batches' (`in_flight_microbatches`), less the head's of the one being differentiated (its
    backward comes first and frees them)."""
    head = head_bytes(config, job, layout) if stage == layout.pp - 1 else 0
    return activation_bytes_per_microbatch(config, job, layout, stage) * in_flight_microbatches(job, layout, stage) \
        - head


def recompute_bytes(config: QwenImageConfig, job: Job, layout: Layout) -> float:
    """With recompute, one block's activations (less its input, already kept) and the bf16 copies of
    its trainable weights exist while it is recomputed for its backward, one micro-batch at a time.
    By the peak, the image MLP's backward, the text stream's tail has been differentiated and its
    copies freed: the block's copies less those (at D = 256 under bf16, 3.62 MB alive at the peak,
    3.54 counted)."""
    if not job.recompute:
        return 0
    text, image = _tokens(job, layout)
    c = activation_bytes(job)
    saved = block_activation_bytes(config, layout.tp, job.lora_rank, c).of(text, image)
    return saved - (text + image) * config.hidden_size * c + weight_cast_bytes(
        job, trainable_block_matrices(config, job, layout, text_out=False))


def backward_working_bytes(config: QwenImageConfig, job: Job, layout: Layout) -> float:
    """Activation gradients alive during a block's backward beyond its saved activations:
    BACKWARD_WORKING_BYTES_PER_TOKEN x D / TP per token (measured)."""
    text, image = _tokens(job, layout)
    per_unit = BACKWARD_WORKING_BYTES_PER_TOKEN[activation_bytes(job), bool(job.lora_rank)]
    return (text + image) * per_unit * config.hidden_size / layout.tp


def in_flight_microbatches(job: Job, layout: Layout, stage: int) -> int:
    """1F1B keeps pp - stage micro-batches' activations on a stage (Megatron), fewer when there are
    fewer micro-batches."""
    return min(layout.pp - stage, micro_batches_per_update(job, layout)) if layout.pp > 1 else 1


def micro_batches_per_update(job: Job, layout: Layout) -> int:
    return job.trained_steps * (job.batch // layout.dp) // job.micro_batch_size


def rollout_forward_working_bytes(config: QwenImageConfig, job: Job, layout: Layout) -> float:
    """No-grad forward of one micro-batch (g x m samples), at its peak, the image stream's fc2 in a
    block (blocks.py: the block's locals live until it returns): per token of both streams the
    attention's tensors, split by TP, 9D (qkv 3D, which v views, the normalised q / k of each stream
    2D, their concatenation 2D, v's D, attention out D); per image token, replicated, the block input,
    the attention projection out, the new residual, the MLP input and output (5D), with LoRA the
    adapter's addmm output beside the frozen linear's and fc2's r-wide A x (D + r), split the fc1 and
    GELU outputs (2F); per text token its block input (D); all at c; with full fine-tuning under
    --bf16 the bf16 copy of fc2's weight. Equal to the meter's peak of a no-grad block forward
    (44 bytes per token per hidden unit at D = 256 in bf16, 46.1 with LoRA r = 8; the test)."""
    D, F, r, c = config.hidden_size, config.mlp_hidden_size, job.lora_rank, activation_bytes(job)
    text, image = _tokens(job, layout)
    live = ((text + image) * 9 * D / layout.tp + image * (5 * D + (D + r if r else 0) + 2 * F / layout.tp)
            + text * D)
    cast = 0 if job.lora_rank else weight_cast_bytes(job, D * F / layout.tp)
    return live * c + cast


def latent_values(config: QwenImageConfig, job: Job) -> int:
    """Elements of one sample's packed latent: I x C."""
    return job.image_tokens * config.in_channels


def rollout_buffer_bytes(config: QwenImageConfig, job: Job, layout: Layout) -> float:
    """The rollout of this rank's B samples (grpo/schedule.py, rollout/), fp32: latents of every step
    (N + 1), step noise (N), initial noise and x0 (2), and the per-sample prompt features [T, J] (rows
    of the cache; their mask is T small integers); under true CFG the negative prompt's once."""
    B, N = job.batch // layout.dp, job.num_inference_steps
    latents = B * ((N + 1) + N + 2) * latent_values(config, job)
    cond = (B + (1 if job.passes > 1 else 0)) * job.text_tokens * config.joint_attention_dim
    return FP32 * (latents + cond)


def training_rows_bytes(config: QwenImageConfig, job: Job, layout: Layout) -> float:
    """The trained rows of an update, built at once (schedule.micro_batches), fp32: per (sample,
    trained step) x_t and x_t+1 (and the KL reference's mean) and the sample's features."""
    rows = job.trained_steps * job.batch // layout.dp
    per_row = (3 if job.kl_reference else 2) * latent_values(config, job) + job.text_tokens * config.joint_attention_dim
    return FP32 * rows * per_row


def vae_bytes(comps: Components, job: Job) -> float:
    """The whole AutoencoderKLQwenImage (vae.py loads it) in the compute dtype."""
    return comps.vae_params * (2 if job.bf16 else 4)


def vae_decode_bytes(comps: Components, job: Job, layout: Layout) -> float:
    """Decode of this rank's B images in one call (grpo/schedule.py hands the decoder the batch;
    vae.py's VaeDecoder decodes it at once): B x H x W x values per pixel (measured constant) x c."""
    B = job.batch // layout.dp
    return B * job.height * job.width * comps.vae_decode_values_per_pixel * (2 if job.bf16 else 4)


def text_encoder_bytes(comps: Components, job: Job) -> float:
    """Qwen2.5-VL-7B on the device when there is no feature cache."""
    return 0 if job.text_cache else comps.text_encoder_params * (2 if job.bf16 else 4)


def stage_memory(config: QwenImageConfig, comps: Components, job: Job, layout: Layout, stage: int) -> RankMemory:
    base, lora = stage_params(config, layout.tp, layout.pp, stage, job.lora_rank)
    static = {
        "weights": weights_bytes(base, lora, job, fp32_norm_params(config, layout.pp, stage)),
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
                        activations=activations_at_peak(config, job, layout, stage),
                        recompute_block=recompute_bytes(config, job, layout),
                        backward_working=backward_working_bytes(config, job, layout),
                        training_rows=training_rows_bytes(config, job, layout),
                        rollout_buffers=rollout_buffer_bytes(config, job, layout),
                        rollout_forward=rollout_forward_working_bytes(config, job, layout),
                        vae_decode=vae_decode_bytes(comps, job, layout))


def rank_memory(config: QwenImageConfig, comps: Components, job: Job, layout: Layout) -> LayoutMemory:
    return LayoutMemory([stage_memory(config, comps, job, layout, s) for s in range(layout.pp)])


# --- time ---------------------------------------------------------------------------------
class SampleFlops(NamedTuple):
    """Matrix-product and attention FLOPs of one pass of one sample (one of g under true CFG)."""
    forward: float
    backward: float


def _mm(rows, fan_in, fan_out) -> float:
    """2 FLOPs per multiply-add."""
    return 2 * rows * fan_in * fan_out


def sample_flops(config: QwenImageConfig, job: Job) -> SampleFlops:
    """FLOPs of every linear (token-wise, and the per-sample modulation and timestep vectors) and of
    attention's two products over the joint sequence (4 S^2 D per block; the prompts' padding is
    computed and masked), LoRA's adapters included, element-wise work left out; the last block's text
    stream runs its q / k / v only. Backward: full fine-tuning twice the forward less the products
    whose inputs need no gradient (img_in and the timestep MLP's first layer: weight gradients only;
    txt_in's input gradient feeds the features' RMSNorm weight); LoRA on a frozen base the input
    gradients of the token linears but the first block's qkv (nothing before it needs one),
    attention's twice, and the adapters' weight and input gradients (the first one's input gradient
    left out too)."""
    D, T, I, r = config.hidden_size, job.text_tokens, job.image_tokens, job.lora_rank
    S, L = T + I, config.num_blocks
    per_token = attention_linears(config) + tail_linears(config)  # one token through one stream of a block

    def linears(rows, which):
        return sum(_mm(rows, x.fan_in, x.fan_out) for x in which)

    def adapters(rows, which):
        return sum(_mm(rows, x.fan_in, r) + _mm(rows, r, x.fan_out) for x in which if x.adapted) if r else 0

    blocks = linears(L * S, per_token) - linears(T, tail_linears(config))  # the last block's text tail
    lora = adapters(L * S, per_token) - adapters(T, tail_linears(config))
    embed_in = _mm(I, config.in_channels, D) + _mm(T, config.joint_attention_dim, D)
    head = _mm(I, D, config.output_channels)
    time_first = _mm(1, TIME_CHANNELS, D)
    vectors = time_first + _mm(1, D, D) + L * 2 * _mm(1, D, 6 * D) + _mm(1, D, 2 * D)
    attention = L * 2 * _mm(S, S, D)
    forward = blocks + embed_in + head + vectors + attention + lora
    if r:
        backward = blocks + head - _mm(S, D, 3 * D) + 2 * attention + 2 * lora - _mm(S, D, r)
    else:
        backward = 2 * forward - _mm(I, config.in_channels, D) - time_first
    return SampleFlops(forward, backward)


def vae_decode_flops(job: Job) -> float:
    """One image through AutoencoderKLQwenImage's decoder: its convolutions per output pixel (measured)
    and the middle attention over the h x w latent (one head of VAE_MIDDLE_CHANNELS: 4 (hw)^2 x 384)."""
    h, w = job.height // VAE_SCALE_FACTOR, job.width // VAE_SCALE_FACTOR
    return job.height * job.width * VAE_DECODE_FLOPS_PER_PIXEL + 4 * (h * w) ** 2 * VAE_MIDDLE_CHANNELS


def reward_flops(comps: Components) -> float:
    """One image through the reward model: 2 FLOPs per parameter and token, REWARD_TOKENS tokens."""
    return 2 * comps.reward_params * REWARD_TOKENS


def phase_flops(config: QwenImageConfig, job: Job, samples: int) -> Dict[str, float]:
    """FLOPs each phase of one iteration runs for `samples` images: the rollout N forwards of g passes
    per sample; the training K rows per sample, each g passes of forward + backward and, with
    recompute, the forward again; the VAE decode and the reward per image; the text encoder, without
    the cache, once per prompt and once for the negative prompt (2 FLOPs per parameter and token)."""
    one, g = sample_flops(config, job), job.passes
    train_row = one.forward * (2 if job.recompute else 1) + one.backward
    prompts = max(1, samples // job.num_generations)
    return dict(rollout=samples * job.num_inference_steps * g * one.forward,
                train=samples * job.trained_steps * g * train_row,
                decode_reward=samples * vae_decode_flops(job),
                text_encode=0.0 if job.text_cache else
                (prompts + (g - 1)) * 2 * QWEN25_VL_7B_LANGUAGE_PARAMS * job.text_tokens)


def iteration_time(config: QwenImageConfig, comps: Components, job: Job, layout: Layout, device,
                   mfu: float) -> IterationTime:
    """Seconds of one iteration on the slowest rank: each phase's FLOPs (`phase_flops`) at `mfu` x the
    device's peak, TP x SP x PP splitting the transformer's evenly (the rollout's pipeline filled once
    per sweep of the micro-batches, the training's 1F1B bubble (pp - 1) / m); the decode + reward and
    the text encoder on each rank whole; communication at the profile's bandwidths, not overlapped.
    The weights' own traffic is left out: at micro-batch 1 with true CFG a forward's bf16 weight reads
    take 2% of its FLOPs' time at 1024 px, 8% at 512 px (twice that without true CFG)."""
    B, N, K = job.batch // layout.dp, job.num_inference_steps, job.trained_steps
    rate = device.peak_bf16_flops * mfu
    model_par = layout.tp * layout.sp * layout.pp
    flops = phase_flops(config, job, B)
    m = job.micro_batch_size
    sweeps = max(1, B // m)
    rollout = flops["rollout"] / model_par / rate * (1 + (layout.pp - 1) / sweeps)
    train = flops["train"] / model_par / rate * (1 + (layout.pp - 1) / micro_batches_per_update(job, layout))
    decode = (flops["decode_reward"] + B * reward_flops(comps)) / rate
    text = flops["text_encode"] / rate
    c = activation_bytes(job)
    tokens = (job.text_tokens + job.image_tokens) * m * job.passes
    D = config.hidden_size
    blocks_per_stage = max(stage_blocks(config.num_blocks, layout.pp))
    # Passes of one micro-batch through a stage: N in the rollout, K x (forward + backward (+ recompute)).
    passes = sweeps * (N + 2 * K + (K if job.recompute else 0))
    tp_comm = sp_comm = pp_comm = dp_comm = 0.0
    if layout.tp > 1:  # per block and token the two row-parallel all-reduces of its stream (projection,
        # fc2), ring: 2 (tp - 1) / tp x the bytes
        volume = 2 * tokens / layout.sp * D * c * 2 * (layout.tp - 1) / layout.tp
        tp_comm = passes * blocks_per_stage * volume / bandwidth(device, layout.tp)
    if layout.sp > 1:  # Ulysses: q, k, v to heads and the output back, all-to-all of (sp - 1) / sp
        volume = 4 * tokens / layout.sp * D / layout.tp * c * (layout.sp - 1) / layout.sp
        sp_comm = passes * blocks_per_stage * volume / bandwidth(device, layout.tp * layout.sp)
    if layout.pp > 1:  # one [S / sp + 1, g m, D] tensor per stage boundary and pass ([x ; silu(temb)])
        volume = (tokens / layout.sp + m * job.passes) * D * c
        pp_comm = passes * volume / bandwidth(device, layout.world)
    dp_group = layout.dp * layout.sp
    if dp_group > 1:  # fp32 gradients: all-reduce, or reduce-scatter + parameter all-gather
        base, lora = stage_params(config, layout.tp, layout.pp, 0, job.lora_rank)
        volume = FP32 * trainable_params(base, lora, job) * 2 * (dp_group - 1) / dp_group
        dp_comm = volume / bandwidth(device, layout.tp * layout.sp * layout.dp)
    return IterationTime(dict(rollout=rollout, train=train, decode_reward=decode, text_encode=text,
                              tp_allreduce=tp_comm, ulysses_all_to_all=sp_comm, pp_p2p=pp_comm,
                              dp_grad_sync=dp_comm))


def layouts(config: QwenImageConfig, devices: int) -> List[Layout]:
    """Every TP x PP x SP x DP of `devices` whose TP x SP divides the heads and whose PP is at most
    the blocks (an uneven split is `stage_blocks`')."""
    out = []
    for tp in range(1, devices + 1):
        for sp in range(1, devices // tp + 1):
            for pp in range(1, devices // (tp * sp) + 1):
                if devices % (tp * sp * pp) or config.num_attention_heads % (tp * sp) or pp > config.num_blocks:
                    continue
                out.append(Layout(tp=tp, pp=pp, sp=sp, dp=devices // (tp * sp * pp)))
    return out


# --- the model, and the frozen parts -------------------------------------------------------------
def _diffusers_config(path: str):
    """The transformer config.json dict of a diffusers pipeline folder, transformer folder or file,
    or None where there is none."""
    for candidate in (os.path.join(path, "transformer", "config.json"), os.path.join(path, "config.json"), path):
        if os.path.isfile(candidate) and candidate.endswith(".json"):
            config = load_json(candidate, "diffusers config.json")
            return config if isinstance(config, dict) else None
    return None


def is_qwen_image(name_or_path) -> bool:
    """A name of MODELS, or a diffusers QwenImageTransformer2DModel config.json / folder."""
    if name_or_path in MODELS:
        return True
    if not isinstance(name_or_path, str) or not os.path.exists(name_or_path):
        return False
    try:
        config = _diffusers_config(name_or_path)
    except ValueError:  # not JSON: not ours to read
        return False
    return bool(config) and config.get("_class_name") == DIFFUSERS_CLASS


def model_of(name_or_path) -> QwenImageConfig:
    """A name of MODELS or a diffusers Qwen-Image transformer config.json, transformer or pipeline folder."""
    if name_or_path in MODELS:
        return PRESETS[MODELS[name_or_path]]
    if not is_qwen_image(name_or_path):
        raise ValueError(f"unknown Qwen-Image model {name_or_path!r}: {', '.join(MODELS)}, or a diffusers "
                         f"{DIFFUSERS_CLASS} config.json / transformer or pipeline folder")
    return QwenImageConfig.from_diffusers_config(name_or_path)


# AutoencoderKLQwenImage at Qwen-Image's vae config (diffusers' defaults: base_dim 96, z_dim 16,
# dim_mult (1, 2, 4, 4), 2 ResNets per level, temperal_downsample (False, True, True)), counted on the
# meta device: encoder + quant_conv 53,596,928, decoder + post_quant_conv 73,295,603 (the test counts
# it again). The trainer loads it whole (vae.py).
QWEN_IMAGE_VAE_PARAMS = 126_892_531
# Largest live set of one image's no-grad decode (a one-frame video: frame 0 with the causal
# convolutions' time padding), values per output pixel: 1732, the slope between 128 and 192 px of the
# live-tensor meter on diffusers' AutoencoderKLQwenImage (random weights, fp32, CPU; 1747 at 64 px, the
# same per image at batch 2; the test measures it again). The middle attention's scores (at h x w)
# come and go before the full-resolution peak.
VAE_DECODE_VALUES_PER_PIXEL = 1732.0
# Its convolution FLOPs per output pixel: torch's FlopCounterMode on the same decode (10,748,168 at
# 64, 128 and 192 px); the middle attention, which it does not count, is added by hand: one head of
# 384 channels over the h x w latent (`vae_decode_flops`).
VAE_DECODE_FLOPS_PER_PIXEL = 10_748_168.0
VAE_MIDDLE_CHANNELS = 384
# Qwen2.5-VL-7B-Instruct as QwenImagePipeline loads it (Qwen2_5_VLForConditionalGeneration at its
# config: hidden 3584, 28 layers, 28 heads / 4 KV heads, MLP 18944, vocabulary 152064 untied; vision
# tower depth 32, width 1280), counted on the meta device: 8,292,166,656, of which the vision tower
# 676,550,144 (resident, unused for text) and the language model with its head 7,615,616,512 (what a
# prompt runs through).
QWEN25_VL_7B_PARAMS = 8_292_166_656
QWEN25_VL_7B_LANGUAGE_PARAMS = 7_615_616_512
# Tokens the image reward's ViT-H-14 image tower sees: 256 patches + the class token at 224 px.
REWARD_TOKENS = 257


def components(reward: str = "hps", text_cache: bool = True) -> Components:
    """Qwen-Image's VAE, Qwen2.5-VL-7B unless its features are cached, and the reward."""
    return Components(QWEN_IMAGE_VAE_PARAMS, VAE_DECODE_VALUES_PER_PIXEL, 0 if text_cache else QWEN25_VL_7B_PARAMS,
                      reward_params(reward), latent_channels=PRESETS["qwen-image"].in_channels // PATCH ** 2)
