"""Parameter and peak activation memory per rank of FLUX at TP / SP / PP 1, 2 and 4.

    torchrun --nproc_per_node 4 bench/bench_parallel_memory.py [--hidden 256 --height 24 ...]

One training step (megatron-core's schedule, 4 micro-batches) per layout, on any device.
Parameter memory: the bytes of this rank's parameters. Activation memory: the bytes of
the tensors autograd keeps for backward (parameters excluded), live at once, at their
peak over the step; it is counted from the saved-tensor hooks, so it is exact and the
same on CPU and accelerators (allocator caching and temporaries are not included).

`--text-layout` instead times, in one process, what an SP rank computes for one double
and one single block (forward + backward) when the text tokens are split along the
sequence like the image tokens vs. kept whole on every rank (heads sliced for attention).
"""
import argparse
import contextlib
import json
import os
import time

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

import mm_grpo  # noqa: F401  (platform first)
from mm_grpo.models.flux import FluxConfig
from mm_grpo.models.flux.config import FLUX_DEV_GUIDANCE
from mm_grpo.parallel import ParallelConfig, destroy_parallel, initialize_parallel
from mm_grpo.parallel.state import init_process_group
from mm_grpo.runtime.chunks import build_model_chunks, forward_backward

LAYOUTS = {
    "single": ParallelConfig(), "TP2": ParallelConfig(tp=2), "TP4": ParallelConfig(tp=4),
    "SP2": ParallelConfig(cp=2), "SP4": ParallelConfig(cp=4),
    "PP2": ParallelConfig(pp=2), "PP4": ParallelConfig(pp=4), "PP2xVPP2": ParallelConfig(pp=2, vpp=2),
    "TP2xSP2": ParallelConfig(tp=2, cp=2), "TP2xPP2": ParallelConfig(tp=2, pp=2),
    "PP2xSP2": ParallelConfig(pp=2, cp=2),
}
MiB = 2 ** 20


