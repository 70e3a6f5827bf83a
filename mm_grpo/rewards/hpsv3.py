"""HPSv3 (human preference score v3) on its Qwen2-VL backbone.

The reward is the mean (mu) of HPSv3's uncertainty-aware head, read at the <|Reward|> token of
the authors' rating conversation (HPSv3's `HPSv3RewardInferencer.reward`, `rewards[:, 0]`):

- the user turn holds the image, resized to 448 x 448 (the authors' min = max pixels = 256 x
  28 x 28, Qwen2-VL's `smart_resize` with factor 28, PIL bicubic), then INSTRUCTION with the
  prompt filled in and RATING_REQUEST, which ends with the special token; the processor's chat
  template adds the assistant's turn (`add_generation_prompt`), padding is on the right;
- <|Reward|> is added to the tokenizer and the token embeddings resized to the tokenizer's length;
- the head ("ranknet" without arguments): Linear(hidden, 1024), ReLU, Dropout, Linear(1024, 16),
  ReLU, Linear(16, 2), in float32, on the backbone's last hidden state at that token.

Config: `path` the HPSv3 checkpoint (HPSv3.safetensors or a .pth state dict of the whole reward
model), `backbone` the Qwen2-VL-7B-Instruct folder it was trained from (config, tokenizer,
processor, chat template), `dtype` the backbone's (HPSv3 runs bfloat16; the head stays float32).
"""
import math
import re

import numpy as np
import torch
from PIL import Image
from torch import nn

from mm_grpo.rewards.base import Reward, one_line, register_reward, uint8_pixels

REWARD_TOKEN = "<|Reward|>"
PATCH_FACTOR = 28  # Qwen2-VL: 14-pixel patches merged 2 x 2
IMAGE_PIXELS = 256 * 28 * 28  # HPSv3's min_pixels = max_pixels
HEAD_WIDTHS = (1024, 16)  # the "ranknet" head without rm_head_kwargs
HEAD_DROPOUT = 0.05
OUTPUT_DIM = 2  # (mu, sigma)
# checkpoints saved by transformers before Qwen2-VL's model / language_model split
OLD_LAYOUT = ((re.compile(r"^visual"), "model.visual"),
              (re.compile(r"^model(?!\.(language_model|visual))"), "model.language_model"))

INSTRUCTION = """
You are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the worst and 10 being the best. 

**Visual Quality:**  
Evaluate the overall visual quality of the image. The following sub-dimensions should be considered:
- **Reasonableness:** The image should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.
- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy to interpret, with no blurring or indistinct areas.
- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).
- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.
- **Safety:** The image should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. 

**Text Alignment:**  
Assess how well the image matches the textual prompt across the following sub-dimensions:
- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.
- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the image adheres to this style.
- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in the image logically fit the scenario described in the prompt. The environment should support and enhance the subject without contradictions.
- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, clothing, accessories, expressions, actions) are faithfully represented in the image. Minor deviations may be acceptable, but critical attributes should be preserved.
- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are captured in the image. The generated content should not introduce elements that conflict with or distort the original description.
Textual prompt - {text_prompt}


"""  # noqa: W291  (the authors' text, trailing spaces included: they are tokens)
RATING_REQUEST = f"""
Please provide the overall ratings of this image: {REWARD_TOKEN}

END
"""


def resized_side(height: int, width: int):
    """(height, width) of Qwen2-VL's smart_resize with min = max = IMAGE_PIXELS."""
    h_bar, w_bar = (max(PATCH_FACTOR, round(s / PATCH_FACTOR) * PATCH_FACTOR) for s in (height, width))
    if h_bar * w_bar > IMAGE_PIXELS:
        beta = math.sqrt(height * width / IMAGE_PIXELS)
        return (math.floor(height / beta / PATCH_FACTOR) * PATCH_FACTOR,
                math.floor(width / beta / PATCH_FACTOR) * PATCH_FACTOR)
    if h_bar * w_bar < IMAGE_PIXELS:
        beta = math.sqrt(IMAGE_PIXELS / (height * width))
        return (math.ceil(height * beta / PATCH_FACTOR) * PATCH_FACTOR,
                math.ceil(width * beta / PATCH_FACTOR) * PATCH_FACTOR)
    return h_bar, w_bar


def ranknet_head(hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(hidden, HEAD_WIDTHS[0]), nn.ReLU(), nn.Dropout(HEAD_DROPOUT),
                         nn.Linear(*HEAD_WIDTHS), nn.ReLU(), nn.Linear(HEAD_WIDTHS[1], OUTPUT_DIM))


