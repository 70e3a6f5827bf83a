"""Megatron's full activation recompute, over the blocks of one model chunk.

`--recompute-granularity full --recompute-method M --recompute-num-layers N` mean what they mean in
Megatron (`TransformerBlock._checkpointed_forward`), counted over the blocks of one model chunk: a
pipeline stage, or one virtual chunk of it (FLUX: its double- then single-stream blocks in order).

- uniform: the blocks in groups of N in order (the last group may be shorter); each group keeps only
  its input and runs again in the backward. N = 1 recomputes every block, one at a time.
- block: the first N blocks, one at a time, keep only their input; the others keep every activation,
  so memory left on the card buys fewer recomputed forwards.

Megatron's `--recompute-activations` is its `--recompute-granularity selective` (core attention only),
which mm-grpo's models do not implement: both are refused in one line, as MindSpeed-MM's own
HunyuanVideo DiT refuses selective.
"""
import dataclasses
from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

METHODS = ("uniform", "block")
FULL = "full"
FULL_FLAGS = ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 (every block), "
              "or --recompute-method block --recompute-num-layers N (the first N blocks of each pipeline stage)")


@dataclasses.dataclass(frozen=True)
class Recompute:
    """Which blocks of a model chunk keep only their input and run again in the backward."""
    method: str  # one of METHODS
    num_layers: int  # uniform: blocks per recomputed group; block: blocks recomputed per chunk

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"recompute method {self.method!r}: must be one of {', '.join(METHODS)}")
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ValueError(f"recompute num_layers must be a whole number >= 1, got {self.num_layers!r}")

    def spans(self, count: int):
        """[(start, end, recomputed)] covering blocks 0..count-1 in order."""
        n = self.num_layers
        if self.method == "uniform":
            return [(i, min(i + n, count), True) for i in range(0, count, n)]
        first = min(n, count)
        return [(i, i + 1, True) for i in range(first)] + ([(first, count, False)] if first < count else [])


EVERY_BLOCK = Recompute("uniform", 1)  # model.json's `recompute_blocks: true` (older configs)


def recompute_flags(recompute: Optional[Recompute]) -> list:
    """Megatron's command-line flags for `recompute` (none for None)."""
    if recompute is None:
        return []
    return ["--recompute-granularity", FULL, "--recompute-method", recompute.method,
            "--recompute-num-layers", str(recompute.num_layers)]


EVERY_BLOCK_FLAGS = recompute_flags(EVERY_BLOCK)


def recompute_fields(recompute: Optional[Recompute]) -> dict:
    """A model config's plain-data fields for `recompute` (None: no recompute)."""
    return {"recompute_method": recompute.method if recompute else None,
            "recompute_num_layers": recompute.num_layers if recompute else None}


def config_recompute(method: Optional[str], num_layers: Optional[int]) -> Optional[Recompute]:
    """The Recompute a model config's fields name (`recompute_fields`), refused in one line when only one is set."""
    if method is None and num_layers is None:
        return None
    if method is None or num_layers is None:
        raise ValueError(f"recompute_method ({method!r}) and recompute_num_layers ({num_layers!r}) go together: "
                         "set both, or neither for no recompute")
    return Recompute(method, num_layers)


def block_recompute_fields(block: dict, where: str) -> dict:
    """The recompute fields of a model config from a predictor block: its `recompute_method` and
    `recompute_num_layers` (what the trainers and MindSpeed-MM's arguments set), or `recompute_blocks: true`
    (older model.json files: every block, one at a time); {} for neither."""
    named = {k: block[k] for k in ("recompute_method", "recompute_num_layers") if block.get(k) is not None}
    if named and block.get("recompute_blocks"):
        raise ValueError(f"{where}: recompute_blocks and {' / '.join(named)} both set: give recompute_method and "
                         "recompute_num_layers (recompute_blocks: true is recompute_method uniform, num_layers 1)")
    if named:
        return recompute_fields(config_recompute(named.get("recompute_method"), named.get("recompute_num_layers")))
    return recompute_fields(EVERY_BLOCK) if block.get("recompute_blocks") else {}


def recompute_from_flags(granularity: Optional[str], method: Optional[str], num_layers: Optional[int],
                         activations: bool = False) -> Optional[Recompute]:
    """The Recompute of Megatron's flags (None: no recompute), or a one-line refusal naming the flag."""
    if activations or granularity == "selective":
        given = "--recompute-activations (Megatron's selective recompute)" if activations else \
            "--recompute-granularity selective"
        raise ValueError(f"{given}: recomputing core attention only is not implemented by mm-grpo's models; "
                         f"recompute whole blocks with {FULL_FLAGS}")
    if granularity is None:
        given = [flag for flag, value in (("--recompute-method", method), ("--recompute-num-layers", num_layers))
                 if value is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} given without --recompute-granularity full: add it, or drop "
                             f"{' and '.join(given)} for no recompute")
        return None
    if granularity != FULL:
        raise ValueError(f"--recompute-granularity {granularity!r}: must be full (or selective, refused)")
    if method is None:
        raise ValueError(f"--recompute-granularity full needs --recompute-method ({' or '.join(METHODS)}): "
                         f"{FULL_FLAGS}")
    if num_layers is None:
        raise ValueError("--recompute-granularity full needs --recompute-num-layers: the blocks in each recomputed "
                         "group (uniform) or the blocks recomputed in each pipeline stage (block)")
    return Recompute(method, num_layers)


def with_megatron_recompute(block: dict) -> dict:
    """A MindSpeed-MM predictor block with Megatron's --recompute-* arguments applied, as MindSpeed-MM's own
    DiTs read them (`get_args()`, HunyuanVideo's): given, they replace the block's recompute (its older
    `recompute_blocks` too); not given, or outside Megatron-LM's training, the block is as it was."""
    try:
        from megatron.training import get_args
        args = get_args()
    except (ImportError, AssertionError):  # the megatron-core wheel, or no Megatron arguments parsed
        return block
    recompute = recompute_from_flags(*(getattr(args, f"recompute_{k}", None)
                                       for k in ("granularity", "method", "num_layers")))
    if recompute is None:
        return block
    return dict({k: v for k, v in block.items() if k != "recompute_blocks"}, **recompute_fields(recompute))


def _run(blocks, x, *args):
    for block in blocks:
        x = block(x, *args)
    return x


def run_blocks(blocks, x, recompute: Optional[Recompute], *args):
    """x through `blocks` in order (`block(x, *args) -> x`), the spans `recompute` names recomputed in
    the backward when autograd records (never in the rollout's no-grad forwards)."""
    blocks = list(blocks)
    if recompute is None or not torch.is_grad_enabled():
        return _run(blocks, x, *args)
    for start, end, again in recompute.spans(len(blocks)):
        if again:
            x = checkpoint(_run, blocks[start:end], x, *args, use_reentrant=False)
        else:
            x = _run(blocks[start:end], x, *args)
    return x
