"""The `flux` predictor block (MindSpeed-MM's way: hyperparameters inline), its loading from one
file, and its registration into MindSpeed-MM's real predictor factory (tests/testbed.py).

Multi-process layouts (TP2, PP2, virtual stages) through the real PredictModel:
tests/distributed/test_mindspeed_mm_predictor.py."""
import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from mm_grpo.families.flux.mindspeed_mm import FluxPredictor
from mm_grpo.families.flux.predictor_block import flux_config_from_block
from mm_grpo.families.flux.transformer import FluxConfig
from mm_grpo.mindspeed_mm.registry import MODEL_REGISTRY, build_model
from mm_grpo.recompute import EVERY_BLOCK, recompute_fields
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.testbed import REPO, require_testbed, subprocess_env
from tests.utils import assert_one_line_error, make_inputs, random_reference, reference_output, rel_err

TINY = FluxConfig.preset("tiny")  # 2 double + 4 single blocks


def inline_block(config=TINY, **extra):
    """A predictor block written like MindSpeed-MM's wandit blocks: hyperparameters inline."""
    return {"model_id": "flux", "dtype": "fp32", **config.to_diffusers_config(), **extra}


def test_flux_is_registered():
    assert MODEL_REGISTRY["flux"] is FluxPredictor
    assert_one_line_error(lambda: build_model("sd3"), "unknown model_id 'sd3'")


def test_inline_block_names_the_architecture():
    assert flux_config_from_block(inline_block()) == TINY
    assert flux_config_from_block(inline_block(dtype="bf16")).bf16
    assert flux_config_from_block(inline_block(dtype=torch.bfloat16)).bf16  # MindSpeed-MM's ConfigReader
    assert_one_line_error(lambda: flux_config_from_block(inline_block(dtype="fp16")), "predictor dtype 'fp16'")
    assert_one_line_error(lambda: flux_config_from_block(inline_block(hidden_size=64)),
                          r'^the flux predictor block: unknown key "hidden_size" \(known: ')
    assert_one_line_error(lambda: flux_config_from_block({"model_id": "flux"}),
                          "give the architecture inline")


def test_heads_under_mindspeed_mm_names():
    """MindSpeed-MM's names for the heads and their width (num_heads, head_dim: its validate_args
    reads them) mean diffusers' num_attention_heads and attention_head_dim; given both ways, equal."""
    diffusers_names = ("num_attention_heads", "attention_head_dim")
    mindspeed_mm_way = {k: v for k, v in inline_block().items() if k not in diffusers_names}
    assert flux_config_from_block(dict(mindspeed_mm_way, num_heads=4, head_dim=16)) == TINY
    assert flux_config_from_block(inline_block(num_heads=4, head_dim=16)) == TINY
    assert_one_line_error(lambda: flux_config_from_block(inline_block(num_heads=2)),
                          "num_heads = 2 and num_attention_heads = 4 are MindSpeed-MM's and diffusers' names")
    assert_one_line_error(lambda: flux_config_from_block(dict(mindspeed_mm_way, num_heads=4, head_dim=8)),
                          r"axes_dims_rope \(4, 6, 6\) must sum to attention_head_dim \(8\)")


def test_mindspeed_mm_entry_refuses_a_block_its_validation_cannot_read(tmp_path, capsys):
    """Without num_heads, MindSpeed-MM's validate_args multiplies a missing head count (tested in
    tests/test_mindspeed_mm_sora.py): `-m mm_grpo.mindspeed_mm.run` says what to add, in one line."""
    from mm_grpo.mindspeed_mm.run import main
    for block, missing in ((inline_block(), '"num_heads": 4, "head_dim": 16'),
                           (inline_block(num_heads=4), '"head_dim": 16')):
        (tmp_path / "model.json").write_text(json.dumps({"predictor": block}))
        with pytest.raises(SystemExit) as exit_:
            main(["pretrain_sora.py", "--mm-data", "data.json", "--mm-model", str(tmp_path / "model.json")])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("mm-grpo: error: "), err
        assert "MindSpeed-MM sets --num-attention-heads from num_heads" in err and err.strip().endswith(missing)
    (tmp_path / "model.json").write_text(json.dumps({"predictor": inline_block(num_heads=4, hidden_size=64)}))
    with pytest.raises(SystemExit):
        main(["pretrain_sora.py", f"--mm-model={tmp_path / 'model.json'}"])
    assert 'the flux predictor block: unknown key "hidden_size"' in capsys.readouterr().err


