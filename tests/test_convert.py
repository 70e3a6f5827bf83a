"""mm-convert FluxConverter and the Megatron checkpoint layout (tiny FLUX, CPU, single process).

References are independent of the converter: diffusers' FluxTransformer2DModel (its weights
and forward), diffusers' own single-file converter, and plain `torch.load`.
"""
import argparse
import json
import os
import sys
import types

import numpy as np

import pytest
import torch
from diffusers import FluxTransformer2DModel
from diffusers.loaders import single_file_utils
from safetensors.torch import load_file, save_file

from converters.bfl import diffusers_to_bfl
from converters.convert_cli import main
from mm_grpo.checkpoint import CheckpointWriter, ShardReader, ShardWriter, write_shard
from mm_grpo.checkpoint.paths import META_KEY
from mm_grpo.checkpoint.shard_io import Opaque, tensor_leaves
from mm_grpo.families.flux.checkpoint import CheckpointMeta, MegatronCheckpoint, load_megatron_checkpoint
from mm_grpo.families.flux.transformer import FluxConfig, FluxTransformer
from mm_grpo.parallel.pipeline_layout import stage_specs
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.utils import make_inputs, random_reference, reference_output, rel_err

TINY = FluxConfig.preset("tiny")  # 4 heads, D = 64, 2 double + 4 single blocks
TOL = 1e-5
LAYOUTS = {  # id: (tp_size, pp_layers)
    "tp1": (1, None),
    "tp2-pp2": (2, [2, 4]),
    "tp4-pp4": (4, [1, 2, 1, 2]),
    "tp2-vpp2x2": (2, [[1, 2], [2, 1]]),
    "tp1-vpp2x1": (1, [[3], [3]]),
}


def convert(command, source, target, tp=None, pp_layers=None, *extra):
    args = ["FluxConverter", command, "--cfg.source_path", str(source), "--cfg.target_path", str(target)]
    if tp is not None:
        args += ["--cfg.target_parallel_config.tp_size", str(tp)]
    if pp_layers is not None:
        args += ["--cfg.target_parallel_config.pp_layers", json.dumps(pp_layers)]
    main(args + list(extra))
    return target


@pytest.fixture(scope="module")
def reference():
    return random_reference(TINY, seed=21)


@pytest.fixture(scope="module")
def hf_dir(reference, tmp_path_factory):
    """A sharded diffusers folder (index + several files) inside a pipeline folder."""
    pipe = tmp_path_factory.mktemp("pipe")
    reference.save_pretrained(pipe / "transformer", max_shard_size="100KB")
    assert (pipe / "transformer" / "diffusion_pytorch_model.safetensors.index.json").exists()
    return pipe / "transformer"


@pytest.fixture(scope="module")
def mm_dirs(hf_dir, tmp_path_factory):
    """hf_to_mm output for every layout in LAYOUTS."""
    root = tmp_path_factory.mktemp("mm")
    return {name: convert("hf_to_mm", hf_dir, root / name, tp, pp) for name, (tp, pp) in LAYOUTS.items()}


def shard_tensors(root):
    """Every tensor of every shard file, read with plain torch.load: {(shard, key path): tensor}."""
    out = {}
    release = root / "release"
    for shard in sorted(os.listdir(release)):
        if not shard.startswith("mp_rank_"):
            continue
        tree = torch.load(release / shard / "model_optim_rng.pt", weights_only=True)
        assert tree["checkpoint_version"] == 3.0
        for key, value in tree.items():
            if key.startswith("model"):
                out.update({(shard, key, name): t for name, t in value.items()})
    return out


# --- round trip and layout -----------------------------------------------------------------
@pytest.mark.parametrize("name", LAYOUTS)
def test_hf_mm_hf_round_trip_is_bit_exact_and_loads_in_diffusers(name, reference, mm_dirs, tmp_path):
    out = convert("mm_to_hf", mm_dirs[name], tmp_path / "hf", None, None, "--cfg.max_shard_size", "100KB")
    assert (out / "diffusion_pytorch_model.safetensors.index.json").exists()
    loaded = FluxTransformer2DModel.from_pretrained(out)
    expected = reference.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(expected)
    for key, tensor in expected.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
    inputs = make_inputs(TINY)
    with torch.no_grad():
        assert torch.equal(reference_output(loaded, inputs), reference_output(reference, inputs))


