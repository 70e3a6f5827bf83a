"""Changing parallel layouts frees the previous layout's process groups and their threads; the
thread bound every test process checks (tests/threads.py) sees a pile-up."""
import torch
import torch.distributed as dist

from mm_grpo.parallel import ParallelConfig, destroy_parallel, initialize_parallel
from tests.threads import thread_count, threads_over_bound

LAYOUTS = 6


def test_layouts_one_after_another_hold_one_layouts_threads():
    initialize_parallel(ParallelConfig())
    one_layout = thread_count() + torch.get_num_threads()  # torch's pool may start meanwhile
    for _ in range(LAYOUTS):
        initialize_parallel(ParallelConfig())
        assert thread_count() <= one_layout  # without destroying the groups: about 50 more a layout
    destroy_parallel()
    assert set(dist.distributed_c10d._world.pg_map) == {dist.group.WORLD}
    assert thread_count() < one_layout


def test_the_bound_sees_groups_that_are_not_destroyed():
    initialize_parallel(ParallelConfig())
    leaked = [dist.new_group([0], backend="gloo") for _ in range(40)]  # about 3 threads each
    try:
        assert threads_over_bound() is not None
    finally:
        for group in leaked:
            dist.destroy_process_group(group)
        del leaked
        destroy_parallel()
    assert threads_over_bound() is None
