"""LoRA interchange on the tiny pipeline: a LoRA run's adapters as a diffusers LoRA file
(`lora_mm_to_hf`, loaded by FluxPipeline.load_lora_weights), merged into the base
(`merge_lora_to_base`, exported with mm_to_hf), and diffusers / PEFT LoRA files as the starting
adapter (--lora-load)."""
import logging
import os

import pytest
import torch
from diffusers import FluxPipeline, FluxTransformer2DModel
from safetensors.torch import load_file

from converters.convert_cli import main
from mm_grpo.families.flux.transformer import FluxConfig, lora
from mm_grpo.families.flux.transformer.lora_hf import LORA_FILE, read_diffusers_lora
from tests.fixtures import parallel_1proc, peft_without_mindspeed_te_dummies  # noqa: F401
from tests.grpo_helpers import SMOOTH_REWARD, grpo_argv, run_grpo, write_configs
from tests.utils import assert_one_line_error, make_inputs, reference_output, rel_err

TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "linear_in", "linear_out", "adaln"]
LORA = ["--lora-target-modules", *TARGETS, "--lora-r", "4", "--lora-alpha", "8"]


pytestmark = pytest.mark.usefixtures("peft_without_mindspeed_te_dummies")  # the reference side: diffusers + peft


def cli(verb, **options):
    args = ["FluxConverter", verb]
    for k, v in options.items():
        args += [f"--cfg.{k}", str(v)]
    main(args)


@pytest.fixture(scope="module")
def trained(parallel_1proc, tiny_pipeline_dir, tmp_path_factory):
    """A TP2 x PP2 base (hf_to_mm of the tiny pipeline's transformer) and a LoRA run's checkpoint on it."""
    root = tmp_path_factory.mktemp("lora_convert")
    base = root / "base"
    main(["FluxConverter", "hf_to_mm", "--cfg.source_path", str(tiny_pipeline_dir / "transformer"),
          "--cfg.target_path", str(base), "--cfg.target_parallel_config.tp_size", "2",
          "--cfg.target_parallel_config.pp_layers", "[2,4]"])
    cfg = write_configs(root / "cfg", tiny_pipeline_dir, reward=SMOOTH_REWARD)
    _, run = run_grpo(grpo_argv(*cfg, iters=2, extra=LORA + ["--lr", "1e-2", "--load", str(base),
                                                              "--save", str(root / "ckpt")]))
    return base, root / "ckpt", run


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_merged_model_equals_diffusers_with_the_lora_loaded(trained, tiny_pipeline_dir, tmp_path):
    base, ckpt, run = trained
    cli("lora_mm_to_hf", source_path=ckpt, target_path=tmp_path / "lora")
    cli("merge_lora_to_base", source_path=base, lora_path=ckpt, target_path=tmp_path / "merged")
    # the base's sharded layout
    assert sorted(os.listdir(tmp_path / "merged" / "release")) == sorted(os.listdir(base / "release"))
    cli("mm_to_hf", source_path=tmp_path / "merged", target_path=tmp_path / "merged_hf")

    pipe = FluxPipeline.from_pretrained(tiny_pipeline_dir)
    records = _Records()
    logging.getLogger("diffusers").addHandler(records)
    try:
        pipe.load_lora_weights(str(tmp_path / "lora"))
    finally:
        logging.getLogger("diffusers").removeHandler(records)
    # no unmatched or unexpected keys: only the notice that the file has no text-encoder LoRA
    assert [m for m in records.messages if not m.startswith("No LoRA keys associated to CLIPTextModel")] == []
    from peft.utils import get_peft_model_state_dict
    written = load_file(tmp_path / "lora" / LORA_FILE)
    # diffusers modules: 2 double blocks x 2 streams x (q, k, v, out, 2 MLP, adaLN), 4 single blocks x
    # (q, k, v, proj_mlp, proj_out, adaLN), the final adaLN; A and B each
    assert len(written) == 2 * (2 * 2 * 7 + 4 * 6 + 1)
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name=pipe.transformer.active_adapters()[0])
    assert {f"transformer.{k}" for k in loaded} == set(written)
    assert all(torch.equal(v, written[f"transformer.{k}"]) for k, v in loaded.items())
    merged = FluxTransformer2DModel.from_pretrained(tmp_path / "merged_hf")
    inputs = make_inputs(run.config, batch=2, height=4, width=4, txt_len=32)
    with torch.no_grad():
        with_lora = reference_output(pipe.transformer, inputs)
        pipe.transformer.disable_lora()
        base_out = reference_output(pipe.transformer, inputs)
        merged_out = reference_output(merged, inputs)
    assert rel_err(merged_out, with_lora) <= 1e-5
    assert rel_err(merged_out, base_out) > 1e-3  # the adapter learned something


