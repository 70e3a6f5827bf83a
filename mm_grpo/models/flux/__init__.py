"""FLUX.1 transformer built from megatron-core layers (TP / PP / Ulysses SP)."""
from mm_grpo.models.flux.config import PRESETS, FluxConfig
from mm_grpo.models.flux.model import FluxTransformer, transformer_config

__all__ = ["PRESETS", "FluxConfig", "FluxTransformer", "transformer_config"]
