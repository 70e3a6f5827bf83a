"""Megatron's on-disk checkpoint format, for any model family: streaming shard I/O, paths and the
tracker, checksums, the metadata's format and shard set, resume points, and the writer. Which
tensors a shard holds, and how each is cut across TP ranks, is the family's layout (FLUX's:
mm_grpo/families/flux/checkpoint/).

See docs/checkpoint_layout.md."""
from mm_grpo.checkpoint.paths import is_megatron_checkpoint, iteration_dir
from mm_grpo.checkpoint.shard_io import ShardReader, ShardWriter, write_shard
from mm_grpo.checkpoint.writer import CheckpointWriter

__all__ = ["CheckpointWriter", "ShardReader", "ShardWriter", "is_megatron_checkpoint", "iteration_dir", "write_shard"]
