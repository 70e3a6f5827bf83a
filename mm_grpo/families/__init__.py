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
import dataclasses
from types import ModuleType
from typing import Callable, Optional


@dataclasses.dataclass(frozen=True)
class Family:
    """A family as mm-grpo's own trainers build and train it (each package's `family.py` declares one;
    mm_grpo/training/components.py `TRAINED` maps model.json's predictor model_id to it). Every entry is
    the family's own function or module; the trainers know no family beyond these names."""
    name: str  # the model's name in messages
    model_id: str  # the predictor block's model_id
    config_from_block: Callable  # (predictor block with the run's runtime options) -> the family's config
    build_model_chunks: Callable  # (config, pp_layers) -> this rank's model chunks
    load_pretrained: Callable  # (chunks, path: a converted checkpoint or a diffusers folder) -> chunks
    forward_backward: Callable  # (chunks, micro_batches, loss_fn, forward_only=False, denoiser=None) -> per mb
    lora: ModuleType  # LoRAConfig, TARGETS, RECOMMENDED_TARGETS, add_adapters, ... (mm_grpo/lora.py's API)
    read_diffusers_lora: Callable  # (path, config, lora_config) -> {first diffusers name: (A, B)}
    weights: ModuleType  # the model in a training checkpoint: state_dict(chunk), load(chunks, folder)
    checkpoint_meta: Callable  # (config, tp_size, pp_layers) -> the metadata a checkpoint records
    lora_entry: Callable  # (checkpoint path) -> its LoRA entry, or None
    checkpoint_base: Callable  # (LoRA checkpoint path) -> the base weights it names, or None
    guidance: type  # the guidance settings (a settings dataclass: its fields are the trainer's flags)
    parts: Callable  # (model_cfg, settings, policy, device, dtype, guidance) -> (conditioner, decoder, denoiser)
    token_grid: Callable  # (height, width) -> (rows, columns) of the latent tokens; refuses a size in one line
    check_text: Callable  # (text_encoder block, prompts) -> None: a precomputed feature cache holds them all
    # (ae block, device) -> encode(images [N, 3, H, W] in [0, 1]) -> the packed latents [N, *latent_shape] the
    # transformer is trained on (deterministic); None: flow-matching training does not train the family
    latent_encoder: Optional[Callable] = None
