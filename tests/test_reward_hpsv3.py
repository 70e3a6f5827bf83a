"""HPSv3 on a tiny random Qwen2-VL built from transformers' config classes (the real weights are
given by path), against a float64 transcription of the authors' inference: their conversation,
image size and resampling, their forward (token embeddings with the image's merged patches
scattered in, the language model at its default positions) and their "ranknet" head at <|Reward|>."""
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from torch import nn

from mm_grpo.rewards import build_reward
from mm_grpo.rewards.hpsv3 import INSTRUCTION, RATING_REQUEST

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]
# Qwen2-VL-Instruct's chat template (its chat_template.json)
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")
PROMPTS = ["a red circle", "two blue squares side by side", "a cat"]


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([INSTRUCTION, RATING_REQUEST, *PROMPTS, "system You are a helpful assistant. user assistant"],
                            trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return Qwen2TokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                              unk_token=None, bos_token=None)


def _old_layout(key):
    """The key as transformers wrote it before Qwen2-VL's model / language_model split (HPSv3's release)."""
    return key.replace("model.language_model.", "model.", 1).replace("model.visual.", "visual.", 1)


def _authors_head(hidden):
    return nn.Sequential(nn.Linear(hidden, 1024), nn.ReLU(), nn.Dropout(0.05), nn.Linear(1024, 16), nn.ReLU(),
                         nn.Linear(16, 2))


@pytest.fixture(scope="module")
def hpsv3(tmp_path_factory):
    """(backbone folder, checkpoint): a tiny Qwen2-VL with its processor, and an HPSv3 checkpoint of it."""
    from transformers import (Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor, Qwen2VLProcessor,
                              Qwen2VLVideoProcessor)
    folder = tmp_path_factory.mktemp("qwen2vl")
    tokenizer = _tokenizer()
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(), tokenizer=tokenizer,
                                 video_processor=Qwen2VLVideoProcessor(), chat_template=CHAT_TEMPLATE)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIALS}
    config = Qwen2VLConfig(
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"])
    config.save_pretrained(folder)
    processor.save_pretrained(folder)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config)
    model.resize_token_embeddings(len(tokenizer) + 1, mean_resizing=False)  # + <|Reward|>, as HPSv3 trains
    head = _authors_head(config.text_config.hidden_size)
    with torch.no_grad():
        for p in [*model.parameters(), *head.parameters()]:
            p.normal_(0, 0.5)
    state = {_old_layout(k): v.contiguous() for k, v in model.state_dict().items()}
    state.update({f"rm_head.{k}": v for k, v in head.state_dict().items()})
    checkpoint = folder / "HPSv3.safetensors"
    save_file(state, str(checkpoint))
    return folder, checkpoint


def _images(n, size=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), generator=g).float() / 255


