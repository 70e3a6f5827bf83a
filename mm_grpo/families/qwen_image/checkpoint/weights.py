"""Qwen-Image's weights in a training checkpoint, as the training loop's checkpoints take them
(mm_grpo/training/checkpointing.py knows no family): what a model chunk saves (a LoRA run, its adapters
only: the frozen base is named in the checkpoint's `lora` entry) and loading this rank's chunks from a
checkpoint of any TP / PP."""
from mm_grpo.families.qwen_image.checkpoint.adapters import load_adapter_checkpoint
from mm_grpo.families.qwen_image.checkpoint.loader import load_megatron_checkpoint
from mm_grpo.families.qwen_image.checkpoint.metadata import CheckpointMeta
from mm_grpo.families.qwen_image.transformer.lora import adapter_state_dict, has_adapters


def state_dict(chunk) -> dict:
    """What one bare model chunk saves."""
    return adapter_state_dict(chunk) if has_adapters(chunk) else chunk.state_dict()


def load(chunks, folder: str) -> CheckpointMeta:
    """This rank's bare `chunks` from the iteration `folder`; returns the checkpoint's metadata."""
    return (load_adapter_checkpoint if has_adapters(chunks[0]) else load_megatron_checkpoint)(chunks, folder)
