"""Load a Megatron-layout Qwen-Image checkpoint of any TP / PP into this rank's model chunks."""
import torch
from megatron.core import parallel_state

from mm_grpo.families.qwen_image.checkpoint.metadata import CheckpointMeta, check_same_architecture
from mm_grpo.families.qwen_image.checkpoint.reader import MegatronCheckpoint
from mm_grpo.families.qwen_image.transformer import layout


def _unwrap(module):
    """The QwenImageTransformer inside DDP / Float16Module style wrappers (they keep it in `.module`)."""
    while not hasattr(module, "qwen_config") and hasattr(module, "module"):
        module = module.module
    if not hasattr(module, "qwen_config"):
        raise TypeError(f"{type(module).__name__} is not a Qwen-Image model chunk (no qwen_config)")
    return module


def _tp_rank_and_size():
    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return (parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size())


def load_megatron_checkpoint(model, path: str, iteration=None) -> CheckpointMeta:
    """Copy the weights of `model` (one chunk, or this rank's list of virtual-pipeline chunks) from the
    checkpoint at `path` (a root with `latest_checkpointed_iteration.txt`, or one iteration folder),
    whatever TP / PP it was saved with; each rank reads only its stage's tensors. Returns the
    checkpoint's metadata."""
    chunks = [_unwrap(m) for m in (model if isinstance(model, (list, tuple)) else [model])]
    ckpt = MegatronCheckpoint(path, iteration)
    tp_rank, tp_size = _tp_rank_and_size()
    try:
        check_same_architecture(ckpt.config, chunks[0].qwen_config, f"checkpoint {ckpt.path}", "the model")
        with torch.no_grad():
            for chunk in chunks:
                _load_chunk(chunk, ckpt, tp_rank, tp_size)
    finally:
        ckpt.close()
    return ckpt.meta


def _load_chunk(chunk, ckpt: MegatronCheckpoint, tp_rank: int, tp_size: int):
    params = dict(chunk.named_parameters())
    rules = list(layout.stage_rules(chunk.qwen_config, chunk.block_range, chunk.pre_process, chunk.post_process))
    if unruled := sorted(set(params) - {r.megatron for r in rules}):
        raise RuntimeError(f"model parameters without a layout rule: {unruled}")
    for rule in rules:
        local = ckpt.local(rule, tp_rank, tp_size)
        param = params[rule.megatron]
        if local.shape != param.shape:
            raise ValueError(f"{rule.megatron}: checkpoint shard {tuple(local.shape)} does not fit the model's "
                             f"{tuple(param.shape)}")
        param.copy_(local)
