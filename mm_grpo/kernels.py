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

    FLUX attends to everything; `key_mask` [S_k] (bool, True = attend) only drops the
    padding that sequence parallelism adds when the token count does not divide."""
    mask = None if key_mask is None else key_mask[None, None, None, :]
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
    """cos, sin [S, d] (FLUX's repeat-interleaved tables, fp32) -> complex rotations [S, 1, 1, d/2]."""
    return torch.complex(cos[:, 0::2], sin[:, 0::2])[:, None, None, :]


def rope_torch(x, table):
    """Rotate adjacent channel pairs of x [S, B, H, d] (diffusers `use_real_unbind_dim=-1`), in fp32.

    The pair (x_2j, x_2j+1) is the complex number x_2j + i x_2j+1 and the rotation one
    complex multiply: one pass over x, where the real form takes about ten."""
    x32 = x.to(torch.float32).contiguous()
    rotated = torch.view_as_complex(x32.unflatten(-1, (-1, 2))) * table
    return torch.view_as_real(rotated).flatten(-2).to(x.dtype)


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
    rope=rope_torch)


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
        # npu_fusion_attention's mask is the opposite of torch's: True = masked out, [S_q, S_k].
        mask = None if key_mask is None else (~key_mask).expand(q.shape[2], -1).contiguous()
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

    return types.SimpleNamespace(name="npu", attention=attention, rms_norm=rms_norm, rope_table=rope_table,
                                 rope=rope)


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
