"""GRPO inside MindSpeed-MM's real `pretrain` (mindspeed_mm/training.py, Megatron-LM core_v0.12.1's
loop), launched as a MindSpeed-MM user launches it: examples/flux/mindspeed_mm/grpo_flux.sh, unchanged,
with only its variables set (tiny model, 2 iterations, CPU, gloo, a no-op CANN set_env.sh).

- Two iterations with the KL term equal mm-grpo's own trainer at the same seeds (losses, KL, rewards,
  grad norms, weights, the held-out evaluation before and after), and a run resumed from Megatron's
  checkpoint (`--load`) continues exactly as the uninterrupted one; with Megatron's block recompute flags
  the launch trains bit for bit what the plain one trains.
- With MindSpeed-MM's own LoRA (its `--lora-target-modules` flags after the script): only adapters
  train and are saved, the KL term's reference is their frozen base, and resume is exact.
- The entry's guards: every refusal is one line per launch before Megatron starts (a torchrun launch
  of two processes, and each refusal in this process); non-finite rewards skip rollouts, never an
  optimizer step or a checkpoint, and `--max-skipped-iterations` of them in a row end the run (exit 3,
  one line, two processes); `--save` is locked and probed before the first rollout.

What a launch trained is read from its own outputs: the TensorBoard scalars Megatron logs and the
checkpoints it saves.
"""
import argparse
import glob
import json
import math
import os
import re
import socket
import subprocess
import sys
import types

import pytest
import torch

from mm_grpo.families.flux.transformer import FluxConfig
from mm_grpo.files.lock import LOCK_FILE, RunFolderLocked
from mm_grpo.grpo.batch import GRPOBatch
from mm_grpo.training.run_guard import TrainingStopped, UnusableSaveFolder
from tests.fixtures import parallel_1proc, peft_without_mindspeed_te_dummies  # noqa: F401
from tests.grpo_helpers import SMOOTH_REWARD, grpo_argv, run_grpo, write_configs
from tests.ports import free_port
from tests.standins.ascend_install import ascend_install
from tests.testbed import REPO, TESTBED, require_testbed, subprocess_env
from tests.utils import make_inputs, reference_output, rel_err

pytestmark = pytest.mark.mindspeed_mm
TOL = 1e-5
LAUNCH_TIMEOUT_S = 900
SCRIPT = os.path.join(REPO, "examples", "flux", "mindspeed_mm", "grpo_flux.sh")
TRACKER = "latest_checkpointed_iteration.txt"
# The trainer's run (tests/grpo_helpers.grpo_argv): 8 generations of 2 prompts, micro-batch 2,
# 6 steps of which DanceGRPO trains int(5 x 0.6) = 3: the entry derives Megatron's 8 x 3 = 24 rows per step.
KL_BETA = "0.1"
# grpo_flux.sh's variables for that run (everything else as shipped).
SCRIPT_VARIABLES = {"NPUS_PER_NODE": "1", "DIST_BACKEND": "gloo", "MBS": "2", "G": "4", "STEPS": "6",
                    "PROMPTS": "2", "TRAIN_ITERS": "2", "LR": "1e-3",
                    "SEED": "3", "KL_BETA": KL_BETA, "SAVE_INTERVAL": "1", "EVAL_INTERVAL": "2"}
# The same run as Megatron arguments, for the launches that test the guards.
MEGATRON_ARGV = [
    "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
    # Megatron's model-size arguments, required by its parser (the FLUX predictor reads its block)
    "--num-layers", "6", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "1",
    "--max-position-embeddings", "1",
    "--micro-batch-size", "2", "--train-iters", "2", "--seed", "3",
    "--lr", "1e-3", "--min-lr", "0", "--lr-decay-style", "constant", "--lr-warmup-iters", "0",
    "--weight-decay", "1e-4", "--adam-beta1", "0.9", "--adam-beta2", "0.999", "--adam-eps", "1e-8",
    "--clip-grad", "1.0", "--distributed-backend", "gloo", "--no-gradient-accumulation-fusion",
    "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0", "--save-interval", "1",
    "--ckpt-format", "torch",
    "--prompts-per-iteration", "2", "--num-generations", "4", "--num-inference-steps", "6"]


