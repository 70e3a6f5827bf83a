"""The tensor-parallel building blocks a family's transformer is assembled from: megatron-core's
column- and row-parallel linears (with the hook a LoRA adapter attaches to), adaLN modulation, the
per-head RMSNorm of QK-norm, joint attention (Ulysses SP in `CoreAttention`) and the GELU MLP.

Activations are [S, B, D] (Megatron's layout); heads are [S, B, H, d]. Which linear of a family is
column- or row-parallel is also declared, as data, in its `layout.py`.
"""
import dataclasses
import inspect

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer import TransformerConfig
from torch import nn

from mm_grpo import kernels
from mm_grpo.parallel import ulysses
from mm_grpo.parallel.ulysses import ULYSSES_CP_ALGO


def _tp_group_kwargs() -> dict:
    """How to name the TP group to megatron-core's TP mappings. 0.16 takes it as `group=` and
    warns when it is left out (the warning also breaks a compiled block's graph); 0.12 has no
    such argument and always uses the TP group of parallel_state, which is the same group."""
    if "group" in inspect.signature(copy_to_tensor_model_parallel_region).parameters:
        return {"group": parallel_state.get_tensor_model_parallel_group()}
    return {}


def megatron_config(**fields) -> TransformerConfig:
    """megatron-core's TransformerConfig of a transformer built from these layers at the current
    parallel layout (parallel_state's TP / PP / CP / virtual PP sizes), `fields` its architecture and
    dtypes (num_layers, hidden_size, num_attention_heads, kv_channels, ffn_hidden_size,
    params_dtype, pipeline_dtype, bf16, overrides)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    cp = parallel_state.get_context_parallel_world_size()
    from mm_grpo import get_platform
    kwargs = dict(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        virtual_pipeline_model_parallel_size=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        use_cpu_initialization=get_platform().name == "cpu",
        gradient_accumulation_fusion=False, sequence_parallel=False,
        # With 2 stages the previous and the next stage are the same rank: batched p2p would
        # put both directions on one communicator, where an activation and a gradient sent
        # at once can be matched to each other's receive (seen with virtual stages on gloo).
        # The unbatched path sends the two directions on two different groups.
        batch_p2p_comm=pp != 2)
    if hasattr(TransformerConfig.__init__, "__wrapped__"):
        # MindSpeed's adaptor wraps __init__ and validates every config by its context-parallel
        # algorithm and sequence length, taken from Megatron's or the process's command line where
        # the config does not name them: ring attention by default, and no length at all in a
        # trainer built from an argument list. The joint attention here is Ulysses; its joint sequence
        # changes with the resolution and SequenceShard pads it to a multiple of CP at every
        # forward (the schedules get the real length per call): the length stated is that unit.
        kwargs.update(context_parallel_algo=ULYSSES_CP_ALGO, seq_length=cp)
    kwargs.update(fields)
    return TransformerConfig(**{**_field_defaults(), **kwargs})


def _field_defaults() -> dict:
    """Every TransformerConfig field at its default. Passed in full because MindSpeed's adaptor (on
    Ascend) fills the fields a caller leaves out from the command line's Megatron arguments
    (`TransformerConfig.__init__` patched by MegatronBasicFeature): under MindSpeed-MM's `pretrain`
    that turned on overlap_p2p_comm, the fusions and one query group, none of which FLUX's config
    says. Passing every field keeps the config the family's; MindSpeed's own flags still arrive as the extra
    attributes its patched modules read (docs/adaptor.md)."""
    return {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(TransformerConfig)
            if f.init and (f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)}


def _init_normal(weight):
    return nn.init.normal_(weight, std=0.02)


def _plain_gemm(layer) -> bool:
    """megatron-core's linear is then a plain matmul + bias (one TP rank): `linear` computes it.
    Its own path would also break a compiled block's graph (megatron-core 0.16's RowParallelLinear
    names no TP group to its GEMM, which warns)."""
    return tp_world_size() == 1 and not layer.config.sequence_parallel


def linear(x, weight, bias=None):
    """x W^T + b in the activations' dtype (the model's compute dtype, model.py): the bias goes into
    the GEMM (one pass over the output, no fp32 output to cast back), and a weight held in another
    dtype (a trainable fp32 weight under --bf16) is cast for the call. A frozen base held in bf16
    (`lora.freeze_base_in_bf16`) is used as it is: nothing is cast."""
    dtype = x.dtype
    return F.linear(x, weight.to(dtype), None if bias is None else bias.to(dtype))


def dense(layer: nn.Linear, x):
    """A replicated nn.Linear (embedders, the output projection) in x's dtype, as `linear`."""
    return linear(x, layer.weight, layer.bias)


