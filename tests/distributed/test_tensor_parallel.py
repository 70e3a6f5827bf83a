import pytest

from tests.distributed.conftest import check_result

TOL = 1e-5


@pytest.mark.parametrize("nproc", [2, 4])
def test_tp_output_and_grads_match_single_process(torchrun, nproc):
    m = check_result(torchrun(nproc), "tp_matches_tp1_and_diffusers")
    assert m["tp"] == nproc
    assert m["out_vs_tp1"] <= TOL
    assert m["out_vs_diffusers"] <= TOL
    assert m["n_grads"] > 50  # every parameter's gradient was compared
    assert m["grad_vs_tp1_max"] <= TOL, m["worst_grad"]


@pytest.mark.parametrize("nproc", [2, 4])
def test_tp_lora_output_and_adapter_grads_match_single_process(torchrun, nproc):
    """Adapters on every kind of linear (column, row, packed, gathered adaLN) under TP2 / TP4."""
    m = check_result(torchrun(nproc), "tp_lora_matches_tp1")
    assert m["tp"] == nproc
    assert m["out_vs_tp1"] <= TOL
    # A and B of 2 x 2 x 5 double-block linears, 3 per single block and the final adaLN
    assert m["n_grads"] == 2 * (2 * 2 * 5 + 3 * 4 + 1)
    assert m["min_grad"] > 0
    assert m["grad_vs_tp1_max"] <= TOL, m["worst_grad"]
