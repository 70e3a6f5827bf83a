"""FLUX at run time: this rank's model chunks under pipeline parallelism, their weights (a converted
checkpoint or a diffusers folder), training through megatron-core's schedules, and pipelined
forward-only inference for the rollout.

Every rank of a model-parallel group (TP x CP x PP) calls these functions with the same
arguments. Stages exchange one tensor per micro-batch, [text ; image ; silu(temb)] as
[S + 1, B, D] (this rank's pieces under Ulysses SP, see `model.pack_stage_tensor`).
See docs/parallelism.md.
"""
import os
from typing import Callable, Dict, List, Sequence

import torch
from megatron.core import parallel_state
from megatron.core.utils import get_attr_wrapped_model

from mm_grpo.checkpoint.paths import is_megatron_checkpoint
from mm_grpo.families.flux.checkpoint.loader import load_megatron_checkpoint
from mm_grpo.families.flux.transformer.config import FluxConfig
from mm_grpo.families.flux.transformer.hf_weights import check_hf_weights, load_hf_weights, open_diffusers_weights
from mm_grpo.families.flux.transformer.latents import prepare_latent_image_ids
from mm_grpo.families.flux.transformer.model import FluxTransformer, transformer_config
from mm_grpo.parallel.pipeline_layout import PPLayers, resolve_pp_layers, stage_specs
from mm_grpo.parallel.schedule import forward_only, keyword_call, results_to_host, run_schedule
from mm_grpo.parallel.state import is_last_stage, object_from_last_stage
from mm_grpo.parallel.ulysses import SequenceShard

# The keyword arguments of FluxTransformer.forward (diffusers' names); other keys of a
# micro-batch are for the loss.
FORWARD_KEYS = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep",
                "img_ids", "txt_ids", "guidance")


# --- model chunks ---------------------------------------------------------------------
def build_model_chunks(config: FluxConfig, pp_layers: PPLayers = None) -> List[FluxTransformer]:
    """This rank's model chunks, one per virtual stage, for megatron-core's parallel state.

    `pp_layers` counts blocks per stage over [double..., single...] (a nested list for
    virtual stages, as in the converter); None splits evenly."""
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    chunks = resolve_pp_layers(pp_layers, config.num_blocks, pp, vpp or 1)
    specs = stage_specs(chunks, config.num_blocks)
    tconfig = transformer_config(config)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    return [FluxTransformer(config, tconfig, s.pre_process, s.post_process, s.block_range,
                            vp_stage=v if vpp else None)
            for v, s in enumerate(specs[(rank, v)] for v in range(vpp or 1))]


def load_hf_weights_into_chunks(model_chunks: Sequence[FluxTransformer], weights):
    """Diffusers-named weights (a mapping or a path) into every chunk of this rank."""
    if isinstance(weights, (str, os.PathLike)):  # open the safetensors once for all chunks
        weights = open_diffusers_weights(str(weights))
    chunks = [get_attr_wrapped_model(c, "flux_config", return_model_obj=True) for c in model_chunks]
    check_hf_weights(weights, chunks[0].flux_config)
    for chunk in chunks:
        load_hf_weights(chunk, weights, check=False)
    return model_chunks


# --- shapes and checks ------------------------------------------------------------------
def load_pretrained(model_chunks, path):
    """Weights for one model chunk or a rank's list of chunks, from a converted Megatron
    checkpoint (any TP/PP) or a diffusers folder (converted on the fly)."""
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    if is_megatron_checkpoint(path):
        load_megatron_checkpoint(chunks, path)
    else:
        load_hf_weights_into_chunks(chunks, path)
    return model_chunks


def _micro_batch_layout(micro_batches: Sequence[Dict]):
    """(micro-batch size, n_txt, n_img); every micro-batch must have the same shapes."""
    if not micro_batches:
        raise ValueError("no micro-batches given")
    shapes = {(mb["hidden_states"].shape[0], mb["txt_ids"].shape[-2], mb["img_ids"].shape[-2])
              for mb in micro_batches}
    if len(shapes) > 1:
        raise ValueError(f"micro-batches differ in (batch, text tokens, image tokens): {sorted(shapes)}; "
                         "pipeline stages exchange fixed-shape tensors")
    return shapes.pop()


def _run_schedule(model_chunks, micro_batches, loss_func, forward_only, collect_non_loss_data=False, forward=None):
    """megatron-core's schedule over `micro_batches`; returns the last stage's forward data."""
    mbs, n_txt, n_img = _micro_batch_layout(micro_batches)
    seq = SequenceShard.current(n_txt, n_img)
    # Megatron's p2p shape is (seq_length // CP, mbs, D): this rank's rows + the temb row.
    return run_schedule(model_chunks, micro_batches, forward or keyword_call(FORWARD_KEYS), loss_func,
                        seq.size * (seq.local_len + 1), mbs, forward_only, collect_non_loss_data)


