"""FLUX transformer configuration: plain data, with presets and diffusers interop."""
import dataclasses
import functools
import os
from typing import Annotated, Literal, Optional, Tuple

from pydantic import Field

from mm_grpo.files.jsonfile import load_json
from mm_grpo.recompute import METHODS, config_recompute
from mm_grpo.settings import Count, NonNegative, read_block

FLUX_DEV_GUIDANCE = 3.5  # FLUX.1-dev's guidance embedding value (diffusers' FluxPipeline default guidance_scale)

# Fields of diffusers' FluxTransformer2DModel config that define the architecture.
DIFFUSERS_FIELDS = (
    "patch_size", "in_channels", "out_channels", "num_layers", "num_single_layers",
    "attention_head_dim", "num_attention_heads", "joint_attention_dim",
    "pooled_projection_dim", "guidance_embeds", "axes_dims_rope",
)


@dataclasses.dataclass(frozen=True)
class FluxConfig:
    """FLUX's architecture and run-time options; the types (with their bounds) are what a config.json or
    a predictor block may hold (`from_diffusers_config`, mm_grpo/settings.py `read_block`)."""
    # Architecture (diffusers' names and meanings).
    patch_size: Count = 1
    in_channels: Count = 64
    out_channels: Optional[Count] = None
    num_layers: NonNegative = 19  # double-stream blocks
    num_single_layers: NonNegative = 38
    attention_head_dim: Count = 128
    num_attention_heads: Count = 24
    joint_attention_dim: Count = 4096
    pooled_projection_dim: Count = 768
    guidance_embeds: bool = True
    axes_dims_rope: Annotated[Tuple[NonNegative, NonNegative, NonNegative], Field(
        description="a list of three even whole numbers summing to attention_head_dim")] = (16, 56, 56)
    # Fixed by FLUX.1; kept here so the numbers are not scattered through the code.
    mlp_ratio: float = 4.0
    rope_theta: int = 10000
    norm_eps: float = 1e-6
    # Runtime options (not part of the checkpoint).
    recompute_method: Optional[Literal[METHODS]] = None  # Megatron's full recompute (mm_grpo/recompute.py)
    recompute_num_layers: Optional[Count] = None
    bf16: bool = False  # compute in bf16 (model.compute_dtype; norm statistics and RoPE stay fp32)
    compile_blocks: bool = False  # torch.compile each block: fuses its element-wise chains

    def __post_init__(self):
        object.__setattr__(self, "axes_dims_rope", tuple(self.axes_dims_rope))
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError(
                f"axes_dims_rope {self.axes_dims_rope} must sum to attention_head_dim "
                f"({self.attention_head_dim})")
        if any(d % 2 for d in self.axes_dims_rope):
            raise ValueError(f"axes_dims_rope {self.axes_dims_rope} must all be even")
        config_recompute(self.recompute_method, self.recompute_num_layers)  # both or neither

    @functools.cached_property  # read by every forward; derived from the two fields once
    def recompute(self):
        """The blocks recomputed in the backward (`mm_grpo.recompute.Recompute`), or None."""
        return config_recompute(self.recompute_method, self.recompute_num_layers)

    @property
    def hidden_size(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def mlp_hidden_size(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    @property
    def output_channels(self) -> int:
        return self.patch_size * self.patch_size * (self.out_channels or self.in_channels)

    @property
    def num_blocks(self) -> int:
        """Length of the block sequence [double blocks, then single blocks]."""
        return self.num_layers + self.num_single_layers

    def replace(self, **changes) -> "FluxConfig":
        return dataclasses.replace(self, **changes)

    # --- diffusers interop -------------------------------------------------------
    def to_diffusers_config(self) -> dict:
        cfg = {k: getattr(self, k) for k in DIFFUSERS_FIELDS}
        cfg["axes_dims_rope"] = list(self.axes_dims_rope)
        return cfg

    @classmethod
    def from_diffusers_config(cls, config, **runtime) -> "FluxConfig":
        """From a diffusers config dict, a `config.json` path, or a transformer folder; a value of the
        wrong type or out of its range is one line naming the file and the key."""
        where = "FLUX config"
        if isinstance(config, (str, os.PathLike)):
            where = os.path.join(config, "config.json") if os.path.isdir(config) else str(config)
            config = load_json(where, "diffusers config.json")
            if not isinstance(config, dict):
                raise ValueError(f"{where} must hold a JSON object, got {type(config).__name__}")
        elif not isinstance(config, dict) or set(config) - set(DIFFUSERS_FIELDS):
            # written by hand (model.json's predictor.config): a misspelt field must not fall back
            # to FLUX.1-dev's value silently. A config.json may hold more (diffusers adds fields).
            unknown = sorted(set(config) - set(DIFFUSERS_FIELDS)) if isinstance(config, dict) else config
            raise ValueError(f"unknown FLUX config field(s) {unknown}; known: {', '.join(DIFFUSERS_FIELDS)}")
        arch = {k: config[k] for k in DIFFUSERS_FIELDS if k in config}
        return read_block(cls, {**arch, **runtime}, where)

    @classmethod
    def preset(cls, name: str, **overrides) -> "FluxConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown FLUX preset {name!r}; choose one of {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)


PRESETS = {
    "flux-dev": FluxConfig(guidance_embeds=True),
    "flux-schnell": FluxConfig(guidance_embeds=False),
    # Runs a forward in a few milliseconds on CPU; 4 heads so TP/SP up to 4 divide.
    # Matches the transformer of the tiny pipeline (16 = 4 VAE channels packed 2x2).
    "tiny": FluxConfig(
        in_channels=16, num_layers=2, num_single_layers=4, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=32,
        guidance_embeds=True, axes_dims_rope=(4, 6, 6)),
}
