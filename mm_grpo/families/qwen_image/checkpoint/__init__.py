"""Qwen-Image in Megatron's checkpoint format (mm_grpo/checkpoint/): its metadata (the architecture and
the parallel layout, stored in every shard), a lazy reader of any weight at any TP, and loading into
this rank's model chunks at any TP / PP (`weights.py`: what the training loop's checkpoints save and
load of it). The converter is converters/qwen_image.py; see docs/qwen_image.md."""
from mm_grpo.families.qwen_image.checkpoint.loader import load_megatron_checkpoint
from mm_grpo.families.qwen_image.checkpoint.metadata import CheckpointMeta
from mm_grpo.families.qwen_image.checkpoint.reader import MegatronCheckpoint

__all__ = ["CheckpointMeta", "MegatronCheckpoint", "load_megatron_checkpoint"]
