"""Qwen-Image at run time: this rank's model chunks under pipeline parallelism, their weights (a
diffusers folder) and forward / backward through megatron-core's schedules
(mm_grpo/parallel/schedule.py). Every rank of a model-parallel group (TP x CP x PP) calls these with
the same arguments; stages exchange [text ; image ; silu(temb)] as one [S + 1, B, D] tensor (this
rank's pieces under Ulysses SP)."""
import os
from typing import Callable, Dict, List, Sequence

from megatron.core import parallel_state
from megatron.core.utils import get_attr_wrapped_model

from mm_grpo.families.qwen_image.transformer.config import QwenImageConfig
from mm_grpo.families.qwen_image.transformer.hf_weights import check_hf_weights, load_hf_weights, open_diffusers_weights
from mm_grpo.families.qwen_image.transformer.model import QwenImageTransformer, transformer_config
from mm_grpo.parallel.pipeline_layout import PPLayers, resolve_pp_layers, stage_specs
from mm_grpo.parallel.schedule import results_to_host, run_schedule
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
                     loss_fn: Callable, forward_only: bool = False) -> List[Dict]:
    """Forward (and backward) of `micro_batches` (QwenImageTransformer.forward's kwargs, whole, the same
    on every rank of the model-parallel group, + what the loss reads) through megatron-core's schedule.
    loss_fn(output [B, S_img, C] gathered over SP, micro_batch) -> (loss, stats) runs on the last stage;
    returns {"loss", **stats} per micro-batch, on the CPU, on every rank of the pipeline group (gradients
    follow Megatron's convention, as FLUX's `chunks.forward_backward`)."""
    mbs, n_txt, n_img = _micro_batch_layout(micro_batches)
    seq = SequenceShard.current(n_txt, n_img)

    def loss_func(output, batch):
        loss, stats = loss_fn(output, batch)
        return loss, {"loss": loss.detach().clone(), **stats}  # Megatron scales the loss in place

    results = run_schedule(model_chunks, micro_batches, FORWARD_KEYS, loss_func, seq.size * (seq.local_len + 1), mbs,
                           forward_only)
    return object_from_last_stage(results_to_host(results) if is_last_stage() else None)
