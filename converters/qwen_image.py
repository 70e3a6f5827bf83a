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
same semantics; what these verbs cannot do (MindSpeed-MM's --cfg.lora_path, expert parallelism) is refused.
LoRA training checkpoints of mm-grpo's trainer (--lora-target-modules; adapters only, any TP/PP:
mm_grpo/families/qwen_image/checkpoint/adapters.py) have verbs of their own, FluxConverter's, on the shared
converters/lora_io.py:

    mm-convert QwenImageConverter lora_mm_to_hf --cfg.source_path SAVE_DIR --cfg.target_path DIR
    mm-convert QwenImageConverter merge_lora_to_base --cfg.lora_path SAVE_DIR --cfg.target_path DIR \\
        [--cfg.source_path BASE] [--cfg.target_parallel_config.tp_size 2 ...]

lora_mm_to_hf writes the adapters as the diffusers LoRA file QwenImagePipeline.load_lora_weights reads
(`mm_grpo.families.qwen_image.transformer.lora_hf`); merge_lora_to_base adds them to the base weights (a
Megatron checkpoint, or a diffusers folder; by default the base the run recorded) and writes a whole
Megatron checkpoint, hf_to_mm's layout, at the target TP/PP. MindSpeed-MM's own LoRA checkpoints (peft
adapters) are refused. QwenImageConverter is a MindSpeed-MM `Converter` when MindSpeed-MM is importable
(converters/mindspeed_mm.py).
"""
import contextlib
import dataclasses
import os
import time
from typing import List, Literal, Optional, Union

from converters import lora_io, megatron_io
from converters.mindspeed_mm import Converter
from converters.target_guard import prepare_target
from mm_grpo.checkpoint import is_megatron_checkpoint
from mm_grpo.checkpoint.paths import iteration_dir
from mm_grpo.families.qwen_image.checkpoint import CheckpointMeta, MegatronCheckpoint, adapters
from mm_grpo.families.qwen_image.checkpoint.metadata import check_same_architecture
from mm_grpo.families.qwen_image.transformer import layout, lora, lora_hf
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
        lora_path: MindSpeed-MM's LoRA weights option; these verbs convert whole weights only: leave empty
            (LoRA training checkpoints: lora_mm_to_hf, merge_lora_to_base).
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
        lora_path: MindSpeed-MM's LoRA weights option; these verbs convert whole weights only: leave empty
            (LoRA training checkpoints: lora_mm_to_hf, merge_lora_to_base).
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
        lora_path: MindSpeed-MM's LoRA weights option; these verbs convert whole weights only: leave empty
            (LoRA training checkpoints: lora_mm_to_hf, merge_lora_to_base).
    """

    source_path: str
    target_path: str
    target_parallel_config: TargetParallelConfig = dataclasses.field(default_factory=TargetParallelConfig)
    iteration: Optional[int] = None
    dtype: DtypeName = None
    overwrite: bool = False
    lora_path: str = ""


@dataclasses.dataclass
class LoraMmToHfConfig(lora_io.LoraMmToHfConfig):
    """Options of `lora_mm_to_hf`.

    Args:
        source_path: A LoRA training checkpoint of mm-grpo's trainer (--save of a run with
            --lora-target-modules; any TP/PP), or one iteration folder of it.
        target_path: Folder to create with pytorch_lora_weights.safetensors, which
            QwenImagePipeline.load_lora_weights(target_path) loads.
        iteration: Iteration to convert; default: the one latest_checkpointed_iteration.txt names.
        overwrite: Replace target_path if it holds a diffusers LoRA file (or is empty).
    """