def layout_of(root):
    """mm-grpo's metadata as the first shard stores it."""
    folder = root / "release" / sorted(os.listdir(root / "release"))[0]
    return torch.load(folder / "model_optim_rng.pt", weights_only=True)[META_KEY]


def test_layout_on_disk(mm_dirs):
    root = mm_dirs["tp2-vpp2x2"]
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert sorted(os.listdir(root / "release")) == [  # nothing but shard folders (MindSpeed-MM lists them)
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    meta = layout_of(root)
    assert meta["parallel"] == {"tp_size": 2, "pp_size": 2, "vpp_size": 2, "pp_layers": [[1, 2], [2, 1]]}
    assert FluxConfig.from_diffusers_config(meta["config"]) == TINY
    stage0 = torch.load(root / "release" / "mp_rank_01_000" / "model_optim_rng.pt", weights_only=True)
    assert sorted(stage0) == ["checkpoint_version", META_KEY, "model0", "model1"]
    assert stage0[META_KEY] == meta  # in every shard
    # chunk 1 of stage 0 holds global blocks 3-4 = single blocks 1-2, numbered locally from 0
    assert {n.split(".")[0] + "." + n.split(".")[1] for n in stage0["model1"]} == {"single_blocks.0", "single_blocks.1"}
    assert "x_embedder.weight" in stage0["model0"] and "final_layer.linear.weight" not in stage0["model0"]
    assert stage0["model0"]["double_blocks.0.img_attn.linear_qkv.weight"].shape == (3 * 64 // 2, 64)
    assert sorted(os.listdir(mm_dirs["tp1-vpp2x1"] / "release")) == ["mp_rank_00"]


def test_pp_shards_alias_model0_to_model_without_storing_it_twice(mm_dirs, tmp_path):
    """PP > 1 without virtual chunks: Megatron's --load reads `model`, MindSpeed-MM's load_from_mm
    only `model<N>`; both keys name one dict, pickled once."""
    shard = mm_dirs["tp2-pp2"] / "release" / "mp_rank_01_001" / "model_optim_rng.pt"
    tree = torch.load(shard, weights_only=True)
    assert sorted(tree) == ["checkpoint_version", META_KEY, "model", "model0"] and tree["model0"] is tree["model"]
    torch.save({k: v for k, v in tree.items() if k != "model0"}, tmp_path / "without_alias.pt")
    assert abs(os.path.getsize(shard) - os.path.getsize(tmp_path / "without_alias.pt")) < 1024
    single = torch.load(mm_dirs["tp1"] / "release" / "mp_rank_00" / "model_optim_rng.pt", weights_only=True)
    assert "model0" not in single  # PP = 1: Megatron and load_from_mm both read `model`


def test_shard_names_are_the_models_own(parallel_1proc, mm_dirs):
    """Each model chunk's keys are exactly its Megatron module's parameter names."""
    root = mm_dirs["tp1-vpp2x1"]
    tree = torch.load(root / "release" / "mp_rank_00" / "model_optim_rng.pt", weights_only=True)
    for (_, v), spec in stage_specs([[3], [3]], TINY.num_blocks).items():
        chunk = FluxTransformer(TINY, pre_process=spec.pre_process, post_process=spec.post_process,
                                block_range=spec.block_range)
        assert set(tree[f"model{v}"]) == set(dict(chunk.named_parameters()))


def test_plain_load_state_dict_of_a_tp1_shard_matches_diffusers(parallel_1proc, reference, mm_dirs):
    """Without our loader: Megatron-style `model.load_state_dict(ckpt['model'])`."""
    model = FluxTransformer(TINY)
    state = torch.load(mm_dirs["tp1"] / "release" / "mp_rank_00" / "model_optim_rng.pt", weights_only=True)
    model.load_state_dict(state["model"], strict=True)
    inputs = make_inputs(TINY, batch=2, height=3, width=5, txt_len=6)
    with torch.no_grad():
        assert rel_err(model(**inputs), reference_output(reference, inputs)) <= TOL


# --- resplit ---------------------------------------------------------------------------------
@pytest.mark.parametrize("src,dst", [("tp1", "tp2-vpp2x2"), ("tp4-pp4", "tp2-pp2"), ("tp2-vpp2x2", "tp1-vpp2x1"),
                                     ("tp2-pp2", "tp4-pp4")])
def test_resplit_equals_direct_conversion(src, dst, mm_dirs, tmp_path):
    tp, pp = LAYOUTS[dst]
    out = convert("resplit", mm_dirs[src], tmp_path / "resplit", tp, pp)
    direct, resplit = shard_tensors(mm_dirs[dst]), shard_tensors(out)
    assert set(resplit) == set(direct)
    for key, tensor in direct.items():
        assert torch.equal(resplit[key], tensor), key
    assert layout_of(out) == layout_of(mm_dirs[dst])


def test_dtype_cast(reference, hf_dir, tmp_path):
    mm = convert("hf_to_mm", hf_dir, tmp_path / "mm", 2, [3, 3], "--cfg.dtype", "bf16")
    assert all(t.dtype == torch.bfloat16 for t in shard_tensors(mm).values())
    assert layout_of(mm)["dtype"] == "bfloat16"
    hf = convert("mm_to_hf", mm, tmp_path / "hf")  # keeps bf16
    got = load_file(hf / "diffusion_pytorch_model.safetensors")
    for key, tensor in reference.state_dict().items():
        assert torch.equal(got[key], tensor.to(torch.bfloat16)), key
    hf32 = convert("mm_to_hf", mm, tmp_path / "hf32", None, None, "--cfg.dtype", "fp32")
    assert load_file(hf32 / "diffusion_pytorch_model.safetensors")["proj_out.weight"].dtype == torch.float32


# --- original (BFL) single file ----------------------------------------------------------------
def diffusers_converter(bfl_state_dict, hidden_size):
    """diffusers' `convert_flux_transformer_checkpoint_to_diffusers`, with its FLUX.1 width
    (`inner_dim = 3072`, hard-coded, used to split linear1) set to the tiny model's."""
    fn = single_file_utils.convert_flux_transformer_checkpoint_to_diffusers
    consts = fn.__code__.co_consts
    assert consts.count(3072) == 1
    code = fn.__code__.replace(co_consts=tuple(hidden_size if c == 3072 else c for c in consts))
    return types.FunctionType(code, fn.__globals__)(dict(bfl_state_dict))


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
@pytest.mark.parametrize("guidance", [True, False], ids=["dev", "schnell"])
def test_single_file_gives_what_diffusers_converter_gives(prefix, guidance, tmp_path):
    config = TINY.replace(guidance_embeds=guidance)
    ref = random_reference(config, seed=5).state_dict()
    bfl = diffusers_to_bfl(ref, config, prefix)
    if prefix:  # a full checkpoint also carries other components: ignored
        bfl["first_stage_model.decoder.conv_in.weight"] = torch.zeros(3)
    oracle = diffusers_converter(bfl, config.hidden_size)
    assert set(oracle) == set(ref) and all(torch.equal(oracle[k], ref[k]) for k in ref)  # inverse is right
    save_file(bfl, tmp_path / "flux1-tiny.safetensors")
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(config.to_diffusers_config()))
    mm = convert("hf_to_mm", tmp_path / "flux1-tiny.safetensors", tmp_path / "mm", 2, [4, 2],
                 "--cfg.hf_dir", str(tmp_path / "cfg"))
    hf = convert("mm_to_hf", mm, tmp_path / "hf")
    got = load_file(hf / "diffusion_pytorch_model.safetensors")
    assert set(got) == set(oracle)
    for key, tensor in oracle.items():
        assert torch.equal(got[key], tensor), key


def test_single_file_with_a_preset(tmp_path):
    ref = random_reference(TINY, seed=8)
    save_file(diffusers_to_bfl(ref.state_dict(), TINY), tmp_path / "flux.safetensors")
    mm = convert("hf_to_mm", tmp_path / "flux.safetensors", tmp_path / "mm", 4, None, "--cfg.preset", "tiny")
    hf = convert("mm_to_hf", mm, tmp_path / "hf")
    got = FluxTransformer2DModel.from_pretrained(hf).state_dict()
    assert all(torch.equal(got[k], t) for k, t in ref.state_dict().items())


# --- MindSpeed-MM's FLUX DanceGRPO checkpoints --------------------------------------------------
def test_dancegrpo_checkpoint_converts(reference, hf_dir, tmp_path):
    """MindSpeed-MM's DanceGRPO (mindspeed_mm/tasks/rl/soragrpo/sora_grpo_trainer.py save_checkpoint)
    writes `checkpoint-<step>-<epoch>/`: save_file(transformer.state_dict()) as
    diffusion_pytorch_model.safetensors and json.dump(dict(transformer.config)) without "dtype"."""
    transformer = FluxTransformer2DModel.from_pretrained(str(hf_dir.parent), subfolder="transformer",
                                                         torch_dtype=torch.float32)  # as flux_grpo_model.py loads it
    save_dir = tmp_path / "save_dir" / "checkpoint-300-0"
    save_dir.mkdir(parents=True)
    save_file(transformer.state_dict(), save_dir / "diffusion_pytorch_model.safetensors")
    config_dict = dict(transformer.config)
    config_dict.pop("dtype", None)
    (save_dir / "config.json").write_text(json.dumps(config_dict, indent=4))
    mm = convert("hf_to_mm", save_dir, tmp_path / "mm", 2, [3, 3])
    got = load_file(convert("mm_to_hf", mm, tmp_path / "hf") / "diffusion_pytorch_model.safetensors")
    assert set(got) == set(reference.state_dict())
    assert all(torch.equal(got[k], t) for k, t in reference.state_dict().items())


# --- loading MM shards into a model at another TP / PP ---------------------------------------
def run_stages(chunks, inputs):
    """Forward through pipeline chunks in order, passing the stage tensor along as the schedule would."""
    packed = None
    with torch.no_grad():
        for chunk in chunks:
            chunk.set_input_tensor(packed)
            packed = chunk(**inputs)
    return packed


@pytest.mark.parametrize("source", ["tp2-pp2", "tp4-pp4", "tp2-vpp2x2"])
@pytest.mark.parametrize("target_pp", [None, [1, 3, 2], [[2, 1], [1, 2]]], ids=["pp1", "pp3", "vpp2x2"])
def test_model_loaded_from_shards_matches_diffusers(parallel_1proc, reference, mm_dirs, source, target_pp):
    chunks = []
    for spec in sorted(stage_specs(target_pp, TINY.num_blocks).values(), key=lambda s: s.block_range):
        chunk = FluxTransformer(TINY, pre_process=spec.pre_process, post_process=spec.post_process,
                                block_range=spec.block_range)
        load_megatron_checkpoint(chunk, str(mm_dirs[source]))
        chunks.append(chunk)
    inputs = make_inputs(TINY, batch=2, height=3, width=4, txt_len=5)
    with torch.no_grad():
        expected = reference_output(reference, inputs)
    assert rel_err(run_stages(chunks, inputs), expected) <= TOL


# --- training checkpoints: iterations, extras ---------------------------------------------------
def test_training_checkpoint_with_extras_and_iterations(parallel_1proc, tmp_path):
    model = FluxTransformer(TINY)
    meta = CheckpointMeta(TINY)
    extras = {"optimizer": {"state": {0: {"exp_avg": torch.randn(3, 4).bfloat16()}},
                            "param_groups": [{"lr": 1e-5, "params": [0]}]},
              "opt_param_scheduler": {"num_steps": 100},
              "rng_state": [{"random_rng_state": (3, (1, 2), None), "torch_rng_state": torch.get_rng_state()}]}
    written = {}
    for iteration in (100, 200):
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.1)
        written[iteration] = {n: p.clone() for n, p in model.named_parameters()}
        writer = CheckpointWriter(str(tmp_path), meta, iteration)
        writer.write_shard(0, 0, {"model": model.state_dict(), **extras})
        assert writer.commit() == str(tmp_path / f"iter_{iteration:07d}")
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "200"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]
    plain = torch.load(tmp_path / "iter_0000200" / "mp_rank_00" / "model_optim_rng.pt", weights_only=True)
    assert plain["iteration"] == 200 and plain["checkpoint_version"] == 3.0
    assert torch.equal(plain["optimizer"]["state"][0]["exp_avg"], extras["optimizer"]["state"][0]["exp_avg"])
    assert torch.equal(plain["rng_state"][0]["torch_rng_state"], extras["rng_state"][0]["torch_rng_state"])
    assert plain["rng_state"][0]["random_rng_state"] == (3, (1, 2), None)

    ckpt = MegatronCheckpoint(str(tmp_path))
    got = ckpt.extras(0, 0)
    assert got["opt_param_scheduler"] == {"num_steps": 100} and got["iteration"] == 200
    ckpt.close()
    fresh = FluxTransformer(TINY)
    load_megatron_checkpoint(fresh, str(tmp_path))  # latest: 200
    assert all(torch.equal(p, written[200][n]) for n, p in fresh.named_parameters())
    load_megatron_checkpoint(fresh, str(tmp_path), iteration=100)
    assert all(torch.equal(p, written[100][n]) for n, p in fresh.named_parameters())


