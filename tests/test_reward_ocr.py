"""OCR reward on a tiny random TrOCR-style recogniser saved locally, against flow_grpo's formula.

The recogniser (ViT encoder, TrOCR decoder, a byte-level BPE trained here on a few phrases)
stands in only for the weights of a real TrOCR checkpoint: it is saved and loaded through the
same `path` a user gives. The oracle reads the images with it straight through transformers
(processor, `model.generate`, `batch_decode`) and applies flow_grpo's OcrScorer formula
(flow_grpo/ocr.py) in float64 with its own edit distance: quoted text, spaces removed and
lower case, distance 0 when the target occurs in the recognised text, clipped at the target's
length, reward = 1 - dist / len(target).
"""
import functools
import re

import numpy as np
import pytest
import torch
import transformers

from mm_grpo.rewards import build_reward
from mm_grpo.rewards.ocr import MAX_NEW_TOKENS, levenshtein, ocr_reward, target_text
from tests.utils import assert_one_line_error

PHRASES = ["Hello World", "Spring Collection 2024", "Open Late", "Fearless", "Black Diamond Run"]
SPECIALS = {"bos_token": "<s>", "pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}
VOCAB_SIZE = 64
IMAGE_SIZE = 32  # the recogniser's input; test images are larger and not square
TOLERANCE = 1e-6  # float32 reward against the float64 oracle
# Scales the end-of-text logit so that greedy decoding stops at different lengths per image
# (some images read as empty text) instead of always at MAX_NEW_TOKENS.
EOS_LOGIT_SCALE = 2.5


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token=SPECIALS["unk_token"]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    # RoBERTa's (and so TrOCR's) special ids: <s> 0, <pad> 1, </s> 2, <unk> 3.
    specials = [SPECIALS[k] for k in ("bos_token", "pad_token", "eos_token", "unk_token")]
    bpe.train_from_iterator(PHRASES, trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=specials))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, **SPECIALS)


def _save_recogniser(folder, seed=0):
    from transformers import (TrOCRConfig, TrOCRProcessor, ViTConfig, ViTImageProcessor, VisionEncoderDecoderConfig,
                              VisionEncoderDecoderModel)

    tokenizer = _tokenizer()
    ids = {"bos_token_id": tokenizer.bos_token_id, "pad_token_id": tokenizer.pad_token_id,
           "eos_token_id": tokenizer.eos_token_id}
    encoder = ViTConfig(image_size=IMAGE_SIZE, patch_size=8, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, initializer_range=1.0)
    decoder = TrOCRConfig(vocab_size=len(tokenizer), d_model=32, decoder_layers=1, decoder_attention_heads=2,
                          decoder_ffn_dim=64, max_position_embeddings=2 * MAX_NEW_TOKENS, init_std=1.0,
                          decoder_start_token_id=tokenizer.eos_token_id, **ids)
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    # TrOCR starts decoding from </s>.
    config.decoder_start_token_id = tokenizer.eos_token_id
    config.pad_token_id, config.eos_token_id = ids["pad_token_id"], ids["eos_token_id"]
    torch.manual_seed(seed)
    model = VisionEncoderDecoderModel(config).eval()
    with torch.no_grad():
        logits = model.decoder.output_projection.weight
        logits[[tokenizer.bos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id]] = 0  # text tokens only
        logits[tokenizer.eos_token_id] *= EOS_LOGIT_SCALE
    model.save_pretrained(folder)
    size = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    TrOCRProcessor(image_processor=ViTImageProcessor(size=size), tokenizer=tokenizer).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def recogniser(tmp_path_factory):
    return _save_recogniser(tmp_path_factory.mktemp("ocr") / "trocr")


@pytest.fixture(scope="module")
def reward(recogniser):
    return build_reward({"name": "ocr", "path": str(recogniser)})


