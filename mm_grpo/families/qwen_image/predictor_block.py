"""The `predictor` block of a model.json naming Qwen-Image -> its config.

The block holds the architecture inline under diffusers' `config.json` names, or names a
`from_pretrained` folder (a diffusers pipeline or `transformer/` folder, or an mm-convert checkpoint)
holding it. Qwen-Image has one kind of block, so diffusers' `num_layers` and MindSpeed-MM's
PredictModel's (the blocks `pipeline_num_layers` splits) count the same blocks. MindSpeed-MM's argument
validation sets Megatron's `--num-attention-heads` and `--hidden-size` from the block's `num_heads` and
`head_dim`; they may stand beside diffusers' names and must agree with them.
"""
import dataclasses
import os
from typing import Annotated, List, Literal, Optional, Union

from pydantic import Field

from mm_grpo.checkpoint.paths import is_megatron_checkpoint, iteration_dir
from mm_grpo.configs import AeBlock, ModelBlocks, TextEncoderBlock
from mm_grpo.families.qwen_image.transformer.config import DIFFUSERS_FIELDS, QwenImageConfig
from mm_grpo.recompute import METHODS, block_recompute_fields
from mm_grpo.settings import Count, NonNegative, read_block

# The predictor's model_id: mm-grpo's, apart from MindSpeed-MM's own names (its PREDICTOR_MODEL_MAPPINGS), so
# that a MindSpeed-MM release that adds a Qwen-Image DiT of its own cannot take this one's place.
MODEL_ID = "mmgrpo_qwenimage"
TEXT_ENCODER_MODEL_IDS = ("qwen2_5_vl",)  # names model.json's other blocks may carry; mm-grpo reads neither
AE_MODEL_IDS = ("autoencoder_kl_qwenimage",)
MAX_SEQUENCE_LENGTH = 1024  # QwenImagePipeline refuses longer prompts
RUNTIME = ("bf16",)  # options of a run, not of the weights
MINDSPEED_MM_NAMES = {"num_heads": "num_attention_heads", "head_dim": "attention_head_dim"}
_DTYPES = {"fp32": False, "float32": False, "bf16": True, "bfloat16": True}  # -> bf16 compute
BLOCK_NAME = f"the {MODEL_ID} predictor block"
PipelineLayers = Annotated[Union[List[NonNegative], List[List[NonNegative]]], Field(
    description="the blocks of each pipeline stage: a list of whole numbers, or one such list per virtual stage")]


@dataclasses.dataclass(frozen=True)
class PredictorBlock:
    """What a Qwen-Image predictor block holds besides the architecture (QwenImageConfig's DIFFUSERS_FIELDS)."""
    model_id: Literal[MODEL_ID] = MODEL_ID
    from_pretrained: Optional[str] = None
    dtype: Optional[str] = None  # one of _DTYPES (`_bf16`); MindSpeed-MM's ConfigReader gives a torch dtype
    pipeline_num_layers: Optional[PipelineLayers] = None
    num_heads: Optional[Count] = None  # MINDSPEED_MM_NAMES
    head_dim: Optional[Count] = None
    recompute_blocks: bool = False  # older configs: every block (mm_grpo/recompute.py block_recompute_fields)
    recompute_method: Optional[Literal[METHODS]] = None
    recompute_num_layers: Optional[Count] = None
    bf16: bool = False  # RUNTIME
    pre_process: bool = True  # PredictModel's, per pipeline stage
    post_process: bool = True
    global_layer_idx: Optional[List[NonNegative]] = None


KNOWN_KEYS = (*DIFFUSERS_FIELDS, *(f.name for f in dataclasses.fields(PredictorBlock)))


@dataclasses.dataclass(frozen=True)
class QwenImageTextEncoderBlock(TextEncoderBlock):
    model_id: Optional[Literal[TEXT_ENCODER_MODEL_IDS]] = None
    max_sequence_length: Optional[Annotated[int, Field(ge=1, le=MAX_SEQUENCE_LENGTH)]] = None


@dataclasses.dataclass(frozen=True)
class QwenImageAeBlock(AeBlock):
    model_id: Optional[Literal[AE_MODEL_IDS]] = None


def check_block(block: dict, where: str = BLOCK_NAME) -> dict:
    """The block checked without reading any file (its keys, every value's type and range, the two names
    of the heads agreeing); returns its architecture under diffusers' names."""
    own = read_block(PredictorBlock, block, where, known=KNOWN_KEYS)
    arch = {k: block[k] for k in DIFFUSERS_FIELDS if k in block}
    for ours, theirs in MINDSPEED_MM_NAMES.items():
        if getattr(own, ours) is not None and arch.setdefault(theirs, block[ours]) != block[ours]:
            raise ValueError(f"{where}: {ours} = {block[ours]} and {theirs} = {block[theirs]} are MindSpeed-MM's and "
                             "diffusers' names for the same number; give one, or equal values")
    if arch:
        read_block(QwenImageConfig, arch, where)
    if own.dtype is not None:
        _bf16(own.dtype)
    return arch


def _bf16(dtype) -> bool:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"predictor dtype {dtype!r}: Qwen-Image computes in fp32 or bf16 (use one of {', '.join(_DTYPES)})")
    return _DTYPES[name]


MODEL_BLOCKS = ModelBlocks(QwenImageTextEncoderBlock, QwenImageAeBlock, check_block)


def config_from_block(block: dict) -> QwenImageConfig:
    """The architecture (and runtime options) of a predictor block (checked: `check_block`): inline, else
    the config.json of its `from_pretrained` folder or the metadata of a converted checkpoint."""
    if block.get("compile_blocks"):
        raise ValueError("--compile-blocks compiles FLUX's blocks; Qwen-Image's run eagerly (drop the flag)")
    block = {k: v for k, v in block.items() if k != "compile_blocks"}
    arch = check_block(block)
    runtime = {k: block[k] for k in RUNTIME if k in block}
    runtime.update(block_recompute_fields(block, BLOCK_NAME))
    if block.get("dtype") is not None:
        runtime["bf16"] = runtime.get("bf16", False) or _bf16(block["dtype"])
    if arch:
        return read_block(QwenImageConfig, dict(arch, **runtime), BLOCK_NAME)
    path = block.get("from_pretrained")
    if path and os.path.isdir(path):
        if is_megatron_checkpoint(path):  # converted by mm-convert: the config is in its shards
            from mm_grpo.families.qwen_image.checkpoint.metadata import CheckpointMeta
            return CheckpointMeta.load(iteration_dir(path)).config.replace(**runtime)
        return QwenImageConfig.from_diffusers_config(path, **runtime)
    raise ValueError(f"{BLOCK_NAME}: give the architecture inline (diffusers' config.json fields: "
                     f"{', '.join(DIFFUSERS_FIELDS)}) or a from_pretrained folder holding its config.json")
