"""The frozen parts around FLUX's transformer: latent packing, text encoders, VAE decode.

The tiny test pipeline is built by `mm_grpo.families.flux.tiny` (not imported here, so that
`python -m mm_grpo.families.flux.tiny` runs it cleanly)."""
from mm_grpo.encoders.latents import (
    latent_size,
    num_image_tokens,
    pack_latents,
    prepare_latent_image_ids,
    unpack_latents,
)
from mm_grpo.encoders.text import TextEmbeddingCache, TextEncoders, save_text_embeddings
from mm_grpo.encoders.vae import VaeDecoder

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
