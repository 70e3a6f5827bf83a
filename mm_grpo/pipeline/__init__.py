"""FLUX pipeline pieces outside the transformer: latent packing, text encoders, VAE decode.

The tiny test pipeline is built by `mm_grpo.pipeline.tiny` (not imported here, so that
`python -m mm_grpo.pipeline.tiny` runs it cleanly)."""
from mm_grpo.pipeline.latents import (
    latent_size,
    num_image_tokens,
    pack_latents,
    prepare_latent_image_ids,
    unpack_latents,
)
from mm_grpo.pipeline.text import TextEmbeddingCache, TextEncoders, save_text_embeddings
from mm_grpo.pipeline.vae import VaeDecoder

__all__ = [
    "TextEmbeddingCache",
    "TextEncoders",
    "VaeDecoder",
    "latent_size",
    "num_image_tokens",
    "pack_latents",
    "prepare_latent_image_ids",
    "save_text_embeddings",
    "unpack_latents",
]
