"""FLUX in Megatron's checkpoint format (mm_grpo/checkpoint/): its metadata (the model config and
parallel layout, stored or inferred from the shards), a lazy reader of any weight at any TP, and
loading into this rank's model chunks at any TP / PP; LoRA adapters in the same layout.

See docs/checkpoint_layout.md."""
from mm_grpo.families.flux.checkpoint.loader import load_megatron_checkpoint
from mm_grpo.families.flux.checkpoint.metadata import CheckpointMeta
from mm_grpo.families.flux.checkpoint.reader import MegatronCheckpoint

__all__ = ["CheckpointMeta", "MegatronCheckpoint", "load_megatron_checkpoint"]
