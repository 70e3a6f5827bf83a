"""FLUX.1 transformer built from megatron-core layers (TP / PP / Ulysses SP)."""
from mm_grpo.families.flux.transformer.config import PRESETS, FluxConfig
from mm_grpo.families.flux.transformer.model import FluxTransformer, transformer_config

__all__ = ["PRESETS", "FluxConfig", "FluxTransformer", "transformer_config"]
