"""The flags, checks and output of `mm-grpo plan` that every family's planner shares (FLUX's
families/flux/plan_cli.py, Wan2.1's families/wan/plan_cli.py), declared once; each family adds its
own (FLUX: --sp; Wan: --cp, --pipeline-num-layers). `several`: the family plans several device
counts and LoRA ranks in one call (Wan: a summary row each)."""
import argparse
import json
import sys

from mm_grpo.plan import devices as devices_mod
from mm_grpo.plan import frozen_parts
from mm_grpo.plan.devices import GB
from mm_grpo.settings import add_setting_args, from_args


def parser(description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog="mm-grpo plan", description=description, allow_abbrev=False)


def _nargs(several: bool):
    return "+" if several else None


def add_job_args(group, job_cls, several: bool = False):
    """The job's flags (`job_cls`'s settings), --lora-rank, --prompts-per-iteration and --reward."""
    add_setting_args(group, job_cls)
    group.add_argument("--lora-rank", type=int, nargs=_nargs(several), default=[0] if several else 0,
                       help="0: full fine-tuning" + ("; several (0 64): a plan for each" if several else ""))
    group.add_argument("--prompts-per-iteration", type=int, default=None,
                       help="prompts per iteration over all ranks (default: one per data-parallel rank)")
    group.add_argument("--reward", default="hps", choices=sorted(frozen_parts.REWARD_PARAMS),
                       help="reward model (an image reward: on a video's first frame, as DanceGRPO's Wan recipe "
                            "scores HPS v2)")


def add_device_args(group, several: bool = False, calibrated: bool = False):
    """--devices, the device profile, --mfu and the TP / PP filters; with `calibrated` (FLUX, whose
    time model is calibrated on measured phases: families/flux/plan.py `efficiency`) --mfu is an override (default
    none) and --matmul-tflops gives the card's measured matmul rate."""
    group.add_argument("--devices", type=int, nargs=_nargs(several), required=True,
                       help="number of devices" + ("; several: a row each" if several else ""))
    group.add_argument("--device-memory", type=float, default=None, help="GB per device (default: the profile's)")
    group.add_argument("--device", default="atlas-800t-a2", choices=sorted(devices_mod.DEVICES),
                       help="profile: peak bf16 FLOP/s, measured matmul rate, HBM, interconnect "
                            "(mm_grpo/plan/devices.py)")
    if calibrated:
        group.add_argument("--mfu", type=float, default=None,
                           help="every phase at this fraction of the datasheet peak instead of the calibrated "
                                "per-phase efficiencies (mm_grpo/families/flux/calibration.py, docs/scaling.md)")
        group.add_argument("--matmul-tflops", type=float, default=None,
                           help="the card's measured bf16 matmul rate, TFLOP/s (default: the profile's; "
                                "bench/bench_grpo.matmul_throughput measures it)")
    else:
        group.add_argument("--mfu", type=float, default=0.4,
                           help="assumed fraction of peak FLOP/s reached (one H100, FLUX.1-dev LoRA 64 at 512 px: "
                                "0.25 measured, docs/scaling.md)")
    group.add_argument("--tp", type=int, default=None, help="only layouts with this TP (Wan2.1: 1 only)")
    group.add_argument("--pp", type=int, default=None, help="only layouts with this PP")


def add_output_args(group, several: bool = False):
    group.add_argument("--json", action="store_true", help="a JSON list of objects instead of the table")
    group.add_argument("--top", type=int, default=None,
                       help="print the first N rows only" + ("; the summary of several --devices or --lora-rank "
                                                             "names N layouts per row (default 3)" if several else ""))


def _listed(value) -> list:
    return value if isinstance(value, list) else [value]


