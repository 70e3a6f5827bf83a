"""What every family's checkpoint shares of mm-grpo's metadata: its format tag, the parallel layout
it records, and the shard set that layout names.

mm-grpo stores its metadata (JSON) in every shard file under `paths.META_KEY`: the format tag, the
model and its config (the family's own: families/<name>/checkpoint/), and `parallel` (TP, PP and
virtual sizes, blocks per stage). A checkpoint written by Megatron or MindSpeed-MM has none: its
shard grid must then have no gap and agree with the `args` Megatron saved. Checking the shard set
needs only this (`check_shard_set`, before any model is built); reading the weights needs the
family's layout.
"""
import os
import re
from typing import Callable, Tuple

from mm_grpo.checkpoint.paths import META_KEY, SHARD_FILE, shard_name
from mm_grpo.checkpoint.shard_io import ShardReader

FORMAT = "mm-grpo/megatron-torch"
FORMAT_VERSION = 1
EXTRA_STATE = "._extra_state"  # Megatron's non-TE linears save None here; not a weight
CHUNK_KEY = re.compile(r"model(\d*)")  # a model chunk's state dict in a shard


def check_format(data: dict):
    if data.get("format") != FORMAT or data.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"unknown checkpoint metadata format {data.get('format')!r} "
                         f"v{data.get('format_version')} (expected {FORMAT!r} v{FORMAT_VERSION})")


def parallel_layout(data: dict) -> Tuple[int, int, object]:
    """(TP size, PP size, pp_layers) the stored metadata `data` records."""
    check_format(data)
    parallel = data["parallel"]
    return parallel["tp_size"], parallel["pp_size"], parallel["pp_layers"]


def read_stored(path, data, parse: Callable[[dict], object]):
    """`parse(data)` of the metadata stored in the shard file `path`; one line naming the file when it
    is not ours."""
    if not isinstance(data, dict):
        detail = f"a {type(data).__name__}, not a dict"
    else:
        try:
            return parse(data)
        except KeyError as e:
            detail = f"no {e} entry"
        except (TypeError, ValueError, AttributeError) as e:
            detail = f"{type(e).__name__}: {' '.join(str(e).split())}"
    raise ValueError(f"{path}: its mm-grpo metadata ({META_KEY}) is unreadable ({detail}); the checkpoint cannot be "
                     "read without it") from None


def check_shards(folder, tp_size: int, pp_size: int, pp_layers, found: dict):
    """The shard folders `found` are exactly those of the layout (TP x PP, Megatron's names)."""
    expected = {(tp, pp) for tp in range(tp_size) for pp in range(pp_size)}
    layout = f"layout: TP {tp_size}, pp_layers {pp_layers}"
    for tp, pp in sorted(expected - set(found)):
        path = os.path.join(folder, shard_name(tp, pp, pp_size), SHARD_FILE)
        raise FileNotFoundError(f"checkpoint shard {path} is missing ({layout})")
    extra = sorted(found[k] for k in set(found) - expected)
    if extra or any(found[k] != shard_name(*k, pp_size) for k in expected):
        raise ValueError(f"{folder} holds shard folders of another layout ({', '.join(extra) or 'PP naming'}; {layout})")


def grid(folder, found) -> Tuple[int, int]:
    """(TP size, PP size) of the shard folders present, refusing a gap in their grid."""
    tp_size, pp_size = (1 + max(k[i] for k in found) for i in (0, 1))
    for tp, pp in ((t, p) for t in range(tp_size) for p in range(pp_size)):
        if (tp, pp) not in found:  # a gap in the grid: the names say which file is missing
            path = os.path.join(folder, shard_name(tp, pp, pp_size), SHARD_FILE)
            raise FileNotFoundError(f"checkpoint shard {path} is missing")
    return tp_size, pp_size


def check_args(folder, args, tp_size, pp_size, vpp_size):
    """Megatron's saved args name the layout the job ran with: a shard grid that disagrees
    means shards are missing (or belong to another save)."""
    for name, held in (("tensor_model_parallel_size", tp_size), ("pipeline_model_parallel_size", pp_size),
                       ("virtual_pipeline_model_parallel_size", vpp_size)):
        said = getattr(args, name, None)
        if said is not None and said != held:
            raise ValueError(f"{folder}: the saved args say {name} = {said}, the shards hold {held}: incomplete checkpoint?")


def chunk_keys(tree: dict) -> list:
    """The model chunks' state-dict keys of a shard tree ('model', 'model0', 'model1'...)."""
    return [k for k, v in tree.items() if isinstance(k, str) and CHUNK_KEY.fullmatch(k) and isinstance(v, dict)]


def shard_extras(reader: ShardReader) -> dict:
    """A shard's entries other than the model chunks and mm-grpo's metadata (optimizer, RNG states,
    iteration...), read."""
    return {k: reader.load(k) for k in reader.tree
            if k != META_KEY and not (isinstance(k, str) and CHUNK_KEY.fullmatch(k))}


def check_shard_set(folder, found: dict, first: ShardReader):
    """The shard folders `found` are those the layout names, read from the first shard's pickle only
    (no weights, no architecture inferred): its stored metadata, else (written by Megatron or
    MindSpeed-MM) a grid without gaps that agrees with Megatron's saved args. Raises one line."""
    stored = first.tree.get(META_KEY)
    if stored is not None:
        check_shards(folder, *read_stored(first.path, stored, parallel_layout), found)
        return
    tp_size, pp_size = grid(folder, found)
    chunks = chunk_keys(first.tree)
    vpp_size = 1 if "model" in chunks or not chunks else len(chunks)
    check_args(folder, first.tree.get("args"), tp_size, pp_size, vpp_size)
