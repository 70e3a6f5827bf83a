"""FLUX.1 text-to-image.

- denoiser and guidance: `denoiser.py` (`FluxDenoiser`, `FluxGuidance`: the distilled guidance
  embedding);
- parts: `parts.parts(model_cfg, settings, policy, device, dtype, guidance)` -> (text conditioner,
  VAE decoder, denoiser);
- run time: `chunks.py` (this rank's model chunks, their weights, forward / backward under
  megatron-core's schedules, pipelined inference), `predictor_block.py` (the config a model.json
  `predictor` block names);
- encoders and latents: `text.py` (CLIP + T5, the embedding cache), `vae.py` (the VAE decoder);
  latent packing is the transformer's input layout, with the transformer in mm_grpo/models/flux/
  (`latents.py`): both stay below the families, read by the checkpoint layout and the planner;
- planner formulas: mm_grpo/plan/formulas.py (below the families for the same reason);
- MindSpeed-MM glue: `mindspeed_mm.py` (FLUX as MindSpeed-MM's predictor; mm_grpo/mindspeed_mm/
  registry.py registers it);
- tiny builders: `tiny.py` (the tiny demo pipeline), `tiny_shapes.py` (the shapes pipeline; its data
  grammar, mm_grpo/data/shapes.py, is shared with the compositional reward).
"""
