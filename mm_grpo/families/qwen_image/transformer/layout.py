"""How each Qwen-Image weight maps between diffusers names and the (TP-sharded) Megatron model.

Declared as data, as FLUX's layout is: every rule names a Megatron parameter, the diffusers tensors
it is built from (`merge`) and how the full tensor is cut across tensor-parallel ranks (`shard`).
The model loader and the converter both read these rules.

merge:  same   one diffusers tensor, unchanged
        qkv    to_q / to_k / to_v (or add_q_proj / add_k_proj / add_v_proj) fused per head:
               [q_h, k_h, v_h] for h in heads, so a contiguous TP chunk holds whole heads
shard:  replicated | column (dim 0) | row (dim 1; its bias replicated)
"""
import dataclasses
from typing import Iterator, Sequence, Tuple

import torch

from mm_grpo.families.qwen_image.transformer.config import QwenImageConfig
from mm_grpo.layers import fuse_per_head, split_per_head


@dataclasses.dataclass(frozen=True)
class Rule:
    megatron: str  # name in the stage's model (block numbers local to the stage)
    hf: Tuple[str, ...]  # diffusers names (global block numbers)
    merge: str = "same"
    shard: str = "replicated"


def _linear(megatron, hf, merge="same", shard="replicated"):
    hf = (hf,) if isinstance(hf, str) else hf
    yield Rule(f"{megatron}.weight", tuple(f"{h}.weight" for h in hf), merge, shard)
    yield Rule(f"{megatron}.bias", tuple(f"{h}.bias" for h in hf), merge, "column" if shard == "column" else "replicated")


# Per stream: (Megatron prefix, diffusers' modulation, q/k/v, QK norms, output projection, MLP).
STREAMS = (
    ("img", "img_mod.1", ("attn.to_q", "attn.to_k", "attn.to_v"), ("attn.norm_q", "attn.norm_k"),
     "attn.to_out.0", "img_mlp"),
    ("txt", "txt_mod.1", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
     ("attn.norm_added_q", "attn.norm_added_k"), "attn.to_add_out", "txt_mlp"),
)


def _block(m, h):  # m, h: Megatron / diffusers prefixes of one block
    for stream, mod, qkv, norms, proj, mlp in STREAMS:
        yield from _linear(f"{m}{stream}_mod.linear", f"{h}{mod}", shard="column")
        yield from _linear(f"{m}{stream}_attn.linear_qkv", tuple(h + n for n in qkv), "qkv", "column")
        yield Rule(f"{m}{stream}_attn.q_norm.weight", (f"{h}{norms[0]}.weight",))
        yield Rule(f"{m}{stream}_attn.k_norm.weight", (f"{h}{norms[1]}.weight",))
        yield from _linear(f"{m}{stream}_attn.linear_proj", f"{h}{proj}", shard="row")
        yield from _linear(f"{m}{stream}_mlp.linear_fc1", f"{h}{mlp}.net.0.proj", shard="column")
        yield from _linear(f"{m}{stream}_mlp.linear_fc2", f"{h}{mlp}.net.2", shard="row")


def stage_rules(config: QwenImageConfig, block_range=None, pre_process=True, post_process=True) -> Iterator[Rule]:
    """Rules for one model chunk: the blocks in `block_range`."""
    start, end = block_range or (0, config.num_blocks)
    if pre_process:
        yield from _linear("img_in", "img_in")
        yield Rule("txt_norm.weight", ("txt_norm.weight",))
        yield from _linear("txt_in", "txt_in")
        for lin in ("linear_1", "linear_2"):
            yield from _linear(f"time_text_embed.{lin}", f"time_text_embed.timestep_embedder.{lin}")
    for local, g in enumerate(range(start, end)):
        yield from _block(f"blocks.{local}.", f"transformer_blocks.{g}.")
    if post_process:
        yield from _linear("final_layer.modulation.linear", "norm_out.linear", shard="column")
        yield from _linear("final_layer.linear", "proj_out")


# --- merge: diffusers tensors <-> one full Megatron tensor ------------------------------
def merge(rule: Rule, tensors: Sequence[torch.Tensor], config: QwenImageConfig) -> torch.Tensor:
    if rule.merge == "same":
        return tensors[0]
    return fuse_per_head(tensors, config.num_attention_heads)


def unmerge(rule: Rule, full: torch.Tensor, config: QwenImageConfig) -> Tuple[torch.Tensor, ...]:
    if rule.merge == "same":
        return (full,)
    return split_per_head(full, config.num_attention_heads)


# --- shard: one full tensor <-> TP shards ----------------------------------------------
def shard(rule: Rule, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    if rule.shard == "replicated" or size == 1:
        return full
    return full.chunk(size, dim=0 if rule.shard == "column" else 1)[rank]


def unshard(rule: Rule, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    if rule.shard == "replicated" or len(shards) == 1:
        return shards[0]
    return torch.cat(list(shards), dim=0 if rule.shard == "column" else 1)
