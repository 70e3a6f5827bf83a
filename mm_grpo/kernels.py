"""The one place where attention, RMSNorm and RoPE pick their kernels.

The torch versions reproduce diffusers' FLUX semantics exactly (they are what the
parity tests check). On Ascend, `torch_npu`'s fused kernels replace them when the
platform is NPU; `select_kernels` makes the choice once and can be called again in
tests to check the selection logic without an NPU.
"""
import math
import types

import torch
import torch.nn.functional as F


# --- torch reference implementations ------------------------------------------------
def attention_torch(q, k, v, key_mask=None):
    """Softmax attention, [B, H, S, d] in and out.

    FLUX attends to everything; `key_mask` [S_k] (bool, True = attend) only drops the
    padding that sequence parallelism adds when the token count does not divide."""
    mask = None if key_mask is None else key_mask[None, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def rms_norm_torch(x, weight, eps):
    """diffusers' RMSNorm: statistics in fp32; cast to the weight dtype only if it is half."""
    x = x * torch.rsqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype in (torch.float16, torch.bfloat16):
        x = x.to(weight.dtype)
    return x * weight


def rope_torch(x, cos, sin):
    """Rotate adjacent channel pairs (FLUX / diffusers `use_real_unbind_dim=-1`), in fp32.

    x: [..., S, H, d] with cos/sin broadcastable to it (fp32)."""
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(-2)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


# --- NPU fused kernels (torch_npu) ---------------------------------------------------
def _npu_kernels(torch_npu):
    def attention(q, k, v, key_mask=None):
        heads, head_dim = q.shape[1], q.shape[-1]
        # npu_fusion_attention's mask is the opposite of torch's: True = masked out, [S_q, S_k].
        mask = None if key_mask is None else (~key_mask).expand(q.shape[2], -1).contiguous()
        return torch_npu.npu_fusion_attention(
            q, k, v, heads, input_layout="BNSD", atten_mask=mask,
            scale=1.0 / math.sqrt(head_dim), keep_prob=1.0)[0]

    def rms_norm(x, weight, eps):
        if weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(weight.dtype)
        return torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]

    def rope(x, cos, sin):
        # npu_rotary_mul with rotary_mode="interleave" rotates adjacent pairs, like FLUX.
        out = torch_npu.npu_rotary_mul(x.float(), cos, sin, rotary_mode="interleave")
        return out.to(x.dtype)

    return types.SimpleNamespace(name="npu", attention=attention, rms_norm=rms_norm, rope=rope)


TORCH_KERNELS = types.SimpleNamespace(
    name="torch", attention=attention_torch, rms_norm=rms_norm_torch, rope=rope_torch)

_selected = TORCH_KERNELS


def select_kernels(platform_name: str, torch_npu_module=None, enabled: bool = True):
    """Choose the kernel set for a platform; returns it and makes it current."""
    global _selected
    if enabled and platform_name == "npu" and torch_npu_module is not None:
        _selected = _npu_kernels(torch_npu_module)
    else:
        _selected = TORCH_KERNELS
    return _selected


def attention(q, k, v, key_mask=None):
    return _selected.attention(q, k, v, key_mask)


def rms_norm(x, weight, eps):
    return _selected.rms_norm(x, weight, eps)


def rope(x, cos, sin):
    return _selected.rope(x, cos, sin)
