"""`mm-grpo plan`: which parallel layouts of N devices fit a GRPO run, and how fast, before a launch.
Each model family has its planner (formulas and flags): FLUX's (mm_grpo/families/flux/plan_cli.py,
TP x PP x SP x DP), Wan2.1's (mm_grpo/families/wan/plan_cli.py, CP x PP x DP) and Qwen-Image's
(mm_grpo/families/qwen_image/plan_cli.py, TP x PP x SP x DP); `--model` picks it.

    mm-grpo plan --model flux-dev --devices 8 --device-memory 64 --height 1024 --width 1024
    mm-grpo plan --model wan2.1-14b --devices 8 16 32 64 --lora-rank 0 64
    mm-grpo plan --model qwen-image --devices 8 --device-memory 64 --lora-rank 64
    python -m mm_grpo.tools.plan --model flux-dev --devices 16 --lora-rank 64 --json
"""
import argparse
import sys

from mm_grpo.families.flux import plan_cli as flux_cli
from mm_grpo.families.qwen_image import plan as qwen_image
from mm_grpo.families.qwen_image import plan_cli as qwen_image_cli
from mm_grpo.families.wan import plan as wan
from mm_grpo.families.wan import plan_cli as wan_cli


def model_arg(argv):
    """The value of --model in `argv` (None when absent), before either family's parser reads it."""
    peek = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    peek.add_argument("--model", default=None)
    return peek.parse_known_args(argv)[0].model


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plan":  # `mm-grpo plan ...`
        argv = argv[1:]
    model = model_arg(argv)
    if wan.is_wan(model):  # Wan2.1 text-to-video: its own flags (frames, CP, ...)
        return wan_cli.main(argv)
    if qwen_image.is_qwen_image(model):  # its own flags (--true-cfg-scale, ...)
        return qwen_image_cli.main(argv)
    return flux_cli.main(argv)


def console():
    """The `mm-grpo` console command: `mm-grpo plan ...` (plan is its one subcommand)."""
    argv = sys.argv[1:]
    if not argv or argv[0] != "plan":
        print("usage: mm-grpo plan [--model ...] --devices N [...]  (mm-grpo plan --help)", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(argv))


if __name__ == "__main__":
    sys.exit(main())
