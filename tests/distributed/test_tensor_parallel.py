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
