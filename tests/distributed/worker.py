"""Runs every registered multi-process check in ONE torchrun launch per world size.

Each launch costs seconds of imports, so checks from all features share it. A check is
a function registered with `@check(world_sizes)`; it returns a dict of metrics, which the
pytest side asserts on (tests/distributed/test_*.py). Run by tests/distributed/conftest.py:

    torchrun --nproc_per_node N -m tests.distributed.worker OUT.json

MM_GRPO_CHECKS=REGEX in the environment runs only the checks whose name it matches (a manual run).
"""
import gc
import importlib
import json
import os
import re
import sys
import time
import traceback

import mm_grpo  # noqa: F401  (platform adaptor first)
import torch.distributed as dist

from tests.env_split import CHECK, left_out_here
from tests.testbed import has_megatron_training
from tests.threads import thread_count, threads_over_bound

# Modules whose import registers checks.
CHECK_MODULES = [
    "tests.distributed.checks_tp",
    "tests.distributed.checks_pp_sp",
    "tests.distributed.checks_convert",
    "tests.distributed.checks_grpo",
    "tests.distributed.checks_flow",
    "tests.distributed.checks_qwen_image",
]
if has_megatron_training():  # MindSpeed-MM's environment
    CHECK_MODULES.append("tests.distributed.checks_mindspeed_mm")  # the real PredictModel

_CHECKS = []


def check(*world_sizes):
    """Registers a check for these world sizes. MindSpeed-MM's environment leaves out those listed in
    tests/default_env_only.txt as `check:NAME` (measured: python -m tests.env_split)."""
    def register(fn):
        _CHECKS.append((fn, world_sizes))
        return fn
    return register


# A collective that waits this long means the ranks disagree (one raised, or took another branch):
# the waiting rank then raises too, so the check fails instead of the launch hanging until killed.
COLLECTIVE_TIMEOUT_MINUTES = 5


def _write(results, out_path):
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, out_path)


def _measure_as(name):
    """Under coverage (python -m tests.env_split), the lines the next check runs count as its own."""
    if "coverage" in sys.modules and (cov := sys.modules["coverage"].Coverage.current()) is not None:
        cov.switch_context(CHECK + name)


def main(out_path):
    for name in CHECK_MODULES:
        importlib.import_module(name)
    # Under `-m` this file runs as __main__, while the check modules register with the
    # importable `tests.distributed.worker`: read the checks from that one.
    checks = importlib.import_module("tests.distributed.worker")._CHECKS
    gc.freeze()  # what the imports made lives as long as the process (tests/conftest.py)
    from mm_grpo.parallel.state import destroy_parallel, end_process_groups, init_process_group
    init_process_group(timeout_minutes=COLLECTIVE_TIMEOUT_MINUTES)
    world, rank = dist.get_world_size(), dist.get_rank()
    results = {}
    only = os.environ.get("MM_GRPO_CHECKS")
    left_out = left_out_here()
    for fn, sizes in checks:
        if world not in sizes or (only and not re.search(only, fn.__name__)) or CHECK + fn.__name__ in left_out:
            continue
        start = time.time()
        _measure_as(fn.__name__)
        try:
            metrics, error = fn() or {}, None
        except Exception:
            metrics, error = {}, f"rank {rank}: {traceback.format_exc()}"
            print(f"[worker] {fn.__name__} failed on {error}", file=sys.stderr, flush=True)
        destroy_parallel()
        if error is None and (complaint := threads_over_bound()) is not None:
            error = f"rank {rank}: {complaint}"
        errors = [None] * world
        try:
            dist.all_gather_object(errors, error)
        except Exception:  # a collective timed out: the ranks are out of step, the group unusable
            if rank == 0:
                results[fn.__name__] = {"ok": False, "metrics": metrics, "seconds": round(time.time() - start, 2),
                                        "error": f"{error}\nthe ranks fell out of step (the other ranks' "
                                                 "errors are in the torchrun log); later checks did not run"}
                _write(results, out_path)
            raise
        errors = [e for e in errors if e]
        results[fn.__name__] = {"ok": not errors, "error": "\n".join(errors), "metrics": metrics,
                                "seconds": round(time.time() - start, 2), "threads": thread_count()}
        if rank == 0:
            print(f"[worker] {fn.__name__}: {'ok' if not errors else 'FAILED'} {metrics}", flush=True)
            _write(results, out_path)  # after every check: a launch stopped midway still reports
    dist.barrier()
    end_process_groups()


if __name__ == "__main__":
    main(sys.argv[1])
