"""Qwen-Image transformer configuration: plain data, with presets and diffusers interop."""
import dataclasses
import functools
import os
from typing import Annotated, Literal, Optional, Tuple

from pydantic import Field

from mm_grpo.files.jsonfile import load_json
from mm_grpo.recompute import METHODS, config_recompute
from mm_grpo.settings import Count, NonNegative, read_block

# Fields of diffusers' QwenImageTransformer2DModel config that define the architecture.
DIFFUSERS_FIELDS = (
    "patch_size", "in_channels", "out_channels", "num_layers", "attention_head_dim",
    "num_attention_heads", "joint_attention_dim", "axes_dims_rope",
)
# Fields diffusers' config holds for Qwen-Image's variants (Edit-2511's zero_cond_t, Layered's
# 3D RoPE and additional timestep condition, a guidance embedding no checkpoint has): the text-to-image
# model has them all off, and a config that turns one on is refused by name.
VARIANT_FIELDS = ("guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope")
# Written by diffusers into every config.json; nothing to check.
BOOKKEEPING_FIELDS = ("_class_name", "_diffusers_version", "_name_or_path", "pooled_projection_dim")


@dataclasses.dataclass(frozen=True)
class QwenImageConfig:
    """Qwen-Image's architecture and run-time options; the types (with their bounds) are what a
    config.json or a predictor block may hold (`from_diffusers_config`, mm_grpo/settings.py `read_block`)."""
    # Architecture (diffusers' names and meanings).
    patch_size: Count = 2
    in_channels: Count = 64  # 16 VAE channels packed 2 x 2
    out_channels: Optional[Count] = 16  # per patch position: proj_out gives patch_size^2 x out_channels
    num_layers: NonNegative = 60  # dual-stream blocks
    attention_head_dim: Count = 128
    num_attention_heads: Count = 24
    joint_attention_dim: Count = 3584  # Qwen2.5-VL-7B's hidden size
    axes_dims_rope: Annotated[Tuple[NonNegative, NonNegative, NonNegative], Field(
        description="a list of three even whole numbers summing to attention_head_dim")] = (16, 56, 56)
    # Fixed by Qwen-Image; kept here so the numbers are not scattered through the code.
    mlp_ratio: float = 4.0
    rope_theta: int = 10000
    norm_eps: float = 1e-6
    # Runtime options (not part of the checkpoint).
    recompute_method: Optional[Literal[METHODS]] = None  # Megatron's full recompute (mm_grpo/recompute.py)
    recompute_num_layers: Optional[Count] = None
    bf16: bool = False  # compute in bf16 (norm statistics and RoPE stay fp32)

    def __post_init__(self):
        object.__setattr__(self, "axes_dims_rope", tuple(self.axes_dims_rope))
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError(f"axes_dims_rope {self.axes_dims_rope} must sum to attention_head_dim "
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
        return self.num_layers

    def replace(self, **changes) -> "QwenImageConfig":
        return dataclasses.replace(self, **changes)

    # --- diffusers interop -------------------------------------------------------
    def to_diffusers_config(self) -> dict:
        cfg = {k: getattr(self, k) for k in DIFFUSERS_FIELDS}
        cfg["axes_dims_rope"] = list(self.axes_dims_rope)
        return cfg

    @classmethod
    def from_diffusers_config(cls, config, **runtime) -> "QwenImageConfig":
        """From a diffusers config dict, a `config.json` path, or a transformer (or pipeline) folder; a
        value of the wrong type or out of its range, a variant this model is not, or (in a dict written by
        hand) an unknown field is one line naming the file and the key."""
        where = "Qwen-Image config"
        if isinstance(config, (str, os.PathLike)):
            folder = os.path.join(config, "transformer") if os.path.isdir(os.path.join(config, "transformer")) \
                else config
            where = os.path.join(folder, "config.json") if os.path.isdir(folder) else str(folder)
            config = load_json(where, "diffusers config.json")
            if not isinstance(config, dict):
                raise ValueError(f"{where} must hold a JSON object, got {type(config).__name__}")
            unknown = sorted(set(config) - set(DIFFUSERS_FIELDS) - set(VARIANT_FIELDS) - set(BOOKKEEPING_FIELDS))
        elif isinstance(config, dict):
            unknown = sorted(set(config) - set(DIFFUSERS_FIELDS))
        else:
            raise ValueError(f"a Qwen-Image config is a dict or a config.json path, got {type(config).__name__}")
        if unknown:
            raise ValueError(f"{where}: unknown Qwen-Image config field(s) {unknown}; known: "
                             f"{', '.join(DIFFUSERS_FIELDS)}")
        variants = [k for k in VARIANT_FIELDS if config.get(k)]
        if variants:
            raise ValueError(f"{where}: {', '.join(f'{k}: {config[k]!r}' for k in variants)} is a Qwen-Image variant "
                             "this transformer does not build (text-to-image Qwen-Image has them all false)")
        arch = {k: config[k] for k in DIFFUSERS_FIELDS if k in config}
        return read_block(cls, {**arch, **runtime}, where)

    @classmethod
    def preset(cls, name: str, **overrides) -> "QwenImageConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown Qwen-Image preset {name!r}; choose one of {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)


PRESETS = {
    "qwen-image": QwenImageConfig(),  # Qwen/Qwen-Image (20B): diffusers' defaults
    # A forward in milliseconds on CPU; 4 heads so TP / SP up to 4 divide; 16 = 4 VAE channels packed 2 x 2.
    "tiny": QwenImageConfig(in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                            num_attention_heads=4, joint_attention_dim=32, axes_dims_rope=(4, 6, 6)),
}
