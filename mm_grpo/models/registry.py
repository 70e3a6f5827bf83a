"""Model registry: `model_id` -> builder, and registration into MindSpeed-MM.

MindSpeed-MM keeps its DiT predictors in `PREDICTOR_MODEL_MAPPINGS`
(`mindspeed_mm/models/predictor/predict_model.py`); `PredictModel` instantiates the
class with the whole `predictor` block of model.json as keyword arguments and, under
pipeline parallelism, adds `num_layers`, `pre_process`, `post_process` and
`global_layer_idx` for the stage. MindSpeed-MM cannot be installed here, so the
registration is tested against that documented contract (tests/test_registry.py).
"""
import importlib

from mm_grpo.models.flux import FluxConfig, FluxTransformer

MODEL_REGISTRY = {}


def register_model(model_id):
    def wrap(builder):
        if model_id in MODEL_REGISTRY:
            raise ValueError(f"model_id {model_id!r} is already registered")
        MODEL_REGISTRY[model_id] = builder
        return builder
    return wrap


def build_model(model_id, **kwargs):
    if model_id not in MODEL_REGISTRY:
        raise ValueError(f"unknown model_id {model_id!r}; registered: {sorted(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[model_id](**kwargs)


def flux_config_from_block(block: dict) -> FluxConfig:
    """The architecture named by a predictor block: `config` (diffusers fields), a `preset`,
    or the `config.json` of `from_pretrained`, plus runtime options."""
    runtime = {k: block[k] for k in ("recompute_blocks", "bf16", "compile_blocks") if k in block}
    if "config" in block:
        return FluxConfig.from_diffusers_config(block["config"], **runtime)
    if "preset" in block:
        return FluxConfig.preset(block["preset"], **runtime)
    if block.get("from_pretrained"):
        from mm_grpo.checkpoint.metadata import CheckpointMeta
        from mm_grpo.checkpoint.paths import is_megatron_checkpoint, iteration_dir
        from mm_grpo.models.flux.hf_weights import transformer_dir
        path = block["from_pretrained"]
        if is_megatron_checkpoint(path):  # converted by mm-convert: config in model_layout.json
            return CheckpointMeta.load(iteration_dir(path)).config.replace(**runtime)
        return FluxConfig.from_diffusers_config(transformer_dir(path), **runtime)
    raise ValueError("predictor block needs one of 'config', 'preset' or 'from_pretrained'")


@register_model("flux")
class FluxPredictor(FluxTransformer):
    """FLUX built from a MindSpeed-MM style `predictor` block (keyword arguments).

    MindSpeed-MM's stage arguments are honoured: `global_layer_idx` (the global indices of
    this stage's blocks in [double..., single...]), `pre_process`, `post_process`.
    `num_layers` is MindSpeed's per-stage count; FLUX's own counts live in `config`."""

    def __init__(self, model_id="flux", pre_process=True, post_process=True, global_layer_idx=None,
                 num_layers=None, pipeline_num_layers=None, **block):
        config = flux_config_from_block(block)
        block_range = None
        if global_layer_idx is not None:
            idx = list(global_layer_idx)
            start = idx[0] if idx else 0
            if idx != list(range(start, start + len(idx))):
                raise ValueError(f"global_layer_idx must be consecutive, got {idx}")
            block_range = (start, start + len(idx))
            if num_layers is not None and num_layers != len(idx):
                raise ValueError(f"num_layers {num_layers} != len(global_layer_idx) {len(idx)}")
        super().__init__(config, pre_process=pre_process, post_process=post_process,
                         block_range=block_range)
        if block.get("from_pretrained"):
            load_pretrained(self, block["from_pretrained"])


def load_pretrained(model_chunks, path):
    """Weights for one model chunk or a rank's list of chunks, from a converted Megatron
    checkpoint (any TP/PP) or a diffusers folder (converted on the fly)."""
    from mm_grpo.checkpoint.loader import load_megatron_checkpoint
    from mm_grpo.checkpoint.paths import is_megatron_checkpoint
    from mm_grpo.parallel.pipeline import load_hf_weights_into_chunks
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    if is_megatron_checkpoint(path):
        load_megatron_checkpoint(chunks, path)
    else:
        load_hf_weights_into_chunks(chunks, path)
    return model_chunks


def register_into_mindspeed_mm(mapping=None):
    """Add every registered model to MindSpeed-MM's predictor mapping.

    Returns the mapping, or None when MindSpeed-MM is not installed."""
    if mapping is None:
        try:
            module = importlib.import_module("mindspeed_mm.models.predictor.predict_model")
        except ImportError:
            return None
        mapping = module.PREDICTOR_MODEL_MAPPINGS
    for model_id, builder in MODEL_REGISTRY.items():
        existing = mapping.get(model_id)
        if existing is not None and existing is not builder:
            raise ValueError(f"MindSpeed-MM already maps {model_id!r} to {existing!r}")
        mapping[model_id] = builder
    return mapping
