import pytest

from tests.distributed.conftest import check_result
from tests.megatron_save import HAS_MEGATRON_TRAINING

TOL = 1e-5


@pytest.mark.parametrize("nproc", [2, 4])
def test_converted_shards_load_into_a_tp_model(torchrun, nproc):
    m = check_result(torchrun(nproc), "converted_shards_load_at_tp")
    assert m["tp"] == nproc
    assert m["same_tp_vs_diffusers"] <= TOL
    assert m["other_tp_vs_diffusers"] <= TOL
    assert m["local_shards_identical"]  # read straight from the rank's shard == re-cut from another TP


@pytest.mark.parametrize("nproc,name,tp,pp_layers", [
    (4, "megatron_saved_tp2_pp2_reads", 2, [2, 4]),
    (2, "megatron_saved_pp2_vpp2_reads", 1, [[1, 2], [2, 1]]),
])
def test_megatron_saved_checkpoints_read_without_metadata(torchrun, nproc, name, tp, pp_layers):
    m = check_result(torchrun(nproc), name)
    assert m["writer"].startswith("megatron.training" if HAS_MEGATRON_TRAINING else "legacy tree")
    assert (m["tp"], m["pp_layers"]) == (tp, pp_layers)
    assert m["bit_exact"]
