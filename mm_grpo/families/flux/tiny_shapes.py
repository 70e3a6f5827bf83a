"""The tiny "shapes" FLUX pipeline: the tiny pipeline's layout with tokenizers learnt on the
shapes grammar (every word one token), frozen random text encoders (T5 with a local attention
prior, see `local_t5`), a trained VAE and a trained transformer.

    python -m mm_grpo.families.flux.tiny_shapes init --vae VAE_DIR --out DIR [--seed 0]
        a pipeline folder with the given VAE, frozen random text encoders and a random transformer
    python -m mm_grpo.families.flux.tiny_shapes finish --init DIR --transformer HF_DIR --out FINAL
        the same folder with a trained transformer (a diffusers folder, e.g. from mm-convert mm_to_hf)

examples/flux/build_tiny_shapes.sh runs the whole recipe.
"""
import torch

from mm_grpo.data.shapes import grammar_corpus
from mm_grpo.families.flux import tiny
from mm_grpo.tiny import pipeline
from mm_grpo.tiny.pipeline import seeded
from mm_grpo.tiny.text import T5_CONFIG, grammar_t5_tokenizer

# The tiny transformer with a wider model: D = 4 heads x 24 = 96 (heads divisible by TP x SP = 4).
TRANSFORMER_CONFIG = dict(tiny.TRANSFORMER_CONFIG, attention_head_dim=24, axes_dims_rope=[4, 10, 10])


def build_clip_tokenizer(corpus):
    """CLIP's byte-level BPE learnt on `corpus` with enough merges to make each word one token."""
    from tokenizers import pre_tokenizers

    words = tiny._clip_words(corpus)
    merges = tiny._learn_bpe(words, sum(len(w) for w in words))  # stops once every word is whole
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = alphabet + [b + "</w>" for b in alphabet] + ["".join(m) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
    return tiny.clip_tokenizer(vocab, merges, model_max_length=tiny.CLIP_TEXT_CONFIG["max_position_embeddings"])


# Relative offsets each T5 head attends to (previous, next, two back, two ahead).
T5_HEAD_OFFSETS = (-1, 1, -2, 2)
T5_LOCAL_BIAS = 10.0  # logit bonus: attention is practically one-hot on that offset


def local_t5(config, seed):
    """A random T5 encoder whose heads each attend to one fixed neighbour.

    FLUX's text tokens carry no positions into the transformer (txt_ids are zero), so word order
    reaches it only through the text features. A random T5 attends almost uniformly (its
    relative-position biases start near 0), and then "a red circle above a blue square" and "a
    blue circle above a red square" give nearly the same set of token features (3% apart,
    measured; 40% with this prior): each token's features now hold its neighbours' words."""
    from transformers import T5EncoderModel
    from transformers.models.t5.modeling_t5 import T5Attention

    model = seeded(seed, lambda: T5EncoderModel(config))
    attention = model.encoder.block[0].layer[0].SelfAttention  # the layer that owns the position bias
    bias = attention.relative_attention_bias.weight
    with torch.no_grad():
        bias.zero_()
        for head, offset in enumerate(T5_HEAD_OFFSETS[:config.num_heads]):
            bucket = T5Attention._relative_position_bucket(
                torch.tensor(offset), bidirectional=True, num_buckets=config.relative_attention_num_buckets,
                max_distance=config.relative_attention_max_distance)
            bias[bucket, head] = T5_LOCAL_BIAS
    return model


def build_init_pipeline(vae_dir, seed=0, transformer_config=TRANSFORMER_CONFIG):
    """FluxPipeline with the trained VAE, random (seeded) text encoders and transformer."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config

    corpus = grammar_corpus()
    tokenizer, tokenizer_2 = build_clip_tokenizer(corpus), grammar_t5_tokenizer(corpus)
    clip_config = CLIPTextConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                 **tiny.CLIP_TEXT_CONFIG)
    t5_config = T5Config(vocab_size=len(tokenizer_2), pad_token_id=tokenizer_2.pad_token_id,
                         eos_token_id=tokenizer_2.eos_token_id, decoder_start_token_id=tokenizer_2.pad_token_id,
                         **T5_CONFIG)
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**tiny.SCHEDULER_CONFIG),
        vae=AutoencoderKL.from_pretrained(vae_dir),
        text_encoder=seeded(seed + 1, lambda: CLIPTextModel(clip_config)),
        tokenizer=tokenizer,
        text_encoder_2=local_t5(t5_config, seed + 2),
        tokenizer_2=tokenizer_2,
        transformer=seeded(seed + 3, lambda: FluxTransformer2DModel(**transformer_config)))


VAE_HELP = "trained VAE folder (python -m mm_grpo.tools.train_tiny_vae)"


def finish_pipeline(init_dir, transformer_dir, out):
    """The init pipeline with its transformer replaced by the trained one (fp16, `mm_grpo.tiny.pipeline`)."""
    from diffusers import FluxPipeline, FluxTransformer2DModel

    return pipeline.finish_pipeline(FluxPipeline, FluxTransformer2DModel, init_dir, transformer_dir, out)


def main(argv=None):
    pipeline.init_finish_main(argv, "python -m mm_grpo.families.flux.tiny_shapes", __doc__.splitlines()[0],
                              build_init_pipeline, finish_pipeline, VAE_HELP)


if __name__ == "__main__":
    main()
