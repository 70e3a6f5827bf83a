"""What a FLUX run's GRPO schedule is handed: model.json's text encoders (or their embedding cache),
its VAE decoder and the denoiser over this rank's chunks."""
from mm_grpo.configs import MODEL_FLAG, block
from mm_grpo.families.flux.denoiser import FluxDenoiser, FluxGuidance


def conditioner(text_block, device, dtype):
    """prompts -> (prompt_embeds, pooled, txt_ids), from a precomputed cache or the encoders."""
    if text_block.get("embeddings_cache"):
        from mm_grpo.families.flux.text import TextEmbeddingCache
        cache = TextEmbeddingCache(text_block["embeddings_cache"])
        return lambda prompts: cache.get(prompts, device=device)
    from mm_grpo.families.flux.text import TextEncoders
    kwargs = {"max_sequence_length": text_block["max_sequence_length"]} if "max_sequence_length" in text_block else {}
    encoders = TextEncoders(block(text_block, "from_pretrained", "text_encoder"), device=device, dtype=dtype, **kwargs)
    return encoders.encode


def decoder(ae_block, device, dtype):
    from mm_grpo.families.flux.vae import VaeDecoder
    return VaeDecoder(block(ae_block, "from_pretrained", "ae"), device=device, dtype=dtype)


def latent_encoder(ae_block, device):
    """images [N, 3, H, W] in [0, 1] -> the packed, normalised latents of model.json's VAE."""
    from mm_grpo.families.flux.transformer.latents import pack_latents
    from mm_grpo.families.flux.vae import encode_latents, load_vae
    vae = load_vae(block(ae_block, "from_pretrained", "ae"), device=device)
    return lambda images: pack_latents(encode_latents(vae, images))


def parts(model_cfg, settings, policy, device, dtype, guidance: FluxGuidance):
    """(conditioner, decoder, denoiser) of a FLUX run: model.json's text encoders and VAE decoder, what
    training/components.py `grpo_schedule` asks of a family."""
    return (conditioner(block(model_cfg, "text_encoder", MODEL_FLAG), device, dtype),
            decoder(block(model_cfg, "ae", MODEL_FLAG), device, dtype),
            FluxDenoiser.of(policy, settings.height, settings.width, guidance.guidance_scale))
