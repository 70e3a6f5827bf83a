"""Parallel state (TP / PP / CP-Ulysses / DP) on top of megatron-core's parallel_state."""
from mm_grpo.parallel.state import ParallelConfig, destroy_parallel, initialize_parallel

__all__ = ["ParallelConfig", "destroy_parallel", "initialize_parallel"]
