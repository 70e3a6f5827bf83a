"""A tiny but complete diffusers FLUX pipeline folder, built locally (no hub).

The folder has every component FluxPipeline needs, with the real classes and
FLUX's real scheduler / VAE scaling settings, only shrunk: tests and CPU smoke
runs load it through the same code paths as FLUX.1-dev. Both tokenizers are
learnt from a small caption corpus (CLIP: byte-level BPE, here; T5: a SentencePiece
Unigram model, as T5's own, in mm_grpo/tiny/text.py), so nothing is downloaded.

    python -m mm_grpo.families.flux.tiny --out DIR [--seed 0]
"""
import argparse
import collections
import json
import tempfile
from pathlib import Path

from mm_grpo.families.flux.transformer.config import PRESETS
from mm_grpo.tiny.pipeline import seeded, write_pipeline
from mm_grpo.tiny.text import CAPTIONS, T5_CONFIG, build_t5_tokenizer, t5_token_ids
from mm_grpo.versions import transformers_5

# FLUX.1's transformer shrunk (the `tiny` preset): D = 4 heads x 16 = 64, 16 input channels (4
# latent channels packed 2x2), text width 32 = the T5 d_model and CLIP hidden size below.
TRANSFORMER_CONFIG = PRESETS["tiny"].to_diffusers_config()

# Four blocks = three 2x downsamples: VAE factor 8, as FLUX's. Scaling and shift
# factors are FLUX.1's, so the latent normalisation path is exercised for real.
VAE_CONFIG = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[8, 8, 16, 16],
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=4,
    sample_size=64,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
    force_upcast=True,
    mid_block_add_attention=True,
)

# FLUX.1-dev's scheduler_config.json.
SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)

CLIP_TEXT_CONFIG = dict(
    hidden_size=32,
    intermediate_size=64,
    projection_dim=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=77,
    hidden_act="quick_gelu",  # as CLIP-L
)

CLIP_BPE_MERGES = 300


def build_clip_tokenizer():
    """CLIPTokenizer with a byte-level BPE learnt on CAPTIONS, laid out as CLIP's vocab."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = _learn_bpe(_clip_words(CAPTIONS), CLIP_BPE_MERGES)
    # CLIP's vocab order: bytes, bytes + "</w>", one token per merge, then the two specials.
    tokens = alphabet + [b + "</w>" for b in alphabet] + ["".join(m) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
    return clip_tokenizer(vocab, merges, model_max_length=CLIP_TEXT_CONFIG["max_position_embeddings"])


def clip_tokenizer(vocab, merges, **kwargs):
    """CLIP's (fast) tokenizer from an in-memory vocab {token: id} and merges [(a, b), ...].

    transformers 5 takes them directly; 4.x (MindSpeed-MM's 4.57) reads them from CLIP's two
    files and converts them with its CLIP converter, which builds the same backend."""
    from transformers import CLIPTokenizerFast

    if transformers_5():
        return CLIPTokenizerFast(vocab=vocab, merges=merges, **kwargs)
    with tempfile.TemporaryDirectory() as folder:
        vocab_file, merges_file = Path(folder) / "vocab.json", Path(folder) / "merges.txt"
        vocab_file.write_text(json.dumps(vocab))
        merges_file.write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
        return CLIPTokenizerFast(vocab_file=str(vocab_file), merges_file=str(merges_file), **kwargs)


def _clip_words(texts):
    """Word counts after CLIPTokenizer's own normaliser and byte-level pre-tokeniser."""
    from tokenizers import pre_tokenizers

    specials = ("<|startoftext|>", "<|endoftext|>")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet()) + list(specials)
    backend = clip_tokenizer({t: i for i, t in enumerate(alphabet)}, [])._tokenizer
    counts = collections.Counter()
    for text in texts:
        normalized = backend.normalizer.normalize_str(text)
        counts.update(word for word, _ in backend.pre_tokenizer.pre_tokenize_str(normalized))
    return counts


def _learn_bpe(word_counts, num_merges):
    """Classic BPE (Sennrich et al.) with CLIP's "</w>" word ending. Ties go to the
    smallest pair, so the merges are reproducible (the `tokenizers` trainer's are not)."""
    words = {tuple(w[:-1]) + (w[-1] + "</w>",): n for w, n in sorted(word_counts.items())}
    merges = []
    for _ in range(num_merges):
        pairs = collections.Counter()
        for word, n in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        words = {_merge(word, best): n for word, n in words.items()}
    return merges


def _merge(word, pair):
    out, i = [], 0
    while i < len(word):
        if word[i : i + 2] == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def build_tiny_components(seed=0):
    """The seven FluxPipeline components, deterministic from `seed`."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer, tokenizer_2 = build_clip_tokenizer(), build_t5_tokenizer()
    clip_config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,  # CLIP pools at the first eos
        pad_token_id=tokenizer.pad_token_id,
        **CLIP_TEXT_CONFIG,
    )
    t5_config = T5Config(**t5_token_ids(tokenizer_2), **T5_CONFIG)
    # One seed per weight-bearing component: changing one does not shift the others.
    return dict(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        vae=seeded(seed, lambda: AutoencoderKL(**VAE_CONFIG)),
        text_encoder=seeded(seed + 1, lambda: CLIPTextModel(clip_config)),
        tokenizer=tokenizer,
        text_encoder_2=seeded(seed + 2, lambda: T5EncoderModel(t5_config)),
        tokenizer_2=tokenizer_2,
        transformer=seeded(seed + 3, lambda: FluxTransformer2DModel(**TRANSFORMER_CONFIG)),
    )


def build_tiny_pipeline(path, seed=0):
    """Write the tiny FLUX pipeline folder to `path` (which must not exist); returns the path."""
    from diffusers import FluxPipeline

    return write_pipeline(path, lambda: FluxPipeline(**build_tiny_components(seed)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder to create (must not exist)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(build_tiny_pipeline(args.out, args.seed))


if __name__ == "__main__":
    main()