def write_mindspeed_configs(folder, pipeline_dir, from_pretrained=None, reward=None):
    """mm-grpo's model.json / data.json (the trainer's), and for `pretrain` the same configs with the
    predictor written MindSpeed-MM's way (architecture inline, heads as MindSpeed-MM names them,
    from_pretrained one file) and paths absolute (MindSpeed-MM reads them from the working
    directory), and a tools.json; returns ((model, data), mindspeed model.json, mindspeed data.json, tools.json)."""
    ours = write_configs(folder, pipeline_dir, reward=reward)
    with open(ours[0]) as f:
        model = json.load(f)
    with open(ours[1]) as f:
        data = json.load(f)
    params = data["dataset_param"]
    params.update({k: os.path.join(folder, params[k]) for k in ("prompt_file", "eval_prompt_file")})
    transformer = os.path.join(str(pipeline_dir), "transformer")
    arch = FluxConfig.from_diffusers_config(transformer).to_diffusers_config()
    model["predictor"] = {"model_id": "flux", **arch, "num_heads": arch["num_attention_heads"],
                          "head_dim": arch["attention_head_dim"],
                          "from_pretrained": from_pretrained or os.path.join(transformer,
                                                                              "diffusion_pytorch_model.safetensors")}
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


def _child_env(**extra):
    """The launched processes: this checkout and the testbed importable, one thread each."""
    env = subprocess_env(dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                              CUDA_DEVICE_MAX_CONNECTIONS="1", **extra))
    # Absolute: the launch script runs from the MindSpeed-MM checkout.
    env["PYTHONPATH"] = os.pathsep.join([REPO, *map(os.path.abspath, env["PYTHONPATH"].split(os.pathsep))])
    env.pop("MM_GRPO_ERROR_FILE", None)
    return env


