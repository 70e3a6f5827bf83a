"""LoRA on the Megatron FLUX (single process): a new adapter leaves the output bit for bit, only
adapters train, adapters off is the base, and the argument checks."""
import pytest
import torch

from mm_grpo.families.flux.family import FAMILY as FLUX
from mm_grpo.families.flux.transformer import FluxConfig, FluxTransformer, lora
from mm_grpo.families.flux.transformer.hf_weights import load_hf_weights
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.utils import assert_one_line_error, make_inputs, random_adapters, random_reference, rel_err

CONFIG = FluxConfig.preset("tiny")
ALL = lora.LoRAConfig(r=4, alpha=8, targets=tuple(lora.TARGETS))


def _model(seed=3):
    return load_hf_weights(FluxTransformer(CONFIG), random_reference(CONFIG, seed=seed).state_dict())


def _model_inputs_and_base_output():
    model = _model()
    inputs = make_inputs(CONFIG, batch=2, height=3, width=4, txt_len=5)
    with torch.no_grad():
        return model, inputs, model(**inputs)


def test_new_adapters_give_the_base_output_bit_for_bit(parallel_1proc):
    model, inputs, base = _model_inputs_and_base_output()
    with torch.no_grad():
        lora.add_adapters(model, ALL, seed=1)
        assert torch.equal(model(**inputs), base)


def test_only_adapters_train_and_adapters_off_is_the_base(parallel_1proc):
    model, inputs, base = _model_inputs_and_base_output()
    lora.add_adapters(model, ALL, seed=1)
    lora.copy_full_adapters(model, random_adapters(model, ALL), ALL)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    # every target linear: 2 double blocks x 2 streams x (qkv, proj, fc1, fc2, adaLN) + single blocks x 3 + final adaLN
    n_linears = CONFIG.num_layers * 2 * 5 + CONFIG.num_single_layers * 3 + 1
    assert len(trainable) == 2 * n_linears and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    out = model(**inputs)
    assert rel_err(out.detach(), base) > 1e-3  # the adapters change the output
    out.square().sum().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)
    assert all(p.grad.abs().max() > 0 for n, p in model.named_parameters() if n in trainable)
    with torch.no_grad(), lora.adapters_disabled([model]):
        assert torch.equal(model(**inputs), base)
    with torch.no_grad():
        assert torch.equal(lora.AdaptersOff(model)(**inputs), base)
        assert torch.equal(model(**inputs), out.detach())  # back on afterwards


def test_adapter_is_the_low_rank_update_of_the_weight(parallel_1proc):
    """W x + (alpha / r) B A x: folding (alpha / r) B A into W gives the same output."""
    model = _model()
    inputs = make_inputs(CONFIG, batch=1, height=2, width=3, txt_len=4)
    lora.add_adapters(model, ALL, seed=1)
    lora.copy_full_adapters(model, random_adapters(model, ALL), ALL)
    with torch.no_grad():
        out = model(**inputs)
        for name, module in model.named_modules():
            if module.__dict__.get("adapter") is not None:
                module.weight += ALL.scaling * module.lora_B.weight @ module.lora_A.weight
        with lora.adapters_disabled([model]):
            merged = model(**inputs)
    assert rel_err(merged, out) < 1e-5


@pytest.mark.parametrize("kwargs, match", [
    (dict(targets=("to_q",)), "unknown --lora-target-modules"),
    (dict(r=0), "--lora-r must be >= 1"),
    (dict(dropout=1.0), "--lora-dropout must be in"),
])
def test_bad_lora_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lora.LoRAConfig(**kwargs)


def _parse(*extra, folder="missing"):
    from mm_grpo.training.arguments import parse_args
    return parse_args(["--train-iters", "1", "--mm-model", f"{folder}/model.json", "--mm-data", f"{folder}/data.json",
                       *extra])


# alpha and dropout at their default values: still given
@pytest.mark.parametrize("flag, value", [("--lora-r", "4"), ("--lora-alpha", str(lora.LoRAConfig.alpha)),
                                         ("--lora-dropout", str(lora.LoRAConfig.dropout)),
                                         ("--lora-load", "x.safetensors")])
def test_an_adapter_flag_without_target_modules_is_refused_at_parsing(flag, value):
    """It would train the full model. The config files do not exist: the error comes before they are read."""
    assert_one_line_error(lambda: _parse(flag, value), f"^{flag} given without --lora-target-modules: add "
                          r"--lora-target-modules \(e\.g\. linear_qkv linear_proj .*\), or drop " + flag)


def test_every_adapter_flag_given_is_named():
    assert_one_line_error(lambda: _parse("--lora-dropout", "0.1", "--lora-r", "4"),
                          "^--lora-r, --lora-dropout given without --lora-target-modules")


def test_adapter_flags_with_target_modules_make_the_config(tmp_path):
    from mm_grpo.training import arguments
    for name in ("model.json", "data.json"):
        (tmp_path / name).write_text("{}")
    targets = ["--lora-target-modules", "linear_qkv", "linear_in"]
    args = _parse(*targets, "--lora-r", "4", "--lora-alpha", "2", "--lora-dropout", "0.1", "--lora-load",
                  "x.safetensors", folder=tmp_path)
    assert arguments.lora_config(args, FLUX) == lora.LoRAConfig(4, 2.0, ("linear_qkv", "linear_in"), 0.1)
    assert args.lora_load == "x.safetensors"
    defaults = lora.LoRAConfig(targets=("linear_qkv", "linear_in"))
    assert arguments.lora_config(_parse(*targets, folder=tmp_path), FLUX) == defaults
    assert arguments.lora_config(_parse(folder=tmp_path), FLUX) is None


def test_frozen_base_in_bf16_leaves_the_bf16_output_unchanged(parallel_1proc):
    """Under --bf16 the linears compute in bf16, casting an fp32 weight or bias for the call: the frozen
    base held in bf16 (matrices and biases) changes no bit; adapters and QK-norm weights stay fp32."""
    config = CONFIG.replace(bf16=True)
    model = load_hf_weights(FluxTransformer(config), random_reference(CONFIG, seed=3).state_dict())
    lora.add_adapters(model, ALL, seed=1)
    lora.copy_full_adapters(model, random_adapters(model, ALL), ALL)
    inputs = make_inputs(CONFIG, batch=2, height=3, width=4, txt_len=5)
    with torch.no_grad():
        before = model(**inputs)
        lora.freeze_base_in_bf16(model)
        after = model(**inputs)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert all(d == torch.float32 for n, d in dtypes.items() if ".lora_" in n or n.endswith("norm.weight"))
    assert all(d == torch.bfloat16 for n, d in dtypes.items() if ".lora_" not in n and n.endswith("bias"))
    assert dtypes["double_blocks.0.img_attn.linear_qkv.weight"] == torch.bfloat16
    assert torch.equal(after, before)
