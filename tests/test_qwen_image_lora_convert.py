"""mm-convert QwenImageConverter's LoRA verbs on a LoRA run of mm-grpo's trainer (tiny Qwen-Image pipeline,
CPU, one process): `lora_mm_to_hf` loaded by diffusers' QwenImagePipeline.load_lora_weights (peft) and
computing what the trained Megatron model computes; `merge_lora_to_base` from the recorded diffusers base
and from a Megatron base at another layout, exported with mm_to_hf and held to diffusers' transformer with
the LoRA fused (`fuse_lora`), resplit bit for bit; the refusals in one line, before anything is written."""
import json
import logging
import os

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel
from safetensors.torch import load_file

from converters.convert_cli import main
from converters.qwen_image import LoraMmToHfConfig, MergeLoraToBaseConfig, QwenImageConverter
from mm_grpo.checkpoint import CheckpointWriter, write_shard
from mm_grpo.families.qwen_image.transformer import lora
from mm_grpo.families.qwen_image.transformer.lora_hf import LORA_FILE
from tests.fixtures import parallel_1proc, peft_without_mindspeed_te_dummies  # noqa: F401
from tests.grpo_helpers import SMOOTH_REWARD, grpo_argv, run_grpo, write_configs
from tests.qwen_image_utils import make_inputs, reference_output
from tests.utils import rel_err, run_main

TOL = 1e-5
LORA = ["--lora-target-modules", *lora.TARGETS, "--lora-r", "4", "--lora-alpha", "8"]
TP2_PP2 = ["--cfg.target_parallel_config.tp_size", "2", "--cfg.target_parallel_config.pp_layers", "[1,1]"]

pytestmark = pytest.mark.usefixtures("peft_without_mindspeed_te_dummies")  # the reference side: diffusers + peft


def cli(verb, *args, **options):
    main(["QwenImageConverter", verb, *[a for k, v in options.items() for a in (f"--cfg.{k}", str(v))], *args])


@pytest.fixture(scope="module")
def trained(parallel_1proc, tiny_qwen_image_pipeline_dir, tmp_path_factory):
    """A LoRA run (every target, 1 iteration) on the tiny pipeline's diffusers transformer, which its
    checkpoint records as the base; and that base through hf_to_mm (TP 1)."""
    root = tmp_path_factory.mktemp("qwen_lora_convert")
    transformer = tiny_qwen_image_pipeline_dir / "transformer"
    model_json, data_json = write_configs(root / "cfg", tiny_qwen_image_pipeline_dir, reward=SMOOTH_REWARD)
    with open(model_json) as f:
        model = json.load(f)
    model["predictor"] = {"model_id": "mmgrpo_qwenimage", "from_pretrained": str(transformer)}
    model["text_encoder"]["max_sequence_length"] = 64
    with open(model_json, "w") as f:
        json.dump(model, f)
    _, run = run_grpo(grpo_argv(model_json, data_json, iters=1,
                                extra=LORA + ["--lr", "1e-2", "--save", str(root / "ckpt")]))
    cli("hf_to_mm", source_path=transformer, target_path=root / "base")
    return root / "ckpt", root / "base", run


def diffusers_with_lora(transformer_dir, lora_dir):
    """diffusers' pipeline around the base transformer, the LoRA file loaded by load_lora_weights; the
    warnings diffusers logs while loading."""
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None,
                             tokenizer=None, transformer=QwenImageTransformer2DModel.from_pretrained(transformer_dir))
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("diffusers").addHandler(handler)
    try:
        pipe.load_lora_weights(str(lora_dir))
    finally:
        logging.getLogger("diffusers").removeHandler(handler)
    return pipe, records


def test_the_exported_lora_loads_in_diffusers_and_computes_the_trained_model(trained, tiny_qwen_image_pipeline_dir,
                                                                             tmp_path):
    from peft.utils import get_peft_model_state_dict
    ckpt, _, run = trained
    cli("lora_mm_to_hf", source_path=ckpt, target_path=tmp_path / "lora")
    assert os.listdir(tmp_path / "lora") == [LORA_FILE]
    pipe, warnings = diffusers_with_lora(tiny_qwen_image_pipeline_dir / "transformer", tmp_path / "lora")
    assert warnings == []  # no unmatched or unexpected keys
    written = load_file(tmp_path / "lora" / LORA_FILE)
    # diffusers modules: 2 blocks x 2 streams x (q, k, v, out, 2 MLP, modulation), the head's adaLN; A and B each
    assert len(written) == 2 * (run.config.num_layers * 2 * 7 + 1)
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name=pipe.transformer.active_adapters()[0])
    assert {f"transformer.{k}" for k in loaded} == set(written)
    assert all(torch.equal(v, written[f"transformer.{k}"]) for k, v in loaded.items())

    inputs = make_inputs(run.config, lengths=(6, 2), height=3, width=4, seed=2)
    with torch.no_grad():
        ours = run.model.modules[0](**inputs)
        theirs = reference_output(pipe.transformer, inputs)
        pipe.transformer.disable_lora()
        base = reference_output(pipe.transformer, inputs)
    print(f"lora_mm_to_hf: max |ours - diffusers| {(ours - theirs).abs().max().item():.3g}, "
          f"rel {rel_err(ours, theirs):.3g}")
    assert rel_err(ours, theirs) <= TOL
    assert rel_err(theirs, base) > 1e-3  # the adapters learned something


