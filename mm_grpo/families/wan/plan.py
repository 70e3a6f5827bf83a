"""Per-rank memory and seconds per GRPO iteration of Wan2.1 text-to-video under CP x PP x DP.

The model is MindSpeed-MM's WanDiT (mindspeed_mm/models/predictor/dits/wan_dit.py; the same
parameters as diffusers' WanTransformer3DModel), run the way MindSpeed-MM runs it: TP 1 (`TP_REASON`),
Ulysses context parallelism (CP) over the video tokens, pipeline stages of whole blocks
(`pipeline_num_layers`), a micro-batch of one sample, Megatron's --bf16 (bf16 parameters, fp32 main
gradients, fp32 master weights and Adam moments sharded over DP x CP by the distributed optimizer) and
full recompute of every block (`--recompute-granularity full --recompute-method block`).

Notation: D hidden size, F FFN width, d head dim, n heads, L blocks, S video tokens (latent
frames x latent rows / 2 x latent columns / 2), T text tokens (umT5, padded to 512), C latent
channels, B videos per data-parallel rank, N denoising steps, K trained steps per video; "values"
are elements of the bf16 compute dtype (an fp32 tensor counts twice).

The GRPO job (`VideoJob`) defaults to DanceGRPO's Wan2.1 recipe (scripts/finetune/
finetune_wan_2_1_grpo.sh, fastvideo/train_grpo_wan_2_1.py): G = 12 videos per prompt, N = 20
steps, 60% of the N - 1 steps trained (K = 11), classifier-free guidance (cfg_infer 5) in the
rollout and in the trained steps (a conditional and an unconditional pass of each step: 2
"streams"), umT5 embeddings precomputed, an image reward on the first frame. The rest of the
iteration (the rollout's buffers, the trained rows, phases) is modelled as mm-grpo's FLUX trainer
holds it (formulas.py); shared pieces (the job's common fields `GRPOJob`, Layout, the memory and
time records and phases, the gradient and KL-reference terms, the bandwidth rule, a layout's row)
are formulas.py's.
"""
import dataclasses
import json
import math
import os
from typing import Dict, List, Optional, Sequence, Tuple

from mm_grpo.families.wan.encoders import (WAN_VAE_TEMPORAL, WANDIT_MICRO_BATCH_REASON, WANDIT_TP_REASON,
                                           video_latent_shape, video_token_grid)
from mm_grpo.plan import formulas as f
from mm_grpo.plan.frozen_parts import Components, reward_params
from mm_grpo.settings import setting

TP_REASON = f"Wan2.1 runs with TP 1: {WANDIT_TP_REASON}"
MICRO_BATCH_REASON = WANDIT_MICRO_BATCH_REASON
# Tokens of the image reward's ViT-H-14 image tower on the scored frame (formulas.py counts its FLOPs so)
REWARD_TOKENS = 257
NEAR_FASTEST = 1.02  # fitting layouts this close to the fastest in seconds per video rank by memory


@dataclasses.dataclass(frozen=True)
class WanConfig:
    """The architecture (MindSpeed-MM's predictor fields in model.json)."""
    hidden_size: int
    ffn_dim: int
    num_heads: int
    num_layers: int
    text_dim: int = 4096
    text_len: int = 512
    freq_dim: int = 256
    in_channels: int = 16
    out_channels: int = 16
    patch_size: Tuple[int, int, int] = (1, 2, 2)
    qk_norm: bool = True
    cross_attn_norm: bool = True
    name: str = "wan"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_blocks(self) -> int:
        return self.num_layers


# MindSpeed-MM's examples/wan2.1/{1.3b,14b}/t2v/pretrain_model.json
PRESETS = {
    "wan2.1-1.3b": WanConfig(hidden_size=1536, ffn_dim=8960, num_heads=12, num_layers=30, name="wan2.1-1.3b"),
    "wan2.1-14b": WanConfig(hidden_size=5120, ffn_dim=13824, num_heads=40, num_layers=40, name="wan2.1-14b"),
}


def _diffusers_config(path):
    """The config.json dict of a diffusers transformer (a file or its folder), or None."""
    path = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not (os.path.isfile(path) and path.endswith(".json")):
        return None
    with open(path) as fh:
        try:
            config = json.load(fh)
        except json.JSONDecodeError:
            return None
    return config if isinstance(config, dict) else None


