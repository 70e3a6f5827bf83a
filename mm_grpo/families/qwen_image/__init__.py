"""Qwen-Image text-to-image (20B MMDiT, Qwen2.5-VL-7B text encoder; docs/qwen_image.md).

- the transformer: `transformer/` (Qwen-Image on megatron-core layers with TP / PP / Ulysses SP and the
  prompts' padding masked in the joint attention, its TP layout as data, diffusers weight loading);
- run time: `chunks.py` (this rank's model chunks, their weights, forward / backward under megatron-core's
  schedules).

Still to come (docs/qwen_image.md, "Status"): the checkpoint layout and `mm-convert
QwenImageConverter`, the Qwen2.5-VL encoder and VAE, the denoiser with true CFG, LoRA, the
MindSpeed-MM predictor and scripts, the planner, the tiny pipeline and its demo.
"""
