"""A tiny but complete diffusers Qwen-Image pipeline folder, built locally (no hub).

Every component QwenImagePipeline needs, with the real classes, Qwen-Image's scheduler and its VAE's
16 latent channels with their per-channel normalisation, only shrunk: tests and CPU smoke runs load
it through the same code paths as Qwen/Qwen-Image. The tokenizer is Qwen2's byte-level BPE layout
with Qwen2.5-VL's special tokens, learnt here on the caption corpus and the prompt template, so
that every word of the template is one token and its system prefix the 34 tokens
QwenImagePipeline drops, as with Qwen's own tokenizer.

    python -m mm_grpo.families.qwen_image.tiny --out DIR [--seed 0]
"""
import argparse
import collections
import json
import re
import tempfile
from pathlib import Path

import torch

from mm_grpo.families.qwen_image.sigmas import SCHEDULER_CONFIG
from mm_grpo.families.qwen_image.text import PROMPT_TEMPLATE
from mm_grpo.families.qwen_image.transformer.config import QwenImageConfig
from mm_grpo.tiny.pipeline import seeded, write_pipeline
from mm_grpo.tiny.text import CAPTIONS
from mm_grpo.versions import transformers_5

# The `tiny` transformer with Qwen-Image's own 16 latent channels (packed 2 x 2: 64 in, 16 per patch
# position out), so the VAE below has the real latent width and normalisation constants.
TRANSFORMER = QwenImageConfig.preset("tiny", in_channels=64, out_channels=16)

# AutoencoderKLQwenImage shrunk: three 2x spatial downsamples (factor 8, as the real one), z_dim 16;
# latents_mean / latents_std are left to the class defaults, Qwen/Qwen-Image's vae/config.json values.
VAE_CONFIG = dict(
    base_dim=8,
    z_dim=16,
    dim_mult=[1, 2, 2, 2],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[False, True, True],
    dropout=0.0,
)

# Qwen2.5-VL-7B's text tower (SiLU MLP, grouped-query attention, multimodal RoPE, untied head) at the
# tiny transformer's text width; mrope_section splits the head's 8 / 2 rotary frequencies over
# (frame, row, column) as Qwen's [16, 24, 24] splits its 64.
TEXT_CONFIG = dict(
    hidden_size=TRANSFORMER.joint_attention_dim,
    intermediate_size=2 * TRANSFORMER.joint_attention_dim,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,  # more than QwenImagePipeline's 1024 + 34 tokens
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
)
# Its vision tower (never run by text-to-image, but part of the class), as small as it goes.
VISION_CONFIG = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                     out_hidden_size=TRANSFORMER.joint_attention_dim, fullatt_block_indexes=[0])

# Qwen2.5-VL's special tokens in the order of its vocabulary (ids 151643.. there, after the BPE
# tokens here); <|endoftext|> is Qwen2's pad token.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                  "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
MODEL_MAX_LENGTH = 32768  # Qwen2's tokenizer
TRANSFORMER_INIT_STD = 0.1  # every transformer weight drawn N(0, std^2): no zero-initialised gate hides the text


def _corpus(captions):
    """The captions and the prompt template's text between its special tokens."""
    specials = "|".join(re.escape(t) for t in SPECIAL_TOKENS)
    return list(captions) + [piece for piece in re.split(specials, PROMPT_TEMPLATE.format("")) if piece]


def qwen2_tokenizer(vocab, merges, **kwargs):
    """Qwen2's (fast) tokenizer from an in-memory vocab {token: id} and merges [(a, b), ...], with
    SPECIAL_TOKENS (which `vocab` may hold) as special tokens.

    transformers 5 takes them directly; 4.x (MindSpeed-MM's 4.57) reads them from Qwen2's two files
    and converts them with its Qwen2 converter, which builds the same backend."""
    from tokenizers import AddedToken
    from transformers import Qwen2TokenizerFast

    kwargs.setdefault("model_max_length", MODEL_MAX_LENGTH)
    if transformers_5():
        tokenizer = Qwen2TokenizerFast(vocab=vocab, merges=merges, **kwargs)
    else:
        with tempfile.TemporaryDirectory() as folder:
            vocab_file, merges_file = Path(folder) / "vocab.json", Path(folder) / "merges.txt"
            vocab_file.write_text(json.dumps(vocab))
            merges_file.write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
            tokenizer = Qwen2TokenizerFast(vocab_file=str(vocab_file), merges_file=str(merges_file), **kwargs)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
                         special_tokens=True)
    return tokenizer


