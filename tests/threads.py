"""The bound on the threads a test process holds.

Each gloo process group keeps three threads and a socket per peer until it is destroyed; test
processes that build many parallel layouts once piled up 1,000-5,000 threads and slowed a 2-core
machine several-fold (destroy_parallel now frees them). pytest's process (tests/conftest.py) and
every torchrun worker (tests/distributed/worker.py) check the bound after each test / check.
"""
import gc
import os

import torch

# Threads allowed beyond torch's own CPU pools (which scale with the machine's cores): the world
# group's gloo threads, one parallel layout's groups, loggers, and headroom.
THREAD_BOUND = 100


def thread_count() -> int:
    """Native threads of this process (gloo's are not Python threads)."""
    return len(os.listdir("/proc/self/task"))


def threads_over_bound() -> str | None:
    """A one-line complaint when this process holds more threads than the bound, else None."""
    if not os.path.isdir("/proc/self/task"):  # not Linux: nothing to count
        return None
    bound = THREAD_BOUND + torch.get_num_threads() + torch.get_num_interop_threads()
    if thread_count() <= bound:
        return None
    gc.collect()  # what a finished test left in reference cycles is not held: its groups' threads end here
    count = thread_count()
    if count <= bound:
        return None
    return (f"this test process holds {count} threads, over the bound of {bound} "
            f"(tests/threads.py): something creates process groups or threads it does not free")
