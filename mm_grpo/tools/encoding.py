"""The flags of the frozen encoders the offline tools run (precompute_text, write_features)."""
import dataclasses

import torch

from mm_grpo.families.flux.text import MAX_SEQUENCE_LENGTH
from mm_grpo.settings import setting


@dataclasses.dataclass(frozen=True)
class EncoderSettings:
    pipeline: str = setting(None, "diffusers FLUX pipeline folder (vae/, text_encoder/, tokenizer/, ...); "
                                  "write_features --family wan: a Wan pipeline folder", required=True)
    max_sequence_length: int = setting(MAX_SEQUENCE_LENGTH,
                                       "T5 (umT5) tokens per caption (the predictor block's text_len)",
                                       minimum=1)
    device: str = setting("cpu", "device of the encoders")
    dtype: str = setting("bfloat16", "of the encoders and of what they write", choices=["bfloat16", "float32"])

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)
