"""`mm-grpo plan --model wan2.1-14b`: which CP x PP x DP layouts (TP 1) of N devices fit a GRPO run of
Wan2.1 text-to-video, and how fast.

    mm-grpo plan --model wan2.1-14b --devices 16 --device-memory 64                 # every layout
    mm-grpo plan --model wan2.1-14b --devices 8 16 32 64 --lora-rank 0 64           # the best per size
    python -m mm_grpo.tools.plan --model wan2.1-1.3b --devices 8 --frames 33 --json

One device count and one LoRA rank: every layout whose CP divides the heads and the video tokens
and whose PP divides the blocks, ranked as for FLUX (the ones that fit by predicted seconds per
video, then the others by memory, each with why it does not fit). Several device counts or ranks
(0: full fine-tuning): one row each with the recommended layouts. Formulas: mm_grpo/families/wan/plan.py.
"""
import sys

from mm_grpo.families.wan import plan as wan
from mm_grpo.plan import flags
from mm_grpo.plan import formulas as f
from mm_grpo.plan.devices import GB

LAYOUT = ("cp", "pp", "dp")  # a row's layout, as the table shows it


def build_parser():
    p = flags.parser(" ".join(__doc__.split("\n\n")[0].split()))
    g = p.add_argument_group("model and job")
    g.add_argument("--model", required=True,
                   help="wan2.1-14b, wan2.1-1.3b, or a diffusers WanTransformer3DModel config.json / folder")
    flags.add_job_args(g, wan.VideoJob, several=True)
    g = p.add_argument_group("devices")
    flags.add_device_args(g, several=True)
    g.add_argument("--cp", "--sp", dest="cp", type=int, default=None,
                   help="only layouts with this CP (Ulysses context parallelism)")
    g.add_argument("--pipeline-num-layers", type=int, nargs="+", default=None,
                   help="blocks per pipeline stage (model.json's pipeline_num_layers; sets PP)")
    flags.add_output_args(p.add_argument_group("output"), several=True)
    return p


def jobs_of(args) -> list:
    """One VideoJob per --lora-rank, checked: one line for what cannot be planned at all."""
    if args.tp is not None and args.tp != 1:
        raise ValueError(f"--tp {args.tp}: {wan.TP_REASON}")
    if args.micro_batch_size != 1:
        raise ValueError(f"--micro-batch-size {args.micro_batch_size}: {wan.MICRO_BATCH_REASON}")
    jobs = flags.jobs_of(wan.VideoJob, args)
    wan.latent_grid(jobs[0].frames, jobs[0].height, jobs[0].width)  # one line naming the size unless it divides
    return jobs


def candidate_layouts(config, job, devices, args):
    """The layouts of `devices` that --pp / --cp / --pipeline-num-layers leave, or one line why none."""
    split = args.pipeline_num_layers
    pp = args.pp
    if split:
        if pp is not None and pp != len(split):
            raise ValueError(f"--pp {pp} and --pipeline-num-layers {split} ({len(split)} stages) disagree")
        if sum(split) != config.num_layers or min(split) < 1:
            raise ValueError(f"--pipeline-num-layers {split} must be positive and sum to the model's "
                             f"{config.num_layers} blocks")
        pp = len(split)
    flags.check_divides(devices, pp=pp, cp=args.cp)
    tokens = wan.video_tokens(config, job)
    if args.cp is not None and (config.num_heads % args.cp or tokens % args.cp):
        what = f"{config.num_heads} heads" if config.num_heads % args.cp else f"{tokens} video tokens"
        raise ValueError(f"--cp {args.cp}: {what} do not split over CP {args.cp}")
    if pp is not None and not split and config.num_layers % pp:
        raise ValueError(f"--pp {pp} does not divide the model's {config.num_layers} blocks; give the split "
                         f"with --pipeline-num-layers")
    if args.cp and pp and devices % (args.cp * pp):
        raise ValueError(f"--cp {args.cp} x --pp {pp} does not divide --devices {devices}")
    return flags.matching(wan.layouts(config, job, devices, split), f"no CP x PP x DP layout of {devices} devices "
                          f"divides the model's {config.num_heads} heads, {tokens} video tokens and "
                          f"{config.num_layers} blocks", pp=pp, sp=args.cp)


def plan(args):
    """(config, jobs, device, [(devices, job, rows)]) for every device count and LoRA rank."""
    config, jobs, device, comps = flags.setup(args, wan.model_of, jobs_of, wan.components)
    plans = []
    for n in args.devices:
        for job in jobs:
            rows = wan.plan_layouts(config, comps, job, n, device, args.mfu, args.pipeline_num_layers,
                                    candidate_layouts(config, job, n, args),
                                    per_dp_rank_prompts=args.prompts_per_iteration is None)
            plans.append((n, job, rows))
    return config, jobs, device, plans


def _tuning(job) -> str:
    return f"LoRA {job.lora_rank}" if job.lora_rank else "full"


