"""GRPO of Qwen-Image inside MindSpeed-MM's real `pretrain`, launched as shipped:
examples/qwen_image/mindspeed_mm/grpo_qwen_image.sh with only its variables set (the tiny Qwen-Image
pipeline, 2 iterations, true CFG, CPU, gloo, a no-op CANN set_env.sh): the predictor registered under
its model_id, the run equal to mm-grpo's own trainer at the same seeds (losses, rewards, grad norms, the
saved weights), the first micro-batch's PPO ratio exactly 1."""
import json
import os
import subprocess
import sys

import pytest

from mm_grpo.families.qwen_image.predictor_block import MODEL_ID
from mm_grpo.families.qwen_image.transformer import QwenImageConfig
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.grpo_helpers import SMOOTH_REWARD, grpo_argv, run_grpo, write_configs
from tests.ports import free_port
from tests.standins.ascend_install import ascend_install
from tests.test_mindspeed_grpo import (KL_BETA, LAUNCH_TIMEOUT_S, SCRIPT_VARIABLES, TOL, _child_env, saved_model,
                                       scalars)
from tests.testbed import REPO, TESTBED, require_testbed
from tests.utils import rel_err

pytestmark = pytest.mark.mindspeed_mm
SCRIPT = os.path.join(REPO, "examples", "qwen_image", "mindspeed_mm", "grpo_qwen_image.sh")
SAMPLER = "flow_sde"  # the script's default


def write_qwen_image_configs(folder, pipeline_dir):
    """mm-grpo's model.json / data.json, and MindSpeed-MM's (the architecture inline with MindSpeed-MM's
    names of the heads, from_pretrained one file, absolute paths) with a tools.json."""
    ours = write_configs(folder, pipeline_dir, reward=SMOOTH_REWARD)  # no 8-bit steps (test_mindspeed_grpo.configs)
    with open(ours[0]) as f:
        model = json.load(f)
    transformer = os.path.join(str(pipeline_dir), "transformer")
    model["predictor"] = {"model_id": MODEL_ID, "from_pretrained": transformer}
    model["text_encoder"]["max_sequence_length"] = 64
    with open(ours[0], "w") as f:
        json.dump(model, f)
    with open(ours[1]) as f:
        data = json.load(f)
    params = data["dataset_param"]
    params.update({k: os.path.join(folder, params[k]) for k in ("prompt_file", "eval_prompt_file")})
    arch = QwenImageConfig.from_diffusers_config(transformer).to_diffusers_config()
    heads, head_dim = arch.pop("num_attention_heads"), arch.pop("attention_head_dim")
    model["predictor"] = {"model_id": MODEL_ID, **arch, "num_heads": heads, "head_dim": head_dim,
                          "from_pretrained": os.path.join(transformer, "diffusion_pytorch_model.safetensors")}
    with open(os.path.join(TESTBED, "MindSpeed-MM", "mindspeed_mm", "tools", "tools.json")) as f:
        tools = json.load(f)
    tools["profile"]["profile_type"] = "dynamic"  # no NPU profiler built while profiling is off
    paths = [os.path.join(folder, n) for n in ("mindspeed_model.json", "mindspeed_data.json", "tools.json")]
    for path, content in zip(paths, (model, data, tools)):
        with open(path, "w") as f:
            json.dump(content, f)
    return ours, *paths


@pytest.fixture(scope="module")
def runs(parallel_1proc, tiny_qwen_image_pipeline_dir, tmp_path_factory):
    require_testbed(needs_megatron_training=True)
    folder = tmp_path_factory.mktemp("mindspeed_qwen_image")
    ours, model_json, data_json, tools_json = write_qwen_image_configs(str(folder), tiny_qwen_image_pipeline_dir)
    history, run = run_grpo(grpo_argv(*ours, iters=2, extra=["--kl-beta", KL_BETA, "--sampler", SAMPLER]))
    weights = {n: p.detach().clone() for n, p in run.model.modules[0].named_parameters()}
    run_dir = str(folder / "full")
    tmp = folder / "a"
    tmp.mkdir()
    variables = dict(SCRIPT_VARIABLES, EVAL_INTERVAL="1000")
    env = _child_env(**variables, MM_GRPO_ASCEND=str(ascend_install(tmp)), MASTER_PORT=str(free_port()),
                     MINDSPEED_MM=os.path.join(TESTBED, "MindSpeed-MM"), MM_MODEL=model_json, MM_DATA=data_json,
                     MM_TOOL=tools_json, LOAD_PATH=str(folder / "nothing_yet"), SAVE_PATH=os.path.join(run_dir, "ckpt"),
                     TENSORBOARD_DIR=os.path.join(run_dir, "tb"), LOG_DIR=os.path.join(run_dir, "logs"))
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env["PATH"]])  # torchrun
    proc = subprocess.run(["bash", SCRIPT], env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"grpo_qwen_image.sh failed (rc={proc.returncode}):\n{log[-6000:]}"
    return {"history": history, "weights": weights, "run_dir": run_dir, "guided": run.schedule.denoiser.guided}


def test_two_iterations_in_pretrain_equal_the_trainer(runs):
    assert runs["guided"]  # true CFG, the script's default and the trainer's
    logged = scalars(runs["run_dir"])
    for it, ours in enumerate(runs["history"], start=1):
        assert abs(logged["loss"][it] - ours["loss"]) <= 1e-6
        assert logged["reward/mean"][it] == pytest.approx(ours["reward/mean"], rel=TOL)
        assert logged["grad-norm"][it] == pytest.approx(ours["grad_norm"], rel=TOL)
        assert logged["ratio_min"][it] == logged["ratio_max"][it] == 1.0
    saved = saved_model(runs["run_dir"], 2)
    errs = {n: rel_err(saved[n], w) for n, w in runs["weights"].items()}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= TOL, (worst, errs[worst])


def test_the_predictor_is_registered_in_mindspeed_mms_mapping():
    require_testbed(needs_megatron_training=True)
    import mm_grpo.mindspeed_mm.registry  # noqa: F401
    from mindspeed_mm.models.predictor.predict_model import PREDICTOR_MODEL_MAPPINGS
    from mm_grpo.families.qwen_image.mindspeed_mm import QwenImagePredictor
    assert PREDICTOR_MODEL_MAPPINGS[MODEL_ID] is QwenImagePredictor