def _images(count=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(count, 3, 48, 64, generator=g)


_TORCH_BACKEND = {"backend": "torchvision"} if int(transformers.__version__.split(".")[0]) >= 5 else {"use_fast": True}
GREEDY = {"max_new_tokens": MAX_NEW_TOKENS, "do_sample": False, "num_beams": 1}


def _read_directly(folder, images, generate_kwargs=GREEDY):
    """The recogniser through transformers as a user would run it on flow_grpo's uint8 images."""
    from transformers import AutoProcessor, VisionEncoderDecoderModel

    # The torch image backend, as the reward uses: transformers 4.x defaults to the PIL one,
    # whose resize differs by up to one level of 255 here (measured on these images), and the
    # random recogniser reads such images differently. Resizing is not what this test checks.
    processor = AutoProcessor.from_pretrained(folder, **_TORCH_BACKEND)
    model = VisionEncoderDecoderModel.from_pretrained(folder).eval()
    arrays = (images * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    pixel_values = processor(images=list(arrays), return_tensors="pt").pixel_values
    with torch.no_grad():
        tokens = model.generate(pixel_values, **generate_kwargs)
    return processor.batch_decode(tokens, skip_special_tokens=True)


def _edit_distance(a, b):
    """Levenshtein distance by memoised recursion (a second algorithm to the reward's table)."""

    @functools.lru_cache(maxsize=None)
    def d(i, j):  # distance between a[i:] and b[j:]
        if i == len(a) or j == len(b):
            return len(a) - i + len(b) - j
        return min(d(i + 1, j) + 1, d(i, j + 1) + 1, d(i + 1, j + 1) + (a[i] != b[j]))

    return d(0, 0)


def _oracle(recognised, prompt):
    """flow_grpo's OcrScorer formula in float64."""
    target = prompt.split('"')[1].replace(" ", "").lower()
    recognised = recognised.replace(" ", "").lower()
    dist = 0 if target in recognised else _edit_distance(recognised, target)
    return np.float64(1.0) - np.float64(min(dist, len(target))) / np.float64(len(target))


@pytest.fixture(scope="module")
def read(recogniser):
    """Test images and the text the recogniser reads in them, straight through transformers."""
    images = _images()
    return images, _read_directly(recogniser, images)


def _cases(texts):
    """(image index, prompt) pairs built from the read texts so that each of flow_grpo's cases occurs."""
    length = [len(t.replace(" ", "")) for t in texts]
    empty = length.index(0)
    inner, exact, spaced, longer = sorted((i for i in range(len(texts)) if length[i]), key=lambda i: -length[i])[:4]
    assert length[inner] >= 3, texts
    return [
        (exact, f'a neon sign that says "{texts[exact]}"'),  # the read text itself: 1
        (spaced, f'a poster with "{" ".join(texts[spaced].replace(" ", "").upper())}" on it'),  # case, spaces: 1
        (inner, f'a shop front reading "{texts[inner].replace(" ", "")[1:-1]}"'),  # inside the read text: 1
        (longer, f'a banner saying "{texts[longer]}XY"'),  # two characters missing: 1 - 2 / (n + 2)
        (empty, 'a chalkboard with "Hello" written on it'),  # nothing read: 0
    ]


def test_reward_equals_flow_grpo_formula_on_directly_read_text(reward, read):
    images, texts = read
    indexes, prompts = zip(*_cases(texts))
    images, texts = images[list(indexes)], [texts[i] for i in indexes]
    reward.check_prompts(prompts)

    values = reward(images, prompts)
    expected = np.array([_oracle(text, prompt) for text, prompt in zip(texts, prompts)])
    assert values.dtype == torch.float32 and values.shape == (len(prompts),)
    np.testing.assert_allclose(values.numpy().astype(np.float64), expected, rtol=0, atol=TOLERANCE)
    # The cases the prompts were built for.
    n = len(texts[3].replace(" ", ""))
    np.testing.assert_allclose(expected, [1, 1, 1, 1 - 2 / (n + 2), 0], rtol=0, atol=1e-12)


def test_reward_reads_what_transformers_reads(reward, read):
    images, texts = read
    assert reward.recognise(images) == texts


def test_unrelated_text_is_clipped_at_zero(reward, read):
    images, texts = read
    longest = max(range(len(texts)), key=lambda i: len(texts[i]))
    prompt = 'a sign that says "zq"'  # letters outside the recogniser's vocabulary
    assert _edit_distance(texts[longest].replace(" ", "").lower(), "zq") > 2  # unclipped, 1 - dist / 2 < 0
    assert reward(images[longest:longest + 1], [prompt]).item() == 0.0 == _oracle(texts[longest], prompt)


def test_saved_generation_settings_do_not_change_greedy_reading(tmp_path, recogniser, read):
    """A checkpoint that asks for beam search and bans repeats is still read greedily."""
    from transformers import GenerationConfig, VisionEncoderDecoderModel

    folder = _save_recogniser(tmp_path / "beam")
    model = VisionEncoderDecoderModel.from_pretrained(folder)
    model.generation_config = GenerationConfig(
        num_beams=2, no_repeat_ngram_size=1, max_new_tokens=MAX_NEW_TOKENS,
        **{k: getattr(model.generation_config, k) for k in
           ("decoder_start_token_id", "bos_token_id", "eos_token_id", "pad_token_id")})
    model.save_pretrained(folder)
    images, greedy = read
    assert _read_directly(folder, images, {}) != greedy  # the saved settings do change generate()'s default
    assert build_reward({"name": "ocr", "path": str(folder)}).recognise(images) == greedy


@pytest.mark.parametrize("a, b, distance", [
    ("kitten", "sitting", 3),
    ("sitting", "kitten", 3),
    ("flaw", "lawn", 2),
    ("", "", 0),
    ("", "abc", 3),
    ("abc", "", 3),
    ("hello", "hello", 0),
    ("abc", "cab", 2),
])
def test_levenshtein_hand_computed(a, b, distance):
    assert levenshtein(a, b) == distance == _edit_distance(a, b)


def test_formula_hand_computed():
    assert target_text('New York skyline with "Hello World" in fireworks') == "Hello World"
    assert target_text('a "first" and a "second" sign') == "first"  # the first quoted text only
    assert ocr_reward("HELLOWORLD!", "Hello World") == 1.0  # contained, case and spaces ignored
    assert ocr_reward("helo world", "Hello World") == 1 - 1 / 10
    assert ocr_reward("", "Hello") == 0.0
    assert ocr_reward("an entirely different line of text", "Hi") == 0.0  # clipped, not negative


def test_config_errors_are_one_line(tmp_path):
    from transformers import ViTConfig, ViTModel

    assert_one_line_error(lambda: build_reward({"name": "ocr"}), "needs `path` \\(a folder\\)")
    assert_one_line_error(lambda: build_reward({"name": "ocr", "path": str(tmp_path / "nowhere")}),
                          "is not an existing folder", FileNotFoundError)
    (tmp_path / "empty").mkdir()
    assert_one_line_error(lambda: build_reward({"name": "ocr", "path": str(tmp_path / "empty")}),
                          "is not a transformers VisionEncoderDecoder \\(TrOCR\\) folder: ")
    ViTModel(ViTConfig(image_size=IMAGE_SIZE, patch_size=8, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                       intermediate_size=64)).save_pretrained(tmp_path / "vit")
    assert_one_line_error(lambda: build_reward({"name": "ocr", "path": str(tmp_path / "vit")}),
                          "is not a transformers VisionEncoderDecoder \\(TrOCR\\) folder: its model_type is 'vit'")


def test_prompts_without_quoted_text_are_refused(reward):
    good = 'a sign that says "Open Late"'
    for bad in ["a sign that says Open Late", 'a sign that says "Open Late', 'an empty sign ""', 'a blank " " sign']:
        assert_one_line_error(lambda: reward.check_prompts([good, bad, "no quotes either"]),
                              re.escape(f"prompt has no quoted text to render: {bad!r}"))
        assert_one_line_error(lambda: reward(_images(2), [good, bad]), "prompt has no quoted text")
