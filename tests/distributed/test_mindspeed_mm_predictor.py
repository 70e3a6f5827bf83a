"""MindSpeed-MM's own PredictModel builds and loads `flux` at TP2, PP2 (pipeline_num_layers),
PP2 x 2 virtual stages and TP2 x PP2: checks in tests/distributed/checks_mindspeed_mm.py."""
import pytest

from tests.distributed.conftest import check_result

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
