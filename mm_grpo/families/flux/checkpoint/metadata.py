"""FLUX's metadata in a checkpoint: model config and parallel layout (the format and the shard set
every family shares are mm_grpo/checkpoint/metadata.py's).

With it a reader needs nothing else: which shard files exist, which blocks each model
chunk holds (and so every tensor's local name), and how each tensor is cut across TP
ranks (from the model's layout rules). Its JSON form is stored in every shard file under
`paths.META_KEY`; a checkpoint written by Megatron or MindSpeed-MM has none, and then the
layout is inferred from the shards (`read_meta`).

What the shards tell: the TP and PP sizes (shard folder names, checked against the saved
`args`), the virtual chunks (`model0`, `model1`...), the blocks of every chunk
(`double_blocks.N`, `single_blocks.N`), and from the shapes the hidden size, the heads
(the q/k RMSNorm width is head_dim), the input, text, pooled and output widths and
whether there is a guidance embedder. What they cannot tell: `axes_dims_rope` (RoPE has no
weights) and `patch_size` (the output projection holds patch_size^2 x out_channels rows;
FLUX uses 1). Those come from the `config` given (the model being loaded, or the
`--cfg.hf_dir` config.json of mm_to_hf), else from the run's `predictor` block that
MindSpeed-MM saves in `args.mm`; without either, reading stops with one line saying so.
"""
import dataclasses
import os
import re
from typing import Callable, Iterator, List, Optional, Tuple

from mm_grpo.checkpoint.metadata import (EXTRA_STATE, FORMAT, FORMAT_VERSION, check_args, check_format, check_shards,
                                         chunk_keys, grid, read_stored)
from mm_grpo.checkpoint.paths import META_KEY, SHARD_FILE, model_key, shard_folders, shard_name
from mm_grpo.checkpoint.shard_io import Opaque, ShardReader
from mm_grpo.families.flux.transformer import layout
from mm_grpo.families.flux.transformer.config import FluxConfig
from mm_grpo.families.flux.transformer.model import check_parallel_sizes
from mm_grpo.parallel.pipeline_layout import StageSpec, normalize_pp_layers, stage_specs


@dataclasses.dataclass(frozen=True)
class CheckpointMeta:
    config: FluxConfig
    tp_size: int = 1
    pp_layers: Optional[tuple] = None  # as pipeline_layout takes it; None = one stage
    dtype: Optional[str] = None  # torch dtype name of the weights, e.g. "bfloat16"
    model: str = "flux"

    def __post_init__(self):
        if self.model != "flux":
            raise ValueError(f"unsupported model {self.model!r} in checkpoint metadata (only 'flux')")
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp_size must be a whole number >= 1, got {self.tp_size!r}")
        check_parallel_sizes(self.config, self.tp_size)
        chunks = normalize_pp_layers(self.pp_layers, self.config.num_blocks)
        object.__setattr__(self, "pp_layers", chunks[0] if len(chunks) == 1 else chunks)

    @property
    def chunks(self) -> List[List[int]]:
        """Block counts as [vchunk][pp_rank]."""
        return normalize_pp_layers(self.pp_layers, self.config.num_blocks)

    @property
    def pp_size(self) -> int:
        return len(self.chunks[0])

    @property
    def vpp_size(self) -> int:
        return len(self.chunks)

    def shard_name(self, tp_rank: int, pp_rank: int) -> str:
        return shard_name(tp_rank, pp_rank, self.pp_size)

    def stages(self) -> Iterator[Tuple[StageSpec, str]]:
        """(stage spec, model key in its shard) for every model chunk, in global block order."""
        specs = stage_specs(self.pp_layers, self.config.num_blocks)
        for v in range(self.vpp_size):
            for p in range(self.pp_size):
                yield specs[(p, v)], model_key(v, self.vpp_size)

    def rules(self, spec: StageSpec) -> List[layout.Rule]:
        return list(layout.stage_rules(self.config, spec.block_range, spec.pre_process, spec.post_process))

    # --- JSON -----------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": FORMAT, "format_version": FORMAT_VERSION, "model": self.model,
                "config": self.config.to_diffusers_config(),
                "parallel": {"tp_size": self.tp_size, "pp_size": self.pp_size, "vpp_size": self.vpp_size,
                             "pp_layers": self.pp_layers},
                "dtype": self.dtype}

    @classmethod
    def from_json(cls, data: dict) -> "CheckpointMeta":
        check_format(data)
        parallel = data["parallel"]
        return cls(FluxConfig.from_diffusers_config(data["config"]), parallel["tp_size"],
                   parallel["pp_layers"], data.get("dtype"), data["model"])

    @classmethod
    def load(cls, folder: str, config: Optional[FluxConfig] = None) -> "CheckpointMeta":
        """The metadata of one iteration folder: what its shards store, else inferred from them
        (`config` supplies what the weights cannot tell, see `read_meta`)."""
        return read_meta(folder, config)


