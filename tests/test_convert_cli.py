"""`mm-convert` through its real command line: help texts, bad input, atomic output."""
import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from converters import flux
from converters.convert_cli import main
from mm_grpo.checkpoint.shard_io import ShardWriter
from mm_grpo.families.flux.transformer import FluxConfig
from tests.utils import random_reference, run_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = FluxConfig.preset("tiny")


@pytest.fixture(scope="module")
def state_dict():
    return random_reference(TINY, seed=3).state_dict()


def diffusers_folder(path, state_dict, config=TINY):
    """A diffusers transformer folder written with plain safetensors (so it can be broken at will)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config.to_diffusers_config()))
    save_file(dict(state_dict), path / "diffusion_pytorch_model.safetensors")
    return path


def run(capsys, *args):
    """mm-convert's main(args) -> (exit status, stdout, stderr)."""
    return run_main(main, capsys, *args)


def hf_to_mm(capsys, source, target, *extra):
    return run(capsys, "FluxConverter", "hf_to_mm", "--cfg.source_path", source, "--cfg.target_path", target, *extra)


def assert_refused(code, err, pattern, tmp_path, target):
    assert code == 1
    assert err.startswith("mm-convert: error: ") and err.count("\n") == 1, err
    assert re.search(pattern, err), err
    assert not os.path.exists(target)
    assert not [n for n in os.listdir(os.path.dirname(target)) if ".tmp-" in n]  # no partial output


# --- bad input ----------------------------------------------------------------------------
def test_missing_and_unexpected_keys_are_listed(capsys, tmp_path, state_dict):
    broken = dict(state_dict)
    del broken["transformer_blocks.1.attn.add_k_proj.bias"]
    del broken["single_transformer_blocks.3.proj_out.weight"]
    broken["transformer_blocks.7.attn.to_q.weight"] = torch.zeros(2)
    src = diffusers_folder(tmp_path / "src", broken)
    code, _, err = hf_to_mm(capsys, src, tmp_path / "dst")
    assert_refused(code, err, r"missing weights: single_transformer_blocks\.3\.proj_out\.weight, "
                              r"transformer_blocks\.1\.attn\.add_k_proj\.bias; "
                              r"unexpected weights: transformer_blocks\.7\.attn\.to_q\.weight",
                   tmp_path, tmp_path / "dst")


def test_wrong_shape_is_named(capsys, tmp_path, state_dict):
    src = diffusers_folder(tmp_path / "src", {**state_dict, "proj_out.weight": torch.zeros(16, 32)})
    code, _, err = hf_to_mm(capsys, src, tmp_path / "dst")
    assert_refused(code, err, r"wrong shapes: proj_out\.weight is \(16, 32\), expected \(16, 64\)",
                   tmp_path, tmp_path / "dst")


def test_bfl_missing_key_is_named_in_bfl_terms(capsys, tmp_path, state_dict):
    from converters.bfl import diffusers_to_bfl
    bfl = diffusers_to_bfl(state_dict, TINY)
    del bfl["single_blocks.2.linear1.bias"]
    save_file(bfl, tmp_path / "flux.safetensors")
    code, _, err = hf_to_mm(capsys, tmp_path / "flux.safetensors", tmp_path / "dst", "--cfg.preset", "tiny")
    assert_refused(code, err, r"missing BFL weights: single_blocks\.2\.linear1\.bias", tmp_path, tmp_path / "dst")


def test_single_file_without_a_config_is_refused(capsys, tmp_path, state_dict):
    from converters.bfl import diffusers_to_bfl
    save_file(diffusers_to_bfl(state_dict, TINY), tmp_path / "flux.safetensors")
    code, _, err = hf_to_mm(capsys, tmp_path / "flux.safetensors", tmp_path / "dst")
    assert_refused(code, err, r"single file without a config: pass --cfg\.hf_dir .* or --cfg\.preset",
                   tmp_path, tmp_path / "dst")


@pytest.mark.parametrize("args,pattern", [
    (["--cfg.target_parallel_config.tp_size", "3"],
     r"num_attention_heads \(4\) must be divisible by tensor-model-parallel size \(3\)"),
    (["--cfg.target_parallel_config.pp_layers", "[2,2]"], r"pp_layers \[2, 2\] sums to 4, but the model has 6 blocks"),
    (["--cfg.target_parallel_config.pp_layers", "[[1,2],[3]]"], r"every virtual chunk needs one count per stage"),
])
def test_bad_parallel_layout_is_refused(capsys, tmp_path, state_dict, args, pattern):
    src = diffusers_folder(tmp_path / "src", state_dict)
    code, _, err = hf_to_mm(capsys, src, tmp_path / "dst", *args)
    assert_refused(code, err, pattern, tmp_path, tmp_path / "dst")


