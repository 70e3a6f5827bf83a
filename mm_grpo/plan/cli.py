"""`mm-grpo plan`: which TP x PP x SP x DP layouts of N devices fit a GRPO run of FLUX, and how fast.

    mm-grpo plan --model flux-dev --devices 8 --device-memory 64 --height 1024 --width 1024
    python -m mm_grpo.plan --model flux-dev --devices 16 --lora-rank 64 --json

Every layout whose TP x SP divides the heads and PP the blocks is listed, ranked: the ones that
fit by predicted seconds per iteration, then the others by memory, each with why it does not
fit. Formulas and their sources: mm_grpo/plan/formulas.py; validation: docs/scaling.md.
"""
import argparse
import json
import sys

from mm_grpo.encoders.latents import token_grid
from mm_grpo.plan import frozen_parts
from mm_grpo.plan import devices as devices_mod
from mm_grpo.plan import formulas as f
from mm_grpo.settings import add_setting_args, from_args

GB = 10 ** 9


def build_parser():
    p = argparse.ArgumentParser(prog="mm-grpo plan", description=__doc__.splitlines()[0], allow_abbrev=False)
    g = p.add_argument_group("model and job")
    g.add_argument("--model", default="flux-dev",
                   help="flux-dev, flux-schnell, tiny, or a diffusers transformer config.json / folder")
    add_setting_args(g, f.Job)
    g.add_argument("--prompts-per-iteration", type=int, default=None,
                   help="prompts per iteration over all ranks (default: one per data-parallel rank)")
    g.add_argument("--reward", default="hps", choices=sorted(frozen_parts.REWARD_PARAMS))
    g = p.add_argument_group("devices")
    g.add_argument("--devices", type=int, required=True, help="number of devices")
    g.add_argument("--device-memory", type=float, default=None, help="GB per device (default: the profile's)")
    g.add_argument("--device", default="atlas-800t-a2", choices=sorted(devices_mod.DEVICES),
                   help="profile: peak bf16 FLOP/s, HBM, interconnect (mm_grpo/plan/devices.py)")
    g.add_argument("--mfu", type=float, default=0.4, help="assumed fraction of peak FLOP/s reached")
    g.add_argument("--tp", type=int, default=None, help="only layouts with this TP")
    g.add_argument("--pp", type=int, default=None, help="only layouts with this PP")
    g.add_argument("--sp", type=int, default=None, help="only layouts with this SP (Ulysses)")
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="a JSON list of objects instead of the table")
    g.add_argument("--top", type=int, default=None, help="print the first N rows only")
    return p


def job_of(args) -> f.Job:
    if args.devices < 1:
        raise ValueError(f"--devices must be >= 1, got {args.devices}")
    if not 0 < args.timestep_fraction <= 1:
        raise ValueError(f"--timestep-fraction must be in (0, 1], got {args.timestep_fraction}")
    if not 0 < args.mfu <= 1:
        raise ValueError(f"--mfu must be in (0, 1], got {args.mfu}")
    job = from_args(f.Job, args, prompts_per_iteration=args.prompts_per_iteration or 1)
    token_grid(job.height, job.width)  # one line naming the size unless FLUX's latent layout divides it
    return job


def candidate_layouts(config, args):
    for name, value in (("tp", args.tp), ("pp", args.pp), ("sp", args.sp)):
        if value is not None and (value < 1 or args.devices % value):
            raise ValueError(f"--{name} {value} does not divide --devices {args.devices}")
    if args.tp and args.sp and args.devices % (args.tp * args.sp):
        raise ValueError(f"--tp {args.tp} x --sp {args.sp} does not divide --devices {args.devices}")
    if (args.tp or 1) * (args.sp or 1) > 1 and config.num_attention_heads % ((args.tp or 1) * (args.sp or 1)):
        raise ValueError(f"{config.num_attention_heads} heads do not split over TP x SP = "
                         f"{(args.tp or 1) * (args.sp or 1)}")
    if args.pp and args.pp > config.num_blocks:
        raise ValueError(f"--pp {args.pp} is more stages than the model's {config.num_blocks} blocks")
    out = [lay for lay in f.layouts(config, args.devices)
           if (args.tp is None or lay.tp == args.tp) and (args.pp is None or lay.pp == args.pp)
           and (args.sp is None or lay.sp == args.sp)]
    if not out:
        raise ValueError(f"no TP x PP x SP x DP layout of {args.devices} devices divides the model's "
                         f"{config.num_attention_heads} heads and {config.num_blocks} blocks")
    return out