def run_script(tmp, run_dir, model_json, data_json, tools_json, load, extra=()):
    """examples/flux/mindspeed_mm/grpo_flux.sh with its variables set; returns its output."""
    tmp.mkdir()
    env = _child_env(**SCRIPT_VARIABLES, MM_GRPO_ASCEND=str(ascend_install(tmp)), MASTER_PORT=str(free_port()),
                     MINDSPEED_MM=os.path.join(TESTBED, "MindSpeed-MM"), MM_MODEL=model_json, MM_DATA=data_json,
                     MM_TOOL=tools_json, LOAD_PATH=load, SAVE_PATH=os.path.join(run_dir, "ckpt"),
                     TENSORBOARD_DIR=os.path.join(run_dir, "tb"), LOG_DIR=os.path.join(run_dir, "logs"))
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env["PATH"]])  # torchrun
    proc = subprocess.run(["bash", SCRIPT, *extra], env=env, capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"grpo_flux.sh failed (rc={proc.returncode}):\n{log[-6000:]}"
    return log


def launch_entry(tmp, argv, nproc):
    """`torchrun -m mm_grpo.mindspeed_mm.grpo ARGV` on `nproc` processes: (output, the lines
    the processes wrote to MM_GRPO_ERROR_FILE, as shell/run_trainer.sh reads them)."""
    errors = os.path.join(tmp, "errors.txt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "mm_grpo.mindspeed_mm.grpo", *argv]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(_child_env(), MM_GRPO_ERROR_FILE=errors), capture_output=True,
                          text=True, timeout=LAUNCH_TIMEOUT_S)
    lines = open(errors).read().splitlines() if os.path.exists(errors) else []
    return proc.stdout + proc.stderr, proc.returncode, lines


def assert_one_line_per_launch(log, rc, error_lines, status, match):
    """The launch failed with one `mm-grpo: error` line (rank 0's; the other processes quiet) and
    no worker traceback (torchrun's own report names no mm_grpo frame); rank 0 exited first, so
    torchrun reports its status as the root cause."""
    assert rc != 0
    assert re.search(rf"rank\s*: 0 \(local_rank: 0\)\s*\n\s*exitcode\s*: {status} ", log), log[-3000:]
    assert len(error_lines) == 1 and error_lines[0].startswith(f"{status}\tmm-grpo: error: "), error_lines
    assert re.search(match, error_lines[0]), error_lines[0]
    assert log.count("mm-grpo: error:") == 1, log[-4000:]
    assert not re.search(r'File ".*mm_grpo/', log), log[-4000:]


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
def configs(tiny_pipeline_dir, tmp_path_factory):
    require_testbed(needs_megatron_training=True)
    folder = str(tmp_path_factory.mktemp("mindspeed_grpo_cfg"))
    # A reward without 8-bit steps: after a step the two runs' weights agree to float rounding, which can
    # move a JPEG by a byte and the rewards by a quantum the comparison is not about.
    return write_mindspeed_configs(folder, tiny_pipeline_dir, reward=SMOOTH_REWARD)


def entry_argv(configs, *extra):
    _, model_json, data_json, tools_json = configs
    return [*MEGATRON_ARGV, "--mm-model", model_json, "--mm-data", data_json, "--mm-tool", tools_json, *extra]


# --- the launch script: the same run as mm-grpo's trainer --------------------------------------------
@pytest.fixture(scope="module")
def runs(parallel_1proc, configs, tmp_path_factory):
    """mm-grpo's own trainer (2 iterations, KL, held-out evaluation before and after), grpo_flux.sh
    uninterrupted (2 iterations, a checkpoint after each) and grpo_flux.sh resumed from the first checkpoint."""
    ours, model_json, data_json, tools_json = configs
    history, run = run_grpo(grpo_argv(*ours, iters=2, extra=["--kl-beta", KL_BETA, "--eval-interval", "2"]))
    weights = {n: p.detach().clone() for n, p in run.model.modules[0].named_parameters()}
    trainer = {"history": history, "weights": weights, "evaluations": run.evaluations}
    folder = tmp_path_factory.mktemp("mindspeed_grpo")
    full, resumed = str(folder / "full"), str(folder / "resumed")
    run_script(folder / "a", full, model_json, data_json, tools_json, load=str(folder / "nothing_yet"))
    log = run_script(folder / "b", resumed, model_json, data_json, tools_json, load=os.path.join(full, "ckpt"),
                     extra=["--ckpt-step", "1"])
    return {"trainer": trainer, "full": full, "resumed": resumed, "resumed_log": log}


def test_two_iterations_in_pretrain_equal_the_trainer(runs):
    history, weights = runs["trainer"]["history"], runs["trainer"]["weights"]
    logged = scalars(runs["full"])
    for it, ours in enumerate(history, start=1):
        # PPO with ratio 1: the loss is mean(-A) + beta KL, about 0: compared absolutely (float32 in TensorBoard)
        assert abs(logged["loss"][it] - ours["loss"]) <= 1e-6
        assert logged["reward/mean"][it] == pytest.approx(ours["reward/mean"], rel=TOL)
        assert logged["grad-norm"][it] == pytest.approx(ours["grad_norm"], rel=TOL)
        assert logged["ratio_min"][it] == logged["ratio_max"][it] == 1.0  # on-policy: the rollout's log-probs
    # The KL term to the starting policy: none before the first step, then the trainer's.
    assert logged["kl"][1] == history[0]["kl"] == 0.0
    assert history[1]["kl"] > 0 and logged["kl"][2] == pytest.approx(history[1]["kl"], rel=TOL)
    assert min(h["grad_norm"] for h in history) > 0  # it trained
    saved = saved_model(runs["full"], 2)
    assert set(saved) >= set(weights)
    errs = {n: rel_err(saved[n], w) for n, w in weights.items()}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= TOL, (worst, errs[worst])
    first = saved_model(runs["full"], 1)
    assert any(not torch.equal(first[n], saved[n]) for n in weights)  # the second step moved the weights
    assert LOCK_FILE not in os.listdir(os.path.join(runs["full"], "ckpt"))  # the run's lock released


def test_held_out_evaluation_before_and_after_equals_the_trainer(runs):
    evaluations = runs["trainer"]["evaluations"]
    logged = scalars(runs["full"])["eval/reward_mean"]
    assert set(logged) == set(evaluations) == {0, 2}
    for it, stats in evaluations.items():
        assert logged[it] == pytest.approx(stats["eval/reward_mean"], rel=TOL)
    assert logged[0] != logged[2]  # the policy it scored changed


def test_pretrain_resumed_from_its_checkpoint_continues_identically(runs):
    assert "loading checkpoint from" in runs["resumed_log"] and "at iteration 1" in runs["resumed_log"]
    full, resumed = scalars(runs["full"]), scalars(runs["resumed"])
    assert set(resumed["loss"]) == {2}  # only the second iteration ran
    for tag in ("loss", "kl", "reward/mean", "reward/std", "grad-norm"):  # kl: the reference is from_pretrained
        assert resumed[tag][2] == full[tag][2], tag
    assert resumed["eval/reward_mean"][2] == full["eval/reward_mean"][2]
    a, b = saved_model(runs["full"], 2), saved_model(runs["resumed"], 2)
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a if torch.is_tensor(a[n]))


