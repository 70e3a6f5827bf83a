"""What the LoRA verbs of every family's converter (converters/flux_lora.py, converters/qwen_image.py) do
alike, knowing no family: read a LoRA training checkpoint's adapters whole (mm-grpo's adapter-only shards:
mm_grpo/families/<family>/checkpoint/adapters.py), write them as a diffusers LoRA file (`lora_mm_to_hf`),
and add them to base weights, W + (alpha / r) B A computed in fp32 (`merge_lora_to_base`), streamed through
the family's Megatron writer. A family hands in its pieces as a `LoraFamily`.

    mm-convert <Converter> lora_mm_to_hf --cfg.source_path SAVE_DIR --cfg.target_path DIR
    mm-convert <Converter> merge_lora_to_base --cfg.source_path BASE --cfg.lora_path SAVE_DIR \\
        --cfg.target_path DIR
"""
import contextlib
import dataclasses
import os
from types import ModuleType
from typing import Any, Callable, Optional

from safetensors.torch import save_file

from mm_grpo.checkpoint import is_megatron_checkpoint
from mm_grpo.checkpoint.paths import SHARD_FILE, iteration_dir, shard_folders
from mm_grpo.checkpoint.shard_io import ShardReader
from mm_grpo.files.atomic import atomic_dir
from mm_grpo.lora import LORA_FILE

PEFT_ADAPTER_SUFFIX = ".default.weight"  # peft's name of an adapter's weight (its default adapter)


@dataclasses.dataclass
class LoraMmToHfConfig:
    """Options of `lora_mm_to_hf`.

    Args:
        source_path: A LoRA training checkpoint (--save of a run with --lora-target-modules), or one
            iteration folder of it; any TP/PP.
        target_path: Folder to create with pytorch_lora_weights.safetensors, which the family's diffusers
            pipeline loads with load_lora_weights(target_path).
        iteration: Iteration to convert; default: the one latest_checkpointed_iteration.txt names.
        overwrite: Replace target_path if it exists.
    """

    source_path: str
    target_path: str
    iteration: Optional[int] = None
    overwrite: bool = False


@dataclasses.dataclass(frozen=True)
class LoraFamily:
    """What the LoRA verbs read of a family."""
    name: str  # the model's name in messages
    lora: ModuleType  # its transformer's lora.py: base_rules(config, targets), adapter_rules(base rule)
    adapter_checkpoint: Callable  # (iteration folder) -> its AdapterCheckpoint (`.meta`, `.config`, `.full(rule)`)
    lora_key: str  # the `lora` entry of its LoRA checkpoints' shards
    to_diffusers: Callable  # (whole adapters, model config, LoRAConfig) -> the tensors of a diffusers LoRA file
    # (iteration folder, its shard folders, the first shard) -> the Adapters of a LoRA checkpoint another trainer
    # wrote (FLUX: MindSpeed-MM's), or None: mm-grpo's own; it may refuse the checkpoint in one line
    other_format: Optional[Callable] = None


@dataclasses.dataclass
class Adapters:
    """A LoRA checkpoint's adapters, whole: {base weight's first diffusers name: (A, B)}."""
    model_config: Any  # the family's model config
    config: Any  # the family's LoRAConfig
    whole: dict


def refuse_adapter_checkpoint(ckpt, lora_key: str):
    """A LoRA training checkpoint where whole weights are expected: one line naming the LoRA verbs."""
    if lora_key in ckpt.shard(0, 0).tree:
        raise ValueError(f"{ckpt.path} is a LoRA training checkpoint (adapters only): convert it with lora_mm_to_hf, "
                         "or merge it into its base with merge_lora_to_base")


def is_mindspeed_mm_lora(tree, lora_key: str) -> bool:
    """A shard of MindSpeed-MM's LoRA: no mm-grpo `lora` entry, peft-named adapters."""
    model = tree.get("model")
    return (lora_key not in tree and isinstance(model, dict)
            and any(k.endswith(PEFT_ADAPTER_SUFFIX) for k in model))


def is_lora_folder(path: str) -> bool:
    """lora_mm_to_hf's kind of target: a folder with a diffusers LoRA file."""
    return os.path.isfile(os.path.join(path, LORA_FILE))


def read_adapters(family: LoraFamily, path: str, iteration: Optional[int]) -> Adapters:
    """The adapters of a LoRA checkpoint of `family` (mm-grpo's, or what `family.other_format` reads)."""
    folder = iteration_dir(path, iteration)
    found = shard_folders(folder)
    if family.other_format is not None and (0, 0) in found:
        first = ShardReader(os.path.join(folder, found[(0, 0)], SHARD_FILE))
        try:
            other = family.other_format(folder, found, first)
            if other is not None:
                return other
        finally:
            first.close()
    with contextlib.closing(family.adapter_checkpoint(folder)) as source:
        model_config, whole = source.meta.config, {}
        for base in family.lora.base_rules(model_config, source.config.targets):
            rule_a, rule_b = family.lora.adapter_rules(base)
            whole[base.hf[0]] = source.full(rule_a), source.full(rule_b)
        return Adapters(model_config, source.config, whole)


def lora_mm_to_hf(family: LoraFamily, cfg: LoraMmToHfConfig):
    adapters = read_adapters(family, cfg.source_path, cfg.iteration)
    tensors = family.to_diffusers(adapters.whole, adapters.model_config, adapters.config)
    with atomic_dir(cfg.target_path, cfg.overwrite) as tmp:
        save_file(tensors, os.path.join(tmp, LORA_FILE), metadata={"format": "pt"})


def checkpoint_full(ckpt) -> Callable:
    """A Megatron checkpoint's weights as the writers take them: full(rule, read), a meta tensor unless `read`."""
    return lambda rule, read: ckpt.full(rule) if read else ckpt.full_meta(rule)


def merged(family: LoraFamily, adapters: Adapters, base_full: Callable) -> Callable:
    """`base_full(rule, read)` (whole Megatron tensors) with the adapters added to the adapted linears, in fp32,
    cast back to the base's dtype."""
    by_weight = {base.hf: adapters.whole[base.hf[0]]
                 for base in family.lora.base_rules(adapters.model_config, adapters.config.targets)}
    scaling = adapters.config.scaling

    def full(rule, read):
        weight = base_full(rule, read)
        if not read or rule.hf not in by_weight:
            return weight
        a, b = by_weight[rule.hf]
        return (weight.float() + scaling * (b.float() @ a.float())).to(weight.dtype)

    return full


def merge_lora_to_base(family: LoraFamily, cfg, source: str, open_base: Callable, write_megatron: Callable,
                       check_target: Callable):
    """`cfg.lora_path`'s adapters merged into the base weights at `source` and written as a Megatron
    checkpoint. `open_base()`: a context manager giving the base as (model config, the target's
    CheckpointMeta, full(rule, read)); `write_megatron`, `check_target`: the family converter's."""
    adapters = read_adapters(family, cfg.lora_path, cfg.iteration)
    with open_base() as (model_config, meta, base_full):
        if model_config.to_diffusers_config() != adapters.model_config.to_diffusers_config():
            raise ValueError(f"{cfg.lora_path} adapts another {family.name} architecture than {source}")
        check_target(cfg.target_path, cfg.overwrite, is_megatron_checkpoint)
        write_megatron(cfg.target_path, meta, merged(family, adapters, base_full), cfg.overwrite,
                       "merge_lora_to_base")
