"""Accelerator adaptor: detects NPU / CUDA / CPU and prepares torch and Megatron for it."""
from mm_grpo.platform.adaptor import Platform, get_platform, init_platform

__all__ = ["Platform", "get_platform", "init_platform"]
