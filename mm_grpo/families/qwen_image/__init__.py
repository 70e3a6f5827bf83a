"""Qwen-Image text-to-image (20B MMDiT, Qwen2.5-VL-7B text encoder; docs/qwen_image.md).

- the transformer: `transformer/` (Qwen-Image on megatron-core layers with TP / PP / Ulysses SP and the
  prompts' padding masked in the joint attention, its TP layout as data, diffusers weight loading);
- run time: `chunks.py` (this rank's model chunks, their weights, forward / backward under megatron-core's
  schedules, the rollout's pipelined velocity with QwenImagePipeline's true CFG);
- denoiser and guidance: `denoiser.py` (`QwenImageDenoiser`, `QwenImageGuidance`: true CFG against a
  negative prompt, the guided velocity rescaled to the conditional one's norm).

Still to come (docs/qwen_image.md, "Status"): `parts`, the Qwen2.5-VL encoder and VAE, the checkpoint
layout and `mm-convert QwenImageConverter`, LoRA, the MindSpeed-MM predictor and scripts, the planner,
the tiny pipeline and its demo.
"""
