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

`--block-bytes` counts, for one double and one single block (full fine-tuning and LoRA, bf16 and
fp32), what `mm-grpo plan`'s activation terms predict (mm_grpo/plan/formulas.py): the bytes autograd
saves per token (`SavedActivationMeter`, the slope between two sequence lengths) and per weight
(the intercept: bf16 copies of trainable fp32 weights), the working set of a recomputed block's
backward and the live set of a no-grad forward (`BlockLiveMeter`), each beside the formula.
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
from mm_grpo.families.flux.chunks import build_model_chunks, forward_backward
from mm_grpo.families.flux.transformer import FluxConfig
from mm_grpo.families.flux.transformer.config import FLUX_DEV_GUIDANCE
from mm_grpo.parallel import ParallelConfig, destroy_parallel, initialize_parallel
from mm_grpo.parallel.state import init_process_group

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


class BlockLiveMeter:
    """bench/plan_validate.py's LiveTensorMeter (the bytes of the tensor storages allocated while
    active and still alive, their peak) that leaves out the storages of `existing` tensors (a
    block's input, the RoPE table, the parameters): an op that returns a view of one of them (a
    slice of the input, a transposed weight) allocates nothing."""

    def __new__(cls, existing):
        from bench.plan_validate import LiveTensorMeter
        meter = LiveTensorMeter()
        for t in existing:
            meter._seen[id(t.untyped_storage())] = None  # never counted, never freed while measured
        return meter