class SavedActivationMeter:
    """Peak bytes of the storages autograd saves for backward (parameters excluded)."""

    def __init__(self, params):
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.refs, self.live, self.peak = {}, 0, 0

    def _pack(self, t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.param_ptrs:
            return t
        if key not in self.refs:
            self.refs[key] = [0, storage.nbytes()]
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[key][0] += 1
        return _Saved(t, self, key)

    def _release(self, key):
        self.refs[key][0] -= 1
        if self.refs[key][0] == 0:
            self.live -= self.refs.pop(key)[1]

    @contextlib.contextmanager
    def __call__(self):
        unpack = lambda s: s.tensor if isinstance(s, _Saved) else s  # noqa: E731
        with torch.autograd.graph.saved_tensors_hooks(self._pack, unpack):
            yield self


class _Saved:
    """A saved tensor; when autograd frees it, its bytes stop counting."""

    def __init__(self, tensor, meter, key):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        self.meter._release(self.key)


def bench_config(args) -> FluxConfig:
    d = args.hidden // args.heads
    rope = (d // 8 * 2, d // 16 * 7, d - d // 8 * 2 - d // 16 * 7)  # FLUX's 16/56/56 proportions
    return FluxConfig(num_layers=args.double, num_single_layers=args.single, num_attention_heads=args.heads,
                      attention_head_dim=d, axes_dims_rope=rope)


def micro_batches(config, args, device):
    g = torch.Generator().manual_seed(0)
    img_ids = torch.zeros(args.height, args.width, 3)
    img_ids[..., 1], img_ids[..., 2] = torch.arange(args.height)[:, None], torch.arange(args.width)[None]
    mk = lambda *s: torch.randn(*s, generator=g).to(device)  # noqa: E731
    return [dict(hidden_states=mk(args.mbs, args.height * args.width, config.in_channels),
                 encoder_hidden_states=mk(args.mbs, args.txt_len, config.joint_attention_dim),
                 pooled_projections=mk(args.mbs, config.pooled_projection_dim), timestep=torch.rand(args.mbs).to(device),
                 guidance=torch.full((args.mbs,), FLUX_DEV_GUIDANCE).to(device),
                 img_ids=img_ids.reshape(-1, 3).to(device), txt_ids=torch.zeros(args.txt_len, 3).to(device))
            for _ in range(args.micro_batches)]


def measure(name, parallel, config, args):
    initialize_parallel(parallel)
    device = mm_grpo.get_platform().device
    chunks = [c.to(device) for c in build_model_chunks(config)]
    params = [p for c in chunks for p in c.parameters()]
    meter = SavedActivationMeter(params)
    start = time.time()
    # The single-process figure needs one rank only (the others would repeat it).
    if name != "single" or dist.get_rank() == 0:
        with meter():
            forward_backward(chunks, micro_batches(config, args, device), lambda out, mb: (out.square().mean(), {}))
    row = {"param_bytes": sum(p.numel() * p.element_size() for p in params), "act_peak_bytes": meter.peak,
           "seconds": round(time.time() - start, 2)}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    destroy_parallel()
    return rows if name != "single" else rows[:1]


def memory_table(args):
    init_process_group()
    config = bench_config(args)
    results = {name: measure(name, parallel, config, args) for name, parallel in LAYOUTS.items()
               if parallel.tp * parallel.pp * parallel.cp <= dist.get_world_size()}
    if dist.get_rank() == 0:
        base = results["single"][0]
        print(f"FLUX D={config.hidden_size} heads={config.num_attention_heads} blocks={config.num_layers}+"
              f"{config.num_single_layers}; tokens {args.txt_len} text + {args.height * args.width} image; "
              f"{args.micro_batches} micro-batches of {args.mbs}; fp32")
        print(f"{'layout':10s} {'params MiB (max rank)':>22s} {'ratio':>6s} {'act. peak MiB (max rank)':>25s} "
              f"{'ratio':>6s}  per-rank activation MiB")
        for name, rows in results.items():
            p = max(r["param_bytes"] for r in rows)
            a = max(r["act_peak_bytes"] for r in rows)
            print(f"{name:10s} {p / MiB:22.1f} {p / base['param_bytes']:6.3f} {a / MiB:25.1f} "
                  f"{a / base['act_peak_bytes']:6.3f}  {[round(r['act_peak_bytes'] / MiB, 1) for r in rows]}")
        if args.json:
            with open(args.json + ".tmp", "w") as f:
                json.dump(results, f, indent=1)
            os.replace(args.json + ".tmp", args.json)


# --- text split vs. text replicated (one process, what one SP rank computes) ----------------
class RankAttention(torch.nn.Module):
    """The attention one SP rank runs: the whole sequence (n_seq) with heads / SP. Local rows
    are tiled to the whole length and heads sliced; the all-to-alls themselves are left out."""

    def __init__(self, n_seq, sp):
        super().__init__()
        self.n_seq, self.sp = n_seq, sp

    def forward(self, q, k, v, key_mask=None):
        n, heads = q.shape[0], q.shape[2]
        reps = -(-self.n_seq // n)
        whole = [t.repeat(reps, 1, 1, 1)[:self.n_seq, :, :heads // self.sp].permute(1, 2, 0, 3) for t in (q, k, v)]
        o = torch.nn.functional.scaled_dot_product_attention(*whole).permute(2, 0, 1, 3)
        return o[:n].repeat(1, 1, self.sp, 1).flatten(2)  # back to [n_local, B, H*d] (values irrelevant)


def text_layout_timing(args):
    from mm_grpo.models.flux.blocks import DoubleStreamBlock, SingleStreamBlock
    from mm_grpo.models.flux.embeddings import rope_tables
    from mm_grpo.models.flux.model import transformer_config
    initialize_parallel(ParallelConfig())
    config = bench_config(args)
    tconfig = transformer_config(config)
    blocks = [DoubleStreamBlock(config, tconfig), SingleStreamBlock(config, tconfig)]
    n_txt, n_img = args.txt_len, args.height * args.width
    print(f"one double + one single block, D={config.hidden_size}, {n_txt} text + {n_img} image tokens, "
          f"fwd+bwd, {torch.get_num_threads()} threads")
    for sp in args.sp_sizes:
        for layout, local_txt in (("split", -(-n_txt // sp)), ("replicated", n_txt)):
            local = local_txt + -(-n_img // sp)
            for b in blocks:
                b.core_attention = RankAttention(n_txt + n_img, sp)
            x = torch.randn(local, args.mbs, config.hidden_size, requires_grad=True)
            vec = torch.randn(args.mbs, config.hidden_size)
            rope = rope_tables(torch.zeros(local, 3), config.axes_dims_rope, config.rope_theta)
            times, meter = [], SavedActivationMeter([p for b in blocks for p in b.parameters()])
            flops = FlopCounterMode(display=False)
            for i in range(args.repeats):
                start = time.perf_counter()
                with meter(), (flops if i == 0 else contextlib.nullcontext()):
                    y = x
                    for b in blocks:
                        y = b(y, local_txt, vec, rope)
                    y.square().mean().backward()
                times.append(time.perf_counter() - start)
            # Attention is the same in both layouts (whole sequence, heads / SP): count the rest.
            token_wise = sum(n for op, n in flops.get_flop_counts()["Global"].items()
                             if "scaled_dot_product" not in str(op))
            print(f"SP{sp} text {layout:10s}: {local:5d} tokens per rank, {token_wise / 1e9:6.1f} GFLOP outside "
                  f"attention, activations {meter.peak / MiB:7.1f} MiB, {min(times) * 1e3:8.1f} ms (best of "
                  f"{args.repeats})")
    destroy_parallel()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--double", type=int, default=4)
    p.add_argument("--single", type=int, default=8)
    p.add_argument("--height", type=int, default=24, help="image token grid (packed latents)")
    p.add_argument("--width", type=int, default=24)
    p.add_argument("--txt-len", type=int, default=64)
    p.add_argument("--mbs", type=int, default=1, help="micro-batch size")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--json", help="also write the per-rank numbers here")
    p.add_argument("--text-layout", action="store_true", help="time split vs. replicated text instead")
    p.add_argument("--sp-sizes", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if args.text_layout:
        text_layout_timing(args)
    else:
        memory_table(args)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
