"""Original (Black Forest Labs) single-file FLUX names -> diffusers names.

Declared as data, like the model's layout rules: each BFL tensor maps to one or more
diffusers tensors by
    same   one tensor, unchanged (`.scale` of the q/k RMSNorms becomes `.weight`)
    rows   cut along dim 0 into parts of the given sizes: fused qkv (D, D, D) of double
           blocks, linear1 (D, D, D, F) of single blocks; all of Q, then K, then V
    swap   final adaLN: BFL keeps (shift, scale), diffusers (scale, shift)
The oracle is diffusers' `convert_flux_transformer_checkpoint_to_diffusers`.
"""
import dataclasses
from collections.abc import Mapping
from typing import Iterator, Tuple

import torch

from mm_grpo.families.flux.transformer.config import FluxConfig
from mm_grpo.families.flux.transformer.hf_weights import expected_hf_shapes
from mm_grpo.files.safetensors_weights import SafetensorsWeights

PREFIX = "model.diffusion_model."  # full ComfyUI / ldm-style checkpoints nest the transformer here


@dataclasses.dataclass(frozen=True)
class BflRule:
    bfl: str
    hf: Tuple[str, ...]
    split: str = "same"  # same | rows | swap
    sizes: Tuple[int, ...] = ()  # rows: dim-0 sizes of the parts, in `hf` order


def _linear(bfl, hf, split="same", sizes=()):
    hf = (hf,) if isinstance(hf, str) else hf
    for p in ("weight", "bias"):
        yield BflRule(f"{bfl}.{p}", tuple(f"{h}.{p}" for h in hf), split, sizes)


def _qk_norms(bfl, q, k):
    yield BflRule(f"{bfl}.query_norm.scale", (f"{q}.weight",))
    yield BflRule(f"{bfl}.key_norm.scale", (f"{k}.weight",))


