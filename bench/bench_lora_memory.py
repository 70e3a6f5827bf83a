"""Per-rank training memory of full fine-tuning vs LoRA, one optimizer step at a bench preset.

    python -m bench.bench_lora_memory [--preset bench] [--lora-r 8] [--threads 2]

One process (any device; fp32 on CPU). For each mode, the model is built as the trainer builds it
(megatron-core DDP with fp32 gradient buffers, the Megatron Adam optimizer), one optimizer step
runs the GRPO trainer's micro-batch shape (the preset's micro-batch, its text and image tokens)
and the bytes of what the step holds are counted: parameters, gradient buffers, optimizer state
(Adam's two moments, plus fp32 master copies where the optimizer keeps them) and the peak of the
activations autograd saves for backward (bench_parallel_memory.SavedActivationMeter). Counting
tensors gives the same figures on every machine (allocator caching excluded).
"""
import argparse

import torch

import mm_grpo  # noqa: F401  (platform first)
from bench.bench_parallel_memory import MiB, SavedActivationMeter
from bench.grpo_setup import PRESETS, optimizer_args
from mm_grpo.families.flux.chunks import build_model_chunks, forward_backward
from mm_grpo.families.flux.transformer import FluxConfig, lora
from mm_grpo.families.flux.transformer.config import FLUX_DEV_GUIDANCE
from mm_grpo.families.flux.transformer.latents import num_image_tokens, token_grid
from mm_grpo.parallel import ParallelConfig, destroy_parallel, initialize_parallel
from mm_grpo.training.trainable import attach_lora, optimize

TARGETS = lora.RECOMMENDED_TARGETS


def micro_batch(config: FluxConfig, preset, device):
    g = torch.Generator().manual_seed(0)
    h, w = token_grid(preset.height, preset.width)
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1], img_ids[..., 2] = torch.arange(h)[:, None], torch.arange(w)[None]
    mbs, txt = preset.micro_batch_size, preset.text_tokens
    mk = lambda *s: torch.randn(*s, generator=g).to(device)  # noqa: E731
    return dict(hidden_states=mk(mbs, h * w, config.in_channels),
                encoder_hidden_states=mk(mbs, txt, config.joint_attention_dim),
                pooled_projections=mk(mbs, config.pooled_projection_dim), timestep=torch.rand(mbs).to(device),
                guidance=torch.full((mbs,), FLUX_DEV_GUIDANCE).to(device), img_ids=img_ids.reshape(-1, 3).to(device),
                txt_ids=torch.zeros(txt, 3).to(device))


def _bytes(tensors):
    seen, total = set(), 0
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def measure(config: FluxConfig, preset, lora_config=None) -> dict:
    initialize_parallel(ParallelConfig())
    device = mm_grpo.get_platform().device
    chunks = [c.to(device) for c in build_model_chunks(config)]
    if lora_config is not None:
        attach_lora(chunks, lora_config, seed=0, bf16=config.bf16)
    ddp, optimizer, _ = optimize(chunks, optimizer_args(lr=1e-5))
    params = [p for c in chunks for p in c.parameters()]
    meter = SavedActivationMeter(params)
    for c in ddp:
        c.zero_grad_buffer()
    with meter():
        forward_backward(ddp, [micro_batch(config, preset, device)], lambda out, mb: (out.square().mean(), {}))
    optimizer.step()
    state = [t for s in optimizer.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    masters = [p for g in optimizer.optimizer.param_groups for p in g["params"]]
    master_bytes = _bytes([p for p in masters if all(p.untyped_storage().data_ptr() != q.untyped_storage().data_ptr()
                                                     for q in params)])
    grads = [b.grad_data for c in ddp for b in c.buffers]
    row = {"params": sum(p.numel() for p in params), "trainable": sum(p.numel() for p in params if p.requires_grad),
           "weights": _bytes(params), "gradients": _bytes(grads),
           "optimizer": _bytes(state) + master_bytes, "activations": meter.peak}
    row["total"] = row["weights"] + row["gradients"] + row["optimizer"] + row["activations"]
    destroy_parallel()
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="bench", choices=[k for k, v in PRESETS.items() if v.transformer])
    p.add_argument("--lora-r", type=int, default=lora.LoRAConfig.r)
    p.add_argument("--lora-alpha", type=float, default=lora.LoRAConfig.alpha)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    preset = PRESETS[args.preset]
    from mm_grpo.families.flux.tiny import TRANSFORMER_CONFIG
    config = FluxConfig.from_diffusers_config(dict(TRANSFORMER_CONFIG, **preset.transformer))  # as grpo_setup builds it
    rows = {"full": measure(config, preset),
            f"LoRA r={args.lora_r}": measure(config, preset, lora.LoRAConfig(args.lora_r, args.lora_alpha, TARGETS))}
    print(f"preset {args.preset}: FLUX D={config.hidden_size}, {config.num_layers}+{config.num_single_layers} blocks, "
          f"micro-batch {preset.micro_batch_size} x ({preset.text_tokens} text + "
          f"{num_image_tokens(preset.height, preset.width)} image tokens), fp32; LoRA on {' '.join(TARGETS)}")
    cols = ("weights", "gradients", "optimizer", "activations", "total")
    print(f"{'mode':12s} {'trainable':>12s} " + " ".join(f"{c + ' MiB':>16s}" for c in cols))
    for name, r in rows.items():
        print(f"{name:12s} {r['trainable']:12,d} " + " ".join(f"{r[c] / MiB:16.2f}" for c in cols))
    full, low = rows["full"], rows[f"LoRA r={args.lora_r}"]
    print(f"peak per-rank memory LoRA / full: {low['total'] / full['total']:.3f}; without activations: "
          f"{(low['total'] - low['activations']) / (full['total'] - full['activations']):.3f}")


if __name__ == "__main__":
    main()
