"""Wan2.1 text-to-video GRPO on MindSpeed-MM's own DiT (`"model_id": "wandit"`, built by its
`PredictModel`): the denoiser the schedule drives, umT5 text features and Wan's VAE.

MindSpeed-MM's WanDiT takes `(latents [B, C, T, h, w], timestep on 0..1000, prompt [B, L, D])` and
returns a tuple whose first entry is the velocity (noise - x0, its flow-matching target) on the last
pipeline stage. What it runs, measured against diffusers' WanTransformer3DModel
(tests/test_wan_grpo.py), and therefore what this module refuses in one line:
- a micro-batch of one sample: its output head adds the [B, D] time embedding to a [1, 2, D]
  modulation table without a sample axis, which mixes the samples of a micro-batch of 2 and fails
  beyond (MindSpeed-MM's Wan scripts all run --micro-batch-size 1). Classifier-free guidance runs
  a sample's conditional and unconditional velocity as one call of 2 samples at one timestep, whose
  time embeddings are equal, so the head computes what two calls compute (tested against
  diffusers' WanPipeline);
- tensor parallel size 1: its q / k RMSNorm spans the whole hidden size, which a tensor-parallel
  shard does not hold (MindSpeed-MM's Wan scripts run TP 1; its WanConverter does not split for TP);
- Ulysses context parallelism over the video tokens, T x h/2 x w/2 of them, which CP must divide;
- pipeline parallelism as MindSpeed-MM runs it: the predictor's `pipeline_num_layers` (blocks per
  stage) and MindSpeed's multi-tensor schedule (`--use-multiparameter-pipeline-model-parallel`),
  each stage sending the next `STAGE_OUTPUTS`; no virtual stages (one model chunk per rank);
and model.json's text encoder and VAE must be a Wan pipeline's (umT5, AutoencoderKLWan).
"""
import dataclasses
import json
import math
import os
from typing import Dict, List, Literal, Optional, Tuple

import torch
from megatron.core import parallel_state
from megatron.core.utils import get_attr_wrapped_model

from mm_grpo.configs import (MODEL_FLAG, MODEL_KEYS, AeBlock, ModelBlocks, ModelFile, TextEncoderBlock, block,
                             configured_size)
from mm_grpo.families.wan.encoders import (TIMESTEP_SCALE, WAN_LATENT_CHANNELS, WAN_NEGATIVE_PROMPT,
                                           WANDIT_MICRO_BATCH_REASON, WANDIT_TP_REASON, UMT5Conditioner, WanVaeDecoder,
                                           video_latent_shape, video_token_grid)
from mm_grpo.grpo.denoiser import Denoiser
from mm_grpo.parallel.grad_scale import scale_grad
from mm_grpo.parallel.state import is_last_stage, tensor_from_last_stage
from mm_grpo.settings import Count, read_block, setting

MODEL_ID = "wandit"
DEFAULT_NUM_FRAMES = 81  # Wan2.1's 5 s at 16 fps
DEFAULT_TEXT_LEN = 512  # Wan2.1's umT5 sequence length
# WanDiT returns (hidden states, prompt, prompt_emb, time_emb, times, prompt_mask); a stage sends the next
# these entries: the prompt (and its mask) only the first stage reads, and a None cannot be sent.
STAGE_OUTPUTS = (0, 2, 3, 4)
NUM_MODULATIONS = 6  # time_emb: the blocks' shift / scale / gate of attention and feed-forward
MULTI_TENSOR_FLAG = "--use-multiparameter-pipeline-model-parallel"
DEFAULT_MAX_SEQ_LEN = 1024  # WanDiT's max_seq_len default: the positions its RoPE table holds along each axis
# MindSpeed-MM's names for Wan's text encoder and VAE (its Wan2.1 configs'); mm-grpo reads neither.
TEXT_ENCODER_MODEL_IDS = ("UMT5",)
AE_MODEL_IDS = ("wan_video_vae",)


@dataclasses.dataclass(frozen=True)
class WanPredictorBlock:
    """What mm-grpo reads of a wandit predictor block: MindSpeed-MM's WanDiT takes the whole block as its
    arguments and reads the rest."""
    model_id: Literal[MODEL_ID] = MODEL_ID
    in_dim: Count = WAN_LATENT_CHANNELS
    hidden_size: Optional[Count] = None
    text_len: Count = DEFAULT_TEXT_LEN
    num_layers: Optional[Count] = None
    pipeline_num_layers: Optional[List[Count]] = None
    max_seq_len: Count = DEFAULT_MAX_SEQ_LEN


