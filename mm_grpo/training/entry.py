"""What every trainer's `python -m` entry does around its run: report on one rank, tear the
process group down, and turn configuration errors into one line and exit status 2."""
import sys
import time

import torch.distributed as dist


def train_and_report(run, report):
    """`run.train()`; then `report(history, seconds)` on the last rank (it holds the loss of the
    last pipeline stage)."""
    start = time.time()
    history = run.train()
    if dist.get_rank() == dist.get_world_size() - 1 and history:
        report(history, time.time() - start)
    return history


def run_entry(main):
    """Calls `main()`; a ValueError / FileNotFoundError (bad configuration, missing file) ends the
    process with one line naming the problem instead of a traceback on every rank."""
    try:
        main()
    except (ValueError, FileNotFoundError) as e:
        print(f"mm-grpo: error: {e}", file=sys.stderr)
        sys.exit(2)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
