"""mm-grpo's metadata of a checkpoint: model config and parallel layout.

With it a reader needs nothing else: which shard files exist, which blocks each model
chunk holds (and so every tensor's local name), and how each tensor is cut across TP
ranks (from the model's layout rules). Its JSON form is stored in every shard file under
`paths.META_KEY`; a checkpoint written by Megatron or MindSpeed-MM has none, and then the
layout is inferred from the shards (`mm_grpo.checkpoint.infer`).
"""
import dataclasses
from typing import Iterator, List, Optional, Tuple

from mm_grpo.checkpoint.paths import model_key, shard_name
from mm_grpo.models.flux import layout
from mm_grpo.models.flux.config import FluxConfig
from mm_grpo.models.flux.model import check_parallel_sizes
from mm_grpo.parallel.pipeline_layout import StageSpec, normalize_pp_layers, stage_specs

FORMAT = "mm-grpo/megatron-torch"
FORMAT_VERSION = 1


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
        if data.get("format") != FORMAT or data.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"unknown checkpoint metadata format {data.get('format')!r} "
                             f"v{data.get('format_version')} (expected {FORMAT!r} v{FORMAT_VERSION})")
        parallel = data["parallel"]
        return cls(FluxConfig.from_diffusers_config(data["config"]), parallel["tp_size"],
                   parallel["pp_layers"], data.get("dtype"), data["model"])

    @classmethod
    def load(cls, folder: str, config: Optional[FluxConfig] = None) -> "CheckpointMeta":
        """The metadata of one iteration folder: what its shards store, else inferred from them
        (`config` supplies what the weights cannot tell, see `infer.read_meta`)."""
        from mm_grpo.checkpoint.infer import read_meta
        return read_meta(folder, config)
