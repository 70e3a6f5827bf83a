"""The README's commands, read from the README: the two commands are the ones the launch-script and
test-command tests run; the conversion and the model snippet run here as written, with only the
paths and sizes of FLUX.1-dev swapped for the tiny pipeline's (one process, no accelerator); the
cluster launch sets only variables the launch script or its configs read."""
import json
import pathlib
import re
import shlex

import pytest
import torch

from converters.convert_cli import main as convert_main
from tests.utils import run_main

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)
REAL_WEIGHTS = "/models/FLUX.1-dev"


def blocks(language: str) -> list:
    return [body for lang, body in BLOCK.findall(README) if lang == language]


def commands(body: str) -> list:
    """The shell commands of a block, continuation lines joined, comments dropped."""
    return [line.split("#")[0].strip() for line in body.replace("\\\n", " ").splitlines() if line.split("#")[0].strip()]


def block_with(language: str, text: str) -> str:
    found = [b for b in blocks(language) if text in b]
    assert len(found) == 1, f"the README has {len(found)} {language} blocks with {text!r}"
    return found[0]


def test_the_two_commands_are_the_ones_the_tests_run():
    assert commands(block_with("bash", "shell/run_tests.sh")) == ["bash examples/flux/grpo_flux.sh",
                                                                  "bash shell/run_tests.sh"]
    assert "examples/flux/grpo_flux.sh" in (ROOT / "tests" / "test_run_trainer.py").read_text()
    assert "shell/run_tests.sh" in (ROOT / "tests" / "test_run_tests_script.py").read_text()


def test_the_cluster_launch_sets_only_what_the_script_reads():
    (launch,) = commands(block_with("bash", "NNODES=2"))
    tokens = shlex.split(launch)
    assert tokens[-2:] == ["bash", "examples/flux/grpo_flux.sh"]
    # the script and the configs it passes (model.json's $VARS are expanded by the trainer)
    read = "".join((ROOT / "examples" / "flux" / name).read_text() for name in ("grpo_flux.sh", "model.json",
                                                                                 "data.json"))
    for name in (t.split("=", 1)[0] for t in tokens[:-2]):
        assert re.search(r"\$\{?%s\b" % name, read), f"neither grpo_flux.sh nor its configs read {name}"


def test_the_conversion_commands_run(capsys, tiny_pipeline_dir, tmp_path):
    """hf_to_mm at TP 2 and two pipeline stages, resplit to TP 4, mm_to_hf: the weights come back."""
    from safetensors.torch import load_file
    config = json.loads((pathlib.Path(tiny_pipeline_dir) / "transformer" / "config.json").read_text())
    blocks_total = config["num_layers"] + config["num_single_layers"]
    stages = f"[{blocks_total // 2},{blocks_total - blocks_total // 2}]"  # FLUX.1's [28,29] of 57
    for command in commands(block_with("bash", "mm-convert")):
        argv = shlex.split(command.replace(REAL_WEIGHTS, str(tiny_pipeline_dir)).replace("[28,29]", stages))
        assert argv[0] == "mm-convert"
        argv = [str(tmp_path / a) if a.startswith(("ckpt/", "hf_out")) else a for a in argv[1:]]
        code, _, err = run_main(convert_main, capsys, *argv)
        assert code == 0, err
    original = load_file(pathlib.Path(tiny_pipeline_dir) / "transformer" / "diffusion_pytorch_model.safetensors")
    written = next((tmp_path / "hf_out").rglob("*.safetensors"))
    back = load_file(written)
    assert back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in original)


def test_the_model_snippet_runs(tiny_pipeline_dir):
    from mm_grpo.families.flux.transformer.latents import prepare_latent_image_ids
    from mm_grpo.parallel import destroy_parallel
    snippet = block_with("python", "FluxTransformer(config)")
    snippet = snippet.replace(REAL_WEIGHTS, str(tiny_pipeline_dir)).replace("ParallelConfig(tp=2)", "ParallelConfig()")
    config = json.loads((pathlib.Path(tiny_pipeline_dir) / "transformer" / "config.json").read_text())
    batch, text_tokens, grid = 2, 8, 4
    inputs = dict(hidden_states=torch.randn(batch, grid * grid, config["in_channels"]),
                  encoder_hidden_states=torch.randn(batch, text_tokens, config["joint_attention_dim"]),
                  pooled_projections=torch.randn(batch, config["pooled_projection_dim"]),
                  timestep=torch.full((batch,), 0.5), img_ids=prepare_latent_image_ids(grid, grid),
                  txt_ids=torch.zeros(text_tokens, 3), guidance=torch.full((batch,), 3.5))
    scope = dict(inputs)
    try:
        exec(compile(snippet, "README.md", "exec"), scope)
    finally:
        destroy_parallel()
    assert scope["velocity"].shape == inputs["hidden_states"].shape
    assert torch.isfinite(scope["velocity"]).all()