def is_wan(name_or_path) -> bool:
    """A Wan preset name, or a diffusers WanTransformer3DModel config.json / folder."""
    if name_or_path in PRESETS:
        return True
    config = _diffusers_config(name_or_path) if isinstance(name_or_path, str) and os.path.exists(name_or_path) else None
    return bool(config) and config.get("_class_name") == "WanTransformer3DModel"


def model_of(name_or_path) -> WanConfig:
    """A preset (wan2.1-1.3b, wan2.1-14b) or a diffusers WanTransformer3DModel config.json / folder
    (text-to-video: no image embedder)."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    config = _diffusers_config(name_or_path) if os.path.exists(str(name_or_path)) else None
    if not config or config.get("_class_name") != "WanTransformer3DModel":
        raise ValueError(f"unknown Wan model {name_or_path!r}: a preset ({', '.join(PRESETS)}) or a diffusers "
                         f"WanTransformer3DModel config.json / folder")
    if config.get("image_dim") or config.get("added_kv_proj_dim"):
        raise ValueError(f"{name_or_path}: an image-to-video Wan (image_dim / added_kv_proj_dim); only "
                         f"text-to-video is planned")
    heads, head_dim = config.get("num_attention_heads", 40), config.get("attention_head_dim", 128)
    return WanConfig(hidden_size=heads * head_dim, ffn_dim=config.get("ffn_dim", 13824), num_heads=heads,
                     num_layers=config.get("num_layers", 40), text_dim=config.get("text_dim", 4096),
                     freq_dim=config.get("freq_dim", 256), in_channels=config.get("in_channels", 16),
                     out_channels=config.get("out_channels", 16),
                     patch_size=tuple(config.get("patch_size", (1, 2, 2))),
                     qk_norm=bool(config.get("qk_norm", "rms_norm_across_heads")),
                     cross_attn_norm=bool(config.get("cross_attn_norm", True)), name=str(name_or_path))


@dataclasses.dataclass(frozen=True)
class VideoJob(f.GRPOJob):
    """One GRPO iteration of text-to-video: formulas.GRPOJob, with DanceGRPO's Wan recipe's N = 20 and
    Megatron's --bf16 parameters, and the video's size and CFG; fields with a help text are `mm-grpo plan
    --model wan...`'s flags."""
    num_inference_steps: int = f.job_default("num_inference_steps", 20)  # DanceGRPO's Wan recipe
    param_dtype: str = f.job_default("param_dtype", "bf16")  # Megatron's --bf16, as MindSpeed-MM runs Wan
    frames: int = setting(81, "video frames (4k + 1: Wan's VAE is 4x in time after the first frame)", minimum=1)
    height: int = setting(480, "video height (a multiple of 16: VAE 8 x patch 2)", minimum=1)
    width: int = setting(832, "video width (a multiple of 16)", minimum=1)
    cfg: bool = setting(True, "classifier-free guidance in the rollout and the trained steps (DanceGRPO's "
                              "cfg_infer 5): a conditional and an unconditional pass per step")

    @property
    def streams(self) -> int:
        """Passes of the transformer per denoising step of one video: 2 with CFG."""
        return 2 if self.cfg else 1


def latent_grid(frames: int, height: int, width: int) -> Tuple[int, int, int]:
    """(t, h, w) of a video's latent: (frames - 1) / 4 + 1 frames, height / 8, width / 8 (one line if
    the size does not divide: the VAE's factors and the transformer's 1 x 2 x 2 patch)."""
    if frames < 1 or (frames - 1) % WAN_VAE_TEMPORAL:  # named as the planner's flag
        raise ValueError(f"--frames {frames} must be 4k + 1 (Wan's VAE: 4x in time after the first frame)")
    return video_latent_shape(frames, height, width)[1:]


def token_grid(config: WanConfig, job: VideoJob) -> Tuple[int, int, int]:
    return video_token_grid(latent_grid(job.frames, job.height, job.width), config.patch_size)


def video_tokens(config: WanConfig, job: VideoJob) -> int:
    """S: 480 x 832, 81 frames -> latent 21 x 60 x 104 -> 21 x 30 x 52 = 32,760 tokens."""
    return math.prod(token_grid(config, job))


