"""Model families: one package each, above the GRPO core and the shared floors (grpo/, rollout/,
flow/, parallel/, checkpoint/, rewards/, files/, the settings and seeding, training/loop.py), which
know no family, and below the trainers and entries that build runs from them (training/,
mindspeed_mm/, tools/).

A new family goes in one package here, `mm_grpo/families/<name>/`, holding the same parts as the
others (each package's docstring lists where they are):
- its `Denoiser` subclass (the interface is mm_grpo/grpo/denoiser.py) and its guidance settings
  (a settings dataclass whose fields are the trainers' flags);
- `parts(model_cfg, settings, policy, device, dtype, guidance)` -> (conditioner, decoder, denoiser),
  what training/components.py `grpo_schedule` asks of a family;
- its encoders and latents: the frozen text encoder and VAE around the transformer;
- the planner's formulas (`mm-grpo plan`, on the shared ones of mm_grpo/plan/);
- the MindSpeed-MM glue (`mindspeed_mm.py`): the model as MindSpeed-MM builds or registers it;
- the tiny-model builders and their data, for tests and the demos.
Family code may import the shared floors, never the other way round (tests/test_layering.py)."""