# --- the EMA of a training checkpoint (--ema-decay) -------------------------------------------------
def test_mm_to_hf_exports_a_training_runs_ema_or_its_policy(parallel_1proc, tiny_pipeline_dir, tmp_path):
    """2 GRPO iterations with --ema-decay (decay 0.5 from the second on): `--cfg.weights ema` and
    `policy` (the default) equal the run's in-memory EMA and policy bit for bit, and differ."""
    from tests.grpo_helpers import SMOOTH_REWARD, grpo_argv, run_grpo, write_configs
    from tests.utils import gather_hf_state_dict
    cfg = write_configs(tmp_path / "cfg", tiny_pipeline_dir, reward=SMOOTH_REWARD)
    _, run = run_grpo(grpo_argv(*cfg, iters=2, extra=["--ema-decay", "0.5", "--ema-decay-ramp", "0.5",
                                                      "--num-inference-steps", "3", "--save", str(tmp_path / "ckpt")]))
    exported = {}
    for weights, chunks, extra in (("policy", run.model.modules, ()),
                                   ("ema", run.ema.modules, ("--cfg.weights", "ema"))):
        hf = convert("mm_to_hf", tmp_path / "ckpt", tmp_path / weights, None, None, *extra)
        exported[weights] = load_file(hf / "diffusion_pytorch_model.safetensors")
        want = gather_hf_state_dict(chunks)
        assert set(exported[weights]) == set(want)
        assert all(torch.equal(exported[weights][k], want[k]) for k in want), weights
    policy = exported["policy"]
    assert sum(not torch.equal(exported["ema"][k], t) for k, t in policy.items()) > len(policy) // 2