# --- training -------------------------------------------------------------------------
def forward_backward(model_chunks: Sequence[FluxTransformer], micro_batches: Sequence[Dict],
                     loss_fn: Callable, forward_only: bool = False, denoiser=None) -> List[Dict]:
    """Forward (and backward) of `micro_batches` through megatron-core's pipeline schedule (the model
    called by `denoiser.forward` when given, as MindSpeed-MM's forward step does; else as it is).

    micro_batches: dicts with FluxTransformer.forward's kwargs (diffusers meaning, whole
        sequences, the same on every rank of the model-parallel group) + what the loss needs.
    loss_fn(output [B, S_img, C] gathered over SP, micro_batch) -> (loss scalar, stats dict);
        it runs on the last pipeline stage only.
    Returns one dict per micro-batch, {"loss": ..., **stats} with tensors detached and on the
    CPU, on every rank of the pipeline group. Gradients follow megatron-core's convention:
    the loss is scaled by CP / num_microbatches, so averaging gradients over the
    data-parallel-with-CP group (Megatron DDP, or all_reduce AVG) gives d(mean loss)/dw.
    """
    def loss_func(output, batch):
        loss, stats = loss_fn(output, batch)
        # Megatron scales the returned loss in place, so record a copy.
        return loss, {"loss": loss.detach().clone(), **stats}

    results = _run_schedule(model_chunks, micro_batches, loss_func, forward_only,
                            forward=None if denoiser is None else denoiser.forward)
    return object_from_last_stage(results_to_host(results) if is_last_stage() else None)


# --- pipelined inference for the rollout -------------------------------------------------
# Conditioning with one row per sample; txt_ids and img_ids are shared by the batch.
PER_SAMPLE_CONDITIONING = ("encoder_hidden_states", "pooled_projections", "guidance")


def conditioning(text, grid, guidance: float, device) -> dict:
    """The forward kwargs that depend on the prompts only, one row per prompt: `text` is a
    conditioner's (T5 embeds, pooled CLIP, txt_ids), `grid` the packed latent's token grid
    (`families/flux/transformer/latents.py` `token_grid`), `guidance` the guidance embedding's value."""
    embeds, pooled, txt_ids = text
    return dict(encoder_hidden_states=embeds.to(device), pooled_projections=pooled.to(device),
                txt_ids=txt_ids.to(device),
                img_ids=prepare_latent_image_ids(*grid, device=device, dtype=txt_ids.dtype),
                guidance=torch.full((embeds.shape[0],), float(guidance), device=device))


def make_velocity_fn(model_chunks: Sequence[FluxTransformer], cond: Dict, micro_batch_size: int):
    """velocity_fn(x [B, S_img, C], sigma [B]) -> v [B, S_img, C] on every model-parallel rank.

    cond: the conditioning of the whole batch: encoder_hidden_states [B, L, 4096],
    pooled_projections [B, 768], txt_ids [L, 3], img_ids [S_img, 3] and (FLUX.1-dev)
    guidance [B]. The batch is cut into B / micro_batch_size micro-batches that are in flight
    together through the pipeline (megatron-core's forward-only schedule); the last stage's
    velocity is then broadcast over the pipeline group, so every PP/SP/TP rank can step the
    sampler identically. With PP = 1 it is a plain forward per micro-batch.
    """
    batch = cond["encoder_hidden_states"].shape[0]
    if micro_batch_size < 1 or batch % micro_batch_size:
        raise ValueError(f"batch size {batch} is not divisible by micro_batch_size {micro_batch_size}")
    config = get_attr_wrapped_model(model_chunks[0], "flux_config")
    per_sample = [k for k in PER_SAMPLE_CONDITIONING if cond.get(k) is not None]
    seq = SequenceShard.current(cond["txt_ids"].shape[-2], cond["img_ids"].shape[-2])

    # The conditioning of each micro-batch, cut once: a step adds its latents and sigmas.
    starts = range(0, batch, micro_batch_size)
    conditioned = [dict({k: cond[k][i:i + micro_batch_size] for k in per_sample},
                        img_ids=cond["img_ids"], txt_ids=cond["txt_ids"]) for i in starts]

    def velocity_fn(x, sigma):
        if x.shape[0] != batch or sigma.shape != (batch,):
            raise ValueError(f"velocity_fn takes x [{batch}, S_img, C] and sigma [{batch}], got "
                             f"{tuple(x.shape)} and {tuple(sigma.shape)}")
        micro_batches = [dict(c, hidden_states=x[i:i + micro_batch_size], timestep=sigma[i:i + micro_batch_size])
                         for i, c in zip(starts, conditioned)]
        return forward_only(model_chunks, micro_batches, FORWARD_KEYS, seq.size * (seq.local_len + 1),
                            micro_batch_size, (batch, x.shape[1], config.output_channels), x.dtype, x.device)

    return velocity_fn