def _words(texts):
    """Word counts after Qwen2's own normaliser and pre-tokeniser (its split regex, then bytes)."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = qwen2_tokenizer({t: i for i, t in enumerate(alphabet)}, [])._tokenizer
    counts = collections.Counter()
    for text in texts:
        normalized = backend.normalizer.normalize_str(text)
        counts.update(word for word, _ in backend.pre_tokenizer.pre_tokenize_str(normalized))
    return counts


def _learn_bpe(word_counts):
    """Classic BPE (Sennrich et al.), run until every word is one token. Ties go to the smallest
    pair, so the merges are reproducible."""
    words = {tuple(w): n for w, n in sorted(word_counts.items())}
    merges = []
    while True:
        pairs = collections.Counter()
        for word, n in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += n
        if not pairs:
            return merges
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        words = {_merge(word, best): n for word, n in words.items()}


def _merge(word, pair):
    out, i = [], 0
    while i < len(word):
        if word[i:i + 2] == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def build_tokenizer(captions=CAPTIONS):
    """Qwen2's tokenizer with a byte-level BPE learnt on `captions` and the prompt template, laid out
    as Qwen2's vocabulary: the 256 bytes, one token per merge, then Qwen2.5-VL's special tokens."""
    from tokenizers import pre_tokenizers

    merges = _learn_bpe(_words(_corpus(captions)))
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["".join(m) for m in merges] + list(SPECIAL_TOKENS)
    return qwen2_tokenizer({t: i for i, t in enumerate(dict.fromkeys(tokens))}, merges)


def text_encoder_config(tokenizer):
    """Qwen2_5_VLConfig of the tiny text encoder over `tokenizer`'s vocabulary and special tokens."""
    from transformers import Qwen2_5_VLConfig

    ids = dict(zip(SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))))
    text = dict(TEXT_CONFIG, vocab_size=len(tokenizer), bos_token_id=ids["<|endoftext|>"],
                eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=VISION_CONFIG, tie_word_embeddings=False,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])


def random_transformer(config: QwenImageConfig, std: float = TRANSFORMER_INIT_STD):
    """diffusers' QwenImageTransformer2DModel for `config` with every weight N(0, std^2)."""
    from diffusers import QwenImageTransformer2DModel

    model = QwenImageTransformer2DModel(**config.to_diffusers_config())
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std)
    return model


def build_tiny_components(seed=0):
    """The five QwenImagePipeline components, deterministic from `seed`."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler
    from transformers import Qwen2_5_VLForConditionalGeneration

    tokenizer = build_tokenizer()
    text_config = text_encoder_config(tokenizer)
    # One seed per weight-bearing component: changing one does not shift the others.
    return dict(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        vae=seeded(seed, lambda: AutoencoderKLQwenImage(**VAE_CONFIG)),
        text_encoder=seeded(seed + 1, lambda: Qwen2_5_VLForConditionalGeneration(text_config)),
        tokenizer=tokenizer,
        transformer=seeded(seed + 2, lambda: random_transformer(TRANSFORMER)),
    )


def build_tiny_pipeline(path, seed=0):
    """Write the tiny Qwen-Image pipeline folder to `path` (which must not exist); returns the path."""
    from diffusers import QwenImagePipeline

    return write_pipeline(path, lambda: QwenImagePipeline(**build_tiny_components(seed)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder to create (must not exist)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        print(build_tiny_pipeline(args.out, args.seed))
    except FileExistsError as error:
        parser.error(str(error))


if __name__ == "__main__":
    main()