def _single_rank(layer, x):
    """(output, bias to add later) of `layer` on one TP rank, as megatron-core's forward returns them."""
    bias = None if layer.skip_bias_add else layer.bias
    return linear(x, layer.weight, bias), (layer.bias if layer.skip_bias_add else None)


def _megatron(forward, layer, x):
    """megatron-core's own (tensor-parallel) forward of `layer` on x; its GEMM takes one dtype, so a
    weight held in another one goes through autocast to x's dtype, and the output comes back in it."""
    with torch.autocast(x.device.type, dtype=x.dtype, enabled=x.dtype != layer.weight.dtype):
        out, bias = forward(x)
    return out.to(x.dtype), bias


def _with_adapter(layer, x, out):
    """`out` plus the layer's LoRA adapter's output on its input `x`, when it has one that is on
    (an `adapter` attribute with `enabled` and `add_to`: FLUX's is families/flux/transformer/lora.py)."""
    adapter = layer.__dict__.get("adapter")
    if adapter is None or not adapter.enabled:
        return out
    return adapter.add_to(layer, x, out)


class ColumnLinear(ColumnParallelLinear):
    """megatron-core's ColumnParallelLinear; on one TP rank its GEMM is `linear`."""

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if weight is None and _plain_gemm(self):
            out, bias = _single_rank(self, input_)
        else:
            out, bias = _megatron(lambda x: super(ColumnLinear, self).forward(x, weight, runtime_gather_output),
                                  self, input_)
        return _with_adapter(self, input_, out), bias


class RowLinear(RowParallelLinear):
    """megatron-core's RowParallelLinear; on one TP rank its GEMM is `linear`."""

    def forward(self, input_):
        if _plain_gemm(self):
            out, bias = _single_rank(self, input_)
        else:
            out, bias = _megatron(super().forward, self, input_)
        return _with_adapter(self, input_, out), bias

    def forward_parts(self, parts):
        """`self(torch.cat(parts, -1))` without materialising the concatenation: one GEMM per part
        accumulated into the output (addmm) where `_plain_gemm` allows. The concatenation would read
        and write all its parts once more (5 D wide in a single block); accumulating reads and writes
        the D-wide output once per extra part."""
        if not _plain_gemm(self) or self.skip_bias_add:
            return self(torch.cat(parts, dim=-1))[0]
        dtype = parts[0].dtype
        weights = self.weight.to(dtype).split([p.shape[-1] for p in parts], dim=1)
        lead = parts[0].shape[:-1]
        out = self.bias.to(dtype)
        for part, w in zip(parts, weights):
            out = torch.addmm(out, part.reshape(-1, part.shape[-1]), w.t())
        return _with_adapter(self, parts, out.view(*lead, -1))


def row_linear_parts(layer, parts):
    """`layer(torch.cat(parts, -1))[0]`, through `RowLinear.forward_parts` where the layer is ours;
    a layer another library wrapped (peft's LoRA, which MindSpeed-MM's --lora-target-modules puts
    around linear_out) takes the concatenation."""
    if isinstance(layer, RowLinear):
        return layer.forward_parts(parts)
    return layer(torch.cat(parts, dim=-1))[0]


def column_linear(in_dim, out_dim, tconfig, gather_output=False):
    return ColumnLinear(in_dim, out_dim, config=tconfig, init_method=_init_normal,
                        bias=True, gather_output=gather_output)


def row_linear(in_dim, out_dim, tconfig):
    return RowLinear(in_dim, out_dim, config=tconfig, init_method=_init_normal,
                     bias=True, input_is_parallel=True, skip_bias_add=False)


def modulate(x, shift, scale):
    """x * (1 + scale) + shift with per-sample [B, D] shift/scale over [S, B, D] (one pass)."""
    return torch.addcmul(shift, x, 1 + scale)


def gated_residual(x, gate, y):
    """x + gate * y with a per-sample [B, D] gate over [S, B, D] (one pass)."""
    return torch.addcmul(x, gate, y)


def layer_norm(x, eps):
    return F.layer_norm(x, (x.shape[-1],), eps=eps)


class Modulation(nn.Module):
    """adaLN: `n` modulation vectors from silu(temb), in diffusers' chunk order.

    Column-parallel with the output gathered: every rank needs all vectors, but the
    (n*D, D) weights are a third of FLUX's parameters, so they are not replicated."""

    def __init__(self, dim, n, tconfig):
        super().__init__()
        self.n = n
        self.linear = column_linear(dim, n * dim, tconfig, gather_output=True)

    def forward(self, vec):  # vec: silu(temb) [B, D]
        out, _ = self.linear(vec.unsqueeze(0))  # Megatron linears expect 3-D input
        return out.squeeze(0).chunk(self.n, dim=-1)