def test_whole_weight_verbs_refuse_a_lora_checkpoint(trained, tmp_path, capsys):
    _, ckpt, _ = trained
    with pytest.raises(SystemExit) as info:
        cli("mm_to_hf", source_path=ckpt, target_path=tmp_path / "hf")
    assert info.value.code == 1 and not (tmp_path / "hf").exists()
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("mm-convert: error: ") and "is a LoRA training checkpoint (adapters only)" in err


def test_exported_lora_loads_back_as_the_same_adapters(trained, tmp_path):
    _, ckpt, run = trained
    cli("lora_mm_to_hf", source_path=ckpt, target_path=tmp_path / "lora")
    config = lora.LoRAConfig(4, 8.0, tuple(TARGETS))
    loaded = read_diffusers_lora(str(tmp_path / "lora"), run.config, config)
    params = dict(run.model.modules[0].named_parameters())
    for base in lora.base_rules(run.config, TARGETS):
        for rule, tensor in zip(lora.adapter_rules(base), loaded[base.hf[0]]):
            assert torch.equal(tensor, params[rule.megatron]), rule.megatron  # alpha / r = 2: exact


def test_a_peft_lora_made_elsewhere_is_the_starting_adapter(parallel_1proc, tiny_pipeline_dir, tmp_path):
    """A PEFT LoRA on diffusers' separate to_q / to_k / to_v (their own A's) through --lora-load: the
    Megatron model's output equals diffusers' with the LoRA."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    hf = FluxTransformer2DModel.from_pretrained(tiny_pipeline_dir / "transformer")
    hf.add_adapter(LoraConfig(r=2, lora_alpha=2, init_lora_weights="gaussian",
                              target_modules=["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj",
                                              "add_v_proj", "to_add_out", "proj_out", "proj_mlp"]))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "lora_B" in name:  # FLUX's final proj_out matches "proj_out" too: not one of ours, left at zero
                p.copy_(0 * p if name.startswith("proj_out.") else torch.randn(p.shape, generator=g) * 0.05)
    state = {k: v for k, v in get_peft_model_state_dict(hf).items() if not k.startswith("proj_out.")}
    FluxPipeline.save_lora_weights(tmp_path / "peft", transformer_lora_layers=state)
    targets = ["linear_qkv", "linear_proj", "linear_in", "linear_out"]
    cfg = write_configs(tmp_path / "cfg", tiny_pipeline_dir, reward=SMOOTH_REWARD)
    _, run = run_grpo(grpo_argv(*cfg, iters=0, extra=["--lora-target-modules", *targets,
                                                       "--lora-load", str(tmp_path / "peft")]))
    model = run.model.modules[0]
    assert model.double_blocks[0].img_attn.linear_qkv.lora_A.weight.shape[0] == 6  # 3 parts x rank 2
    assert model.single_blocks[0].linear_in.lora_A.weight.shape[0] == 8  # to_q, to_k, to_v, proj_mlp
    assert model.double_blocks[0].img_attn.linear_proj.lora_A.weight.shape[0] == 2
    inputs = make_inputs(run.config, batch=2, height=4, width=4, txt_len=32)
    with torch.no_grad():
        ours = model(**inputs)
        theirs = reference_output(hf, inputs)
    assert rel_err(ours, theirs) <= 1e-5


def test_bad_lora_files_are_refused(parallel_1proc, tiny_pipeline_dir, tmp_path):
    from safetensors.torch import save_file
    config = FluxConfig.preset("tiny")
    lora_config = lora.LoRAConfig(targets=("linear_qkv",))
    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 64),
               "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(64, 2),
               "transformer.proj_out.lora_A.weight": torch.zeros(2, 64)}, tmp_path / "x.safetensors")
    assert_one_line_error(lambda: read_diffusers_lora(str(tmp_path / "x.safetensors"), config, lora_config),
                          "1 tensors are not LoRAs of --lora-target-modules linear_qkv")
    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 63),
               "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(64, 2)},
              tmp_path / "y.safetensors")
    assert_one_line_error(lambda: read_diffusers_lora(str(tmp_path / "y.safetensors"), config, lora_config),
                          "the LoRA of transformer_blocks.0.attn.to_q has A")
    assert_one_line_error(lambda: read_diffusers_lora(str(tmp_path / "none"), config, lora_config),
                          "no such LoRA file", FileNotFoundError)
