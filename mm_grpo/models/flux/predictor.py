"""FLUX as a MindSpeed-MM predictor: the `predictor` block of model.json -> this rank's model.

MindSpeed-MM's `PredictModel` (mindspeed_mm/models/predictor/predict_model.py) builds
`PREDICTOR_MODEL_MAPPINGS[model_id](**block)` with the whole block as keyword arguments and,
under pipeline parallelism, first checks `sum(pipeline_num_layers) == num_layers` and then
replaces `num_layers` by the stage's count and adds `pre_process`, `post_process` and
`global_layer_idx`. If `from_pretrained` is set it then loads that one file with its own
`load_checkpoint` (`model.load_state_dict(sd, strict=False)`).

The block holds FLUX's hyperparameters inline under diffusers' `config.json` names. One
name is shared with MindSpeed-MM and means two things: diffusers' `num_layers` counts the
double-stream blocks, while PredictModel's counts the blocks `pipeline_num_layers` splits.
So a block with `pipeline_num_layers` gives `num_layers` as all blocks (double + single,
57 for FLUX.1) and the double-stream count is `num_layers - num_single_layers`; a block
without it uses diffusers' meaning.
"""
import os
from typing import Mapping

import torch
from megatron.core import parallel_state
from torch.nn.modules.module import _IncompatibleKeys

from mm_grpo.models.flux import layout
from mm_grpo.models.flux.config import DIFFUSERS_FIELDS, FluxConfig
from mm_grpo.models.flux.hf_weights import copy_hf_weights, transformer_dir
from mm_grpo.models.flux.model import FluxTransformer

_RUNTIME = ("recompute_blocks", "compile_blocks", "bf16")  # options of a run, not of the weights
_STAGE = ("pre_process", "post_process", "global_layer_idx")  # PredictModel's, per pipeline stage
_BLOCK = ("model_id", "from_pretrained", "dtype", "pipeline_num_layers")
KNOWN_KEYS = (*DIFFUSERS_FIELDS, *_RUNTIME, *_STAGE, *_BLOCK)
_DTYPES = {"fp32": False, "float32": False, "bf16": True, "bfloat16": True}  # -> bf16 autocast
# diffusers names that never occur among the Megatron model's own parameter names
_DIFFUSERS_ONLY = ("transformer_blocks.", "single_transformer_blocks.", "norm_out.", "proj_out.")


def _flat(layers):
    return [n for x in layers for n in (_flat(x) if isinstance(x, (list, tuple)) else [x])]


def _double_blocks(block: dict, staged: bool) -> int:
    """The number of double-stream blocks a block names (see the module docstring); `staged`:
    PredictModel has replaced `num_layers` by the pipeline stage's count."""
    default = FluxConfig()
    layers = block.get("pipeline_num_layers")
    if not layers:
        return block.get("num_layers", default.num_layers)
    total = sum(_flat(layers))
    if not staged and block.get("num_layers", total) != total:
        raise ValueError(
            f"predictor block: with pipeline_num_layers, num_layers counts all blocks (double + single) as "
            f"MindSpeed-MM's PredictModel requires: sum(pipeline_num_layers) = {total}, num_layers = "
            f"{block['num_layers']} (FLUX.1: 57 = 19 double + 38 single)")
    n_double = total - block.get("num_single_layers", default.num_single_layers)
    if n_double < 0:
        raise ValueError(f"predictor block: sum(pipeline_num_layers) = {total} is less than num_single_layers "
                         f"= {block.get('num_single_layers', default.num_single_layers)}")
    return n_double


def _bf16(dtype) -> bool:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"predictor dtype {dtype!r}: FLUX runs in fp32 or under bf16 autocast "
                         f"(use one of {', '.join(_DTYPES)})")
    return _DTYPES[name]


