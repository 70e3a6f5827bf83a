"""Qwen-Image's dual-stream block (diffusers' QwenImageTransformerBlock) on the shared layers.

It takes and returns the joint sequence x = [text ; image] as [S, B, D] with the text length `n_txt`,
so a pipeline stage boundary is one tensor. Under sequence parallelism x is this rank's [text piece ;
image piece] and `rope` is cut the same way; `key_mask` ([B, S] per sample) drops the prompts'
padding and SP's (mm_grpo/parallel/ulysses.py).
"""
import torch
from torch import nn

from mm_grpo import kernels
from mm_grpo.layers import MLP, QKV, CoreAttention, Modulation, gated_residual, layer_norm, modulate, row_linear


class StreamAttention(QKV):
    """One stream's q / k / v with QK RMSNorm and RoPE (column-parallel, by heads) and its output
    projection (row-parallel): the image's to_q / to_k / to_v / to_out.0, the text's add_*_proj /
    to_add_out."""

    def __init__(self, config, tconfig):
        super().__init__(config, tconfig)
        self.linear_proj = row_linear(config.hidden_size, config.hidden_size, tconfig)

    def project(self, o):
        out, _ = self.linear_proj(o)
        return out


class DualStreamBlock(nn.Module):
    """Separate weights for the text and the image tokens, joint attention over [text ; image];
    adaLN-Zero modulation of each stream from silu(temb): (shift, scale, gate) for attention, then
    for the MLP. The model's last block leaves the text tokens as they are after attention
    (`text_out=False`): the head reads the image tokens only, so the text stream's projection and MLP
    there feed nothing (diffusers computes them; their parameters get no gradient there either)."""

    def __init__(self, config, tconfig, text_out=True):
        super().__init__()
        self.text_out = text_out
        dim = config.hidden_size
        self.eps = config.norm_eps
        self.img_mod = Modulation(dim, 6, tconfig)
        self.txt_mod = Modulation(dim, 6, tconfig)
        self.img_attn = StreamAttention(config, tconfig)
        self.txt_attn = StreamAttention(config, tconfig)
        self.img_mlp = MLP(dim, config.mlp_hidden_size, tconfig)
        self.txt_mlp = MLP(dim, config.mlp_hidden_size, tconfig)
        self.core_attention = CoreAttention()

    def stream(self, x, mod, attn_out, mlp):
        """Residual updates of one stream after joint attention: x + gate1 attn, then + gate2 MLP."""
        _, _, gate1, shift2, scale2, gate2 = mod
        x = gated_residual(x, gate1, attn_out)
        return gated_residual(x, gate2, mlp(modulate(layer_norm(x, self.eps), shift2, scale2)))

    def forward(self, x, n_txt, vec, rope, key_mask=None):
        txt, img = x[:n_txt], x[n_txt:]
        img_mod, txt_mod = self.img_mod(vec), self.txt_mod(vec)
        qk_i, v_i = self.img_attn(modulate(layer_norm(img, self.eps), img_mod[0], img_mod[1]),
                                  kernels.rope_rows(rope, slice(n_txt, None)))
        qk_t, v_t = self.txt_attn(modulate(layer_norm(txt, self.eps), txt_mod[0], txt_mod[1]),
                                  kernels.rope_rows(rope, slice(None, n_txt)))
        qk, v = torch.cat([qk_t, qk_i]), torch.cat([v_t, v_i])
        o = self.core_attention(qk[..., 0, :], qk[..., 1, :], v, key_mask)
        img = self.stream(img, img_mod, self.img_attn.project(o[n_txt:]), self.img_mlp)
        if self.text_out:
            txt = self.stream(txt, txt_mod, self.txt_attn.project(o[:n_txt]), self.txt_mlp)
        x = torch.cat([txt, img])
        return x.clip(-65504, 65504) if x.dtype == torch.float16 else x  # as diffusers, for fp16
