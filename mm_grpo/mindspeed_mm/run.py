"""Run a MindSpeed-MM entry script with mm-grpo's models registered (`"model_id": "flux"`):

    torchrun $DISTRIBUTED_ARGS -m mm_grpo.mindspeed_mm.run pretrain_sora.py $ARGS

`import mm_grpo` first sets up the accelerator the way the script would (on Ascend: torch_npu's
cuda->npu mapping, then MindSpeed's Megatron adaptor, before Megatron is imported); the
registry then adds mm-grpo's predictors to MindSpeed-MM's mapping as it is imported. The script
runs as `__main__` with its own arguments. A flux predictor block in `--mm-model` is checked
first: a block MindSpeed-MM's argument validation cannot read ends the launch with one line (exit 2).
"""
import os
import runpy
import sys

import mm_grpo  # noqa: F401  (accelerator first)
from mm_grpo.files.jsonfile import load_json
import mm_grpo.mindspeed_mm.registry  # noqa: F401  (registers into MindSpeed-MM on its import)
from mm_grpo.families.flux.predictor_block import flux_config_from_block, mindspeed_mm_block_error
from mm_grpo.training.entry import run_entry


def _mm_model(argv):
    for i, arg in enumerate(argv):
        if arg == "--mm-model" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--mm-model="):
            return arg.split("=", 1)[1]
    return None


def check_predictor_block(argv):
    """ValueError naming what MindSpeed-MM (or the predictor, later, on every rank) would fail on."""
    path = _mm_model(argv)
    if path is None:
        return
    model = load_json(path, "--mm-model")
    block = model.get("predictor") if isinstance(model, dict) else None
    if not isinstance(block, dict) or block.get("model_id") != "flux":
        return
    try:
        flux_config_from_block(block)
        why = mindspeed_mm_block_error(block)
    except ValueError as e:
        why = str(e)
    if why is not None:
        raise ValueError(f"{path}: {why}")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or not argv[0].endswith(".py"):
        raise SystemExit("usage: python -m mm_grpo.mindspeed_mm.run SCRIPT.py [ARGS...] "
                         "(a MindSpeed-MM entry script, e.g. pretrain_sora.py)")
    # Every rank reads the same file: one line per launch.
    run_entry(lambda: check_predictor_block(argv), agreed=(ValueError, FileNotFoundError))
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))  # as `python SCRIPT.py` would
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
