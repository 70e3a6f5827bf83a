"""`mm-grpo plan`: which TP x PP x SP x DP layouts of N devices fit a GRPO run of FLUX, and how fast.

    mm-grpo plan --model flux-dev --devices 8 --device-memory 64 --height 1024 --width 1024
    python -m mm_grpo.tools.plan --model flux-dev --devices 16 --lora-rank 64 --json
    mm-grpo plan --model flux-dev --devices 1 --device h200 --height 512 --micro-batch-size 12 --lora-rank 64 \\
        --compile-blocks
    mm-grpo plan --model wan2.1-14b --devices 8 16 32 64 --lora-rank 0 64   # video: families/wan/plan_cli.py's flags

Every layout whose TP x SP divides the heads and PP the blocks is listed, ranked: the ones that
fit by predicted seconds per iteration, then the others by memory, each with why it does not
fit. Formulas and their sources: mm_grpo/plan/formulas.py; the time model's calibration:
mm_grpo/plan/calibration.py; validation: docs/scaling.md.
"""
import argparse
import sys

from mm_grpo.families.wan import plan as wan
from mm_grpo.families.wan import plan_cli as wan_cli
from mm_grpo.models.flux.latents import token_grid
from mm_grpo.plan import flags, frozen_parts
from mm_grpo.plan import formulas as f
from mm_grpo.plan.devices import GB

LAYOUT = ("tp", "pp", "sp", "dp")  # a row's layout, as the table shows it


def build_parser():
    p = flags.parser(__doc__.splitlines()[0])
    g = p.add_argument_group("model and job")
    g.add_argument("--model", default="flux-dev",
                   help="flux-dev, flux-schnell, tiny, or a diffusers transformer config.json / folder; "
                        "wan2.1-14b, wan2.1-1.3b (or a WanTransformer3DModel config) take the video flags: "
                        "--model wan2.1-14b --help")
    flags.add_job_args(g, f.Job)
    g = p.add_argument_group("devices")
    flags.add_device_args(g, calibrated=True)
    g.add_argument("--sp", type=int, default=None, help="only layouts with this SP (Ulysses)")
    flags.add_output_args(p.add_argument_group("output"))
    return p


def jobs_of(args) -> list:
    """The one Job of the flags, checked."""
    jobs = flags.jobs_of(f.Job, args)
    token_grid(jobs[0].height, jobs[0].width)  # one line naming the size unless FLUX's latent layout divides it
    return jobs


def candidate_layouts(config, args):
    flags.check_divides(args.devices, tp=args.tp, pp=args.pp, sp=args.sp)
    if args.tp and args.sp and args.devices % (args.tp * args.sp):
        raise ValueError(f"--tp {args.tp} x --sp {args.sp} does not divide --devices {args.devices}")
    if (args.tp or 1) * (args.sp or 1) > 1 and config.num_attention_heads % ((args.tp or 1) * (args.sp or 1)):
        raise ValueError(f"{config.num_attention_heads} heads do not split over TP x SP = "
                         f"{(args.tp or 1) * (args.sp or 1)}")
    if args.pp and args.pp > config.num_blocks:
        raise ValueError(f"--pp {args.pp} is more stages than the model's {config.num_blocks} blocks")
    return flags.matching(f.layouts(config, args.devices), f"no TP x PP x SP x DP layout of {args.devices} devices "
                          f"divides the model's {config.num_attention_heads} heads and {config.num_blocks} blocks",
                          tp=args.tp, pp=args.pp, sp=args.sp)


