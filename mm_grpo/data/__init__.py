"""Prompt data for GRPO and image-caption data for flow-matching training."""
from mm_grpo.data.prompts import PromptStream, read_prompts

__all__ = ["PromptStream", "read_prompts"]