def shards(root):
    """Every shard file's model tensors, read with plain torch.load: {(shard folder, key, name): tensor}."""
    out = {}
    for folder in sorted(os.listdir(root / "release")):
        tree = torch.load(root / "release" / folder / "model_optim_rng.pt", weights_only=True)
        out.update({(folder, key, n): t for key, chunk in tree.items() if key.startswith("model")
                    for n, t in chunk.items()})
    return out


def test_merged_checkpoints_equal_diffusers_with_the_lora_fused(trained, tiny_qwen_image_pipeline_dir, tmp_path):
    from mm_grpo.families.qwen_image.checkpoint.adapters import checkpoint_base
    ckpt, base, run = trained
    cli("lora_mm_to_hf", source_path=ckpt, target_path=tmp_path / "lora")
    assert checkpoint_base(str(ckpt)) == str(tiny_qwen_image_pipeline_dir / "transformer")
    # the base the run recorded (the diffusers transformer), one stage at TP 1
    cli("merge_lora_to_base", lora_path=ckpt, target_path=tmp_path / "tp1")
    # the base converted to Megatron (TP 1), written at TP 2 x PP 2
    cli("merge_lora_to_base", *TP2_PP2, source_path=base, lora_path=ckpt, target_path=tmp_path / "tp2pp2")
    assert os.listdir(tmp_path / "tp1" / "release") == ["mp_rank_00"]
    assert sorted(os.listdir(tmp_path / "tp2pp2" / "release")) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]

    pipe, _ = diffusers_with_lora(tiny_qwen_image_pipeline_dir / "transformer", tmp_path / "lora")
    inputs = make_inputs(run.config, lengths=(5, 3), height=4, width=3, seed=8)
    with torch.no_grad():
        pipe.fuse_lora()
        fused_out = reference_output(pipe.transformer, inputs)
        pipe.unload_lora_weights()  # the fused weights stay
    fused = pipe.transformer.state_dict()
    for name in ("tp1", "tp2pp2"):
        cli("mm_to_hf", source_path=tmp_path / name, target_path=tmp_path / f"{name}_hf")
        merged = QwenImageTransformer2DModel.from_pretrained(tmp_path / f"{name}_hf")
        state = merged.state_dict()
        assert state.keys() == fused.keys()
        weights_err = max((state[k] - fused[k]).abs().max().item() for k in fused)
        with torch.no_grad():
            out = reference_output(merged, inputs)
        print(f"merge_lora_to_base {name}: max |merged - fused| weights {weights_err:.3g}, "
              f"output {(out - fused_out).abs().max().item():.3g} (rel {rel_err(out, fused_out):.3g})")
        assert weights_err <= TOL and rel_err(out, fused_out) <= TOL

    # resplit: TP 2 x PP 2 -> TP 1 is the TP 1 merge, and back is the TP 2 x PP 2 one, bit for bit
    cli("resplit", source_path=tmp_path / "tp2pp2", target_path=tmp_path / "resplit_tp1")
    cli("resplit", *TP2_PP2, source_path=tmp_path / "resplit_tp1", target_path=tmp_path / "resplit_tp2pp2")
    for got, expected in (("resplit_tp1", "tp1"), ("resplit_tp2pp2", "tp2pp2")):
        a, b = shards(tmp_path / got), shards(tmp_path / expected)
        assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in b), got


def refused(capsys, target, pattern, verb, *args):
    """mm-convert exits 1 with one line holding `pattern`, leaving `target` as it was (absent here) and no
    temporary folder beside it."""
    existed = os.path.exists(target)
    code, _, err = run_main(main, capsys, "QwenImageConverter", verb, *args)
    assert code == 1 and err.startswith("mm-convert: error: ") and err.count("\n") == 1, err
    assert pattern in err, err
    assert os.path.exists(target) == existed
    assert not [n for n in os.listdir(os.path.dirname(target)) if ".tmp-" in n]