def plan(args):
    """Rows (dicts) for every candidate layout, ranked."""
    config, (job,), device, comps = flags.setup(args, f.model_of, jobs_of, frozen_parts.flux_components)
    rows = []
    for lay in candidate_layouts(config, args):
        job_l = job.on(lay, args.prompts_per_iteration is None)
        reason = f.check_layout(config, job_l, lay)
        row = dict(tp=lay.tp, pp=lay.pp, sp=lay.sp, dp=lay.dp, fits=False, reason=reason,
                   peak_bytes_per_rank=None, seconds_per_iteration=None, batch=job_l.batch)
        counts = f.stage_blocks(config.num_blocks, lay.pp)
        if len(set(counts)) > 1:  # the trainer needs the split as predictor.pipeline_num_layers
            row["pipeline_num_layers"] = counts
        if reason is None:
            f.measured_row(row, f.rank_memory(config, comps, job_l, lay),
                           f.iteration_time(config, comps, job_l, lay, device, args.mfu), device, "seconds_per_image")
            row["time_path"] = "mfu" if args.mfu is not None else f.time_path(job_l, device)
        rows.append(row)
    # Fitting layouts by time per image (layouts of more DP ranks run more prompts per iteration
    # unless --prompts-per-iteration fixes it), then the others by memory.
    return config, job, device, f.ranked(rows, "seconds_per_image")


def print_table(config, job, device, rows, args, out=None):
    out = out or sys.stdout
    full = f"LoRA rank {job.lora_rank}" if job.lora_rank else "full"
    print(f"FLUX {f.total_params(config) / 1e9:.2f}B ({args.model}), {full}, {job.height}x{job.width} "
          f"({job.image_tokens} image + {job.text_tokens} text tokens), G={job.num_generations}, N="
          f"{job.num_inference_steps}, K={job.trained_steps} trained steps, micro-batch {job.micro_batch_size}, "
          f"recompute {'on' if job.recompute else 'off'}, distributed optimizer "
          f"{'on' if job.distributed_optimizer else 'off'}, {'bf16' if job.bf16 else 'fp32'} compute, "
          f"{job.param_dtype} parameters; {args.devices} x {device.name} of {device.memory_bytes / GB:.0f} GB, "
          f"{_time_basis(job, device, args)}", file=out)
    flags.print_layout_table(rows, args, LAYOUT, f"{'decode':>6} {'s/iter':>8} {'s/image':>7} {'rollout':>8} "
                             f"{'train':>8} {'comm':>7}  note", _seconds, 65, out)


def _time_basis(job, device, args) -> str:
    """What the seconds assume: --mfu of the peak, or the calibrated path at the card's matmul rate."""
    if args.mfu is not None:
        return f"MFU {args.mfu} of {device.peak_bf16_flops / 1e12:.0f} TFLOP/s"
    path = f.time_path(job, device)
    note = " (compiled blocks run eager here)" if job.compile_blocks and path == "eager" else ""
    measured = "measured" if device.matmul_bf16_flops else "assumed"
    return (f"time calibrated on the {path} path{note} at {device.matmul_rate / 1e12:.0f} TFLOP/s bf16 matmul "
            f"({measured}; mm_grpo/plan/calibration.py)")


def _seconds(r) -> str:
    s = r["seconds"]
    return (f"{r['terms_bytes']['vae_decode'] / GB:6.1f} {r['seconds_per_iteration']:8.1f} "
            f"{r['seconds_per_image']:7.2f} {s['rollout']:8.1f} {s['train']:8.1f} {f.comm_seconds(s):7.1f}  "
            f"{flags.note(r)}")


def model_arg(argv):
    """The value of --model in `argv` (None when absent), before either family's parser reads it."""
    peek = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    peek.add_argument("--model", default=None)
    return peek.parse_known_args(argv)[0].model


def show(planned, args):
    config, job, device, rows = planned
    if args.json:
        flags.print_json(flags.shown(rows, args))
    else:
        print_table(config, job, device, rows, args)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plan":  # `mm-grpo plan ...`
        argv = argv[1:]
    if wan.is_wan(model_arg(argv)):  # Wan2.1 text-to-video: its own flags (frames, CP, ...)
        return wan_cli.main(argv)
    return flags.run(build_parser().parse_args(argv), plan, show)


def console():
    """The `mm-grpo` console command: `mm-grpo plan ...` (plan is its one subcommand)."""
    argv = sys.argv[1:]
    if not argv or argv[0] != "plan":
        print("usage: mm-grpo plan [--model ...] --devices N [...]  (mm-grpo plan --help)", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(argv))


if __name__ == "__main__":
    sys.exit(main())