@dataclasses.dataclass
class MergeLoraToBaseConfig:
    """Options of `merge_lora_to_base` (MindSpeed-MM's verb and option names).

    Args:
        lora_path: A LoRA training checkpoint of mm-grpo's trainer (as for lora_mm_to_hf) trained on
            the base, or one iteration folder of it.
        target_path: Megatron checkpoint folder to create (hf_to_mm's layout): W + (alpha / r) B A for
            every adapted linear, in the base's dtype (computed in fp32).
        source_path: The base weights: a Megatron checkpoint (hf_to_mm's output; any TP/PP) or a diffusers
            Qwen-Image transformer or pipeline folder. Default: the base the LoRA run recorded (its
            predictor.from_pretrained or --load), if it is still there.
        target_parallel_config: Parallel layout of the output; default: a Megatron base's own layout,
            one stage at TP 1 for a diffusers base.
        iteration: Iteration of lora_path; default: its latest.
        overwrite: Replace target_path if it already holds a Megatron checkpoint.
    """

    lora_path: str
    target_path: str
    source_path: Optional[str] = None
    target_parallel_config: Optional[TargetParallelConfig] = None
    iteration: Optional[int] = None
    overwrite: bool = False


class QwenImageConverter(Converter):
    """Qwen-Image transformer weights: diffusers <-> Megatron TP/PP shards."""

    def hf_to_mm(self, cfg: HfToMmConfig):
        """Convert a diffusers Qwen-Image transformer (or pipeline) folder into the sharded Megatron layout."""
        start = time.perf_counter(), time.process_time()
        _refuse_unsupported(cfg)
        weights, config = open_hf_source(cfg.source_path, cfg.hf_dir, cfg.preset)
        meta = _target_meta(config, cfg.target_parallel_config, cfg.dtype, _hf_dtypes(weights))
        prepare_target(cfg.source_path, cfg.target_path, in_place_ok=True)
        in_place = megatron_io.same_path(cfg.source_path, cfg.target_path)
        if in_place:
            megatron_io.check_in_place(cfg.target_path, cfg.overwrite)
        else:
            megatron_io.check_target(cfg.target_path, cfg.overwrite, is_megatron_checkpoint)

        _write_megatron(cfg.target_path, meta, _hf_full(weights, config), cfg.overwrite, "hf_to_mm", beside=in_place)
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
            meta = _target_meta(ckpt.config, cfg.target_parallel_config, cfg.dtype, _dtypes(ckpt))
            megatron_io.check_target(cfg.target_path, cfg.overwrite, is_megatron_checkpoint)
            _write_megatron(cfg.target_path, meta, lora_io.checkpoint_full(ckpt), cfg.overwrite, "resplit")
        megatron_io.report("resplit", cfg.target_path, start)

    def lora_mm_to_hf(self, cfg: LoraMmToHfConfig):
        """Write a LoRA training checkpoint's adapters as a diffusers Qwen-Image LoRA file
        (pytorch_lora_weights.safetensors)."""
        start = time.perf_counter(), time.process_time()
        prepare_target(cfg.source_path, cfg.target_path)
        megatron_io.check_target(cfg.target_path, cfg.overwrite, lora_io.is_lora_folder)
        lora_io.lora_mm_to_hf(LORA, cfg)
        megatron_io.report("lora_mm_to_hf", cfg.target_path, start)

    def merge_lora_to_base(self, cfg: MergeLoraToBaseConfig):
        """Merge a LoRA training checkpoint into its base weights: a whole Megatron checkpoint at the target layout."""
        start = time.perf_counter(), time.process_time()
        if cfg.target_parallel_config is not None:
            _refuse_experts(cfg.target_parallel_config)
        source = _lora_base(cfg)
        megatron_io.refuse_in_place(source, cfg.target_path, "the merged weights would replace the base being read")
        prepare_target(source, cfg.target_path)
        prepare_target(cfg.lora_path, cfg.target_path)
        lora_io.merge_lora_to_base(LORA, cfg, source, lambda: _open_base(source, cfg.target_parallel_config),
                                   _write_megatron, megatron_io.check_target)
        megatron_io.report("merge_lora_to_base", cfg.target_path, start)