def test_with_pipeline_num_layers_num_layers_counts_all_blocks():
    """PredictModel checks sum(pipeline_num_layers) == num_layers: there num_layers is 2 + 4."""
    block = inline_block(num_layers=6, pipeline_num_layers=[2, 4])
    assert flux_config_from_block(block).num_layers == 2  # double-stream blocks
    assert flux_config_from_block(inline_block(num_layers=6, pipeline_num_layers=[[1, 2], [1, 2]])) == TINY
    # A stage's block: PredictModel replaced num_layers by the stage's count.
    assert flux_config_from_block(dict(block, num_layers=4), staged=True) == TINY
    assert_one_line_error(lambda: flux_config_from_block(inline_block(pipeline_num_layers=[2, 4])),
                          r"with pipeline_num_layers, num_layers counts all blocks .* = 6, num_layers = 2")
    assert_one_line_error(lambda: flux_config_from_block(inline_block(num_layers=3, pipeline_num_layers=[1, 2])),
                          "sum\\(pipeline_num_layers\\) = 3 is less than num_single_layers = 4")


def test_shipped_mindspeed_mm_config_is_flux_dev():
    from mm_grpo.files.jsonfile import load_json
    block = load_json(os.path.join(REPO, "examples/flux/mindspeed_mm/pretrain_model.json"), "model.json")["predictor"]
    assert flux_config_from_block(block) == FluxConfig.preset("flux-dev", bf16=True, **recompute_fields(EVERY_BLOCK))


def test_from_pretrained_must_be_one_file(parallel_1proc, tmp_path):
    assert_one_line_error(lambda: FluxPredictor(**inline_block(from_pretrained=str(tmp_path))),
                          "is not a file: MindSpeed-MM loads one .safetensors")


def test_diffusers_state_dict_loads_into_any_stage(parallel_1proc):
    ref = random_reference(TINY, seed=9)
    model = FluxPredictor(**inline_block())
    keys = model.load_state_dict(ref.state_dict(), strict=True)
    assert keys.missing_keys == [] and keys.unexpected_keys == []
    inputs = make_inputs(TINY)
    with torch.no_grad():
        assert rel_err(model(**inputs), reference_output(ref, inputs)) <= 1e-5
    # A middle pipeline stage (blocks 1..3 of [2 double, 4 single]) takes its blocks only.
    stage = FluxPredictor(**inline_block(num_layers=3, pipeline_num_layers=[1, 3, 2]), pre_process=False,
                          post_process=False, global_layer_idx=(1, 2, 3))
    assert (len(stage.double_blocks), len(stage.single_blocks)) == (1, 2)
    keys = stage.load_state_dict(ref.state_dict(), strict=False)
    assert keys.missing_keys == [] and keys.unexpected_keys == []
    torch.testing.assert_close(stage.single_blocks[1].q_norm.weight,
                               ref.single_transformer_blocks[1].attn.norm_q.weight, rtol=0, atol=0)
    # What it lacks and what is no FLUX weight are reported; strict refuses both.
    partial = {k: v for k, v in ref.state_dict().items() if k != "single_transformer_blocks.1.attn.norm_q.weight"}
    partial["not_a_flux_weight"] = torch.zeros(1)
    keys = stage.load_state_dict(partial, strict=False)
    assert keys.missing_keys == ["single_transformer_blocks.1.attn.norm_q.weight"]
    assert keys.unexpected_keys == ["not_a_flux_weight"]
    assert_one_line_error(lambda: stage.load_state_dict(partial), "does not fit the model: missing")
    assert_one_line_error(lambda: FluxPredictor(**inline_block(), global_layer_idx=[0, 2]),
                          "global_layer_idx must be consecutive")


