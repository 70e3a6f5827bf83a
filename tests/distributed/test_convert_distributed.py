import pytest

from tests.distributed.conftest import check_result

TOL = 1e-5


@pytest.mark.parametrize("nproc", [2, 4])
def test_converted_shards_load_into_a_tp_model(torchrun, nproc):
    m = check_result(torchrun(nproc), "converted_shards_load_at_tp")
    assert m["tp"] == nproc
    assert m["same_tp_vs_diffusers"] <= TOL
    assert m["other_tp_vs_diffusers"] <= TOL
    assert m["local_shards_identical"]  # read straight from the rank's shard == re-cut from another TP
