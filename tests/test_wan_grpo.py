"""Wan2.1 text-to-video GRPO on MindSpeed-MM's own `wandit`, in MindSpeed-MM's environment.

- The DiT MindSpeed-MM's `PredictModel` builds, loaded from `mm-convert WanConverter hf_to_mm` (MindSpeed-MM's
  own converter through mm-convert), gives diffusers' WanTransformer3DModel's velocity on the same weights,
  one sample at a time; two samples in one call mix (the reason the Wan path runs one per micro-batch).
- With classifier-free guidance, its velocity is the one diffusers' WanPipeline steps with (guidance_scale 5,
  the same negative prompt).
- `examples/wan/grpo_wan.sh` as shipped (its tiny CPU run: DP 2, CFG 5; MODEL_JSON its model_tiny.json with
  a reward without 8-bit steps) trains what one process trains, and what Ulysses CP 2 and PP 2 train: the
  logged losses, rewards and gradient norms and the saved weights, 3 iterations.
- One line for the layouts the Wan path refuses: TP 2, micro-batch 2, a CP size that does not divide the
  video tokens, a frame count the VAE cannot take; and a FLUX predictor under a Wan model.json.
"""
import functools
import json
import os
import subprocess
import sys

import pytest
import torch

from mm_grpo.families.wan.tiny import TINY_WAN_PREDICTOR, build_tiny_wan
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.grpo_helpers import SMOOTH_REWARD
from tests.ports import free_port
from tests.test_mindspeed_grpo import _child_env, saved_model, scalars
from tests.testbed import REPO, TESTBED, require_testbed, subprocess_env
from tests.utils import rel_err

pytestmark = pytest.mark.mindspeed_mm
SCRIPT = os.path.join(REPO, "examples", "wan", "grpo_wan.sh")
TINY_MODEL = os.path.join(REPO, "examples", "wan", "model_tiny.json")
LAUNCH_TIMEOUT_S = 900
PROMPTS = 2  # the tiny run's prompts per iteration (G 4 x K 3: 24 rows per step), the same for every layout below


@pytest.fixture(scope="module")
def tiny_wan(tmp_path_factory):
    """(tiny Wan pipeline folder, its transformer converted by `mm-convert WanConverter hf_to_mm`)."""
    require_testbed(needs_megatron_training=True)
    root = tmp_path_factory.mktemp("wan")
    pipeline = build_tiny_wan(root / "tiny_wan")
    converted = root / "tiny_wan_mm"
    subprocess.run([sys.executable, "-m", "converters.convert_cli", "WanConverter", "hf_to_mm",
                    "--cfg.source_path", str(pipeline / "transformer"), "--cfg.target_path", str(converted),
                    "--cfg.target_parallel_config.tp_size", "1"],
                   cwd=REPO, env=subprocess_env(), check=True, capture_output=True, text=True)
    return pipeline, converted


def test_tiny_model_json_is_the_tiny_pipelines_transformer():
    with open(TINY_MODEL) as f:
        predictor = json.load(f)["predictor"]
    assert {k: v for k, v in predictor.items() if k not in ("dtype", "pipeline_num_layers")} == TINY_WAN_PREDICTOR
    assert sum(predictor["pipeline_num_layers"]) == predictor["num_layers"]  # its PP 2 split


# MindSpeed-MM's own Wan2.1 text-to-video configs, which the shipped model.json files' predictor blocks repeat
MINDSPEED_MM_WAN_CONFIGS = {"model.json": "1.3b", "model_14b.json": "14b"}
FPDT_KEYS = ("FPDT", "FPDT_chunk_number", "FPDT_with_offload")  # its long-sequence attention, off (wandit's default)


@pytest.mark.parametrize("ours, size", sorted(MINDSPEED_MM_WAN_CONFIGS.items()))
def test_shipped_model_json_is_mindspeed_mms_wan_config(ours, size):
    with open(os.path.join(REPO, "examples", "wan", ours)) as f:
        predictor = json.load(f)["predictor"]
    with open(os.path.join(TESTBED, "MindSpeed-MM", "examples", "wan2.1", size, "t2v", "pretrain_model.json")) as f:
        theirs = json.load(f)["predictor"]
    assert not theirs.get("FPDT", False)
    assert predictor == {k: v for k, v in theirs.items() if k not in FPDT_KEYS}


