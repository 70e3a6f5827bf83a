"""Load diffusers-named FLUX weights straight into a (TP-sharded, PP-staged) model.

Reads lazily: only the tensors this rank's stage needs are read from the safetensors
files, one at a time, so a rank never holds the whole checkpoint.
"""
import os
from collections.abc import Mapping

import torch
from megatron.core import parallel_state

from mm_grpo.families.flux.transformer import layout
from mm_grpo.families.flux.transformer.config import FluxConfig
from mm_grpo.files import safetensors_weights

FAMILY = "FLUX"  # the model named in a missing checkpoint's error


def transformer_dir(path: str) -> str:
    """A diffusers FLUX transformer folder, given it or a whole pipeline folder."""
    return safetensors_weights.transformer_dir(path, FAMILY)


def open_diffusers_weights(path: str, backend: str = "mmap") -> safetensors_weights.SafetensorsWeights:
    """Weights of a diffusers FLUX transformer folder (sharded with an index, or not), or a pipeline's."""
    return safetensors_weights.open_diffusers_weights(path, backend, FAMILY)


def expected_hf_shapes(config: FluxConfig) -> dict:
    """Names and shapes of diffusers' FluxTransformer2DModel for `config` (built on meta)."""
    from diffusers import FluxTransformer2DModel
    with torch.device("meta"):
        ref = FluxTransformer2DModel(**config.to_diffusers_config())
    return {name: tuple(t.shape) for name, t in ref.state_dict().items()}


def check_hf_weights(weights: Mapping, config: FluxConfig):
    """Missing, unexpected and wrong-shaped diffusers tensors, all reported by name."""
    safetensors_weights.check_weights(weights, expected_hf_shapes(config))


def load_hf_weights(model, weights, check: bool = True):
    """Copy diffusers-named weights (a mapping or a path) into `model` for this rank."""
    if isinstance(weights, (str, os.PathLike)):
        weights = open_diffusers_weights(str(weights))
    config = model.flux_config
    if check:
        check_hf_weights(weights, config)
    rules = list(layout.stage_rules(config, model.block_range, model.pre_process, model.post_process))
    unruled = sorted(set(dict(model.named_parameters())) - {r.megatron for r in rules})
    if unruled:
        raise RuntimeError(f"model parameters without a layout rule: {unruled}")
    copy_hf_weights(model, weights, rules)
    return model


def copy_hf_weights(model, weights, rules):
    """Copy the diffusers tensors of `rules` (of `model`'s stage) into this rank's TP shards."""
    config = model.flux_config
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for rule in rules:
            full = layout.merge(rule, [weights[h] for h in rule.hf], config)
            local = layout.shard(rule, full, tp_rank, tp_size, config)
            param = params[rule.megatron]
            if tuple(local.shape) != tuple(param.shape):
                raise ValueError(f"{rule.megatron}: shard shape {tuple(local.shape)} does not fit "
                                 f"the model's {tuple(param.shape)}")
            param.copy_(local)
