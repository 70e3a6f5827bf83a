"""One place that starts torch.distributed and megatron-core's model-parallel groups.

Everything else looks the groups up through `megatron.core.parallel_state`.
"""
import dataclasses
import datetime
import gc
import os
import time
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from mm_grpo import get_platform
from mm_grpo.parallel.ulysses import ULYSSES_CP_ALGO
from mm_grpo.seeding import DEFAULT_SEED


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1  # --tensor-model-parallel-size
    pp: int = 1  # --pipeline-model-parallel-size
    cp: int = 1  # --context-parallel-size (Ulysses)
    vpp: Optional[int] = None  # virtual pipeline stages per rank
    cp_algo: str = ULYSSES_CP_ALGO

    def check(self, world_size: int):
        for name in ("tp", "pp", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} size must be >= 1, got {getattr(self, name)}")
        model_parallel = self.tp * self.pp * self.cp
        if world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by TP x PP x CP = "
                f"{self.tp} x {self.pp} x {self.cp}")
        if self.vpp is not None and (self.vpp < 2 or self.pp < 2):
            raise ValueError(f"virtual pipeline size {self.vpp} needs vpp >= 2 and pipeline-model-parallel "
                             f"size >= 2 (got pp={self.pp}); use vpp=None for no virtual stages")
        if self.cp > 1 and self.cp_algo != ULYSSES_CP_ALGO:
            raise ValueError(f"context-parallel-algo {self.cp_algo!r}: only {ULYSSES_CP_ALGO!r} is supported")

    @property
    def dp(self) -> int:
        return dist.get_world_size() // (self.tp * self.pp * self.cp)


def init_process_group(timeout_minutes: int = 30):
    """torch.distributed from torchrun's env, or a 1-process group when run alone."""
    if dist.is_initialized():
        return
    platform = get_platform()
    if platform.device.type != "cpu":
        getattr(torch, platform.device.type).set_device(platform.device)
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group(backend=platform.dist_backend, timeout=timeout)
    else:  # one process: an in-memory store, so no port (another process could take a freed one
        # before the group binds it) and os.environ untouched (subprocesses may be torchrun)
        dist.init_process_group(backend=platform.dist_backend, timeout=timeout, rank=0, world_size=1,
                                store=dist.HashStore())


def initialize_parallel(parallel: ParallelConfig = ParallelConfig(), seed: int = DEFAULT_SEED, timeout_minutes: int = 30):
    """Start torch.distributed (if needed) and megatron-core's model-parallel groups; a collective
    of any of them times out after `timeout_minutes` (the world group's only if started here)."""
    init_process_group(timeout_minutes)
    parallel.check(dist.get_world_size())
    destroy_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        context_parallel_size=parallel.cp,
        distributed_timeout_minutes=timeout_minutes)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


# Rank lists megatron-core's destroy_model_parallel leaves set (0.12 both, 0.16 the first). The next
# layout sets them only on the ranks of its (position) embedding groups, so on the other ranks
# is_rank_in_(position_)embedding_group would still answer for the old layout, and
# finalize_model_grads would ask for a group that is not there.
_RANKS_LEFT_BY_DESTROY = ("_EMBEDDING_GLOBAL_RANKS", "_POSITION_EMBEDDING_GLOBAL_RANKS")


# gloo's worker thread lets go of a finished collective's tensors just after the caller has its
# result; when Python no longer holds them, that takes the GIL. A group destroyed in that moment
# deadlocks (seen with torch 2.7 at the end of a 4-process launch, barrier() then
# destroy_process_group()): its destructor, holding the GIL, waits for the worker thread's lock, and
# the worker thread, holding that lock, waits for the GIL. Releasing the GIL this long first lets the
# worker threads finish.
GLOO_SETTLE_SECONDS = 0.05


def end_process_groups():
    """The end of a distributed process: every group, the world's too."""
    time.sleep(GLOO_SETTLE_SECONDS)
    dist.destroy_process_group()


def _destroy_subgroups():
    """Free every process group but the world's. megatron-core's destroy_model_parallel forgets most
    of its groups without destroying them, and each gloo group holds three threads and a socket per
    peer: a process that changes layouts (the tests, the benches) would pile up about 50 threads a
    layout. A group's threads end with its last reference, and the previous layout's modules,
    DDP buffers and optimizers hold theirs in reference cycles: collect those now, not whenever
    the collector next runs."""
    world = dist.group.WORLD
    time.sleep(GLOO_SETTLE_SECONDS)
    for group in list(dist.distributed_c10d._world.pg_map):  # every group this rank is in
        if group is not world:
            dist.destroy_process_group(group)
    gc.collect()


def destroy_parallel():
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        _destroy_subgroups()
    for name in _RANKS_LEFT_BY_DESTROY:
        if hasattr(parallel_state, name):
            setattr(parallel_state, name, None)


# The dtype of reduced statistics. Not float64: HCCL has none, and MindSpeed's adaptor makes a float64
# all_reduce reduce a float32 copy that it then drops (torch_all_reduce_double_dtype_bypass_wrapper),
# leaving the caller's tensor unreduced on every rank.
STAT_DTYPE = torch.float32


def dp_reduce(value, op=dist.ReduceOp.SUM, device=None) -> float:
    """A scalar statistic (a number or a 0-d tensor) reduced over the data-parallel group, in
    STAT_DTYPE on `device` (default: the tensor's own; NCCL / HCCL need the accelerator's). With one
    data-parallel rank nothing moves: the value is read where it is."""
    if parallel_state.get_data_parallel_world_size() == 1:
        return torch.as_tensor(value, dtype=STAT_DTYPE).item()
    t = torch.as_tensor(value, dtype=STAT_DTYPE, device=device).clone()
    dist.all_reduce(t, op=op, group=parallel_state.get_data_parallel_group())
    return t.item()


def dp_mean(value, device=None) -> float:
    return dp_reduce(value, device=device) / parallel_state.get_data_parallel_world_size()


# --- the pipeline group: what the last stage computed, on every stage -----------------------
def is_last_stage() -> bool:
    """This rank holds the last pipeline stage. megatron-core 0.12 asks the current virtual stage
    too unless told not to (0.16 does not by default): the schedule leaves it set to any chunk."""
    return parallel_state.is_pipeline_last_stage(ignore_virtual=True)


def _from_last_rank() -> dict:
    return dict(src=parallel_state.get_pipeline_model_parallel_last_rank(),
                group=parallel_state.get_pipeline_model_parallel_group())


def _one_stage() -> bool:
    return parallel_state.get_pipeline_model_parallel_world_size() == 1


def tensor_from_last_stage(tensor: Optional[torch.Tensor], shape, dtype, device) -> torch.Tensor:
    """The last stage's `tensor` on every rank of the pipeline group: the other stages pass None and
    receive it in a new tensor of `shape`, `dtype` on `device`. Without pipeline stages it is the
    caller's own (no collective)."""
    if _one_stage():
        return tensor
    if not is_last_stage():
        tensor = torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(tensor, **_from_last_rank())
    return tensor


def object_from_last_stage(obj):
    """The last stage's picklable `obj` on every rank of the pipeline group (the others pass None);
    without pipeline stages the caller's own (nothing pickled)."""
    if _one_stage():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, **_from_last_rank())
    return box[0]