def _megatron_args(tmp_path):
    from tests.sora_helpers import set_megatron_args
    model = {"predictor": dict(TINY_WAN_PREDICTOR, dtype="fp32")}
    data = {"dataset_param": {"preprocess_parameters": {"max_height": 32, "max_width": 32, "num_frames": 5}}}
    paths = [str(tmp_path / "model.json"), str(tmp_path / "data.json")]
    for path, content in zip(paths, (model, data)):
        with open(path, "w") as f:
            json.dump(content, f)
    set_megatron_args(*paths, micro_batch=1)


def _wandit(tmp_path, converted):
    """MindSpeed-MM's PredictModel (wandit, fp32) with the weights `mm-convert WanConverter hf_to_mm` wrote."""
    from mindspeed_mm.configs.config import ConfigReader
    from mindspeed_mm.models.predictor import PredictModel
    _megatron_args(tmp_path)
    model = PredictModel(ConfigReader(dict(TINY_WAN_PREDICTOR, dtype="fp32"))).get_model()
    state = torch.load(converted / "release" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)["model"]
    model.load_state_dict(state, strict=False)  # strict=False: the TE-style `_extra_state` entries it adds itself
    assert set(state) == {k for k in model.state_dict() if not k.endswith("_extra_state")}
    return model


def test_wandit_from_mindspeed_mms_converter_gives_diffusers_velocity(parallel_1proc, tiny_wan, tmp_path):
    from diffusers import WanTransformer3DModel
    from mm_grpo.families.wan.mindspeed_mm import TIMESTEP_SCALE, WanDenoiser
    pipeline, converted = tiny_wan
    model = _wandit(tmp_path, converted)
    reference = WanTransformer3DModel.from_pretrained(pipeline / "transformer").eval()

    g = torch.Generator().manual_seed(0)
    x, prompt = torch.randn(3, 4, 2, 4, 4, generator=g), torch.randn(3, 7, 32, generator=g)
    sigma = torch.tensor([0.9, 0.5, 0.1])
    with torch.no_grad():
        ours = WanDenoiser((4, 2, 4, 4)).velocity_fn([model], {"prompt": prompt}, 3)(x, sigma)
        theirs = reference(x, sigma * TIMESTEP_SCALE, prompt).sample
        assert rel_err(ours, theirs) < 1e-5
        together = model(x[:2], sigma[:2] * TIMESTEP_SCALE, prompt[:2])[0]  # two samples in one call
    assert rel_err(together, theirs[:2]) > 1e-2


