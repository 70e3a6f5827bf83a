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
from typing import Callable, List, Literal, Optional, Union

import diffusers
import torch
from tqdm import tqdm

from converters.diffusers_io import INDEX_FILE, write_diffusers_folder
from converters.mindspeed_mm import Converter
from converters.target_guard import prepare_target
from mm_grpo.checkpoint import CheckpointWriter, is_megatron_checkpoint
from mm_grpo.checkpoint.paths import RELEASE, TRACKER_FILE
from mm_grpo.families.qwen_image.checkpoint import CheckpointMeta, MegatronCheckpoint
from mm_grpo.families.qwen_image.checkpoint.metadata import check_same_architecture
from mm_grpo.families.qwen_image.transformer import layout
from mm_grpo.families.qwen_image.transformer.config import PRESETS, QwenImageConfig
from mm_grpo.families.qwen_image.transformer.hf_weights import check_hf_weights, open_diffusers_weights
from mm_grpo.files.atomic import atomic_dir, atomic_entries
from mm_grpo.files.jsonfile import load_json
from mm_grpo.files.safetensors_weights import transformer_dir

FAMILY = "Qwen-Image"
DIFFUSERS_CLASS = "QwenImageTransformer2DModel"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_SHARD_SIZE = "10GB"  # diffusers' save_pretrained default
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
        in_place = _same_path(cfg.source_path, cfg.target_path)
        if in_place:
            _check_in_place(cfg.target_path, cfg.overwrite)
        else:
            _check_target(cfg.target_path, cfg.overwrite, is_megatron_checkpoint)

        def full(rule, read):
            return layout.merge(rule, [weights[h] if read else weights.meta(h) for h in rule.hf], config)

        _write_megatron(cfg.target_path, meta, full, cfg.overwrite, "hf_to_mm", beside=in_place)
        _report("hf_to_mm", cfg.target_path, start)

    def mm_to_hf(self, cfg: MmToHfConfig):
        """Convert a Megatron checkpoint (any TP/PP) into a diffusers transformer folder."""
        start = time.perf_counter(), time.process_time()
        _refuse_unsupported(cfg)
        _refuse_in_place(cfg.source_path, cfg.target_path, "mm_to_hf writes a diffusers folder of its own, and "
                         "the folder it replaces holds the shards being read")
        prepare_target(cfg.source_path, cfg.target_path)
        original = _original_folder(cfg.hf_dir, cfg.max_shard_size) if cfg.hf_dir else None
        with contextlib.closing(_open_checkpoint(cfg.source_path, cfg.iteration, cfg.weights)) as ckpt:
            if original:
                check_same_architecture(ckpt.config, original.config, ckpt.path, f"{cfg.hf_dir}'s config.json")
            _check_target(cfg.target_path, cfg.overwrite, lambda p: os.path.isfile(os.path.join(p, "config.json")))
            _write_diffusers(ckpt, cfg, original)
        _report("mm_to_hf", cfg.target_path, start)

    def resplit(self, cfg: ResplitConfig):
        """Rewrite a Megatron checkpoint with another TP/PP layout, without going through diffusers files."""
        start = time.perf_counter(), time.process_time()
        _refuse_unsupported(cfg)
        _refuse_in_place(cfg.source_path, cfg.target_path, "the new layout would replace the folder holding the "
                         "shards being read (and any other iterations in it)")
        prepare_target(cfg.source_path, cfg.target_path)
        with contextlib.closing(_open_checkpoint(cfg.source_path, cfg.iteration)) as ckpt:
            dtypes = {ckpt.full_meta(r).dtype for r in layout.stage_rules(ckpt.config)}
            meta = _target_meta(ckpt.config, cfg.target_parallel_config, cfg.dtype, dtypes)
            _check_target(cfg.target_path, cfg.overwrite, is_megatron_checkpoint)

            def full(rule, read):
                return ckpt.full(rule) if read else ckpt.full_meta(rule)

            _write_megatron(cfg.target_path, meta, full, cfg.overwrite, "resplit")
        _report("resplit", cfg.target_path, start)


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


@dataclasses.dataclass
class OriginalFolder:
    """What mm_to_hf keeps of `--cfg.hf_dir` (MindSpeed-MM copies its config.json and index)."""
    config_json: dict
    config: QwenImageConfig
    weight_map: Optional[dict]  # tensor name -> file, from its index; None: no index


def _original_folder(hf_dir: str, max_shard_size: Optional[str]) -> OriginalFolder:
    folder = transformer_dir(hf_dir, FAMILY)
    config = QwenImageConfig.from_diffusers_config(folder)
    config_json = load_json(os.path.join(folder, "config.json"), "diffusers config.json")
    index = os.path.join(folder, INDEX_FILE)
    weight_map = load_json(index, "safetensors index").get("weight_map") if os.path.isfile(index) else None
    if weight_map is not None and max_shard_size:
        raise ValueError(f"--cfg.max_shard_size {max_shard_size} and --cfg.hf_dir {hf_dir}, whose index fixes the "
                         "file split: give one")
    return OriginalFolder(config_json, config, weight_map)


