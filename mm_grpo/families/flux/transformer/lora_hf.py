"""LoRA adapters <-> diffusers' FLUX LoRA files (`pytorch_lora_weights.safetensors`, PEFT names), the
format `FluxPipeline.load_lora_weights` reads and diffusers' / flow_grpo's training scripts write.

Keys: `transformer.<diffusers module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]. No
alphas are written, so diffusers takes lora_alpha = r (scale 1): the exported B carries our
alpha / r. A fused linear (linear_qkv: to_q / to_k / to_v; linear_in: the same and proj_mlp) gives
each of its diffusers modules its one A and its rows of B. A file whose parts of a fused linear have
different A's (trained on the separate linears) loads as one adapter of their summed rank:
A = [A_q; A_k; A_v], B block-diagonal; parts missing from the file get zero rows of B.
"""
import json
import os
from typing import Dict, Tuple

import torch
from safetensors import safe_open

from mm_grpo.families.flux.transformer import layout
from mm_grpo.families.flux.transformer import lora as flux_lora
from mm_grpo.families.flux.transformer.config import FluxConfig
from mm_grpo.families.flux.transformer.hf_weights import expected_hf_shapes

LORA_FILE = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
PREFIX = "transformer."
Adapters = Dict[str, Tuple[torch.Tensor, torch.Tensor]]  # base weight's first diffusers name -> (A, B)


def _module(weight_name: str) -> str:
    return weight_name[:-len(".weight")]


def to_diffusers(adapters: Adapters, flux_config: FluxConfig, config: flux_lora.LoRAConfig) -> Dict[str, torch.Tensor]:
    """Whole adapters (ours, B unscaled) -> the tensors of a diffusers FLUX LoRA file."""
    out = {}
    for base in flux_lora.base_rules(flux_config, config.targets):
        a, b = adapters[base.hf[0]]
        for name, b_part in zip(base.hf, layout.unmerge(base, b.float() * config.scaling, flux_config)):
            out[f"{PREFIX}{_module(name)}.lora_A.weight"] = a.float().clone()  # one file tensor each
            out[f"{PREFIX}{_module(name)}.lora_B.weight"] = b_part.contiguous()
    return out


def _file_scale(metadata: dict, path: str) -> float:
    """alpha / r from diffusers' adapter metadata when the file has it, else 1."""
    raw = (metadata or {}).get("lora_adapter_metadata")
    if not raw:
        return 1.0
    meta = json.loads(raw)
    if meta.get(f"{PREFIX}rank_pattern") or meta.get(f"{PREFIX}alpha_pattern"):
        raise ValueError(f"{path}: per-module rank_pattern / alpha_pattern in its metadata is not supported")
    r, alpha = meta.get(f"{PREFIX}r"), meta.get(f"{PREFIX}lora_alpha")
    return float(alpha) / float(r) if r and alpha else 1.0


def lora_file(path: str) -> str:
    """The .safetensors file of a LoRA given as the file or its folder."""
    if os.path.isdir(path):
        path = os.path.join(path, LORA_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such LoRA file: {path}")
    return path


def read_diffusers_lora(path: str, flux_config: FluxConfig, config: flux_lora.LoRAConfig) -> Adapters:
    """A diffusers / PEFT FLUX LoRA file (or its folder) as whole adapters of `config.targets`, B
    divided by config.scaling so that the model computes what the file means."""
    path = lora_file(path)
    try:
        with safe_open(path, framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            scale = _file_scale(f.metadata(), path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read LoRA file {path}: {e}") from None
    others = sorted(k for k in tensors if not k.startswith(PREFIX))
    if others and len(others) < len(tensors):  # a file with the transformer's and other models' adapters
        raise ValueError(f"{path} holds adapters of other models than the transformer (e.g. {others[0]}); "
                         "only transformer LoRAs load")
    tensors = {k[len(PREFIX):] if k.startswith(PREFIX) else k: v.float() for k, v in tensors.items()}
    shapes = expected_hf_shapes(flux_config)
    used, out = set(), {}
    for base in flux_lora.base_rules(flux_config, config.targets):
        parts = [_module(h) for h in base.hf]
        present = [p for p in parts if f"{p}.lora_A.weight" in tensors]
        if not present:
            continue  # a new adapter there
        a_parts, b_parts = {}, {}
        for p, h in zip(parts, base.hf):
            if p not in present:
                continue
            a, b = tensors.get(f"{p}.lora_A.weight"), tensors.get(f"{p}.lora_B.weight")
            used.update({f"{p}.lora_A.weight", f"{p}.lora_B.weight"})
            out_dim, in_dim = shapes[h]
            if b is None or a.ndim != 2 or b.ndim != 2 or a.shape[1] != in_dim or b.shape != (out_dim, a.shape[0]):
                raise ValueError(f"{path}: the LoRA of {p} has A {tuple(a.shape)} and B "
                                 f"{None if b is None else tuple(b.shape)}; {p} is [{out_dim}, {in_dim}]")
            a_parts[p], b_parts[p] = a, b * (scale / config.scaling)
        first = a_parts[present[0]]
        if len(present) == len(parts) and all(torch.equal(first, a) for a in a_parts.values()):
            out[base.hf[0]] = first, layout.merge(base, [b_parts[p] for p in parts], flux_config)
            continue
        rank = sum(a.shape[0] for a in a_parts.values())
        a_full = torch.cat([a_parts[p] for p in present])
        blocks, offset = [], 0
        for p, h in zip(parts, base.hf):
            block = torch.zeros(shapes[h][0], rank)
            if p in a_parts:
                block[:, offset:offset + a_parts[p].shape[0]] = b_parts[p]
                offset += a_parts[p].shape[0]
            blocks.append(block)
        out[base.hf[0]] = a_full, layout.merge(base, blocks, flux_config)
    unused = sorted(set(tensors) - used)
    if unused:
        raise ValueError(f"{path}: {len(unused)} tensors are not LoRAs of --lora-target-modules "
                         f"{' '.join(config.targets)} (e.g. {unused[0]})")
    if not out:
        raise ValueError(f"{path} holds no LoRA of --lora-target-modules {' '.join(config.targets)}")
    return out
