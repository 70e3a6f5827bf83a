"""The model-level optimisations one by one: each op as written before and as mm-grpo writes it now.

    python -m bench.bench_ops [--threads 2 --batch 12 --repeats 5]

Shapes of the `bench` preset (D = 256, 2 heads of 128, 32 + 256 tokens, batch 12 = one
GRPO group per micro-batch). Each pair runs forward + backward, interleaved, best of
`--repeats`; the speed-up is old / new. See docs/performance.md.
"""
import argparse
import time

import torch
import torch.nn.functional as F

from mm_grpo import kernels
from mm_grpo.families.flux.transformer.embeddings import rope_tables
from mm_grpo.families.flux.transformer.latents import prepare_latent_image_ids

D, HEADS, N_TXT, GRID = 256, 2, 32, (16, 16)


def _rope_old(x, cos, sin):
    """The real-valued rotation (diffusers' apply_rotary_emb), mm-grpo's RoPE before."""
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(-2)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


def _rms_old(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps) * weight


_compiled_gelu_tanh = torch.compile(lambda x: F.gelu(x, approximate="tanh"))  # inductor's own lowering
_compiled_gelu = torch.compile(kernels.gelu_tanh)  # mm-grpo's (the sigmoid form when compiled)


def cases(batch):
    s = N_TXT + GRID[0] * GRID[1]
    rows = s * batch
    d_head = D // HEADS
    ids = torch.cat([torch.zeros(N_TXT, 3), prepare_latent_image_ids(*GRID)])
    cos, sin = rope_tables(ids, (16, 56, 56), 10000)
    table = kernels.rope_table_torch(cos, sin)
    c4, s4 = cos[:, None, None, :], sin[:, None, None, :]
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    x, w = rand(rows, D), rand(3 * D, D)
    x3, vec = rand(s, batch, D), rand(batch, D)
    qkv = rand(s, batch, HEADS, 3 * d_head)
    w_out, o, mlp = rand(D, 5 * D), rand(s, batch, D), rand(s, batch, 4 * D)
    wq, wk, wv, w_fused = rand(D, D), rand(D, D), rand(D, D), rand(3 * D, D)
    b, b_out, b3 = rand(3 * D), rand(D), rand(3 * D)
    h = rand(s, batch, 4 * D)  # the single block's MLP activation
    norm_w = rand(d_head)
    return {
        "bias in the GEMM (qkv, D -> 3D)": (
            lambda: torch.matmul(x, w.t()) + b, lambda: F.linear(x, w, b), [x, w, b]),
        "RoPE: complex multiply vs real form": (
            lambda: _rope_old(qkv[..., :d_head], c4, s4), lambda: kernels.rope_torch(qkv[..., :d_head], table), [qkv]),
        "RoPE tables: cached vs rebuilt per forward": (
            lambda: rope_tables(ids, (16, 56, 56), 10000), lambda: table, []),
        "QK RMSNorm: one norm reduction vs pow+mean": (
            lambda: _rms_old(qkv[..., :d_head], norm_w), lambda: kernels.rms_norm_torch(qkv[..., :d_head], norm_w, 1e-6),
            [qkv, norm_w]),
        "modulate: addcmul vs mul + add": (
            lambda: x3 * (1 + vec) + vec, lambda: torch.addcmul(vec, x3, 1 + vec), [x3, vec]),
        "single-block out proj: 2 GEMMs vs concat + GEMM": (
            lambda: torch.matmul(torch.cat([o, mlp], -1), w_out.t()) + b_out,
            lambda: torch.addmm(torch.addmm(b_out, o.reshape(-1, D), w_out[:, :D].t()), mlp.reshape(-1, 4 * D),
                                w_out[:, D:].t()).view(s, batch, D), [o, mlp, w_out, b_out]),
        "GELU under torch.compile: tanh vs sigmoid form": (
            lambda: _compiled_gelu_tanh(h), lambda: _compiled_gelu(h), [h]),
        "fused qkv GEMM vs three (reference model)": (
            lambda: torch.cat([F.linear(x, wq, b3[:D]), F.linear(x, wk, b3[D:2 * D]), F.linear(x, wv, b3[2 * D:])], -1),
            lambda: F.linear(x, w_fused, b3), [x, wq, wk, wv, w_fused, b3]),
    }


def timed(fn, inputs, repeats):
    """Best seconds of fn() forward + backward (forward only when nothing needs a gradient)."""
    for t in inputs:
        t.requires_grad_(True)
    best = float("inf")
    for _ in range(repeats + 1):  # the first call warms up
        start = time.perf_counter()
        out = fn()
        if inputs:
            out.float().sum().backward()
        best = min(best, time.perf_counter() - start)
    for t in inputs:
        t.grad = None
    return best


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{'op (forward + backward)':52}{'old ms':>9}{'new ms':>9}{'speed-up':>10}")
    for name, (old, new, inputs) in cases(args.batch).items():
        t_old = t_new = float("inf")
        for _ in range(args.repeats):  # interleaved, so that load changes hit both alike
            t_old, t_new = min(t_old, timed(old, inputs, 1)), min(t_new, timed(new, inputs, 1))
        speedup = f"{t_old / t_new:9.2f}x" if t_new > 1e-5 else f"{'(saved)':>10}"
        print(f"{name:52}{t_old * 1e3:9.2f}{t_new * 1e3:9.2f}{speedup}")


if __name__ == "__main__":
    main()
