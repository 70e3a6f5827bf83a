"""LoRA adapters <-> diffusers' Qwen-Image LoRA files (`pytorch_lora_weights.safetensors`, PEFT names),
the format `QwenImagePipeline.load_lora_weights` reads and diffusers' / flow_grpo's training scripts write
(mm_grpo/lora.py, on Qwen-Image's layout).

Keys: `transformer.transformer_blocks.N.attn.to_q.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]
(`transformer.norm_out.linear.*` for the head's adaLN). No alphas are written, so diffusers takes
lora_alpha = r (scale 1): the exported B carries our alpha / r. The fused q / k / v adapter gives each
of to_q / to_k / to_v (add_q_proj / add_k_proj / add_v_proj) its one A and its heads' rows of B; a file
trained on the separate linears (their own A's) loads as one adapter of their summed rank.
"""
from typing import Dict

import torch

from mm_grpo import lora
from mm_grpo.families.qwen_image.transformer import lora as qwen_lora
from mm_grpo.families.qwen_image.transformer.config import QwenImageConfig
from mm_grpo.families.qwen_image.transformer.hf_weights import expected_hf_shapes
from mm_grpo.lora import LORA_FILE, PREFIX, Adapters, lora_file  # noqa: F401  (this module's API)


def to_diffusers(adapters: Adapters, qwen_config: QwenImageConfig,
                 config: qwen_lora.LoRAConfig) -> Dict[str, torch.Tensor]:
    """Whole adapters (ours, B unscaled) -> the tensors of a diffusers Qwen-Image LoRA file."""
    return lora.to_diffusers(qwen_lora.LORA_LAYOUT, adapters, qwen_config, config)


def read_diffusers_lora(path: str, qwen_config: QwenImageConfig, config: qwen_lora.LoRAConfig) -> Adapters:
    """A diffusers / PEFT Qwen-Image LoRA file (or its folder) as whole adapters of `config.targets`, B
    divided by config.scaling so that the model computes what the file means."""
    return lora.read_diffusers_lora(qwen_lora.LORA_LAYOUT, path, qwen_config, config, expected_hf_shapes)
