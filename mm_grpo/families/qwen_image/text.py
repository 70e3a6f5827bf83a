"""Qwen-Image's text encoder (Qwen2.5-VL) and an offline embedding cache.

`QwenImageTextEncoder.encode` computes exactly what `QwenImagePipeline.encode_prompt` does, without a
pipeline object: each prompt in Qwen-Image's chat template, the decoder's last hidden state, the
template's system prefix dropped, the prompts padded to the batch's longest with their mask. As for FLUX,
training can precompute the features of its prompt set once (`save_text_embeddings`) and read them back
by prompt (`TextEmbeddingCache`), so the 8B-parameter Qwen2.5-VL never needs to sit next to the
transformer. Both give `(prompt_embeds [N, L, D], prompt_embeds_mask [N, L] or None)`, the text
`QwenImageDenoiser.conditioning` takes; the mask is None when no prompt is padded, as the pipeline's.
"""
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from mm_grpo.versions import transformers_5

logger = logging.getLogger(__name__)

# QwenImagePipeline's prompt template and the number of its leading tokens (the system prompt and the user
# turn's opening, `prompt_template_encode_start_idx`) dropped from the features.
PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                   "<|im_end|>\n<|im_start|>assistant\n")
TEMPLATE_START_IDX = 34
MAX_SEQUENCE_LENGTH = 1024  # QwenImagePipeline's tokenizer_max_length; it refuses more


def component_folder(pipeline_dir, name, marker="config.json") -> Path:
    """`pipeline_dir`/`name`, a folder of a diffusers Qwen-Image pipeline; a one-line FileNotFoundError
    when it has no `marker` file."""
    folder = Path(pipeline_dir) / name
    if not (folder / marker).is_file():
        raise FileNotFoundError(f"no {name}/ in {pipeline_dir} (expected a diffusers Qwen-Image pipeline folder)")
    return folder


def load_tokenizer(pipeline_dir):
    """The Qwen2 tokenizer of a pipeline folder, as the fast class: it reads tokenizer.json under
    transformers 4.x and 5 alike (pass it to `QwenImagePipeline.from_pretrained(..., tokenizer=...)` for
    a folder written under the other version)."""
    from transformers import Qwen2TokenizerFast

    # transformers 5 writes "extra_special_tokens": [] where 4.x expects a mapping.
    kwargs = {} if transformers_5() else {"extra_special_tokens": {}}
    return Qwen2TokenizerFast.from_pretrained(component_folder(pipeline_dir, "tokenizer", "tokenizer_config.json"),
                                              **kwargs)


def check_max_sequence_length(max_sequence_length: int):
    if isinstance(max_sequence_length, bool) or not isinstance(max_sequence_length, int) \
            or not 0 < max_sequence_length <= MAX_SEQUENCE_LENGTH:
        raise ValueError(f"max_sequence_length must be an integer in 1..{MAX_SEQUENCE_LENGTH} (QwenImagePipeline's "
                         f"limit), got {max_sequence_length!r}")


class QwenImageTextEncoder:
    """Qwen2.5-VL from a Qwen-Image pipeline folder; `encode(prompts)` -> (prompt_embeds [N, L, D],
    prompt_embeds_mask [N, L] (1: a prompt token) or None when no prompt is padded)."""

    def __init__(self, pipeline_dir, device="cpu", dtype=torch.float32, max_sequence_length=MAX_SEQUENCE_LENGTH):
        from transformers import Qwen2_5_VLForConditionalGeneration

        check_max_sequence_length(max_sequence_length)
        self.device = torch.device(device)
        self.max_sequence_length = max_sequence_length
        self.tokenizer = load_tokenizer(pipeline_dir)
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(component_folder(pipeline_dir, "text_encoder"),
                                                                    dtype=dtype)
        # The decoder without its language-model head: the features are hidden states, no logits are needed.
        self.text_encoder = model.model.to(self.device).eval().requires_grad_(False)

    @torch.no_grad()
    def encode(self, prompts):
        if isinstance(prompts, str):
            prompts = [prompts]
        if not prompts:
            raise ValueError("no prompts to encode")
        # As QwenImagePipeline._get_qwen_prompt_embeds: the templated text cut at 1024 + 34 tokens ...
        tokens = self.tokenizer([PROMPT_TEMPLATE.format(p) for p in prompts],
                                max_length=MAX_SEQUENCE_LENGTH + TEMPLATE_START_IDX, padding=True, truncation=True,
                                return_tensors="pt").to(self.device)
        hidden = self.text_encoder(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask,
                                   output_hidden_states=True).hidden_states[-1]
        # ... each prompt's own tokens, less the template's prefix, padded with zeros to the longest ...
        mask = tokens.attention_mask.bool()
        features = [h[m][TEMPLATE_START_IDX:] for h, m in zip(hidden, mask)]
        # ... then encode_prompt's cut at max_sequence_length.
        if max(len(f) for f in features) > self.max_sequence_length:
            logger.warning("prompts truncated to %d Qwen2.5-VL tokens", self.max_sequence_length)
        return pad_features([f[:self.max_sequence_length] for f in features], self.text_encoder.dtype)


