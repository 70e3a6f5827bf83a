"""`mm-grpo plan --model flux-dev`: which TP x PP x SP x DP layouts of N devices fit a GRPO run of
FLUX, and how fast.

    mm-grpo plan --model flux-dev --devices 8 --device-memory 64 --height 1024 --width 1024
    python -m mm_grpo.tools.plan --model flux-dev --devices 16 --lora-rank 64 --json
    mm-grpo plan --model flux-dev --devices 1 --device h200 --height 512 --micro-batch-size 12 --lora-rank 64 \\
        --compile-blocks

Every layout whose TP x SP divides the heads and PP the blocks is listed, ranked: the ones that
fit by predicted seconds per iteration, then the others by memory, each with why it does not
fit. Formulas and their sources: mm_grpo/families/flux/plan.py; the time model's calibration:
mm_grpo/families/flux/calibration.py; validation: docs/scaling.md.
"""
import sys

from mm_grpo.families.flux import plan as f
from mm_grpo.families.flux.transformer.latents import token_grid
from mm_grpo.plan import flags
from mm_grpo.plan.devices import GB
from mm_grpo.plan.formulas import comm_seconds, measured_row, ranked

LAYOUT = ("tp", "pp", "sp", "dp")  # a row's layout, as the table shows it


def build_parser():
    p = flags.parser(" ".join(__doc__.split("\n\n")[0].split()))
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
    config, (job,), device, comps = flags.setup(args, f.model_of, jobs_of, f.components)
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
            measured_row(row, f.rank_memory(config, comps, job_l, lay),
                         f.iteration_time(config, comps, job_l, lay, device, args.mfu), device, "seconds_per_image")
            row["time_path"] = "mfu" if args.mfu is not None else f.time_path(job_l, device)
        rows.append(row)
    # Fitting layouts by time per image (layouts of more DP ranks run more prompts per iteration
    # unless --prompts-per-iteration fixes it), then the others by memory.
    return config, job, device, ranked(rows, "seconds_per_image")


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
            f"({measured}; mm_grpo/families/flux/calibration.py)")


def _seconds(r) -> str:
    s = r["seconds"]
    return (f"{r['terms_bytes']['vae_decode'] / GB:6.1f} {r['seconds_per_iteration']:8.1f} "
            f"{r['seconds_per_image']:7.2f} {s['rollout']:8.1f} {s['train']:8.1f} {comm_seconds(s):7.1f}  "
            f"{flags.note(r)}")


def show(planned, args):
    config, job, device, rows = planned
    if args.json:
        flags.print_json(flags.shown(rows, args))
    else:
        print_table(config, job, device, rows, args)


def main(argv) -> int:
    return flags.run(build_parser().parse_args(argv), plan, show)
