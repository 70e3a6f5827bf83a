"""Building a tiny diffusers pipeline folder: each component's weights under its own seed, and the
folder written atomically."""
from pathlib import Path

import torch

from mm_grpo.files.atomic import atomic_dir


def seeded(seed, build):
    """`build()` under `seed`, leaving the caller's RNG as it was (one seed per component: changing
    one does not shift the others)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def write_pipeline(path, make_pipeline) -> Path:
    """`make_pipeline()` saved as the diffusers folder `path` (which must not exist), atomically; the
    pipeline is built once the folder is known to be free."""
    with atomic_dir(path) as tmp:
        make_pipeline().save_pretrained(tmp, safe_serialization=True)
    return Path(path)