@dataclasses.dataclass(frozen=True)
class WanTextEncoderBlock(TextEncoderBlock):
    model_id: Optional[Literal[TEXT_ENCODER_MODEL_IDS]] = None


@dataclasses.dataclass(frozen=True)
class WanAeBlock(AeBlock):
    model_id: Optional[Literal[AE_MODEL_IDS]] = None


def check_predictor_block(predictor: dict, where: str) -> WanPredictorBlock:
    return read_block(WanPredictorBlock, predictor, where, known=predictor)


MODEL_BLOCKS = ModelBlocks(WanTextEncoderBlock, WanAeBlock, check_predictor_block)


def is_wan(model_cfg: dict) -> bool:
    return model_cfg.get("predictor", {}).get("model_id") == MODEL_ID


def video_size(model_cfg: dict) -> Tuple[int, int, int]:
    """(frames, height, width) of model.json (`num_frames`, `image_size`), checked against the VAE and
    the positions of the predictor's RoPE table (`max_seq_len` along each of frames, rows and columns)."""
    model = read_block(ModelFile, model_cfg, MODEL_FLAG, known=MODEL_KEYS)
    height, width = configured_size(model_cfg)
    frames = model.num_frames or DEFAULT_NUM_FRAMES
    grid = video_token_grid(video_latent_shape(frames, height, width)[1:])
    positions = check_predictor_block(model_cfg.get("predictor", {}), f"{MODEL_FLAG} predictor").max_seq_len
    if max(grid) > positions:
        raise ValueError(f"{frames} frames at {height}x{width}: {' x '.join(map(str, grid))} tokens (frames x rows x "
                         f"columns), more along an axis than the predictor's max_seq_len {positions}, the positions "
                         "of wandit's RoPE table")
    return frames, height, width


def video_tokens(model_cfg: dict) -> int:
    """The DiT's tokens over model.json's video (wandit's 1 x 2 x 2 patch)."""
    frames, height, width = video_size(model_cfg)
    return math.prod(video_token_grid(video_latent_shape(frames, height, width)[1:]))


# model.json block -> (its pipeline subfolder, the class a Wan pipeline has there)
WAN_PARTS = {"text_encoder": ("text_encoder", "UMT5EncoderModel"), "ae": ("vae", "AutoencoderKLWan")}


def check_wan_pipeline(model_cfg: dict):
    """model.json's text encoder and VAE folders hold Wan's classes (not, say, a FLUX pipeline's)."""
    for name, (sub, wanted) in WAN_PARTS.items():
        folder = block(block(model_cfg, name, MODEL_FLAG), "from_pretrained", name)
        config = os.path.join(folder, sub, "config.json")
        if not os.path.isfile(config):
            raise ValueError(f"{name}.from_pretrained {folder}: no {sub}/config.json (a diffusers Wan pipeline folder)")
        with open(config) as f:
            found = json.load(f)
        found = (found.get("architectures") or [found.get("_class_name")])[0]
        if found != wanted:
            raise ValueError(f"{name}.from_pretrained {folder}: its {sub}/ holds {found}, not Wan's {wanted}: the "
                             f"{MODEL_ID} predictor needs a Wan pipeline folder (e.g. Wan2.1-T2V-1.3B-Diffusers)")


def check_wan_launch(args, model_cfg: dict):
    """One line for each layout MindSpeed-MM's WanDiT does not run (see the module docstring), and for
    a text encoder or VAE that is not Wan's."""
    if args.micro_batch_size != 1:
        raise ValueError(f"--micro-batch-size {args.micro_batch_size}: {WANDIT_MICRO_BATCH_REASON}: use "
                         "--micro-batch-size 1")
    if args.tensor_model_parallel_size != 1:
        raise ValueError(f"--tensor-model-parallel-size {args.tensor_model_parallel_size}: {WANDIT_TP_REASON}: use "
                         "--context-parallel-size (Ulysses) and data parallelism")
    frames, height, width = video_size(model_cfg)
    tokens = video_tokens(model_cfg)
    if tokens % args.context_parallel_size:
        raise ValueError(f"--context-parallel-size {args.context_parallel_size} does not divide the {tokens} video "
                         f"tokens of {frames} frames at {height}x{width} (Ulysses splits the sequence evenly)")
    if args.pipeline_model_parallel_size > 1:
        check_wan_pipeline_stages(args, model_cfg["predictor"])
    check_wan_pipeline(model_cfg)