def plan(args):
    """Rows (dicts) for every candidate layout, ranked."""
    config = f.model_of(args.model)
    job = job_of(args)
    device = devices_mod.device(args.device, args.device_memory)
    comps = frozen_parts.flux_components(args.reward, args.text_cache)
    rows = []
    for lay in candidate_layouts(config, args):
        if args.prompts_per_iteration is None:  # one group per data-parallel rank
            job_l = f.Job(**{**job.__dict__, "prompts_per_iteration": lay.dp})
        else:
            job_l = job
        reason = f.check_layout(config, job_l, lay)
        row = dict(tp=lay.tp, pp=lay.pp, sp=lay.sp, dp=lay.dp, fits=False, reason=reason,
                   peak_bytes_per_rank=None, seconds_per_iteration=None, batch=job_l.batch)
        counts = f.stage_blocks(config.num_blocks, lay.pp)
        if len(set(counts)) > 1:  # the trainer needs the split as predictor.pipeline_num_layers
            row["pipeline_num_layers"] = counts
        if reason is None:
            mem = f.rank_memory(config, comps, job_l, lay)
            worst = mem.worst
            t = f.iteration_time(config, comps, job_l, lay, device, args.mfu)
            row.update(peak_bytes_per_rank=int(worst.peak_bytes), peak_phase=worst.peak_phase,
                       terms_bytes={k: int(v) for k, v in worst.terms.items()},
                       seconds_per_iteration=t.seconds, seconds_per_image=t.seconds / job_l.batch,
                       seconds={k: v for k, v in t.parts.items()})
            row["fits"] = worst.peak_bytes <= device.memory_bytes
            if not row["fits"]:
                big = sorted(((v, k) for k, v in worst.terms.items() if k != "activations_per_microbatch"),
                             reverse=True)[:3]
                row["reason"] = (f"{worst.peak_bytes / GB:.1f} GB > {device.memory_bytes / GB:.0f} GB in "
                                 f"{worst.peak_phase}; largest: " + ", ".join(f"{k} {v / GB:.1f}" for v, k in big))
        rows.append(row)
    # Fitting layouts by time per image (layouts of more DP ranks run more prompts per iteration
    # unless --prompts-per-iteration fixes it), then the others by memory.
    rows.sort(key=lambda r: (not r["fits"], r["seconds_per_image"] if r["fits"] else
                             (r["peak_bytes_per_rank"] or float("inf"))))
    return config, job, device, rows


def print_table(config, job, device, rows, args, out=None):
    out = out or sys.stdout
    full = f"LoRA rank {job.lora_rank}" if job.lora_rank else "full"
    print(f"FLUX {f.total_params(config) / 1e9:.2f}B ({args.model}), {full}, {job.height}x{job.width} "
          f"({job.image_tokens} image + {job.text_tokens} text tokens), G={job.num_generations}, N="
          f"{job.num_inference_steps}, K={job.trained_steps} trained steps, micro-batch {job.micro_batch_size}, "
          f"recompute {'on' if job.recompute else 'off'}, distributed optimizer "
          f"{'on' if job.distributed_optimizer else 'off'}, {'bf16' if job.bf16 else 'fp32'} compute, "
          f"{job.param_dtype} parameters; {args.devices} x {device.name} of {device.memory_bytes / GB:.0f} GB, "
          f"MFU {args.mfu}", file=out)
    head = (f"{'#':>3} {'TP':>3} {'PP':>3} {'SP':>3} {'DP':>3} {'batch':>5} {'fits':>4} {'peak GB':>8} "
            f"{'weights':>7} {'grads':>6} {'optim':>6} {'act':>6} {'decode':>6} {'s/iter':>8} {'s/image':>7} {'rollout':>8} "
            f"{'train':>8} {'comm':>7}  note")
    print(head, file=out)
    for i, r in enumerate(rows[:args.top] if args.top else rows, 1):
        if r["peak_bytes_per_rank"] is None:
            print(f"{i:3d} {r['tp']:3d} {r['pp']:3d} {r['sp']:3d} {r['dp']:3d} {r['batch']:5d} {'no':>4} "
                  f"{'-':>8} {'':65s}  {r['reason']}", file=out)
            continue
        t, s = r["terms_bytes"], r["seconds"]
        comm = sum(v for k, v in s.items() if k not in ("rollout", "train", "decode_reward"))
        print(f"{i:3d} {r['tp']:3d} {r['pp']:3d} {r['sp']:3d} {r['dp']:3d} {r['batch']:5d} "
              f"{'yes' if r['fits'] else 'no':>4} {r['peak_bytes_per_rank'] / GB:8.1f} {t['weights'] / GB:7.1f} "
              f"{t['main_grads'] / GB:6.1f} {t['optimizer'] / GB:6.1f} {t['activations'] / GB:6.1f} "
              f"{t['vae_decode'] / GB:6.1f} {r['seconds_per_iteration']:8.1f} {r['seconds_per_image']:7.2f} {s['rollout']:8.1f} {s['train']:8.1f} "
              f"{comm:7.1f}  {r['reason'] or ''}"
              + (f" pipeline_num_layers {r['pipeline_num_layers']}" if "pipeline_num_layers" in r else ""), file=out)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plan":  # `mm-grpo plan ...`
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    try:
        config, job, device, rows = plan(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"mm-grpo plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(rows[:args.top] if args.top else rows, sys.stdout, indent=1)
        print()
    else:
        print_table(config, job, device, rows, args)
    return 0


def console():
    """The `mm-grpo` console command: `mm-grpo plan ...` (plan is its one subcommand)."""
    argv = sys.argv[1:]
    if not argv or argv[0] != "plan":
        print("usage: mm-grpo plan [--model ...] --devices N [...]  (mm-grpo plan --help)", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(argv))