_BLOCK = re.compile(r"(double_blocks|single_blocks)\.(\d+)\.")
# Fields compared with a given config (the others the weights cannot tell).
_INFERRED = ("in_channels", "num_layers", "num_single_layers", "attention_head_dim", "num_attention_heads",
             "joint_attention_dim", "pooled_projection_dim", "guidance_embeds", "output_channels")


def read_meta(folder: str, config: Optional[FluxConfig] = None,
              shard: Optional[Callable[[int, int], ShardReader]] = None) -> CheckpointMeta:
    """The CheckpointMeta of `folder`: from its shards' metadata, else inferred (module doc).
    `shard(tp, pp)` opens a shard (a caller's cache); by default shards are opened here."""
    found = shard_folders(folder)
    opened = {}

    def open_here(tp, pp):
        if (tp, pp) not in opened:
            opened[(tp, pp)] = ShardReader(os.path.join(folder, found[(tp, pp)], SHARD_FILE))
        return opened[(tp, pp)]

    shard = shard or open_here
    try:
        if (0, 0) not in found:
            raise FileNotFoundError(f"{folder} has no first shard (mp_rank_00 or mp_rank_00_000): incomplete checkpoint")
        stored = shard(0, 0).tree.get(META_KEY)
        meta = (read_stored(shard(0, 0).path, stored, CheckpointMeta.from_json) if stored is not None
                else _infer(folder, found, shard, config))
        check_shards(folder, meta.tp_size, meta.pp_size, meta.pp_layers, found)
        return meta
    finally:
        for reader in opened.values():
            reader.close()


# --- a layout inferred from the shards -----------------------------------------------------
def _infer(folder, found, shard, config: Optional[FluxConfig]) -> CheckpointMeta:
    tp_size, pp_size = grid(folder, found)
    args = shard(0, 0).tree.get("args")
    stages = [_model_chunks(folder, shard(0, pp)) for pp in range(pp_size)]
    check_args(folder, args, tp_size, pp_size, len(stages[0]))
    if len({len(s) for s in stages}) != 1:
        raise ValueError(f"{folder}: pipeline stages hold different numbers of virtual chunks")
    chunks = [[stages[pp][v] for pp in range(pp_size)] for v in range(len(stages[0]))]
    counts = [[_block_counts(folder, sd) for sd in row] for row in chunks]
    order = [c for row in counts for c in row]  # Megatron's interleaved order: chunk 0 of every stage first
    first_single = next((i for i, (_, singles) in enumerate(order) if singles), len(order))
    if any(doubles for doubles, _ in order[first_single + 1:]):  # within a chunk doubles come first
        raise ValueError(f"{folder}: double-stream blocks after single-stream ones: not FLUX's block order")
    pp_layers = [[d + s for d, s in row] for row in counts]
    fields = _architecture(folder, chunks, tp_size, sum(d for d, _ in order), sum(s for _, s in order))
    if config is not None:
        _check_given(folder, fields, config)
    else:
        config = _config(folder, fields, _rope_from_args(args))
    dtypes = {t.dtype for t in chunks[0][0].values() if hasattr(t, "dtype")}
    dtype = str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else None
    return CheckpointMeta(config, tp_size, pp_layers[0] if len(pp_layers) == 1 else pp_layers, dtype)


def _model_chunks(folder, reader: ShardReader) -> list:
    """A shard's model state dicts in virtual-chunk order, `_extra_state` entries dropped.
    `model` wins over `model0` (mm-grpo writes both, one object, in PP shards)."""
    keys = chunk_keys(reader.tree)
    if not keys:
        raise ValueError(f"{reader.path} holds no model state dict ('model' or 'model0', 'model1'...)")
    keys = ["model"] if "model" in keys else sorted(keys, key=lambda k: int(k[len("model"):]))
    return [{n: t for n, t in reader.tree[k].items() if not n.endswith(EXTRA_STATE)} for k in keys]


