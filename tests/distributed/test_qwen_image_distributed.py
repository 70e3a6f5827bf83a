"""Qwen-Image under TP, Ulysses SP and PP (virtual stages too): the checks run in
tests/distributed/checks_qwen_image.py."""
from tests.distributed.conftest import check_result

TOL = 1e-5


def test_tp_and_sp_with_prompts_of_mixed_lengths_match_diffusers_and_the_single_process(torchrun):
    m = check_result(torchrun(4), "qwen_image_tp_sp_with_masked_text_match_single_process")
    assert set(m) == {"tp2_sp2", "sp4", "tp4"}
    for name, errs in m.items():
        assert errs["same_grads"] and errs["n_grads"] > 40, name
        assert errs["out_vs_diffusers"] <= TOL, name
        assert errs["grad_err"] <= TOL, name


def test_pipeline_stages_virtual_stages_and_their_mix_with_tp_and_sp_match_the_single_process(torchrun):
    m = check_result(torchrun(4), "qwen_image_pipeline_layouts_match_single_process")
    assert set(m) == {"tp2_pp2", "pp2_sp2", "pp4", "pp2_vpp2"}
    for name, errs in m.items():
        assert errs["n_micro_batches"] == 4 and errs["all_grads_compared"] and errs["n_grads"] > 90, name
        assert errs["out_err"] <= TOL, name
        assert errs["grad_err"] <= TOL, name


def test_the_rollouts_true_cfg_velocity_through_pipeline_stages_matches_the_single_process(torchrun):
    m = check_result(torchrun(4), "qwen_image_pipelined_true_cfg_velocity_matches_single_process")
    assert set(m) == {"pp2_sp2", "pp2_vpp2"} and max(m.values()) <= TOL, m


def test_checkpoints_of_other_layouts_load_into_running_pipelines(torchrun):
    m = check_result(torchrun(4), "qwen_image_checkpoints_of_other_layouts_load_into_running_pipelines")
    assert set(m) == {"tp2_pp2", "pp2_vpp2"}
    for running, loaded in m.items():
        assert loaded.pop("params_on_a_rank") > 40 and loaded == {"tp4": True, "pp2": True, "tp2_vpp2": True}, running


def test_lora_at_tp2_pp2_matches_the_single_process(torchrun):
    m = check_result(torchrun(4), "qwen_image_lora_tp2_pp2_matches_single_process")
    assert m["n_micro_batches"] == 4 and m["all_grads_compared"] and m["n_grads"] == 76 and m["base_frozen"]
    assert m["out_err"] <= 1e-5 and m["grad_err"] <= 1e-5
