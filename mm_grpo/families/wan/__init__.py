"""Wan2.1 text-to-video (docs/video.md), on MindSpeed-MM's own DiT (`"model_id": "wandit"`).

- denoiser and guidance: `mindspeed_mm.py` (`WanDenoiser`, `WanGuidance`: classifier-free guidance
  against a negative prompt);
- parts: `mindspeed_mm.parts(model_cfg, settings, policy, device, dtype, guidance)` -> (umT5
  conditioner, VAE decoder, denoiser);
- encoders and latents: `encoders.py` (umT5 prompt embeddings, Wan's VAE, the latent and token grid);
- planner formulas: `plan.py`, its flags and table: `plan_cli.py`;
- MindSpeed-MM glue: `mindspeed_mm.py` (the wandit predictor block, its launch checks and pipeline
  shapes);
- tiny builders: `tiny.py` (a diffusers Wan2.1 pipeline of a 2-block DiT), `tiny_motion.py` (the
  motion pipeline's builders, its diffusers DiT as a `Denoiser`, its evaluation's reference levels);
  the motion data and rewards are shared (mm_grpo/data/motion.py, mm_grpo/rewards/video.py), the
  recipe's command line is a tool (mm_grpo/tools/tiny_motion.py: it evaluates with training's
  `Evaluator`).
"""