def test_pretrain_with_megatrons_block_recompute_trains_what_the_plain_launch_trains(runs, configs, tmp_path):
    """Megatron's --recompute-* flags after grpo_flux.sh reach the FLUX predictor through pretrain's parsed
    arguments (over grpo_model.json's recompute_blocks): the launch trains bit for bit what the plain one
    did (tests/test_recompute.py: the predictor reads them; the models: which blocks run twice)."""
    _, model_json, data_json, tools_json = configs
    flags = ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"]
    out = str(tmp_path / "recomputed")
    run_script(tmp_path / "a", out, model_json, data_json, tools_json, load=str(tmp_path / "nothing_yet"), extra=flags)
    plain, recomputed = scalars(runs["full"]), scalars(out)
    for tag in ("loss", "kl", "reward/mean", "grad-norm"):
        assert recomputed[tag] == plain[tag], tag


# --- MindSpeed-MM's own LoRA (--lora-target-modules: peft around the policy) --------------------------
LORA_FLAGS = ["--lora-target-modules", "linear_qkv", "linear_proj", "linear_in", "linear_out", "--lora-r", "4",
              "--lora-alpha", "8"]


@pytest.fixture(scope="module")
def lora_runs(configs, tmp_path_factory):
    """grpo_flux.sh with MindSpeed-MM's LoRA flags after it (the script hands them to the entry):
    2 iterations with the KL term, and the same resumed from the first checkpoint."""
    _, model_json, data_json, tools_json = configs
    folder = tmp_path_factory.mktemp("mindspeed_grpo_lora")
    full, resumed = str(folder / "full"), str(folder / "resumed")
    run_script(folder / "a", full, model_json, data_json, tools_json, load=str(folder / "nothing_yet"),
               extra=LORA_FLAGS)
    run_script(folder / "b", resumed, model_json, data_json, tools_json, load=os.path.join(full, "ckpt"),
               extra=["--ckpt-step", "1", *LORA_FLAGS])
    return {"full": full, "resumed": resumed}


def test_mindspeed_mm_lora_trains_the_adapters_with_the_kl_term_to_their_base(lora_runs):
    """Only adapters are saved (MindSpeed-MM's LoRA checkpoint) and they trained; the KL reference is
    the frozen base (the policy with its adapters off): none before the first step, then > 0."""
    logged = scalars(lora_runs["full"])
    assert logged["kl"][1] == 0.0 and logged["kl"][2] > 0 and math.isfinite(logged["kl"][2])
    assert set(logged["eval/reward_mean"]) == {0, 2}
    first, saved = saved_model(lora_runs["full"], 1), saved_model(lora_runs["full"], 2)
    weights = {n for n in saved if torch.is_tensor(saved[n]) and not n.endswith("_extra_state")}
    assert weights and all(".lora_A." in n or ".lora_B." in n for n in weights), sorted(weights)[:4]
    assert any(n.startswith("single_blocks.") and ".linear_out." in n for n in weights)
    assert all(saved[n].abs().max() > 0 for n in weights if ".lora_B." in n)  # B starts at zero
    assert any(not torch.equal(first[n], saved[n]) for n in weights)


def test_mindspeed_mm_lora_run_resumed_continues_identically(lora_runs):
    full, resumed = scalars(lora_runs["full"]), scalars(lora_runs["resumed"])
    assert set(resumed["loss"]) == {2}
    for tag in ("loss", "kl", "reward/mean", "grad-norm"):
        assert resumed[tag][2] == full[tag][2], tag
    a, b = saved_model(lora_runs["full"], 2), saved_model(lora_runs["resumed"], 2)
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a if torch.is_tensor(a[n]))