class HeadRMSNorm(nn.Module):
    """The weight of a per-head RMSNorm over head_dim (QK-norm), replicated; `qk_norm_rope` applies q's
    and k's together.

    A TP rank sees only its heads, so its weight gradient is partial: the weight goes
    through `copy_to_tensor_model_parallel_region` (identity forward, all-reduce backward
    over the TP group of megatron-core's parallel state) so that every rank ends with the
    full gradient."""

    def __init__(self, head_dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.tp_group_kwargs = _tp_group_kwargs()

    def tp_weight(self):
        return copy_to_tensor_model_parallel_region(self.weight, **self.tp_group_kwargs)


def qk_norm_rope(qk, q_norm: HeadRMSNorm, k_norm: HeadRMSNorm, rope):
    """qk [S, B, H, 2, d] (each head's q and k) normalised by q_norm / k_norm and rotated by `rope`."""
    weight = torch.stack([q_norm.tp_weight(), k_norm.tp_weight()])
    return kernels.qk_norm_rope(qk, weight, q_norm.eps, rope)


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(d)) v over the joint sequence: [S, B, H, d] -> [S, B, H*d].

    Under Ulysses sequence parallelism (context-parallel size > 1) q/k/v hold this rank's
    piece of the sequence with all its (TP-local) heads: one all-to-all trades them for the
    whole sequence with heads / SP, a second one trades the output back (see
    mm_grpo/parallel/ulysses.py). `key_mask` [S] or per sample [B, S] (True = attend) drops the
    padding SP adds and a family's padded text tokens (None: attend to every key)."""

    def __init__(self):
        super().__init__()
        cp = parallel_state.get_context_parallel_world_size()
        self.cp_group = parallel_state.get_context_parallel_group() if cp > 1 else None

    def forward(self, q, k, v, key_mask=None):
        if self.cp_group is not None:  # one all-to-all for q, k and v together
            q, k, v = ulysses.seq_to_heads(torch.stack([q, k, v], dim=2), self.cp_group).unbind(2)
        to_bhsd = lambda t: t.permute(1, 2, 0, 3)  # noqa: E731
        out = kernels.attention(to_bhsd(q), to_bhsd(k), to_bhsd(v), key_mask).permute(2, 0, 1, 3)
        if self.cp_group is not None:
            out = ulysses.heads_to_seq(out, self.cp_group)
        return out.flatten(2)


def split_heads(qkv, head_dim):
    """Megatron's per-head fused layout [q_h, k_h, v_h]: [S, B, H*3*d] -> (qk [S, B, H, 2, d], v [S, B, H, d]),
    both views: each head's q and k stay side by side for `qk_norm_rope`."""
    heads = qkv.unflatten(-1, (-1, 3, head_dim))
    return heads[..., :2, :], heads[..., 2, :]


def fuse_per_head(tensors, heads: int) -> torch.Tensor:
    """Separate projections' weights (or biases) [q ; k ; v], each [H*d, ...], as `QKV`'s fused per-head
    layout [q_h, k_h, v_h for h in heads], so that a contiguous TP chunk holds whole heads."""
    return torch.stack([t.unflatten(0, (heads, -1)) for t in tensors], dim=1).flatten(0, 2)


def split_per_head(fused: torch.Tensor, heads: int, parts: int = 3):
    """The inverse of `fuse_per_head`: (q, k, v), each [H*d, ...]."""
    return tuple(t.flatten(0, 1) for t in fused.unflatten(0, (heads, parts, -1)).unbind(1))


class QKV(nn.Module):
    """Fused, per-head q/k/v projection with QK RMSNorm and RoPE, so a TP shard holds whole heads."""

    def __init__(self, config, tconfig):
        super().__init__()
        d, dim = config.attention_head_dim, config.hidden_size
        self.head_dim = d
        self.linear_qkv = column_linear(dim, 3 * dim, tconfig)
        self.q_norm = HeadRMSNorm(d, config.norm_eps)
        self.k_norm = HeadRMSNorm(d, config.norm_eps)

    def forward(self, x, rope):
        """(qk [S, B, H, 2, d] normalised and rotated, v [S, B, H, d]) of the stream x; rope: its rows'
        `kernels.rope_table`."""
        qkv, _ = self.linear_qkv(x)
        qk, v = split_heads(qkv, self.head_dim)
        return qk_norm_rope(qk, self.q_norm, self.k_norm, rope), v


class MLP(nn.Module):
    """fc1 (column) -> GELU(tanh) -> fc2 (row): one all-reduce per MLP under TP."""

    def __init__(self, dim, hidden, tconfig):
        super().__init__()
        self.linear_fc1 = column_linear(dim, hidden, tconfig)
        self.linear_fc2 = row_linear(hidden, dim, tconfig)

    def forward(self, x):
        h, _ = self.linear_fc1(x)
        out, _ = self.linear_fc2(kernels.gelu_tanh(h))
        return out


def tp_world_size():
    return parallel_state.get_tensor_model_parallel_world_size()
