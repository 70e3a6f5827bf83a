"""Qwen-Image at run time: this rank's model chunks under pipeline parallelism, their weights (a
diffusers folder), forward / backward through megatron-core's schedules (mm_grpo/parallel/schedule.py)
and pipelined inference for the rollout with QwenImagePipeline's true classifier-free guidance. Every rank of a model-parallel group (TP x CP x PP) calls these with
the same arguments; stages exchange [text ; image ; silu(temb)] as one [S + 1, B, D] tensor (this
rank's pieces under Ulysses SP)."""
import os
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.utils import get_attr_wrapped_model

from mm_grpo.families.qwen_image.transformer.config import QwenImageConfig
from mm_grpo.families.qwen_image.transformer.hf_weights import check_hf_weights, load_hf_weights, open_diffusers_weights
from mm_grpo.families.qwen_image.transformer.model import QwenImageTransformer, transformer_config
from mm_grpo.parallel.pipeline_layout import PPLayers, resolve_pp_layers, stage_specs
from mm_grpo.parallel.schedule import forward_only, keyword_call, results_to_host, run_schedule
from mm_grpo.parallel.state import is_last_stage, object_from_last_stage
from mm_grpo.parallel.ulysses import SequenceShard

# QwenImageTransformer.forward's keyword arguments (diffusers' names); other keys of a micro-batch are
# for the loss.
FORWARD_KEYS = ("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep", "img_shapes")


def build_model_chunks(config: QwenImageConfig, pp_layers: PPLayers = None) -> List[QwenImageTransformer]:
    """This rank's model chunks, one per virtual stage; `pp_layers` counts blocks per stage (a nested
    list for virtual stages), None splits evenly."""
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    specs = stage_specs(resolve_pp_layers(pp_layers, config.num_blocks, pp, vpp or 1), config.num_blocks)
    tconfig = transformer_config(config)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    return [QwenImageTransformer(config, tconfig, s.pre_process, s.post_process, s.block_range,
                                 vp_stage=v if vpp else None)
            for v, s in enumerate(specs[(rank, v)] for v in range(vpp or 1))]


def load_hf_weights_into_chunks(model_chunks: Sequence[QwenImageTransformer], weights):
    """diffusers-named weights (a mapping or a path) into every chunk of this rank."""
    if isinstance(weights, (str, os.PathLike)):  # open the safetensors once for all chunks
        weights = open_diffusers_weights(str(weights))
    chunks = [get_attr_wrapped_model(c, "qwen_config", return_model_obj=True) for c in model_chunks]
    check_hf_weights(weights, chunks[0].qwen_config)
    for chunk in chunks:
        load_hf_weights(chunk, weights, check=False)
    return model_chunks


def _micro_batch_layout(micro_batches: Sequence[Dict]):
    """(micro-batch size, n_txt, n_img); every micro-batch must have the same shapes."""
    if not micro_batches:
        raise ValueError("no micro-batches given")
    shapes = {(mb["hidden_states"].shape[0], mb["encoder_hidden_states"].shape[1], mb["hidden_states"].shape[1])
              for mb in micro_batches}
    if len(shapes) > 1:
        raise ValueError(f"micro-batches differ in (batch, text tokens, image tokens): {sorted(shapes)}; pipeline "
                         "stages exchange fixed-shape tensors: pad the prompts to one length (the mask drops it)")
    return shapes.pop()


def forward_backward(model_chunks: Sequence[QwenImageTransformer], micro_batches: Sequence[Dict],
                     loss_fn: Callable, forward_only: bool = False, denoiser=None) -> List[Dict]:
    """Forward (and backward) of `micro_batches` (QwenImageTransformer.forward's kwargs, whole, the same
    on every rank of the model-parallel group, + what the loss reads) through megatron-core's schedule;
    the model called by `denoiser.forward` when given (under true CFG one call of 2 x the samples, the
    prompts and the negative prompt padded to one length: the stages then exchange that shape).
    loss_fn(output [B, S_img, C] gathered over SP, micro_batch) -> (loss, stats) runs on the last stage;
    returns {"loss", **stats} per micro-batch, on the CPU, on every rank of the pipeline group (gradients
    follow Megatron's convention, as FLUX's `chunks.forward_backward`)."""
    mbs, n_txt, n_img = _micro_batch_layout(micro_batches)
    copies = 2 if getattr(denoiser, "guided", False) else 1
    if copies > 1:
        n_txt = max(n_txt, micro_batches[0]["negative_encoder_hidden_states"].shape[1])
    seq = SequenceShard.current(n_txt, n_img)

    def loss_func(output, batch):
        loss, stats = loss_fn(output, batch)
        return loss, {"loss": loss.detach().clone(), **stats}  # Megatron scales the loss in place

    forward = keyword_call(FORWARD_KEYS) if denoiser is None else denoiser.forward
    results = run_schedule(model_chunks, micro_batches, forward, loss_func, seq.size * (seq.local_len + 1),
                           copies * mbs, forward_only)
    return object_from_last_stage(results_to_host(results) if is_last_stage() else None)


