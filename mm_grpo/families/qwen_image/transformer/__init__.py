"""Qwen-Image's transformer built from megatron-core layers (TP / PP / Ulysses SP)."""
from mm_grpo.families.qwen_image.transformer.config import PRESETS, QwenImageConfig
from mm_grpo.families.qwen_image.transformer.model import QwenImageTransformer, transformer_config

__all__ = ["PRESETS", "QwenImageConfig", "QwenImageTransformer", "transformer_config"]