def test_mindspeed_mm_lora_checkpoint_converts_to_diffusers_and_merges(lora_runs, tiny_pipeline_dir, tmp_path,
                                                                        peft_without_mindspeed_te_dummies):
    """mm-convert's LoRA verbs read MindSpeed-MM's LoRA checkpoint: the diffusers file holds its adapters
    (B x alpha / r), and diffusers' FLUX with that file loaded equals the merged model."""
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from converters.convert_cli import main as convert
    from mm_grpo.families.flux.transformer import lora
    from mm_grpo.families.flux.transformer.lora_hf import read_diffusers_lora
    ckpt = os.path.join(lora_runs["full"], "ckpt")
    exported, base, merged = (str(tmp_path / n) for n in ("lora", "base", "merged"))
    for verb, *options in (("lora_mm_to_hf", "source_path", ckpt, "target_path", exported),
                           ("hf_to_mm", "source_path", str(tiny_pipeline_dir / "transformer"), "target_path", base),
                           ("merge_lora_to_base", "source_path", base, "lora_path", ckpt, "target_path", merged),
                           ("mm_to_hf", "source_path", merged, "target_path", merged + "_hf")):
        convert(["FluxConverter", verb, *(f"--cfg.{o}" if i % 2 == 0 else o for i, o in enumerate(options))])
    config = FluxConfig.from_diffusers_config(str(tiny_pipeline_dir / "transformer"))
    targets = tuple(LORA_FLAGS[1:LORA_FLAGS.index("--lora-r")])
    loaded = read_diffusers_lora(exported, config, lora.LoRAConfig(4, 8.0, targets))
    saved = saved_model(lora_runs["full"], 2)
    for base_rule in lora.base_rules(config, targets):
        for rule, tensor in zip(lora.adapter_rules(base_rule), loaded[base_rule.hf[0]]):
            assert torch.equal(tensor, saved[rule.megatron.removesuffix(".weight") + ".default.weight"]), rule.megatron

    pipe = FluxPipeline.from_pretrained(tiny_pipeline_dir)
    pipe.load_lora_weights(exported)
    inputs = make_inputs(config, batch=2, height=4, width=4, txt_len=32)
    with torch.no_grad():
        with_lora = reference_output(pipe.transformer, inputs)
        pipe.transformer.disable_lora()
        base_out = reference_output(pipe.transformer, inputs)
        merged_out = reference_output(FluxTransformer2DModel.from_pretrained(merged + "_hf"), inputs)
    assert rel_err(merged_out, with_lora) <= 1e-5
    assert rel_err(with_lora, base_out) > 1e-4  # two steps of training moved the adapters' output (1.9e-3)


def _lora_checkpoint_copy(lora_runs, folder, layout_of, edit=lambda state: None):
    """Iteration 2 of the LoRA run rewritten as other shards: {shard folder: (tp rank, tp size)};
    `edit(state)` changes each shard's state before it is saved."""
    from mm_grpo.families.flux.transformer import layout
    from mm_grpo.families.flux.transformer import lora
    config = FluxConfig.preset("tiny")  # the tiny pipeline's transformer
    rules = {r.megatron.removesuffix(".weight") + ".default.weight": r for base in lora.base_rules(
        config, lora.TARGETS) for r in lora.adapter_rules(base)}
    source = os.path.join(lora_runs["full"], "ckpt", "iter_0000002", "mp_rank_00", "model_optim_rng.pt")
    for name, (rank, size) in layout_of.items():
        state = torch.load(source, map_location="cpu", weights_only=False)
        state["model"] = {k: layout.shard(rules[k], v, rank, size, config) if k in rules else v
                          for k, v in state["model"].items()}
        edit(state)
        os.makedirs(folder / name)
        torch.save(state, folder / name / "model_optim_rng.pt")
    return folder


def test_a_tp2_mindspeed_mm_lora_checkpoint_converts_as_its_tp1_original(lora_runs, tmp_path):
    """Adapters sharded as peft shards them at TP 2 (tests/distributed: the same rules) read back whole."""
    from converters.convert_cli import main as convert
    from safetensors.torch import load_file
    tp2 = _lora_checkpoint_copy(lora_runs, tmp_path / "iter_0000002", {"mp_rank_00": (0, 2), "mp_rank_01": (1, 2)})
    for source, target in ((os.path.join(lora_runs["full"], "ckpt"), "tp1"), (str(tp2), "tp2")):
        convert(["FluxConverter", "lora_mm_to_hf", "--cfg.source_path", source, "--cfg.target_path",
                 str(tmp_path / target)])
    a, b = (load_file(tmp_path / t / "pytorch_lora_weights.safetensors") for t in ("tp1", "tp2"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _wandit(state):
    state["args"].mm.model.predictor.model_id = "wandit"


@pytest.mark.parametrize("layout_of,edit,match", [
    ({"mp_rank_00_000": (0, 1), "mp_rank_00_001": (0, 1)}, lambda state: None, "converts at PP 1 (this one: TP 1, PP 2"),
    ({"mp_rank_00": (0, 1)}, _wandit, "MindSpeed-MM's 'wandit' predictor; FluxConverter converts FLUX"),
], ids=["pp2", "wandit"])
def test_a_mindspeed_mm_lora_checkpoint_it_cannot_read_is_refused(lora_runs, tmp_path, capsys, layout_of, edit,
                                                                   match):
    from converters.convert_cli import main as convert
    copy = _lora_checkpoint_copy(lora_runs, tmp_path / "iter_0000002", layout_of, edit)
    with pytest.raises(SystemExit) as info:
        convert(["FluxConverter", "lora_mm_to_hf", "--cfg.source_path", str(copy), "--cfg.target_path",
                 str(tmp_path / "lora")])
    assert info.value.code == 1 and not (tmp_path / "lora").exists()
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("mm-convert: error: ") and match in err, err


# --- guards: refusals before Megatron starts ------------------------------------------------------
def test_a_refusal_is_one_line_per_launch_before_megatron_starts(configs, tmp_path):
    argv = entry_argv(configs)
    argv[argv.index("--pipeline-model-parallel-size") + 1] = "2"
    log, rc, lines = launch_entry(str(tmp_path), argv, nproc=2)
    assert_one_line_per_launch(log, rc, lines, 2, r"pipeline parallelism \(--pipeline-model-parallel-size 2\) is "
                                                  r"not supported .* use --pipeline-model-parallel-size 1, or "
                                                  r"mm_grpo.training.train_grpo")
    assert "initializing torch distributed" not in log  # before Megatron's initialization


def _tracker(folder, iteration):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, TRACKER), "w") as f:
        f.write(str(iteration))
    return str(folder)


