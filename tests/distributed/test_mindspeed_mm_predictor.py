"""MindSpeed-MM's own PredictModel builds and loads `flux` at TP2, PP2 (pipeline_num_layers),
PP2 x 2 virtual stages and TP2 x PP2: checks in tests/distributed/checks_mindspeed_mm.py."""
import pytest

from tests.distributed.conftest import check_result, launch

pytestmark = pytest.mark.mindspeed_mm
TOL = 1e-5


@pytest.mark.parametrize("nproc,layout,blocks", [
    (2, "tp2", [[(2, 6)], [(2, 6)]]),
    (2, "pp2", [[(2, 1)], [(0, 5)]]),
    (2, "pp2_vpp2", [[(1, 0), (0, 2)], [(1, 1), (0, 3)]]),
    (4, "tp2_pp2", [[(2, 2)], [(2, 2)], [(0, 4)], [(0, 4)]]),
])
def test_predict_model_builds_loads_and_matches_diffusers(torchrun, nproc, layout, blocks):
    m = check_result(torchrun(nproc), f"predict_model_{layout}_matches_diffusers")
    assert m["clean_load"], "MindSpeed-MM's load_checkpoint reported missing or unexpected keys"
    assert [[tuple(b) for b in rank] for rank in m["blocks"]] == blocks  # (double, single) per chunk
    assert m["out_err"] <= TOL


@pytest.mark.parametrize("layout", ["tp2", "cp2"])
def test_pretrain_sora_flow_step_equals_mm_grpo(torchrun, layout):
    """MindSpeed-MM's pretrain_sora.py forward step + loss at TP2 / Ulysses CP2, backpropagated
    and averaged as Megatron does: loss and every gradient equal mm-grpo's single-process
    flow-matching loss (times the scheduler's timestep weight)."""
    m = check_result(torchrun(2), f"pretrain_sora_flow_step_{layout}_matches_mm_grpo")
    assert m["n_grads"] > 50
    assert m["loss_err"] <= TOL
    assert m["grad_err"] <= TOL


def test_mindspeed_mm_lora_at_tp2_equals_mm_grpo_lora(torchrun):
    """MindSpeed-MM's own LoRA (peft) at TP2 with whole adapters sharded by mm-grpo's adapter layout
    rules: loss and whole adapter gradients equal mm-grpo's single-process LoRA (docs/lora.md)."""
    m = check_result(torchrun(2), "pretrain_sora_lora_tp2_matches_mm_grpo_lora")
    assert m["n_adapters"] == 2 * (2 * 2 * 4 + 6 * 2)  # A and B: 2 double blocks x 2 streams x 4 + 6 single x 2
    assert m["loss_err"] <= TOL
    assert m["grad_err"] <= 1e-4


def test_pretrain_sora_flow_step_under_pipeline_parallelism(tmp_path):
    """pretrain_sora.py at PP2 through MindSpeed's multi-tensor pipeline schedule (the predictor's
    initialize_pipeline_tensor_shapes and pipeline_set_*_stage_tensor): loss and every stage's
    gradients equal mm-grpo's single-process flow-matching step."""
    results = launch(2, str(tmp_path), {}, module="tests.distributed.sora_pp_worker",
                     args=("--use-multiparameter-pipeline-model-parallel",))
    m = check_result(results, "sora_pp2_flow_step_matches_mm_grpo")
    assert m["n_grads"] == 116 and m["min_grad_norm"] > 0  # both stages' gradients, all of them real
    assert m["loss_err"] <= TOL
    assert m["grad_err"] <= TOL