# --- targets ---------------------------------------------------------------------------
def _target_meta(config, parallel: TargetParallelConfig, dtype_name, source_dtypes) -> CheckpointMeta:
    """The output's metadata; its dtype is the requested one, else the source's if it has only one."""
    dtype = DTYPES[dtype_name] if dtype_name else (next(iter(source_dtypes)) if len(source_dtypes) == 1 else None)
    return CheckpointMeta(config, parallel.tp_size, parallel.pp_layers,
                          str(dtype).removeprefix("torch.") if dtype else None)


def _same_path(source: str, target: str) -> bool:
    return os.path.realpath(source) == os.path.realpath(target)


def _refuse_in_place(source: str, target: str, why: str):
    if _same_path(source, target):
        raise ValueError(f"target_path {target} is the source: {why}; write to another folder")


def _check_in_place(folder: str, overwrite: bool):
    """hf_to_mm into its own source: the Megatron files go beside the diffusers ones."""
    held = [n for n in (TRACKER_FILE, RELEASE) if os.path.lexists(os.path.join(folder, n))]
    if held and not overwrite:
        raise FileExistsError(f"target {folder} already holds {' and '.join(held)}: remove them or pass "
                              "--cfg.overwrite true")


def _check_target(target: str, overwrite: bool, replaceable: Callable[[str], bool]):
    if not os.path.lexists(target):
        return
    if not overwrite:
        raise FileExistsError(f"target {target} already exists: remove it or pass --cfg.overwrite true")
    if not (os.path.isdir(target) and (replaceable(target) or not os.listdir(target))):
        raise FileExistsError(f"refusing to overwrite {target}: it is not an empty folder or a checkpoint "
                              "of the kind being written")


def _progress(total_bytes: int, desc: str):
    return tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=None)


def _caster(dtype: Optional[torch.dtype]):
    return (lambda t: t.to(dtype)) if dtype else (lambda t: t)


def _write_megatron(target: str, meta: CheckpointMeta, full, overwrite: bool, desc: str, beside: bool = False):
    """Write every weight once. `full(rule, read)` gives a weight's whole Megatron tensor (a meta tensor
    when not `read`); it is cut into the TP shards of its stage and each piece goes into its shard file,
    all TP files of a pipeline stage being open together. `beside`: `target` is an existing folder that
    keeps its other files (the tracker file moves in last)."""
    tp_size = meta.tp_size
    cast = _caster(getattr(torch, meta.dtype) if meta.dtype else None)
    stages = list(meta.stages())
    metas = {(key, r.megatron): cast(full(r, False)) for spec, key in stages for r in meta.rules(spec)}
    output = atomic_entries(target, overwrite, last=(TRACKER_FILE,)) if beside else atomic_dir(target, overwrite)
    with output as tmp, _progress(sum(m.nbytes for m in metas.values()), desc) as bar:
        writer = CheckpointWriter(tmp, meta)
        for pp in range(meta.pp_size):
            chunks = [(key, meta.rules(spec)) for spec, key in stages if spec.pp_rank == pp]
            shards = [writer.open_shard(tp, pp, {key: {r.megatron: layout.shard(r, metas[key, r.megatron], tp, tp_size)
                                                       for r in rules} for key, rules in chunks})
                      for tp in range(tp_size)]
            for key, rules in chunks:
                for rule in rules:
                    whole = cast(full(rule, True))
                    for tp, shard in enumerate(shards):
                        shard.write((key, rule.megatron), layout.shard(rule, whole, tp, tp_size))
                    bar.update(whole.nbytes)
            for shard in shards:
                shard.close()
        writer.commit()


def _write_diffusers(ckpt: MegatronCheckpoint, cfg: MmToHfConfig, original: Optional[OriginalFolder]):
    config, cast = ckpt.config, _caster(DTYPES[cfg.dtype] if cfg.dtype else None)
    rules = list(layout.stage_rules(config))
    metas = {h: cast(t) for r in rules for h, t in zip(r.hf, layout.unmerge(r, ckpt.full_meta(r), config))}

    def tensors():
        with _progress(sum(m.nbytes for m in metas.values()), "mm_to_hf") as bar:
            for rule in rules:
                for name, tensor in zip(rule.hf, layout.unmerge(rule, ckpt.full(rule), config)):
                    yield name, cast(tensor)
                    bar.update(metas[name].nbytes)

    if original:
        hf_config, weight_map = original.config_json, original.weight_map
    else:
        hf_config = {"_class_name": DIFFUSERS_CLASS, "_diffusers_version": diffusers.__version__,
                     **config.to_diffusers_config()}
        weight_map = None
    with atomic_dir(cfg.target_path, cfg.overwrite) as tmp:
        write_diffusers_folder(tmp, hf_config, metas, tensors(), cfg.max_shard_size or DEFAULT_SHARD_SIZE, weight_map)


def _report(what: str, target: str, start):
    wall, cpu = time.perf_counter() - start[0], time.process_time() - start[1]
    print(f"{what}: wrote {target} in {wall:.2f} s (CPU {cpu:.2f} s)")
