"""LoRA on a family's parallel linears (mm_grpo/layers.py), sharded like the linear it adapts.

A linear W of a `--lora-target-modules` name gets W x + (alpha / r) B A x with A [r, in] and
B [out, r] (PEFT's names: `<linear>.lora_A.weight`, `<linear>.lora_B.weight`). Under tensor
parallelism the adapter follows the base linear's split:

    column-parallel W (rows split):  A replicated, B split by rows like W; the r-wide product
                                     A x goes through copy_to_tensor_model_parallel_region, so A's
                                     gradient is summed over the TP group (full on every rank);
    row-parallel W (columns split):  A split by columns like W, the partial products A_k x_k
                                     summed over the TP group (reduce_from_...), B replicated.

Which rows / columns a rank holds (packed linears too) comes from the base weight's rule in the
family's `layout.py`, so adapters convert, reshard and load like weights. B starts at zero (the base
model's output, bit for bit); A is drawn per weight from (seed, Stream.LORA_INIT, the weight's first
diffusers name), the same under every layout.

This module knows no family: each declares once, in its transformer's `lora.py`, a `LoRALayout` (its
target names, its layout's rules and sharding) and a `LoRAConfig` subclass naming its targets, and
wraps these functions with its layout. The diffusers / PEFT LoRA file format (`to_diffusers`,
`read_diffusers_lora`) is shared the same way: each family's `lora_hf.py` passes its layout.
"""
import contextlib
import copy
import dataclasses
import inspect
import json
import os
import zlib
from typing import Any, Callable, ClassVar, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from safetensors import safe_open
from torch import nn

from mm_grpo.seeding import Stream, seeded_generator

ADAPTER_KEYS = (".lora_A.", ".lora_B.")
Adapters = Dict[str, Tuple[torch.Tensor, torch.Tensor]]  # base weight's first diffusers name -> whole (A, B)


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """The LoRA settings of a run. A family subclasses it with its `TARGETS` (the names
    --lora-target-modules takes) and its default `targets`; the names are checked against them."""
    r: int = 8
    alpha: float = 16.0
    targets: Tuple[str, ...] = ()
    dropout: float = 0.0
    TARGETS: ClassVar[Optional[Mapping[str, str]]] = None  # the family's: --lora-target-modules name -> modules

    def __post_init__(self):
        if self.TARGETS is None:
            raise TypeError("LoRAConfig is declared per model family (its transformer's lora.py), which names "
                            "its target modules")
        object.__setattr__(self, "targets", tuple(self.targets))
        unknown = [t for t in self.targets if t not in self.TARGETS]
        if unknown:
            raise ValueError(f"unknown --lora-target-modules {unknown}; choose from {sorted(self.TARGETS)}")
        if not self.targets:
            raise ValueError("LoRA needs at least one target module")
        if self.r < 1:
            raise ValueError(f"--lora-r must be >= 1, got {self.r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--lora-dropout must be in [0, 1), got {self.dropout}")

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    def to_json(self) -> dict:
        return {"r": self.r, "alpha": self.alpha, "targets": list(self.targets), "dropout": self.dropout}

    @classmethod
    def from_json(cls, data: dict) -> "LoRAConfig":
        return cls(data["r"], data["alpha"], tuple(data["targets"]), data.get("dropout", 0.0))


@dataclasses.dataclass(frozen=True)
class LoRALayout:
    """What the mechanism reads of a family, from its transformer's `layout.py`. A rule is the family's
    `layout.Rule` (`.megatron`, `.hf`, `.merge`, `.shard`: "replicated", or "column..." / "row..."
    for the linear's split)."""
    targets: Mapping[str, str]  # --lora-target-modules name -> the diffusers modules it adapts
    target_of: Callable[[str], Optional[str]]  # a linear's module path in the chunk -> its target name, or None
    stage_rules: Callable[..., Iterable[Any]]  # (model config, block_range, pre_process, post_process) -> rules
    shard: Callable[..., torch.Tensor]  # (rule, full tensor, tp rank, tp size, model config) -> this rank's
    merge: Callable[..., torch.Tensor]  # (rule, diffusers tensors, model config) -> the full Megatron tensor
    unmerge: Callable[..., Tuple[torch.Tensor, ...]]  # (rule, full tensor, model config) -> diffusers tensors
    config_attr: str  # the model chunk's attribute holding its model config


# --- which linears, and the layout rules of their adapters ----------------------------------
def _adapter_name(weight_name: str, matrix: str) -> str:
    return weight_name[:-len("weight")] + f"lora_{matrix}.weight"


