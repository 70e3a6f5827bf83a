"""Two flow-matching iterations under TP2, SP2, PP2 and DP2 (world size 2) on the tiny pipeline.

Each layout writes its losses and final weights (diffusers names) to $MM_GRPO_TEST_OUT;
tests/distributed/test_flow_distributed.py compares them with a single-process run.
"""
import os

import torch
import torch.distributed as dist

from tests.distributed.worker import check
from tests.grpo_helpers import ADAM_LINEAR, LAYOUTS, flow_argv, run_flow, write_flow_configs


def _run_layout(name):
    from tests.utils import gather_hf_state_dict
    out = os.environ["MM_GRPO_TEST_OUT"]
    folder = os.path.join(out, "flow_cfg")
    if dist.get_rank() == 0:
        write_flow_configs(folder, os.environ["MM_GRPO_TEST_PIPELINE"])
    dist.barrier()
    history, run = run_flow(flow_argv(os.path.join(folder, "model.json"), os.path.join(folder, "data.json"),
                                      extra=LAYOUTS[name] + ADAM_LINEAR))
    weights = gather_hf_state_dict(run.model.chunks)
    if dist.get_rank() == 0:
        torch.save({"history": history, "weights": weights}, os.path.join(out, f"flow_{name}.pt"))
    return {"losses": [h["loss"] for h in history]}


@check(2)
def flow_tp2():
    return _run_layout("tp2")


@check(2)
def flow_sp2():
    return _run_layout("sp2")


@check(2)
def flow_pp2():
    return _run_layout("pp2")


@check(2)
def flow_dp2():
    return _run_layout("dp2")
