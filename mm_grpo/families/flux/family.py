"""FLUX as mm-grpo's own trainers build and train it (mm_grpo/families/__init__.py `Family`)."""
from mm_grpo.families import Family
from mm_grpo.families.flux import chunks, parts, predictor_block
from mm_grpo.families.flux.checkpoint import adapters, weights
from mm_grpo.families.flux.checkpoint.metadata import CheckpointMeta
from mm_grpo.families.flux.denoiser import FluxGuidance
from mm_grpo.families.flux.transformer import lora
from mm_grpo.families.flux.transformer.latents import token_grid
from mm_grpo.families.flux.transformer.lora_hf import read_diffusers_lora


def check_text(text_block: dict, prompts):
    """Every prompt in the text block's precomputed embedding cache, when it names one."""
    if text_block.get("embeddings_cache"):
        from mm_grpo.families.flux.text import TextEmbeddingCache
        TextEmbeddingCache(text_block["embeddings_cache"]).check(list(dict.fromkeys(prompts)))


FAMILY = Family(
    name="FLUX", model_id=predictor_block.MODEL_ID, config_from_block=predictor_block.flux_config_from_block,
    build_model_chunks=chunks.build_model_chunks, load_pretrained=chunks.load_pretrained,
    forward_backward=chunks.forward_backward, lora=lora, read_diffusers_lora=read_diffusers_lora, weights=weights,
    checkpoint_meta=CheckpointMeta, lora_entry=adapters.lora_entry, checkpoint_base=adapters.checkpoint_base,
    guidance=FluxGuidance, parts=parts.parts, token_grid=token_grid, check_text=check_text,
    latent_encoder=parts.latent_encoder)
