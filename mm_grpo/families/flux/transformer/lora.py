"""LoRA on the FLUX transformer's parallel linears: FLUX's target modules and its layout, on the
shared mechanism (mm_grpo/lora.py: adapters sharded like the linear they adapt, seeded A, zero B).

`TARGETS` maps the --lora-target-modules names to the diffusers modules they adapt (docs/lora.md).
Every function here is mm_grpo/lora.py's with FLUX's `LORA_LAYOUT`.
"""
import dataclasses
from typing import ClassVar, Dict, Iterator, List, Optional, Tuple

import torch

from mm_grpo import lora
from mm_grpo.families.flux.transformer import layout
from mm_grpo.families.flux.transformer.config import FluxConfig
from mm_grpo.lora import (  # noqa: F401  (FLUX's lora module is where callers find them)
    ADAPTER_KEYS, Adapter, AdaptersOff, adapter_rules, adapter_state_dict, adapters, adapters_disabled,
    freeze_base_in_bf16, has_adapters, mirror_adapters, reference_policy, switched)

# --lora-target-modules name -> the diffusers modules it adapts (double blocks: image / text stream).
TARGETS = {
    "linear_qkv": "transformer_blocks.N.attn.to_q, to_k, to_v / attn.add_q_proj, add_k_proj, add_v_proj",
    "linear_proj": "transformer_blocks.N.attn.to_out.0 / attn.to_add_out",
    "linear_fc1": "transformer_blocks.N.ff.net.0.proj / ff_context.net.0.proj",
    "linear_fc2": "transformer_blocks.N.ff.net.2 / ff_context.net.2",
    "linear_in": "single_transformer_blocks.N.attn.to_q, to_k, to_v, proj_mlp",
    "linear_out": "single_transformer_blocks.N.proj_out",
    "adaln": "transformer_blocks.N.norm1.linear, norm1_context.linear; single_transformer_blocks.N.norm.linear; "
             "norm_out.linear",
}
# Attention and MLP linears of every block (what flow_grpo and DiffusionNFT adapt).
RECOMMENDED_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "linear_in", "linear_out")


@dataclasses.dataclass(frozen=True)
class LoRAConfig(lora.LoRAConfig):
    targets: Tuple[str, ...] = RECOMMENDED_TARGETS
    TARGETS: ClassVar = TARGETS


def target_of(module_path: str) -> Optional[str]:
    """The --lora-target-modules name of a linear of the model, or None."""
    last = module_path.rsplit(".", 1)[-1]
    if last in TARGETS:
        return last
    if module_path.endswith(("_mod.linear", "modulation.linear")):
        return "adaln"
    return None


LORA_LAYOUT = lora.LoRALayout(targets=TARGETS, target_of=target_of, stage_rules=layout.stage_rules,
                              shard=layout.shard, merge=layout.merge, unmerge=layout.unmerge,
                              config_attr="flux_config")


# --- mm_grpo/lora.py's functions on FLUX's layout ---------------------------------------------
def base_rules(config: FluxConfig, targets, block_range=None, pre_process=True,
               post_process=True) -> Iterator[layout.Rule]:
    """The weight rules of the adapted linears of one model chunk."""
    return lora.base_rules(LORA_LAYOUT, config, targets, block_range, pre_process, post_process)


def stage_adapter_rules(config: FluxConfig, targets, block_range=None, pre_process=True,
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
