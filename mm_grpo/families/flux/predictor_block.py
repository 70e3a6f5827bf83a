"""The `predictor` block of a model.json (MindSpeed-MM's, which mm-grpo's trainers read too) ->
FLUX's config.

The block holds FLUX's hyperparameters inline under diffusers' `config.json` names. One
name is shared with MindSpeed-MM and means two things: diffusers' `num_layers` counts the
double-stream blocks, while PredictModel's counts the blocks `pipeline_num_layers` splits.
So a block with `pipeline_num_layers` gives `num_layers` as all blocks (double + single,
57 for FLUX.1) and the double-stream count is `num_layers - num_single_layers`; a block
without it uses diffusers' meaning.

MindSpeed-MM's argument validation (`mindspeed_mm/patchs/validate_args_patch.py`) sets
Megatron's `--num-attention-heads` from the block's `num_heads` and `--hidden-size` from
`num_heads x head_dim`, the names of its own MMDiT (HunyuanVideo's: 24 x 128, as FLUX.1's). So
the block may name the attention heads and their width MindSpeed-MM's way (`num_heads`,
`head_dim`) or diffusers' way (`num_attention_heads`, `attention_head_dim`); named both ways,
they must agree. MindSpeed-MM's scripts need MindSpeed-MM's names (`mindspeed_mm_block_error`).
"""
import dataclasses
import os
from typing import Annotated, List, Literal, Optional, Union

from pydantic import Field

from mm_grpo.checkpoint.paths import is_megatron_checkpoint, iteration_dir
from mm_grpo.configs import AeBlock, ModelBlocks, TextEncoderBlock
from mm_grpo.families.flux.checkpoint.metadata import CheckpointMeta
from mm_grpo.families.flux.text import MAX_SEQUENCE_LENGTH
from mm_grpo.families.flux.transformer.config import DIFFUSERS_FIELDS, FluxConfig
from mm_grpo.families.flux.transformer.hf_weights import transformer_dir
from mm_grpo.recompute import METHODS, block_recompute_fields
from mm_grpo.settings import Count, Finite, NonNegative, read_block

MODEL_ID = "flux"  # the predictor's model_id (mm_grpo/mindspeed_mm/registry.py registers it)
# The names model.json's other blocks may give FLUX's parts: the shipped configs' (MindSpeed-MM's FLUX
# DanceGRPO), and MindSpeed-MM's own for FLUX's VAE (its AE_MODEL_MAPPINGS); mm-grpo reads neither.
AE_MODEL_IDS = ("autoencoder_kl", "flux_vae")
TEXT_ENCODER_MODEL_IDS = ("flux_text_encoders",)
_RUNTIME = ("compile_blocks", "bf16")  # options of a run, not of the weights
# MindSpeed-MM's name -> diffusers' (see the module docstring).
MINDSPEED_MM_NAMES = {"num_heads": "num_attention_heads", "head_dim": "attention_head_dim"}
_DTYPES = {"fp32": False, "float32": False, "bf16": True, "bfloat16": True}  # -> bf16 compute
BLOCK_NAME = "the flux predictor block"  # in errors, where the file is not known
PipelineLayers = Annotated[Union[List[NonNegative], List[List[NonNegative]]], Field(
    description="the blocks of each pipeline stage: a list of whole numbers, or one such list per virtual stage")]


@dataclasses.dataclass(frozen=True)
class PredictorBlock:
    """What a flux predictor block holds besides FLUX's architecture (FluxConfig's DIFFUSERS_FIELDS)."""
    model_id: Optional[Literal[MODEL_ID]] = None
    from_pretrained: Optional[str] = None
    dtype: Optional[str] = None  # one of _DTYPES (`_bf16`)
    pipeline_num_layers: Optional[PipelineLayers] = None
    num_heads: Optional[Count] = None  # MINDSPEED_MM_NAMES
    head_dim: Optional[Count] = None
    recompute_blocks: bool = False  # older configs: every block (mm_grpo/recompute.py block_recompute_fields)
    recompute_method: Optional[Literal[METHODS]] = None
    recompute_num_layers: Optional[Count] = None
    compile_blocks: bool = False  # _RUNTIME
    bf16: bool = False
    pre_process: bool = True  # PredictModel's, per pipeline stage
    post_process: bool = True
    global_layer_idx: Optional[List[NonNegative]] = None
    text_len: Optional[Count] = None  # read by the SoRAModel interface only (names as wandit's block has them)
    guidance_scale: Optional[Finite] = None


