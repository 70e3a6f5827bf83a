"""GRPO inside MindSpeed-MM's real `pretrain` (mindspeed_mm/training.py, Megatron-LM core_v0.12.1's
loop): two iterations equal mm-grpo's own trainer at the same seeds, and a run resumed from
Megatron's checkpoint (`--load`) continues exactly as the uninterrupted one.

`pretrain` runs in a child process (torchrun, one gloo process), as a MindSpeed-MM user launches
it: `python -m mm_grpo.training.mindspeed_grpo` with Megatron's arguments. What it trained is read
from its own outputs: the TensorBoard scalars Megatron logs and the checkpoints it saves.
"""
import argparse
import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from mm_grpo.models.flux import FluxConfig
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.grpo_helpers import grpo_argv, run_grpo, write_configs
from tests.testbed import REPO, TESTBED, require_testbed, subprocess_env
from tests.utils import rel_err

pytestmark = pytest.mark.mindspeed_mm
TOL = 1e-5
LAUNCH_TIMEOUT_S = 900
# The trainer's run (tests/grpo_helpers.grpo_argv): 8 generations of 2 prompts, micro-batch 2,
# 6 steps of which DanceGRPO trains int(5 x 0.6) = 3: Megatron counts 8 x 3 = 24 rows per step.
TRAINED_STEPS = 3
MEGATRON_ARGV = [
    "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
    # Megatron's model-size arguments, required by its parser (the FLUX predictor reads its block)
    "--num-layers", "6", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "1",
    "--max-position-embeddings", "1",
    "--micro-batch-size", "2", "--global-batch-size", str(8 * TRAINED_STEPS), "--train-iters", "2", "--seed", "3",
    "--lr", "1e-3", "--min-lr", "0", "--lr-decay-style", "constant", "--lr-warmup-iters", "0",
    "--weight-decay", "1e-4", "--adam-beta1", "0.9", "--adam-beta2", "0.999", "--adam-eps", "1e-8",
    "--clip-grad", "1.0", "--distributed-backend", "gloo", "--no-gradient-accumulation-fusion",
    "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0", "--save-interval", "1",
    "--ckpt-format", "torch",
    "--num-generations", "4", "--num-inference-steps", "6"]


def write_mindspeed_configs(folder, pipeline_dir):
    """mm-grpo's model.json / data.json (the trainer's), and for `pretrain` the same configs with the
    predictor written MindSpeed-MM's way (architecture inline, from_pretrained one file) and paths
    absolute (MindSpeed-MM reads them from the working directory), and a tools.json; returns
    ((model, data), mindspeed model.json, mindspeed data.json, tools.json)."""
    ours = write_configs(folder, pipeline_dir)
    with open(ours[0]) as f:
        model = json.load(f)
    with open(ours[1]) as f:
        data = json.load(f)
    params = data["dataset_param"]
    params.update({k: os.path.join(folder, params[k]) for k in ("prompt_file", "eval_prompt_file")})
    transformer = os.path.join(str(pipeline_dir), "transformer")
    model["predictor"] = {"model_id": "flux", **FluxConfig.from_diffusers_config(transformer).to_diffusers_config(),
                          "from_pretrained": os.path.join(transformer, "diffusion_pytorch_model.safetensors")}
    with open(os.path.join(TESTBED, "MindSpeed-MM", "mindspeed_mm", "tools", "tools.json")) as f:
        tools = json.load(f)
    # MindSpeed-MM builds its "static" NPU profiler (torch_npu) even when profiling is off; "dynamic"
    # builds none until enabled. Profiling stays off.
    tools["profile"]["profile_type"] = "dynamic"
    paths = (os.path.join(folder, "mindspeed_model.json"), os.path.join(folder, "mindspeed_data.json"),
             os.path.join(folder, "tools.json"))
    for path, content in zip(paths, (model, data, tools)):
        with open(path, "w") as f:
            json.dump(content, f)
    return ours, *paths


def launch_pretrain(run_dir, model_json, data_json, tools_json, extra=()):
    """`torchrun -m mm_grpo.training.mindspeed_grpo ...` (one process); returns its log."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           "-m", "mm_grpo.training.mindspeed_grpo", *MEGATRON_ARGV, "--mm-model", model_json, "--mm-data", data_json,
           "--mm-tool", tools_json, "--save", os.path.join(run_dir, "ckpt"),
           "--tensorboard-dir", os.path.join(run_dir, "tb"), *extra]
    env = subprocess_env(dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                              CUDA_DEVICE_MAX_CONNECTIONS="1"))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"pretrain failed (rc={proc.returncode}):\n{log[-6000:]}"
    return log


def scalars(run_dir):
    """{tag: {iteration: value}} of what Megatron logged to TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = {}
    for path in glob.glob(os.path.join(run_dir, "tb", "events.*")):
        events = EventAccumulator(path)
        events.Reload()
        for tag in events.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in events.Scalars(tag)})
    return out


