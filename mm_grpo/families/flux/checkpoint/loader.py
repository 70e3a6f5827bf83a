"""Load a Megatron-layout checkpoint of any TP / PP into this rank's model chunks."""
import torch
from megatron.core import parallel_state

from mm_grpo.families.flux.checkpoint.metadata import CheckpointMeta
from mm_grpo.families.flux.checkpoint.reader import MegatronCheckpoint
from mm_grpo.families.flux.transformer import layout


def _unwrap(module):
    """The FluxTransformer inside DDP / Float16Module style wrappers (they keep it in `.module`)."""
    while not hasattr(module, "flux_config") and hasattr(module, "module"):
        module = module.module
    if not hasattr(module, "flux_config"):
        raise TypeError(f"{type(module).__name__} is not a FLUX model chunk (no flux_config)")
    return module


def _tp_rank_and_size():
    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return (parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size())


def load_megatron_checkpoint(model, path: str, iteration=None) -> CheckpointMeta:
    """Copy the weights of `model` (one chunk, or this rank's list of virtual-pipeline chunks)
    from the checkpoint at `path` (a root with `latest_checkpointed_iteration.txt`, or one
    iteration folder), whatever TP / PP it was saved with. Returns the checkpoint's metadata."""
    chunks = [_unwrap(m) for m in (model if isinstance(model, (list, tuple)) else [model])]
    # A checkpoint without mm-grpo's metadata (saved by Megatron / MindSpeed-MM) takes what its
    # weights cannot tell (RoPE) from the model; the architecture is still checked below.
    ckpt = MegatronCheckpoint(path, iteration, config=chunks[0].flux_config)
    tp_rank, tp_size = _tp_rank_and_size()
    try:
        with torch.no_grad():
            for chunk in chunks:
                _load_chunk(chunk, ckpt, tp_rank, tp_size)
    finally:
        ckpt.close()
    return ckpt.meta


def _load_chunk(chunk, ckpt: MegatronCheckpoint, tp_rank: int, tp_size: int):
    config = chunk.flux_config
    if config.to_diffusers_config() != ckpt.config.to_diffusers_config():
        raise ValueError(f"checkpoint {ckpt.path} holds a different FLUX architecture: "
                         f"{ckpt.config.to_diffusers_config()} vs the model's {config.to_diffusers_config()}")
    params = dict(chunk.named_parameters())
    rules = list(layout.stage_rules(config, chunk.block_range, chunk.pre_process, chunk.post_process))
    unruled = sorted(set(params) - {r.megatron for r in rules})
    if unruled:
        raise RuntimeError(f"model parameters without a layout rule: {unruled}")
    for rule in rules:
        local = ckpt.local(rule, tp_rank, tp_size)
        param = params[rule.megatron]
        if local.shape != param.shape:
            raise ValueError(f"{rule.megatron}: checkpoint shard {tuple(local.shape)} does not fit the "
                             f"model's {tuple(param.shape)}")
        param.copy_(local)
