"""Two flow-matching iterations under TP2, SP2, PP2 and DP2 (world size 2) on the tiny pipeline.

Each layout writes its losses and final weights (diffusers names) to $MM_GRPO_TEST_OUT;
tests/distributed/test_flow_distributed.py compares them with a single-process run. The
helpers here also build the single-process runs of tests/test_flow_matching.py.
"""
import os

import torch
import torch.distributed as dist

from tests.distributed.worker import check
from tests.grpo_helpers import ADAM_LINEAR, LAYOUTS, write_run_configs


def write_flow_configs(folder, pipeline_dir, num_images=8, reward=None):
    """A shapes dataset and model.json / data.json for the tiny pipeline; returns (model, data) paths."""
    from mm_grpo.data.shapes import generate_dataset
    os.makedirs(folder, exist_ok=True)
    data_dir = os.path.join(folder, "data")
    if not os.path.exists(data_dir):
        generate_dataset(data_dir, num_images, seed=4)
    model = {"ae": {"from_pretrained": str(pipeline_dir)},
             "text_encoder": {"from_pretrained": str(pipeline_dir), "max_sequence_length": 32},
             "predictor": {"model_id": "flux", "from_pretrained": os.path.join(str(pipeline_dir), "transformer")},
             "image_size": [64, 64]}
    if reward:
        model["reward"] = reward
    data = {"dataset_param": {"data_folder": "data", "cache_features": True},
            "dataloader_param": {"shuffle": True, "seed": 5}}
    return write_run_configs(folder, model, data)


def flow_argv(model_json, data_json, iters=2, extra=()):
    return ["--mm-model", model_json, "--mm-data", data_json, "--train-iters", str(iters),
            "--global-batch-size", "4", "--micro-batch-size", "2", "--lr", "1e-3", "--no-progress-bar",
            "--log-interval", "1000", "--seed", "3", *extra]


def run_flow(argv):
    """(history, run) of a flow-matching run in this process group."""
    from mm_grpo.training.train_flow import FlowRun, parse_args
    run = FlowRun(parse_args(list(argv)))
    return run.train(), run


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
