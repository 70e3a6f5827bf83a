"""MindSpeed-MM's own `pretrain_sora.py` with FLUX: its arguments, model provider and forward step,
in MindSpeed-MM's environment (tests/testbed.py). Shared by single-process and torchrun tests."""
import json
import os
import re
import runpy
import sys

import torch
from safetensors.torch import save_file

from mm_grpo.families.flux.predictor_block import MINDSPEED_MM_NAMES
from mm_grpo.families.flux.transformer import FluxConfig
from tests.testbed import TESTBED

PRETRAIN_SORA = os.path.join(TESTBED, "MindSpeed-MM", "pretrain_sora.py")
# Megatron's fused kernels that need Apex / Transformer Engine; MindSpeed provides them on NPU.
NO_FUSIONS = ("--no-rope-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion")


def predictor_block(config: FluxConfig) -> dict:
    """`config` as a MindSpeed-MM user writes the flux block (examples/flux/mindspeed_mm/pretrain_model.json):
    diffusers' names, with the heads under MindSpeed-MM's (num_heads, head_dim), which its argument
    validation reads to set Megatron's head count and hidden size."""
    block = config.to_diffusers_config()
    for theirs, diffusers in MINDSPEED_MM_NAMES.items():
        block[theirs] = block.pop(diffusers)
    return block


def write_configs(folder, config: FluxConfig, weights: dict, predictor_extra=None, image_size=(64, 64)):
    """model.json / data.json in MindSpeed-MM's schema for FLUX trained on precomputed features,
    and the transformer's weights as one diffusers file; returns (model.json, data.json)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "diffusion_pytorch_model.safetensors")
    save_file({k: v.contiguous() for k, v in weights.items()}, path)
    model = {
        "load_video_features": True, "load_text_features": True, "task": "t2v",
        "diffusion": {"model_id": "wan_flow_match_scheduler", "num_train_timesteps": 1000, "shift": 3.0,
                      "sigma_min": 0.0, "extra_one_step": True},
        "predictor": {"model_id": "flux", "dtype": "fp32", "from_pretrained": path,
                      **predictor_block(config), **(predictor_extra or {})},
    }
    data = {"dataset_param": {"preprocess_parameters": {"max_height": image_size[0], "max_width": image_size[1]}}}
    files = os.path.join(folder, "model.json"), os.path.join(folder, "data.json")
    for file, content in zip(files, (model, data)):
        with open(file, "w") as f:
            json.dump(content, f)
    return files


def set_megatron_args(model_json, data_json, tp=1, pp=1, cp=1, micro_batch=2, extra=()):
    """Megatron's global arguments as pretrain_sora.py's `pretrain` parses them (MindSpeed's and
    MindSpeed-MM's argument patches included): no size flags, MindSpeed-MM's validation takes the
    sizes from the predictor block, as examples/flux/mindspeed_mm/pretrain_flux.sh has it. The
    model-parallel groups are the caller's."""
    from mindspeed_mm.configs.config import mm_extra_args_provider  # first: its import patches validate_args
    from mindspeed_mm.arguments import extra_args_provider_decorator  # MindSpeed-MM's own flags, as pretrain adds them
    from megatron.training import arguments
    from megatron.training.global_vars import set_global_variables, unset_global_variables
    argv = ["pretrain_sora.py", "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--context-parallel-size", str(cp), "--context-parallel-algo", "ulysses_cp_algo",
            "--micro-batch-size", str(micro_batch), "--global-batch-size", str(micro_batch), "--lr", "1e-5",
            "--train-iters", "1", "--no-gradient-accumulation-fusion", "--use-cpu-initialization",
            "--mm-model", model_json, "--mm-data", data_json, "--ckpt-format", "torch", *NO_FUSIONS, *extra]
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # MindSpeed-MM's launch scripts export it; its TP / CP check reads it
    saved, sys.argv = sys.argv, argv
    try:
        args = arguments.parse_args(extra_args_provider_decorator(mm_extra_args_provider))
        arguments.validate_args(args, {"dataloader_type": "external", "vision_pretraining": False,
                                    "curr_forward_iteration": 0})
    finally:
        sys.argv = saved
    unset_global_variables()
    set_global_variables(args, build_tokenizer=False)
    return args


def pretrain_sora():
    """pretrain_sora.py's module namespace (model_provider, forward_step, ...), not run as main,
    with mm-grpo's models registered as `python -m mm_grpo.mindspeed_mm.run pretrain_sora.py` does."""
    import mm_grpo.mindspeed_mm.run  # noqa: F401
    return runpy.run_path(PRETRAIN_SORA, run_name="pretrain_sora")


def record_q_sample(model):
    """Keep what SoRAModel's scheduler draws (noised latents, noise, timestep) in a list."""
    drawn, q_sample = [], model.diffusion.q_sample

    def recording(*args, **kwargs):
        out = q_sample(*args, **kwargs)
        drawn.append(out)
        return out
    model.diffusion.q_sample = recording
    return drawn


def feature_batch(config: FluxConfig, batch=2, latent=(8, 8), txt_len=7, seed=0):
    """A batch of precomputed features as a MindSpeed-MM dataset yields them: VAE latents and
    [T5 hidden states, pooled CLIP] text features."""
    g = torch.Generator().manual_seed(seed)
    return {"video": torch.randn(batch, config.in_channels // 4, *latent, generator=g),
            "prompt_ids": [torch.randn(batch, txt_len, config.joint_attention_dim, generator=g),
                           torch.randn(batch, config.pooled_projection_dim, generator=g)]}


def write_feature_dataset(folder, batch: dict, data_json: str, image_size=(64, 64)):
    """The batch as a MindSpeed-MM feature dataset (`dataset_type: "feature"`, the format
    docs/mindspeed_mm.md gives: one .pt per sample with video, prompt_ids and prompt_mask, and a
    data.jsonl naming the files); rewrites `data_json` to read it in order."""
    os.makedirs(folder, exist_ok=True)
    t5, pooled = batch["prompt_ids"]
    with open(os.path.join(folder, "data.jsonl"), "w") as f:
        for i, latents in enumerate(batch["video"]):
            torch.save({"video": latents, "prompt_ids": [t5[i], pooled[i]],
                        "prompt_mask": torch.ones(t5.shape[1], dtype=torch.long)}, os.path.join(folder, f"{i}.pt"))
            f.write(json.dumps({"file": f"{i}.pt"}) + "\n")
    data = {"dataset_param": {"dataset_type": "feature",
                              "basic_parameters": {"data_path": os.path.join(folder, "data.jsonl"), "data_folder": folder},
                              "preprocess_parameters": {"max_height": image_size[0], "max_width": image_size[1]}},
            "dataloader_param": {"dataloader_mode": "sampler", "shuffle": False, "drop_last": True,
                                 "pin_memory": False}}
    with open(data_json, "w") as f:
        json.dump(data, f)


PEFT_ADAPTER = re.compile(r"^(?:.*?predictor\.)?(.+)\.lora_([AB])\.default\.weight$")


def peft_adapters(model) -> dict:
    """{mm-grpo's parameter name: peft's parameter} of the adapters MindSpeed-MM's LoRA put on `model`."""
    found = {}
    for name, p in model.named_parameters():
        m = PEFT_ADAPTER.match(name)
        if m:
            found[f"{m[1]}.lora_{m[2]}.weight"] = p
    return found
