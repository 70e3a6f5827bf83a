"""Load diffusers-named Qwen-Image weights straight into a (TP-sharded, PP-staged) model, reading
only the tensors this rank's stage needs (a diffusers transformer folder with its sharded
`diffusion_pytorch_model.safetensors.index.json`, a whole pipeline folder, or a mapping)."""
import os
from collections.abc import Mapping

import torch
from megatron.core import parallel_state

from mm_grpo.families.qwen_image.transformer import layout
from mm_grpo.families.qwen_image.transformer.config import QwenImageConfig
from mm_grpo.files import safetensors_weights

FAMILY = "Qwen-Image"  # the model named in a missing checkpoint's error


def open_diffusers_weights(path: str, backend: str = "mmap") -> safetensors_weights.SafetensorsWeights:
    return safetensors_weights.open_diffusers_weights(path, backend, FAMILY)


def expected_hf_shapes(config: QwenImageConfig) -> dict:
    """Names and shapes of diffusers' QwenImageTransformer2DModel for `config` (built on meta)."""
    from diffusers import QwenImageTransformer2DModel
    with torch.device("meta"):
        ref = QwenImageTransformer2DModel(**config.to_diffusers_config())
    return {name: tuple(t.shape) for name, t in ref.state_dict().items()}


def check_hf_weights(weights: Mapping, config: QwenImageConfig):
    """Missing, unexpected and wrong-shaped diffusers tensors, all reported by name."""
    safetensors_weights.check_weights(weights, expected_hf_shapes(config))


def load_hf_weights(model, weights, check: bool = True):
    """Copy diffusers-named weights (a mapping or a path) into `model`'s TP shards for this rank."""
    if isinstance(weights, (str, os.PathLike)):
        weights = open_diffusers_weights(str(weights))
    config = model.qwen_config
    if check:
        check_hf_weights(weights, config)
    rules = list(layout.stage_rules(config, model.block_range, model.pre_process, model.post_process))
    params = dict(model.named_parameters())
    if unruled := sorted(set(params) - {r.megatron for r in rules}):
        raise RuntimeError(f"model parameters without a layout rule: {unruled}")
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for rule in rules:
            local = layout.shard(rule, layout.merge(rule, [weights[h] for h in rule.hf], config), tp_rank, tp_size)
            param = params[rule.megatron]
            if tuple(local.shape) != tuple(param.shape):
                raise ValueError(f"{rule.megatron}: shard shape {tuple(local.shape)} does not fit the model's "
                                 f"{tuple(param.shape)}")
            param.copy_(local)
    return model
