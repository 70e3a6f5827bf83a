"""LoRA on the FLUX transformer's parallel linears, sharded like the linear it adapts.

A linear W of a `--lora-target-modules` name gets W x + (alpha / r) B A x with A [r, in] and
B [out, r] (PEFT's names: `<linear>.lora_A.weight`, `<linear>.lora_B.weight`). Under tensor
parallelism the adapter follows the base linear's split:

    column-parallel W (rows split):  A replicated, B split by rows like W; the r-wide product
                                     A x goes through copy_to_tensor_model_parallel_region, so A's
                                     gradient is summed over the TP group (full on every rank);
    row-parallel W (columns split):  A split by columns like W, the partial products A_k x_k
                                     summed over the TP group (reduce_from_...), B replicated.

Which rows / columns a rank holds (also for the packed single-block linears) comes from the
base weight's layout rule (`layout.py`), so adapters convert, reshard and load like weights.
B starts at zero (the base model's output, bit for bit); A is drawn per weight from
(seed, Stream.LORA_INIT, the weight's diffusers name), the same under every layout.

`TARGETS` maps the --lora-target-modules names to the diffusers modules they adapt (docs/lora.md).
"""
import contextlib
import copy
import dataclasses
import inspect
import zlib
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from torch import nn

from mm_grpo.families.flux.transformer import layout
from mm_grpo.families.flux.transformer.config import FluxConfig
from mm_grpo.seeding import Stream, seeded_generator

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
ADAPTER_KEYS = (".lora_A.", ".lora_B.")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    r: int = 8
    alpha: float = 16.0
    targets: Tuple[str, ...] = RECOMMENDED_TARGETS
    dropout: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(self.targets))
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown:
            raise ValueError(f"unknown --lora-target-modules {unknown}; choose from {sorted(TARGETS)}")
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


# --- which linears, and the layout rules of their adapters ----------------------------------
def target_of(module_path: str) -> Optional[str]:
    """The --lora-target-modules name of a linear of the model, or None."""
    last = module_path.rsplit(".", 1)[-1]
    if last in TARGETS:
        return last
    if module_path.endswith(("_mod.linear", "modulation.linear")):
        return "adaln"
    return None


def adapter_rules(base: layout.Rule) -> Tuple[layout.Rule, layout.Rule]:
    """The layout rules of the A and B of the adapter on the linear whose weight rule is `base`."""
    column = base.shard.startswith("column")
    name = lambda n, m: n[:-len("weight")] + f"lora_{m}.weight"  # noqa: E731
    a = layout.Rule(name(base.megatron, "A"), tuple(name(h, "A") for h in base.hf), base.merge,
                    "replicated" if column else base.shard)
    b = layout.Rule(name(base.megatron, "B"), tuple(name(h, "B") for h in base.hf), base.merge,
                    base.shard if column else "replicated")
    return a, b


def base_rules(config: FluxConfig, targets, block_range=None, pre_process=True,
               post_process=True) -> Iterator[layout.Rule]:
    """The weight rules of the adapted linears of one model chunk."""
    for rule in layout.stage_rules(config, block_range, pre_process, post_process):
        if rule.megatron.endswith(".weight") and target_of(rule.megatron[:-len(".weight")]) in targets:
            yield rule


def stage_adapter_rules(config: FluxConfig, targets, block_range=None, pre_process=True,
                        post_process=True) -> List[layout.Rule]:
    return [r for base in base_rules(config, targets, block_range, pre_process, post_process)
            for r in adapter_rules(base)]


def chunk_adapter_rules(chunk, targets) -> List[layout.Rule]:
    return stage_adapter_rules(chunk.flux_config, targets, chunk.block_range, chunk.pre_process, chunk.post_process)


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


def add_adapters(chunk, config: LoRAConfig, seed: int, ranks: Optional[Dict[str, int]] = None):
    """Adapters on the target linears of one model chunk (A drawn, B zero); every other parameter
    frozen. `ranks`: per base weight's first diffusers name, a rank other than config.r (a loaded
    adapter's)."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    chunk.requires_grad_(False)
    device = next(chunk.parameters()).device
    for base in base_rules(chunk.flux_config, config.targets, chunk.block_range, chunk.pre_process,
                           chunk.post_process):
        layer = chunk.get_submodule(base.megatron[:-len(".weight")])
        if not hasattr(layer, "config"):  # FinalLayer's replicated nn.Linear is not a parallel linear
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
        a = layout.shard(rule_a, a_full, tp_rank, tp_size, chunk.flux_config)
        b = layout.shard(rule_b, torch.zeros(out_full, r), tp_rank, tp_size, chunk.flux_config)
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


def copy_full_adapters(chunk, full: Dict[str, Tuple[torch.Tensor, torch.Tensor]], config: LoRAConfig):
    """This rank's shards of whole adapters {base weight's first diffusers name: (A, B)} into the
    chunk's adapters (a chunk takes those of its own blocks)."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    params = dict(chunk.named_parameters())
    with torch.no_grad():
        for base in base_rules(chunk.flux_config, config.targets, chunk.block_range, chunk.pre_process,
                               chunk.post_process):
            if base.hf[0] not in full:
                continue
            for rule, tensor in zip(adapter_rules(base), full[base.hf[0]]):
                params[rule.megatron].copy_(layout.shard(rule, tensor, tp_rank, tp_size, chunk.flux_config))


def freeze_base_in_bf16(chunk):
    """The frozen base in bf16, the dtype the model computes in under --bf16 (model.py): its matrices
    (half the memory) and biases are then used as they are, with no cast per forward. The QK-norm
    weights (head_dim each) stay fp32: they scale q and k inside an fp32 chain (kernels.qk_norm_rope)."""
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