def pad_features(features, dtype=None):
    """Per-prompt features [L_i, D] -> (embeds [N, max L_i, D] zero-padded, mask [N, max L_i] int64 or None
    when every prompt has the same length), as QwenImagePipeline.encode_prompt returns them."""
    longest = max(len(f) for f in features)
    embeds = torch.stack([torch.cat([f, f.new_zeros(longest - len(f), f.shape[1])]) for f in features])
    lengths = torch.tensor([len(f) for f in features], device=embeds.device)
    mask = (torch.arange(longest, device=embeds.device) < lengths[:, None]).long()
    return embeds.to(dtype or embeds.dtype), None if bool(mask.all()) else mask


def unpadded(embeds, mask):
    """`encode`'s (embeds, mask) -> each prompt's features [L_i, D]."""
    if mask is None:
        return list(embeds)
    return [e[:int(n)] for e, n in zip(embeds, mask.sum(dim=1))]


def save_text_embeddings(encoder, prompts, path, batch_size=16):
    """Encode every distinct prompt once and write each one's features (its own length) to one
    safetensors file, atomically."""
    from safetensors.torch import save_file

    prompts = list(dict.fromkeys(prompts))
    if not prompts:
        raise ValueError("no prompts to encode")
    features = []
    for i in range(0, len(prompts), batch_size):
        features += [f.cpu() for f in unpadded(*encoder.encode(prompts[i:i + batch_size]))]
    lengths = [len(f) for f in features]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        save_file({"prompt_embeds": torch.cat(features).contiguous()}, tmp,
                  metadata={"prompts": json.dumps(prompts), "lengths": json.dumps(lengths)})
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


class TextEmbeddingCache:
    """Reads a `save_text_embeddings` file; `get(prompts)` returns what `QwenImageTextEncoder.encode` would.

    The features of all prompts lie end to end in one tensor, read lazily (memory-mapped) by rows, so
    a large prompt set is not loaded whole."""

    def __init__(self, path):
        from safetensors import safe_open

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no text-embedding cache at {self.path}: build it with save_text_embeddings")
        with safe_open(self.path, framework="pt") as f:
            meta = f.metadata() or {}
        if not {"prompts", "lengths"} <= meta.keys():
            raise ValueError(f"{self.path} is not a Qwen-Image text-embedding cache (no 'prompts' and 'lengths' "
                             "metadata)")
        lengths = json.loads(meta["lengths"])
        starts = torch.tensor([0] + lengths).cumsum(0).tolist()
        self.rows = {p: (starts[i], starts[i] + n) for i, (p, n) in enumerate(zip(json.loads(meta["prompts"]), lengths))}

    def __len__(self):
        return len(self.rows)

    def __contains__(self, prompt):
        return prompt in self.rows

    def check(self, prompts):
        missing = [p for p in prompts if p not in self.rows]
        if missing:
            raise ValueError(f"{len(missing)} prompt(s) not in text-embedding cache {self.path}, e.g. {missing[0]!r}")

    def get(self, prompts, device="cpu"):
        from safetensors import safe_open

        if isinstance(prompts, str):
            prompts = [prompts]
        if not prompts:
            raise ValueError("no prompts to look up")
        self.check(prompts)
        with safe_open(self.path, framework="pt", device=str(device)) as f:
            embeds = f.get_slice("prompt_embeds")
            return pad_features([embeds[slice(*self.rows[p])] for p in prompts])
