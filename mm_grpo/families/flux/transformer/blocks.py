"""FLUX double-stream (MMDiT) and single-stream (parallel attention + MLP) blocks.

Both take and return the joint sequence x = [text ; image] as [S, B, D] with the text
length `n_txt`, so a pipeline stage boundary is always one tensor. Under sequence
parallelism x is this rank's [text piece ; image piece] (`n_txt` its local text rows),
`rope` is cut the same way and `key_mask` marks the padding (mm_grpo/parallel/ulysses.py).
"""
import torch
from torch import nn

from mm_grpo import kernels
from mm_grpo.layers import (
    MLP, QKV, CoreAttention, HeadRMSNorm, Modulation, column_linear, gated_residual, layer_norm, modulate,
    qk_norm_rope, row_linear, row_linear_parts, split_heads, tp_world_size)


def _clip_fp16(x):
    # diffusers clips fp16 activations to the finite range after each block.
    return x.clip(-65504, 65504) if x.dtype == torch.float16 else x


class StreamAttention(QKV):
    """One stream's q/k/v (with QK-norm) and its output projection (row-parallel)."""

    def __init__(self, config, tconfig):
        super().__init__(config, tconfig)
        dim = config.hidden_size
        self.linear_proj = row_linear(dim, dim, tconfig)

    def project(self, o):
        out, _ = self.linear_proj(o)
        return out


class DoubleStreamBlock(nn.Module):
    """Separate weights for text and image tokens, joint attention over [text ; image]."""

    def __init__(self, config, tconfig):
        super().__init__()
        dim, eps = config.hidden_size, config.norm_eps
        self.eps = eps
        self.img_mod = Modulation(dim, 6, tconfig)
        self.txt_mod = Modulation(dim, 6, tconfig)
        self.img_attn = StreamAttention(config, tconfig)
        self.txt_attn = StreamAttention(config, tconfig)
        self.img_mlp = MLP(dim, config.mlp_hidden_size, tconfig)
        self.txt_mlp = MLP(dim, config.mlp_hidden_size, tconfig)
        self.core_attention = CoreAttention()

    def forward(self, x, n_txt, vec, rope, key_mask=None):
        txt, img = x[:n_txt], x[n_txt:]
        img_shift, img_scale, img_gate, img_shift2, img_scale2, img_gate2 = self.img_mod(vec)
        txt_shift, txt_scale, txt_gate, txt_shift2, txt_scale2, txt_gate2 = self.txt_mod(vec)

        qk_i, v_i = self.img_attn(modulate(layer_norm(img, self.eps), img_shift, img_scale),
                                  kernels.rope_rows(rope, slice(n_txt, None)))
        qk_t, v_t = self.txt_attn(modulate(layer_norm(txt, self.eps), txt_shift, txt_scale),
                                  kernels.rope_rows(rope, slice(None, n_txt)))
        qk, v = torch.cat([qk_t, qk_i]), torch.cat([v_t, v_i])
        o = self.core_attention(qk[..., 0, :], qk[..., 1, :], v, key_mask)

        img = gated_residual(img, img_gate, self.img_attn.project(o[n_txt:]))
        img = gated_residual(img, img_gate2, self.img_mlp(modulate(layer_norm(img, self.eps), img_shift2, img_scale2)))
        txt = gated_residual(txt, txt_gate, self.txt_attn.project(o[:n_txt]))
        txt = gated_residual(txt, txt_gate2, self.txt_mlp(modulate(layer_norm(txt, self.eps), txt_shift2, txt_scale2)))
        return torch.cat([_clip_fp16(txt), img])


class SingleStreamBlock(nn.Module):
    """Shared weights for all tokens; attention and MLP run in parallel from one fused input
    projection (BFL's `linear1`) and meet in one row-parallel output projection (`linear2`)."""

    def __init__(self, config, tconfig):
        super().__init__()
        dim, hidden = config.hidden_size, config.mlp_hidden_size
        self.eps = config.norm_eps
        self.head_dim = config.attention_head_dim
        tp = tp_world_size()
        self.split_sizes = (3 * dim // tp, hidden // tp)  # this rank's [qkv | mlp] columns
        self.modulation = Modulation(dim, 3, tconfig)
        self.linear_in = column_linear(dim, 3 * dim + hidden, tconfig)
        self.q_norm = HeadRMSNorm(self.head_dim, self.eps)
        self.k_norm = HeadRMSNorm(self.head_dim, self.eps)
        self.linear_out = row_linear(dim + hidden, dim, tconfig)
        self.core_attention = CoreAttention()

    def forward(self, x, n_txt, vec, rope, key_mask=None):
        shift, scale, gate = self.modulation(vec)
        fused, _ = self.linear_in(modulate(layer_norm(x, self.eps), shift, scale))
        qkv, mlp = fused.split(self.split_sizes, dim=-1)
        qk, v = split_heads(qkv, self.head_dim)
        qk = qk_norm_rope(qk, self.q_norm, self.k_norm, rope)
        o = self.core_attention(qk[..., 0, :], qk[..., 1, :], v, key_mask)
        out = row_linear_parts(self.linear_out, [o, kernels.gelu_tanh(mlp)])
        return _clip_fp16(gated_residual(x, gate, out))
