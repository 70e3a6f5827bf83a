"""What every family's converter (converters/flux.py, converters/qwen_image.py) does alike, knowing no
family: the dtypes it writes, the checks of a target before any work (in place, replaceable), its progress
bar and report, the metadata of a target layout, and the streamed writers of Megatron shards and of a
diffusers folder, each given the family's layout functions."""
import dataclasses
import os
import time
from typing import Any, Callable, Iterable, Optional

import diffusers
import torch
from tqdm import tqdm

from converters.diffusers_io import INDEX_FILE, write_diffusers_folder
from mm_grpo.checkpoint import CheckpointWriter
from mm_grpo.checkpoint.paths import RELEASE, TRACKER_FILE
from mm_grpo.files.atomic import atomic_dir, atomic_entries
from mm_grpo.files.jsonfile import load_json

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_SHARD_SIZE = "10GB"  # diffusers' save_pretrained default


@dataclasses.dataclass
class OriginalFolder:
    """What mm_to_hf keeps of `--cfg.hf_dir` (MindSpeed-MM copies its config.json and index)."""
    config_json: dict
    config: Any  # the family's config of that folder
    weight_map: Optional[dict]  # tensor name -> file, from its index; None: no index


def original_folder(folder: str, hf_dir: str, config: Any, max_shard_size: Optional[str]) -> OriginalFolder:
    """`folder`: the transformer folder of `--cfg.hf_dir`, whose architecture is `config`."""
    config_json = load_json(os.path.join(folder, "config.json"), "diffusers config.json")
    index = os.path.join(folder, INDEX_FILE)
    weight_map = load_json(index, "safetensors index").get("weight_map") if os.path.isfile(index) else None
    if weight_map is not None and max_shard_size:
        raise ValueError(f"--cfg.max_shard_size {max_shard_size} and --cfg.hf_dir {hf_dir}, whose index fixes the "
                         "file split: give one")
    return OriginalFolder(config_json, config, weight_map)


# --- targets ---------------------------------------------------------------------------
def target_meta(meta_cls, config, parallel, dtype_name, source_dtypes):
    """The output's metadata (the family's `meta_cls`); its dtype is the requested one, else the
    source's if it has only one."""
    dtype = DTYPES[dtype_name] if dtype_name else (next(iter(source_dtypes)) if len(source_dtypes) == 1 else None)
    return meta_cls(config, parallel.tp_size, parallel.pp_layers, str(dtype).removeprefix("torch.") if dtype else None)


def same_path(source: str, target: str) -> bool:
    return os.path.realpath(source) == os.path.realpath(target)


def refuse_in_place(source: str, target: str, why: str):
    if same_path(source, target):
        raise ValueError(f"target_path {target} is the source: {why}; write to another folder")


def check_in_place(folder: str, overwrite: bool):
    """hf_to_mm into its own source: the Megatron files go beside the diffusers ones."""
    if not os.path.isdir(folder):
        raise ValueError(f"target_path {folder} is the source file: give a folder to create")
    held = [n for n in (TRACKER_FILE, RELEASE) if os.path.lexists(os.path.join(folder, n))]
    if held and not overwrite:
        raise FileExistsError(f"target {folder} already holds {' and '.join(held)}: remove them or pass "
                              "--cfg.overwrite true")


def check_target(target: str, overwrite: bool, replaceable: Callable[[str], bool]):
    if not os.path.lexists(target):
        return
    if not overwrite:
        raise FileExistsError(f"target {target} already exists: remove it or pass --cfg.overwrite true")
    if not (os.path.isdir(target) and (replaceable(target) or not os.listdir(target))):
        raise FileExistsError(f"refusing to overwrite {target}: it is not an empty folder or a checkpoint "
                              "of the kind being written")


def is_diffusers_folder(path: str) -> bool:
    """mm_to_hf's kind of target: a folder with a config.json."""
    return os.path.isfile(os.path.join(path, "config.json"))


def progress(total_bytes: int, desc: str):
    return tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=None)


def caster(dtype: Optional[torch.dtype]):
    return (lambda t: t.to(dtype)) if dtype else (lambda t: t)


def report(what: str, target: str, start):
    wall, cpu = time.perf_counter() - start[0], time.process_time() - start[1]
    print(f"{what}: wrote {target} in {wall:.2f} s (CPU {cpu:.2f} s)")


# --- writers ---------------------------------------------------------------------------
def write_megatron(target: str, meta, full, shard: Callable, overwrite: bool, desc: str, beside: bool = False):
    """Write every weight once. `full(rule, read)` gives a weight's whole Megatron tensor (a meta
    tensor when not `read`); `shard(rule, tensor, tp_rank, tp_size)` (the family's layout) cuts it into
    the TP shards of its stage and each piece goes into its shard file, all TP files of a pipeline stage
    being open together. `beside`: `target` is an existing folder that keeps its other files (the tracker
    file moves in last)."""
    tp_size = meta.tp_size
    cast = caster(getattr(torch, meta.dtype) if meta.dtype else None)
    stages = list(meta.stages())
    metas = {(key, r.megatron): cast(full(r, False)) for spec, key in stages for r in meta.rules(spec)}
    output = atomic_entries(target, overwrite, last=(TRACKER_FILE,)) if beside else atomic_dir(target, overwrite)
    with output as tmp, progress(sum(m.nbytes for m in metas.values()), desc) as bar:
        writer = CheckpointWriter(tmp, meta)
        for pp in range(meta.pp_size):
            chunks = [(key, meta.rules(spec)) for spec, key in stages if spec.pp_rank == pp]
            shards = [writer.open_shard(tp, pp, {key: {r.megatron: shard(r, metas[key, r.megatron], tp, tp_size)
                                                       for r in rules} for key, rules in chunks})
                      for tp in range(tp_size)]
            for key, rules in chunks:
                for rule in rules:
                    whole = cast(full(rule, True))
                    for tp, out in enumerate(shards):
                        out.write((key, rule.megatron), shard(rule, whole, tp, tp_size))
                    bar.update(whole.nbytes)
            for out in shards:
                out.close()
        writer.commit()


def write_diffusers(ckpt, cfg, original: Optional[OriginalFolder], rules: Iterable, unmerge: Callable,
                    class_name: str):
    """The checkpoint `ckpt` as a diffusers transformer folder (`class_name`'s config.json, or
    `original`'s config and file split), every weight unmerged by the family's `unmerge(rule, tensor)`."""
    cast = caster(DTYPES[cfg.dtype] if cfg.dtype else None)
    rules = list(rules)
    metas = {h: cast(t) for r in rules for h, t in zip(r.hf, unmerge(r, ckpt.full_meta(r)))}

    def tensors():
        with progress(sum(m.nbytes for m in metas.values()), "mm_to_hf") as bar:
            for rule in rules:
                for name, tensor in zip(rule.hf, unmerge(rule, ckpt.full(rule))):
                    yield name, cast(tensor)
                    bar.update(metas[name].nbytes)

    if original:
        hf_config, weight_map = original.config_json, original.weight_map
    else:
        hf_config = {"_class_name": class_name, "_diffusers_version": diffusers.__version__,
                     **ckpt.config.to_diffusers_config()}
        weight_map = None
    with atomic_dir(cfg.target_path, cfg.overwrite) as tmp:
        write_diffusers_folder(tmp, hf_config, metas, tensors(), cfg.max_shard_size or DEFAULT_SHARD_SIZE, weight_map)
