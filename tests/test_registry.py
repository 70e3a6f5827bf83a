"""The model registry and its registration into MindSpeed-MM's predictor mapping.

MindSpeed-MM is not installable here: a stand-in module with its documented contract
(`PREDICTOR_MODEL_MAPPINGS` dict; `PredictModel` calls `cls(**predictor_block)` and adds
`num_layers`, `pre_process`, `post_process`, `global_layer_idx` per pipeline stage) is used.
"""
import sys
import types

import pytest
import torch

from mm_grpo.models.flux.hf_weights import load_hf_weights
from mm_grpo.models.registry import MODEL_REGISTRY, FluxPredictor, build_model, register_into_mindspeed_mm
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.utils import make_inputs, random_reference, reference_output, rel_err
from mm_grpo.models.flux import FluxConfig


def _fake_mindspeed_mm(monkeypatch):
    mapping = {"sat": object}
    names = ["mindspeed_mm", "mindspeed_mm.models", "mindspeed_mm.models.predictor",
             "mindspeed_mm.models.predictor.predict_model"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules[names[-1]].PREDICTOR_MODEL_MAPPINGS = mapping
    return mapping


def test_flux_is_registered():
    assert MODEL_REGISTRY["flux"] is FluxPredictor
    with pytest.raises(ValueError, match="unknown model_id 'sd3'"):
        build_model("sd3")


def test_registration_into_mindspeed_mm(monkeypatch):
    assert register_into_mindspeed_mm() is None  # not installed: nothing happens
    mapping = _fake_mindspeed_mm(monkeypatch)
    assert register_into_mindspeed_mm() is mapping
    assert mapping["flux"] is FluxPredictor and mapping["sat"] is object
    mapping["flux"] = object
    with pytest.raises(ValueError, match="already maps 'flux'"):
        register_into_mindspeed_mm()


def test_predictor_block_builds_like_predict_model(parallel_1proc, monkeypatch, tmp_path):
    """`PredictModel` style: cls(**block), and per PP stage with MindSpeed's stage arguments."""
    config = FluxConfig.preset("tiny")
    ref = random_reference(config, seed=9)
    ref.save_pretrained(tmp_path / "transformer")
    block = {"model_id": "flux", "from_pretrained": str(tmp_path / "transformer")}
    mapping = register_into_mindspeed_mm(_fake_mindspeed_mm(monkeypatch))
    model = mapping[block["model_id"]](**block)
    inputs = make_inputs(config)
    with torch.no_grad():
        assert rel_err(model(**inputs), reference_output(ref, inputs)) <= 1e-5
    # A middle pipeline stage: blocks 1..3 of [2 double, 4 single].
    stage = mapping["flux"](model_id="flux", preset="tiny", num_layers=3, pre_process=False,
                            post_process=False, global_layer_idx=[1, 2, 3])
    assert (len(stage.double_blocks), len(stage.single_blocks)) == (1, 2)
    assert stage.block_range == (1, 4) and not hasattr(stage, "x_embedder")
    load_hf_weights(stage, ref.state_dict())  # stage-local names map to the right global blocks
    torch.testing.assert_close(stage.single_blocks[1].q_norm.weight,
                               ref.single_transformer_blocks[1].attn.norm_q.weight, rtol=0, atol=0)
    with pytest.raises(ValueError, match="global_layer_idx must be consecutive"):
        mapping["flux"](preset="tiny", global_layer_idx=[0, 2])
    with pytest.raises(ValueError, match="needs one of 'config', 'preset' or 'from_pretrained'"):
        mapping["flux"](model_id="flux")
