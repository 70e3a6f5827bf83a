"""What a Qwen-Image run's GRPO schedule is handed: model.json's Qwen2.5-VL text encoder (or its feature
cache), the VAE decoder and the denoiser over this rank's chunks, with true CFG's negative prompt encoded
once by the same conditioner."""
import dataclasses
import os
from typing import Optional

from mm_grpo.configs import MODEL_FLAG, block
from mm_grpo.families.qwen_image.denoiser import QwenImageDenoiser, QwenImageGuidance
from mm_grpo.families.qwen_image.sigmas import load_scheduler_config


def conditioner(text_block, device, dtype):
    """prompts -> (prompt_embeds [N, L, D], mask [N, L] or None), from a precomputed cache or the encoder."""
    if text_block.get("embeddings_cache"):
        from mm_grpo.families.qwen_image.text import TextEmbeddingCache
        cache = TextEmbeddingCache(text_block["embeddings_cache"])
        return lambda prompts: cache.get(prompts, device=device)
    from mm_grpo.families.qwen_image.text import QwenImageTextEncoder
    kwargs = {"max_sequence_length": text_block["max_sequence_length"]} if "max_sequence_length" in text_block else {}
    encoder = QwenImageTextEncoder(block(text_block, "from_pretrained", "text_encoder"), device=device, dtype=dtype,
                                   **kwargs)
    return encoder.encode


def check_text(text_block: dict, prompts):
    """Every prompt in the text block's precomputed feature cache, when it names one."""
    if text_block.get("embeddings_cache"):
        from mm_grpo.families.qwen_image.text import TextEmbeddingCache
        TextEmbeddingCache(text_block["embeddings_cache"]).check(list(dict.fromkeys(prompts)))


def decoder(ae_block, device, dtype):
    from mm_grpo.families.qwen_image.vae import VaeDecoder
    return VaeDecoder(block(ae_block, "from_pretrained", "ae"), device=device, dtype=dtype)


def latent_encoder(ae_block, device):
    """images [N, 3, H, W] in [0, 1] -> the packed, normalised latents of model.json's VAE."""
    from mm_grpo.families.qwen_image.vae import encode_latents, load_vae
    vae = load_vae(block(ae_block, "from_pretrained", "ae"), device=device)
    return lambda images: encode_latents(vae, images)


def scheduler_config(ae_block) -> Optional[dict]:
    """The scheduler config of the pipeline folder model.json's ae names, when it has one (else Qwen-Image's)."""
    folder = ae_block.get("from_pretrained")
    if folder and os.path.isfile(os.path.join(folder, "scheduler", "scheduler_config.json")):
        return load_scheduler_config(folder)
    return None


def parts(model_cfg, settings, policy, device, dtype, guidance: QwenImageGuidance):
    """(conditioner, decoder, denoiser) of a Qwen-Image run; under true CFG the negative prompt's features
    come from the run's conditioner (a feature cache must hold the negative prompt too). The rollout's
    sigmas are the pipeline's (QwenImageDenoiser.sigmas), so --sigma-shift, FLUX's, is refused."""
    default_shift = next(f.default for f in dataclasses.fields(settings) if f.name == "sigma_shift")
    if settings.sigma_shift != default_shift:
        raise ValueError(f"--sigma-shift {settings.sigma_shift}: Qwen-Image's rollout takes QwenImagePipeline's "
                         "schedule (its shift follows the image size, from the pipeline's scheduler_config.json)")
    ae_block = block(model_cfg, "ae", MODEL_FLAG)
    text = conditioner(block(model_cfg, "text_encoder", MODEL_FLAG), device, dtype)
    negative = text([guidance.unconditional_prompt]) if guidance.true_cfg_scale > 1 else None
    return (text, decoder(ae_block, device, dtype),
            QwenImageDenoiser.of(policy, settings.height, settings.width, guidance.true_cfg_scale, negative,
                                 scheduler_config(ae_block)))