def _smart_resize(height, width, factor=28, pixels=256 * 28 * 28):
    """Qwen2-VL's smart_resize with HPSv3's min = max pixels."""
    h, w = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
    if h * w > pixels:
        beta = math.sqrt(height * width / pixels)
        return math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    if h * w < pixels:
        beta = math.sqrt(pixels / (height * width))
        return math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def _authors_reward(folder, checkpoint, images, prompts):
    """HPSv3RewardInferencer.reward(...)[:, 0] in float64, transcribed step by step."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoProcessor, Qwen2VLForConditionalGeneration
    processor = AutoProcessor.from_pretrained(folder, padding_side="right")
    processor.tokenizer.add_special_tokens({"additional_special_tokens": ["<|Reward|>"]})
    special = processor.tokenizer.convert_tokens_to_ids("<|Reward|>")
    config = AutoConfig.from_pretrained(folder)
    model = Qwen2VLForConditionalGeneration(config)
    model.resize_token_embeddings(len(processor.tokenizer))
    head = _authors_head(config.text_config.hidden_size)
    state = load_file(str(checkpoint))
    head.load_state_dict({k[8:]: v for k, v in state.items() if k.startswith("rm_head.")})
    new = {k.replace("visual.", "model.visual.", 1) if k.startswith("visual.") else
           k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
           for k, v in state.items() if not k.startswith("rm_head.")}
    model.load_state_dict(new)
    model, head = model.double().eval(), head.double().eval()
    pil = []
    for image in images:
        array = (image * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
        h, w = _smart_resize(*array.shape[:2])
        pil.append(Image.fromarray(np.ascontiguousarray(array)).convert("RGB").resize((w, h), Image.BICUBIC))
    conversations = [[{"role": "user", "content": [
        {"type": "image", "image": img, "min_pixels": 256 * 28 * 28, "max_pixels": 256 * 28 * 28},
        {"type": "text", "text": INSTRUCTION.format(text_prompt=text) + RATING_REQUEST}]}]
        for text, img in zip(prompts, pil)]
    batch = processor(text=processor.apply_chat_template(conversations, tokenize=False, add_generation_prompt=True),
                      images=pil, padding=True, return_tensors="pt")
    with torch.no_grad():
        embeds = model.get_input_embeddings()(batch["input_ids"])
        out = model.model.visual(batch["pixel_values"].double(), grid_thw=batch["image_grid_thw"])
        image_embeds = out.pooler_output if hasattr(out, "pooler_output") else out
        mask = (batch["input_ids"] == config.image_token_id).unsqueeze(-1).expand_as(embeds)
        embeds = embeds.masked_scatter(mask, image_embeds)
        hidden = model.model.language_model(inputs_embeds=embeds, attention_mask=batch["attention_mask"])[0]
        return head(hidden[batch["input_ids"] == special]).view(len(prompts), -1)[:, 0]


def test_hpsv3_equals_the_authors_inference_in_float64(hpsv3):
    folder, checkpoint = hpsv3
    reward = build_reward({"name": "hpsv3", "path": str(checkpoint), "backbone": str(folder)})
    images = _images(3)
    ours = reward(images, PROMPTS)
    expected = _authors_reward(folder, checkpoint, images, PROMPTS)
    assert ours.dtype == torch.float32 and ours.shape == (3,)
    assert torch.allclose(ours.double(), expected, rtol=1e-4, atol=1e-5), (ours, expected)
    assert expected.std() > 1e-3  # the images and prompts are told apart
    larger = _images(1, size=128, seed=1)  # resized to the same 448 x 448 before the processor
    assert torch.allclose(reward(larger, PROMPTS[:1]).double(),
                          _authors_reward(folder, checkpoint, larger, PROMPTS[:1]), rtol=1e-4, atol=1e-5)


def test_hpsv3_config_errors_are_one_line(hpsv3, tmp_path):
    folder, checkpoint = hpsv3
    with pytest.raises(ValueError, match="needs `backbone`"):
        build_reward({"name": "hpsv3", "path": str(checkpoint)})
    other = tmp_path / "clip"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "clip"}))
    with pytest.raises(ValueError, match="is not a Qwen2-VL folder|not a Qwen2VLConfig"):
        build_reward({"name": "hpsv3", "path": str(checkpoint), "backbone": str(other)})
    from safetensors.torch import load_file
    state = load_file(str(checkpoint))
    state.pop("rm_head.5.weight")
    save_file(state, str(tmp_path / "broken.safetensors"))
    with pytest.raises(ValueError, match="does not fit HPSv3") as e:
        build_reward({"name": "hpsv3", "path": str(tmp_path / "broken.safetensors"), "backbone": str(folder)})
    assert "\n" not in str(e.value)


def test_a_checkpoint_in_todays_qwen2vl_layout_scores_the_same(hpsv3, tmp_path):
    """Saved after transformers split Qwen2-VL into model.visual / model.language_model: the same reward."""
    from safetensors.torch import load_file
    folder, checkpoint = hpsv3
    state = load_file(str(checkpoint))
    new = {("model.visual." + k[7:] if k.startswith("visual.") else
            "model.language_model." + k[6:] if k.startswith("model.") else k): v for k, v in state.items()}
    save_file(new, str(tmp_path / "new_layout.safetensors"))
    images = _images(2, seed=3)
    old = build_reward({"name": "hpsv3", "path": str(checkpoint), "backbone": str(folder)})(images, PROMPTS[:2])
    ours = build_reward({"name": "hpsv3", "path": str(tmp_path / "new_layout.safetensors"),
                         "backbone": str(folder)})(images, PROMPTS[:2])
    assert torch.equal(old, ours)