def test_own_state_dict_loads_as_torch_does(parallel_1proc):
    """Megatron's --load hands the predictor its own (stage, TP shard) state dict."""
    source = FluxPredictor(**inline_block())
    target = FluxPredictor(**inline_block())
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()
    target.load_state_dict(source.state_dict())
    loaded = target.state_dict()
    tensors = {k: v for k, v in source.state_dict().items() if torch.is_tensor(v)}  # not Megatron's _extra_state
    assert len(tensors) > 50 and all(torch.equal(v, loaded[k]) for k, v in tensors.items())


# --- against MindSpeed-MM's own code ---------------------------------------------------------
_REGISTERED = """
import mm_grpo
{first}
{second}
from mindspeed_mm.models.predictor.predict_model import PREDICTOR_MODEL_MAPPINGS
from mm_grpo.families.flux.mindspeed_mm import FluxPredictor
assert PREDICTOR_MODEL_MAPPINGS["flux"] is FluxPredictor, PREDICTOR_MODEL_MAPPINGS
assert "wandit" in PREDICTOR_MODEL_MAPPINGS
print("registered")
"""


@pytest.mark.mindspeed_mm
@pytest.mark.parametrize("mm_grpo_first", [True, False])
def test_flux_registers_into_mindspeed_mm_on_import_in_either_order(mm_grpo_first):
    require_testbed(needs_megatron_training=True)
    ours, theirs = "import mm_grpo.mindspeed_mm.registry", "import mindspeed_mm.models.predictor.predict_model"
    first, second = (ours, theirs) if mm_grpo_first else (theirs, ours)
    out = subprocess.run([sys.executable, "-c", _REGISTERED.format(first=first, second=second)], cwd=REPO,
                         env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "registered" in out.stdout, out.stderr[-3000:]


def _predict_model(block):
    """MindSpeed-MM's PredictModel on a model.json block, and what its load_checkpoint printed."""
    require_testbed(needs_megatron_training=True)
    import mm_grpo.mindspeed_mm.registry  # noqa: F401
    from mindspeed_mm.configs.config import ConfigReader
    from mindspeed_mm.models.predictor import PredictModel
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        model = PredictModel(ConfigReader(block)).get_model()
    return model, printed.getvalue()


@pytest.mark.mindspeed_mm
def test_predict_model_loads_one_diffusers_file(parallel_1proc, tmp_path):
    ref = random_reference(TINY, seed=4)
    path = str(tmp_path / "diffusion_pytorch_model.safetensors")
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, path)
    model, printed = _predict_model(inline_block(from_pretrained=path))
    assert "Missing keys: []" in printed and "Unexpected keys: []" in printed
    inputs = make_inputs(TINY)
    with torch.no_grad():
        assert rel_err(model(**inputs), reference_output(ref, inputs)) <= 1e-5


@pytest.mark.mindspeed_mm
def test_predict_model_loads_mm_convert_output(parallel_1proc, tmp_path):
    """mm-convert's TP1 shard (`{"model": state_dict}`) is a file MindSpeed-MM's load_checkpoint reads."""
    ref = random_reference(TINY, seed=6)
    ref.save_pretrained(tmp_path / "transformer")
    out = subprocess.run(
        [sys.executable, "-m", "converters.convert_cli", "FluxConverter", "hf_to_mm",
         "--cfg.source_path", str(tmp_path / "transformer"), "--cfg.target_path", str(tmp_path / "mm")],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    model, printed = _predict_model(inline_block(from_pretrained=str(tmp_path / "mm/release/mp_rank_00/model_optim_rng.pt")))
    assert "Missing keys: []" in printed and "Unexpected keys: []" in printed
    inputs = make_inputs(TINY)
    with torch.no_grad():
        assert rel_err(model(**inputs), reference_output(ref, inputs)) <= 1e-5
