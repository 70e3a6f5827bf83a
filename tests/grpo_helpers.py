"""Builds small GRPO and flow-matching runs on the tiny pipeline (shared by single- and multi-process tests)."""
import json
import os

import torch

from mm_grpo.rewards.base import REWARDS, Reward, register_reward

TRAIN_PROMPTS = ["a red circle", "a blue square", "a green triangle", "two yellow circles",
                 "a purple square above a circle", "an orange triangle"]
EVAL_PROMPTS = ["a white circle", "a black square"]
# The world-size-2 layouts the multi-process GRPO and flow-matching runs are compared under.
LAYOUTS = {"tp2": ["--tensor-model-parallel-size", "2"], "sp2": ["--context-parallel-size", "2"],
           "pp2": ["--pipeline-model-parallel-size", "2"], "dp2": []}
# Adam's first steps move every weight by about +-lr whatever the size of its gradient (update
# ~ lr * g / |g|), so a gradient of 1e-9 whose sign depends on the summation order (TP/SP reduce
# in another order) would become a 1e-3 weight difference. A large epsilon keeps the update
# proportional to the gradient, so the comparison measures the layouts, not Adam's sign amplification.
ADAM_LINEAR = ["--adam-eps", "1e-3"]


if "test_smooth" not in REWARDS:
    @register_reward("test_smooth")
    class SmoothReward(Reward):
        """A reward that is a smooth function of the pixels (for tests only).

        JPEG sizes and CLIP preprocessing round pixels to 8 bits, so two numerically equal
        runs (1e-7 apart) can get rewards that differ by a quantisation step; comparing
        parallel layouts needs a reward without steps."""

        def score(self, images, prompts):
            pattern = torch.linspace(-1, 1, images[0].numel(), device=images.device).view_as(images[0])
            return (images * pattern).flatten(1).mean(1) * 100


# `module`: the processes a shipped launch script starts import it too (the repository is on their PYTHONPATH).
SMOOTH_REWARD = [{"name": "test_smooth", "module": "tests.grpo_helpers", "weight": 1.0}]


def write_run_configs(folder, model: dict, data: dict):
    """model.json and data.json in `folder`; returns their paths."""
    paths = os.path.join(folder, "model.json"), os.path.join(folder, "data.json")
    for path, cfg in zip(paths, (model, data)):
        with open(path, "w") as f:
            json.dump(cfg, f)
    return paths


def write_configs(folder, pipeline_dir, reward=None, prompts=TRAIN_PROMPTS):
    """model.json, data.json and prompt files for the tiny pipeline; returns (model, data) paths."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "prompts.txt"), "w") as f:
        f.write("\n".join(prompts) + "\n")
    with open(os.path.join(folder, "eval.txt"), "w") as f:
        f.write("\n".join(EVAL_PROMPTS) + "\n")
    model = {"ae": {"from_pretrained": str(pipeline_dir)},
             "text_encoder": {"from_pretrained": str(pipeline_dir), "max_sequence_length": 32},
             "predictor": {"model_id": "flux", "from_pretrained": os.path.join(str(pipeline_dir), "transformer")},
             "reward": reward or [{"name": "jpeg_compressibility", "weight": 1.0}],
             "image_size": [32, 32]}
    data = {"dataset_param": {"prompt_file": "prompts.txt", "eval_prompt_file": "eval.txt"},
            "dataloader_param": {"shuffle": True, "seed": 7}}
    return write_run_configs(folder, model, data)


def grpo_argv(model_json, data_json, iters=2, extra=()):
    return ["--mm-model", model_json, "--mm-data", data_json, "--train-iters", str(iters),
            "--prompts-per-iteration", "2", "--num-generations", "4", "--micro-batch-size", "2",
            "--num-inference-steps", "6", "--lr", "1e-3", "--no-progress-bar", "--log-interval", "1000",
            "--seed", "3", *extra]


def run_grpo(argv):
    """(history, run) of a GRPO run in this process group."""
    from mm_grpo.training.arguments import parse_args
    from mm_grpo.training.train_grpo import GRPORun
    run = GRPORun(parse_args(list(argv)))
    return run.train(), run


def write_flow_configs(folder, pipeline_dir, num_images=8, reward=None, model_id="flux"):
    """A shapes dataset and model.json / data.json for a tiny pipeline of the family `model_id` names;
    returns (model, data) paths."""
    from mm_grpo.data.shapes import generate_dataset
    os.makedirs(folder, exist_ok=True)
    data_dir = os.path.join(folder, "data")
    if not os.path.exists(data_dir):
        generate_dataset(data_dir, num_images, seed=4)
    model = {"ae": {"from_pretrained": str(pipeline_dir)},
             "text_encoder": {"from_pretrained": str(pipeline_dir), "max_sequence_length": 32},
             "predictor": {"model_id": model_id, "from_pretrained": os.path.join(str(pipeline_dir), "transformer")},
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
