"""Ulysses sequence parallelism for an MMDiT's joint attention (FLUX's, Qwen-Image's), on Megatron's
context-parallel group.

Each SP rank holds a contiguous piece of the text tokens and a contiguous piece of the
image tokens: [text piece r ; image piece r]. Both streams are padded to a multiple of the
SP size first, so every rank has the same layout and length (one pipeline tensor shape),
and the padding is masked out of attention and dropped from the output. Everything but
attention acts token by token, so only attention communicates: an all-to-all trades the
local sequence with all (TP-local) heads for the whole sequence with heads / SP, and a
second all-to-all trades back (DeepSpeed-Ulysses, arXiv:2309.14509). RoPE tables are cut
exactly like the tokens and applied before the first all-to-all.

The gathered sequence is [txt_0 ; img_0 ; txt_1 ; img_1 ; ...]: not FLUX's order, but
attention does not care about the order of keys once RoPE has been applied, and every
query row goes back to the rank it came from.
"""
import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import all_to_all, gather_from_sequence_parallel_region

# The one context-parallel algorithm FLUX's attention implements, by MindSpeed's name for it.
ULYSSES_CP_ALGO = "ulysses_cp_algo"


def _ceil_div(a, b):
    return -(-a // b)


def _pad_and_cut(t, n, piece, size, rank, dim):
    """Rows [rank * piece, (rank + 1) * piece) of `t` (length n along dim) zero-padded to size * piece."""
    pad = piece * size - n
    if pad:
        shape = list(t.shape)
        shape[dim] = pad
        t = torch.cat([t, t.new_zeros(shape)], dim=dim)
    return t.narrow(dim, rank * piece, piece)


@dataclasses.dataclass(frozen=True)
class SequenceShard:
    """This SP rank's part of the joint sequence [text ; image] (n_txt + n_img tokens)."""

    n_txt: int
    n_img: int
    size: int = 1
    rank: int = 0

    @classmethod
    def current(cls, n_txt: int, n_img: int) -> "SequenceShard":
        """The shard of the calling rank in megatron-core's context-parallel group."""
        return cls(n_txt, n_img, parallel_state.get_context_parallel_world_size(),
                   parallel_state.get_context_parallel_rank())

    @property
    def txt_len(self) -> int:
        """Local text rows (the local `n_txt` of the blocks), padding included."""
        return _ceil_div(self.n_txt, self.size)

    @property
    def img_len(self) -> int:
        return _ceil_div(self.n_img, self.size)

    @property
    def local_len(self) -> int:
        return self.txt_len + self.img_len

    @property
    def padded(self) -> bool:
        return self.txt_len * self.size != self.n_txt or self.img_len * self.size != self.n_img

    def txt(self, t, dim=0):
        return _pad_and_cut(t, self.n_txt, self.txt_len, self.size, self.rank, dim)

    def img(self, t, dim=0):
        return _pad_and_cut(t, self.n_img, self.img_len, self.size, self.rank, dim)

    def joint(self, t, dim=0):
        """This rank's rows of a tensor laid out along the whole joint sequence [text ; image]."""
        txt, img = t.split([self.n_txt, self.n_img], dim=dim)
        return torch.cat([self.txt(txt, dim), self.img(img, dim)], dim=dim)

    def key_mask(self, device=None, txt_mask=None) -> Optional[torch.Tensor]:
        """The keys attention reads, True for real tokens, in the order of the gathered sequence:
        [size * local_len] bool, or with `txt_mask` [B, n_txt] (True = a text token to attend to;
        Qwen-Image pads its prompts) [B, size * local_len] per sample. None when no token is padded
        or masked (so attention keeps its unmasked, fastest kernel)."""
        if txt_mask is None and not self.padded:
            return None
        ranks = torch.arange(self.size, device=device)[:, None]
        img = ranks * self.img_len + torch.arange(self.img_len, device=device) < self.n_img
        if txt_mask is None:
            txt = ranks * self.txt_len + torch.arange(self.txt_len, device=device) < self.n_txt
            return torch.cat([txt, img], dim=1).flatten()
        txt = F.pad(txt_mask.bool(), (0, self.size * self.txt_len - self.n_txt)).unflatten(1, (self.size, -1))
        return torch.cat([txt, img.expand(len(txt), -1, -1)], dim=2).flatten(1)

    def gather_img(self, t):
        """[img_len, ...] pieces of all SP ranks -> the whole image sequence [n_img, ...].

        Backward keeps this rank's rows only: the loss on the gathered output is computed
        identically on every SP rank, so each rank back-propagates its own tokens (the
        parameter gradients are then per-rank shares, summed over the group; see docs)."""
        if self.size > 1:
            t = gather_from_sequence_parallel_region(
                t, tensor_parallel_output_grad=False, group=parallel_state.get_context_parallel_group())
        return t[:self.n_img]


def seq_to_heads(x, group):
    """[S_local, B, ..., H, d] -> [SP * S_local, B, ..., H / SP, d]: gather the sequence, scatter heads."""
    size = group.size()
    x = x.unflatten(-2, (size, x.shape[-2] // size)).movedim(-3, 0)  # [SP, S, B, ..., H/SP, d]
    return all_to_all(group, x.contiguous()).flatten(0, 1)  # chunk i came from rank i


def heads_to_seq(x, group):
    """[SP * S_local, B, ..., H / SP, d] -> [S_local, B, ..., H, d]: the inverse of `seq_to_heads`."""
    size = group.size()
    x = all_to_all(group, x.unflatten(0, (size, -1)).contiguous())  # chunk i: head group i
    return x.movedim(0, -3).flatten(-3, -2)
