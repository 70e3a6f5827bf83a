"""`mm-convert <Converter> <subcommand> --cfg.*`: jsonargparse CLI over the converter classes.

    mm-convert FluxConverter hf_to_mm --cfg.source_path SRC --cfg.target_path DST \\
        --cfg.target_parallel_config.tp_size 2 --cfg.target_parallel_config.pp_layers [28,29]

Bad input ends with one line `mm-convert: error: ...` on stderr and exit status 1
(argument errors: jsonargparse's usage message, status 2).
"""
import sys

from jsonargparse import auto_cli

from converters.flux import FluxConverter

# A dict keeps the class name as the command group even with a single converter.
CONVERTERS = {"FluxConverter": FluxConverter}


def main(args=None):
    try:
        auto_cli(CONVERTERS, args=args)
    except (ValueError, OSError) as e:  # bad input, missing or existing paths, full disk...
        print(f"mm-convert: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