def header(config, job, device, args) -> str:
    t, h, w = wan.token_grid(config, job)
    lt, lh, lw = wan.latent_grid(job.frames, job.height, job.width)
    prompts = ("one prompt per DP rank" if args.prompts_per_iteration is None
               else f"{job.prompts_per_iteration} prompts per iteration")
    return (f"Wan2.1 {wan.total_params(config) / 1e9:.2f}B ({args.model}), {job.height}x{job.width}, "
            f"{job.frames} frames (latent {lt}x{lh}x{lw} -> {t}x{h}x{w} = {t * h * w} video tokens + "
            f"{job.text_tokens} text), "
            f"G={job.num_generations} videos per prompt, {prompts}, "
            f"N={job.num_inference_steps}, K={job.trained_steps} trained steps, "
            f"CFG {'on (2 passes per step)' if job.cfg else 'off'}, micro-batch 1, recompute "
            f"{'on' if job.recompute else 'off'}, {job.param_dtype} parameters + fp32 grads"
            f"{' + fp32 master' if job.param_dtype == 'bf16' else ''} + Adam, distributed optimizer "
            f"{'on (over DP x CP)' if job.distributed_optimizer else 'off'}, umT5 "
            f"{'embeddings cached' if job.text_cache else 'on every rank'}, {args.reward} reward on the first frame, "
            f"KL reference {'on' if job.kl_reference else 'off'}; {device.name} of {device.memory_bytes / GB:.0f} GB, "
            f"MFU {args.mfu}; TP 1")


def _layout(r) -> str:
    return f"CP{r['cp']} PP{r['pp']} DP{r['dp']}"


def print_layouts(config, job, device, rows, args, out=None):
    """Every layout of one device count and one job, as FLUX's planner tables them."""
    out = out or sys.stdout
    devices = rows[0]["cp"] * rows[0]["pp"] * rows[0]["dp"]
    print(header(config, job, device, args) + f"; {_tuning(job)}, {devices} devices", file=out)
    flags.print_layout_table(rows, args, LAYOUT, f"{'s/iter':>8} {'s/video':>8} {'rollout':>8} {'train':>8} "
                             f"{'decode':>7} {'comm':>6}  note", _seconds, 79, out)


def _seconds(r) -> str:
    s = r["seconds"]
    return (f"{r['seconds_per_iteration']:8.0f} {r['seconds_per_video']:8.1f} {s['rollout']:8.0f} {s['train']:8.0f} "
            f"{s['decode_reward']:7.0f} {f.comm_seconds(s):6.0f}  {flags.note(r).strip()}").rstrip()


def summary(plans, top=3):
    """One dict per (devices, job): how many layouts fit, the best `top` of them, or the one needing least memory."""
    out = []
    for n, job, rows in plans:
        fitting = [r for r in rows if r["fits"]]
        sized = [r for r in rows if r["peak_bytes_per_rank"] is not None]
        least = min(sized, key=lambda r: r["peak_bytes_per_rank"]) if sized else None
        out.append(dict(devices=n, lora_rank=job.lora_rank, layouts=len(rows), fitting=len(fitting),
                        recommended=fitting[:top], least_memory=None if fitting else least))
    return out


def print_summary(config, jobs, device, plans, args, out=None):
    out = out or sys.stdout
    top = args.top or 3
    print(header(config, jobs[0], device, args), file=out)
    print(f"{'NPUs':>4}  {'tuning':<7}  {'fit':<8}  {'layout':<13} {'peak GB':>7} {'s/iter':>7} {'s/video':>7} "
          f"{'rollout':>7} {'train':>7} {'decode':>6} {'comm':>5}  other fitting layouts (peak GB, s/video)", file=out)
    for s in summary(plans, top):
        fit = f"{s['fitting']} of {s['layouts']}"
        lead = f"{s['devices']:>4}  {_tuning(next(j for j in jobs if j.lora_rank == s['lora_rank'])):<7}  {fit:<8}"
        if not s["recommended"]:
            r = s["least_memory"]
            why = (f"none fits; least memory {_layout(r)}: {r['reason']}" if r else "no layout divides")
            print(f"{lead}  {'-':<13} {'':>7} {'':>7} {'':>7} {'':>7} {'':>7} {'':>6} {'':>5}  {why}", file=out)
            continue
        r, others = s["recommended"][0], s["recommended"][1:]
        p = r["seconds"]
        rest = "; ".join(f"{_layout(o)} ({o['peak_bytes_per_rank'] / GB:.1f}, {o['seconds_per_video']:.0f})"
                         for o in others)
        line = (f"{lead}  {_layout(r):<13} {r['peak_bytes_per_rank'] / GB:7.1f} {r['seconds_per_iteration']:7.0f} "
                f"{r['seconds_per_video']:7.0f} {p['rollout']:7.0f} {p['train']:7.0f} {p['decode_reward']:6.0f} "
                f"{f.comm_seconds(r['seconds']):5.0f}  {rest}")
        print(line.rstrip(), file=out)


def show(planned, args):
    config, jobs, device, plans = planned
    single = len(plans) == 1
    if args.json:
        flags.print_json(flags.shown(plans[0][2], args) if single
                         else summary(plans, args.top or 3))
    elif single:
        print_layouts(config, plans[0][1], device, plans[0][2], args)
    else:
        print_summary(config, jobs, device, plans, args)


def main(argv):
    return flags.run(build_parser().parse_args(argv), plan, show)
