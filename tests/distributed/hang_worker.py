"""torchrun --nproc_per_node 2 -m tests.distributed.hang_worker MINUTES: rank 1 stops itself (SIGSTOP)
between two data-parallel reductions, as a hung rank does; rank 0 must time out after MINUTES (a
fraction of a minute too: the test waits no longer than it must)."""
import os
import signal
import sys
import time

import torch.distributed as dist

from mm_grpo.parallel import ParallelConfig, initialize_parallel
from mm_grpo.parallel.state import dp_reduce
from mm_grpo.training.entry import run_entry


def main():
    initialize_parallel(ParallelConfig(), timeout_minutes=float(sys.argv[1]))
    dp_reduce(1.0)  # both ranks in the data-parallel group
    if dist.get_rank() == 1:
        print(f"rank 1 stops at {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    dp_reduce(1.0)


if __name__ == "__main__":
    run_entry(main)
