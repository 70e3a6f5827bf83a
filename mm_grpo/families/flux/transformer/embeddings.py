"""Conditioning vector and rotary tables of FLUX (diffusers semantics)."""
import torch
from diffusers.models.embeddings import get_1d_rotary_pos_embed, get_timestep_embedding
from torch import nn

from mm_grpo.layers import dense

TIME_CHANNELS = 256  # sinusoid width for timestep and guidance


class MLPEmbedder(nn.Module):
    """linear_1 -> SiLU -> linear_2 (diffusers' TimestepEmbedding / PixArtAlphaTextProjection)."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x):
        return dense(self.linear_2, nn.functional.silu(dense(self.linear_1, x)))


class TimeTextEmbedding(nn.Module):
    """temb = timestep emb + guidance emb (FLUX.1-dev) + pooled-text emb, one vector per sample.

    Replicated on every TP rank: it acts on one vector per sample, so splitting it would
    save little memory and cost a collective."""

    def __init__(self, dim: int, pooled_dim: int, guidance_embeds: bool):
        super().__init__()
        self.timestep_embedder = MLPEmbedder(TIME_CHANNELS, dim)
        self.guidance_embedder = MLPEmbedder(TIME_CHANNELS, dim) if guidance_embeds else None
        self.text_embedder = MLPEmbedder(pooled_dim, dim)

    @staticmethod
    def sinusoid(t, dtype):
        # diffusers' Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0): cos first. Made
        # from t * 1000 in fp32: diffusers scales the bf16 t of a bf16 model, whose rounding moves the
        # timestep by up to 2 of 1000 and the sinusoid's fast channels by whole periods.
        emb = get_timestep_embedding(t.float() * 1000, TIME_CHANNELS, flip_sin_to_cos=True, downscale_freq_shift=0)
        return emb.to(dtype)

    def forward(self, timestep, guidance, pooled, dtype):
        """temb [B, D] in `dtype` (the model's compute dtype)."""
        temb = self.timestep_embedder(self.sinusoid(timestep, dtype))
        if self.guidance_embedder is not None:
            if guidance is None:
                raise ValueError("this FLUX model has a guidance embedding: pass `guidance`")
            temb = temb + self.guidance_embedder(self.sinusoid(guidance, dtype))
        return temb + self.text_embedder(pooled.to(dtype))


def rope_tables(ids: torch.Tensor, axes_dims, theta: int):
    """cos, sin [S, head_dim] in fp32 for positions `ids` [S, n_axes] (frequencies in fp64)."""
    pos = ids.float()
    cos, sin = zip(*[
        get_1d_rotary_pos_embed(dim, pos[:, i], theta=theta, repeat_interleave_real=True,
                                use_real=True, freqs_dtype=torch.float64)
        for i, dim in enumerate(axes_dims)])
    return torch.cat(cos, dim=-1), torch.cat(sin, dim=-1)