def test_checkpoints_without_qwen_image_adapters_are_refused_in_one_line(trained, tmp_path, capsys):
    from mm_grpo.families.flux.checkpoint import CheckpointMeta as FluxCheckpointMeta
    from mm_grpo.families.flux.transformer import FluxConfig
    ckpt, base, _ = trained
    out = tmp_path / "out"
    refused(capsys, out, f"{base / 'release'} is not a LoRA checkpoint (no 'lora' entry)",
            "lora_mm_to_hf", "--cfg.source_path", base, "--cfg.target_path", out)
    refused(capsys, out, "is not a LoRA checkpoint (no 'lora' entry): its base weights are not recorded",
            "merge_lora_to_base", "--cfg.lora_path", base, "--cfg.target_path", out)
    # the whole-weights verbs, and a LoRA checkpoint as the base
    for verb, *args in (("mm_to_hf", "--cfg.source_path", ckpt),
                        ("merge_lora_to_base", "--cfg.source_path", ckpt, "--cfg.lora_path", ckpt)):
        refused(capsys, out, "is a LoRA training checkpoint (adapters only): convert it with lora_mm_to_hf",
                verb, *args, "--cfg.target_path", out)
    # FLUX's LoRA checkpoint: FLUX's metadata, an adapter-only shard
    flux = tmp_path / "flux"
    writer = CheckpointWriter(str(flux), FluxCheckpointMeta(FluxConfig.preset("tiny")))
    writer.write_shard(0, 0, {"model": {}, "lora": {"config": {"r": 4, "alpha": 8.0, "targets": ["linear_qkv"]}}})
    writer.commit()
    refused(capsys, out, "model_optim_rng.pt is a checkpoint of model 'flux', not Qwen-Image",
            "lora_mm_to_hf", "--cfg.source_path", flux, "--cfg.target_path", out)
    # MindSpeed-MM's own LoRA: peft's adapter names, no mm-grpo entry
    peft = tmp_path / "peft" / "release"
    write_shard(str(peft / "mp_rank_00" / "model_optim_rng.pt"),
                {"model": {"blocks.0.attn.linear_qkv.lora_A.default.weight": torch.zeros(4, 8)},
                 "checkpoint_version": 3.0})
    refused(capsys, out, "is a checkpoint of MindSpeed-MM's own LoRA (peft adapters)",
            "lora_mm_to_hf", "--cfg.source_path", peft, "--cfg.target_path", out)


def test_targets_are_refused_before_any_work(trained, tmp_path, capsys):
    ckpt, base, _ = trained
    lora_out, merged = tmp_path / "lora", tmp_path / "merged"
    converter = QwenImageConverter()  # not through the CLI: MindSpeed-MM's builds every converter's parser per call
    converter.lora_mm_to_hf(LoraMmToHfConfig(str(ckpt), str(lora_out)))
    converter.merge_lora_to_base(MergeLoraToBaseConfig(str(ckpt), str(merged), source_path=str(base)))
    before = (lora_out / LORA_FILE).read_bytes()
    refused(capsys, lora_out, f"target {lora_out} already exists: remove it or pass --cfg.overwrite true",
            "lora_mm_to_hf", "--cfg.source_path", ckpt, "--cfg.target_path", lora_out)
    refused(capsys, merged, f"target {merged} already exists: remove it or pass --cfg.overwrite true",
            "merge_lora_to_base", "--cfg.source_path", base, "--cfg.lora_path", ckpt, "--cfg.target_path", merged)
    assert (lora_out / LORA_FILE).read_bytes() == before
    cli("lora_mm_to_hf", source_path=ckpt, target_path=lora_out, overwrite="true")
    cli("merge_lora_to_base", source_path=base, lora_path=ckpt, target_path=merged, overwrite="true")
    assert (lora_out / LORA_FILE).read_bytes() == before
    # overwrite replaces only what the verb writes
    refused(capsys, merged, "refusing to overwrite", "lora_mm_to_hf", "--cfg.source_path", ckpt,
            "--cfg.target_path", merged, "--cfg.overwrite", "true")
    refused(capsys, ckpt, "is not the converter's to replace: it holds training iterations",
            "merge_lora_to_base", "--cfg.source_path", base, "--cfg.lora_path", ckpt, "--cfg.target_path", ckpt,
            "--cfg.overwrite", "true")
    refused(capsys, ckpt / "hf", "is inside the source", "lora_mm_to_hf", "--cfg.source_path", ckpt,
            "--cfg.target_path", ckpt / "hf")
    refused(capsys, base, f"target_path {base} is the source: the merged weights would replace",
            "merge_lora_to_base", "--cfg.source_path", base, "--cfg.lora_path", ckpt, "--cfg.target_path", base)
    refused(capsys, tmp_path / "z", "ep_size 2: Qwen-Image has no experts", "merge_lora_to_base", "--cfg.lora_path",
            ckpt, "--cfg.target_path", tmp_path / "z", "--cfg.target_parallel_config.ep_size", "2")
    refused(capsys, tmp_path / "z", "--cfg.lora_path x: QwenImageConverter converts whole Qwen-Image weights; LoRA "
            "weights are not supported (LoRA checkpoints: lora_mm_to_hf, merge_lora_to_base)",
            "hf_to_mm", "--cfg.source_path", base, "--cfg.target_path", tmp_path / "z", "--cfg.lora_path", "x")