def latent_values(config: WanConfig, job: VideoJob) -> int:
    """Elements of one video's latent, C x t x h x w."""
    return config.in_channels * math.prod(latent_grid(job.frames, job.height, job.width))


# --- layouts ------------------------------------------------------------------------------------
def stage_split(config: WanConfig, pp: int, pipeline_num_layers: Optional[Sequence[int]] = None) -> List[int]:
    """Blocks per pipeline stage: the given split (model.json's `pipeline_num_layers`), else the even
    split, which needs PP to divide the blocks."""
    if pipeline_num_layers:
        return list(pipeline_num_layers)
    return [config.num_layers // pp] * pp


def check_layout(config: WanConfig, job: VideoJob, layout: f.Layout,
                 pipeline_num_layers: Optional[Sequence[int]] = None):
    """Why a layout cannot run at all (None if it can), as one line."""
    if layout.tp != 1:
        return TP_REASON
    if config.num_heads % layout.sp:
        return f"{config.num_heads} heads do not split over CP {layout.sp}"
    tokens = video_tokens(config, job)
    if tokens % layout.sp:
        return f"{tokens} video tokens do not split over CP {layout.sp}"
    if pipeline_num_layers:
        if len(pipeline_num_layers) != layout.pp:
            return (f"pipeline_num_layers {list(pipeline_num_layers)} has {len(pipeline_num_layers)} stages, "
                    f"not PP {layout.pp}")
        if sum(pipeline_num_layers) != config.num_layers or min(pipeline_num_layers) < 1:
            return (f"pipeline_num_layers {list(pipeline_num_layers)} must be {layout.pp} positive counts "
                    f"summing to the {config.num_layers} blocks")
    elif config.num_layers % layout.pp:
        return (f"PP {layout.pp} does not divide the {config.num_layers} blocks (give the split as "
                f"--pipeline-num-layers)")
    if job.micro_batch_size != 1:
        return MICRO_BATCH_REASON
    per_rank = job.batch // layout.dp if job.batch % layout.dp == 0 else 0
    if not per_rank:
        return f"batch {job.batch} does not split into DP {layout.dp}"
    return None


def layouts(config: WanConfig, job: VideoJob, devices: int,
            pipeline_num_layers: Optional[Sequence[int]] = None) -> List[f.Layout]:
    """Every CP x PP x DP of `devices` (TP 1) whose CP divides the heads and the video tokens and
    whose PP divides the blocks (or is the given split's length)."""
    tokens = video_tokens(config, job)
    out = []
    for cp in range(1, devices + 1):
        if devices % cp or config.num_heads % cp or tokens % cp:
            continue
        for pp in range(1, devices // cp + 1):
            if (devices // cp) % pp:
                continue
            if pipeline_num_layers and pp != len(pipeline_num_layers):
                continue
            if not pipeline_num_layers and config.num_layers % pp:
                continue
            out.append(f.Layout(tp=1, pp=pp, sp=cp, dp=devices // (cp * pp)))
    return out


# --- parameters (counted from wan_dit.py; the test holds them to diffusers' model) ---------------
def _linear(fan_in, fan_out):
    return fan_in * fan_out + fan_out


def block_params(config: WanConfig, lora_rank: int = 0) -> Tuple[int, int]:
    """(parameters, LoRA adapter parameters) of one WanDiTBlock (t2v): self- and cross-attention
    (q, k, v, o with bias; RMSNorm weights on q and k over the hidden size), cross_attn_norm (a
    LayerNorm with affine), the GELU FFN and the 6 x D modulation. LoRA on MindSpeed-MM's Wan
    targets (examples/wan2.1/14b/t2v/finetune_lora.sh: proj_q proj_k proj_v proj_out ffn.0 ffn.2):
    rank r x (in + out) on the 8 attention linears and the 2 FFN linears."""
    D, F, r = config.hidden_size, config.ffn_dim, lora_rank
    attention = 4 * _linear(D, D) + (2 * D if config.qk_norm else 0)
    base = 2 * attention + (2 * D if config.cross_attn_norm else 0) + _linear(D, F) + _linear(F, D) + 6 * D
    lora = r * (8 * 2 * D + (D + F) + (F + D))
    return base, lora


def embedder_params(config: WanConfig) -> int:
    """The first stage's embedders: patch embedding (Conv3d), time embedding (freq_dim -> D -> D),
    time projection (D -> 6D), text embedding (text_dim -> D -> D)."""
    D = config.hidden_size
    patch = config.in_channels * math.prod(config.patch_size) * D + D
    time = _linear(config.freq_dim, D) + _linear(D, D) + _linear(D, 6 * D)
    text = _linear(config.text_dim, D) + _linear(D, D)
    return patch + time + text


def head_params(config: WanConfig) -> int:
    """The last stage's head: a linear to out_channels x patch and its 2 x D modulation."""
    return _linear(config.hidden_size, config.out_channels * math.prod(config.patch_size)) + 2 * config.hidden_size


def stage_params(config: WanConfig, split: Sequence[int], stage: int, lora_rank: int = 0) -> Tuple[int, int]:
    """(base parameters, LoRA parameters) of pipeline stage `stage` (TP 1: every rank of the stage holds them)."""
    base, lora = block_params(config, lora_rank)
    n = split[stage]
    total, adapters = n * base, n * lora
    if stage == 0:
        total += embedder_params(config)
    if stage == len(split) - 1:
        total += head_params(config)
    return total, adapters


def total_params(config: WanConfig) -> int:
    return stage_params(config, [config.num_layers], 0)[0]


# --- memory terms -----------------------------------------------------------------------------
BF16 = 2


def weights_bytes(base, lora, job: VideoJob):
    """The policy's parameters, LoRA adapters included, in the parameter dtype (Megatron's --bf16:
    bf16; a frozen base stays bf16)."""
    return (base + lora) * f.dtype_bytes(job.param_dtype)


def optimizer_bytes(base, lora, job: VideoJob, layout: f.Layout):
    """Adam's two fp32 moments and, for bf16 parameters, fp32 master weights (12 bytes / trainable
    parameter; 8 for fp32 parameters), sharded over DP x CP (Megatron's data-parallel group with
    context parallelism) by the distributed optimizer."""
    per_param = 4 * f.ADAM_STATES + (4 if job.param_dtype == "bf16" else 0)
    shards = layout.dp * layout.sp if job.distributed_optimizer else 1
    return per_param * f.trainable_params(base, lora, job) / shards


def block_activation_values(config: WanConfig, lora_rank: int = 0) -> Tuple[float, float]:
    """(values per video token, values per text token) one WanDiTBlock saves for its backward
    (micro-batch 1, bf16), counted from wan_dit.py and the MindSpeed-MM layers it calls:
      self-attention 13D: norm1's input, an fp32 copy of the block input (2D); the modulation's
        fp32 LayerNorm output (2D, kept for the gradient of scale); the q/k/v projections' input (D);
        the q and k RMSNorm inputs (2D); flash attention's q, k, v after RoPE (3D) and its output
        (D); the output projection's input, the output in [s, b, h] layout (D); the gated output (D);
      cross-attention 6D: norm3's input and output (2D), the q RMSNorm's input (D), q (D), the
        attention output and its [s, b, h] copy (2D); per text token 3D (k's RMSNorm input, k, v:
        computed from the T text tokens on every CP rank, not split);
      FFN 4D + 2F: norm2's input, the LayerNorm output kept by the modulation, the FFN input, the
        gated FFN output (4D); the GELU input and output (2F);
      RoPE 8d: the cos and sin tables (fp32, d per token) each application builds, for q and for k;
      flash attention statistics 64n: softmax_max and softmax_sum, [b, n, s, 8] fp32 each, of both
        attentions (torch_npu's npu_fusion_attention).
    Total 23D + 2F + 8d + 64n per video token (29.1D for Wan2.1-14B). Ulysses CP keeps S / CP tokens
    outside attention and S x n / CP inside: the same count per rank.

    With LoRA the base is frozen and the modulation's shift / scale / gate come from the frozen time
    embedding: the modulation's LayerNorm outputs (2D fp32 + D) and the gated outputs (2D) are not
    saved; the adapters' inputs (the base projections' inputs) still are, and every adapter adds
    its r-wide A x: 18D + 2F + 8d + 64n + 8r per video token (q, k, v, o of self-attention, q, o of
    cross-attention, the two FFN linears), 3D + 2r per text token (cross-attention k, v)."""
    D, F, d, n, r = config.hidden_size, config.ffn_dim, config.head_dim, config.num_heads, lora_rank
    shared = 8 * d + 64 * n
    if lora_rank:
        return 18 * D + 2 * F + shared + 8 * r, 3 * D + 2 * r
    return 23 * D + 2 * F + shared, 3 * D


def activation_bytes_per_microbatch(config: WanConfig, job: VideoJob, layout: f.Layout, split, stage: int):
    """Saved activations of one micro-batch (one video's step, both CFG streams) on a stage until
    its backward. With recompute (Megatron's checkpoint per block) each block's input (D per local
    video token) and, once per micro-batch, the checkpoint's other inputs: the text embedding (T x D)
    and the RoPE table (d / 2 complex64 per local token, 2d values). Without, every block's count
    (`block_activation_values`) and the text embedding once. The first stage (full fine-tuning only:
    with LoRA the embedders are frozen) keeps the patch embedding's input (C x patch per video token,
    all S: the CP split comes after it) and the text embedding's (text_dim + 2D per text token); the
    last stage's head works on the CP-gathered S tokens: its LayerNorm input, modulated output and
    linear input (3D per token; LoRA: the LayerNorm input only)."""
    S, T, D = video_tokens(config, job), job.text_tokens, config.hidden_size
    local = S / layout.sp
    blocks = split[stage]
    per_video, per_text = block_activation_values(config, job.lora_rank)
    if job.recompute:
        values = blocks * D * local + T * D + 2 * config.head_dim * local
    else:
        values = blocks * (per_video * local + per_text * T) + T * D
    if stage == 0 and not job.lora_rank:
        values += S * config.in_channels * math.prod(config.patch_size) + T * (config.text_dim + 2 * D)
    if stage == len(split) - 1:
        values += (1 if job.lora_rank else 3) * D * S
    return values * job.streams * job.micro_batch_size * BF16


def recompute_bytes(config: WanConfig, job: VideoJob, layout: f.Layout):
    """With recompute, one block's activations (less its input, already kept) while it is recomputed
    for its backward."""
    if not job.recompute:
        return 0
    per_video, per_text = block_activation_values(config, job.lora_rank)
    local = video_tokens(config, job) / layout.sp
    return ((per_video - config.hidden_size) * local + per_text * job.text_tokens) * job.streams * BF16


def backward_working_bytes(config: WanConfig, job: VideoJob, layout: f.Layout):
    """Activation gradients alive during a block's backward: formulas.py's constant (4D per token,
    measured on FLUX; not measured for Wan)."""
    local = video_tokens(config, job) / layout.sp
    return local * f.BACKWARD_WORKING_VALUES_PER_TOKEN * config.hidden_size * job.streams * BF16


def rollout_buffer_bytes(config: WanConfig, job: VideoJob, layout: f.Layout):
    """The rank's B videos' rollout, fp32 as mm-grpo's trainer keeps FLUX's: latents of every step
    (N + 1), step noise (N), initial noise and x0 (2), and the umT5 conditioning rows [T, text_dim]
    (with CFG the negative prompt's too)."""
    B, N = job.batch // layout.dp, job.num_inference_steps
    latents = B * ((N + 1) + N + 2) * latent_values(config, job)
    cond = B * job.text_tokens * config.text_dim * job.streams
    return 4 * (latents + cond)


def training_rows_bytes(config: WanConfig, job: VideoJob, layout: f.Layout):
    """The update's trained rows, all built at once (as mm-grpo's FLUX trainer does): per (video,
    trained step) x_t and x_t+1 (and the reference's mean with the KL term) and the conditioning
    rows, fp32."""
    rows = job.trained_steps * job.batch // layout.dp
    per_row = (3 if job.kl_reference else 2) * latent_values(config, job) + \
        job.text_tokens * config.text_dim * job.streams
    return 4 * rows * per_row


def rollout_forward_working_bytes(config: WanConfig, job: VideoJob, layout: f.Layout):
    """A no-grad forward of one micro-batch: the largest live set inside a block, per local video
    token max(9D, 2D + 2F): the residual, k and v and q's RoPE temporaries (fp32 products), or the
    residual, the FFN input and its two F-wide intermediates; and the text k, v (2D per text token)."""
    D, F = config.hidden_size, config.ffn_dim
    local = video_tokens(config, job) / layout.sp
    return (local * max(9 * D, 2 * D + 2 * F) + 2 * D * job.text_tokens) * job.streams * BF16


def vae_decode_bytes(config: WanConfig, job: VideoJob):
    """One video decoded at a time (Wan's VAE goes one latent frame at a time with its convolution
    cache): the measured live set per output pixel plus the decoded video (`WAN_VAE_DECODE_VALUES_PER_PIXEL`)."""
    pixels = job.height * job.width
    return (WAN_VAE_DECODE_VALUES_PER_PIXEL * pixels +
            WAN_VAE_DECODE_VALUES_PER_PIXEL_FRAME * pixels * job.frames) * BF16


def stage_memory(config: WanConfig, comps, job: VideoJob, layout: f.Layout, split, stage: int) -> f.RankMemory:
    base, lora = stage_params(config, split, stage, job.lora_rank)
    static = {
        "weights": weights_bytes(base, lora, job),
        "main_grads": f.main_grad_bytes(base, lora, job),  # fp32, as Megatron's --bf16 keeps them
        "optimizer": optimizer_bytes(base, lora, job, layout),
        "kl_reference": f.kl_reference_bytes(base, job),
        "vae": comps.vae_params * BF16,
        "reward_model": f.reward_bytes(comps),
        "text_encoders": 0 if job.text_cache else comps.text_encoder_params * BF16,
    }
    act = activation_bytes_per_microbatch(config, job, layout, split, stage)
    micro_batches = job.trained_steps * (job.batch // layout.dp)
    in_flight = min(layout.pp - stage, micro_batches) if layout.pp > 1 else 1
    return f.phase_memory(static,
                          activations_per_microbatch=act,
                          activations=act * in_flight,
                          recompute_block=recompute_bytes(config, job, layout),
                          backward_working=backward_working_bytes(config, job, layout),
                          training_rows=training_rows_bytes(config, job, layout),
                          rollout_buffers=rollout_buffer_bytes(config, job, layout),
                          rollout_forward=rollout_forward_working_bytes(config, job, layout),
                          vae_decode=vae_decode_bytes(config, job))


def rank_memory(config: WanConfig, comps, job: VideoJob, layout: f.Layout,
                pipeline_num_layers: Optional[Sequence[int]] = None) -> f.LayoutMemory:
    split = stage_split(config, layout.pp, pipeline_num_layers)
    return f.LayoutMemory([stage_memory(config, comps, job, layout, split, s) for s in range(layout.pp)])


# --- time ---------------------------------------------------------------------------------------
def forward_flops(config: WanConfig, job: VideoJob) -> float:
    """Matrix-product and attention FLOPs of one pass (one stream) of one video: per block, on the S
    video tokens the self-attention q, k, v, o and cross-attention q, o projections (6D^2) and the
    FFN (2DF); on the T text tokens cross-attention k, v (2D^2); self-attention over the S tokens
    (4 S^2 D: QK^T and PV) and cross-attention to the T text tokens (4 S T D); and the embedders
    (patch, text, the timestep's MLPs) and the head. Attention is half of it at 480p / 81 frames
    (S = 32,760). The test holds it to torch's FLOP counter on diffusers' model."""
    D, F, S, T = config.hidden_size, config.ffn_dim, video_tokens(config, job), job.text_tokens
    p = math.prod(config.patch_size)
    linear = 2 * S * (6 * D * D + 2 * D * F) + 2 * T * 2 * D * D
    attention = 4 * S * S * D + 4 * S * T * D
    embed = 2 * S * config.in_channels * p * D + 2 * T * (config.text_dim * D + D * D) + \
        2 * S * D * config.out_channels * p
    time = 2 * (config.freq_dim * D + D * D + 6 * D * D)
    return config.num_layers * (linear + attention) + embed + time


def attention_fraction(config: WanConfig, job: VideoJob) -> float:
    S, D = video_tokens(config, job), config.hidden_size
    return config.num_layers * (4 * S * S * D + 4 * S * job.text_tokens * D) / forward_flops(config, job)


def vae_decode_flops(job: VideoJob) -> float:
    """Wan's VAE decode of one video: convolutions per output pixel (the first frame, then every
    later frame: measured constants above) and the middle attention of every latent frame
    (one head over its h x w latent pixels at 384 channels: 4 (hw)^2 x 384)."""
    t, h, w = latent_grid(job.frames, job.height, job.width)
    pixels = job.height * job.width
    conv = pixels * (WAN_VAE_DECODE_FLOPS_FIRST_FRAME +
                     (job.frames - 1) * WAN_VAE_DECODE_FLOPS_PER_FRAME)
    return conv + t * 4 * (h * w) ** 2 * WAN_VAE_MIDDLE_CHANNELS


def iteration_time(config: WanConfig, comps, job: VideoJob, layout: f.Layout, device, mfu: float = 0.4,
                   pipeline_num_layers: Optional[Sequence[int]] = None) -> f.IterationTime:
    """Seconds of one GRPO iteration on the slowest rank, formulas.iteration_time's model: compute at
    `mfu` x peak (an assumption), communication at the profile's bandwidths, not overlapped.
    Rollout: B videos x N steps x streams passes, the pipeline filled once per sweep of the B videos;
    training: K rows per video, forward + backward (2 forwards; LoRA 1) + the recompute forward, the
    1F1B bubble (pp - 1) / m; decode + reward: the B videos shared by the CP x PP ranks of a
    data-parallel group, one video after another; umT5 once per prompt unless cached."""
    B, N, K = job.batch // layout.dp, job.num_inference_steps, job.trained_steps
    split = stage_split(config, layout.pp, pipeline_num_layers)
    flops_per_s = device.peak_bf16_flops * mfu
    model_par = layout.sp * layout.pp
    fwd = forward_flops(config, job) * job.streams
    rollout = B * N * fwd / model_par / flops_per_s * (1 + (layout.pp - 1) / max(1, B))
    m = K * B
    train_factor = (2 if job.lora_rank else 3) + (1 if job.recompute else 0)
    train = B * K * fwd * train_factor / model_par / flops_per_s * (1 + (layout.pp - 1) / m)
    videos = math.ceil(B / model_par)
    decode = videos * (vae_decode_flops(job) + 2 * comps.reward_params * REWARD_TOKENS) / flops_per_s
    prompts = max(1, B // job.num_generations)
    text = 0.0 if job.text_cache else prompts * 2 * comps.text_encoder_params * job.text_tokens / flops_per_s
    D, T = config.hidden_size, job.text_tokens
    tokens = video_tokens(config, job) * job.streams
    passes = B * (N + 2 * K + (K if job.recompute else 0))
    sp_comm = pp_comm = dp_comm = 0.0
    if layout.sp > 1:  # Ulysses: q, k, v to heads and the output back, all-to-all of (cp - 1) / cp, per block
        volume = 4 * tokens / layout.sp * D * BF16 * (layout.sp - 1) / layout.sp
        sp_comm = passes * max(split) * volume / f.bandwidth(device, layout.sp)
    if layout.pp > 1:  # per stage boundary and pass: the [S / cp, D] activation, the prompt and its embedding
        volume = (tokens / layout.sp * D + job.streams * T * (D + config.text_dim)) * BF16
        pp_comm = passes * volume / f.bandwidth(device, layout.world)
    dp_group = layout.dp * layout.sp
    if dp_group > 1:  # fp32 gradients: reduce-scatter + parameter all-gather (or all-reduce)
        base, lora = max((stage_params(config, split, s, job.lora_rank) for s in range(layout.pp)),
                         key=lambda x: x[0])
        volume = 4 * f.trainable_params(base, lora, job) * 2 * (dp_group - 1) / dp_group
        dp_comm = volume / f.bandwidth(device, layout.sp * layout.dp)
    return f.IterationTime(dict(rollout=rollout, train=train, decode_reward=decode, text_encode=text,
                                ulysses_all_to_all=sp_comm, pp_p2p=pp_comm, dp_grad_sync=dp_comm))


def plan_layouts(config: WanConfig, comps, job: VideoJob, devices: int, device, mfu: float = 0.4,
                 pipeline_num_layers: Optional[Sequence[int]] = None, candidates=None,
                 per_dp_rank_prompts: bool = True) -> List[Dict]:
    """Rows (dicts) for every candidate layout, ranked: the fitting ones by seconds per video (those
    within 2% of the fastest by memory: the same time, more headroom), then the others by memory.
    `per_dp_rank_prompts`: one prompt group per data-parallel rank (else the job's prompts_per_iteration)."""
    rows = []
    for lay in candidates if candidates is not None else layouts(config, job, devices, pipeline_num_layers):
        job_l = job.on(lay, per_dp_rank_prompts)
        reason = check_layout(config, job_l, lay, pipeline_num_layers)
        row = dict(tp=lay.tp, cp=lay.sp, pp=lay.pp, dp=lay.dp, lora_rank=job.lora_rank, fits=False, reason=reason,
                   peak_bytes_per_rank=None, seconds_per_iteration=None, seconds_per_video=None, batch=job_l.batch)
        if reason is None:
            split = stage_split(config, lay.pp, pipeline_num_layers)
            if lay.pp > 1:
                row["pipeline_num_layers"] = split
            f.measured_row(row, rank_memory(config, comps, job_l, lay, pipeline_num_layers),
                           iteration_time(config, comps, job_l, lay, device, mfu, pipeline_num_layers), device,
                           "seconds_per_video")
        rows.append(row)
    rows = f.ranked(rows, "seconds_per_video")
    # Layouts within NEAR_FASTEST of the fastest are one choice as far as time goes: least memory first.
    fast = [r for r in rows if r["fits"] and r["seconds_per_video"] <= rows[0]["seconds_per_video"] * NEAR_FASTEST]
    fast.sort(key=lambda r: r["peak_bytes_per_rank"])
    return fast + rows[len(fast):]


# --- frozen parts: the VAE and the text encoder (mm_grpo/plan/frozen_parts.py: the rewards) ----------
# Wan2.1 (text-to-video): its VAE and its text encoder, counts of diffusers' AutoencoderKLWan at its
# default (= Wan2.1's) config and of transformers' UMT5EncoderModel at Wan2.1's text_encoder config
# (umT5-XXL: d_model 4096, d_ff 10240, 24 layers, 64 heads, vocabulary 256384), both built on the meta device.
WAN_VAE_PARAMS = 126_892_531
UMT5_XXL_ENCODER_PARAMS = 5_680_910_336
# Wan's VAE decodes a video one latent frame (4 output frames, the first alone) at a time, with a
# cache of the last frames of every causal convolution. Largest live set of a no-grad decode, in
# values per output pixel (of one frame), plus 3 values per output pixel per frame (the decoded
# video): 4900, measured with the live-tensor meter on diffusers' AutoencoderKLWan (random weights,
# fp32, CPU) at 64 and 128 px for 5 to 25 frames (tests/test_plan_wan.py measures it again).
WAN_VAE_DECODE_VALUES_PER_PIXEL = 4900.0
WAN_VAE_DECODE_VALUES_PER_PIXEL_FRAME = 3.0
# Convolution FLOPs of that decode per output pixel: the first frame 10.75M, every later frame
# 8.445M (counted by torch's FlopCounterMode on the same model; the decoder's middle attention, one
# head over the h x w latent of each latent frame at 384 channels, is added by hand: 4 (hw)^2 x 384).
WAN_VAE_DECODE_FLOPS_FIRST_FRAME = 10.748e6
WAN_VAE_DECODE_FLOPS_PER_FRAME = 8.445e6
WAN_VAE_MIDDLE_CHANNELS = 384


def components(reward: str = "hps", text_cache: bool = True) -> Components:
    """Wan2.1 text-to-video: its VAE, umT5-XXL unless the embeddings are cached, and the reward
    (an image reward scores a frame of the video, as DanceGRPO's Wan recipe scores the first)."""
    return Components(WAN_VAE_PARAMS, WAN_VAE_DECODE_VALUES_PER_PIXEL, 0 if text_cache else UMT5_XXL_ENCODER_PARAMS,
                      reward_params(reward))
