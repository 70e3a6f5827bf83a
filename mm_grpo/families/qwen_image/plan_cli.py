"""`mm-grpo plan --model qwen-image`: which TP x PP x SP x DP layouts of N devices fit a GRPO run of
Qwen-Image, and how fast.

    mm-grpo plan --model qwen-image --devices 8 --device-memory 64 --lora-rank 64
    mm-grpo plan --model qwen-image --devices 16 --height 512 --true-cfg-scale 1 --json
    python -m mm_grpo.tools.plan --model qwen-image --devices 8 --device h200 --lora-rank 64 --top 5

Every layout whose TP x SP divides the heads and whose PP is at most the blocks is listed, ranked: the
ones that fit by predicted seconds per image, then the others by memory, each with why it does not
fit. Formulas and their sources: mm_grpo/families/qwen_image/plan.py; the time is --mfu x the peak
(Qwen-Image's iterations are not measured yet).
"""
import sys

from mm_grpo.families.qwen_image import plan as q
from mm_grpo.plan import flags
from mm_grpo.plan.devices import GB
from mm_grpo.plan.formulas import comm_seconds, measured_row, ranked

LAYOUT = ("tp", "pp", "sp", "dp")  # a row's layout, as the table shows it


def build_parser():
    p = flags.parser(" ".join(__doc__.split("\n\n")[0].split()))
    g = p.add_argument_group("model and job")
    g.add_argument("--model", required=True,
                   help=f"{', '.join(q.MODELS)}, or a diffusers {q.DIFFUSERS_CLASS} config.json / transformer or "
                        f"pipeline folder")
    flags.add_job_args(g, q.Job)
    g = p.add_argument_group("devices")
    flags.add_device_args(g)
    g.add_argument("--sp", type=int, default=None, help="only layouts with this SP (Ulysses)")
    flags.add_output_args(p.add_argument_group("output"))
    return p


def jobs_of(args) -> list:
    """The one Job of the flags, checked."""
    jobs = flags.jobs_of(q.Job, args)
    q.check_job(jobs[0])
    return jobs


def candidate_layouts(config, args):
    """The layouts of --devices that --tp / --pp / --sp leave, or one line why none."""
    flags.check_divides(args.devices, tp=args.tp, pp=args.pp, sp=args.sp)
    tp_sp = (args.tp or 1) * (args.sp or 1)
    if args.devices % tp_sp:
        raise ValueError(f"--tp {args.tp} x --sp {args.sp} does not divide --devices {args.devices}")
    if config.num_attention_heads % tp_sp:
        raise ValueError(f"{config.num_attention_heads} heads do not split over TP x SP = {tp_sp}")
    if args.pp and args.pp > config.num_blocks:
        raise ValueError(f"--pp {args.pp} is more stages than the model's {config.num_blocks} blocks")
    return flags.matching(q.layouts(config, args.devices), f"no TP x PP x SP x DP layout of {args.devices} devices "
                          f"divides the model's {config.num_attention_heads} heads and {config.num_blocks} blocks",
                          tp=args.tp, pp=args.pp, sp=args.sp)


def plan(args):
    """(config, job, device, rows): a row (dict) for every candidate layout, ranked."""
    config, (job,), device, comps = flags.setup(args, q.model_of, jobs_of, q.components)
    rows = []
    for lay in candidate_layouts(config, args):
        job_l = job.on(lay, args.prompts_per_iteration is None)
        reason = q.check_layout(config, job_l, lay)
        row = dict(tp=lay.tp, pp=lay.pp, sp=lay.sp, dp=lay.dp, fits=False, reason=reason,
                   peak_bytes_per_rank=None, seconds_per_iteration=None, seconds_per_image=None, batch=job_l.batch)
        counts = q.stage_blocks(config.num_blocks, lay.pp)
        if len(set(counts)) > 1:  # the trainer needs the split as pp_layers
            row["pipeline_num_layers"] = counts
        if reason is None:
            measured_row(row, q.rank_memory(config, comps, job_l, lay),
                         q.iteration_time(config, comps, job_l, lay, device, args.mfu), device, "seconds_per_image")
        rows.append(row)
    # Fitting layouts by time per image (more DP ranks run more prompts per iteration unless
    # --prompts-per-iteration fixes it), then the others by memory.
    return config, job, device, ranked(rows, "seconds_per_image")


def header(config, job, device, args) -> str:
    tuning = f"LoRA rank {job.lora_rank}" if job.lora_rank else "full"
    cfg = (f"true CFG {job.true_cfg_scale:g} (2 passes per step, rollout and training)" if job.passes > 1
           else "no true CFG")
    text = "features cached" if job.text_cache else "Qwen2.5-VL-7B on every rank"
    return (f"Qwen-Image {q.total_params(config) / 1e9:.2f}B ({args.model}), {tuning}, {job.height}x{job.width} "
            f"({job.image_tokens} image + {job.text_tokens} text tokens), {cfg}, G={job.num_generations}, "
            f"N={job.num_inference_steps}, K={job.trained_steps} trained steps, micro-batch {job.micro_batch_size}, "
            f"recompute {'on' if job.recompute else 'off'}, distributed optimizer "
            f"{'on' if job.distributed_optimizer else 'off'}, {'bf16' if job.bf16 else 'fp32'} compute, "
            f"{job.param_dtype} parameters, text {text}; {args.devices} x {device.name} of "
            f"{device.memory_bytes / GB:.0f} GB, MFU {args.mfu} of {device.peak_bf16_flops / 1e12:.0f} TFLOP/s")


def _seconds(r) -> str:
    s = r["seconds"]
    return (f"{r['terms_bytes']['vae_decode'] / GB:6.1f} {r['seconds_per_iteration']:8.1f} "
            f"{r['seconds_per_image']:7.2f} {s['rollout']:8.1f} {s['train']:8.1f} {comm_seconds(s):7.1f}  "
            f"{flags.note(r)}")


def print_table(config, job, device, rows, args, out=None):
    out = out or sys.stdout
    print(header(config, job, device, args), file=out)
    flags.print_layout_table(rows, args, LAYOUT, f"{'decode':>6} {'s/iter':>8} {'s/image':>7} {'rollout':>8} "
                             f"{'train':>8} {'comm':>7}  note", _seconds, 65, out)


def show(planned, args):
    config, job, device, rows = planned
    if args.json:
        flags.print_json(flags.shown(rows, args))
    else:
        print_table(config, job, device, rows, args)


def main(argv) -> int:
    return flags.run(build_parser().parse_args(argv), plan, show)
