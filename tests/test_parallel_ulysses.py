"""Ulysses SP pieces in one process: the token split, the padding mask, the all-to-all
layouts (with a simulated all-to-all) and masked attention (the NPU kernels' inverted mask:
tests/test_kernels.py). The multi-process parity checks are in tests/distributed/checks_pp_sp.py."""
import types

import pytest
import torch

from mm_grpo import kernels
from mm_grpo.parallel import ulysses
from mm_grpo.parallel.ulysses import SequenceShard


@pytest.mark.parametrize("n_txt,n_img,size", [(7, 15, 4), (8, 16, 4), (9, 15, 2), (5, 12, 1), (1, 3, 4)])
def test_pieces_cover_the_sequence_and_the_mask_marks_the_padding(n_txt, n_img, size):
    seq = torch.arange(1, n_txt + n_img + 1)  # 0 marks padding below
    pieces = [SequenceShard(n_txt, n_img, size, r).joint(seq) for r in range(size)]
    shard = SequenceShard(n_txt, n_img, size, 0)
    assert {len(p) for p in pieces} == {shard.local_len}
    gathered = torch.cat(pieces)  # the order the all-to-all gathers: [txt_0; img_0; txt_1; ...]
    assert sorted(gathered[gathered > 0].tolist()) == seq.tolist()
    for p in pieces:  # each rank: its text piece, then its image piece
        assert (p[:shard.txt_len][p[:shard.txt_len] > 0] <= n_txt).all()
        assert (p[shard.txt_len:][p[shard.txt_len:] > 0] > n_txt).all()
    mask = shard.key_mask()
    if shard.padded:
        assert torch.equal(mask, gathered > 0)
    else:
        assert mask is None and (gathered > 0).all()


def test_image_pieces_of_a_batch_and_the_gather_drop_padding():
    x = torch.randn(2, 15, 3)  # diffusers' [B, S_img, C]
    pieces = [SequenceShard(4, 15, 4, r).img(x, dim=1) for r in range(4)]
    assert all(p.shape == (2, 4, 3) for p in pieces)
    assert torch.equal(torch.cat(pieces, dim=1)[:, :15], x)
    assert torch.equal(pieces[-1][:, 3:], torch.zeros(2, 1, 3))
    one = SequenceShard(4, 15)
    assert torch.equal(one.gather_img(x.transpose(0, 1)), x.transpose(0, 1))


def _simulated_all_to_all(monkeypatch, size):
    """Run a per-rank function for all `size` ranks with all_to_all simulated between them."""
    group = types.SimpleNamespace(size=lambda: size)

    def run_all(fn, inputs):
        sent = []
        monkeypatch.setattr(ulysses, "all_to_all", lambda g, x: sent.append(x) or x)
        for x in inputs:
            fn(x, group)
        outs = []
        for r, x in enumerate(inputs):  # rank r receives chunk r of what every rank sent
            exchanged = torch.stack([sent[i][r] for i in range(size)])
            monkeypatch.setattr(ulysses, "all_to_all", lambda g, _, e=exchanged: e)
            outs.append(fn(x, group))
        return outs
    return run_all


def test_all_to_all_layouts_gather_the_sequence_and_scatter_heads(monkeypatch):
    size, s_local, batch, heads, d = 4, 3, 2, 8, 5
    full = torch.randn(size * s_local, batch, 3, heads, d)  # [S, B, qkv, H, d]
    local = list(full.chunk(size))
    run_all = _simulated_all_to_all(monkeypatch, size)
    gathered = run_all(ulysses.seq_to_heads, local)
    for r, g in enumerate(gathered):  # whole sequence, head group r
        assert torch.equal(g, full[..., r * heads // size:(r + 1) * heads // size, :])
    back = run_all(ulysses.heads_to_seq, [g[:, :, 0] for g in gathered])
    for r, b in enumerate(back):
        assert torch.equal(b, local[r][:, :, 0])


def test_masked_attention_ignores_padded_keys():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 10, 8, generator=g) for _ in range(3))
    expected = kernels.attention_torch(q, k, v)
    pad = lambda t: torch.cat([t, 1e3 * torch.randn(2, 3, 2, 8, generator=g)], dim=2)  # noqa: E731
    mask = torch.arange(12) < 10
    out = kernels.attention_torch(pad(q), pad(k), pad(v), key_mask=mask)
    assert torch.allclose(out[:, :, :10], expected, atol=1e-6)


@pytest.mark.parametrize("n_txt,n_img,size", [(7, 15, 4), (8, 16, 4), (5, 12, 1)])
def test_a_per_sample_text_mask_follows_the_text_tokens_into_the_gathered_order(n_txt, n_img, size):
    """Qwen-Image's prompts of different lengths in one batch: each sample's key mask keeps its own
    text tokens and every image token, in the all-to-all's order, and drops SP's padding."""
    lengths = torch.tensor([n_txt, 2, 0])  # a full prompt, a short one, an empty one
    txt_mask = torch.arange(n_txt) < lengths[:, None]
    seq = torch.arange(1, n_txt + n_img + 1)
    gathered = torch.cat([SequenceShard(n_txt, n_img, size, r).joint(seq) for r in range(size)])
    mask = SequenceShard(n_txt, n_img, size, 0).key_mask(txt_mask=txt_mask)
    real = gathered > 0
    attended = real & ((gathered > n_txt) | (gathered <= lengths[:, None]))
    assert mask.shape == (3, len(gathered)) and torch.equal(mask, attended)