def adapter_rules(base):
    """The layout rules (of the base rule's own type) of the A and B of the adapter on the linear
    whose weight rule is `base`."""
    column = base.shard.startswith("column")
    a = dataclasses.replace(base, megatron=_adapter_name(base.megatron, "A"),
                            hf=tuple(_adapter_name(h, "A") for h in base.hf),
                            shard="replicated" if column else base.shard)
    b = dataclasses.replace(base, megatron=_adapter_name(base.megatron, "B"),
                            hf=tuple(_adapter_name(h, "B") for h in base.hf),
                            shard=base.shard if column else "replicated")
    return a, b


def base_rules(layout: LoRALayout, config, targets, block_range=None, pre_process=True,
               post_process=True) -> Iterator[Any]:
    """The weight rules of the adapted linears of one model chunk (`config`: the family's model config)."""
    for rule in layout.stage_rules(config, block_range, pre_process, post_process):
        if rule.megatron.endswith(".weight") and layout.target_of(rule.megatron[:-len(".weight")]) in targets:
            yield rule


def stage_adapter_rules(layout: LoRALayout, config, targets, block_range=None, pre_process=True,
                        post_process=True) -> List[Any]:
    return [r for base in base_rules(layout, config, targets, block_range, pre_process, post_process)
            for r in adapter_rules(base)]


def chunk_base_rules(layout: LoRALayout, chunk, targets) -> Iterator[Any]:
    return base_rules(layout, getattr(chunk, layout.config_attr), targets, chunk.block_range, chunk.pre_process,
                      chunk.post_process)


def chunk_adapter_rules(layout: LoRALayout, chunk, targets) -> List[Any]:
    return [r for base in chunk_base_rules(layout, chunk, targets) for r in adapter_rules(base)]


# --- the adapter -----------------------------------------------------------------------------
def _tp(fn, x):
    """A megatron-core TP mapping on the TP group (0.16 takes it as `group=`, 0.12 has no argument)."""
    if "group" in inspect.signature(fn).parameters:
        return fn(x, group=parallel_state.get_tensor_model_parallel_group())
    return fn(x)


class Adapter:
    """The adapter's computation on its linear `layer` (which holds `lora_A` / `lora_B`); a plain
    object, so the parameters keep PEFT's names. Called by layers.py's linears."""

    def __init__(self, column: bool, gather_output: bool, config: LoRAConfig):
        self.column, self.gather_output = column, gather_output
        self.scaling, self.dropout = config.scaling, config.dropout
        self.enabled = True

    def add_to(self, layer, x, out):
        """`out` (the layer's output, in the compute dtype) plus the adapter's output for the layer's
        input `x` (or the list of parts `RowLinear.forward_parts` concatenates). The scaled product
        B (A x) is accumulated into `out` by one GEMM (addmm): no adapter-sized output of its own,
        scaled and added in two more passes. A and B are trainable (fp32 under --bf16): r x D each,
        cast for the call."""
        parts = x if isinstance(x, (list, tuple)) else [x]
        if self.dropout and torch.is_grad_enabled():
            parts = [F.dropout(p, self.dropout, training=True) for p in parts]
        dtype = out.dtype
        a = layer.lora_A.weight.to(dtype).split([p.shape[-1] for p in parts], dim=1)
        h = sum(F.linear(p, w) for p, w in zip(parts, a))
        h = _tp(mappings.copy_to_tensor_model_parallel_region if self.column
                else mappings.reduce_from_tensor_model_parallel_region, h)
        b = layer.lora_B.weight.to(dtype)
        if self.gather_output:
            return out + _tp(mappings.gather_from_tensor_model_parallel_region, F.linear(h, b) * self.scaling)
        flat = torch.addmm(out.reshape(-1, out.shape[-1]), h.reshape(-1, h.shape[-1]), b.t(), alpha=self.scaling)
        return flat.view(out.shape)


def adapters(model) -> Iterator[Adapter]:
    for module in model.modules():
        if module.__dict__.get("adapter") is not None:
            yield module.__dict__["adapter"]


def has_adapters(model) -> bool:
    return next(adapters(model), None) is not None