def saved_model(run_dir, iteration):
    """The model state dict of Megatron's checkpoint at `iteration` (its `args` unpickle Megatron's classes)."""
    path = os.path.join(run_dir, "ckpt", f"iter_{iteration:07d}", "mp_rank_00", "model_optim_rng.pt")
    return torch.load(path, map_location="cpu", weights_only=False)["model"]


@pytest.fixture(scope="module")
def runs(parallel_1proc, tiny_pipeline_dir, tmp_path_factory):
    """mm-grpo's own trainer (2 iterations), `pretrain` uninterrupted (2 iterations, a checkpoint
    after each) and `pretrain` resumed from the first checkpoint."""
    require_testbed(needs_megatron_training=True)
    folder = tmp_path_factory.mktemp("mindspeed_grpo")
    ours, model_json, data_json, tools_json = write_mindspeed_configs(str(folder), tiny_pipeline_dir)
    history, run = run_grpo(grpo_argv(*ours, iters=2))
    weights = {n: p.detach().clone() for n, p in run.model.modules[0].named_parameters()}
    trainer = {"history": history, "weights": weights}
    full, resumed = str(folder / "full"), str(folder / "resumed")
    launch_pretrain(full, model_json, data_json, tools_json)
    log = launch_pretrain(resumed, model_json, data_json, tools_json,
                          ["--load", os.path.join(full, "ckpt"), "--ckpt-step", "1"])
    return {"trainer": trainer, "full": full, "resumed": resumed, "resumed_log": log}


def test_two_iterations_in_pretrain_equal_the_trainer(runs):
    history, weights = runs["trainer"]["history"], runs["trainer"]["weights"]
    logged = scalars(runs["full"])
    for it, ours in enumerate(history, start=1):
        # PPO with ratio 1: the loss is mean(-A), about 0: compared absolutely (float32 in TensorBoard)
        assert abs(logged["loss"][it] - ours["loss"]) <= 1e-6
        assert logged["reward/mean"][it] == pytest.approx(ours["reward/mean"], rel=TOL)
        assert logged["grad-norm"][it] == pytest.approx(ours["grad_norm"], rel=TOL)
        assert logged["ratio_min"][it] == logged["ratio_max"][it] == 1.0  # on-policy: the rollout's log-probs
    assert min(h["grad_norm"] for h in history) > 0  # it trained
    saved = saved_model(runs["full"], 2)
    assert set(saved) >= set(weights)
    errs = {n: rel_err(saved[n], w) for n, w in weights.items()}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= TOL, (worst, errs[worst])
    first = saved_model(runs["full"], 1)
    assert any(not torch.equal(first[n], saved[n]) for n in weights)  # the second step moved the weights


def test_pretrain_resumed_from_its_checkpoint_continues_identically(runs):
    assert "loading checkpoint from" in runs["resumed_log"] and "at iteration 1" in runs["resumed_log"]
    full, resumed = scalars(runs["full"]), scalars(runs["resumed"])
    assert set(resumed["loss"]) == {2}  # only the second iteration ran
    for tag in ("loss", "reward/mean", "reward/std", "grad-norm"):
        assert resumed[tag][2] == full[tag][2], tag
    a, b = saved_model(runs["full"], 2), saved_model(runs["resumed"], 2)
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a if torch.is_tensor(a[n]))


def test_megatron_global_batch_counts_trained_rows(parallel_1proc):
    """--global-batch-size is rows (generation, trained step) per optimizer step: it gives the rollout's
    generations, and a count that is no multiple of the trained steps is refused in one line."""
    require_testbed(needs_megatron_training=True)
    from mm_grpo.training.mindspeed_grpo import GRPOInPretrain
    args = argparse.Namespace(num_generations=4, num_inference_steps=6, global_batch_size=24, micro_batch_size=2,
                              updates_per_rollout=2, seed=3)
    settings = GRPOInPretrain.settings(args, {"image_size": [32, 32]})
    assert (settings.global_batch_size, settings.trained_steps_per_sample, settings.height) == (16, 3, 32)
    args.global_batch_size = 25
    with pytest.raises(ValueError, match="--global-batch-size 25 counts .* multiple of the 3 trained steps"):
        GRPOInPretrain.settings(args, {"image_size": [32, 32]})