# --- pipelined inference for the rollout, with true classifier-free guidance -----------------------
def pad_text(embeds: torch.Tensor, mask: Optional[torch.Tensor], length: int):
    """Prompt features [B, L, D] and their mask [B, L] (None: all real) padded with masked zeros to `length`."""
    n = embeds.shape[1]
    mask = torch.ones(embeds.shape[:2], dtype=torch.bool, device=embeds.device) if mask is None else mask.bool()
    return F.pad(embeds, (0, 0, 0, length - n)), F.pad(mask, (0, length - n))


def true_cfg(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """QwenImagePipeline's true CFG: the guided velocity v_u + s (v_c - v_u) rescaled, token by token,
    to the conditional velocity's norm over the channels (in the velocities' dtype, as the pipeline)."""
    combined = v_uncond + scale * (v_cond - v_uncond)
    return combined * (torch.linalg.vector_norm(v_cond, dim=-1, keepdim=True)
                       / torch.linalg.vector_norm(combined, dim=-1, keepdim=True))


def guided_inputs(cond: Dict, rows: slice, true_cfg_scale: float) -> Dict:
    """The text inputs of the samples `rows` of a batch's conditioning; with true CFG (scale > 1) the
    conditional then the unconditional prompt features, padded to one length and masked: one call
    of 2 x the samples."""
    embeds, mask = cond["encoder_hidden_states"][rows], cond.get("encoder_hidden_states_mask")
    mask = None if mask is None else mask[rows]
    if true_cfg_scale <= 1:
        return {"encoder_hidden_states": embeds, "encoder_hidden_states_mask": mask}
    neg, neg_mask = cond["negative_encoder_hidden_states"], cond.get("negative_encoder_hidden_states_mask")
    length = max(embeds.shape[1], neg.shape[1])
    embeds, mask = pad_text(embeds, mask, length)
    neg, neg_mask = pad_text(neg.expand(len(embeds), -1, -1), None if neg_mask is None else neg_mask.expand(len(embeds), -1),
                             length)
    return {"encoder_hidden_states": torch.cat([embeds, neg]), "encoder_hidden_states_mask": torch.cat([mask, neg_mask])}


def make_velocity_fn(model_chunks: Sequence[QwenImageTransformer], cond: Dict, micro_batch_size: int,
                     true_cfg_scale: float = 1.0):
    """velocity_fn(x [B, S_img, C], sigma [B]) -> v [B, S_img, C] on every model-parallel rank.

    cond: encoder_hidden_states [B, L, D] with encoder_hidden_states_mask [B, L] (or None), img_shapes,
    and for true CFG (true_cfg_scale > 1) negative_encoder_hidden_states [1, L', D] with its mask. The
    batch goes through in micro-batches of `micro_batch_size` prompts in flight together (each one call
    of 2 x micro_batch_size samples under true CFG); the last stage's velocity is broadcast over the
    pipeline group (mm_grpo/parallel/schedule.py `forward_only`)."""
    batch = cond["encoder_hidden_states"].shape[0]
    if micro_batch_size < 1 or batch % micro_batch_size:
        raise ValueError(f"batch size {batch} is not divisible by micro_batch_size {micro_batch_size}")
    config = get_attr_wrapped_model(model_chunks[0], "qwen_config")
    copies = 2 if true_cfg_scale > 1 else 1
    starts = range(0, batch, micro_batch_size)
    texts = [guided_inputs(cond, slice(i, i + micro_batch_size), true_cfg_scale) for i in starts]
    n_txt = texts[0]["encoder_hidden_states"].shape[1]

    def velocity_fn(x, sigma):
        if x.shape[0] != batch or sigma.shape != (batch,):
            raise ValueError(f"velocity_fn takes x [{batch}, S_img, C] and sigma [{batch}], got "
                             f"{tuple(x.shape)} and {tuple(sigma.shape)}")
        seq = SequenceShard.current(n_txt, x.shape[1])
        micro_batches = [dict(text, img_shapes=[cond["img_shapes"][0]] * (copies * micro_batch_size),
                              hidden_states=x[i:i + micro_batch_size].repeat(copies, 1, 1),
                              timestep=sigma[i:i + micro_batch_size].repeat(copies))
                         for i, text in zip(starts, texts)]
        v = forward_only(model_chunks, micro_batches, FORWARD_KEYS, seq.size * (seq.local_len + 1),
                         copies * micro_batch_size, (copies * batch, x.shape[1], config.output_channels), x.dtype,
                         x.device)
        if copies == 1:
            return v
        # [cond ; uncond] per micro-batch -> the guided velocity of each
        pairs = [m.chunk(2) for m in v.split(2 * micro_batch_size)]
        return torch.cat([true_cfg(c, u, true_cfg_scale) for c, u in pairs])

    return velocity_fn


def load_pretrained(model_chunks, path):
    """Weights for one model chunk or a rank's list of chunks, from a Megatron checkpoint (any TP / PP;
    mm-convert QwenImageConverter hf_to_mm, or a training run's) or a diffusers transformer or pipeline
    folder (cut on the fly)."""
    from mm_grpo.checkpoint import is_megatron_checkpoint
    from mm_grpo.families.qwen_image.checkpoint import load_megatron_checkpoint
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    if is_megatron_checkpoint(path):
        load_megatron_checkpoint(chunks, path)
    else:
        load_hf_weights_into_chunks(chunks, path)
    return model_chunks
