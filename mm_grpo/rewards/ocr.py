"""flow_grpo's OCR reward (text rendering accuracy) on a transformers TrOCR recogniser.

The prompt quotes the text the image should show (`a neon sign that says "Open Late"`).
flow_grpo's `OcrScorer` (flow_grpo/ocr.py) reads the image and scores

    reward = 1 - min(dist, len(target)) / len(target)

where target is the quoted text and recognised the text read from the image, both with
spaces removed and lower-cased, and dist is 0 when target occurs in recognised, else the
Levenshtein distance between them. So the reward lies in [0, 1]: 1 when the text is
rendered (extra text around it costs nothing), 0 when nothing of it is.

Recognition differs from flow_grpo's: flow_grpo runs PaddleOCR's detector and recogniser
and joins the lines it finds; here a transformers `VisionEncoderDecoderModel` (TrOCR, e.g.
microsoft/trocr-base-printed) reads the whole image as one line, greedily. That fits
images whose text is one line (flow_grpo's OCR prompts are short phrases); text in
several lines or small text in a large scene is read worse than a detector would.
Also unlike flow_grpo, a recogniser failure raises instead of scoring 0.
"""
import torch

from mm_grpo.rewards.base import Reward, one_line, register_reward

QUOTE = '"'
# Tokens the recogniser may emit per image: TrOCR's BPE averages a few characters per
# token, so this covers phrases far longer than flow_grpo's OCR prompts.
MAX_NEW_TOKENS = 64
MODEL_TYPE = "vision-encoder-decoder"


def target_text(prompt):
    """The text between the prompt's first pair of double quotes (flow_grpo: `split('"')[1]`).

    flow_grpo has no answer for a prompt without quoted text (its split fails) or with an
    empty quote (it divides by zero), so neither is scored here: ValueError.
    """
    parts = prompt.split(QUOTE)
    if len(parts) < 3 or not normalise(parts[1]):
        raise ValueError(f"reward 'ocr': prompt has no quoted text to render: {prompt!r:.200}")
    return parts[1]


def normalise(text):
    """flow_grpo compares texts without spaces and in lower case."""
    return text.replace(" ", "").lower()


def levenshtein(a, b):
    """Edit distance (insertions, deletions, substitutions, each costing 1)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))  # distances from a[:0] to each prefix of b
    for i, char_a in enumerate(a, 1):
        current = [i]
        for j, char_b in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def ocr_reward(recognised, target):
    """flow_grpo's reward for recognised text against the quoted target text."""
    recognised, target = normalise(recognised), normalise(target)
    dist = 0 if target in recognised else levenshtein(recognised, target)
    # Unrelated extra characters cost at most the whole target, not more.
    return 1.0 - min(dist, len(target)) / len(target)


def _load_processor(path):
    """AutoProcessor with the torch image backend, which preprocesses on the reward's device."""
    import transformers
    from transformers import AutoProcessor

    # transformers 5 selects the backend by name; 4.x calls the torch one the fast processor.
    major = int(transformers.__version__.split(".")[0])
    backend = {"backend": "torchvision"} if major >= 5 else {"use_fast": True}
    return AutoProcessor.from_pretrained(path, **backend)


@register_reward("ocr")
class OcrReward(Reward):
    """flow_grpo's OCR reward; `path` is a TrOCR-style folder (VisionEncoderDecoderModel + processor)."""

    def __init__(self, cfg, device="cpu"):
        from transformers import AutoConfig, GenerationConfig, VisionEncoderDecoderModel
        from transformers.image_processing_utils_fast import BaseImageProcessorFast

        super().__init__(cfg, device)
        path = cfg.require_path("path", "folder")
        not_ocr = f"reward {cfg.name!r}: {path} is not a transformers VisionEncoderDecoder (TrOCR) folder"
        try:  # the config alone first: a wrong folder fails before any weights are read
            model_type = AutoConfig.from_pretrained(path).model_type
        except Exception as e:
            raise ValueError(f"{not_ocr}: {one_line(e)}") from None
        if model_type != MODEL_TYPE:
            raise ValueError(f"{not_ocr}: its model_type is {model_type!r}")
        try:
            processor = _load_processor(path)
            model = VisionEncoderDecoderModel.from_pretrained(path, dtype=cfg.torch_dtype)
        except Exception as e:
            raise ValueError(f"{not_ocr}: {one_line(e)}") from None
        image_processor = getattr(processor, "image_processor", None)
        if not isinstance(image_processor, BaseImageProcessorFast) or not hasattr(processor, "batch_decode"):
            raise ValueError(f"{not_ocr}: its processor needs a torch image processor and a tokenizer, "
                             f"got {type(processor).__name__}")
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.processor = processor
        ids = model.generation_config
        # Plain greedy decoding. It replaces the saved generation config rather than being
        # passed beside it, because generate() fills unset and default-valued fields from the
        # model's own config: beam search or n-gram bans saved with a TrOCR checkpoint would
        # otherwise change the text read.
        self.model.generation_config = GenerationConfig(
            max_new_tokens=MAX_NEW_TOKENS, do_sample=False, num_beams=1,
            decoder_start_token_id=ids.decoder_start_token_id, bos_token_id=ids.bos_token_id,
            eos_token_id=ids.eos_token_id, pad_token_id=ids.pad_token_id)

    def check_prompts(self, prompts):
        for prompt in dict.fromkeys(prompts):
            target_text(prompt)

    def recognise(self, images):
        """The text read from each image [B, 3, H, W] in [0, 1], one line per image."""
        # uint8 as flow_grpo hands PaddleOCR its images; then the processor, on the device.
        pixels = (images.float() * 255).round().clamp(0, 255).to(torch.uint8)
        inputs = self.processor.image_processor(images=pixels, return_tensors="pt", device=self.device)
        pixel_values = inputs.pixel_values.to(self.device, self.model.dtype)
        tokens = self.model.generate(pixel_values=pixel_values, generation_config=self.model.generation_config)
        return self.processor.batch_decode(tokens, skip_special_tokens=True)

    def score(self, images, prompts):
        targets = [target_text(prompt) for prompt in prompts]  # before the recogniser runs
        recognised = self.recognise(images)
        values = [ocr_reward(text, target) for text, target in zip(recognised, targets)]
        return torch.tensor(values, dtype=torch.float32, device=self.device)
