"""Qwen-Image text-to-image (20B MMDiT, Qwen2.5-VL-7B text encoder; docs/qwen_image.md).

- the transformer: `transformer/` (Qwen-Image on megatron-core layers with TP / PP / Ulysses SP and the
  prompts' padding masked in the joint attention, its TP layout as data, diffusers weight loading);
- run time: `chunks.py` (this rank's model chunks, their weights, forward / backward under megatron-core's
  schedules, the rollout's pipelined velocity with QwenImagePipeline's true CFG);
- denoiser and guidance: `denoiser.py` (`QwenImageDenoiser`, `QwenImageGuidance`: true CFG against a
  negative prompt, the guided velocity rescaled to the conditional one's norm).

- the trainers' view: `family.py` (`Family`), `predictor_block.py`, `parts.py`; the checkpoint layout:
  `checkpoint/` (and `converters/qwen_image.py`); LoRA: `transformer/lora.py`, `transformer/lora_hf.py`;
- encoders and latents: `text.py` (Qwen2.5-VL, the feature cache), `vae.py`, `sigmas.py` (the pipeline's schedule);
- MindSpeed-MM glue: `mindspeed_mm.py`; planner: `plan.py`, `plan_cli.py`; tiny builder: `tiny.py`.
"""