def test_guided_velocity_is_what_wan_pipeline_steps_with(parallel_1proc, tiny_wan, tmp_path):
    """--cfg-scale 5: the velocity of the rollout and the trained steps (wandit, conditional and
    unconditional in one call of 2 samples) is the one diffusers' WanPipeline, at guidance_scale 5 with
    the same negative prompt, hands its scheduler at each step (two transformer calls there)."""
    from diffusers import WanPipeline
    from mm_grpo.families.wan.encoders import WAN_NEGATIVE_PROMPT, UMT5Conditioner, load_tokenizer
    from mm_grpo.families.wan.mindspeed_mm import TIMESTEP_SCALE, WanDenoiser
    from mm_grpo.families.wan.tiny import TINY_TEXT_LEN
    pipeline, converted = tiny_wan
    model = _wandit(tmp_path, converted)
    pipe = WanPipeline.from_pretrained(pipeline, tokenizer=None)
    pipe.register_modules(tokenizer=load_tokenizer(pipeline))
    steps, scheduler_step = [], pipe.scheduler.step

    def recording_step(model_output, t, sample, *args, **kwargs):
        steps.append((model_output.clone(), float(t), sample.clone()))
        return scheduler_step(model_output, t, sample, *args, **kwargs)

    pipe.scheduler.step = recording_step
    prompt, cfg = "a red circle moving right", 5.0
    pipe(prompt, negative_prompt=WAN_NEGATIVE_PROMPT, height=32, width=32, num_frames=5, num_inference_steps=3,
         guidance_scale=cfg, max_sequence_length=TINY_TEXT_LEN, output_type="latent",
         generator=torch.Generator().manual_seed(0))
    conditioner = UMT5Conditioner(pipeline, max_sequence_length=TINY_TEXT_LEN)
    text = conditioner.encode([prompt])
    guided = WanDenoiser((4, 2, 4, 4), cfg, conditioner.encode([WAN_NEGATIVE_PROMPT]))
    velocities = {name: d.velocity_fn([model], d.conditioning(text, None, "cpu"), 1)
                  for name, d in (("guided", guided), ("conditional", WanDenoiser((4, 2, 4, 4))))}
    assert len(steps) == 3
    for expected, t, x in steps:
        sigma = torch.tensor([t / TIMESTEP_SCALE])
        assert rel_err(velocities["guided"](x, sigma), expected) < 1e-5, t
        assert rel_err(velocities["conditional"](x, sigma), expected) > 1e-2  # guidance moves it


