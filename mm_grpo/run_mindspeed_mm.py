"""Run a MindSpeed-MM entry script with mm-grpo's models registered (`"model_id": "flux"`):

    torchrun $DISTRIBUTED_ARGS -m mm_grpo.run_mindspeed_mm pretrain_sora.py $ARGS

`import mm_grpo` first sets up the accelerator the way the script would (on Ascend: torch_npu's
cuda->npu mapping, then MindSpeed's Megatron adaptor, before Megatron is imported); the
registry then adds mm-grpo's predictors to MindSpeed-MM's mapping as it is imported. The script
runs as `__main__` with its own arguments.
"""
import os
import runpy
import sys

import mm_grpo  # noqa: F401  (accelerator first)
import mm_grpo.models.registry  # noqa: F401  (registers into MindSpeed-MM on its import)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or not argv[0].endswith(".py"):
        raise SystemExit("usage: python -m mm_grpo.run_mindspeed_mm SCRIPT.py [ARGS...] "
                         "(a MindSpeed-MM entry script, e.g. pretrain_sora.py)")
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))  # as `python SCRIPT.py` would
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
