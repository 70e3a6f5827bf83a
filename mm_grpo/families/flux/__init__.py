"""FLUX.1 text-to-image.

- denoiser and guidance: mm_grpo/families/flux/denoiser.py (`FluxDenoiser`, `FluxGuidance`: the distilled
  guidance embedding);
- parts: training/components.py `flux_parts(model_cfg, settings, policy, device, dtype, guidance)`
  -> (text conditioner, VAE decoder, denoiser);
- encoders and latents: mm_grpo/encoders/ (CLIP + T5, the VAE, latent packing);
- planner formulas: mm_grpo/plan/formulas.py;
- MindSpeed-MM glue: mm_grpo/families/flux/mindspeed_mm.py (FLUX as MindSpeed-MM's predictor);
- tiny builders: `tiny.py` (the tiny demo pipeline), `tiny_shapes.py` (the shapes pipeline; its data
  grammar, mm_grpo/data/shapes.py, is shared with the compositional reward).
"""