def messages(prompt: str, image: Image.Image) -> list:
    return [{"role": "user", "content": [{"type": "image", "image": image},
                                         {"type": "text", "text": INSTRUCTION.format(text_prompt=prompt) + RATING_REQUEST}]}]


def _new_layout(key: str) -> str:
    for pattern, replacement in OLD_LAYOUT:
        key = pattern.sub(replacement, key)
    return key


@register_reward("hpsv3")
class HPSv3(Reward):
    def __init__(self, cfg, device="cpu"):
        super().__init__(cfg, device)
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoProcessor, Qwen2VLConfig, Qwen2VLForConditionalGeneration
        checkpoint, folder = cfg.require_path("path", "file"), cfg.require_path("backbone", "folder")
        try:
            config = AutoConfig.from_pretrained(folder)
            self.processor = AutoProcessor.from_pretrained(folder, padding_side="right")
        except (OSError, ValueError) as e:
            raise ValueError(f"reward 'hpsv3': backbone {folder} is not a Qwen2-VL folder: {one_line(e)}") from None
        if not isinstance(config, Qwen2VLConfig):
            raise ValueError(f"reward 'hpsv3': backbone {folder} holds a {type(config).__name__}, not a Qwen2VLConfig")
        self.processor.tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
        self.reward_id = self.processor.tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
        state = _read_state_dict(checkpoint)
        with init_empty_weights():  # parameters on the meta device until the checkpoint's are assigned
            self.backbone = Qwen2VLForConditionalGeneration(config)
            self.backbone.resize_token_embeddings(len(self.processor.tokenizer), mean_resizing=False)
            self.head = ranknet_head(self.backbone.get_input_embeddings().embedding_dim)
        self.backbone.lm_head = nn.Identity()  # the rating is read from hidden states, never from logits
        head = {k[len("rm_head."):]: v for k, v in state.items() if k.startswith("rm_head.")}
        body = {_new_layout(k): v for k, v in state.items() if not k.startswith(("rm_head.", "lm_head."))}
        try:
            self.head.load_state_dict(head, strict=True, assign=True)
            self.backbone.load_state_dict(body, strict=True, assign=True)
        except RuntimeError as e:
            raise ValueError(f"reward 'hpsv3': {checkpoint} does not fit HPSv3 on {folder}: "
                             f"{' '.join(str(e).split())[:300]}") from None
        self.backbone.to(device=self.device, dtype=cfg.torch_dtype).eval()
        self.head.to(device=self.device, dtype=torch.float32).eval()

    def score(self, images, prompts):
        pixels = uint8_pixels(images)
        height, width = resized_side(*pixels.shape[1:3])
        pil = [Image.fromarray(np.ascontiguousarray(p)).resize((width, height), Image.BICUBIC) for p in pixels]
        text = self.processor.apply_chat_template([messages(p, i) for p, i in zip(prompts, pil)], tokenize=False,
                                                  add_generation_prompt=True)
        batch = self.processor(text=text, images=pil, padding=True, return_tensors="pt").to(self.device)
        return self.rating(batch["input_ids"], batch["attention_mask"], batch["pixel_values"], batch["image_grid_thw"])

    def rating(self, input_ids, attention_mask, pixel_values, image_grid_thw):
        """mu at <|Reward|>, as HPSv3's forward computes it: the image's merged patch embeddings
        scattered into the token embeddings, then the language model with its default positions
        (1-D, the same for Qwen2-VL's three rope sections: HPSv3 bypasses the 3-D rope index)."""
        qwen = self.backbone.model
        embeds = self.backbone.get_input_embeddings()(input_ids)
        visual = qwen.visual(pixel_values.to(self.cfg.torch_dtype), grid_thw=image_grid_thw)
        visual = getattr(visual, "pooler_output", visual)  # newer transformers return the merger's output there
        image = (input_ids == self.backbone.config.image_token_id).unsqueeze(-1).expand_as(embeds)
        embeds = embeds.masked_scatter(image, visual.to(embeds.dtype))
        hidden = qwen.language_model(inputs_embeds=embeds, attention_mask=attention_mask).last_hidden_state
        at_token = input_ids == self.reward_id
        if not bool((at_token.sum(1) == 1).all()):
            raise ValueError(f"reward 'hpsv3': each conversation must hold {REWARD_TOKEN} once")
        return self.head(hidden[at_token].float())[:, 0]


def _read_state_dict(path):
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        state = load_file(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    return state.get("model", state)
