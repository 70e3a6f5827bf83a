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
from typing import List, Literal, Optional, Union


from converters import flux_lora, megatron_io
from converters.bfl import BflWeights, looks_like_bfl
from converters.mindspeed_mm import Converter
from converters.target_guard import prepare_target
from mm_grpo.checkpoint import is_megatron_checkpoint
from mm_grpo.families.flux.checkpoint import CheckpointMeta, MegatronCheckpoint
from mm_grpo.families.flux.transformer import layout
from mm_grpo.families.flux.transformer.config import PRESETS, FluxConfig
from mm_grpo.families.flux.transformer.hf_weights import check_hf_weights, open_diffusers_weights, transformer_dir
from mm_grpo.files.safetensors_weights import SafetensorsWeights

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
        with contextlib.closing(_open_checkpoint(cfg.source_path, cfg.iteration, cfg.hf_dir, cfg.weights)) as ckpt:
            if original:
                _check_same_architecture(ckpt, original.config, cfg.hf_dir)
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
        with contextlib.closing(_open_checkpoint(cfg.source_path, cfg.iteration, cfg.hf_dir)) as ckpt:
            dtypes = {ckpt.full_meta(r).dtype for r in layout.stage_rules(ckpt.config)}
            meta = _target_meta(ckpt.config, cfg.target_parallel_config, cfg.dtype, dtypes)
            megatron_io.check_target(cfg.target_path, cfg.overwrite, is_megatron_checkpoint)

            def full(rule, read):
                return ckpt.full(rule) if read else ckpt.full_meta(rule)

            _write_megatron(cfg.target_path, meta, full, cfg.overwrite, "resplit")
        megatron_io.report("resplit", cfg.target_path, start)

    def lora_mm_to_hf(self, cfg: flux_lora.LoraMmToHfConfig):
        """Write a LoRA training checkpoint's adapters as a diffusers FLUX LoRA (pytorch_lora_weights.safetensors)."""
        start = time.perf_counter(), time.process_time()
        flux_lora.lora_mm_to_hf(cfg)
        megatron_io.report("lora_mm_to_hf", cfg.target_path, start)

    def merge_lora_to_base(self, cfg: flux_lora.MergeLoraToBaseConfig):
        """Merge a LoRA training checkpoint into its base weights, in the base's sharded layout."""
        start = time.perf_counter(), time.process_time()
        megatron_io.refuse_in_place(cfg.source_path, cfg.target_path,
                                    "the merged weights would replace the base being read")
        flux_lora.merge_lora_to_base(cfg, _write_megatron, _open_checkpoint, megatron_io.check_target)
        megatron_io.report("merge_lora_to_base", cfg.target_path, start)


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


def _original_folder(hf_dir: str, max_shard_size: Optional[str]) -> megatron_io.OriginalFolder:
    folder = transformer_dir(hf_dir)
    return megatron_io.original_folder(folder, hf_dir, FluxConfig.from_diffusers_config(folder), max_shard_size)


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
    return megatron_io.target_meta(CheckpointMeta, config, parallel, dtype_name, source_dtypes)


def _write_megatron(target: str, meta: CheckpointMeta, full, overwrite: bool, desc: str, beside: bool = False):
    """megatron_io.write_megatron with FLUX's cut (its packed single-block linears need the config)."""
    megatron_io.write_megatron(target, meta, full, lambda r, t, tp, size: layout.shard(r, t, tp, size, meta.config),
                               overwrite, desc, beside)


def _write_diffusers(ckpt: MegatronCheckpoint, cfg: MmToHfConfig, original):
    megatron_io.write_diffusers(ckpt, cfg, original, layout.stage_rules(ckpt.config),
                                lambda r, t: layout.unmerge(r, t, ckpt.config), "FluxTransformer2DModel")