def check_wan_pipeline_stages(args, predictor: dict):
    """Pipeline parallelism as MindSpeed-MM configures wandit's (its Wan README: the multi-tensor
    schedule is required under PP; `pipeline_num_layers` in the predictor block)."""
    pp = args.pipeline_model_parallel_size
    if getattr(args, "virtual_pipeline_model_parallel_size", None) or args.num_layers_per_virtual_pipeline_stage:
        raise ValueError("virtual pipeline stages: this entry runs wandit with one model chunk per rank; drop "
                         "--virtual-pipeline-model-parallel-size")
    if not getattr(args, "use_multiparameter_pipeline_model_parallel", False):
        raise ValueError(f"--pipeline-model-parallel-size {pp}: wandit's stages exchange several tensors; add "
                         f"{MULTI_TENSOR_FLAG} (MindSpeed's multi-tensor pipeline schedule)")
    layers, total = predictor.get("pipeline_num_layers"), predictor.get("num_layers")
    if (not isinstance(layers, list) or len(layers) != pp or sum(layers) != total
            or not all(isinstance(n, int) and n > 0 for n in layers)):
        raise ValueError(f"--pipeline-model-parallel-size {pp}: the predictor's pipeline_num_layers must list the "
                         f"blocks of each of the {pp} stages, summing to its num_layers {total}; got {layers}")


