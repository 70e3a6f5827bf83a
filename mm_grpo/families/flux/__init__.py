"""FLUX.1 text-to-image.

- the transformer: `transformer/` (FLUX.1 on megatron-core layers with TP / PP / Ulysses SP, its
  TP layout as data, diffusers weight loading, LoRA, and the packed-latent layout in `latents.py`);
  its layout in Megatron's checkpoint format: `checkpoint/` (metadata, reader, loading, adapters);
- denoiser and guidance: `denoiser.py` (`FluxDenoiser`, `FluxGuidance`: the distilled guidance
  embedding);
- parts: `parts.parts(model_cfg, settings, policy, device, dtype, guidance)` -> (text conditioner,
  VAE decoder, denoiser);
- run time: `chunks.py` (this rank's model chunks, their weights, forward / backward under
  megatron-core's schedules, pipelined inference), `predictor_block.py` (the config a model.json
  `predictor` block names);
- encoders and latents: `text.py` (CLIP + T5, the embedding cache), `vae.py` (the VAE decoder),
  `transformer/latents.py` (packing);
- planner: `plan.py` (the formulas, on mm_grpo/plan/'s shared ones), `plan_cli.py` (`mm-grpo plan
  --model flux-dev`);
- MindSpeed-MM glue: `mindspeed_mm.py` (FLUX as MindSpeed-MM's predictor; mm_grpo/mindspeed_mm/
  registry.py registers it);
- tiny builders: `tiny.py` (the tiny demo pipeline), `tiny_shapes.py` (the shapes pipeline; its data
  grammar, mm_grpo/data/shapes.py, is shared with the compositional reward).
"""
