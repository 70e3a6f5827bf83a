"""mm-grpo reads FLUX checkpoints that Megatron saved, which carry no mm-grpo metadata: the layout
is inferred from the shards and their saved args (mm_grpo/families/flux/checkpoint/metadata.py).

The writer (tests/megatron_save.py) is Megatron-LM's own save_checkpoint where megatron.training
exists (MindSpeed-MM's environment, core_v0.12.1) and the legacy `--ckpt-format torch` tree with
megatron-core's state_dict_for_save_checkpoint elsewhere (the 0.16.1 wheel has no writer).
Multi-rank layouts (TP 2 x PP 2, PP 2 x 2 virtual chunks): tests/distributed/checks_convert.py.
"""
import argparse
import os
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file

from converters.convert_cli import main
from mm_grpo.checkpoint import iteration_dir
from mm_grpo.checkpoint.paths import META_KEY
from mm_grpo.families.flux.checkpoint import CheckpointMeta, load_megatron_checkpoint
from mm_grpo.families.flux.transformer import FluxConfig, FluxTransformer
from mm_grpo.families.flux.transformer.hf_weights import load_hf_weights
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.megatron_save import HAS_MEGATRON_TRAINING, legacy_args, legacy_save, megatron_save
from tests.utils import assert_one_line_error, random_reference, run_main

TINY = FluxConfig.preset("tiny")  # axes_dims_rope (4, 6, 6): not FLUX.1's, so it cannot be guessed


def cli(capsys, *args):
    code, _, err = run_main(main, capsys, *args)
    return code, err


@pytest.fixture(scope="module")
def reference():
    return random_reference(TINY, seed=11)


@pytest.fixture(scope="module")
def saved(parallel_1proc, reference, tmp_path_factory):
    """(checkpoint root, the model that was saved, which writer saved it)."""
    model = FluxTransformer(TINY)
    load_hf_weights(model, reference.state_dict())
    root = tmp_path_factory.mktemp("megatron_saved")
    writer = megatron_save(root, 20, [model])
    return root, model, writer


@pytest.fixture(scope="module")
def hf_dir(reference, tmp_path_factory):
    folder = tmp_path_factory.mktemp("original") / "transformer"
    reference.save_pretrained(folder)
    return folder


