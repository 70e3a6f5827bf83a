"""One `mm-convert` and one checkpoint format with the real MindSpeed-MM and Megatron-LM (the
testbed, tests/testbed.py): MindSpeed-MM's `load_from_mm` and Megatron-LM's `load_checkpoint`
read what hf_to_mm writes; mm-grpo reads what Megatron-LM's `save_checkpoint` writes for a
MindSpeed-MM run; `mm-convert` lists and runs FluxConverter beside MindSpeed-MM's converters.

CLI processes get MindSpeed-MM on PYTHONPATH the way its users have it, without the stand-ins'
sitecustomize: mm-convert imports nothing CANN-bound, and the stand-in of MindSpeed's Megatron
adaptor that sitecustomize imports parses the command line at import (it exits on `--help`).
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from converters import mindspeed_mm
from converters.convert_cli import main
from converters.flux import FluxConverter
from mm_grpo.checkpoint import ShardReader
from mm_grpo.checkpoint.paths import META_KEY
from mm_grpo.families.flux.checkpoint import load_megatron_checkpoint
from mm_grpo.families.flux.transformer import FluxConfig, FluxTransformer
from mm_grpo.families.flux.transformer.hf_weights import load_hf_weights
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.testbed import REPO, TESTBED_PATHS, require_testbed
from tests.utils import random_reference

pytestmark = pytest.mark.mindspeed_mm
TINY = FluxConfig.preset("tiny")
LAYOUTS = {"tp1": (1, None), "tp2": (2, None), "tp2-pp2": (2, [2, 4]), "tp2-pp2-vpp2": (2, [[1, 2], [2, 1]])}


@pytest.fixture(scope="module", autouse=True)
def testbed():
    require_testbed(needs_megatron_training=True)


@pytest.fixture(scope="module")
def reference():
    return random_reference(TINY, seed=17)


@pytest.fixture(scope="module")
def hf_dir(reference, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "transformer"
    reference.save_pretrained(folder)
    return folder


def convert(*args):
    main(["FluxConverter", *map(str, args)])


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("mm")
    for name, (tp, pp) in LAYOUTS.items():
        convert("hf_to_mm", "--cfg.source_path", hf_dir, "--cfg.target_path", root / name,
                "--cfg.target_parallel_config.tp_size", tp,
                *(["--cfg.target_parallel_config.pp_layers", json.dumps(pp)] if pp else []))
    return {name: root / name for name in LAYOUTS}


def our_chunks(shard_path):
    """A shard's model chunks as mm-grpo's reader reads them: [state dict per virtual chunk]."""
    reader = ShardReader(str(shard_path))
    tree = reader.load()
    reader.close()
    keys = ["model"] if "model" in tree else sorted(k for k in tree if k.startswith("model"))
    return [tree[k] for k in keys]


# --- MindSpeed-MM's load_from_mm ---------------------------------------------------------------
@pytest.mark.parametrize("name", LAYOUTS)
def test_load_from_mm_reads_hf_to_mm_output(converted, name):
    from checkpoint.sora_model.convert_utils.save_load_utils import load_from_mm
    tp_size, pp_layers = LAYOUTS[name]
    pp_size = 1 if pp_layers is None else len(pp_layers[0] if isinstance(pp_layers[0], list) else pp_layers)
    state_dicts = load_from_mm(str(converted[name]))  # [pp][tp]: a dict, or (PP) a list per virtual chunk
    assert len(state_dicts) == pp_size and all(len(row) == tp_size for row in state_dicts)
    for pp in range(pp_size):
        for tp in range(tp_size):
            folder = f"mp_rank_{tp:02d}" if pp_size == 1 else f"mp_rank_{tp:02d}_{pp:03d}"
            ours = our_chunks(converted[name] / "release" / folder / "model_optim_rng.pt")
            theirs = state_dicts[pp][tp] if pp_size > 1 else [state_dicts[pp][tp]]
            assert len(theirs) == len(ours)
            for mine, got in zip(ours, theirs):
                assert set(got) == set(mine) and len(mine) > 0
                assert all(torch.equal(got[k], t) for k, t in mine.items()), (name, pp, tp)


# --- Megatron-LM's load_checkpoint (--load) and save_checkpoint --------------------------------
def test_megatron_load_reads_hf_to_mm_output(parallel_1proc, converted, tmp_path):
    from megatron.training.global_vars import set_args
    from tests.megatron_save import cuda_on_cpu, megatron_args
    args = megatron_args(tmp_path)
    args.load = str(converted["tp1"])
    set_args(args)
    model = FluxTransformer(TINY)
    with cuda_on_cpu() as checkpointing:
        iteration, _ = checkpointing.load_checkpoint([model], None, None, strict=True)
    assert iteration == 0  # a release checkpoint
    ours = FluxTransformer(TINY)
    load_megatron_checkpoint(ours, str(converted["tp1"]))
    want = dict(ours.named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in model.named_parameters())


def test_a_mindspeed_mm_run_checkpoint_reads_without_hf_dir(parallel_1proc, reference, tmp_path):
    """pretrain_sora's args carry model.json as MindSpeed-MM's MMConfig; its flux predictor block
    gives what the weights cannot (axes_dims_rope)."""
    from tests.megatron_save import real_save
    block = {"model_id": "flux", "dtype": "fp32", **TINY.to_diffusers_config()}
    (tmp_path / "model.json").write_text(json.dumps({"predictor": block}))
    model = FluxTransformer(TINY)
    load_hf_weights(model, reference.state_dict())
    real_save(tmp_path / "ckpt", 7, [model], mm_model=tmp_path / "model.json")
    tree = torch.load(tmp_path / "ckpt" / "iter_0000007" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert type(tree["args"].mm).__name__ == "MMConfig" and META_KEY not in tree
    convert("mm_to_hf", "--cfg.source_path", tmp_path / "ckpt", "--cfg.target_path", tmp_path / "hf")
    got = load_file(tmp_path / "hf" / "diffusion_pytorch_model.safetensors")
    assert set(got) == set(reference.state_dict())
    assert all(torch.equal(got[k], t) for k, t in reference.state_dict().items())


def test_the_legacy_tree_is_what_megatron_writes(parallel_1proc, tmp_path):
    """tests/megatron_save.py's writer for the megatron-core wheel against Megatron-LM's own."""
    from tests.megatron_save import legacy_save, real_save
    model = FluxTransformer(TINY)
    real_save(tmp_path / "real", 5, [model])
    legacy_save(tmp_path / "legacy", 5, [model])
    real, legacy = (torch.load(tmp_path / w / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
                    for w in ("real", "legacy"))
    assert set(real) == set(legacy) and type(real["args"]) is type(legacy["args"])
    assert set(real["model"]) == set(legacy["model"])  # _extra_state entries included
    assert all(torch.equal(t, legacy["model"][k]) for k, t in real["model"].items() if torch.is_tensor(t))
    assert set(real["rng_state"][0]) == set(legacy["rng_state"][0])
    assert (tmp_path / "legacy" / "latest_checkpointed_iteration.txt").read_text() == "5"


# --- one mm-convert --------------------------------------------------------------------------------
def test_flux_converter_is_a_mindspeed_mm_converter():
    from checkpoint.common.converter import Commandable, Converter
    assert mindspeed_mm.AVAILABLE and issubclass(FluxConverter, Converter)
    assert FluxConverter in Commandable.subclasses


def test_help_lists_flux_converter_beside_every_mindspeed_mm_converter(capsys):
    from checkpoint.common.converter import Commandable
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    names = [c.__name__ for c in Commandable.subclasses]
    assert "FluxConverter" in names and "WanConverter" in names and len(names) > 20
    assert all(name in out for name in names)


def cli_env():
    paths = [REPO, *TESTBED_PATHS, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)))


def run(command, *args):
    return subprocess.run([*command, *map(str, args)], cwd=REPO, capture_output=True, text=True, env=cli_env())


MM_CONVERT = [os.path.join(os.path.dirname(sys.executable), "mm-convert")]  # mm-grpo's console script


def test_the_console_script_lists_both_families():
    proc = run(MM_CONVERT, "--help")
    assert proc.returncode == 0, proc.stderr
    assert all(n in proc.stdout for n in ("FluxConverter", "WanConverter", "Qwen2_5_VLConverter", "HunyuanVideoConverter"))


def test_a_mindspeed_mm_converter_still_runs(tmp_path):
    """WanConverter hf_to_mm through mm-grpo's mm-convert on a tiny random Wan state dict."""
    torch.manual_seed(0)
    wan = {"condition_embedder.time_proj.weight": torch.randn(6, 4), "scale_shift_table": torch.randn(1, 2, 4),
           "blocks.0.attn1.to_q.weight": torch.randn(4, 4), "blocks.0.ffn.net.0.proj.bias": torch.randn(8),
           "blocks.0.scale_shift_table": torch.randn(1, 6, 4), "patch_embedding.weight": torch.randn(4, 2, 1, 1, 1)}
    (tmp_path / "wan").mkdir()
    save_file(wan, tmp_path / "wan" / "diffusion_pytorch_model.safetensors")
    proc = run(MM_CONVERT, "WanConverter", "hf_to_mm", "--cfg.source_path", tmp_path / "wan",
               "--cfg.target_path", tmp_path / "mm", "--cfg.target_parallel_config.tp_size", "1")
    assert proc.returncode == 0, proc.stderr
    got = torch.load(tmp_path / "mm" / "release" / "mp_rank_00" / "model_optim_rng.pt", weights_only=True)["model"]
    renamed = {"time_projection.1.weight": "condition_embedder.time_proj.weight", "head.modulation": "scale_shift_table",
               "blocks.0.self_attn.proj_q.weight": "blocks.0.attn1.to_q.weight",
               "blocks.0.ffn.0.bias": "blocks.0.ffn.net.0.proj.bias", "blocks.0.modulation": "blocks.0.scale_shift_table",
               "patch_embedding.weight": "patch_embedding.weight"}
    assert set(got) == set(renamed) and all(torch.equal(got[k], wan[v]) for k, v in renamed.items())


def test_mindspeed_mm_own_cli_lists_and_runs_flux_converter_once_converters_are_imported(hf_dir, tmp_path,
                                                                                          monkeypatch, capsys):
    """checkpoint/convert_cli.py's main(), unchanged, in this process (which imported converters)."""
    from checkpoint.convert_cli import main as mindspeed_mm_main
    monkeypatch.setattr(sys, "argv", ["mm-convert", "--help"])
    with pytest.raises(SystemExit):
        mindspeed_mm_main()
    assert "FluxConverter" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["mm-convert", "FluxConverter", "hf_to_mm", "--cfg.source_path", str(hf_dir),
                                      "--cfg.target_path", str(tmp_path / "mm"), "--cfg.target_parallel_config.tp_size", "2"])
    mindspeed_mm_main()
    assert sorted(os.listdir(tmp_path / "mm" / "release")) == ["mp_rank_00", "mp_rank_01"]
