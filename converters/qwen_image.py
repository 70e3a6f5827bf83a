"""`mm-convert QwenImageConverter ...`: Qwen-Image transformer weights between diffusers folders and
Megatron shards.

The source of hf_to_mm is diffusers' layout as Qwen/Qwen-Image ships it: a `transformer/` folder whose
`diffusion_pytorch_model.safetensors.index.json` names its shard files, or the whole pipeline folder
(`model_index.json` + `transformer/`). Every path streams: a weight is read (lazily, from safetensors or
a shard file), merged and cut by the model's layout rules (`mm_grpo.families.qwen_image.transformer.
layout`), and its pieces are written where the target files reserve them; no more than a few tensors
are in memory. Targets are built in a temporary folder next to the target and renamed at the end;
hf_to_mm into its own source folder adds the Megatron files beside the diffusers ones the same way, the
tracker file last.

The options are FluxConverter's (converters/flux.py) where they mean something for Qwen-Image, with the
same semantics; QwenImageConverter is a MindSpeed-MM `Converter` when MindSpeed-MM is importable
(converters/mindspeed_mm.py).
"""
import contextlib
import dataclasses
import os
import time
from typing import List, Literal, Optional, Union

from converters import megatron_io
from converters.mindspeed_mm import Converter
from converters.target_guard import prepare_target
from mm_grpo.checkpoint import is_megatron_checkpoint
from mm_grpo.families.qwen_image.checkpoint import CheckpointMeta, MegatronCheckpoint
from mm_grpo.families.qwen_image.checkpoint.metadata import check_same_architecture
from mm_grpo.families.qwen_image.transformer import layout
from mm_grpo.families.qwen_image.transformer.config import PRESETS, QwenImageConfig
from mm_grpo.families.qwen_image.transformer.hf_weights import check_hf_weights, open_diffusers_weights
from mm_grpo.files.safetensors_weights import transformer_dir

FAMILY = "Qwen-Image"
DIFFUSERS_CLASS = "QwenImageTransformer2DModel"
DtypeName = Optional[Literal["bf16", "fp16", "fp32"]]
PresetName = Optional[Literal[tuple(PRESETS)]]


@dataclasses.dataclass
class TargetParallelConfig:
    """Parallel layout of the Megatron checkpoint to write.

    Args:
        tp_size: Tensor-parallel size; must divide the number of attention heads (24 for Qwen-Image).
        pp_layers: Blocks per pipeline stage (Qwen-Image: 60 dual-stream blocks), e.g. [30,30]; must sum
            to the block count. A nested list [[..],[..]] gives virtual pipeline chunks, one inner list per
            chunk. Default: one stage.
        ep_size: Expert-parallel size, as in MindSpeed-MM's ParallelConfig; Qwen-Image has no experts: 1 only.
    """

    tp_size: int = 1
    pp_layers: Optional[Union[List[int], List[List[int]]]] = None
    ep_size: int = 1


@dataclasses.dataclass
class HfToMmConfig:
    """Options of `hf_to_mm`.

    Args:
        source_path: A diffusers Qwen-Image transformer folder (config.json + diffusion_pytorch_model*.safetensors,
            with or without an index), or a whole pipeline folder (its transformer/ is used).
        target_path: Megatron checkpoint folder to create (latest_checkpointed_iteration.txt,
            release/mp_rank_*/model_optim_rng.pt). The source folder itself is allowed: the Megatron
            files are added beside the diffusers ones (MindSpeed-MM's in-place conversion).
        target_parallel_config: Parallel layout of the output.
        hf_dir: diffusers transformer or pipeline folder whose config.json describes the model; overrides
            the source's config.json.
        preset: Built-in model config instead of a config.json: qwen-image (tiny: tests).
        dtype: Cast the weights to bf16, fp16 or fp32; default: keep the source dtype.
        overwrite: Replace target_path if it already holds a Megatron checkpoint.
        lora_path: MindSpeed-MM's LoRA weights option; QwenImageConverter converts whole weights only: leave empty.
    """

    source_path: str
    target_path: str
    target_parallel_config: TargetParallelConfig = dataclasses.field(default_factory=TargetParallelConfig)
    hf_dir: Optional[str] = None
    preset: PresetName = None
    dtype: DtypeName = None
    overwrite: bool = False
    lora_path: str = ""