def jobs_of(job_cls, args) -> list:
    """One `job_cls` per --lora-rank, from the parsed flags; one line for a value no plan can take
    (and for a job setting below its minimum: settings.from_args)."""
    if not 0 < args.timestep_fraction <= 1:
        raise ValueError(f"--timestep-fraction must be in (0, 1], got {args.timestep_fraction}")
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise ValueError(f"--mfu must be in (0, 1], got {args.mfu}")
    for flag, value, least in (("--devices", args.devices, 1), ("--lora-rank", args.lora_rank, 0),
                               ("--prompts-per-iteration", args.prompts_per_iteration, 1)):
        if any(v is not None and v < least for v in _listed(value)):
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    return [from_args(job_cls, args, prompts_per_iteration=args.prompts_per_iteration or 1, lora_rank=rank)
            for rank in dict.fromkeys(_listed(args.lora_rank))]


def setup(args, model_of, jobs_of, components):
    """(model config, jobs, device, frozen parts) of a family's plan from the parsed flags: `model_of`
    reads --model, `jobs_of` the job's flags, `components` --reward and --text-cache."""
    return (model_of(args.model), jobs_of(args),
            devices_mod.device(args.device, args.device_memory, getattr(args, "matmul_tflops", None)),
            components(args.reward, args.text_cache))


def check_divides(devices: int, **sizes):
    """One line for a --tp / --pp / --sp (--cp) value that does not divide the devices (None: not given)."""
    for name, value in sizes.items():
        if value is not None and (value < 1 or devices % value):
            raise ValueError(f"--{name} {value} does not divide --devices {devices}")


def matching(layouts, none_left: str, **only) -> list:
    """The layouts whose tp / pp / sp are `only`'s values (None: any), or one line, `none_left`, when none is."""
    out = [lay for lay in layouts if all(value is None or getattr(lay, name) == value for name, value in only.items())]
    if not out:
        raise ValueError(none_left)
    return out


def shown(rows: list, args) -> list:
    """The rows --top leaves (all without it)."""
    return rows[:args.top] if args.top else rows


def note(row) -> str:
    """A layout row's note: why it cannot run or does not fit, and the split the trainer takes as
    pipeline_num_layers where the row names one."""
    return (row["reason"] or "") + (f" pipeline_num_layers {row['pipeline_num_layers']}"
                                    if "pipeline_num_layers" in row else "")


def print_layout_table(rows: list, args, keys, titles: str, seconds, blank: int, out):
    """A layout table: its column titles, then the rows --top leaves. Each row: the number, the layout
    (`keys`: the row's keys), the batch, whether it fits, its memory and `seconds(row)` (the family's
    columns, `titles`: seconds and note), or for a layout that cannot run 'no', '-', `blank` spaces
    and why."""
    print(" ".join([f"{'#':>3}", *(f"{k.upper():>3}" for k in keys), f"{'batch':>5} {'fits':>4} {'peak GB':>8}",
                    f"{'weights':>7} {'grads':>6} {'optim':>6} {'act':>6}", titles]), file=out)
    for i, r in enumerate(shown(rows, args), 1):
        if r["peak_bytes_per_rank"] is None:
            rest = f"{'no':>4} {'-':>8} {'':{blank}s}  {r['reason']}"
        else:
            t = r["terms_bytes"]
            rest = (f"{'yes' if r['fits'] else 'no':>4} {r['peak_bytes_per_rank'] / GB:8.1f} {t['weights'] / GB:7.1f} "
                    f"{t['main_grads'] / GB:6.1f} {t['optimizer'] / GB:6.1f} {t['activations'] / GB:6.1f} {seconds(r)}")
        print(" ".join([f"{i:3d}", *(f"{r[k]:3d}" for k in keys), f"{r['batch']:5d}", rest]), file=out)


def print_json(payload):
    json.dump(payload, sys.stdout, indent=1)
    print()


def run(args, plan, show) -> int:
    """show(plan(args), args) and 0, or 2 after one line for what cannot be planned."""
    try:
        planned = plan(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"mm-grpo plan: error: {e}", file=sys.stderr)
        return 2
    show(planned, args)
    return 0
