"""How each FLUX weight maps between diffusers names and the (TP-sharded) Megatron model.

Declared as data: every rule names a Megatron parameter, the diffusers tensors it is
built from (`merge`), and how the full tensor is cut across tensor-parallel ranks
(`shard`). The model loader and the converter both read these rules.

merge:  same     one diffusers tensor, unchanged
        qkv      to_q/to_k/to_v fused per head: [q_h, k_h, v_h] for h in heads, so a
                 contiguous TP chunk holds whole heads (Megatron's layout)
        qkv_mlp  single block's fused input projection: [qkv (per head) ; proj_mlp]
shard:  replicated | column (dim 0) | row (dim 1; its bias replicated) |
        column_packed / row_packed: the [qkv | mlp] (or [attention | mlp]) groups are
        chunked separately so each rank gets its heads and its MLP columns.
"""
import dataclasses
from typing import Iterator, Sequence, Tuple

import torch

from mm_grpo.families.flux.transformer.config import FluxConfig
from mm_grpo.layers import fuse_per_head, split_per_head


@dataclasses.dataclass(frozen=True)
class Rule:
    megatron: str  # name in the stage's model (block numbers local to the stage)
    hf: Tuple[str, ...]  # diffusers names (global block numbers)
    merge: str = "same"
    shard: str = "replicated"


_BIAS_SHARD = {"column": "column", "column_packed": "column_packed", "row": "replicated",
               "row_packed": "replicated", "replicated": "replicated"}


def _linear(megatron, hf, merge="same", shard="replicated"):
    hf = (hf,) if isinstance(hf, str) else hf
    yield Rule(f"{megatron}.weight", tuple(f"{h}.weight" for h in hf), merge, shard)
    yield Rule(f"{megatron}.bias", tuple(f"{h}.bias" for h in hf), merge, _BIAS_SHARD[shard])


def _double_block(m, h):  # m, h: Megatron / diffusers prefixes of one block
    for stream, hf_mod, proj, ff, qkv, norms in (
        ("img", "norm1", "attn.to_out.0", "ff", ("attn.to_q", "attn.to_k", "attn.to_v"),
         ("attn.norm_q", "attn.norm_k")),
        ("txt", "norm1_context", "attn.to_add_out", "ff_context",
         ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
         ("attn.norm_added_q", "attn.norm_added_k")),
    ):
        yield from _linear(f"{m}{stream}_mod.linear", f"{h}{hf_mod}.linear", shard="column")
        yield from _linear(f"{m}{stream}_attn.linear_qkv", tuple(h + n for n in qkv), "qkv", "column")
        yield Rule(f"{m}{stream}_attn.q_norm.weight", (f"{h}{norms[0]}.weight",))
        yield Rule(f"{m}{stream}_attn.k_norm.weight", (f"{h}{norms[1]}.weight",))
        yield from _linear(f"{m}{stream}_attn.linear_proj", f"{h}{proj}", shard="row")
        yield from _linear(f"{m}{stream}_mlp.linear_fc1", f"{h}{ff}.net.0.proj", shard="column")
        yield from _linear(f"{m}{stream}_mlp.linear_fc2", f"{h}{ff}.net.2", shard="row")


def _single_block(m, h):
    yield from _linear(f"{m}modulation.linear", f"{h}norm.linear", shard="column")
    yield from _linear(f"{m}linear_in", tuple(h + n for n in (
        "attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")), "qkv_mlp", "column_packed")
    yield Rule(f"{m}q_norm.weight", (f"{h}attn.norm_q.weight",))
    yield Rule(f"{m}k_norm.weight", (f"{h}attn.norm_k.weight",))
    yield from _linear(f"{m}linear_out", f"{h}proj_out", shard="row_packed")


def stage_rules(config: FluxConfig, block_range=None, pre_process=True, post_process=True) -> Iterator[Rule]:
    """Rules for one model chunk: the blocks in `block_range` of [double..., single...]."""
    start, end = block_range or (0, config.num_blocks)
    n_double = config.num_layers
    if pre_process:
        yield from _linear("x_embedder", "x_embedder")
        yield from _linear("context_embedder", "context_embedder")
        embedders = ["timestep_embedder", "text_embedder"] + (["guidance_embedder"] if config.guidance_embeds else [])
        for e in embedders:
            for lin in ("linear_1", "linear_2"):
                yield from _linear(f"time_text_embed.{e}.{lin}", f"time_text_embed.{e}.{lin}")
    for local, g in enumerate(range(start, min(end, n_double))):
        yield from _double_block(f"double_blocks.{local}.", f"transformer_blocks.{g}.")
    for local, g in enumerate(range(max(start, n_double), max(end, n_double))):
        yield from _single_block(f"single_blocks.{local}.", f"single_transformer_blocks.{g - n_double}.")
    if post_process:
        yield from _linear("final_layer.modulation.linear", "norm_out.linear", shard="column")
        yield from _linear("final_layer.linear", "proj_out")


# --- merge: diffusers tensors <-> one full Megatron tensor ------------------------------
def merge(rule: Rule, tensors: Sequence[torch.Tensor], config: FluxConfig) -> torch.Tensor:
    if rule.merge == "same":
        return tensors[0]
    qkv = fuse_per_head(tensors[:3], config.num_attention_heads)
    return qkv if rule.merge == "qkv" else torch.cat([qkv, tensors[3]])


def unmerge(rule: Rule, full: torch.Tensor, config: FluxConfig) -> Tuple[torch.Tensor, ...]:
    if rule.merge == "same":
        return (full,)
    dim = config.hidden_size
    qkv = split_per_head(full[:3 * dim], config.num_attention_heads)
    return qkv if rule.merge == "qkv" else (*qkv, full[3 * dim:])


# --- shard: one full tensor <-> TP shards ----------------------------------------------
def _packed_groups(rule: Rule, config: FluxConfig):
    dim, hidden = config.hidden_size, config.mlp_hidden_size
    if rule.shard == "column_packed":
        return 0, (3 * dim, hidden)
    return 1, (dim, hidden)  # row_packed: [attention | mlp] input columns


def shard(rule: Rule, full: torch.Tensor, rank: int, size: int, config: FluxConfig) -> torch.Tensor:
    kind = rule.shard
    if kind == "replicated" or size == 1:
        return full
    if kind in ("column", "row"):
        return full.chunk(size, dim=0 if kind == "column" else 1)[rank]
    dim, groups = _packed_groups(rule, config)
    return torch.cat([g.chunk(size, dim=dim)[rank] for g in full.split(groups, dim=dim)], dim=dim)


def unshard(rule: Rule, shards: Sequence[torch.Tensor], config: FluxConfig) -> torch.Tensor:
    kind, size = rule.shard, len(shards)
    if kind == "replicated" or size == 1:
        return shards[0]
    if kind in ("column", "row"):
        return torch.cat(list(shards), dim=0 if kind == "column" else 1)
    dim, groups = _packed_groups(rule, config)
    local = [g // size for g in groups]
    parts = [s.split(local, dim=dim) for s in shards]
    return torch.cat([torch.cat([p[i] for p in parts], dim=dim) for i in range(len(groups))], dim=dim)