def _run(tmp_path, name, **variables):
    """examples/wan/grpo_wan.sh with `variables` set; returns its run folder."""
    run_dir = tmp_path / name
    env = _child_env(RUN_DIR=str(run_dir), MM_GRPO_PYTHON=sys.executable, MINDSPEED_MM_TESTBED=TESTBED,
                     MM_GRPO_ASCEND=str(tmp_path / "no_ascend"), MASTER_PORT=str(free_port()), **variables)
    proc = subprocess.run(["bash", SCRIPT], env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"grpo_wan.sh {variables} failed (rc={proc.returncode}):\n{log[-6000:]}"
    return run_dir, log


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """The shipped tiny run (DP 2), one process, CP 2 and PP 2 (model_tiny.json's pipeline_num_layers),
    scored by a smooth reward, from the same weights (each run builds and converts the same seeded tiny pipeline, PP 2 split)."""
    require_testbed(needs_megatron_training=True)
    tmp = tmp_path_factory.mktemp("wan_runs")
    # model_tiny.json with a reward without 8-bit steps: the layouts' weights agree to float rounding,
    # which flips pixels' 8-bit values, JPEG sizes by bytes and motion detections (tests/grpo_helpers.py).
    with open(TINY_MODEL) as f:
        smooth = dict(json.load(f), reward=[{"name": "frames", "inner": SMOOTH_REWARD[0], "num_frames": 2}])
    model_json = tmp / "model_tiny_smooth.json"
    model_json.write_text(json.dumps(smooth))
    run = functools.partial(_run, tmp, MODEL_JSON=str(model_json))
    return {"dp2": run("dp2"), "single": run("single", NPUS_PER_NODE="1", PROMPTS=str(PROMPTS)),
            "cp2": run("cp2", CP="2", PROMPTS=str(PROMPTS)), "pp2": run("pp2", PP="2", PROMPTS=str(PROMPTS))}


def saved_pipeline(run_dir, iteration):
    """The whole model of a checkpoint's pipeline stages (mp_rank_00_000, _001, ...): each stage's
    blocks renumbered from its first global block, model_tiny.json's pipeline_num_layers."""
    with open(TINY_MODEL) as f:
        stages = json.load(f)["predictor"]["pipeline_num_layers"]
    model, first = {}, 0
    for stage, count in enumerate(stages):
        path = os.path.join(run_dir, "ckpt", f"iter_{iteration:07d}", f"mp_rank_00_{stage:03d}", "model_optim_rng.pt")
        for name, value in torch.load(path, map_location="cpu", weights_only=False)["model"].items():
            if name.startswith("blocks."):
                _, block, rest = name.split(".", 2)
                name = f"blocks.{first + int(block)}.{rest}"
            assert name not in model, name
            model[name] = value
        first += count
    return model


@pytest.mark.parametrize("layout", ["dp2", "cp2", "pp2"])
def test_grpo_wan_layouts_train_what_one_process_trains(layouts, layout):
    single, other = (scalars(layouts[name][0]) for name in ("single", layout))
    for tag in ("grad-norm", "reward/mean", "adv/abs_max", "loss", "eval/reward_mean"):
        for step, value in single[tag].items():
            assert abs(other[tag][step] - value) <= 1e-4 * max(1.0, abs(value)), (tag, step, other[tag][step], value)
    assert sorted(single["grad-norm"]) == [1, 2, 3] and min(single["grad-norm"].values()) > 0
    assert sorted(single["eval/reward_mean"]) == [0, 3]
    a = saved_model(layouts["single"][0], 3)
    b = (saved_pipeline if layout == "pp2" else saved_model)(layouts[layout][0], 3)
    assert set(a) == set(b)
    assert max(rel_err(b[k], v) for k, v in a.items() if torch.is_tensor(v) and v.is_floating_point()) < 1e-4


def test_grpo_wan_tiny_run_reports_the_held_out_evaluation(layouts):
    _, log = layouts["dp2"]
    assert "held-out evaluation (4 samples, ODE, fixed noise), iteration 0 -> 3: reward_mean" in log
    assert "successfully saved checkpoint from iteration       3" in log


# --- refusals, before Megatron starts (in this process, as each launch's processes check) ---------
def _launch_argv(tiny_wan, tmp_path, model=None, **flags):
    """The entry's command line for the tiny Wan run; `model` edits model_tiny.json, `flags` Megatron's."""
    pipeline, _ = tiny_wan
    with open(TINY_MODEL) as f:
        config = json.load(f)
    config = json.loads(json.dumps(config).replace("$PIPELINE_DIR", str(pipeline)))
    for key, value in (model or {}).items():  # the predictor block's entries one by one
        config[key] = dict(config[key], **value) if key == "predictor" else value
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle moving right\na blue square moving up\n")
    data = {"dataset_param": {"prompt_file": str(prompts)}}
    for name, content in (("model.json", config), ("data.json", data)):
        (tmp_path / name).write_text(json.dumps(content))
    values = {"tensor-model-parallel-size": 1, "context-parallel-size": 1, "pipeline-model-parallel-size": 1,
              "micro-batch-size": 1, **flags}
    argv = [f"--{k}" if v is True else f"--{k}={v}" for k, v in values.items()]  # True: a switch
    return argv + ["--context-parallel-algo", "ulysses_cp_algo",
                   "--num-layers", "2", "--hidden-size", "48", "--num-attention-heads", "2", "--seq-length", "1",
                   "--max-position-embeddings", "1", "--prompts-per-iteration", str(PROMPTS), "--train-iters", "2",
                   "--lr", "1e-3", "--distributed-backend", "gloo", "--no-gradient-accumulation-fusion",
                   "--num-generations", "4", "--num-inference-steps", "6",
                   "--mm-model", str(tmp_path / "model.json"), "--mm-data", str(tmp_path / "data.json"),
                   "--mm-tool", os.path.join(TESTBED, "MindSpeed-MM", "mindspeed_mm", "tools", "tools.json")]


def test_a_wan_launch_that_passes_the_checks(tiny_wan, tmp_path):
    from mm_grpo.mindspeed_mm.grpo import check_launch
    launch = check_launch(_launch_argv(tiny_wan, tmp_path))
    assert (launch.settings.height, launch.settings.width, launch.settings.samples_per_iteration) == (32, 32, 8)
    assert sorted(launch.reward.rewards) == ["frames_jpeg_compressibility", "motion"]


def test_wan_14b_at_pp4_cp4_passes_the_checks(tiny_wan, tmp_path, monkeypatch):
    """model_14b.json as MindSpeed-MM runs Wan2.1-14B (4 stages of 10 blocks), with CP 4 on 16 processes."""
    from mm_grpo.mindspeed_mm.grpo import check_launch
    with open(os.path.join(REPO, "examples", "wan", "model_14b.json")) as f:
        config = json.load(f)
    monkeypatch.setenv("WORLD_SIZE", "16")
    launch = check_launch(_launch_argv(tiny_wan, tmp_path, {"predictor": config["predictor"], "num_frames": 81,
                                                            "image_size": [480, 832]},
                                       **{"pipeline-model-parallel-size": 4, "context-parallel-size": 4,
                                          "use-multiparameter-pipeline-model-parallel": True}))
    assert (launch.settings.height, launch.settings.width) == (480, 832)


@pytest.mark.parametrize("case, world, model, flags, match", [
    ("tp2", 2, None, {"tensor-model-parallel-size": 2},
     r"--tensor-model-parallel-size 2: MindSpeed-MM's wandit does not shard under tensor parallelism"),
    ("micro_batch_2", 1, None, {"micro-batch-size": 2, "global-batch-size": 48},
     r"--micro-batch-size 2: MindSpeed-MM's wandit computes one sample per micro-batch correctly"),
    ("cp3", 3, None, {"context-parallel-size": 3},
     r"--context-parallel-size 3 does not divide the 8 video tokens of 5 frames at 32x32"),
    ("frames", 1, {"num_frames": 8}, {}, r"num_frames 8: Wan's VAE takes 4k \+ 1 frames"),
    ("pp2_one_tensor", 2, None, {"pipeline-model-parallel-size": 2},
     r"--pipeline-model-parallel-size 2: wandit's stages exchange several tensors; add "
     r"--use-multiparameter-pipeline-model-parallel"),
    ("pp2_layers", 2, {"predictor": {"pipeline_num_layers": [2]}},
     {"pipeline-model-parallel-size": 2, "use-multiparameter-pipeline-model-parallel": True},
     r"the predictor's pipeline_num_layers must list the blocks of each of the 2 stages, summing to its "
     r"num_layers 2; got \[2\]"),
    ("flux_pipeline", 1, "flux", {},
     r"text_encoder.from_pretrained .*: its text_encoder/ holds CLIPTextModel, not Wan's UMT5EncoderModel"),
])
def test_a_wan_launch_is_refused_in_one_line(tiny_wan, tiny_pipeline_dir, tmp_path, monkeypatch, case, world, model,
                                              flags, match):
    import re
    from mm_grpo.mindspeed_mm.grpo import LaunchRefused, check_launch
    if model == "flux":  # a Wan model.json whose VAE and text encoder are a FLUX pipeline's
        model = {"ae": {"from_pretrained": str(tiny_pipeline_dir)},
                 "text_encoder": {"from_pretrained": str(tiny_pipeline_dir), "max_sequence_length": 16}}
    monkeypatch.setenv("WORLD_SIZE", str(world))  # what torchrun sets, and Megatron's parser reads
    with pytest.raises(LaunchRefused) as refused:
        check_launch(_launch_argv(tiny_wan, tmp_path, model, **flags))
    message = str(refused.value)
    assert re.search(match, message) and "\n" not in message, message


def test_the_negative_prompt_is_wans_by_default_and_refused_without_cfg():
    """--negative-prompt is one flag for every family (mm_grpo/grpo/denoiser.py NegativePrompt): unset,
    Wan2.1 guides against MindSpeed-MM's negative prompt; given without --cfg-scale it would change nothing."""
    from mm_grpo.families.wan.encoders import WAN_NEGATIVE_PROMPT
    from mm_grpo.families.wan.mindspeed_mm import WanGuidance
    from tests.utils import assert_one_line_error
    assert WanGuidance(cfg_scale=5.0).unconditional_prompt == WAN_NEGATIVE_PROMPT
    assert WanGuidance(cfg_scale=5.0, negative_prompt="blurry").unconditional_prompt == "blurry"
    assert_one_line_error(lambda: WanGuidance(negative_prompt="blurry").check(),
                          r"^--negative-prompt is the unconditional prompt of classifier-free guidance, which is off: "
                          r"add --cfg-scale > 1$")