def _without_block(configs, tmp_path, name):
    with open(configs[1]) as f:
        model = json.load(f)
    del model[name]
    path = str(tmp_path / "model.json")
    with open(path, "w") as f:
        json.dump(model, f)
    return path


REFUSALS = {
    "pipeline": (["--pipeline-model-parallel-size", "2"], r"^pipeline parallelism .* is not supported for FLUX .* "
                                                           r"stage tensors of MindSpeed-MM's wandit only"),
    "batch": (["--global-batch-size", "25"], r"^--global-batch-size 25 counts \(sample, trained step\) rows per "
                                             r"optimizer step, which --prompts-per-iteration 2 x --num-generations 4 "
                                             r"x 3 trained steps / --updates-per-rollout 1 make 24"),
    "load_inside_rollout": (lambda t: ["--updates-per-rollout", "2", "--load", _tracker(t / "ckpt", 3)],
                            r"--load: iteration 3 is inside a rollout \(--updates-per-rollout 2\)"),
    "save_inside_rollout": (["--updates-per-rollout", "2"], r"--save-interval 1 must be a multiple of "
                                                             r"--updates-per-rollout 2"),
    "ckpt_step_inside_rollout": (lambda t: ["--updates-per-rollout", "2", "--save-interval", "2", "--load",
                                            _tracker(t / "ckpt", 2), "--ckpt-step", "1"],
                                 r"--load: iteration 1 is inside a rollout"),
    "no_reward_block": (lambda t: ["--mm-model", "{reward}"], r"--mm-model has no 'reward' block"),
    "no_tool_config": (["--mm-tool", ""], r"--mm-tool is required"),
    "ema": (["--ema-decay", "0.5"], r"^--ema-decay: mm_grpo.mindspeed_mm.grpo keeps no EMA .* use "
                                    r"mm_grpo.training.train_grpo"),
    "ema_ramp": (["--ema-decay-ramp", "0.01"], r"^--ema-decay-ramp: .* keeps no EMA"),
    "kl_resumed_without_start": (lambda t: ["--kl-beta", "0.1", "--mm-model", "{no_from_pretrained}", "--load",
                                            _tracker(t / "ckpt", 1)],
                                 r"--kl-beta > 0 needs the starting weights: predictor.from_pretrained"),
    "max_skipped": (["--max-skipped-iterations", "-1"], r"--max-skipped-iterations must be >= 0, got -1"),
    "cfg_flux": (["--cfg-scale", "5"], r"^--cfg-scale 5.0: FLUX.1 is guidance-distilled .* \(--guidance-scale\)"),
    "cfg_below_1": (["--cfg-scale", "0.5"], r"--cfg-scale must be >= 1.0, got 0.5"),
    # FLUX has no unconditional prompt (Wan's refusal without --cfg-scale: tests/test_wan_grpo.py)
    "negative_prompt_flux": (["--negative-prompt", "blurry"], r"^--negative-prompt: the guidance of another model "
                                                              r"family; model.json's predictor is 'flux', whose "
                                                              r"guidance flags are --guidance-scale$"),
    "prompt_file": (lambda t: ["--mm-data", "{missing_prompts}"], r"prompt file not found"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_each_refusal_is_one_line_before_pretrain(configs, tmp_path, case, monkeypatch):
    """Each refusal of the checks before `pretrain`, in this process (the launch above shows that the
    same check is one line per launch)."""
    from mm_grpo.mindspeed_mm import grpo as mindspeed_grpo
    extra, match = REFUSALS[case]
    extra = extra(tmp_path) if callable(extra) else extra
    with open(configs[1]) as f:
        no_start = dict(json.load(f))
    no_start["predictor"] = dict(no_start["predictor"], from_pretrained=None)
    (tmp_path / "no_start.json").write_text(json.dumps(no_start))
    with open(configs[2]) as f:
        missing = json.load(f)
    missing["dataset_param"]["prompt_file"] = str(tmp_path / "missing.txt")
    (tmp_path / "missing_data.json").write_text(json.dumps(missing))
    no_reward = _without_block(configs, tmp_path, "reward")
    paths = {"reward": no_reward, "no_from_pretrained": str(tmp_path / "no_start.json"),
             "missing_prompts": str(tmp_path / "missing_data.json")}
    extra = [a.format(**paths) if a.startswith("{") else a for a in extra]
    monkeypatch.setattr(mindspeed_grpo.CombinedReward, "from_configs",  # rewards come after every check here
                        lambda *a, **k: pytest.fail("the rewards were built before the refusal"))
    with pytest.raises(mindspeed_grpo.LaunchRefused) as refused:
        mindspeed_grpo.check_launch(entry_argv(configs, *extra))
    message = str(refused.value)
    assert re.search(match, message), message
    assert "\n" not in message


def test_a_launch_that_passes_the_checks_reads_what_pretrain_needs(configs):
    from mm_grpo.mindspeed_mm import grpo as mindspeed_grpo
    launch = mindspeed_grpo.check_launch(entry_argv(configs, "--eval-prompts", "1"))
    s = launch.settings
    assert (s.samples_per_iteration, s.trained_steps_per_sample, s.num_generations, s.height) == (8, 3, 4, 32)
    assert launch.eval_prompts == ["a white circle"]  # --eval-prompts of eval_prompt_file
    assert list(launch.reward.rewards) == ["test_smooth"]  # the configs' reward, from its module
    assert launch.args.max_skipped_iterations == 10  # the trainers' default


def test_both_entries_read_one_launch_as_the_same_batch(configs):
    """The same GRPO flags give mm-grpo's trainer and the MindSpeed-MM entry one batch (P, G, K, U),
    and Megatron's --global-batch-size of the launch is its rows per optimizer step."""
    from mm_grpo.grpo.hyperparameters import GRPOSettings
    from mm_grpo.mindspeed_mm import grpo as mindspeed_grpo
    from mm_grpo.settings import from_args
    from mm_grpo.training.arguments import build_parser
    grpo_flags = ["--prompts-per-iteration", "2", "--num-generations", "4", "--num-inference-steps", "6",
                  "--updates-per-rollout", "2", "--micro-batch-size", "2"]
    launch = mindspeed_grpo.check_launch(entry_argv(configs, *grpo_flags, "--global-batch-size", "12",
                                                    "--save-interval", "2"))
    own = from_args(GRPOSettings, build_parser().parse_args(["--mm-model", "m", "--mm-data", "d", "--train-iters",
                                                             "2", *grpo_flags]))
    assert launch.settings.batch == own.batch == GRPOBatch(prompts=2, generations=4, trained_steps=3, updates=2)
    assert launch.args.global_batch_size == own.batch.rows_per_update == 12


def test_megatron_global_batch_is_derived_from_the_prompts_and_checked_when_given():
    """Megatron's --global-batch-size is rows (sample, trained step) per optimizer step: P x G x K / U,
    derived from --prompts-per-iteration; a given one that differs is refused in one line."""
    require_testbed(needs_megatron_training=True)
    from mm_grpo.mindspeed_mm.grpo import grpo_settings
    args = argparse.Namespace(prompts_per_iteration=4, num_generations=4, num_inference_steps=6,
                              global_batch_size=None, micro_batch_size=2, updates_per_rollout=2, seed=3)
    settings = grpo_settings(args, {"image_size": [32, 32]}, dp_size=1)
    assert (settings.samples_per_iteration, settings.trained_steps_per_sample, settings.height) == (16, 3, 32)
    assert settings.batch.rows_per_update == 24  # 16 samples x 3 steps / 2 updates
    args.global_batch_size = 24
    assert grpo_settings(args, {"image_size": [32, 32]}, dp_size=1) == settings
    args.global_batch_size = 25
    with pytest.raises(ValueError, match=r"^--global-batch-size 25 counts .* make 24: drop it"):
        grpo_settings(args, {"image_size": [32, 32]}, dp_size=1)


# --- guards: the save folder before the first rollout ----------------------------------------------
@pytest.fixture
def megatron_args():
    """Megatron's global arguments for one test (what `pretrain` sets before calling the providers)."""
    from megatron.training import global_vars
    saved = global_vars._GLOBAL_ARGS
    yield global_vars.set_args
    global_vars._GLOBAL_ARGS = saved


def test_a_locked_or_unwritable_save_folder_is_refused_before_the_first_rollout(parallel_1proc, configs, tmp_path,
                                                                                megatron_args):
    from mm_grpo.mindspeed_mm.grpo import GRPOInPretrain, check_launch
    locked = tmp_path / "locked"
    locked.mkdir()
    holder = f"{socket.gethostname()}:{os.getppid()}"  # a live process of this host: another job
    (locked / LOCK_FILE).write_text(holder + "\n")
    launch = check_launch(entry_argv(configs, "--save", str(locked)))
    launch.args.iteration = 0  # as Megatron's load leaves it
    megatron_args(launch.args)
    grpo = GRPOInPretrain(launch)
    with pytest.raises(RunFolderLocked, match=f"is in use by the job of process {holder}"):
        grpo.train_valid_test_datasets_provider(None)
    assert grpo.schedule is None and grpo.lock is None  # nothing built, nothing held
    (tmp_path / "file").write_text("not a folder")
    launch.args.save = str(tmp_path / "file" / "ckpt")
    with pytest.raises(UnusableSaveFolder, match="cannot use --save .*Not a directory"):
        grpo.train_valid_test_datasets_provider(None)
    assert grpo.schedule is None


# --- guards: non-finite rewards -------------------------------------------------------------------
class _Schedule:
    """Stands in for GRPOSchedule: rollout i has finite rewards iff finite[i] (one micro-batch)."""

    s = types.SimpleNamespace(prompts_per_iteration=1)

    def __init__(self, finite):
        self.finite, self.rollouts = finite, []

    def prepare(self, iteration, prompts):
        self.rollouts.append(iteration)
        if self.finite[iteration]:
            return [[{"rollout": iteration}]], {"reward/mean": 1.0}
        return None, {"reward/mean": float("nan"), "skipped": 1.0, "skip_reason": "4 of 4 rewards are non-finite"}


class _Prompts:
    def next_batch(self, n):
        return ["a red circle"] * n


def test_skipped_rollouts_yield_nothing_and_stop_the_run_at_the_limit():
    require_testbed(needs_megatron_training=True)
    from mm_grpo.mindspeed_mm.adapter import GRPOMicroBatches
    schedule = _Schedule([False, True, False, True, False, False])
    batches = GRPOMicroBatches(schedule, _Prompts(), max_skipped=2)
    assert next(batches)["rollout"] == 1  # rollout 0 skipped: nothing of it reaches Megatron's step
    assert next(batches)["rollout"] == 3  # one skipped in a row (rollout 2): below the limit
    with pytest.raises(TrainingStopped, match=r"^2 iterations in a row skipped \(up to iteration 6: 4 of 4 rewards "
                                              r"are non-finite\); stopping at --max-skipped-iterations 2"):
        next(batches)
    assert schedule.rollouts == [0, 1, 2, 3, 4, 5]


def test_non_finite_rewards_end_the_run_after_the_skipped_limit_with_nothing_saved(configs, tmp_path):
    """A policy whose images are NaN (a NaN weight): every rollout's rewards are non-finite. Two
    processes (DP 2): both stop at --max-skipped-iterations, with one line, exit 3, no step, no checkpoint."""
    from safetensors.torch import load_file, save_file
    source = json.load(open(configs[1]))["predictor"]["from_pretrained"]
    weights = load_file(source)
    weights["proj_out.weight"] = torch.full_like(weights["proj_out.weight"], float("nan"))
    broken = str(tmp_path / "nan.safetensors")
    save_file(weights, broken)
    model = json.load(open(configs[1]))
    model["predictor"]["from_pretrained"] = broken
    model_json = str(tmp_path / "model.json")
    json.dump(model, open(model_json, "w"))
    save = tmp_path / "ckpt"
    argv = entry_argv(configs, "--mm-model", model_json, "--max-skipped-iterations", "2", "--save", str(save),
                      "--tensorboard-dir", str(tmp_path / "tb"))
    log, rc, lines = launch_entry(str(tmp_path), argv, nproc=2)
    assert_one_line_per_launch(log, rc, lines, 3, r"2 iterations in a row skipped \(up to iteration 2: 8 of 8 "
                                                  r"rewards are non-finite .*\); stopping at "
                                                  r"--max-skipped-iterations 2")
    assert log.count("mm-grpo: warning: rollout 1 skipped") == 1  # rank 0's, before rolling out again
    assert sorted(os.listdir(save)) == []  # no checkpoint, no tracker; the lock released
    assert "loss" not in scalars(str(tmp_path))  # Megatron never stepped
