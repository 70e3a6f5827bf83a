"""mm-convert QwenImageConverter and Qwen-Image's Megatron checkpoint layout (tiny Qwen-Image, CPU, one
process). The oracles are independent of the converter: diffusers' QwenImageTransformer2DModel (its
weights, `save_pretrained` / `from_pretrained` and forward), plain `torch.load` of the shards, and the
model loaded with `load_hf_weights` (itself held to diffusers by tests/test_qwen_image_model.py).
A running TP2 x PP2 model loading checkpoints of other layouts: tests/distributed/checks_qwen_image.py."""
import json
import os
import shutil

import diffusers
import pytest
import torch
from diffusers import QwenImageTransformer2DModel
from safetensors.torch import load_file

from converters.convert_cli import main
from mm_grpo.checkpoint import CheckpointWriter, checksum, write_shard
from mm_grpo.checkpoint.paths import META_KEY, write_tracker
from mm_grpo.families.qwen_image.checkpoint import CheckpointMeta, MegatronCheckpoint, load_megatron_checkpoint
from mm_grpo.families.qwen_image.checkpoint import weights as checkpoint_weights
from mm_grpo.families.qwen_image.transformer import QwenImageTransformer, layout
from mm_grpo.families.qwen_image.transformer.hf_weights import load_hf_weights
from mm_grpo.parallel.pipeline_layout import stage_specs
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.qwen_image_utils import TINY, make_inputs, random_reference, reference_output
from tests.utils import assert_one_line_error, rel_err, run_main

CONFIG = TINY.replace(num_layers=4)  # 4 blocks: 2 stages x 2 virtual stages of one block each
TOL = 1e-5
SHARD_SIZE = "300KB"  # splits the tiny model into several safetensors files, as the 20B one ships in 9
LAYOUTS = {  # id: (tp_size, pp_layers)
    "tp1": (1, None),
    "tp2": (2, None),
    "tp4": (4, None),
    "tp1-pp2": (1, [2, 2]),
    "tp2-pp2": (2, [1, 3]),
    "tp4-pp2": (4, [3, 1]),
    "tp2-vpp2x2": (2, [[1, 1], [1, 1]]),
}


def convert(command, source, target, tp=None, pp_layers=None, *extra):
    args = ["QwenImageConverter", command, "--cfg.source_path", str(source), "--cfg.target_path", str(target)]
    if tp is not None:
        args += ["--cfg.target_parallel_config.tp_size", str(tp)]
    if pp_layers is not None:
        args += ["--cfg.target_parallel_config.pp_layers", json.dumps(pp_layers)]
    main(args + list(extra))
    return target


@pytest.fixture(scope="module")
def reference():
    return random_reference(CONFIG, seed=21)


def save_pipeline(ref, folder):
    """A pipeline folder as Qwen/Qwen-Image's: model_index.json and a sharded transformer/ (with its index)."""
    ref.save_pretrained(folder / "transformer", max_shard_size=SHARD_SIZE)
    (folder / "model_index.json").write_text(json.dumps({
        "_class_name": "QwenImagePipeline", "_diffusers_version": diffusers.__version__,
        "transformer": ["diffusers", "QwenImageTransformer2DModel"]}))
    return folder


@pytest.fixture(scope="module")
def pipeline_dir(reference, tmp_path_factory):
    return save_pipeline(reference, tmp_path_factory.mktemp("pipe"))


@pytest.fixture(scope="module")
def hf_dir(pipeline_dir):
    return pipeline_dir / "transformer"


@pytest.fixture(scope="module")
def mm_dirs(hf_dir, tmp_path_factory):
    """hf_to_mm of the sharded transformer folder for every layout in LAYOUTS."""
    root = tmp_path_factory.mktemp("mm")
    return {name: convert("hf_to_mm", hf_dir, root / name, tp, pp) for name, (tp, pp) in LAYOUTS.items()}


def shard_tensors(root):
    """Every model tensor of every shard file, read with plain torch.load: {(shard, key, name): tensor}."""
    out = {}
    release = root / "release"
    for shard in sorted(os.listdir(release)):
        tree = torch.load(release / shard / "model_optim_rng.pt", weights_only=True)
        assert tree["checkpoint_version"] == 3.0
        for key, value in tree.items():
            if key.startswith("model"):
                out.update({(shard, key, name): t for name, t in value.items()})
    return out


