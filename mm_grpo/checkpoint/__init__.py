"""Megatron's on-disk checkpoint layout for FLUX: write, read, and load at any TP / PP.

See docs/checkpoint_layout.md."""
from mm_grpo.checkpoint.loader import load_megatron_checkpoint
from mm_grpo.checkpoint.metadata import CheckpointMeta
from mm_grpo.checkpoint.paths import is_megatron_checkpoint, iteration_dir
from mm_grpo.checkpoint.reader import MegatronCheckpoint
from mm_grpo.checkpoint.shard_io import ShardReader, ShardWriter, write_shard
from mm_grpo.checkpoint.writer import CheckpointWriter

__all__ = ["CheckpointMeta", "CheckpointWriter", "MegatronCheckpoint", "ShardReader", "ShardWriter",
           "is_megatron_checkpoint", "iteration_dir", "load_megatron_checkpoint", "write_shard"]
