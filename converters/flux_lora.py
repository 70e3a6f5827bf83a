"""FluxConverter's LoRA verbs: a LoRA training checkpoint (adapters only) to a diffusers FLUX LoRA
file, and merged into its base weights (MindSpeed-MM's `merge_lora_to_base`).

    mm-convert FluxConverter lora_mm_to_hf --cfg.source_path SAVE_DIR --cfg.target_path DIR
    mm-convert FluxConverter merge_lora_to_base --cfg.source_path BASE --cfg.lora_path SAVE_DIR \\
        --cfg.target_path DIR
"""
import contextlib
import dataclasses
import os
from typing import Optional

from safetensors.torch import save_file

from mm_grpo.checkpoint.adapters import LORA_KEY, AdapterCheckpoint
from mm_grpo.checkpoint.paths import iteration_dir
from mm_grpo.files.atomic import atomic_dir
from mm_grpo.models.flux import lora as flux_lora
from mm_grpo.models.flux.lora_hf import LORA_FILE, to_diffusers


@dataclasses.dataclass
class LoraMmToHfConfig:
    """Options of `lora_mm_to_hf`.

    Args:
        source_path: A LoRA training checkpoint (--save of a run with --lora-target-modules), or one
            iteration folder of it; any TP/PP.
        target_path: Folder to create with pytorch_lora_weights.safetensors, which
            FluxPipeline.load_lora_weights(target_path) loads.
        iteration: Iteration to convert; default: the one latest_checkpointed_iteration.txt names.
        overwrite: Replace target_path if it exists.
    """

    source_path: str
    target_path: str
    iteration: Optional[int] = None
    overwrite: bool = False


@dataclasses.dataclass
class MergeLoraToBaseConfig:
    """Options of `merge_lora_to_base` (MindSpeed-MM's verb and option names).

    Args:
        source_path: The base weights as a Megatron checkpoint (hf_to_mm's output); any TP/PP.
        lora_path: A LoRA training checkpoint trained on that base, or one iteration folder of it.
        target_path: Megatron checkpoint folder to create: W + (alpha / r) B A for every adapted
            linear, in the base's layout (TP, PP stages) and dtype (computed in fp32).
        iteration: Iteration of lora_path; default: its latest.
        overwrite: Replace target_path if it already holds a Megatron checkpoint.
    """

    source_path: str
    lora_path: str
    target_path: str
    iteration: Optional[int] = None
    overwrite: bool = False


def refuse_adapter_checkpoint(ckpt):
    """A LoRA training checkpoint where whole weights are expected: one line naming the LoRA verbs."""
    if LORA_KEY in ckpt.shard(0, 0).tree:
        raise ValueError(f"{ckpt.path} is a LoRA training checkpoint (adapters only): convert it with lora_mm_to_hf, "
                         "or merge it into its base with merge_lora_to_base")


def whole_adapters(source: AdapterCheckpoint):
    """{base weight's first diffusers name: (A, B)} of every adapter, unsharded."""
    out = {}
    for base in flux_lora.base_rules(source.flux_config, source.config.targets):
        rule_a, rule_b = flux_lora.adapter_rules(base)
        out[base.hf[0]] = source.full(rule_a), source.full(rule_b)
    return out


def lora_mm_to_hf(cfg: LoraMmToHfConfig):
    with contextlib.closing(AdapterCheckpoint(iteration_dir(cfg.source_path, cfg.iteration))) as source:
        tensors = to_diffusers(whole_adapters(source), source.flux_config, source.config)
    with atomic_dir(cfg.target_path, cfg.overwrite) as tmp:
        save_file(tensors, os.path.join(tmp, LORA_FILE), metadata={"format": "pt"})


def merge_lora_to_base(cfg: MergeLoraToBaseConfig, write_megatron, open_checkpoint, check_target):
    """`write_megatron`, `open_checkpoint`, `check_target`: converters/flux.py's writers and checks."""
    from mm_grpo.checkpoint import is_megatron_checkpoint
    if not is_megatron_checkpoint(cfg.source_path):
        raise ValueError(f"--cfg.source_path {cfg.source_path} is not a Megatron checkpoint: convert the base with "
                         "hf_to_mm first")
    with contextlib.closing(AdapterCheckpoint(iteration_dir(cfg.lora_path, cfg.iteration))) as source, \
            contextlib.closing(open_checkpoint(cfg.source_path, None)) as base_ckpt:
        if base_ckpt.config.to_diffusers_config() != source.flux_config.to_diffusers_config():
            raise ValueError(f"{cfg.lora_path} adapts another FLUX architecture than {cfg.source_path}")
        check_target(cfg.target_path, cfg.overwrite, is_megatron_checkpoint)
        adapters = whole_adapters(source)
        by_weight = {base.hf: adapters[base.hf[0]]
                     for base in flux_lora.base_rules(source.flux_config, source.config.targets)}
        scaling = source.config.scaling

        def full(rule, read):
            if not read:
                return base_ckpt.full_meta(rule)
            weight = base_ckpt.full(rule)
            if rule.hf not in by_weight:
                return weight
            a, b = by_weight[rule.hf]
            return (weight.float() + scaling * (b.float() @ a.float())).to(weight.dtype)

        write_megatron(cfg.target_path, base_ckpt.meta, full, cfg.overwrite, "merge_lora_to_base")