def layout_of(root):
    """mm-grpo's metadata as the first shard stores it."""
    folder = root / "release" / sorted(os.listdir(root / "release"))[0]
    return torch.load(folder / "model_optim_rng.pt", weights_only=True)[META_KEY]


def assert_equal_state_dicts(got, expected):
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


# --- round trip, sources and layout on disk ------------------------------------------------------
def test_the_source_is_sharded_as_qwen_image_ships(hf_dir):
    index = json.loads((hf_dir / "diffusion_pytorch_model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2


@pytest.mark.parametrize("name", LAYOUTS)
def test_hf_mm_hf_round_trip_is_bit_exact_and_loads_in_diffusers(name, reference, mm_dirs, tmp_path):
    out = convert("mm_to_hf", mm_dirs[name], tmp_path / "hf", None, None, "--cfg.max_shard_size", SHARD_SIZE)
    assert (out / "diffusion_pytorch_model.safetensors.index.json").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["_class_name"] == "QwenImageTransformer2DModel"
    loaded = QwenImageTransformer2DModel.from_pretrained(out)
    assert_equal_state_dicts(loaded.state_dict(), reference.state_dict())
    inputs = make_inputs(CONFIG, lengths=(5, 2), height=3, width=4)
    with torch.no_grad():
        assert torch.equal(reference_output(loaded, inputs), reference_output(reference, inputs))


def test_a_pipeline_folder_converts_as_its_transformer_folder(pipeline_dir, mm_dirs, tmp_path):
    tp, pp = LAYOUTS["tp2-pp2"]
    out = convert("hf_to_mm", pipeline_dir, tmp_path / "mm", tp, pp)
    direct, via_pipeline = shard_tensors(mm_dirs["tp2-pp2"]), shard_tensors(out)
    assert set(via_pipeline) == set(direct) and all(torch.equal(via_pipeline[k], t) for k, t in direct.items())
    assert layout_of(out) == layout_of(mm_dirs["tp2-pp2"])


def test_layout_on_disk(mm_dirs):
    root = mm_dirs["tp2-vpp2x2"]
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert sorted(os.listdir(root / "release")) == [  # nothing but shard folders (MindSpeed-MM lists them)
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    meta = layout_of(root)
    assert meta["model"] == "qwen-image" and meta["dtype"] == "float32"
    assert meta["parallel"] == {"tp_size": 2, "pp_size": 2, "vpp_size": 2, "pp_layers": [[1, 1], [1, 1]]}
    assert meta["config"] == CONFIG.to_diffusers_config()
    stage1 = torch.load(root / "release" / "mp_rank_01_001" / "model_optim_rng.pt", weights_only=True)
    assert sorted(stage1) == ["checkpoint_version", META_KEY, "model0", "model1"] and stage1[META_KEY] == meta
    # chunk 1 of stage 1 holds global block 3 (the last), numbered locally from 0, and the head
    assert {".".join(n.split(".")[:2]) for n in stage1["model1"] if n.startswith("blocks.")} == {"blocks.0"}
    assert "final_layer.linear.weight" in stage1["model1"] and "img_in.weight" not in stage1["model0"]
    hidden = CONFIG.hidden_size
    assert stage1["model0"]["blocks.0.img_attn.linear_qkv.weight"].shape == (3 * hidden // 2, hidden)
    assert stage1["model0"]["blocks.0.txt_attn.linear_proj.weight"].shape == (hidden, hidden // 2)
    # PP > 1 without virtual stages: `model0` names the `model` dict too (MindSpeed-MM's load_from_mm)
    plain_pp = torch.load(mm_dirs["tp2-pp2"] / "release" / "mp_rank_01_001" / "model_optim_rng.pt", weights_only=True)
    assert plain_pp["model0"] is plain_pp["model"]
    assert sorted(os.listdir(mm_dirs["tp4"] / "release")) == [f"mp_rank_0{r}" for r in range(4)]


def test_shard_names_are_the_models_own_and_a_plain_load_state_dict_works(parallel_1proc, reference, mm_dirs):
    root = mm_dirs["tp1-pp2"]
    for (pp, _), spec in stage_specs([2, 2], CONFIG.num_blocks).items():
        tree = torch.load(root / "release" / f"mp_rank_00_00{pp}" / "model_optim_rng.pt", weights_only=True)
        chunk = QwenImageTransformer(CONFIG, pre_process=spec.pre_process, post_process=spec.post_process,
                                     block_range=spec.block_range)
        assert set(tree["model"]) == set(dict(chunk.named_parameters()))
    model = QwenImageTransformer(CONFIG)  # Megatron's way: model.load_state_dict(ckpt["model"])
    model.load_state_dict(torch.load(mm_dirs["tp1"] / "release" / "mp_rank_00" / "model_optim_rng.pt",
                                     weights_only=True)["model"], strict=True)
    inputs = make_inputs(CONFIG, lengths=(6, 3), height=2, width=5)
    with torch.no_grad():
        assert rel_err(model(**inputs), reference_output(reference, inputs)) <= TOL


# --- resplit and dtypes -----------------------------------------------------------------------------
@pytest.mark.parametrize("src,dst", [("tp1", "tp2-vpp2x2"), ("tp4-pp2", "tp2-pp2"), ("tp2-vpp2x2", "tp4"),
                                     ("tp2-pp2", "tp1-pp2")])
def test_resplit_equals_direct_conversion(src, dst, mm_dirs, tmp_path):
    tp, pp = LAYOUTS[dst]
    out = convert("resplit", mm_dirs[src], tmp_path / "resplit", tp, pp)
    direct, resplit = shard_tensors(mm_dirs[dst]), shard_tensors(out)
    assert set(resplit) == set(direct)
    for key, tensor in direct.items():
        assert resplit[key].dtype == tensor.dtype and torch.equal(resplit[key], tensor), key
    assert layout_of(out) == layout_of(mm_dirs[dst])


def read_folder(folder):
    """Every tensor of a diffusers folder's safetensors files."""
    return {k: t for f in sorted(folder.glob("*.safetensors")) for k, t in load_file(f).items()}


def test_a_bf16_source_stays_bf16_and_dtype_casts(reference, hf_dir, tmp_path):
    bf16 = {k: t.to(torch.bfloat16) for k, t in reference.state_dict().items()}
    source = save_pipeline(random_reference(CONFIG, seed=21).to(torch.bfloat16), tmp_path / "pipe")  # the same, in bf16
    mm = convert("hf_to_mm", source, tmp_path / "mm", 2, [[1, 1], [1, 1]])
    assert layout_of(mm)["dtype"] == "bfloat16" and all(t.dtype == torch.bfloat16 for t in shard_tensors(mm).values())
    assert_equal_state_dicts(read_folder(convert("mm_to_hf", mm, tmp_path / "hf")), bf16)
    cast = convert("hf_to_mm", hf_dir, tmp_path / "cast", 4, [2, 2], "--cfg.dtype", "bf16")  # fp32 source
    assert layout_of(cast)["dtype"] == "bfloat16"
    assert_equal_state_dicts(read_folder(convert("mm_to_hf", cast, tmp_path / "cast_hf")), bf16)
    back = read_folder(convert("mm_to_hf", cast, tmp_path / "fp32", None, None, "--cfg.dtype", "fp32"))
    assert_equal_state_dicts(back, {k: t.float() for k, t in bf16.items()})


def test_mm_to_hf_keeps_the_original_folders_config_and_file_split(mm_dirs, hf_dir, tmp_path):
    out = convert("mm_to_hf", mm_dirs["tp4-pp2"], tmp_path / "hf", None, None, "--cfg.hf_dir", str(hf_dir.parent))
    assert json.loads((out / "config.json").read_text()) == json.loads((hf_dir / "config.json").read_text())
    index = "diffusion_pytorch_model.safetensors.index.json"
    assert json.loads((out / index).read_text())["weight_map"] == json.loads((hf_dir / index).read_text())["weight_map"]
    assert_equal_state_dicts(read_folder(out), read_folder(hf_dir))


# --- loading into a running model ------------------------------------------------------------------
def stage_chunks(pp_layers):
    """Every model chunk of a layout, in block order (one process holds all the stages)."""
    specs = sorted(stage_specs(pp_layers, CONFIG.num_blocks).values(), key=lambda s: s.block_range)
    return [QwenImageTransformer(CONFIG, pre_process=s.pre_process, post_process=s.post_process,
                                 block_range=s.block_range) for s in specs]


def run_stages(chunks, inputs):
    """Forward through pipeline chunks in order, passing the stage tensor along as the schedule would."""
    packed = None
    with torch.no_grad():
        for chunk in chunks:
            chunk.set_input_tensor(packed)
            packed = chunk(**inputs)
    return packed


@pytest.mark.parametrize("source", ["tp4", "tp2-pp2", "tp2-vpp2x2"])
@pytest.mark.parametrize("target_pp", [None, [1, 2, 1], [[1, 1], [1, 1]]], ids=["pp1", "pp3", "vpp2x2"])
def test_a_checkpoint_loads_into_any_layout_as_the_diffusers_weights(parallel_1proc, reference, mm_dirs, source,
                                                                      target_pp):
    from mm_grpo.families.qwen_image.chunks import load_pretrained
    chunks = stage_chunks(target_pp)
    meta = load_megatron_checkpoint(chunks, str(mm_dirs[source]))
    assert (meta.tp_size, meta.pp_layers) == (LAYOUTS[source][0], LAYOUTS[source][1] or [CONFIG.num_blocks])
    for chunk, direct, pretrained in zip(chunks, stage_chunks(target_pp), stage_chunks(target_pp)):
        load_hf_weights(direct, reference.state_dict())
        load_pretrained(pretrained, str(mm_dirs[source]))
        expected = dict(direct.named_parameters())
        for model in (chunk, pretrained):
            for name, param in model.named_parameters():
                assert torch.equal(param, expected[name]), name
    inputs = make_inputs(CONFIG, lengths=(4, 7), height=3, width=3)
    with torch.no_grad():
        assert rel_err(run_stages(chunks, inputs), reference_output(reference, inputs)) <= TOL


def test_load_pretrained_takes_a_diffusers_pipeline_folder_too(parallel_1proc, reference, pipeline_dir):
    from mm_grpo.families.qwen_image.chunks import load_pretrained
    chunks = load_pretrained(stage_chunks([3, 1]), str(pipeline_dir))
    inputs = make_inputs(CONFIG, lengths=(3,), height=2, width=2)
    with torch.no_grad():
        assert rel_err(run_stages(chunks, inputs), reference_output(reference, inputs)) <= TOL


@pytest.mark.parametrize("src,dst", [("tp4", "tp2"), ("tp2-vpp2x2", "tp4"), ("tp1-pp2", "tp2"), ("tp4-pp2", "tp1")])
def test_tp_shards_cut_while_loading_equal_the_direct_conversions_files(mm_dirs, src, dst):
    """What a rank of another TP size reads (`MegatronCheckpoint.local`) is what hf_to_mm wrote for it."""
    tp = LAYOUTS[dst][0]
    ckpt = MegatronCheckpoint(str(mm_dirs[src]))
    try:
        for rank in range(tp):
            files = torch.load(mm_dirs[dst] / "release" / f"mp_rank_0{rank}" / "model_optim_rng.pt",
                               weights_only=True)["model"]
            rules = list(layout.stage_rules(CONFIG))
            assert {r.megatron for r in rules} == set(files)
            for rule in rules:
                assert torch.equal(ckpt.local(rule, rank, tp), files[rule.megatron]), (rule.megatron, rank)
    finally:
        ckpt.close()


def by_diffusers_name(chunks):
    """{diffusers names of a rule: the chunk's parameter} over chunks."""
    found = {}
    for chunk in chunks:
        params = dict(chunk.named_parameters())
        for rule in layout.stage_rules(CONFIG, chunk.block_range, chunk.pre_process, chunk.post_process):
            found[rule.hf] = params[rule.megatron]
    return found


def test_a_training_checkpoint_reloads_through_weights_at_another_layout(parallel_1proc, reference, tmp_path):
    """What the training loop saves (`weights.state_dict` per chunk, with its optimizer's entries) at PP 2,
    and loads back (`weights.load`) at 2 x 2 virtual stages."""
    saved = [load_hf_weights(c, reference.state_dict()) for c in stage_chunks([1, 3])]
    meta = CheckpointMeta(CONFIG, 1, [1, 3], "float32")
    writer = CheckpointWriter(str(tmp_path), meta, 100)
    for pp, chunk in enumerate(saved):
        writer.write_shard(0, pp, {"model": checkpoint_weights.state_dict(chunk), "optimizer": {"step": 7}})
    folder = writer.commit()
    fresh = stage_chunks([[1, 1], [1, 1]])
    assert checkpoint_weights.load(fresh, folder) == meta
    expected, loaded = by_diffusers_name(saved), by_diffusers_name(fresh)
    assert set(loaded) == set(expected)
    for name, param in loaded.items():
        assert torch.equal(param, expected[name]), name
    ckpt = MegatronCheckpoint(str(tmp_path))
    try:
        assert ckpt.extras(0, 1) == {"checkpoint_version": 3.0, "iteration": 100, "optimizer": {"step": 7}}
    finally:
        ckpt.close()


def test_mm_to_hf_exports_a_training_checkpoints_ema(reference, mm_dirs, tmp_path):
    """Each shard given an EMA entry (every chunk's weights doubled, one state dict per chunk, as a trainer
    with --ema-decay saves it): `--cfg.weights ema` exports the doubled diffusers weights."""
    source = tmp_path / "ckpt"
    shutil.copytree(mm_dirs["tp2-vpp2x2"], source)
    for shard in (source / "release").glob("mp_rank_*/model_optim_rng.pt"):
        tree = torch.load(shard, weights_only=True)
        tree["ema"] = [{n: t * 2 for n, t in tree[f"model{v}"].items()} for v in range(2)]
        torch.save(tree, shard)
        checksum.write_checksum(str(shard))
    got = read_folder(convert("mm_to_hf", source, tmp_path / "hf", None, None, "--cfg.weights", "ema"))
    assert_equal_state_dicts(got, {k: t * 2 for k, t in reference.state_dict().items()})


# --- one-line errors ---------------------------------------------------------------------------------
def refused(capsys, tmp_path, target, pattern, *args):
    """mm-convert exits 1 with one line matching `pattern`, leaving no target and no temporary folder."""
    code, _, err = run_main(main, capsys, "QwenImageConverter", *args)
    assert code == 1 and err.startswith("mm-convert: error: ") and err.count("\n") == 1, err
    assert pattern in err, err
    assert not os.path.exists(target)
    assert not [n for n in os.listdir(os.path.dirname(target)) if ".tmp-" in n]


def test_a_model_of_another_architecture_is_refused(parallel_1proc, mm_dirs, hf_dir, tmp_path, capsys):
    assert_one_line_error(lambda: load_megatron_checkpoint(QwenImageTransformer(TINY), str(mm_dirs["tp1"])),
                          r"holds another Qwen-Image architecture than the model: num_layers 4 \(the model: 2\)$")
    narrow = tmp_path / "narrow"
    random_reference(CONFIG.replace(num_attention_heads=2, attention_head_dim=32, axes_dims_rope=(8, 12, 12)),
                     seed=1).save_pretrained(narrow)
    refused(capsys, tmp_path, tmp_path / "hf", "another Qwen-Image architecture than "
            f"{narrow}'s config.json: attention_head_dim 16 ({narrow}'s config.json: 32), num_attention_heads 4",
            "mm_to_hf", "--cfg.source_path", mm_dirs["tp1"], "--cfg.target_path", tmp_path / "hf",
            "--cfg.hf_dir", narrow)
    refused(capsys, tmp_path, tmp_path / "mm", "unexpected weights: transformer_blocks.2.attn.add_k_proj.bias",
            "hf_to_mm", "--cfg.source_path", hf_dir, "--cfg.target_path", tmp_path / "mm", "--cfg.preset", "tiny")


def test_missing_sources_are_one_line(tmp_path, capsys, hf_dir):
    nope = tmp_path / "nope"
    refused(capsys, tmp_path, tmp_path / "mm", f"error: no such Qwen-Image checkpoint: {nope}\n",
            "hf_to_mm", "--cfg.source_path", nope, "--cfg.target_path", tmp_path / "mm")
    refused(capsys, tmp_path, tmp_path / "hf", f"error: no such Megatron checkpoint: {nope}\n",
            "mm_to_hf", "--cfg.source_path", nope, "--cfg.target_path", tmp_path / "hf")
    refused(capsys, tmp_path, tmp_path / "re", f"error: no such Megatron checkpoint: {nope}\n",
            "resplit", "--cfg.source_path", nope, "--cfg.target_path", tmp_path / "re")
    weights = next(hf_dir.glob("*.safetensors"))
    refused(capsys, tmp_path, tmp_path / "mm", "is a file: QwenImageConverter reads a diffusers transformer folder",
            "hf_to_mm", "--cfg.source_path", weights, "--cfg.target_path", tmp_path / "mm")


def test_an_existing_target_is_refused_unless_overwrite(hf_dir, tmp_path, capsys):
    target = convert("hf_to_mm", hf_dir, tmp_path / "mm")
    shard = target / "release" / "mp_rank_00" / "model_optim_rng.pt"
    before = shard.read_bytes()
    code, _, err = run_main(main, capsys, "QwenImageConverter", "hf_to_mm", "--cfg.source_path", hf_dir,
                            "--cfg.target_path", target, "--cfg.target_parallel_config.tp_size", "2")
    assert code == 1 and err == f"mm-convert: error: target {target} already exists: remove it or pass " \
                                "--cfg.overwrite true\n"
    assert shard.read_bytes() == before
    convert("hf_to_mm", hf_dir, target, 2, None, "--cfg.overwrite", "true")
    assert sorted(os.listdir(target / "release")) == ["mp_rank_00", "mp_rank_01"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


@pytest.mark.parametrize("extra,pattern", [
    (["--cfg.target_parallel_config.tp_size", "3"],
     "num_attention_heads (4) must be divisible by tensor-model-parallel size (3)"),
    (["--cfg.target_parallel_config.pp_layers", "[2,1]"], "pp_layers [2, 1] sums to 3, but the model has 4 blocks"),
    (["--cfg.target_parallel_config.ep_size", "2"], "ep_size 2: Qwen-Image has no experts"),
    (["--cfg.lora_path", "lora/"], "--cfg.lora_path lora/: QwenImageConverter converts whole Qwen-Image weights"),
])
def test_what_cannot_be_written_is_refused_before_any_work(hf_dir, tmp_path, capsys, extra, pattern):
    refused(capsys, tmp_path, tmp_path / "mm", pattern, "hf_to_mm", "--cfg.source_path", hf_dir,
            "--cfg.target_path", tmp_path / "mm", *extra)


def test_checkpoints_that_are_not_qwen_images_are_one_line(tmp_path, capsys):
    from mm_grpo.families.flux.checkpoint import CheckpointMeta as FluxCheckpointMeta
    from mm_grpo.families.flux.transformer import FluxConfig
    flux = tmp_path / "flux"
    writer = CheckpointWriter(str(flux), FluxCheckpointMeta(FluxConfig.preset("tiny")))
    writer.write_shard(0, 0, {"model": {}})
    writer.commit()
    refused(capsys, tmp_path, tmp_path / "hf", "model_optim_rng.pt is a checkpoint of model 'flux', not Qwen-Image",
            "mm_to_hf", "--cfg.source_path", flux, "--cfg.target_path", tmp_path / "hf")
    bare = tmp_path / "bare"  # as Megatron saves it: no mm-grpo metadata
    write_shard(str(bare / "release" / "mp_rank_00" / "model_optim_rng.pt"),
                {"model": {"img_in.weight": torch.zeros(2, 2)}, "checkpoint_version": 3.0})
    write_tracker(str(bare))
    refused(capsys, tmp_path, tmp_path / "re", f"model_optim_rng.pt has no mm-grpo metadata ({META_KEY})",
            "resplit", "--cfg.source_path", bare, "--cfg.target_path", tmp_path / "re")


def test_the_ema_of_a_checkpoint_without_one_is_one_line(mm_dirs, tmp_path, capsys):
    refused(capsys, tmp_path, tmp_path / "hf", f"{mm_dirs['tp1'] / 'release'} holds no EMA of the policy",
            "mm_to_hf", "--cfg.source_path", mm_dirs["tp1"], "--cfg.target_path", tmp_path / "hf",
            "--cfg.weights", "ema")
