"""Qwen-Image as mm-grpo's own trainers build and train it (mm_grpo/families/__init__.py `Family`)."""
from mm_grpo.families import Family
from mm_grpo.families.qwen_image import chunks, parts, predictor_block
from mm_grpo.families.qwen_image.checkpoint import adapters, weights
from mm_grpo.families.qwen_image.checkpoint.metadata import CheckpointMeta
from mm_grpo.families.qwen_image.denoiser import QwenImageGuidance, token_grid
from mm_grpo.families.qwen_image.transformer import lora
from mm_grpo.families.qwen_image.transformer.lora_hf import read_diffusers_lora

FAMILY = Family(
    name="Qwen-Image", model_id=predictor_block.MODEL_ID, config_from_block=predictor_block.config_from_block,
    build_model_chunks=chunks.build_model_chunks, load_pretrained=chunks.load_pretrained,
    forward_backward=chunks.forward_backward, lora=lora, read_diffusers_lora=read_diffusers_lora, weights=weights,
    checkpoint_meta=CheckpointMeta, lora_entry=adapters.lora_entry, checkpoint_base=adapters.checkpoint_base,
    guidance=QwenImageGuidance, parts=parts.parts, token_grid=token_grid, check_text=parts.check_text,
    latent_encoder=parts.latent_encoder)
