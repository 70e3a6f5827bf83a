"""`mm-convert FluxConverter ...`: FLUX weights between diffusers / BFL files and Megatron shards.

Every path streams: a weight is read (lazily, from safetensors or a shard file), merged
and cut by the model's layout rules (`mm_grpo.families.flux.transformer.layout`), and its pieces are
written where the target files reserve them; no more than a few tensors are in memory.
Targets are built in a temporary folder next to the target and renamed at the end; hf_to_mm
into its own source folder (MindSpeed-MM's habit) adds the Megatron files beside the
diffusers ones the same way, the tracker file last.

The options are MindSpeed-MM's `ConvertConfig` ones (checkpoint/sora_model/convert_utils/
cfg.py) plus FLUX's own; what these verbs cannot do (LoRA paths, expert parallelism) is refused.
LoRA training checkpoints have verbs of their own: lora_mm_to_hf, merge_lora_to_base
(converters/flux_lora.py).
FluxConverter is a MindSpeed-MM `Converter` when MindSpeed-MM is importable
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

from converters import flux_lora
from converters.bfl import BflWeights, looks_like_bfl
from converters.diffusers_io import INDEX_FILE, write_diffusers_folder
from converters.mindspeed_mm import Converter
from converters.target_guard import prepare_target
from mm_grpo.checkpoint import CheckpointWriter, is_megatron_checkpoint
from mm_grpo.checkpoint.paths import RELEASE, TRACKER_FILE
from mm_grpo.families.flux.checkpoint import CheckpointMeta, MegatronCheckpoint
from mm_grpo.families.flux.transformer import layout
from mm_grpo.families.flux.transformer.config import PRESETS, FluxConfig
from mm_grpo.families.flux.transformer.hf_weights import check_hf_weights, open_diffusers_weights, transformer_dir
from mm_grpo.files.atomic import atomic_dir, atomic_entries
from mm_grpo.files.jsonfile import load_json
from mm_grpo.files.safetensors_weights import SafetensorsWeights

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_SHARD_SIZE = "10GB"  # diffusers' save_pretrained default
DtypeName = Optional[Literal["bf16", "fp16", "fp32"]]
PresetName = Optional[Literal[tuple(PRESETS)]]


@dataclasses.dataclass
class TargetParallelConfig:
    """Parallel layout of the Megatron checkpoint to write.

    Args:
        tp_size: Tensor-parallel size; must divide the number of attention heads (24 for FLUX.1).
        pp_layers: Blocks per pipeline stage over [all double blocks, then all single blocks]
            (FLUX.1: 19 + 38 = 57), e.g. [28,29]; must sum to the block count. A nested list
            [[..],[..]] gives virtual pipeline chunks, one inner list per chunk. Default: one stage.
        ep_size: Expert-parallel size, as in MindSpeed-MM's ParallelConfig; FLUX has no experts: 1 only.
    """

    tp_size: int = 1
    pp_layers: Optional[Union[List[int], List[List[int]]]] = None
    ep_size: int = 1


@dataclasses.dataclass
class HfToMmConfig:
    """Options of `hf_to_mm`.

    Args:
        source_path: A diffusers transformer folder (config.json + diffusion_pytorch_model*.safetensors,
            with or without an index; DanceGRPO's checkpoint-* folders are such), a whole FLUX
            pipeline folder (its transformer/ is used), or an original single-file checkpoint
            (flux1-dev.safetensors names, optionally under model.diffusion_model.).
        target_path: Megatron checkpoint folder to create (latest_checkpointed_iteration.txt,
            release/mp_rank_*/model_optim_rng.pt). The source folder itself is allowed: the Megatron
            files are added beside the diffusers ones (MindSpeed-MM's in-place conversion).
        target_parallel_config: Parallel layout of the output.
        hf_dir: diffusers transformer or pipeline folder whose config.json describes the model: needed
            for a single-file source unless --cfg.preset is given; overrides the source's config.json.
        preset: Built-in model config instead of a config.json: flux-dev, flux-schnell (tiny: tests).
        dtype: Cast the weights to bf16, fp16 or fp32; default: keep the source dtype.
        overwrite: Replace target_path if it already holds a Megatron checkpoint.
        lora_path: MindSpeed-MM's LoRA weights option; FluxConverter converts whole weights only: leave empty.
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
        source_path: Megatron checkpoint folder (from hf_to_mm, resplit or training, or saved by
            Megatron / MindSpeed-MM), or one iteration folder of it; any TP/PP.
        target_path: diffusers transformer folder to create (config.json, safetensors shards and
            their index) that FluxTransformer2DModel.from_pretrained loads; not the source.
        hf_dir: The original diffusers transformer (or pipeline) folder, as MindSpeed-MM's converters
            take it: its config.json is copied (checked against the weights) and its index's file
            split is kept; it also gives what a checkpoint without mm-grpo metadata cannot tell.
        iteration: Iteration to convert (its iter_XXXXXXX folder); default: the one
            latest_checkpointed_iteration.txt names.
        max_shard_size: Largest safetensors file, as diffusers' save_pretrained takes it (10GB, 500MB...);
            default 10GB, or hf_dir's file split.
        dtype: Cast the weights to bf16, fp16 or fp32; default: keep the source dtype.
        overwrite: Replace target_path if it already holds a diffusers folder.
        lora_path: MindSpeed-MM's LoRA weights option; FluxConverter converts whole weights only: leave empty.
        weights: Which weights of a training checkpoint to export: policy (the trained model) or ema
            (its exponential moving average, saved with --ema-decay: the weights the held-out evaluation scores).
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
        target_path: Megatron checkpoint folder to create with the new layout (model weights only,
            as `release`); not the source.
        target_parallel_config: Parallel layout of the output.
        hf_dir: diffusers transformer or pipeline folder whose config.json describes the model: gives
            what a checkpoint without mm-grpo metadata (saved by Megatron) cannot tell.
        iteration: Iteration to read; default: the one latest_checkpointed_iteration.txt names.
        dtype: Cast the weights to bf16, fp16 or fp32; default: keep the source dtype.
        overwrite: Replace target_path if it already holds a Megatron checkpoint.
        lora_path: MindSpeed-MM's LoRA weights option; FluxConverter converts whole weights only: leave empty.
    """

    source_path: str
    target_path: str
    target_parallel_config: TargetParallelConfig = dataclasses.field(default_factory=TargetParallelConfig)
    hf_dir: Optional[str] = None
    iteration: Optional[int] = None
    dtype: DtypeName = None
    overwrite: bool = False
    lora_path: str = ""


class FluxConverter(Converter):
    """FLUX.1 transformer weights: diffusers / original single-file <-> Megatron TP/PP shards."""

    def hf_to_mm(self, cfg: HfToMmConfig):
        """Convert diffusers or original (BFL) FLUX weights into the sharded Megatron layout."""
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
        with contextlib.closing(_open_checkpoint(cfg.source_path, cfg.iteration, cfg.hf_dir, cfg.weights)) as ckpt:
            if original:
                _check_same_architecture(ckpt, original.config, cfg.hf_dir)
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
        with contextlib.closing(_open_checkpoint(cfg.source_path, cfg.iteration, cfg.hf_dir)) as ckpt:
            dtypes = {ckpt.full_meta(r).dtype for r in layout.stage_rules(ckpt.config)}
            meta = _target_meta(ckpt.config, cfg.target_parallel_config, cfg.dtype, dtypes)
            _check_target(cfg.target_path, cfg.overwrite, is_megatron_checkpoint)

            def full(rule, read):
                return ckpt.full(rule) if read else ckpt.full_meta(rule)

            _write_megatron(cfg.target_path, meta, full, cfg.overwrite, "resplit")
        _report("resplit", cfg.target_path, start)

    def lora_mm_to_hf(self, cfg: flux_lora.LoraMmToHfConfig):
        """Write a LoRA training checkpoint's adapters as a diffusers FLUX LoRA (pytorch_lora_weights.safetensors)."""
        start = time.perf_counter(), time.process_time()
        flux_lora.lora_mm_to_hf(cfg)
        _report("lora_mm_to_hf", cfg.target_path, start)

    def merge_lora_to_base(self, cfg: flux_lora.MergeLoraToBaseConfig):
        """Merge a LoRA training checkpoint into its base weights, in the base's sharded layout."""
        start = time.perf_counter(), time.process_time()
        _refuse_in_place(cfg.source_path, cfg.target_path, "the merged weights would replace the base being read")
        flux_lora.merge_lora_to_base(cfg, _write_megatron, _open_checkpoint, _check_target)
        _report("merge_lora_to_base", cfg.target_path, start)


def _refuse_unsupported(cfg):
    """MindSpeed-MM's ConvertConfig options that mean nothing for FLUX, refused before any work."""
    if cfg.lora_path:
        raise ValueError(f"--cfg.lora_path {cfg.lora_path}: FluxConverter converts whole FLUX weights; "
                         "LoRA weights are not supported (LoRA checkpoints: lora_mm_to_hf, merge_lora_to_base)")
    parallel = getattr(cfg, "target_parallel_config", None)
    if parallel is not None and parallel.ep_size != 1:
        raise ValueError(f"--cfg.target_parallel_config.ep_size {parallel.ep_size}: FLUX has no experts "
                         "to split (only 1)")


# --- sources ---------------------------------------------------------------------------
def _config_from(hf_dir, preset) -> Optional[FluxConfig]:
    if hf_dir and preset:
        raise ValueError("give --cfg.hf_dir or --cfg.preset, not both")
    if hf_dir:
        return FluxConfig.from_diffusers_config(transformer_dir(hf_dir))
    return FluxConfig.preset(preset) if preset else None


def open_hf_source(path: str, hf_dir: Optional[str] = None, preset: Optional[str] = None):
    """(lazy diffusers-named weights, FluxConfig) of a diffusers folder, pipeline folder or single file."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such FLUX checkpoint: {path}")
    config = _config_from(hf_dir, preset)
    if os.path.isdir(path):
        weights = open_diffusers_weights(path, backend="pread")
        config = config or FluxConfig.from_diffusers_config(transformer_dir(path))
    else:
        weights = SafetensorsWeights([path], backend="pread")
        sibling = os.path.join(os.path.dirname(os.path.abspath(path)), "config.json")
        if config is None and not looks_like_bfl(weights) and os.path.isfile(sibling):
            config = FluxConfig.from_diffusers_config(sibling)
        if config is None:
            raise ValueError(f"{path} is a single file without a config: pass --cfg.hf_dir (a diffusers FLUX "
                             f"folder) or --cfg.preset ({', '.join(PRESETS)})")
        if looks_like_bfl(weights):
            weights = BflWeights(weights, config)
    check_hf_weights(weights, config)
    return weights, config


def _open_checkpoint(path: str, iteration, hf_dir: Optional[str] = None, weights: str = "policy") -> MegatronCheckpoint:
    """The checkpoint (its policy, or its EMA), checked; `hf_dir`'s config.json gives what one
    without mm-grpo's metadata cannot tell."""
    ckpt = MegatronCheckpoint(path, iteration, config=_config_from(hf_dir, None), weights=weights)
    try:
        flux_lora.refuse_adapter_checkpoint(ckpt)
        ckpt.check()
    except BaseException:
        ckpt.close()
        raise
    return ckpt


@dataclasses.dataclass
class OriginalFolder:
    """What mm_to_hf keeps of `--cfg.hf_dir` (MindSpeed-MM copies its config.json and index)."""
    config_json: dict
    config: FluxConfig
    weight_map: Optional[dict]  # tensor name -> file, from its index; None: no index


def _original_folder(hf_dir: str, max_shard_size: Optional[str]) -> OriginalFolder:
    folder = transformer_dir(hf_dir)
    config = FluxConfig.from_diffusers_config(folder)
    config_json = load_json(os.path.join(folder, "config.json"), "diffusers config.json")
    index = os.path.join(folder, INDEX_FILE)
    weight_map = load_json(index, "safetensors index").get("weight_map") if os.path.isfile(index) else None
    if weight_map is not None and max_shard_size:
        raise ValueError(f"--cfg.max_shard_size {max_shard_size} and --cfg.hf_dir {hf_dir}, whose index fixes the "
                         "file split: give one")
    return OriginalFolder(config_json, config, weight_map)


def _architecture(config: FluxConfig) -> dict:
    """The diffusers fields that shape the weights; out_channels None means in_channels."""
    return dict(config.to_diffusers_config(), out_channels=config.out_channels or config.in_channels)


def _check_same_architecture(ckpt: MegatronCheckpoint, config: FluxConfig, hf_dir: str):
    ours, theirs = _architecture(ckpt.config), _architecture(config)
    wrong = [f"{k} {ours[k]} (hf_dir: {theirs[k]})" for k in ours if ours[k] != theirs[k]]
    if wrong:
        raise ValueError(f"{ckpt.path} is another FLUX architecture than {hf_dir}'s config.json: {', '.join(wrong)}")


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
    if not os.path.isdir(folder):
        raise ValueError(f"target_path {folder} is the source file: give a folder to create")
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
    """Write every weight once. `full(rule, read)` gives a weight's whole Megatron tensor (a meta
    tensor when not `read`); it is cut into the TP shards of its stage and each piece goes into
    its shard file, all TP files of a pipeline stage being open together. `beside`: `target`
    is an existing folder that keeps its other files (the tracker file moves in last)."""
    config, tp_size = meta.config, meta.tp_size
    cast = _caster(getattr(torch, meta.dtype) if meta.dtype else None)
    stages = list(meta.stages())
    metas = {(key, r.megatron): cast(full(r, False)) for spec, key in stages for r in meta.rules(spec)}
    output = atomic_entries(target, overwrite, last=(TRACKER_FILE,)) if beside else atomic_dir(target, overwrite)
    with output as tmp, _progress(sum(m.nbytes for m in metas.values()), desc) as bar:
        writer = CheckpointWriter(tmp, meta)
        for pp in range(meta.pp_size):
            chunks = [(key, meta.rules(spec)) for spec, key in stages if spec.pp_rank == pp]
            shards = [writer.open_shard(tp, pp, {key: {r.megatron: layout.shard(r, metas[key, r.megatron], tp,
                                                                                   tp_size, config) for r in rules}
                                                  for key, rules in chunks})
                      for tp in range(tp_size)]
            for key, rules in chunks:
                for rule in rules:
                    whole = cast(full(rule, True))
                    for tp, shard in enumerate(shards):
                        shard.write((key, rule.megatron), layout.shard(rule, whole, tp, tp_size, config))
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
        hf_config = {"_class_name": "FluxTransformer2DModel", "_diffusers_version": diffusers.__version__,
                     **config.to_diffusers_config()}
        weight_map = None
    with atomic_dir(cfg.target_path, cfg.overwrite) as tmp:
        write_diffusers_folder(tmp, hf_config, metas, tensors(), cfg.max_shard_size or DEFAULT_SHARD_SIZE, weight_map)


def _report(what: str, target: str, start):
    wall, cpu = time.perf_counter() - start[0], time.process_time() - start[1]
    print(f"{what}: wrote {target} in {wall:.2f} s (CPU {cpu:.2f} s)")
