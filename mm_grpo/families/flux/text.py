"""FLUX's two text encoders (CLIP-L pooled + T5 sequence) and an offline embedding cache.

`TextEncoders.encode` computes exactly what `FluxPipeline.encode_prompt` does, without a
pipeline object. As DanceGRPO does, training can precompute the embeddings of its prompt
set once (`save_text_embeddings`) and read them back by prompt (`TextEmbeddingCache`), so
the 4.7B-parameter T5 never needs to sit next to the transformer.
"""
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from mm_grpo.versions import transformers_5

logger = logging.getLogger(__name__)

MAX_SEQUENCE_LENGTH = 512  # FLUX.1's T5 length; FluxPipeline refuses more

# The fast (tokenizers) classes: they read a folder's tokenizer.json under transformers 4.x and 5
# alike (in 5 they are the only ones; 4.x's slow CLIPTokenizer / T5Tokenizer need vocab files).
_COMPONENTS = {
    "tokenizer": "CLIPTokenizerFast",
    "text_encoder": "CLIPTextModel",
    "tokenizer_2": "T5TokenizerFast",
    "text_encoder_2": "T5EncoderModel",
}


def _load(pipeline_dir, name, **kwargs):
    import transformers

    folder = Path(pipeline_dir) / name
    if not folder.is_dir():
        raise FileNotFoundError(f"no {name}/ in {pipeline_dir} (expected a diffusers FLUX pipeline folder)")
    if name.startswith("tokenizer") and not transformers_5():
        # transformers 5 writes "extra_special_tokens": [] where 4.x expects a mapping.
        kwargs.setdefault("extra_special_tokens", {})
    return getattr(transformers, _COMPONENTS[name]).from_pretrained(folder, **kwargs)


def load_tokenizers(pipeline_dir) -> dict:
    """{"tokenizer": CLIP's, "tokenizer_2": T5's} of a pipeline folder, as fast tokenizers: pass
    them to `FluxPipeline.from_pretrained` for a folder written under transformers 5 (its
    model_index names CLIPTokenizer / T5Tokenizer, which are slow classes in 4.x)."""
    return {name: _load(pipeline_dir, name) for name in ("tokenizer", "tokenizer_2")}


def _frozen(model, device):
    return model.to(device).eval().requires_grad_(False)


class TextEncoders:
    """CLIP-L + T5 from a FLUX pipeline folder; `encode(prompts)` -> (prompt_embeds, pooled, txt_ids)."""

    def __init__(self, pipeline_dir, device="cpu", dtype=torch.float32, max_sequence_length=MAX_SEQUENCE_LENGTH):
        if not 0 < max_sequence_length <= MAX_SEQUENCE_LENGTH:
            raise ValueError(f"max_sequence_length must be in 1..{MAX_SEQUENCE_LENGTH}, got {max_sequence_length}")
        self.device = torch.device(device)
        self.max_sequence_length = max_sequence_length
        self.tokenizer, self.tokenizer_2 = load_tokenizers(pipeline_dir).values()
        self.text_encoder = _frozen(_load(pipeline_dir, "text_encoder", dtype=dtype), self.device)
        self.text_encoder_2 = _frozen(_load(pipeline_dir, "text_encoder_2", dtype=dtype), self.device)

    def _tokenize(self, tokenizer, prompts, max_length):
        tokens = tokenizer(prompts, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt")
        if any(len(t) > max_length for t in tokenizer(prompts).input_ids):
            logger.warning("prompts truncated to %d %s tokens", max_length, type(tokenizer).__name__)
        return tokens.to(self.device)

    @torch.no_grad()
    def encode(self, prompts):
        """prompts: list[str] -> prompt_embeds [B, L, D_t5], pooled [B, D_clip], txt_ids [L, 3] (zeros)."""
        prompt_embeds, pooled, _ = self.encode_with_masks(prompts)
        txt_ids = torch.zeros(prompt_embeds.shape[1], 3, device=self.device, dtype=self.text_encoder.dtype)
        return prompt_embeds, pooled, txt_ids

    @torch.no_grad()
    def encode_with_masks(self, prompts):
        """`encode`'s two features and the tokenizers' attention masks (1: a prompt token, 0: padding),
        (T5 [B, L], CLIP [B, 77]). FLUX attends to every token: the masks only describe the sequences
        (MindSpeed-MM's feature files carry them as `prompt_mask`)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        # CLIP: pooled output only, at the tokenizer's own length (77).
        clip = self._tokenize(self.tokenizer, prompts, self.tokenizer.model_max_length)
        pooled = self.text_encoder(clip.input_ids, output_hidden_states=False).pooler_output
        pooled = pooled.to(dtype=self.text_encoder.dtype)
        # T5: the whole padded sequence, no attention mask (FLUX attends to the pad tokens too).
        t5 = self._tokenize(self.tokenizer_2, prompts, self.max_sequence_length)
        prompt_embeds = self.text_encoder_2(t5.input_ids, output_hidden_states=False)[0]
        prompt_embeds = prompt_embeds.to(dtype=self.text_encoder_2.dtype)
        return prompt_embeds, pooled, (t5.attention_mask, clip.attention_mask)


def save_text_embeddings(encoders, prompts, path, batch_size=16):
    """Encode every distinct prompt once and write them to one safetensors file, atomically."""
    from safetensors.torch import save_file

    prompts = list(dict.fromkeys(prompts))
    if not prompts:
        raise ValueError("no prompts to encode")
    embeds, pooled = [], []
    for i in range(0, len(prompts), batch_size):
        e, p, _ = encoders.encode(prompts[i : i + batch_size])
        embeds.append(e.cpu())
        pooled.append(p.cpu())
    tensors = {"prompt_embeds": torch.cat(embeds), "pooled_prompt_embeds": torch.cat(pooled)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"prompts": json.dumps(prompts)})
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


class TextEmbeddingCache:
    """Reads a `save_text_embeddings` file; `get(prompts)` returns what `TextEncoders.encode` would.

    Rows are read lazily (memory-mapped), so a large prompt set is not loaded whole.
    """

    def __init__(self, path):
        from safetensors import safe_open

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no text-embedding cache at {self.path}: build it with save_text_embeddings")
        with safe_open(self.path, framework="pt") as f:
            meta = f.metadata() or {}
        if "prompts" not in meta:
            raise ValueError(f"{self.path} is not a text-embedding cache (no 'prompts' metadata)")
        self.index = {p: i for i, p in enumerate(json.loads(meta["prompts"]))}

    def __len__(self):
        return len(self.index)

    def __contains__(self, prompt):
        return prompt in self.index

    def check(self, prompts):
        missing = [p for p in prompts if p not in self.index]
        if missing:
            raise ValueError(f"{len(missing)} prompt(s) not in text-embedding cache {self.path}, e.g. {missing[0]!r}")

    def get(self, prompts, device="cpu"):
        from safetensors import safe_open

        if isinstance(prompts, str):
            prompts = [prompts]
        self.check(prompts)
        rows = [self.index[p] for p in prompts]
        with safe_open(self.path, framework="pt", device=str(device)) as f:
            embeds = f.get_slice("prompt_embeds")
            pooled = f.get_slice("pooled_prompt_embeds")
            prompt_embeds = torch.cat([embeds[r : r + 1] for r in rows])
            pooled_embeds = torch.cat([pooled[r : r + 1] for r in rows])
        txt_ids = torch.zeros(prompt_embeds.shape[1], 3, device=device, dtype=pooled_embeds.dtype)
        return prompt_embeds, pooled_embeds, txt_ids