def _tp_rank_and_size():
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def add_adapters(layout: LoRALayout, chunk, config: LoRAConfig, seed: int, ranks: Optional[Dict[str, int]] = None):
    """Adapters on the target linears of one model chunk (A drawn, B zero); every other parameter
    frozen. `ranks`: per base weight's first diffusers name, a rank other than config.r (a loaded
    adapter's)."""
    unknown = [t for t in config.targets if t not in layout.targets]
    if unknown:  # another family's LoRAConfig
        raise ValueError(f"--lora-target-modules {unknown} are not this model's; choose from {sorted(layout.targets)}")
    tp_rank, tp_size = _tp_rank_and_size()
    model_config = getattr(chunk, layout.config_attr)
    chunk.requires_grad_(False)
    device = next(chunk.parameters()).device
    for base in chunk_base_rules(layout, chunk, config.targets):
        layer = chunk.get_submodule(base.megatron[:-len(".weight")])
        if not hasattr(layer, "config"):  # a replicated nn.Linear (an output projection) is not a parallel linear
            raise TypeError(f"{base.megatron} is not a parallel linear")
        rule_a, rule_b = adapter_rules(base)
        r = (ranks or {}).get(base.hf[0], config.r)
        out_local, in_local = layer.weight.shape
        column = base.shard.startswith("column")
        in_full = in_local * (1 if column else tp_size)
        out_full = out_local * (tp_size if column else 1)
        generator = seeded_generator(seed, Stream.LORA_INIT, zlib.crc32(base.hf[0].encode()))
        bound = in_full ** -0.5  # PEFT's kaiming_uniform_(a=sqrt(5)) on A
        a_full = torch.empty(r, in_full).uniform_(-bound, bound, generator=generator)
        a = layout.shard(rule_a, a_full, tp_rank, tp_size, model_config)
        b = layout.shard(rule_b, torch.zeros(out_full, r), tp_rank, tp_size, model_config)
        layer.lora_A = nn.Linear(a.shape[1], r, bias=False, device=device)
        layer.lora_B = nn.Linear(r, b.shape[0], bias=False, device=device)
        with torch.no_grad():
            layer.lora_A.weight.copy_(a)
            layer.lora_B.weight.copy_(b)
        if tp_size > 1:  # Megatron's grad-norm and distributed optimizer read these attributes
            split = layer.lora_B.weight if column else layer.lora_A.weight
            set_tensor_model_parallel_attributes(split, True, 0 if column else 1, 1)
        layer.adapter = Adapter(column, bool(getattr(layer, "gather_output", False)), config)
    return chunk


def copy_full_adapters(layout: LoRALayout, chunk, full: Adapters, config: LoRAConfig):
    """This rank's shards of whole adapters {base weight's first diffusers name: (A, B)} into the
    chunk's adapters (a chunk takes those of its own blocks)."""
    tp_rank, tp_size = _tp_rank_and_size()
    model_config = getattr(chunk, layout.config_attr)
    params = dict(chunk.named_parameters())
    with torch.no_grad():
        for base in chunk_base_rules(layout, chunk, config.targets):
            if base.hf[0] not in full:
                continue
            for rule, tensor in zip(adapter_rules(base), full[base.hf[0]]):
                params[rule.megatron].copy_(layout.shard(rule, tensor, tp_rank, tp_size, model_config))


def freeze_base_in_bf16(chunk):
    """The frozen base in bf16, the dtype the model computes in under --bf16: its matrices (half the
    memory) and biases are then used as they are, with no cast per forward. Vectors that are not
    biases (the QK-norm weights, head_dim each) stay fp32: they scale q and k inside an fp32 chain
    (kernels.qk_norm_rope)."""
    for name, p in chunk.named_parameters():
        if not p.requires_grad and (p.dim() >= 2 or name.endswith(".bias")) and not any(k in name for k in ADAPTER_KEYS):
            p.data = p.data.to(torch.bfloat16)


def mirror_adapters(source, target):
    """Adapters on `target` (a chunk built like `source`) where `source` has them, with their own
    weights (a copy) and their own on/off switch: an EMA of a LoRA policy averages its adapters."""
    for name, module in source.named_modules():
        adapter = module.__dict__.get("adapter")
        if adapter is None:
            continue
        layer = target.get_submodule(name)
        layer.lora_A = copy.deepcopy(module.lora_A)
        layer.lora_B = copy.deepcopy(module.lora_B)
        layer.adapter = copy.copy(adapter)


def adapter_state_dict(chunk) -> dict:
    """This rank's adapter tensors, by the chunk's parameter names."""
    return {k: v for k, v in chunk.state_dict().items() if any(s in k for s in ADAPTER_KEYS)}


