"""Qwen-Image as a MindSpeed-MM predictor: the `predictor` block of model.json -> this rank's model.

MindSpeed-MM's `PredictModel` builds `PREDICTOR_MODEL_MAPPINGS[model_id](**block)` with the whole block as
keyword arguments (under pipeline parallelism with the stage's `num_layers`, `pre_process`, `post_process`
and `global_layer_idx`) and, with `from_pretrained` set, loads that one file through `load_state_dict`
(strict=False). mm-grpo's GRPO inside MindSpeed-MM's `pretrain` (mm_grpo/mindspeed_mm/grpo.py) calls the
model as diffusers' QwenImageTransformer2DModel is called, through the family's denoiser.
"""
import os
from typing import Mapping

import torch
from megatron.core import parallel_state
from torch.nn.modules.module import _IncompatibleKeys

from mm_grpo.families.qwen_image.predictor_block import MODEL_ID, config_from_block
from mm_grpo.families.qwen_image.transformer import layout
from mm_grpo.families.qwen_image.transformer.config import DIFFUSERS_FIELDS
from mm_grpo.families.qwen_image.transformer.hf_weights import load_hf_weights
from mm_grpo.families.qwen_image.transformer.model import QwenImageTransformer
from mm_grpo.recompute import with_megatron_recompute

# diffusers names that never occur among the Megatron model's own parameter names
_DIFFUSERS_ONLY = ("transformer_blocks.", "norm_out.", "proj_out.", "time_text_embed.timestep_embedder.")


def _block_range(global_layer_idx, num_layers):
    idx = list(global_layer_idx)
    start = idx[0] if idx else 0
    if idx != list(range(start, start + len(idx))):
        raise ValueError(f"global_layer_idx must be consecutive, got {idx}")
    if num_layers is not None and num_layers != len(idx):
        raise ValueError(f"num_layers {num_layers} != len(global_layer_idx) {len(idx)}")
    return start, start + len(idx)


def is_diffusers_state_dict(state_dict: Mapping) -> bool:
    return any(k.startswith(_DIFFUSERS_ONLY) for k in state_dict)


class QwenImagePredictor(QwenImageTransformer):
    """Qwen-Image built from a MindSpeed-MM `predictor` block, for this rank's tensor-parallel shard and
    pipeline stage; `load_state_dict` takes this rank's Megatron state dict or the whole model under
    diffusers' names (one `diffusion_pytorch_model.safetensors`, or mm-convert `mm_to_hf` output merged
    into one file), which it cuts for this rank."""

    def __init__(self, model_id=MODEL_ID, pre_process=True, post_process=True, global_layer_idx=None, **block):
        path = block.get("from_pretrained")
        if path and not os.path.isfile(path):
            raise ValueError(
                f"predictor from_pretrained {path!r} is not a file: MindSpeed-MM loads one .safetensors / .pt / .pth "
                "file; a sharded diffusers folder goes through mm-convert QwenImageConverter hf_to_mm and --load")
        block = with_megatron_recompute(block)
        staged = global_layer_idx is not None
        stage_blocks = block.get("num_layers")
        if staged:  # PredictModel has replaced num_layers by the stage's count: the model's is the sum
            block = dict(block, num_layers=sum(_flat(block["pipeline_num_layers"])))
        # the file's architecture: the config.json beside it (a diffusers transformer folder's)
        config = config_from_block(block if _has_architecture(block) or not path
                                   else dict(block, from_pretrained=os.path.dirname(os.path.abspath(path))))
        block_range = _block_range(global_layer_idx, stage_blocks) if staged else None
        vp_stage = (parallel_state.get_virtual_pipeline_model_parallel_rank()
                    if parallel_state.get_virtual_pipeline_model_parallel_world_size() else None)
        super().__init__(config, pre_process=pre_process, post_process=post_process, block_range=block_range,
                         vp_stage=vp_stage)

    def load_state_dict(self, state_dict, strict=True, assign=False):
        if not is_diffusers_state_dict(state_dict):
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        return load_diffusers_state_dict(self, state_dict, strict)


def _flat(layers):
    return [n for x in layers for n in (_flat(x) if isinstance(x, (list, tuple)) else [x])]


def _has_architecture(block) -> bool:
    return any(k in block for k in DIFFUSERS_FIELDS)


def load_diffusers_state_dict(model: QwenImageTransformer, state_dict: Mapping, strict: bool = True):
    """The whole model's diffusers-named weights into this rank's shard of `model`: missing keys are the
    names this stage needs and `state_dict` lacks; unexpected ones are no Qwen-Image weight at all."""
    config = model.qwen_config
    everything = {h for r in layout.stage_rules(config) for h in r.hf}
    rules = list(layout.stage_rules(config, model.block_range, model.pre_process, model.post_process))
    missing = sorted(h for r in rules for h in r.hf if h not in state_dict)
    unexpected = sorted(set(state_dict) - everything)
    if strict and (missing or unexpected):
        raise ValueError(f"diffusers Qwen-Image state dict does not fit the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    if not missing:
        with torch.no_grad():
            load_hf_weights(model, state_dict, check=False)
    return _IncompatibleKeys(missing, unexpected)
