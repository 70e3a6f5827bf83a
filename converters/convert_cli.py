"""`mm-convert <Converter> <subcommand> --cfg.*`: one command for FluxConverter and, when
MindSpeed-MM is importable, every MindSpeed-MM converter (WanConverter, Qwen2_5_VLConverter...).

    mm-convert FluxConverter hf_to_mm --cfg.source_path SRC --cfg.target_path DST \\
        --cfg.target_parallel_config.tp_size 2 --cfg.target_parallel_config.pp_layers [28,29]
    python -m converters.convert_cli ...          # the same, whichever package owns `mm-convert`

With MindSpeed-MM this runs MindSpeed-MM's own CLI, in which FluxConverter is registered as
one of its `Converter`s (converters/mindspeed_mm.py); without it, FluxConverter alone.
MindSpeed-MM installs a console script of the same name (`checkpoint.convert_cli:main`): the
package installed last owns `mm-convert`, and MindSpeed-MM's does not import mm-grpo, so
there FluxConverter is missing; `python -m converters.convert_cli` always has both.

Bad input ends with one line `mm-convert: error: ...` on stderr and exit status 1
(argument errors: jsonargparse's usage message, status 2). A target inside or around the source,
or written by training, is refused (converters/target_guard.py); SIGTERM removes the partial output.
Shards are checked against their sha256 files (mm_grpo/checkpoint/checksum.py) unless `--no-verify`
comes anywhere on the command line.
"""
import signal
import sys

from jsonargparse import auto_cli

from converters import mindspeed_mm
from converters.flux import FluxConverter
from converters.qwen_image import QwenImageConverter
from mm_grpo.checkpoint import checksum

# A dict keeps the class name as the command group even with a single converter.
CONVERTERS = {"FluxConverter": FluxConverter, "QwenImageConverter": QwenImageConverter}


def _stop(signum, frame):
    sys.exit(128 + signum)  # SystemExit: the temporary output folder is removed on the way out


def main(args=None):
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        _run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args):
    args = list(sys.argv[1:] if args is None else args)
    if "--no-verify" in args:  # mm-convert's own flag: read shards without checking their sha256 files
        args.remove("--no-verify")
        checksum.set_verify(False)
    if mindspeed_mm.PROBLEM:
        print(f"mm-convert: MindSpeed-MM's converters did not import ({mindspeed_mm.PROBLEM}): FluxConverter only",
              file=sys.stderr)
    try:
        if mindspeed_mm.AVAILABLE:
            mindspeed_mm.run_cli(args)
        else:
            auto_cli(CONVERTERS, args=args, as_positional=False)
    except (ValueError, OSError) as e:  # bad input, missing or existing paths, full disk...
        print(f"mm-convert: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