def bfl_rules(config: FluxConfig) -> Iterator[BflRule]:
    d, f = config.hidden_size, config.mlp_hidden_size
    yield from _linear("img_in", "x_embedder")
    yield from _linear("txt_in", "context_embedder")
    embedders = [("time_in", "timestep_embedder"), ("vector_in", "text_embedder")]
    if config.guidance_embeds:
        embedders.append(("guidance_in", "guidance_embedder"))
    for bfl, hf in embedders:
        yield from _linear(f"{bfl}.in_layer", f"time_text_embed.{hf}.linear_1")
        yield from _linear(f"{bfl}.out_layer", f"time_text_embed.{hf}.linear_2")
    for i in range(config.num_layers):
        b, h = f"double_blocks.{i}.", f"transformer_blocks.{i}."
        for stream, mod, qkv, norms, proj, mlp in (
            ("img", "norm1", ("to_q", "to_k", "to_v"), ("norm_q", "norm_k"), "to_out.0", "ff"),
            ("txt", "norm1_context", ("add_q_proj", "add_k_proj", "add_v_proj"),
             ("norm_added_q", "norm_added_k"), "to_add_out", "ff_context"),
        ):
            yield from _linear(f"{b}{stream}_mod.lin", f"{h}{mod}.linear")
            yield from _linear(f"{b}{stream}_attn.qkv", tuple(f"{h}attn.{n}" for n in qkv), "rows", (d, d, d))
            yield from _qk_norms(f"{b}{stream}_attn.norm", *(f"{h}attn.{n}" for n in norms))
            yield from _linear(f"{b}{stream}_attn.proj", f"{h}attn.{proj}")
            yield from _linear(f"{b}{stream}_mlp.0", f"{h}{mlp}.net.0.proj")
            yield from _linear(f"{b}{stream}_mlp.2", f"{h}{mlp}.net.2")
    for i in range(config.num_single_layers):
        b, h = f"single_blocks.{i}.", f"single_transformer_blocks.{i}."
        yield from _linear(f"{b}linear1", tuple(f"{h}{n}" for n in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")),
                           "rows", (d, d, d, f))
        yield from _linear(f"{b}linear2", f"{h}proj_out")
        yield from _linear(f"{b}modulation.lin", f"{h}norm.linear")
        yield from _qk_norms(f"{b}norm", f"{h}attn.norm_q", f"{h}attn.norm_k")
    yield from _linear("final_layer.linear", "proj_out")
    yield from _linear("final_layer.adaLN_modulation.1", "norm_out.linear", "swap")


def expected_bfl_shapes(config: FluxConfig) -> dict:
    hf = expected_hf_shapes(config)
    return {r.bfl: (sum(r.sizes),) + hf[r.hf[0]][1:] if r.split == "rows" else hf[r.hf[0]]
            for r in bfl_rules(config)}


def looks_like_bfl(names) -> bool:
    return any(n.startswith(("double_blocks.", "img_in.", PREFIX)) for n in names)


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    first, second = t.chunk(2)
    return torch.cat([second, first])


class BflWeights(Mapping):
    """A lazy diffusers-named view of a BFL checkpoint: each diffusers tensor reads only its rows.

    Keys under `model.diffusion_model.` are used when present (other components of a full
    checkpoint are ignored); BFL names are checked up front: missing, unexpected and
    wrong-shaped tensors are listed by name."""

    def __init__(self, weights: SafetensorsWeights, config: FluxConfig):
        self._weights = weights
        self._prefix = PREFIX if any(k.startswith(PREFIX) for k in weights) else ""
        self._rules = list(bfl_rules(config))
        self._check(config)
        self._parts = {h: (r, i) for r in self._rules for i, h in enumerate(r.hf)}

    def _check(self, config):
        n = len(self._prefix)
        present = {k[n:] for k in self._weights if k.startswith(self._prefix)}
        expected = expected_bfl_shapes(config)
        missing, unexpected = sorted(set(expected) - present), sorted(present - set(expected))
        problems = [f"{what} BFL weights: {', '.join(names)}"
                    for what, names in (("missing", missing), ("unexpected", unexpected)) if names]
        if problems:
            raise ValueError("; ".join(problems))
        wrong = [(name, self._weights.shape_of(self._prefix + name), shape) for name, shape in expected.items()
                 if self._weights.shape_of(self._prefix + name) != shape]
        if wrong:
            raise ValueError("wrong shapes: " + ", ".join(f"{n} is {got}, expected {want}" for n, got, want in wrong))

    def _locate(self, name):
        """BFL key, rule, and the rows [start, stop) of the BFL tensor that hold `name`."""
        rule, i = self._parts[name]
        start = sum(rule.sizes[:i])
        stop = start + rule.sizes[i] if rule.split == "rows" else None
        return self._prefix + rule.bfl, rule, start, stop

    def __getitem__(self, name):
        key, rule, start, stop = self._locate(name)
        if rule.split == "rows":
            return self._weights.rows(key, start, stop)
        tensor = self._weights[key]
        return _swap_halves(tensor) if rule.split == "swap" else tensor

    def meta(self, name):
        key, rule, start, stop = self._locate(name)
        stored = self._weights.meta(key)
        return stored if rule.split != "rows" else stored[start:stop]

    def shape_of(self, name):
        return tuple(self.meta(name).shape)

    def __iter__(self):
        return iter(self._parts)

    def __len__(self):
        return len(self._parts)


def diffusers_to_bfl(state_dict: Mapping, config: FluxConfig, prefix: str = "") -> dict:
    """The inverse map, in memory: builds BFL-named checkpoints (tests, tools)."""
    out = {}
    for r in bfl_rules(config):
        tensors = [state_dict[h] for h in r.hf]
        joined = torch.cat(tensors) if r.split == "rows" else tensors[0]
        out[prefix + r.bfl] = _swap_halves(joined) if r.split == "swap" else joined
    return out
