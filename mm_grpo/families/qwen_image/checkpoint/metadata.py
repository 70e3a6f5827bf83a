"""Qwen-Image's metadata in a checkpoint: the model's architecture and the parallel layout (the format
and the shard set every family shares are mm_grpo/checkpoint/metadata.py's).

It is stored as JSON in every shard file under `paths.META_KEY`, and with it a reader needs nothing
else: which shard files exist, which blocks each model chunk holds (and so every tensor's local name),
and how each tensor is cut across TP ranks (the model's layout rules, transformer/layout.py).

A checkpoint without it (Megatron's or MindSpeed-MM's own save of these chunks) is refused in one line:
its shards would tell the layout and most of the architecture, but not `axes_dims_rope` (RoPE has no
weights) nor `patch_size` (the output projection holds patch_size^2 x out_channels rows), and every
writer of Qwen-Image checkpoints today (mm-convert, mm-grpo's training) stores it.
"""
import dataclasses
import os
from typing import Callable, Iterator, List, Optional, Tuple

from mm_grpo.checkpoint.metadata import FORMAT, FORMAT_VERSION, check_format, check_shards, read_stored
from mm_grpo.checkpoint.paths import META_KEY, SHARD_FILE, model_key, shard_folders, shard_name
from mm_grpo.checkpoint.shard_io import ShardReader
from mm_grpo.families.qwen_image.transformer import layout
from mm_grpo.families.qwen_image.transformer.config import QwenImageConfig
from mm_grpo.families.qwen_image.transformer.model import check_parallel_sizes
from mm_grpo.parallel.pipeline_layout import StageSpec, normalize_pp_layers, stage_specs

MODEL = "qwen-image"  # the `model` entry of the stored metadata


def architecture(config: QwenImageConfig) -> dict:
    """The diffusers fields that shape the weights; out_channels None means in_channels (diffusers')."""
    return dict(config.to_diffusers_config(), out_channels=config.out_channels or config.in_channels)


def check_same_architecture(config: QwenImageConfig, expected: QwenImageConfig, what: str, other: str):
    """One line naming every field in which `config` (of `what`) differs from `expected` (of `other`)."""
    ours, theirs = architecture(config), architecture(expected)
    wrong = [f"{k} {ours[k]} ({other}: {theirs[k]})" for k in ours if ours[k] != theirs[k]]
    if wrong:
        raise ValueError(f"{what} holds another Qwen-Image architecture than {other}: {', '.join(wrong)}")


@dataclasses.dataclass(frozen=True)
class CheckpointMeta:
    config: QwenImageConfig
    tp_size: int = 1
    pp_layers: Optional[tuple] = None  # as pipeline_layout takes it; None = one stage
    dtype: Optional[str] = None  # torch dtype name of the weights, e.g. "bfloat16"; None: mixed
    model: str = MODEL

    def __post_init__(self):
        if self.model != MODEL:
            raise ValueError(f"unsupported model {self.model!r} in checkpoint metadata (only {MODEL!r})")
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
        return cls(QwenImageConfig.from_diffusers_config(data["config"]), parallel["tp_size"],
                   parallel["pp_layers"], data.get("dtype"), data["model"])

    @classmethod
    def load(cls, folder: str) -> "CheckpointMeta":
        """The metadata of one iteration folder, as its shards store it."""
        return read_meta(folder)


def read_meta(folder: str, shard: Optional[Callable[[int, int], ShardReader]] = None) -> CheckpointMeta:
    """The stored CheckpointMeta of `folder`, its shard set checked against it. `shard(tp, pp)` opens a
    shard (a caller's cache); by default shards are opened here."""
    found = shard_folders(folder)
    opened = {}

    def open_here(tp, pp):
        if (tp, pp) not in opened:
            opened[(tp, pp)] = ShardReader(os.path.join(folder, found[(tp, pp)], SHARD_FILE))
        return opened[(tp, pp)]

    shard = shard or open_here
    try:
        if (0, 0) not in found:
            raise FileNotFoundError(f"{folder} has no first shard (mp_rank_00 or mp_rank_00_000): incomplete "
                                    "checkpoint")
        first = shard(0, 0)
        stored = first.tree.get(META_KEY)
        if stored is None:
            raise ValueError(f"{first.path} has no mm-grpo metadata ({META_KEY}): a Qwen-Image checkpoint saved "
                             "without it (by Megatron or MindSpeed-MM) cannot tell its RoPE axes and patch size; "
                             "convert the model from its diffusers folder instead")
        model = stored.get("model") if isinstance(stored, dict) else None
        if model is not None and model != MODEL:
            raise ValueError(f"{first.path} is a checkpoint of model {model!r}, not Qwen-Image")
        meta = read_stored(first.path, stored, CheckpointMeta.from_json)
        check_shards(folder, meta.tp_size, meta.pp_size, meta.pp_layers, found)
        return meta
    finally:
        for reader in opened.values():
            reader.close()
