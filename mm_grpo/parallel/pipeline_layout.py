"""Which blocks each pipeline stage owns, from `pp_layers` (the converter's argument too).

`pp_layers` counts blocks per stage over the block sequence [double..., single...]:
`[n_0, ..., n_{P-1}]` for P stages, or a nested list `[[n_00, ..., n_0P], [n_10, ...], ...]`
with one inner list per virtual chunk (Megatron's interleaved order: chunk 0 of every
stage, then chunk 1 of every stage, ...).
"""
import dataclasses
from typing import Dict, List, Sequence, Tuple, Union

PPLayers = Union[Sequence[int], Sequence[Sequence[int]]]


@dataclasses.dataclass(frozen=True)
class StageSpec:
    pp_rank: int
    vchunk: int
    block_range: Tuple[int, int]
    pre_process: bool  # owns the embedders
    post_process: bool  # owns the final norm and projection


def normalize_pp_layers(pp_layers: PPLayers, num_blocks: int) -> List[List[int]]:
    """Validated [vchunk][pp_rank] block counts."""
    if pp_layers is None or len(pp_layers) == 0:
        return [[num_blocks]]
    nested = all(isinstance(x, (list, tuple)) for x in pp_layers)
    if not nested and any(isinstance(x, (list, tuple)) for x in pp_layers):
        raise ValueError(f"pp_layers {pp_layers} mixes numbers and lists")
    chunks = [list(c) for c in pp_layers] if nested else [list(pp_layers)]
    if len({len(c) for c in chunks}) != 1:
        raise ValueError(f"pp_layers {pp_layers}: every virtual chunk needs one count per stage")
    counts = [n for c in chunks for n in c]
    if any(not isinstance(n, int) or n < 1 for n in counts):
        raise ValueError(f"pp_layers {pp_layers}: every stage needs a whole number >= 1 of blocks")
    if sum(counts) != num_blocks:
        raise ValueError(f"pp_layers {pp_layers} sums to {sum(counts)}, but the model has "
                         f"{num_blocks} blocks (double + single)")
    return chunks


def stage_specs(pp_layers: PPLayers, num_blocks: int) -> Dict[Tuple[int, int], StageSpec]:
    """{(pp_rank, vchunk): StageSpec} in the global block order."""
    chunks = normalize_pp_layers(pp_layers, num_blocks)
    n_v, n_p = len(chunks), len(chunks[0])
    specs, start = {}, 0
    for v in range(n_v):
        for p in range(n_p):
            end = start + chunks[v][p]
            specs[(p, v)] = StageSpec(p, v, (start, end), pre_process=(p == 0 and v == 0),
                                      post_process=(p == n_p - 1 and v == n_v - 1))
            start = end
    return specs


def resolve_pp_layers(pp_layers: PPLayers, num_blocks: int, pp: int, vpp: int) -> List[List[int]]:
    """[vchunk][pp_rank] block counts for pp stages x vpp virtual stages (even split if None)."""
    if pp_layers is None:
        stages = pp * vpp
        if num_blocks % stages:
            raise ValueError(
                f"{num_blocks} blocks do not split evenly over {pp} pipeline stages x {vpp} virtual "
                f"stages: pass pp_layers (blocks per stage) explicitly")
        return [[num_blocks // stages] * pp for _ in range(vpp)]
    chunks = normalize_pp_layers(pp_layers, num_blocks)
    if len(chunks[0]) != pp:
        raise ValueError(f"pp_layers {pp_layers} has {len(chunks[0])} stages, but the pipeline-model-"
                         f"parallel size is {pp}")
    if len(chunks) != vpp:
        raise ValueError(f"pp_layers {pp_layers} has {len(chunks)} virtual chunk(s) per stage, but the "
                         f"virtual pipeline size is {vpp} (use one inner list per virtual chunk)")
    return chunks