@dataclasses.dataclass
class MmToHfConfig:
    """Options of `mm_to_hf`.

    Args:
        source_path: Megatron checkpoint folder (from hf_to_mm, resplit or training), or one iteration
            folder of it; any TP/PP.
        target_path: diffusers transformer folder to create (config.json, safetensors shards and their
            index) that QwenImageTransformer2DModel.from_pretrained loads; not the source.
        hf_dir: The original diffusers transformer (or pipeline) folder, as MindSpeed-MM's converters
            take it: its config.json is copied (checked against the checkpoint's architecture) and its
            index's file split is kept.
        iteration: Iteration to convert (its iter_XXXXXXX folder); default: the one
            latest_checkpointed_iteration.txt names.
        max_shard_size: Largest safetensors file, as diffusers' save_pretrained takes it (10GB, 500MB...);
            default 10GB, or hf_dir's file split.
        dtype: Cast the weights to bf16, fp16 or fp32; default: keep the source dtype.
        overwrite: Replace target_path if it already holds a diffusers folder.
        lora_path: MindSpeed-MM's LoRA weights option; QwenImageConverter converts whole weights only: leave empty.
        weights: Which weights of a training checkpoint to export: policy (the trained model) or ema
            (its exponential moving average, saved with --ema-decay).
    """

    source_path: str
    target_path: str
    hf_dir: Optional[str] = None
    iteration: Optional[int] = None
    max_shard_size: Optional[str] = None
    dtype: DtypeName = None
    overwrite: bool = False
    lora_path: str = ""
    weights: Literal["policy", "ema"] = "policy"


@dataclasses.dataclass
class ResplitConfig:
    """Options of `resplit`.

    Args:
        source_path: Megatron checkpoint folder, or one iteration folder of it; any TP/PP.
        target_path: Megatron checkpoint folder to create with the new layout (model weights only, as
            `release`); not the source.
        target_parallel_config: Parallel layout of the output.
        iteration: Iteration to read; default: the one latest_checkpointed_iteration.txt names.
        dtype: Cast the weights to bf16, fp16 or fp32; default: keep the source dtype.
        overwrite: Replace target_path if it already holds a Megatron checkpoint.
        lora_path: MindSpeed-MM's LoRA weights option; QwenImageConverter converts whole weights only: leave empty.
    """

    source_path: str
    target_path: str
    target_parallel_config: TargetParallelConfig = dataclasses.field(default_factory=TargetParallelConfig)
    iteration: Optional[int] = None
    dtype: DtypeName = None
    overwrite: bool = False
    lora_path: str = ""


class QwenImageConverter(Converter):
    """Qwen-Image transformer weights: diffusers <-> Megatron TP/PP shards."""

    def hf_to_mm(self, cfg: HfToMmConfig):
        """Convert a diffusers Qwen-Image transformer (or pipeline) folder into the sharded Megatron layout."""
        start = time.perf_counter(), time.process_time()
        _refuse_unsupported(cfg)
        weights, config = open_hf_source(cfg.source_path, cfg.hf_dir, cfg.preset)
        meta = _target_meta(config, cfg.target_parallel_config, cfg.dtype, {weights.meta(h).dtype for h in weights})
        prepare_target(cfg.source_path, cfg.target_path, in_place_ok=True)
        in_place = megatron_io.same_path(cfg.source_path, cfg.target_path)
        if in_place:
            megatron_io.check_in_place(cfg.target_path, cfg.overwrite)
        else:
            megatron_io.check_target(cfg.target_path, cfg.overwrite, is_megatron_checkpoint)

        def full(rule, read):
            return layout.merge(rule, [weights[h] if read else weights.meta(h) for h in rule.hf], config)

        _write_megatron(cfg.target_path, meta, full, cfg.overwrite, "hf_to_mm", beside=in_place)
        megatron_io.report("hf_to_mm", cfg.target_path, start)

    def mm_to_hf(self, cfg: MmToHfConfig):
        """Convert a Megatron checkpoint (any TP/PP) into a diffusers transformer folder."""
        start = time.perf_counter(), time.process_time()
        _refuse_unsupported(cfg)
        megatron_io.refuse_in_place(cfg.source_path, cfg.target_path, "mm_to_hf writes a diffusers folder of its "
                                    "own, and the folder it replaces holds the shards being read")
        prepare_target(cfg.source_path, cfg.target_path)
        original = _original_folder(cfg.hf_dir, cfg.max_shard_size) if cfg.hf_dir else None
        with contextlib.closing(_open_checkpoint(cfg.source_path, cfg.iteration, cfg.weights)) as ckpt:
            if original:
                check_same_architecture(ckpt.config, original.config, ckpt.path, f"{cfg.hf_dir}'s config.json")
            megatron_io.check_target(cfg.target_path, cfg.overwrite, megatron_io.is_diffusers_folder)
            _write_diffusers(ckpt, cfg, original)
        megatron_io.report("mm_to_hf", cfg.target_path, start)

    def resplit(self, cfg: ResplitConfig):
        """Rewrite a Megatron checkpoint with another TP/PP layout, without going through diffusers files."""
        start = time.perf_counter(), time.process_time()
        _refuse_unsupported(cfg)
        megatron_io.refuse_in_place(cfg.source_path, cfg.target_path, "the new layout would replace the folder "
                                    "holding the shards being read (and any other iterations in it)")
        prepare_target(cfg.source_path, cfg.target_path)
        with contextlib.closing(_open_checkpoint(cfg.source_path, cfg.iteration)) as ckpt:
            dtypes = {ckpt.full_meta(r).dtype for r in layout.stage_rules(ckpt.config)}
            meta = _target_meta(ckpt.config, cfg.target_parallel_config, cfg.dtype, dtypes)
            megatron_io.check_target(cfg.target_path, cfg.overwrite, is_megatron_checkpoint)

            def full(rule, read):
                return ckpt.full(rule) if read else ckpt.full_meta(rule)

            _write_megatron(cfg.target_path, meta, full, cfg.overwrite, "resplit")
        megatron_io.report("resplit", cfg.target_path, start)


