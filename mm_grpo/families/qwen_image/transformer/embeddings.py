"""Qwen-Image's timestep embedding and rotary tables (diffusers' QwenTimestepProjEmbeddings and
QwenEmbedRope with `scale_rope`)."""
from typing import Sequence, Tuple

import torch
from diffusers.models.embeddings import get_timestep_embedding
from torch import nn

from mm_grpo.layers import dense

TIME_CHANNELS = 256  # the timestep sinusoid's width
TIME_SCALE = 1000  # Timesteps(scale=1000): the pipeline passes t in [0, 1]


class TimestepEmbedding(nn.Module):
    """temb = linear_2(SiLU(linear_1(sinusoid(1000 t)))), one vector per sample. Replicated on every
    TP rank: it acts on one vector per sample."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(TIME_CHANNELS, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, timestep, dtype):
        """temb [B, D] in `dtype` (the model's compute dtype). The sinusoid is made from t in fp32, as
        FLUX's: diffusers scales a bf16 model's t rounded to bf16."""
        emb = get_timestep_embedding(timestep.float(), TIME_CHANNELS, flip_sin_to_cos=True,
                                     downscale_freq_shift=0, scale=TIME_SCALE).to(dtype)
        return dense(self.linear_2, nn.functional.silu(dense(self.linear_1, emb)))


def _angles(positions: torch.Tensor, dim: int, theta: int) -> torch.Tensor:
    """[S, dim / 2] rotation angles of integer positions on one axis, in fp32 as diffusers makes
    them (`QwenEmbedRope.rope_params`: the outer product of the positions and theta^(-2i/dim))."""
    inv_freq = 1.0 / torch.pow(theta, torch.arange(0, dim, 2).to(torch.float32).div(dim))
    return torch.outer(positions, inv_freq)


def image_positions(frames: int, height: int, width: int, frame_offset: int = 0) -> torch.Tensor:
    """[frames * height * width, 3] (frame, row, column) positions of a latent grid in diffusers'
    token order, rows and columns centred (`scale_rope`): -(h - h // 2) .. h // 2 - 1."""
    f = torch.arange(frame_offset, frame_offset + frames)
    h = torch.arange(height) - (height - height // 2)
    w = torch.arange(width) - (width - width // 2)
    return torch.stack(torch.meshgrid(f, h, w, indexing="ij"), dim=-1).reshape(-1, 3)


def rope_tables(img_shapes: Sequence[Tuple[int, int, int]], n_txt: int, axes_dims, theta: int):
    """cos, sin [n_txt + S_img, head_dim] fp32 of the joint sequence [text ; image], repeat-interleaved
    over each channel pair (FLUX's layout, `kernels.rope_table`). `img_shapes`: one sample's
    (frames, height, width) grids in token order, the k-th starting at frame k (diffusers reads the
    first sample's for the batch). Text token j sits at position max(h // 2, w // 2) + j on all axes."""
    img = torch.cat([image_positions(*shape, frame_offset=k) for k, shape in enumerate(img_shapes)])
    start = max(max(h // 2, w // 2) for _, h, w in img_shapes)
    txt = (start + torch.arange(n_txt))[:, None].expand(-1, 3)
    positions = torch.cat([txt, img])
    angles = torch.cat([_angles(positions[:, i], dim, theta) for i, dim in enumerate(axes_dims)], dim=-1)
    return (angles.cos().repeat_interleave(2, dim=-1), angles.sin().repeat_interleave(2, dim=-1))
