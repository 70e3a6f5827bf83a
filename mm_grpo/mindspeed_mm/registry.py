"""Model registry: `model_id` -> builder, and its registration into MindSpeed-MM.

MindSpeed-MM keeps its DiT predictors in `PREDICTOR_MODEL_MAPPINGS`
(`mindspeed_mm/models/predictor/predict_model.py`). Importing this module registers every
model there: at once if MindSpeed-MM's module is already imported, otherwise the moment it
is (an import hook), so `"model_id": "flux"` (and Qwen-Image's `"mmgrpo_qwenimage"`) works in any MindSpeed-MM entry script run
through mm-grpo (`python -m mm_grpo.mindspeed_mm.run SCRIPT ARGS`) with no call to remember.
"""
import importlib.abc
import importlib.machinery
import importlib.util
import sys

from mm_grpo.families.flux import predictor_block
from mm_grpo.families.flux.mindspeed_mm import FluxPredictor
from mm_grpo.families.qwen_image import predictor_block as qwen_image_block
from mm_grpo.families.qwen_image.mindspeed_mm import QwenImagePredictor

MINDSPEED_MM_PREDICTORS = "mindspeed_mm.models.predictor.predict_model"
MODEL_REGISTRY = {predictor_block.MODEL_ID: FluxPredictor, qwen_image_block.MODEL_ID: QwenImagePredictor}


def build_model(model_id, **kwargs):
    if model_id not in MODEL_REGISTRY:
        raise ValueError(f"unknown model_id {model_id!r}; registered: {sorted(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[model_id](model_id=model_id, **kwargs)


def register_into_mindspeed_mm(mapping=None):
    """Add every registered model to MindSpeed-MM's predictor mapping (default: the one of the
    imported MindSpeed-MM module). Returns the mapping, or None when it is not imported."""
    if mapping is None:
        module = sys.modules.get(MINDSPEED_MM_PREDICTORS)
        if module is None:
            return None
        mapping = module.PREDICTOR_MODEL_MAPPINGS
    for model_id, builder in MODEL_REGISTRY.items():
        existing = mapping.get(model_id)
        if existing is not None and existing is not builder:
            raise ValueError(f"MindSpeed-MM already maps {model_id!r} to {existing!r}")
        mapping[model_id] = builder
    return mapping


class _RegisterOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs MindSpeed-MM's predictor module with its own loader, then registers into it."""

    def find_spec(self, name, path, target=None):
        if name != MINDSPEED_MM_PREDICTORS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None:
            self._loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        register_into_mindspeed_mm(module.PREDICTOR_MODEL_MAPPINGS)


if not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterOnImport())
register_into_mindspeed_mm()