def _refuse_unsupported(cfg):
    """MindSpeed-MM's ConvertConfig options that mean nothing for Qwen-Image, refused before any work."""
    if cfg.lora_path:
        raise ValueError(f"--cfg.lora_path {cfg.lora_path}: QwenImageConverter converts whole Qwen-Image "
                         "weights; LoRA weights are not supported")
    parallel = getattr(cfg, "target_parallel_config", None)
    if parallel is not None and parallel.ep_size != 1:
        raise ValueError(f"--cfg.target_parallel_config.ep_size {parallel.ep_size}: Qwen-Image has no experts "
                         "to split (only 1)")


# --- sources ---------------------------------------------------------------------------
def _config_from(hf_dir, preset) -> Optional[QwenImageConfig]:
    if hf_dir and preset:
        raise ValueError("give --cfg.hf_dir or --cfg.preset, not both")
    if hf_dir:
        return QwenImageConfig.from_diffusers_config(transformer_dir(hf_dir, FAMILY))
    return QwenImageConfig.preset(preset) if preset else None


def open_hf_source(path: str, hf_dir: Optional[str] = None, preset: Optional[str] = None):
    """(lazy diffusers-named weights, QwenImageConfig) of a diffusers transformer folder or a pipeline
    folder, every tensor's name and shape checked against the config."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such {FAMILY} checkpoint: {path}")
    if not os.path.isdir(path):
        raise ValueError(f"{path} is a file: QwenImageConverter reads a diffusers transformer folder (config.json "
                         "and diffusion_pytorch_model*.safetensors) or a pipeline folder holding one")
    config = _config_from(hf_dir, preset) or QwenImageConfig.from_diffusers_config(transformer_dir(path, FAMILY))
    weights = open_diffusers_weights(path, backend="pread")
    check_hf_weights(weights, config)
    return weights, config


def _open_checkpoint(path: str, iteration, weights: str = "policy") -> MegatronCheckpoint:
    """The checkpoint (its policy, or its EMA), every shard checked against its layout."""
    ckpt = MegatronCheckpoint(path, iteration, weights=weights)
    try:
        ckpt.check()
    except BaseException:
        ckpt.close()
        raise
    return ckpt


def _original_folder(hf_dir: str, max_shard_size: Optional[str]) -> megatron_io.OriginalFolder:
    folder = transformer_dir(hf_dir, FAMILY)
    return megatron_io.original_folder(folder, hf_dir, QwenImageConfig.from_diffusers_config(folder), max_shard_size)


# --- targets ---------------------------------------------------------------------------
def _target_meta(config, parallel: TargetParallelConfig, dtype_name, source_dtypes) -> CheckpointMeta:
    return megatron_io.target_meta(CheckpointMeta, config, parallel, dtype_name, source_dtypes)


def _write_megatron(target: str, meta: CheckpointMeta, full, overwrite: bool, desc: str, beside: bool = False):
    megatron_io.write_megatron(target, meta, full, layout.shard, overwrite, desc, beside)


def _write_diffusers(ckpt: MegatronCheckpoint, cfg: MmToHfConfig, original):
    megatron_io.write_diffusers(ckpt, cfg, original, layout.stage_rules(ckpt.config),
                                lambda r, t: layout.unmerge(r, t, ckpt.config), DIFFUSERS_CLASS)