def _block_counts(folder, state_dict) -> tuple:
    """(double blocks, single blocks) of one chunk; their local numbers must run from 0."""
    numbers = {"double_blocks": set(), "single_blocks": set()}
    for name in state_dict:
        match = _BLOCK.match(name)
        if match:
            numbers[match[1]].add(int(match[2]))
    for kind, found in numbers.items():
        if found != set(range(len(found))):
            raise ValueError(f"{folder}: a model chunk's {kind} are numbered {sorted(found)}, not 0..{len(found) - 1}")
    return len(numbers["double_blocks"]), len(numbers["single_blocks"])


def _architecture(folder, chunks, tp_size, n_double, n_single) -> dict:
    first, last = chunks[0][0], chunks[-1][-1]
    every = {n: t for row in chunks for sd in row for n, t in sd.items()}

    def shape(state_dict, name, where):
        if name not in state_dict:
            raise ValueError(f"{folder}: {where} has no {name}: not a checkpoint of mm-grpo's FLUX model")
        return tuple(state_dict[name].shape)

    hidden, in_channels = shape(first, "x_embedder.weight", "the first model chunk")
    norm = next((n for n in every if n.endswith("q_norm.weight")), None)
    if norm is None:
        raise ValueError(f"{folder}: no transformer block holds a q_norm weight: not a FLUX checkpoint")
    head_dim = shape(every, norm, "")[0]
    if n_double:
        mlp = shape(every, "double_blocks.0.img_mlp.linear_fc1.weight", "a chunk with double blocks")[0] * tp_size
    else:
        mlp = shape(every, "single_blocks.0.linear_in.weight", "a chunk with single blocks")[0] * tp_size - 3 * hidden
    if hidden % head_dim or mlp != FluxConfig.mlp_ratio * hidden:
        raise ValueError(f"{folder}: hidden size {hidden}, head width {head_dim} and MLP width {mlp} are not "
                         f"FLUX's (heads x head_dim, {FluxConfig.mlp_ratio:g} x hidden)")
    return {"in_channels": in_channels, "num_layers": n_double, "num_single_layers": n_single,
            "attention_head_dim": head_dim, "num_attention_heads": hidden // head_dim,
            "joint_attention_dim": shape(first, "context_embedder.weight", "the first model chunk")[1],
            "pooled_projection_dim": shape(first, "time_text_embed.text_embedder.linear_1.weight",
                                           "the first model chunk")[1],
            "guidance_embeds": "time_text_embed.guidance_embedder.linear_1.weight" in first,
            "output_channels": shape(last, "final_layer.linear.weight", "the last model chunk")[0]}


def _check_given(folder, fields: dict, config: FluxConfig):
    wrong = [f"{k} {fields[k]} (given {getattr(config, k)})" for k in _INFERRED if getattr(config, k) != fields[k]]
    if wrong:
        raise ValueError(f"{folder} holds another FLUX architecture than the config given: {', '.join(wrong)}")


def _plain(value):
    """Stand-ins of a shard's foreign objects (Opaque) as dicts of their attributes."""
    if isinstance(value, Opaque):
        return {k: _plain(v) for k, v in vars(value).items() if not k.startswith("_")}
    return value


def _rope_from_args(args) -> Optional[tuple]:
    """axes_dims_rope of the run's flux predictor block (MindSpeed-MM keeps model.json in
    args.mm); the predictor fills a field the block leaves out with FluxConfig's default."""
    block = _plain(getattr(getattr(getattr(args, "mm", None), "model", None), "predictor", None))
    if not isinstance(block, dict) or block.get("model_id") != "flux":
        return None
    return tuple(block.get("axes_dims_rope", FluxConfig().axes_dims_rope))


def _config(folder, fields: dict, rope) -> FluxConfig:
    if rope is None:
        raise ValueError(
            f"{folder} has no mm-grpo metadata and cannot tell axes_dims_rope (RoPE has no weights, and the saved "
            "args hold no flux predictor block): give the model's config.json (mm-convert: --cfg.hf_dir)")
    arch = {k: v for k, v in fields.items() if k != "output_channels"}
    out = fields["output_channels"]  # patch_size 1 (FLUX): the output rows are out_channels
    try:
        return FluxConfig(**arch, out_channels=None if out == fields["in_channels"] else out, axes_dims_rope=rope)
    except ValueError as e:
        raise ValueError(f"{folder}: the saved predictor block does not fit the weights: {e}") from None
