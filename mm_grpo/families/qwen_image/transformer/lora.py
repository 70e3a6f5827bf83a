"""LoRA on the Qwen-Image transformer's parallel linears: its target modules and its layout, on the
shared mechanism (mm_grpo/lora.py: adapters sharded like the linear they adapt, seeded A, zero B).

The targets are the Megatron linears of a DualStreamBlock (each stream's own), named as FLUX's are:
one adapter on a linear that fuses q / k / v per head (`layout.py`) stands for diffusers' three
modules, sharing one A. `TARGETS` maps the --lora-target-modules names to the diffusers modules.
The model's last block has a text stream's projection and MLP that feed nothing (`blocks.py`):
their adapters exist, as in diffusers, and get no gradient.
"""
import dataclasses
from typing import ClassVar, Dict, Iterator, List, Optional, Tuple

import torch

from mm_grpo import lora
from mm_grpo.families.qwen_image.transformer import layout
from mm_grpo.families.qwen_image.transformer.config import QwenImageConfig
from mm_grpo.lora import (  # noqa: F401  (the family's lora module is where callers find them)
    ADAPTER_KEYS, Adapter, AdaptersOff, adapter_rules, adapter_state_dict, adapters, adapters_disabled,
    freeze_base_in_bf16, has_adapters, mirror_adapters, reference_policy, switched)

# --lora-target-modules name -> the diffusers modules it adapts (image / text stream).
TARGETS = {
    "linear_qkv": "transformer_blocks.N.attn.to_q, to_k, to_v / attn.add_q_proj, add_k_proj, add_v_proj",
    "linear_proj": "transformer_blocks.N.attn.to_out.0 / attn.to_add_out",
    "linear_fc1": "transformer_blocks.N.img_mlp.net.0.proj / txt_mlp.net.0.proj",
    "linear_fc2": "transformer_blocks.N.img_mlp.net.2 / txt_mlp.net.2",
    "adaln": "transformer_blocks.N.img_mod.1 / txt_mod.1; norm_out.linear",
}
# Attention q / k / v / out of both streams and both MLP linears: what flow_grpo adapts on Qwen-Image
# (yifan123/flow_grpo scripts/train_qwenimage_edit_plus.py, target_modules; the same transformer).
# DiffSynth-Studio's Qwen-Image examples take the modulations (adaln) instead of the MLP inputs.
RECOMMENDED_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclasses.dataclass(frozen=True)
class LoRAConfig(lora.LoRAConfig):
    targets: Tuple[str, ...] = RECOMMENDED_TARGETS
    TARGETS: ClassVar = TARGETS


def target_of(module_path: str) -> Optional[str]:
    """The --lora-target-modules name of a linear of the model, or None."""
    last = module_path.rsplit(".", 1)[-1]
    if last in TARGETS:
        return last
    if module_path.endswith(("_mod.linear", "modulation.linear")):  # the blocks' and the head's adaLN
        return "adaln"
    return None


def _shard(rule: layout.Rule, full: torch.Tensor, rank: int, size: int, config: QwenImageConfig) -> torch.Tensor:
    return layout.shard(rule, full, rank, size)  # no packed linears: the cut needs no config


LORA_LAYOUT = lora.LoRALayout(targets=TARGETS, target_of=target_of, stage_rules=layout.stage_rules,
                              shard=_shard, merge=layout.merge, unmerge=layout.unmerge, config_attr="qwen_config")


# --- mm_grpo/lora.py's functions on Qwen-Image's layout ----------------------------------------
def base_rules(config: QwenImageConfig, targets, block_range=None, pre_process=True,
               post_process=True) -> Iterator[layout.Rule]:
    """The weight rules of the adapted linears of one model chunk."""
    return lora.base_rules(LORA_LAYOUT, config, targets, block_range, pre_process, post_process)


def stage_adapter_rules(config: QwenImageConfig, targets, block_range=None, pre_process=True,
                        post_process=True) -> List[layout.Rule]:
    return lora.stage_adapter_rules(LORA_LAYOUT, config, targets, block_range, pre_process, post_process)


def chunk_adapter_rules(chunk, targets) -> List[layout.Rule]:
    return lora.chunk_adapter_rules(LORA_LAYOUT, chunk, targets)


def add_adapters(chunk, config: LoRAConfig, seed: int, ranks: Optional[Dict[str, int]] = None):
    """Adapters on the target linears of one model chunk (A drawn, B zero); every other parameter
    frozen. `ranks`: per base weight's first diffusers name, a rank other than config.r (a loaded
    adapter's)."""
    return lora.add_adapters(LORA_LAYOUT, chunk, config, seed, ranks)


def copy_full_adapters(chunk, full: Dict[str, Tuple[torch.Tensor, torch.Tensor]], config: LoRAConfig):
    """This rank's shards of whole adapters {base weight's first diffusers name: (A, B)} into the
    chunk's adapters (a chunk takes those of its own blocks)."""
    lora.copy_full_adapters(LORA_LAYOUT, chunk, full, config)