def block_bytes(kind: str, lora_rank: int = 0, bf16: bool = True, hidden: int = 256, heads: int = 4,
                txt_len: int = 64, image_tokens=(512, 1024)) -> dict:
    """What one FLUX block (`kind`: double or single) holds, per token and hidden unit (bytes / D) and
    per weight, measured at two sequence lengths (`txt_len` + each of `image_tokens`, one sample) as
    the trainer builds it: --bf16 or fp32 compute, full fine-tuning (fp32 parameters; silu(temb)
    needs a gradient) or LoRA of `lora_rank` on the recommended targets (base frozen, in bf16 under
    --bf16). Needs megatron-core's parallel state (one rank).
      saved_per_token, saved_intercept: the storages autograd saves in the block's forward (the
        parameters and the RoPE table left out), slope and intercept;
      working_per_token: the peak of the recomputed block's forward + backward (torch.utils.checkpoint,
        as `run_blocks`) less the recomputed saved bytes (less the input) and the block's output;
      no_grad_per_token: the peak of a no-grad forward, the block's input added."""
    from torch.utils.checkpoint import checkpoint

    from mm_grpo import kernels
    from mm_grpo.families.flux.transformer import FluxTransformer, lora
    d = hidden // heads
    rope_axes = (d // 8 * 2, d // 16 * 7, d - d // 8 * 2 - d // 16 * 7)  # FLUX's 16/56/56 proportions
    config = FluxConfig.preset("tiny").replace(num_attention_heads=heads, attention_head_dim=d,
                                               axes_dims_rope=rope_axes, bf16=bf16, num_layers=1, num_single_layers=1)
    torch.manual_seed(0)
    model = FluxTransformer(config)
    if lora_rank:
        lora.add_adapters(model, lora.LoRAConfig(r=lora_rank, alpha=lora_rank), seed=0)
        if bf16:
            lora.freeze_base_in_bf16(model)
    block = (model.double_blocks if kind == "double" else model.single_blocks)[0]
    dtype = torch.bfloat16 if bf16 else torch.float32
    params = list(model.parameters())
    rows = []
    for n_img in image_tokens:
        g = torch.Generator().manual_seed(0)
        rope = kernels.rope_table(*model.rope(torch.zeros(txt_len, 3), torch.rand(n_img, 3, generator=g)))
        x = torch.randn(txt_len + n_img, 1, hidden, generator=g).to(dtype).requires_grad_(True)
        vec = torch.randn(1, hidden, generator=g).to(dtype).requires_grad_(not lora_rank)
        saved = SavedActivationMeter(params + [rope])
        with saved():
            block(x, txt_len, vec, rope)
        live = BlockLiveMeter(params + [rope, x, vec])
        with live:
            y = checkpoint(block, x, txt_len, vec, rope, None, use_reentrant=False)
            y.backward(torch.ones_like(y))
        no_grad = BlockLiveMeter(params + [rope, x, vec])
        with torch.no_grad(), no_grad:
            block(x, txt_len, vec, rope)
        out_bytes = x.numel() * x.element_size()
        rows.append((txt_len + n_img, saved.peak, live.peak - (saved.peak - out_bytes) - out_bytes,
                     no_grad.peak + out_bytes))
    (n1, s1, w1, f1), (n2, s2, w2, f2) = rows
    slope = lambda a, b: (b - a) / (n2 - n1) / hidden  # noqa: E731
    per_token = slope(s1, s2)
    return dict(saved_per_token=per_token, saved_intercept=s1 - per_token * hidden * n1,
                working_per_token=slope(w1, w2), no_grad_per_token=slope(f1, f2),
                block_trainable=sum(p.numel() for p in block.parameters() if p.requires_grad),
                block_trainable_matrices=sum(p.numel() for p in block.parameters() if p.requires_grad and p.dim() >= 2),
                config=config)


def block_bytes_table(args):
    """`block_bytes` of both kinds, full and LoRA, bf16 and fp32, beside mm-grpo plan's formulas (their
    per-token slope over the same two sequence lengths)."""
    initialize_parallel(ParallelConfig())
    print(f"one FLUX block, D={args.hidden}, {args.heads} heads, {args.txt_len} text + 512 / 1024 image tokens; "
          f"bytes per token per hidden unit (bytes / D), measured | formula")
    for bf16 in (True, False):
        for rank in (0, args.lora_r):
            for i, kind in enumerate(("double", "single")):
                m = block_bytes(kind, rank, bf16, args.hidden, args.heads, args.txt_len)
                formula = formula_block_bytes(m["config"], i, rank, bf16, args.txt_len, m["block_trainable"])
                print(f"{'bf16' if bf16 else 'fp32'} {'LoRA r=%d' % rank if rank else 'full':9s} {kind:6s}: saved "
                      f"{m['saved_per_token']:6.2f} | {formula['saved_per_token']:6.2f}; weight copies "
                      f"{m['saved_intercept'] / 2**20:6.3f} | {formula['weight_copies'] / 2**20:6.3f} MiB; backward "
                      f"working set {m['working_per_token']:6.2f} | {formula['working_per_token']:6.2f}; no-grad "
                      f"forward {m['no_grad_per_token']:6.2f} | {formula['no_grad_per_token']:6.2f}"
                      f"{' (the double block)' if i else ''}")
    destroy_parallel()


def formula_block_bytes(config: FluxConfig, index: int, lora_rank: int, bf16: bool, txt_len: int,
                        block_trainable: int) -> dict:
    """mm-grpo plan's figures for what `block_bytes` measures: the block's saved bytes per token
    (`index` 0: double, 1: single), its weight copies, its backward working set per token, and the
    per-token slope of the no-grad forward's working set (a double block's: the planner counts the
    larger) between the same two jobs (one sample, 512 and 1024 image tokens)."""
    from mm_grpo.families.flux import plan as f
    from mm_grpo.plan.formulas import Layout
    jobs = [f.Job(bf16=bf16, lora_rank=lora_rank, micro_batch_size=1, text_tokens=txt_len, height=h, width=512)
            for h in (256, 512)]  # 512 and 1024 image tokens
    layout, D, c = Layout(), config.hidden_size, f.activation_bytes(jobs[0])
    slope = lambda fn: (fn(jobs[1]) - fn(jobs[0])) / 512 / D  # noqa: E731
    return dict(saved_per_token=f.block_activation_bytes(config, 1, lora_rank, c)[index] / D,
                weight_copies=f.weight_cast_bytes(jobs[0], block_trainable),
                working_per_token=f.BACKWARD_WORKING_BYTES_PER_TOKEN[c, bool(lora_rank)][index],
                no_grad_per_token=slope(lambda j: f.rollout_forward_working_bytes(config, j, layout)))


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
    from mm_grpo.families.flux.transformer.blocks import DoubleStreamBlock, SingleStreamBlock
    from mm_grpo.families.flux.transformer.embeddings import rope_tables
    from mm_grpo.families.flux.transformer.model import transformer_config
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
    p.add_argument("--block-bytes", action="store_true",
                   help="one block's saved bytes, working sets and weight copies against mm-grpo plan's formulas")
    p.add_argument("--lora-r", type=int, default=8, help="--block-bytes: the LoRA rank")
    args = p.parse_args()
    if args.block_bytes:
        block_bytes_table(args)
    elif args.text_layout:
        text_layout_timing(args)
    else:
        memory_table(args)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
