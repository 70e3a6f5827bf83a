"""FLUX trained by flow matching through MindSpeed-MM's own pretrain_sora.py: its model provider
(SoRAModel + PredictModel), forward step and loss, against mm-grpo's own flow-matching loss; its
argument validation on the shipped model.json; and examples/flux/mindspeed_mm/pretrain_flux.sh
as shipped, on features written by mm_grpo.tools.write_features."""
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from mm_grpo.families.flux.predictor_block import flux_config_from_block
from mm_grpo.families.flux.transformer import FluxConfig, FluxTransformer
from mm_grpo.families.flux.transformer.hf_weights import load_hf_weights
from mm_grpo.families.flux.transformer.latents import pack_latents, prepare_latent_image_ids
from mm_grpo.files.jsonfile import load_json
from mm_grpo.flow.matching import flow_matching_loss
from mm_grpo.recompute import recompute_fields
from mm_grpo.tools.write_features import main as write_features
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.ports import free_port
from tests.sora_helpers import (feature_batch, predictor_block, pretrain_sora, record_q_sample, set_megatron_args,
                                write_configs, write_feature_dataset)
from tests.standins.ascend_install import ascend_install
from tests.test_write_features import image_folder
from tests.testbed import REPO, TESTBED, require_testbed, subprocess_env
from tests.utils import random_reference

pytestmark = pytest.mark.mindspeed_mm
TINY = FluxConfig.preset("tiny")
EXAMPLE = os.path.join(REPO, "examples", "flux", "mindspeed_mm")


@pytest.mark.parametrize("source", ["batch", "feature_files"])
def test_pretrain_sora_flow_step_equals_mm_grpo_flow_loss(parallel_1proc, tmp_path, source):
    """`batch`: the step on a batch handed to it; `feature_files`: on what MindSpeed-MM's own
    feature dataset and dataloader (pretrain_sora's datasets provider) read from feature files."""
    require_testbed(needs_megatron_training=True)
    ref = random_reference(TINY, seed=2)
    model_json, data_json = write_configs(tmp_path, TINY, ref.state_dict())
    batch = feature_batch(TINY)
    if source == "feature_files":
        write_feature_dataset(str(tmp_path / "features"), batch, data_json)
    args = set_megatron_args(model_json, data_json)
    sora = pretrain_sora()
    model = sora["model_provider"]()
    drawn = record_q_sample(model)
    x0, (t5, pooled) = batch["video"].clone(), batch["prompt_ids"]
    if source == "feature_files":
        args.consumed_train_samples = 0
        data_iterator = sora["train_valid_test_datasets_provider"]([2, 0, 0])[0]
    else:
        data_iterator = iter([batch])
    output, loss_func = sora["forward_step"](data_iterator, model)
    loss, reported = loss_func(output)
    loss.sum().backward()
    noised, noise, timestep = drawn[0]

    # mm-grpo's flow trainer on the same batch: packed latents, sigma = t / 1000, guidance 3.5.
    ours = load_hf_weights(FluxTransformer(TINY), ref.state_dict())
    sigma = (timestep / 1000).expand(2)
    v = ours(pack_latents(noised), t5, pooled, sigma, prepare_latent_image_ids(4, 4), torch.zeros(7, 3),
             guidance=torch.full((2,), 3.5))
    expected = flow_matching_loss(v, pack_latents(x0), pack_latents(noise)).mean()
    weight = model.diffusion._training_weight(timestep)  # the scheduler's timestep weighting
    assert torch.allclose(loss, weight * expected, rtol=1e-5, atol=0), (loss, weight, expected)
    assert torch.allclose(reported["loss"], loss[0])
    grads = [p.grad for p in model.predictor.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads) and len(grads) > 50


def test_shipped_model_json_passes_mindspeed_mm_validation(tmp_path):
    """MindSpeed-MM's validate_args sets Megatron's sizes from the shipped predictor block: FLUX.1's
    57 blocks, 24 heads of 128 (hidden 3072). Without num_heads it fails as issue 35 found it."""
    require_testbed(needs_megatron_training=True)
    model = load_json(os.path.join(EXAMPLE, "pretrain_model.json"), "model.json")
    data = tmp_path / "data.json"
    data.write_text(json.dumps({"dataset_param": {}}))
    args = set_megatron_args(os.path.join(EXAMPLE, "pretrain_model.json"), str(data))
    assert (args.num_layers, args.num_attention_heads, args.hidden_size) == (57, 24, 3072)
    diffusers_names = dict(model["predictor"], num_attention_heads=24, attention_head_dim=128)
    del diffusers_names["num_heads"], diffusers_names["head_dim"]
    (tmp_path / "model.json").write_text(json.dumps(dict(model, predictor=diffusers_names)))
    with pytest.raises(TypeError, match="unsupported operand"):
        set_megatron_args(str(tmp_path / "model.json"), str(data))


