"""LoRA adapters <-> diffusers' FLUX LoRA files (`pytorch_lora_weights.safetensors`, PEFT names), the
format `FluxPipeline.load_lora_weights` reads and diffusers' / flow_grpo's training scripts write.

Keys: `transformer.<diffusers module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]. No
alphas are written, so diffusers takes lora_alpha = r (scale 1): the exported B carries our
alpha / r. A fused linear (linear_qkv: to_q / to_k / to_v; linear_in: the same and proj_mlp) gives
each of its diffusers modules its one A and its rows of B. A file whose parts of a fused linear have
different A's (trained on the separate linears) loads as one adapter of their summed rank:
A = [A_q; A_k; A_v], B block-diagonal; parts missing from the file get zero rows of B. The format is
every family's (mm_grpo/lora.py); this is it on FLUX's layout.
"""
from typing import Dict

import torch

from mm_grpo import lora
from mm_grpo.families.flux.transformer import lora as flux_lora
from mm_grpo.families.flux.transformer.config import FluxConfig
from mm_grpo.families.flux.transformer.hf_weights import expected_hf_shapes
from mm_grpo.lora import LORA_FILE, PREFIX, Adapters, lora_file  # noqa: F401  (this module's API)


def to_diffusers(adapters: Adapters, flux_config: FluxConfig, config: flux_lora.LoRAConfig) -> Dict[str, torch.Tensor]:
    """Whole adapters (ours, B unscaled) -> the tensors of a diffusers FLUX LoRA file."""
    return lora.to_diffusers(flux_lora.LORA_LAYOUT, adapters, flux_config, config)


def read_diffusers_lora(path: str, flux_config: FluxConfig, config: flux_lora.LoRAConfig) -> Adapters:
    """A diffusers / PEFT FLUX LoRA file (or its folder) as whole adapters of `config.targets`, B
    divided by config.scaling so that the model computes what the file means."""
    return lora.read_diffusers_lora(flux_lora.LORA_LAYOUT, path, flux_config, config, expected_hf_shapes)
