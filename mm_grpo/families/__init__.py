"""Model families: one package each, above the GRPO core and the shared floors (grpo/, rollout/,
flow/, parallel/, checkpoint/, plan/, rewards/, files/, the settings and seeding, training/loop.py
and all it imports), which know no family, and below the trainers and entries that build runs from
them (training/, mindspeed_mm/, tools/).

A new family goes in one package here, `mm_grpo/families/<name>/`, holding the same parts as the
others (each package's docstring lists where they are):
- its `Denoiser` subclass (the interface is mm_grpo/grpo/denoiser.py) and its guidance settings
  (a settings dataclass whose fields are the trainers' flags);
- `parts(model_cfg, settings, policy, device, dtype, guidance)` -> (conditioner, decoder, denoiser),
  what training/components.py `grpo_schedule` asks of a family;
- its transformer, where mm-grpo builds it (FLUX's `transformer/`; Wan's is MindSpeed-MM's), and
  its layout in Megatron's checkpoint format (FLUX's `checkpoint/`, with `weights.py`: what the
  training loop's checkpoints save and load of it);
- its encoders and latents: the frozen text encoder and VAE around the transformer;
- the planner: its formulas and their flags (`plan.py`, on the shared ones of mm_grpo/plan/) and its
  command (`plan_cli.py`, which mm_grpo/tools/plan.py picks by --model);
- the MindSpeed-MM glue (`mindspeed_mm.py`): the model as MindSpeed-MM builds or registers it;
- the tiny-model builders and their data, for tests and the demos.
Family code may import the shared floors, never the other way round (tests/test_layering.py)."""