def _refuse_unsupported(cfg):
    """MindSpeed-MM's ConvertConfig options that mean nothing for Qwen-Image, refused before any work."""
    if cfg.lora_path:
        raise ValueError(f"--cfg.lora_path {cfg.lora_path}: QwenImageConverter converts whole Qwen-Image weights; "
                         "LoRA weights are not supported (LoRA checkpoints: lora_mm_to_hf, merge_lora_to_base)")
    parallel = getattr(cfg, "target_parallel_config", None)
    if parallel is not None:
        _refuse_experts(parallel)


def _refuse_experts(parallel: TargetParallelConfig):
    if parallel.ep_size != 1:
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
        lora_io.refuse_adapter_checkpoint(ckpt, adapters.LORA_KEY)
        ckpt.check()
    except BaseException:
        ckpt.close()
        raise
    return ckpt


def _hf_full(weights, config: QwenImageConfig):
    """Lazy diffusers weights as the writers take them: full(rule, read), merged into Megatron tensors."""
    return lambda rule, read: layout.merge(rule, [weights[h] if read else weights.meta(h) for h in rule.hf], config)


def _hf_dtypes(weights) -> set:
    return {weights.meta(h).dtype for h in weights}


def _dtypes(ckpt: MegatronCheckpoint) -> set:
    return {ckpt.full_meta(r).dtype for r in layout.stage_rules(ckpt.config)}


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


# --- LoRA checkpoints --------------------------------------------------------------------------
def _refuse_mindspeed_mm_lora(folder: str, found: dict, first) -> None:
    """MindSpeed-MM's own LoRA on Qwen-Image (peft adapters): its adapters' layout is not verified."""
    if lora_io.is_mindspeed_mm_lora(first.tree, adapters.LORA_KEY):
        raise ValueError(f"{folder} is a checkpoint of MindSpeed-MM's own LoRA (peft adapters): QwenImageConverter "
                         "converts the LoRA checkpoints of mm-grpo's trainer only")


LORA = lora_io.LoraFamily(name=FAMILY, lora=lora, adapter_checkpoint=adapters.AdapterCheckpoint,
                          lora_key=adapters.LORA_KEY, to_diffusers=lora_hf.to_diffusers,
                          other_format=_refuse_mindspeed_mm_lora)


def _lora_base(cfg: MergeLoraToBaseConfig) -> str:
    """--cfg.source_path, else the base weights the LoRA run recorded."""
    if cfg.source_path:
        return cfg.source_path
    folder = iteration_dir(cfg.lora_path, cfg.iteration)
    entry = adapters.lora_entry(folder)
    if entry is None:
        raise ValueError(f"{folder} is not a LoRA checkpoint (no '{adapters.LORA_KEY}' entry): its base weights "
                         "are not recorded")
    base = adapters.checkpoint_base(folder)
    if base is None:
        raise ValueError(f"{folder} records no base weights that still exist (recorded: {entry.get('base')}): "
                         "give --cfg.source_path")
    return base


@contextlib.contextmanager
def _open_base(path: str, parallel: Optional[TargetParallelConfig]):
    """merge_lora_to_base's base as (config, the target's CheckpointMeta, full(rule, read)): a Megatron
    checkpoint (written at its own layout unless `parallel`) or a diffusers folder (one stage, TP 1 unless
    `parallel`); the dtype is the base's."""
    if is_megatron_checkpoint(path):
        with contextlib.closing(_open_checkpoint(path, None)) as ckpt:
            meta = ckpt.meta if parallel is None else _target_meta(ckpt.config, parallel, None, _dtypes(ckpt))
            yield ckpt.config, meta, lora_io.checkpoint_full(ckpt)
    else:
        weights, config = open_hf_source(path)
        meta = _target_meta(config, parallel or TargetParallelConfig(), None, _hf_dtypes(weights))
        yield config, meta, _hf_full(weights, config)
