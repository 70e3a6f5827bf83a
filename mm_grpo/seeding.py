"""Random draws keyed by integers (seed, stream, iteration, sample...), so that a draw depends on
what it is for, not on how many draws came before it: results then do not depend on the parallel
layout, and a resumed run repeats an uninterrupted one."""
import torch


def seeded_generator(*keys: int) -> torch.Generator:
    """A CPU generator seeded from integers (stable across runs, processes and layouts)."""
    seed = 0
    for k in keys:
        seed = (seed * 1_000_003 + int(k)) % (2**63 - 1)
    return torch.Generator().manual_seed(seed)
