"""The one place where attention, RMSNorm, RoPE and GELU pick their kernels.

The torch versions compute diffusers' FLUX semantics (the parity tests check them to
1e-5). On Ascend, `torch_npu`'s fused kernels (`npu_fusion_attention`, `npu_rms_norm`,
`npu_rotary_mul`) replace them. The choice is made on first use from the platform
(`mm_grpo.get_platform()`): NPU kernels when the platform is NPU and torch_npu imports,
torch otherwise; `MM_GRPO_FUSED_KERNELS=0` keeps the torch versions everywhere.
`select_kernels` makes an explicit choice (tests use it to check the selection without an NPU).

RoPE is applied through a table prepared once per forward (`rope_table`), in the form the
selected kernel wants: complex rotations for torch, cos/sin for torch_npu.
"""
import importlib
import math
import os
import types

import torch
import torch.nn.functional as F


# --- torch implementations ------------------------------------------------------------
def attention_torch(q, k, v, key_mask=None):
    """Softmax attention, [B, H, S, d] in and out.

    `key_mask` (bool, True = attend) drops keys: [S_k] for every sample (the padding sequence
    parallelism adds when the token count does not divide), or [B, S_k] per sample (a family's
    padded text tokens, Qwen-Image's). None attends to every key (FLUX)."""
    mask = None if key_mask is None else key_mask.unsqueeze(-2).unsqueeze(-2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def rms_norm_torch(x, weight, eps):
    """diffusers' RMSNorm: statistics in fp32; cast to the weight dtype only if it is half.

    The mean square comes from one norm reduction (instead of pow, then mean): one pass
    over x fewer, the same value to rounding."""
    x32 = x.to(torch.float32)
    mean_square = torch.linalg.vector_norm(x32, dim=-1, keepdim=True).square() / x.shape[-1]
    x = x * torch.rsqrt(mean_square + eps)
    if weight.dtype in (torch.float16, torch.bfloat16):
        x = x.to(weight.dtype)
    return x * weight


def rope_table_torch(cos, sin):
    """cos, sin [S, d] (FLUX's repeat-interleaved tables, fp32) -> the rotations [S, 1, 1, d/2, 2] as
    (cos, sin) pairs: a complex tensor's real view (`torch.view_as_complex` of it is free), kept real so
    that a compiled block takes no complex input."""
    return torch.stack([cos[:, 0::2], sin[:, 0::2]], dim=-1)[:, None, None]


def rope_torch(x, table):
    """Rotate adjacent channel pairs of x [S, B, H, d] (diffusers `use_real_unbind_dim=-1`), in fp32.

    The pair (x_2j, x_2j+1) is the complex number x_2j + i x_2j+1 and the rotation one
    complex multiply: one pass over x, where the real form takes about ten."""
    x32 = x.to(torch.float32).contiguous()
    rotated = torch.view_as_complex(x32.unflatten(-1, (-1, 2))) * torch.view_as_complex(table)
    return torch.view_as_real(rotated).flatten(-2).to(x.dtype)


def _rotate(x, table, inverse=False):
    """x [..., d] (real, contiguous) rotated pair by pair by `table` [..., d/2, 2] (cos, sin), in place."""
    rotation = torch.view_as_complex(table)
    torch.view_as_complex(x.unflatten(-1, (-1, 2))).mul_(rotation.conj() if inverse else rotation)
    return x


class _QKNormRope(torch.autograd.Function):
    """qk_norm_rope_torch in eager: out = r * R(qk * w), with r = rsqrt(mean(qk^2) + eps) per row and R
    the RoPE rotation. Written out, forward and backward, so that the fp32 chain is three passes (the
    weighted upcast, the rotation in place, the scale written straight into qk's dtype) instead of
    autograd's five, and only qk (a view of the projection's output) and r are kept for backward."""

    @staticmethod
    def forward(ctx, qk, weight, eps, table):
        compute = torch.promote_types(qk.dtype, torch.float32)
        mean_square = torch.linalg.vector_norm(qk, dim=-1, keepdim=True, dtype=compute).square() / qk.shape[-1]
        scale = torch.rsqrt(mean_square + eps)
        rotated = _rotate(qk * weight.to(compute), table)
        out = torch.empty(qk.shape, dtype=qk.dtype, device=qk.device)
        torch.mul(rotated, scale, out=out)
        ctx.save_for_backward(qk, weight, scale, table)
        return out

    @staticmethod
    def backward(ctx, grad):
        qk, weight, scale, table = ctx.saved_tensors
        compute = scale.dtype
        back = _rotate(grad.to(compute, memory_format=torch.contiguous_format, copy=True), table, inverse=True)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (back * qk * scale).sum(dim=tuple(range(qk.dim() - 2))).to(weight.dtype)
        back = back * weight.to(compute)  # d out / d (qk / rms), per element
        # RMSNorm's backward: r (g - n mean(g n)), with n = qk r.
        dot = (back * qk).sum(-1, keepdim=True) * scale.square() / qk.shape[-1]
        return ((back - qk * dot) * scale).to(qk.dtype), grad_weight, None, None


def qk_norm_rope_torch(qk, weight, eps, table):
    """q and k of each head, RMS-normalised over head_dim and rotated: qk [S, B, H, 2, d] (q, k), weight
    [2, d] (q's and k's RMSNorm weights), table: `rope_table` of the S rows. Returns qk's dtype.

    diffusers' semantics (statistics and rotation in fp32) in one fp32 chain over q and k together:
    the statistics read the input as it is (no upcast copy), the weight is applied by the upcast, and
    the result is rounded once, at the end. Per element of q and k, with a bf16 input: 22 bytes read
    and written (diffusers' RMSNorm then RoPE: about 86)."""
    table = table.unsqueeze(-3)  # the same rotation for q and k
    if not torch.compiler.is_compiling():
        return _QKNormRope.apply(qk, weight, eps, table)
    # Inductor generates no code for complex ops (and fuses the chain by itself): the same function
    # in real arithmetic, differentiated by autograd.
    mean_square = torch.linalg.vector_norm(qk, dim=-1, keepdim=True, dtype=torch.float32).square() / qk.shape[-1]
    x32 = qk * weight.float() * torch.rsqrt(mean_square + eps)
    cos, sin = table.unbind(-1)
    even, odd = x32.unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return rotated.flatten(-2).to(qk.dtype)


_TWO_SQRT_2_OVER_PI = 2 * math.sqrt(2 / math.pi)


def gelu_tanh(x):
    """FLUX's GELU (tanh approximation). Under torch.compile it is written as the same function
    through the identity 0.5 (1 + tanh z) = sigmoid(2 z): tanh is slow on CPU (5.8 ms for the
    bench preset's 3.5M MLP values against 1.0 ms for sigmoid), and inductor fuses the sigmoid
    form into one loop, 2x faster than its tanh GELU forward + backward; eager keeps torch's
    single GELU kernel, which beats the five ops of the sigmoid form. Both agree to fp32
    rounding (docs/performance.md)."""
    if torch.compiler.is_compiling():
        return x * torch.sigmoid(_TWO_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x))
    return F.gelu(x, approximate="tanh")