def _shipped(name, tmp_path, change):
    """examples/flux/mindspeed_mm/<name> with `change` applied to its parsed JSON, written to tmp_path."""
    config = load_json(os.path.join(EXAMPLE, name), name)
    change(config)
    (tmp_path / name).write_text(json.dumps(config))
    return str(tmp_path / name)


def test_pretrain_flux_sh_as_shipped_trains_on_written_features(tiny_pipeline_dir, tmp_path):
    """The user's path: features written from images and captions with the pipeline's VAE and text
    encoders, then examples/flux/mindspeed_mm/pretrain_flux.sh unchanged (pipeline parallel 2, as
    shipped), only sizes and paths through its variables, on the CPU stand-in of an Ascend install.
    The shipped model.json and feature data.json with the tiny pipeline's sizes put in."""
    require_testbed(needs_megatron_training=True)
    images, resolution, text_len = 2, 32, 8  # two iterations of one sample each (data parallel 1)
    data = image_folder(tmp_path / "images", [(resolution, resolution)] * images)
    write_features(["--pipeline", str(tiny_pipeline_dir), "--data", str(data), "--out", str(tmp_path / "features"),
                    "--max-sequence-length", str(text_len), "--dtype", "float32"])
    transformer = tiny_pipeline_dir / "transformer"
    tiny = FluxConfig.from_diffusers_config(str(transformer))

    def tiny_model(model):
        block, shipped = model["predictor"], set(model["predictor"])
        sizes = predictor_block(tiny)
        block.update({k: sizes[k] for k in shipped & set(sizes)}, dtype="fp32", text_len=text_len,
                     num_layers=tiny.num_blocks, pipeline_num_layers=[tiny.num_blocks // 2] * 2,
                     from_pretrained=str(transformer / "diffusion_pytorch_model.safetensors"))
        assert set(block) == shipped and flux_config_from_block(block).replace(**recompute_fields(None)) == tiny

    def tiny_data(data):
        data["dataset_param"]["basic_parameters"] = {"data_path": str(tmp_path / "features" / "data.jsonl"),
                                                     "data_folder": str(tmp_path / "features")}
        data["dataset_param"]["preprocess_parameters"] = {"max_height": resolution, "max_width": resolution}

    save = tmp_path / "save"
    env = subprocess_env(dict(
        os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]),
        # absolute: the script runs from $MINDSPEED_MM (Megatron-LM's tree comes on PYTHONPATH here)
        PYTHONPATH=os.pathsep.join(os.path.abspath(p) for p in [REPO, *os.environ.get("PYTHONPATH", "").split(
            os.pathsep)] if p),
        MM_GRPO_ASCEND=str(ascend_install(tmp_path)), MM_GRPO_DEVICE="cpu", OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore", MINDSPEED_MM=os.path.join(TESTBED, "MindSpeed-MM"), NPUS_PER_NODE="2",
        MASTER_PORT=str(free_port()), TRAIN_ITERS="2", PRECISION="fp32", DIST_BACKEND="gloo",
        MM_MODEL=_shipped("pretrain_model.json", tmp_path, tiny_model),
        MM_DATA=_shipped("feature_data.json", tmp_path, tiny_data),
        LOAD_PATH=str(tmp_path / "nothing_to_load"), SAVE_PATH=str(save), LOG_DIR=str(tmp_path / "logs")))
    for shipped in ("TP", "PP", "CP", "MBS", "GRAD_ACC_STEP", "NNODES", "NODE_RANK", "MASTER_ADDR", "MM_TOOL"):
        env.pop(shipped, None)  # the script's own defaults, whatever this shell has
    proc = subprocess.run(["bash", os.path.join(EXAMPLE, "pretrain_flux.sh")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    # Megatron's log line per iteration: "iteration 2/ 2 | ... | loss: 2.7E+00 | ... skipped iterations: 0 |"
    logged = re.findall(r"iteration +(\d+)/ +2 \|.*\| loss: (\S+) \|.*number of skipped iterations: +(\d+)",
                        proc.stdout)
    assert [(int(i), int(skipped)) for i, _, skipped in logged] == [(1, 0), (2, 0)], proc.stdout[-4000:]
    assert all(math.isfinite(float(loss)) for _, loss, _ in logged)
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    for stage in (0, 1):  # pipeline stages, tensor-parallel rank 0
        state = torch.load(save / "iter_0000002" / f"mp_rank_00_{stage:03d}" / "model_optim_rng.pt",
                           map_location="cpu", weights_only=False)
        adam = state["optimizer"]["state"]
        assert state["iteration"] == 2 and len(adam) == sum(not k.endswith("_extra_state") for k in state["model"])
        assert all(s["exp_avg_sq"].abs().sum() > 0 for s in adam.values())  # every weight had a gradient
    assert len(os.listdir(tmp_path / "logs")) == 1  # the script's log (MindSpeed-MM's logs/ layout)