def test_existing_target_is_refused_unless_overwrite(capsys, tmp_path, state_dict):
    src = diffusers_folder(tmp_path / "src", state_dict)
    assert hf_to_mm(capsys, src, tmp_path / "dst")[0] == 0
    shard = tmp_path / "dst" / "release" / "mp_rank_00" / "model_optim_rng.pt"
    before = shard.read_bytes()
    code, _, err = hf_to_mm(capsys, src, tmp_path / "dst", "--cfg.target_parallel_config.tp_size", "2")
    assert code == 1 and "already exists: remove it or pass --cfg.overwrite true" in err
    assert shard.read_bytes() == before
    code, _, _ = hf_to_mm(capsys, src, tmp_path / "dst", "--cfg.target_parallel_config.tp_size", "2",
                          "--cfg.overwrite", "true")
    assert code == 0 and sorted(os.listdir(tmp_path / "dst" / "release")) == ["mp_rank_00", "mp_rank_01"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    code, _, err = hf_to_mm(capsys, src, tmp_path / "notes", "--cfg.overwrite", "true")
    assert code == 1 and "refusing to overwrite" in err and (tmp_path / "notes" / "todo.txt").exists()


def test_truncated_safetensors_is_refused(capsys, tmp_path, state_dict):
    src = diffusers_folder(tmp_path / "src", state_dict)
    weights = src / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    code, _, err = hf_to_mm(capsys, src, tmp_path / "dst")
    assert_refused(code, err, r"cannot read safetensors file .*diffusion_pytorch_model\.safetensors", tmp_path,
                   tmp_path / "dst")


def test_truncated_or_incomplete_megatron_checkpoint_is_refused(capsys, tmp_path, state_dict):
    src = diffusers_folder(tmp_path / "src", state_dict)
    assert hf_to_mm(capsys, src, tmp_path / "mm", "--cfg.target_parallel_config.pp_layers", "[3,3]")[0] == 0
    shard = tmp_path / "mm" / "release" / "mp_rank_00_001" / "model_optim_rng.pt"
    shard.write_bytes(shard.read_bytes()[:-5000])
    code, _, err = run(capsys, "FluxConverter", "mm_to_hf", "--cfg.source_path", tmp_path / "mm",
                       "--cfg.target_path", tmp_path / "hf")
    assert_refused(code, err, r"cannot read checkpoint shard .*mp_rank_00_001/model_optim_rng\.pt \(truncated",
                   tmp_path, tmp_path / "hf")
    shard.unlink()
    code, _, err = run(capsys, "FluxConverter", "resplit", "--cfg.source_path", tmp_path / "mm",
                       "--cfg.target_path", tmp_path / "re")
    assert_refused(code, err, r"checkpoint shard .*mp_rank_00_001/model_optim_rng\.pt is missing", tmp_path,
                   tmp_path / "re")


def test_failure_midway_leaves_nothing_behind(capsys, tmp_path, state_dict, monkeypatch):
    src = diffusers_folder(tmp_path / "src", state_dict)
    calls = []
    real_write = ShardWriter.write

    def failing_write(self, key, tensor):
        calls.append(key)
        if len(calls) == 40:
            raise ValueError("disk full (simulated)")
        real_write(self, key, tensor)

    monkeypatch.setattr(ShardWriter, "write", failing_write)
    code, _, err = hf_to_mm(capsys, src, tmp_path / "dst", "--cfg.target_parallel_config.tp_size", "2")
    assert_refused(code, err, r"disk full \(simulated\)", tmp_path, tmp_path / "dst")


def test_missing_source_through_a_real_process(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "converters.convert_cli", "FluxConverter", "hf_to_mm",
         "--cfg.source_path", str(tmp_path / "nope"), "--cfg.target_path", str(tmp_path / "dst")],
        cwd=REPO, capture_output=True, text=True, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == f"mm-convert: error: no such FLUX checkpoint: {tmp_path / 'nope'}"
    assert not os.path.exists(tmp_path / "dst")


def test_happy_path_pipeline_folder_to_bf16_virtual_stages(capsys, tmp_path, state_dict):
    src = diffusers_folder(tmp_path / "pipe" / "transformer", state_dict)
    code, out, _ = hf_to_mm(capsys, tmp_path / "pipe", tmp_path / "dst", "--cfg.target_parallel_config.tp_size", "2",
                            "--cfg.target_parallel_config.pp_layers", "[[1,1],[2,2]]", "--cfg.dtype", "bf16")
    assert code == 0 and f"hf_to_mm: wrote {tmp_path / 'dst'}" in out
    shard = torch.load(tmp_path / "dst" / "release" / "mp_rank_01_001" / "model_optim_rng.pt", weights_only=True)
    assert sorted(shard) == ["checkpoint_version", "mm_grpo_layout", "model0", "model1"]
    assert shard["model1"]["final_layer.linear.weight"].dtype == torch.bfloat16
    assert os.path.isdir(src)


# --- MindSpeed-MM's habits: options, in-place conversion, --cfg.hf_dir ------------------------
@pytest.mark.parametrize("sub,extra,pattern", [
    ("hf_to_mm", ["--cfg.lora_path", "lora/"], r"--cfg\.lora_path lora/: FluxConverter converts whole FLUX weights"),
    ("hf_to_mm", ["--cfg.target_parallel_config.ep_size", "2"], r"ep_size 2: FLUX has no experts"),
    ("resplit", ["--cfg.target_parallel_config.ep_size", "4"], r"ep_size 4: FLUX has no experts"),
    ("mm_to_hf", ["--cfg.lora_path", "x"], r"--cfg\.lora_path x: .*LoRA weights are not supported"),
])
def test_what_flux_cannot_do_is_refused_first(capsys, tmp_path, sub, extra, pattern):
    code, _, err = run(capsys, "FluxConverter", sub, "--cfg.source_path", tmp_path / "nope",
                       "--cfg.target_path", tmp_path / "dst", *extra)
    assert_refused(code, err, pattern, tmp_path, tmp_path / "dst")  # before the missing source is noticed


def test_in_place_hf_to_mm_adds_the_megatron_files_beside_the_diffusers_ones(capsys, tmp_path, state_dict):
    """MindSpeed-MM's Wan README converts with target_path == source_path."""
    src = diffusers_folder(tmp_path / "transformer", state_dict)
    before = {n: (src / n).read_bytes() for n in os.listdir(src)}
    code, _, _ = hf_to_mm(capsys, src, src, "--cfg.target_parallel_config.tp_size", "2")
    assert code == 0
    assert sorted(os.listdir(src)) == sorted([*before, "latest_checkpointed_iteration.txt", "release"])
    assert all((src / n).read_bytes() == b for n, b in before.items())  # the diffusers files are untouched
    assert sorted(os.listdir(src / "release")) == ["mp_rank_00", "mp_rank_01"]
    code, _, err = hf_to_mm(capsys, src, src)
    assert code == 1 and err.count("\n") == 1 and "already holds latest_checkpointed_iteration.txt and release" in err
    assert hf_to_mm(capsys, src, src, "--cfg.overwrite", "true")[0] == 0  # TP 2 -> TP 1, in place
    assert sorted(os.listdir(src / "release")) == ["mp_rank_00"]
    assert sorted(os.listdir(src)) == sorted([*before, "latest_checkpointed_iteration.txt", "release"])
    code, _, _ = run(capsys, "FluxConverter", "mm_to_hf", "--cfg.source_path", src, "--cfg.target_path", tmp_path / "hf")
    assert code == 0
    got = load_file(tmp_path / "hf" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(got[k], t) for k, t in state_dict.items())


def test_in_place_failure_leaves_the_source_folder_as_it_was(capsys, tmp_path, state_dict, monkeypatch):
    src = diffusers_folder(tmp_path / "transformer", state_dict)
    before = sorted(os.listdir(src))
    real_write = ShardWriter.write

    def failing_write(self, key, tensor):
        if key[-1].startswith("single_blocks.1."):
            raise OSError("disk full (simulated)")
        real_write(self, key, tensor)

    monkeypatch.setattr(ShardWriter, "write", failing_write)
    code, _, err = hf_to_mm(capsys, src, src)
    assert code == 1 and "disk full (simulated)" in err and sorted(os.listdir(src)) == before


@pytest.mark.parametrize("sub,reason", [
    ("mm_to_hf", "mm_to_hf writes a diffusers folder of its own"),
    ("resplit", "the new layout would replace the folder holding the shards being read"),
])
def test_in_place_mm_to_hf_and_resplit_are_refused_with_the_reason(capsys, tmp_path, state_dict, sub, reason):
    src = diffusers_folder(tmp_path / "src", state_dict)
    assert hf_to_mm(capsys, src, tmp_path / "mm")[0] == 0
    listing = sorted(os.listdir(tmp_path / "mm"))
    code, _, err = run(capsys, "FluxConverter", sub, "--cfg.source_path", tmp_path / "mm",
                       "--cfg.target_path", tmp_path / "mm" / ".")
    assert code == 1 and err.count("\n") == 1 and f"is the source: {reason}" in err
    assert sorted(os.listdir(tmp_path / "mm")) == listing


def test_in_place_into_a_single_file_is_refused(capsys, tmp_path, state_dict):
    from converters.bfl import diffusers_to_bfl
    save_file(diffusers_to_bfl(state_dict, TINY), tmp_path / "flux.safetensors")
    code, _, err = hf_to_mm(capsys, tmp_path / "flux.safetensors", tmp_path / "flux.safetensors", "--cfg.preset", "tiny")
    assert code == 1 and "is the source file: give a folder to create" in err


@pytest.fixture()
def original(tmp_path):
    """A diffusers folder as published: sharded with an index, config.json with diffusers' own fields."""
    ref = random_reference(TINY, seed=4)
    ref.save_pretrained(tmp_path / "original", max_shard_size="60KB")
    return ref, tmp_path / "original"


def test_mm_to_hf_with_hf_dir_keeps_its_config_and_file_split(capsys, tmp_path, original):
    ref, folder = original
    assert hf_to_mm(capsys, folder, tmp_path / "mm", "--cfg.target_parallel_config.pp_layers", "[4,2]")[0] == 0
    code, _, _ = run(capsys, "FluxConverter", "mm_to_hf", "--cfg.source_path", tmp_path / "mm",
                     "--cfg.target_path", tmp_path / "hf", "--cfg.hf_dir", folder)
    assert code == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads((folder / "config.json").read_text())
    index = "diffusion_pytorch_model.safetensors.index.json"
    theirs, ours = (json.loads((f / index).read_text())["weight_map"] for f in (folder, tmp_path / "hf"))
    assert ours == theirs and len(set(ours.values())) > 1
    assert sorted(os.listdir(tmp_path / "hf")) == sorted(os.listdir(folder))
    from diffusers import FluxTransformer2DModel
    got = FluxTransformer2DModel.from_pretrained(tmp_path / "hf").state_dict()
    assert all(torch.equal(got[k], t) for k, t in ref.state_dict().items())


def test_mm_to_hf_hf_dir_must_describe_the_checkpoint(capsys, tmp_path, original, state_dict):
    _, folder = original
    assert hf_to_mm(capsys, diffusers_folder(tmp_path / "src", state_dict), tmp_path / "mm")[0] == 0
    other = diffusers_folder(tmp_path / "schnell", {}, TINY.replace(guidance_embeds=False))
    code, _, err = run(capsys, "FluxConverter", "mm_to_hf", "--cfg.source_path", tmp_path / "mm",
                       "--cfg.target_path", tmp_path / "hf", "--cfg.hf_dir", other)
    assert_refused(code, err, r"another FLUX architecture than .*schnell's config\.json: guidance_embeds True "
                              r"\(hf_dir: False\)", tmp_path, tmp_path / "hf")
    code, _, err = run(capsys, "FluxConverter", "mm_to_hf", "--cfg.source_path", tmp_path / "mm",
                       "--cfg.target_path", tmp_path / "hf", "--cfg.hf_dir", folder, "--cfg.max_shard_size", "1GB")
    assert_refused(code, err, r"--cfg\.max_shard_size 1GB and --cfg\.hf_dir .*whose index fixes the file split",
                   tmp_path, tmp_path / "hf")


# --- one mm-convert ---------------------------------------------------------------------------
def cli_process(*args, pythonpath=""):
    """`python -m converters.convert_cli ARGS` in a fresh process (the console script's code), with
    the environment's PYTHONPATH (Megatron-LM's tree in MindSpeed-MM's) but not MindSpeed-MM's."""
    from tests.testbed import STANDIN_DIR, TESTBED_PATHS
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p not in (STANDIN_DIR, *TESTBED_PATHS)]
    env = dict(os.environ, PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, pythonpath, *inherited])))
    return subprocess.run([sys.executable, "-m", "converters.convert_cli", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, env=env)


def test_without_mindspeed_mm_flux_converter_alone():
    proc = cli_process("--help")
    assert proc.returncode == 0 and "FluxConverter" in proc.stdout
    assert "WanConverter" not in proc.stdout and "MindSpeed-MM" not in proc.stderr


def test_a_broken_mindspeed_mm_is_reported_and_flux_converter_still_runs(tmp_path, state_dict):
    """A `checkpoint` package that fails inside (a dependency missing) is not silently dropped."""
    (tmp_path / "checkpoint" / "common").mkdir(parents=True)
    (tmp_path / "checkpoint" / "__init__.py").write_text("")
    (tmp_path / "checkpoint" / "common" / "__init__.py").write_text("")
    (tmp_path / "checkpoint" / "common" / "converter.py").write_text("import pydantic_missing_here\n")
    src = diffusers_folder(tmp_path / "src", state_dict)
    proc = cli_process("FluxConverter", "hf_to_mm", "--cfg.source_path", src, "--cfg.target_path", tmp_path / "mm",
                       pythonpath=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    warning = [line for line in proc.stderr.splitlines() if "MindSpeed-MM" in line]
    assert warning == ["mm-convert: MindSpeed-MM's converters did not import (ModuleNotFoundError: No module named "
                       "'pydantic_missing_here'): FluxConverter only"]
    assert (tmp_path / "mm" / "release" / "mp_rank_00" / "model_optim_rng.pt").is_file()


# --- help ----------------------------------------------------------------------------------
SUBCOMMANDS = {"hf_to_mm": flux.HfToMmConfig, "mm_to_hf": flux.MmToHfConfig, "resplit": flux.ResplitConfig}


def options(config_class, prefix="--cfg."):
    for field in dataclasses.fields(config_class):
        if dataclasses.is_dataclass(field.type):
            yield from options(field.type, f"{prefix}{field.name}.")
        else:
            yield prefix + field.name


def help_text(capsys, *args):
    code, out, _ = run(capsys, *args, "--help")
    assert code == 0
    return " ".join(out.split())  # undo argparse's line wrapping


def test_help_lists_commands_and_every_option(capsys):
    assert "FluxConverter" in help_text(capsys)
    group = help_text(capsys, "FluxConverter")
    assert all(sub in group for sub in SUBCOMMANDS)
    for sub, config_class in SUBCOMMANDS.items():
        text = help_text(capsys, "FluxConverter", sub)
        missing = [o for o in options(config_class) if o not in text]
        assert not missing, f"{sub} --help lacks {missing}"


# What each option's help must say (the docstrings jsonargparse shows).
EXPLAINED = {
    "--cfg.source_path": "whole FLUX pipeline folder", "--cfg.target_path": "folder to create",
    "--cfg.target_parallel_config.tp_size": "must divide the number of attention heads",
    "--cfg.target_parallel_config.pp_layers": "nested list [[..],[..]] gives virtual pipeline chunks",
    "--cfg.hf_dir": "whose config.json describes the model", "--cfg.preset": "Built-in model config",
    "--cfg.target_parallel_config.ep_size": "FLUX has no experts", "--cfg.lora_path": "whole weights only",
    "--cfg.dtype": "keep the source dtype", "--cfg.overwrite": "Replace target_path",
    "--cfg.iteration": "latest_checkpointed_iteration.txt names", "--cfg.max_shard_size": "Largest safetensors file",
}
EXPLAINED_BY_SUBCOMMAND = {
    "hf_to_mm": EXPLAINED,
    "mm_to_hf": {**EXPLAINED, "--cfg.source_path": "Megatron checkpoint folder",
                 "--cfg.target_path": "FluxTransformer2DModel.from_pretrained loads",
                 "--cfg.hf_dir": "as MindSpeed-MM's converters take it",
                 "--cfg.weights": "the weights the held-out evaluation scores"},
    "resplit": {**EXPLAINED, "--cfg.source_path": "Megatron checkpoint folder", "--cfg.target_path": "new layout"},
}


def test_help_explains_every_option(capsys):
    pytest.importorskip("docstring_parser", reason="jsonargparse shows docstrings only with docstring-parser")
    for sub, config_class in SUBCOMMANDS.items():
        text = help_text(capsys, "FluxConverter", sub).split("Show this help message")[1]
        entries = {}  # option -> its help entry ("--cfg.x X  description (type: ...)")
        for entry in re.split(r" (?=--cfg\.)", text):
            entries[entry.split()[0].rstrip(",+")] = entry
        for option in options(config_class):
            assert EXPLAINED_BY_SUBCOMMAND[sub][option] in entries[option], f"{sub} {option}: {entries[option]}"
