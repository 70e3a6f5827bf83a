"""The tiny "shapes" Qwen-Image pipeline: the tiny pipeline's classes (`tiny.py`) with a tokenizer learnt
on the shapes grammar (every word one token), a frozen random Qwen2.5-VL text model, a VAE trained on the
shapes images and a transformer trained by flow matching on them.

    python -m mm_grpo.families.qwen_image.tiny_shapes init --vae VAE_DIR --out DIR [--seed 0]
        a pipeline folder with the given VAE, a frozen random text encoder and a random transformer
    python -m mm_grpo.families.qwen_image.tiny_shapes finish --init DIR --transformer HF_DIR --out FINAL
        the same folder with a trained transformer (a diffusers folder, e.g. from mm-convert mm_to_hf)

examples/qwen_image/build_tiny_shapes.sh runs the whole recipe.
"""
import json
from pathlib import Path

from mm_grpo.data.shapes import grammar_corpus
from mm_grpo.families.qwen_image import tiny
from mm_grpo.families.qwen_image.sigmas import SCHEDULER_CONFIG
from mm_grpo.families.qwen_image.transformer.config import QwenImageConfig
from mm_grpo.tiny import pipeline
from mm_grpo.tiny.pipeline import seeded

# The size of the FLUX demo's transformer (4 heads x 24 = D 96, about 1.3M parameters) in Qwen-Image's
# dual-stream blocks; its channels are the VAE's latent channels packed 2 x 2 (`build_init_pipeline`).
TRANSFORMER = QwenImageConfig.preset("tiny", num_layers=4, attention_head_dim=24, axes_dims_rope=(4, 10, 10))


def build_init_pipeline(vae_dir, seed=0, config: QwenImageConfig = TRANSFORMER):
    """QwenImagePipeline with the trained VAE, a random (seeded) text encoder and a transformer with
    diffusers' own initialisation that takes the VAE's latents (its z_dim channels packed 2 x 2)."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLForConditionalGeneration

    vae = AutoencoderKLQwenImage.from_pretrained(vae_dir)
    config = config.replace(in_channels=4 * vae.config.z_dim, out_channels=vae.config.z_dim)
    tokenizer = tiny.build_tokenizer(grammar_corpus())
    return QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG), vae=vae,
        text_encoder=seeded(seed + 1, lambda: Qwen2_5_VLForConditionalGeneration(tiny.text_encoder_config(tokenizer))),
        tokenizer=tokenizer,
        transformer=seeded(seed + 2, lambda: QwenImageTransformer2DModel(**config.to_diffusers_config())))


VAE_HELP = "trained VAE folder (python -m mm_grpo.tools.train_tiny_vae --family qwen-image --latent-channels 4)"


def readable_by_transformers_4(folder: Path):
    """A pipeline folder written with transformers 5 made readable by 4.x too (MindSpeed-MM's 4.57): the text
    encoder's `rope_scaling` beside the `rope_parameters` transformers 5 writes, and the tokenizer's
    vocab.json / merges.txt beside its tokenizer.json (4.57's Qwen2Tokenizer, which model_index.json names,
    reads those)."""
    config_file = folder / "text_encoder" / "config.json"
    config = json.loads(config_file.read_text())
    text = config["text_config"]
    rope = text.get("rope_parameters") or text["rope_scaling"]
    text.update(rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]}, rope_theta=rope["rope_theta"])
    config_file.write_text(json.dumps(config, indent=2))
    bpe = json.loads((folder / "tokenizer" / "tokenizer.json").read_text())["model"]
    (folder / "tokenizer" / "vocab.json").write_text(json.dumps(bpe["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]]
    (folder / "tokenizer" / "merges.txt").write_text("#version: 0.2\n" + "".join(m + "\n" for m in merges))


def finish_pipeline(init_dir, transformer_dir, out):
    """The init pipeline with its transformer replaced by the trained one (fp16, `mm_grpo.tiny.pipeline`),
    readable by transformers 4 and 5."""
    from diffusers import QwenImagePipeline, QwenImageTransformer2DModel

    return pipeline.finish_pipeline(QwenImagePipeline, QwenImageTransformer2DModel, init_dir, transformer_dir, out,
                                    then=readable_by_transformers_4)


def main(argv=None):
    pipeline.init_finish_main(argv, "python -m mm_grpo.families.qwen_image.tiny_shapes", __doc__.splitlines()[0],
                              build_init_pipeline, finish_pipeline, VAE_HELP)


if __name__ == "__main__":
    main()