def stage_tensor_shapes(args, model_cfg: dict) -> list:
    """What one stage sends the next for a micro-batch of one sample (`STAGE_OUTPUTS`), as MindSpeed's
    multi-tensor schedule takes it (`config.pipeline_tensor_shapes`); under classifier-free guidance
    the micro-batch runs as 2 samples (`WanDenoiser.forward`)."""
    predictor = model_cfg["predictor"]
    hidden, dtype = predictor["hidden_size"], args.params_dtype
    b = 2 if args.cfg_scale != 1 else 1
    return [{"shape": (b, video_tokens(model_cfg) // args.context_parallel_size, hidden), "dtype": dtype},
            {"shape": (b, predictor["text_len"], hidden), "dtype": dtype},
            {"shape": (b, NUM_MODULATIONS, hidden), "dtype": dtype},
            {"shape": (b, hidden), "dtype": dtype}]


@dataclasses.dataclass(frozen=True)
class WanGuidance:
    """Wan2.1 has no guidance embedding: classifier-free guidance against a negative prompt."""
    cfg_scale: float = setting(
        1.0, "classifier-free guidance of a model without a guidance embedding (Wan): the velocity v_uncond + "
             "s (v_cond - v_uncond) in the rollout and in the trained steps, DanceGRPO's --cfg_infer (its Wan "
             "recipe: 5); 1: none", minimum=1.0)
    negative_prompt: Optional[str] = None  # --negative-prompt (mm_grpo/grpo/denoiser.py NegativePrompt)

    @property
    def unconditional_prompt(self) -> str:
        """--negative-prompt, by default MindSpeed-MM's Wan2.1 negative prompt."""
        return WAN_NEGATIVE_PROMPT if self.negative_prompt is None else self.negative_prompt

    def check(self):
        if self.negative_prompt is not None and self.cfg_scale == 1:
            raise ValueError("--negative-prompt is the unconditional prompt of classifier-free guidance, which is "
                             "off: add --cfg-scale > 1")


@dataclasses.dataclass(frozen=True)
class WanDenoiser(Denoiser):
    """MindSpeed-MM's WanDiT on video latents [C, T, h, w], text as umT5 features [L, D]; with
    `cfg_scale` > 1, classifier-free guidance against `negative` (the unconditional prompt's [1, L, D])."""
    latent_shape: Tuple[int, int, int, int]
    cfg_scale: float = 1.0
    negative: Optional[torch.Tensor] = dataclasses.field(default=None, compare=False, repr=False)

    per_sample_keys = ("prompt",)

    def __post_init__(self):
        if self.guided and self.negative is None:
            raise ValueError(f"cfg_scale {self.cfg_scale} needs the negative prompt's features")

    @property
    def guided(self) -> bool:
        return self.cfg_scale != 1

    @property
    def shared_keys(self) -> Tuple[str, ...]:
        return ("negative_prompt",) if self.guided else ()

    def conditioning(self, text, rows, device) -> Dict:
        embeds = text if rows is None else text[rows.to(text.device)]
        cond = {"prompt": embeds.to(device)}
        if self.guided:
            cond["negative_prompt"] = self.negative.to(device)
        return cond

    def velocity_fn(self, chunks, cond, micro_batch_size):
        if len(chunks) != 1:
            raise ValueError("wandit runs one model chunk per rank (no virtual pipeline stages)")
        model, prompt = chunks[0], cond["prompt"]
        shared = {key: cond[key] for key in self.shared_keys}

        def velocity(x, sigma):  # one sample per micro-batch, whatever the batch (see the module docstring)
            samples = [{"hidden_states": x[i:i + 1], "prompt": prompt[i:i + 1], "timestep": sigma[i:i + 1], **shared}
                       for i in range(x.shape[0])]
            with torch.no_grad():
                if parallel_state.get_pipeline_model_parallel_world_size() == 1:
                    return torch.cat([self.forward(model, sample) for sample in samples]).to(x.dtype)
                return self._pipelined(model, samples, x.dtype)

        return velocity

    def _pipelined(self, model, samples, dtype):
        """The samples through every stage with Megatron's forward-only schedule (they are in flight
        together), the last stage's velocity broadcast to the pipeline group."""
        from megatron.core.pipeline_parallel import get_forward_backward_func  # MindSpeed's, under its adaptor

        def forward_step(data_iterator, chunk):
            return self.forward(chunk, next(data_iterator)), lambda out, non_loss_data=False: out

        outs = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(samples), model=[model], num_microbatches=len(samples),
            seq_length=1, micro_batch_size=1, forward_only=True, collect_non_loss_data=True)  # shapes: the config's
        first = samples[0]["hidden_states"]
        v = torch.cat(outs).to(dtype) if is_last_stage() else None
        return tensor_from_last_stage(v, (len(samples), *first.shape[1:]), dtype, first.device)

    def forward(self, model, batch):
        dit = get_attr_wrapped_model(model, "pre_process", return_model_obj=True)
        x, sigma, prompt = batch["hidden_states"], batch["timestep"], batch["prompt"]
        if self.guided:  # the conditional and the unconditional velocity in one call of 2 samples
            x, sigma = torch.cat([x, x]), torch.cat([sigma, sigma])
            prompt = torch.cat([prompt, batch["negative_prompt"].expand_as(prompt)])
        timestep = sigma * TIMESTEP_SCALE
        if dit.pre_process:
            out = model(x, timestep, prompt)
        else:  # the previous stage's STAGE_OUTPUTS, which Megatron's schedule set as the input tensor
            hidden, prompt_emb, time_emb, times = dit.input_tensor
            out = model(hidden, timestep, None, prompt_emb=prompt_emb, time_emb=time_emb, times=times,
                        ori_shape=x.shape)
        if not dit.post_process:
            return [out[i] for i in STAGE_OUTPUTS]
        # Every CP rank holds the whole velocity (the DiT gathers it, scaling its gradient by CP on the way
        # back) and Megatron scales the loss by CP again; MindSpeed-MM's loss divides by CP, so this does.
        v = scale_grad(out[0], 1 / parallel_state.get_context_parallel_world_size())
        if self.guided:
            v_cond, v_uncond = v.chunk(2)
            v = v_uncond + self.cfg_scale * (v_cond - v_uncond)
        return v


def parts(model_cfg, settings, policy, device, dtype, guidance: WanGuidance):
    """(conditioner, decoder, denoiser) of a Wan run: umT5 and Wan's VAE from the `text_encoder` and
    `ae` blocks' diffusers Wan pipeline folder, and the denoiser over model.json's video size."""
    text = block(model_cfg, "text_encoder", MODEL_FLAG)
    encoder = UMT5Conditioner(block(text, "from_pretrained", "text_encoder"), device=device, dtype=dtype,
                              max_sequence_length=text.get("max_sequence_length", DEFAULT_TEXT_LEN))
    ae = block(model_cfg, "ae", MODEL_FLAG)
    vae = WanVaeDecoder(block(ae, "from_pretrained", "ae"), device=device, dtype=dtype)
    frames, height, width = video_size(model_cfg)
    channels = check_predictor_block(block(model_cfg, "predictor", MODEL_FLAG), f"{MODEL_FLAG} predictor").in_dim
    shape = video_latent_shape(frames, height, width, channels)
    negative = encoder.encode([guidance.unconditional_prompt]) if guidance.cfg_scale != 1 else None
    denoiser = WanDenoiser(shape, guidance.cfg_scale, negative)
    return encoder.encode, (lambda latents, height, width: vae(latents)), denoiser