def flux_config_from_block(block: dict, staged: bool = False) -> FluxConfig:
    """The FLUX architecture (and runtime options) of a `predictor` block: the hyperparameters
    inline (diffusers' config.json names), else the config.json of a diffusers or converted
    `from_pretrained` folder. `staged`: the block carries a pipeline stage's arguments."""
    unknown = sorted(set(block) - set(KNOWN_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) in the flux predictor block: {', '.join(unknown)}; "
                         f"known: {', '.join(KNOWN_KEYS)}")
    runtime = {k: block[k] for k in _RUNTIME if k in block}
    if block.get("dtype") is not None:
        runtime["bf16"] = runtime.get("bf16", False) or _bf16(block["dtype"])
    arch = {k: block[k] for k in DIFFUSERS_FIELDS if k in block}
    if arch:
        return FluxConfig(**dict(arch, num_layers=_double_blocks(block, staged)), **runtime)
    path = block.get("from_pretrained")
    if path and os.path.isdir(path):
        from mm_grpo.checkpoint.metadata import CheckpointMeta
        from mm_grpo.checkpoint.paths import is_megatron_checkpoint, iteration_dir
        if is_megatron_checkpoint(path):  # converted by mm-convert: config in model_layout.json
            return CheckpointMeta.load(iteration_dir(path)).config.replace(**runtime)
        return FluxConfig.from_diffusers_config(transformer_dir(path), **runtime)
    raise ValueError("flux predictor block: give the architecture inline (diffusers' config.json fields: "
                     f"{', '.join(DIFFUSERS_FIELDS)}) or a from_pretrained folder holding its config.json")


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


class FluxPredictor(FluxTransformer):
    """FLUX built from a MindSpeed-MM `predictor` block (keyword arguments), for this rank's
    tensor-parallel shard and pipeline stage (or virtual stage).

    `from_pretrained` is one file, loaded by whoever builds the predictor (MindSpeed-MM's
    `PredictModel` does) through `load_state_dict`, which takes either this rank's own
    Megatron state dict (what Megatron's `--load` and mm-convert's shards hold) or the whole
    model under diffusers' names (`diffusion_pytorch_model.safetensors`, or mm-convert
    `mm_to_hf` output), which it cuts for this rank at any TP / PP / virtual-stage layout."""

    def __init__(self, model_id="flux", pre_process=True, post_process=True, global_layer_idx=None, **block):
        path = block.get("from_pretrained")
        if path and not os.path.isfile(path):
            raise ValueError(
                f"predictor from_pretrained {path!r} is not a file: MindSpeed-MM loads one .safetensors / .pt / .pth "
                "file (e.g. a transformer's diffusion_pytorch_model.safetensors); a sharded checkpoint goes "
                "through --load")
        staged = global_layer_idx is not None
        config = flux_config_from_block(block, staged)
        block_range = _block_range(global_layer_idx, block.get("num_layers")) if staged else None
        vp_stage = (parallel_state.get_virtual_pipeline_model_parallel_rank()
                    if parallel_state.get_virtual_pipeline_model_parallel_world_size() else None)
        super().__init__(config, pre_process=pre_process, post_process=post_process,
                         block_range=block_range, vp_stage=vp_stage)

    def load_state_dict(self, state_dict, strict=True, assign=False):
        if not is_diffusers_state_dict(state_dict):
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        return load_diffusers_state_dict(self, state_dict, strict)


def load_diffusers_state_dict(model: FluxTransformer, state_dict: Mapping, strict: bool = True):
    """The whole model's diffusers-named weights into this rank's shard of `model`.

    Missing keys are the diffusers names this stage needs and `state_dict` lacks; unexpected
    keys are names that are no FLUX weight at all (other stages' weights are expected)."""
    config = model.flux_config
    everything = {h for r in layout.stage_rules(config) for h in r.hf}
    rules = list(layout.stage_rules(config, model.block_range, model.pre_process, model.post_process))
    missing = sorted(h for r in rules for h in r.hf if h not in state_dict)
    unexpected = sorted(set(state_dict) - everything)
    if strict and (missing or unexpected):
        raise ValueError(f"diffusers FLUX state dict does not fit the model: missing {missing}, "
                         f"unexpected {unexpected}")
    copy_hf_weights(model, state_dict, [r for r in rules if all(h in state_dict for h in r.hf)])
    return _IncompatibleKeys(missing, unexpected)
