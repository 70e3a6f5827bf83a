"""The tiny pipelines' T5 text side, shared by the families (FLUX's T5, Wan's umT5): the caption
corpus, T5 v1.1's layout shrunk, and T5 tokenizers built locally (no hub): a SentencePiece Unigram
model learnt on the captions, as T5's own, or one piece per word of a grammar."""
import io

from mm_grpo.versions import transformers_5

# Captions the tiny tokenizers are trained on; prompts outside this vocabulary
# still tokenize (rare characters map to <unk>).
CAPTIONS = (
    "a photo of a cat sitting on a red chair",
    "an astronaut riding a horse on the moon",
    "a bowl of fruit on a wooden table",
    "a watercolor painting of a lighthouse at sunset",
    "two dogs playing in the snow",
    "a city street at night with neon signs",
    "a portrait of an old man with a white beard",
    "a small boat on a calm blue lake",
    "a red apple next to a green pear",
    "a mountain landscape with pine trees and fog",
    "a close up of a sunflower in a field",
    "a cup of coffee on a desk by the window",
    "a robot reading a book in a library",
    "an oil painting of a ship in a storm",
    "a bird sitting on a branch in spring",
    "a bowl of ramen with an egg and green onions",
    "a child flying a kite on the beach",
    "a castle on a hill under a starry sky",
    "a black and white photo of a train station",
    "a teddy bear wearing a blue hat",
    "a glass of orange juice with ice",
    "a fox running through the autumn forest",
    "a futuristic car parked in front of a house",
    "a vase of roses on a kitchen table",
    "a snowy village at dawn, digital art",
    "a dragon flying over the ocean, fantasy style",
    "a plate of pasta with tomato sauce",
    "an owl with yellow eyes at night",
    "a bicycle leaning against a brick wall",
    "three cats sleeping on a sofa",
)

# T5 v1.1 layout (gated GELU, untied head) at d_model 32.
T5_CONFIG = dict(
    d_model=32,
    d_kv=8,
    d_ff=64,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    dropout_rate=0.0,
    tie_word_embeddings=False,
)

T5_VOCAB_SIZE = 200  # an upper bound: SentencePiece stops earlier on this corpus


def t5_tokenizer(vocab, **kwargs):
    """T5's (fast) Unigram tokenizer from [(piece, score), ...] with pad 0, eos 1, unk 2, no sentinels.

    transformers 5 takes the pieces directly; for 4.x the same backend is assembled here
    (Metaspace pieces, "$A </s>"), as transformers 5 assembles it."""
    from transformers import T5TokenizerFast

    if transformers_5():
        return T5TokenizerFast(vocab=vocab, extra_ids=0, **kwargs)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    backend = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    metaspace = dict(replacement="\u2581", prepend_scheme="always", split=True)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(**metaspace)])
    backend.decoder = decoders.Metaspace(**metaspace)
    backend.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)])
    return T5TokenizerFast(tokenizer_object=backend, extra_ids=0, **kwargs)


def build_t5_tokenizer():
    """T5TokenizerFast over a SentencePiece Unigram model trained on CAPTIONS (pad 0, eos 1, unk 2 as T5)."""
    import sentencepiece as spm

    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CAPTIONS),
        model_writer=proto,
        model_type="unigram",
        vocab_size=T5_VOCAB_SIZE,
        hard_vocab_limit=False,
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        normalization_rule_name="identity",
        num_threads=1,  # single-threaded EM: the scores are bit-reproducible
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    vocab = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    # Neither family uses T5's sentinel tokens, so no <extra_id_*>.
    return t5_tokenizer(vocab, model_max_length=512)


def grammar_t5_tokenizer(corpus):
    """A T5 (Unigram) tokenizer whose pieces are the corpus's words, plus single characters so
    that other text still tokenizes; pad 0, eos 1, unk 2 as T5. Built directly rather than
    trained: SentencePiece's trainer keeps sub-word pieces on a corpus this repetitive."""
    words = sorted({w for text in corpus for w in text.split()})
    chars = sorted({c for w in words for c in w})
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [("\u2581" + w, -1.0) for w in words] + [(c, -10.0) for c in chars]
    return t5_tokenizer(vocab, model_max_length=512)


def t5_token_ids(tokenizer) -> dict:
    """A T5-family config's vocabulary size and special ids (pad, eos, decoder start) for `tokenizer`."""
    return dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                decoder_start_token_id=tokenizer.pad_token_id)