@contextlib.contextmanager
def switched(objects: Sequence, attribute: str, value):
    """Every object's `attribute` set to `value` inside the block, and restored after."""
    before = [getattr(o, attribute) for o in objects]
    for o in objects:
        setattr(o, attribute, value)
    try:
        yield
    finally:
        for o, state in zip(objects, before):
            setattr(o, attribute, state)


def adapters_disabled(modules: Sequence[nn.Module]):
    """The base model: adapters skipped, their weights untouched."""
    return switched([a for m in modules for a in adapters(m)], "enabled", False)


class AdaptersOff(nn.Module):
    """A model chunk seen with its adapters off: the frozen reference of GRPO's KL term is the
    policy's own base weights (no second copy). Megatron's schedules find the chunk's config and
    `set_input_tensor` through `.module`."""

    def __init__(self, chunk):
        super().__init__()
        self.module = chunk

    def adapters_off(self):
        return adapters_disabled([self.module])

    def forward(self, *args, **kwargs):
        with self.adapters_off():
            return self.module(*args, **kwargs)


def reference_policy(chunks) -> List[AdaptersOff]:
    return [AdaptersOff(c) for c in chunks]


# --- diffusers / PEFT LoRA files ------------------------------------------------------------
# `pytorch_lora_weights.safetensors` with PEFT names, what a diffusers pipeline's load_lora_weights
# reads and diffusers' / flow_grpo's training scripts write: `transformer.<diffusers module>.lora_A.weight`
# [r, in] and `.lora_B.weight` [out, r]. No alphas are written, so diffusers takes lora_alpha = r
# (scale 1): the exported B carries our alpha / r. A fused linear gives each of its diffusers modules
# its one A and its rows of B. A file whose parts of a fused linear have different A's (trained on the
# separate linears) loads as one adapter of their summed rank: A = [A_q; A_k; A_v], B block-diagonal;
# parts missing from the file get zero rows of B.
LORA_FILE = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
PREFIX = "transformer."


def _module(weight_name: str) -> str:
    return weight_name[:-len(".weight")]


def to_diffusers(layout: LoRALayout, adapters: Adapters, model_config, config: LoRAConfig) -> Dict[str, torch.Tensor]:
    """Whole adapters (ours, B unscaled) -> the tensors of a diffusers LoRA file."""
    out = {}
    for base in base_rules(layout, model_config, config.targets):
        a, b = adapters[base.hf[0]]
        for name, b_part in zip(base.hf, layout.unmerge(base, b.float() * config.scaling, model_config)):
            out[f"{PREFIX}{_module(name)}.lora_A.weight"] = a.float().clone()  # one file tensor each
            out[f"{PREFIX}{_module(name)}.lora_B.weight"] = b_part.contiguous()
    return out


def file_scale(metadata: dict, path: str) -> float:
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


def read_diffusers_lora(layout: LoRALayout, path: str, model_config, config: LoRAConfig,
                        hf_shapes: Callable[[Any], Mapping[str, Tuple[int, ...]]]) -> Adapters:
    """A diffusers / PEFT LoRA file (or its folder) as whole adapters of `config.targets`, B divided
    by config.scaling so that the model computes what the file means. `hf_shapes(model_config)`: the
    diffusers model's weight shapes by name (a module's [out, in]), asked once the file is read."""
    path = lora_file(path)
    try:
        with safe_open(path, framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            scale = file_scale(f.metadata(), path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read LoRA file {path}: {e}") from None
    others = sorted(k for k in tensors if not k.startswith(PREFIX))
    if others and len(others) < len(tensors):  # a file with the transformer's and other models' adapters
        raise ValueError(f"{path} holds adapters of other models than the transformer (e.g. {others[0]}); "
                         "only transformer LoRAs load")
    tensors = {k[len(PREFIX):] if k.startswith(PREFIX) else k: v.float() for k, v in tensors.items()}
    shapes = hf_shapes(model_config)
    used, out = set(), {}
    for base in base_rules(layout, model_config, config.targets):
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
            out[base.hf[0]] = first, layout.merge(base, [b_parts[p] for p in parts], model_config)
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
        out[base.hf[0]] = a_full, layout.merge(base, blocks, model_config)
    unused = sorted(set(tensors) - used)
    if unused:
        raise ValueError(f"{path}: {len(unused)} tensors are not LoRAs of --lora-target-modules "
                         f"{' '.join(config.targets)} (e.g. {unused[0]})")
    if not out:
        raise ValueError(f"{path} holds no LoRA of --lora-target-modules {' '.join(config.targets)}")
    return out