TORCH_KERNELS = types.SimpleNamespace(
    name="torch", attention=attention_torch, rms_norm=rms_norm_torch, rope_table=rope_table_torch,
    rope=rope_torch, qk_norm_rope=qk_norm_rope_torch, rope_rows=lambda table, rows: table[rows])


# --- NPU fused kernels (torch_npu) ---------------------------------------------------
# The calls keep to the kernels' documented contracts (docs/adaptor.md, "Fused NPU kernels:
# contracts"), which tests/test_kernels.py checks on CPU against references written from them.
ROTARY_MUL_MAX_BN = 1000  # npu_rotary_mul, rotary_mode="interleave": B * N < 1000


def _npu_kernels(torch_npu):
    def attention(q, k, v, key_mask=None):
        heads, head_dim = q.shape[1], q.shape[-1]
        device = q.device.type
        if torch.is_autocast_enabled(device):
            # The kernel takes q, k, v of one dtype, and autocast may not cast them for it as it
            # does for torch's attention: run it in the autocast dtype, as the torch version runs.
            dtype = torch.get_autocast_dtype(device)
            q, k, v = (t.to(dtype) for t in (q, k, v))
        # npu_fusion_attention's mask is the opposite of torch's: True = masked out, [S_q, S_k] for
        # every sample or [B, 1, S_q, S_k] per sample.
        mask = None
        if key_mask is not None and key_mask.ndim == 1:
            mask = (~key_mask).expand(q.shape[2], -1).contiguous()
        elif key_mask is not None:
            mask = (~key_mask)[:, None, None, :].expand(-1, 1, q.shape[2], -1).contiguous()
        return torch_npu.npu_fusion_attention(
            q, k, v, heads, input_layout="BNSD", atten_mask=mask,
            scale=1.0 / math.sqrt(head_dim), keep_prob=1.0)[0]

    def rms_norm(x, weight, eps):
        # The kernel takes x in the weight's dtype, which is also the dtype diffusers returns.
        return torch_npu.npu_rms_norm(x.to(weight.dtype), weight, epsilon=eps)[0]

    def rope_table(cos, sin):
        return cos[:, None, None, :], sin[:, None, None, :]

    def rope(x, table):
        # rotary_mode="interleave" rotates adjacent pairs, like FLUX. x is [S, B, N, d] (SBND, the
        # table S11D); a batch with B * N past the kernel's limit goes through in slices of samples.
        cos, sin = table
        slices = x.float().split(max(1, (ROTARY_MUL_MAX_BN - 1) // x.shape[2]), dim=1)
        out = [torch_npu.npu_rotary_mul(part, cos, sin, rotary_mode="interleave") for part in slices]
        return (out[0] if len(out) == 1 else torch.cat(out, dim=1)).to(x.dtype)

    def qk_norm_rope(qk, weight, eps, table):
        # npu_rms_norm normalises over all of its weight's dims: q and k go through one at a time.
        return torch.stack([rope(rms_norm(qk[..., i, :], weight[i], eps), table).to(qk.dtype) for i in (0, 1)],
                           dim=-2)

    return types.SimpleNamespace(name="npu", attention=attention, rms_norm=rms_norm, rope_table=rope_table,
                                 rope=rope, qk_norm_rope=qk_norm_rope,
                                 rope_rows=lambda table, rows: tuple(t[rows] for t in table))


_selected = None  # chosen on first use (see `current`)


def select_kernels(platform_name: str, torch_npu_module=None, enabled: bool = True):
    """Choose the kernel set for a platform; returns it and makes it current."""
    global _selected
    if enabled and platform_name == "npu" and torch_npu_module is not None:
        _selected = _npu_kernels(torch_npu_module)
    else:
        _selected = TORCH_KERNELS
    return _selected


def select_for_platform():
    """The choice for this process's platform: fused NPU kernels on NPU unless
    MM_GRPO_FUSED_KERNELS=0, torch kernels everywhere else."""
    from mm_grpo import get_platform
    name = get_platform().name
    enabled = os.environ.get("MM_GRPO_FUSED_KERNELS", "1") != "0"
    torch_npu = importlib.import_module("torch_npu") if name == "npu" and enabled else None
    return select_kernels(name, torch_npu, enabled)


def current():
    return _selected if _selected is not None else select_for_platform()


def attention(q, k, v, key_mask=None):
    return current().attention(q, k, v, key_mask)


def rms_norm(x, weight, eps):
    return current().rms_norm(x, weight, eps)


def rope_table(cos, sin):
    """cos, sin [S, d] fp32 -> the table `rope` takes (prepare once per forward)."""
    return current().rope_table(cos, sin)


def rope(x, table):
    """x [S, B, H, d] rotated by a `rope_table` of the same S."""
    return current().rope(x, table)


def rope_rows(table, rows: slice):
    """The `rope_table` of some of its rows (a stream's part of the joint sequence)."""
    return current().rope_rows(table, rows)


def qk_norm_rope(qk, weight, eps, table):
    """qk [S, B, H, 2, d] (each head's q and k): RMSNorm with weight [2, d], then RoPE by a `rope_table`
    of the same S; in qk's dtype."""
    return current().qk_norm_rope(qk, weight, eps, table)