def test_the_writer_is_megatrons_own_where_it_exists(saved):
    assert saved[2].startswith("megatron.training" if HAS_MEGATRON_TRAINING else "legacy tree")
    tree = torch.load(saved[0] / "iter_0000020" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert META_KEY not in tree and {"args", "model", "iteration", "rng_state"} <= set(tree)


def test_layout_is_inferred_from_the_shards(saved):
    meta = CheckpointMeta.load(iteration_dir(saved[0]), TINY)
    assert (meta.tp_size, meta.pp_layers, meta.dtype) == (1, [6], "float32") and meta.config == TINY


def test_loader_reads_it_into_a_model(saved):
    fresh = FluxTransformer(TINY)
    load_megatron_checkpoint(fresh, str(saved[0]))
    want = dict(saved[1].named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in fresh.named_parameters())


def test_what_the_weights_cannot_tell_is_said_in_one_line(saved, capsys, tmp_path):
    assert_one_line_error(lambda: CheckpointMeta.load(iteration_dir(saved[0])),
                          r"has no mm-grpo metadata and cannot tell axes_dims_rope \(RoPE has no weights")
    code, err = cli(capsys, "FluxConverter", "mm_to_hf", "--cfg.source_path", saved[0], "--cfg.target_path", tmp_path / "hf")
    assert code == 1 and err.count("\n") == 1 and "--cfg.hf_dir" in err and not (tmp_path / "hf").exists()


def test_mm_to_hf_with_hf_dir_is_bit_exact(saved, reference, hf_dir, capsys, tmp_path):
    code, err = cli(capsys, "FluxConverter", "mm_to_hf", "--cfg.source_path", saved[0], "--cfg.target_path",
                    tmp_path / "hf", "--cfg.hf_dir", hf_dir)
    assert code == 0, err
    got = load_file(tmp_path / "hf" / "diffusion_pytorch_model.safetensors")
    assert set(got) == set(reference.state_dict())
    assert all(torch.equal(got[k], t) for k, t in reference.state_dict().items())


def test_resplit_gives_a_checkpoint_with_metadata(saved, reference, hf_dir, capsys, tmp_path):
    assert cli(capsys, "FluxConverter", "resplit", "--cfg.source_path", saved[0], "--cfg.target_path", tmp_path / "tp2",
               "--cfg.target_parallel_config.tp_size", "2", "--cfg.hf_dir", hf_dir)[0] == 0
    assert cli(capsys, "FluxConverter", "mm_to_hf", "--cfg.source_path", tmp_path / "tp2",
               "--cfg.target_path", tmp_path / "hf")[0] == 0  # no hf_dir needed any more
    got = load_file(tmp_path / "hf" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(got[k], t) for k, t in reference.state_dict().items())


def test_another_architecture_than_the_models_is_refused(saved):
    schnell = FluxTransformer(TINY.replace(guidance_embeds=False))
    assert_one_line_error(lambda: load_megatron_checkpoint(schnell, str(saved[0])),
                          r"holds another FLUX architecture than the config given: guidance_embeds True \(given False\)")


def test_shards_missing_or_disagreeing_with_the_args_are_refused(saved, tmp_path):
    folder = tmp_path / "iter_0000020"
    shutil.copytree(iteration_dir(saved[0]), folder)
    shutil.copytree(folder / "mp_rank_00", folder / "mp_rank_01")  # a stray shard: the args say TP 1
    assert_one_line_error(lambda: CheckpointMeta.load(str(folder), TINY),
                          r"the saved args say tensor_model_parallel_size = 1, the shards hold 2: incomplete")
    shutil.rmtree(folder / "mp_rank_00")
    assert_one_line_error(lambda: CheckpointMeta.load(str(folder), TINY),
                          r"has no first shard \(mp_rank_00 or mp_rank_00_000\)", FileNotFoundError)


def test_a_checkpoint_of_another_model_is_named_as_such(parallel_1proc, tmp_path):
    other = torch.nn.Linear(3, 4)
    other.state_dict_for_save_checkpoint = other.state_dict
    legacy_save(tmp_path, 1, [other])
    assert_one_line_error(lambda: CheckpointMeta.load(iteration_dir(str(tmp_path)), TINY),
                          r"the first model chunk has no x_embedder\.weight: not a checkpoint of mm-grpo's FLUX model")


def test_the_rope_of_a_mindspeed_mm_run_comes_from_its_saved_predictor_block(parallel_1proc, reference, tmp_path,
                                                                             monkeypatch):
    """MindSpeed-MM keeps model.json in args.mm (objects of its own classes, read as stand-ins);
    the flux predictor block names axes_dims_rope. The real MindSpeed-MM classes:
    tests/test_mindspeed_mm_checkpoint.py."""
    (tmp_path / "mm_config_like.py").write_text(
        "class ConfigReader:\n    def __init__(self, d):\n"
        "        self.__dict__.update({k: ConfigReader(v) if isinstance(v, dict) else v for k, v in d.items()})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import mm_config_like
    block = {"model_id": "flux", **TINY.to_diffusers_config()}
    args = argparse.Namespace(**vars(legacy_args()), mm=mm_config_like.ConfigReader({"model": {"predictor": block}}))
    model = FluxTransformer(TINY)
    load_hf_weights(model, reference.state_dict())
    legacy_save(tmp_path / "ckpt", 3, [model], args)
    monkeypatch.delitem(sys.modules, "mm_config_like")
    os.remove(tmp_path / "mm_config_like.py")
    assert CheckpointMeta.load(iteration_dir(str(tmp_path / "ckpt"))).config == TINY
