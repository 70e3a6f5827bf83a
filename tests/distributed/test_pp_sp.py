"""Pipeline + Ulysses SP (+ TP) parity: the checks run in tests/distributed/checks_pp_sp.py."""
import pytest

from tests.distributed.conftest import check_result

TOL = 1e-5
LAYOUTS = ["tp2_sp2", "tp2_pp2", "pp2_sp2", "pp2_sp2_megatron_ddp", "pp4", "pp4_vpp2", "sp4_uneven"]


def _assert_parity(m, prefix=""):
    assert m[prefix + "n_micro_batches"] == 4
    assert m[prefix + "all_grads_compared"] and m[prefix + "n_grads"] > 50, "some parameters' gradients were not compared"
    assert m[prefix + "out_err"] <= TOL
    assert m[prefix + "loss_err"] <= TOL
    assert m[prefix + "grad_err"] <= TOL


@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_backward_matches_single_process(torchrun, layout):
    _assert_parity(check_result(torchrun(4), f"{layout}_matches_single_process"))


def test_virtual_stages_need_micro_batches_in_groups_of_pp(torchrun):
    m = check_result(torchrun(4), "pp4_vpp2_matches_single_process")
    assert m["three_micro_batches_error"] == ("the interleaved (virtual-stage) schedule needs a number of "
                                              "micro-batches divisible by the pipeline size 4, got 3")


def test_two_processes_sp_uneven_and_virtual_pipeline(torchrun):
    m = check_result(torchrun(2), "sp2_uneven_and_pp2_vpp2_match_single_process")
    _assert_parity(m, "sp2_")
    _assert_parity(m, "pp2_vpp2_")


def test_plain_forward_under_sp_matches_diffusers(torchrun):
    m = check_result(torchrun(4), "sp_direct_forward_matches_diffusers")
    assert m["n_grads"] == m["n_ref_grads"] > 50
    assert m["out_vs_diffusers"] <= TOL
    assert m["grad_err"] <= TOL


def test_pipelined_inference_matches_single_process_over_16_steps(torchrun):
    m = check_result(torchrun(4), "pipelined_inference_16_steps_matches_single_process")
    assert set(m) == {"pp2_sp2_mbs2", "pp4_vpp2_mbs2"}
    for layout, err in m.items():
        assert err <= TOL, layout


def test_bf16_stage_boundary_is_exact_and_sp_only_rounds(torchrun):
    m = check_result(torchrun(2), "bf16_forward_pp2_sp2_match_single_process_bf16")
    assert m["pp2"] == 0.0
    assert m["sp2"] < 2e-2  # bf16 rounding of a differently split attention