KNOWN_KEYS = (*DIFFUSERS_FIELDS, *(f.name for f in dataclasses.fields(PredictorBlock)))


@dataclasses.dataclass(frozen=True)
class FluxTextEncoderBlock(TextEncoderBlock):
    model_id: Optional[Literal[TEXT_ENCODER_MODEL_IDS]] = None
    max_sequence_length: Optional[Annotated[int, Field(ge=1, le=MAX_SEQUENCE_LENGTH)]] = None


@dataclasses.dataclass(frozen=True)
class FluxAeBlock(AeBlock):
    model_id: Optional[Literal[AE_MODEL_IDS]] = None


def check_block(block: dict, where: str = BLOCK_NAME) -> dict:
    """The flux predictor block `block` (`where`: its file and block, in errors) checked without reading
    any file: its keys, every value's type and range (PredictorBlock's, FluxConfig's), MindSpeed-MM's and
    diffusers' names for the heads agreeing; returns its architecture under diffusers' names."""
    own = read_block(PredictorBlock, block, where, known=KNOWN_KEYS)
    arch = {k: block[k] for k in DIFFUSERS_FIELDS if k in block}
    for ours, theirs in MINDSPEED_MM_NAMES.items():
        if getattr(own, ours) is not None:
            if arch.setdefault(theirs, block[ours]) != block[ours]:
                raise ValueError(f"{where}: {ours} = {block[ours]} and {theirs} = {block[theirs]} are MindSpeed-MM's "
                                 "and diffusers' names for the same number; give one, or equal values")
    if arch:
        read_block(FluxConfig, arch, where)
    if own.dtype is not None:
        _bf16(own.dtype)
    return arch


MODEL_BLOCKS = ModelBlocks(FluxTextEncoderBlock, FluxAeBlock, check_block)


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
        raise ValueError(f"predictor dtype {dtype!r}: FLUX computes in fp32 or bf16 "
                         f"(use one of {', '.join(_DTYPES)})")
    return _DTYPES[name]


def flux_config_from_block(block: dict, staged: bool = False) -> FluxConfig:
    """The FLUX architecture (and runtime options) of a `predictor` block (checked: `check_block`): the
    hyperparameters inline (diffusers' config.json names), else the config.json of a diffusers or
    converted `from_pretrained` folder. `staged`: the block carries a pipeline stage's arguments."""
    arch = check_block(block)
    runtime = {k: block[k] for k in _RUNTIME if k in block}
    runtime.update(block_recompute_fields(block, BLOCK_NAME))
    if block.get("dtype") is not None:
        runtime["bf16"] = runtime.get("bf16", False) or _bf16(block["dtype"])
    if arch:
        return read_block(FluxConfig, dict(arch, num_layers=_double_blocks(block, staged), **runtime), BLOCK_NAME)
    path = block.get("from_pretrained")
    if path and os.path.isdir(path):
        if is_megatron_checkpoint(path):  # converted by mm-convert: the config is in its shards
            return CheckpointMeta.load(iteration_dir(path)).config.replace(**runtime)
        return FluxConfig.from_diffusers_config(transformer_dir(path), **runtime)
    raise ValueError("flux predictor block: give the architecture inline (diffusers' config.json fields: "
                     f"{', '.join(DIFFUSERS_FIELDS)}) or a from_pretrained folder holding its config.json")


def mindspeed_mm_block_error(block: dict):
    """Why MindSpeed-MM's argument validation cannot read a flux `block` (it multiplies
    `num_heads` by `head_dim`, default 1, else a missing --num-attention-heads by it); None if it can."""
    missing = [k for k in MINDSPEED_MM_NAMES if k not in block]
    if not missing:
        return None
    value = {k: block.get(theirs, getattr(FluxConfig, theirs)) for k, theirs in MINDSPEED_MM_NAMES.items()}
    return (f"the flux predictor block lacks {' and '.join(missing)}: MindSpeed-MM sets --num-attention-heads "
            f"from num_heads and --hidden-size from num_heads x head_dim (FLUX.1: 24 x 128 = 3072); add "
            + ", ".join(f'"{k}": {value[k]}' for k in missing))