def test_mm_to_hf_ema_under_tp_and_virtual_pipeline_chunks(reference, mm_dirs, tmp_path):
    """A TP2, 2 x 2 virtual-stage checkpoint given an EMA entry (each chunk's weights doubled, as a
    trainer saves it: one state dict per chunk, beside model0 / model1): the export is the doubled
    diffusers weights."""
    import shutil
    from mm_grpo.checkpoint import checksum
    source = tmp_path / "ckpt"
    shutil.copytree(mm_dirs["tp2-vpp2x2"], source)
    for shard in (source / "release").glob("mp_rank_*/model_optim_rng.pt"):
        tree = torch.load(shard, weights_only=True)
        tree["ema"] = [{n: t * 2 for n, t in tree[f"model{v}"].items()} for v in range(2)]
        torch.save(tree, shard)
        checksum.write_checksum(str(shard))
    got = load_file(convert("mm_to_hf", source, tmp_path / "hf", None, None, "--cfg.weights", "ema")
                    / "diffusion_pytorch_model.safetensors")
    assert set(got) == set(reference.state_dict())
    assert all(torch.equal(got[k], t * 2) for k, t in reference.state_dict().items())


def test_mm_to_hf_ema_of_a_checkpoint_without_one_is_one_line(mm_dirs, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        convert("mm_to_hf", mm_dirs["tp1"], tmp_path / "hf", None, None, "--cfg.weights", "ema")
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 1 and not (tmp_path / "hf").exists()
    assert err[-1] == (f"mm-convert: error: {mm_dirs['tp1'] / 'release'} holds no EMA of the policy "
                       "(saved without --ema-decay)")


# --- shard file I/O ------------------------------------------------------------------------------
def test_shard_writer_and_reader_against_plain_torch(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tree = {"model": {"t": base.t(), "view": base[1:3, 2:], "bf16": torch.randn(5).bfloat16(),
                      "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3), "ints": torch.arange(7)},
            "nested": [{"a": torch.ones(2, dtype=torch.float16)}, (1, "x", None)], "version": 3.0}
    write_shard(str(tmp_path / "s.pt"), tree)
    plain = torch.load(tmp_path / "s.pt", weights_only=True)
    reader = ShardReader(str(tmp_path / "s.pt"))
    for got in (plain, reader.load()):
        for name, t in tree["model"].items():
            assert got["model"][name].dtype == t.dtype and torch.equal(got["model"][name], t), name
        assert torch.equal(got["nested"][0]["a"], tree["nested"][0]["a"])
        assert got["nested"][1] == (1, "x", None) and got["version"] == 3.0
    reader.close()
    # a file torch.save wrote, with views sharing one storage
    torch.save({"a": base[1], "b": base[:, 2], "c": base}, tmp_path / "plain.pt")
    reader = ShardReader(str(tmp_path / "plain.pt"))
    for key, want in {"a": base[1], "b": base[:, 2], "c": base}.items():
        assert torch.equal(reader.read(reader.get(key)), want)
    got = reader.load()
    assert torch.equal(got["b"], base[:, 2]) and got["b"].untyped_storage().data_ptr() == got["c"].data_ptr()
    reader.close()


def test_a_dict_under_two_keys_is_stored_once_and_read_back_as_one(tmp_path):
    state = {"w": torch.randn(3, 4), "b": torch.randn(3)}
    write_shard(str(tmp_path / "s.pt"), {"model": state, "model0": state, "checkpoint_version": 3.0})
    plain = torch.load(tmp_path / "s.pt", weights_only=True)
    assert plain["model0"] is plain["model"] and torch.equal(plain["model"]["w"], state["w"])
    reader = ShardReader(str(tmp_path / "s.pt"))
    assert [k for k, _ in tensor_leaves(reader.tree)] == [("model", "w"), ("model", "b")]
    loaded = reader.load()
    assert loaded["model0"] is loaded["model"] and torch.equal(loaded["model"]["b"], state["b"])
    reader.close()


def test_foreign_objects_in_a_shard_are_read_without_importing_their_classes(tmp_path, monkeypatch):
    """Megatron saves `args` (with MindSpeed-MM's config objects, enums, numpy RNG states): read as
    Opaque stand-ins holding the pickled state; the classes' module is never imported."""
    (tmp_path / "foreign_config.py").write_text(
        "import enum\n"
        "class Mode(enum.Enum):\n    A = 1\n"
        "class Config:\n    def __init__(self, **kw):\n        self.__dict__.update(kw)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import foreign_config
    args = argparse.Namespace(mm=foreign_config.Config(predictor=foreign_config.Config(model_id="flux")),
                              mode=foreign_config.Mode.A, tensor_model_parallel_size=2)
    torch.save({"args": args, "model": {"w": torch.arange(4.0)}, "rng": [np.random.get_state()]}, tmp_path / "s.pt")
    monkeypatch.delitem(sys.modules, "foreign_config")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    reader = ShardReader(str(tmp_path / "s.pt"))
    got = reader.tree["args"]
    assert isinstance(got, argparse.Namespace) and got.tensor_model_parallel_size == 2
    assert isinstance(got.mm, Opaque) and type(got.mm).__module__ == "foreign_config"
    assert got.mm.predictor.model_id == "flux" and isinstance(got.mode, Opaque)
    assert torch.equal(reader.load("model", "w"), torch.arange(4.0))
    assert "foreign_config" not in sys.modules
    reader.close()


def test_shard_writer_refuses_missing_or_misshaped_tensors(tmp_path):
    writer = ShardWriter(str(tmp_path / "s.pt"), {"a": torch.zeros(2, 3), "b": torch.zeros(4)})
    with pytest.raises(ValueError, match=r"\('a',\) is \(3, 2\) torch.float32, the file reserves \(2, 3\)"):
        writer.write(("a",), torch.zeros(3, 2))
    writer.write(("b",), torch.ones(4))
    with pytest.raises(ValueError, match="1 tensors were never written"):
        writer.close()


def test_truncated_shard_is_a_clear_error(tmp_path):
    write_shard(str(tmp_path / "s.pt"), {"a": torch.randn(1000)})
    data = (tmp_path / "s.pt").read_bytes()
    (tmp_path / "s.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cannot read checkpoint shard .*s\.pt \(truncated"):
        ShardReader(str(tmp_path / "s.pt"))
