"""LoRA on the Megatron Qwen-Image (fp32, CPU, one process) against diffusers' QwenImageTransformer2DModel
with the same adapters injected by peft: outputs and adapter gradients to 1e-5; the diffusers LoRA file
`to_diffusers` writes loaded by QwenImagePipeline.load_lora_weights, and read back exactly; a PEFT LoRA
saved by diffusers (separate q / k / v adapters) read as the starting adapter; the settings refused in
one line. TP x PP against this one process: tests/distributed/checks_qwen_image.py."""
import logging

import pytest
import torch
from safetensors.torch import save_file

from mm_grpo.families.qwen_image.transformer import QwenImageTransformer, lora
from mm_grpo.families.qwen_image.transformer.hf_weights import expected_hf_shapes, load_hf_weights
from mm_grpo.families.qwen_image.transformer.lora_hf import LORA_FILE, read_diffusers_lora, to_diffusers
from tests.fixtures import parallel_1proc, peft_without_mindspeed_te_dummies  # noqa: F401
from tests.qwen_image_utils import TINY, make_inputs, random_reference, reference_output
from tests.utils import assert_one_line_error, rel_err

TOL = 1e-5
# alpha / r = 2: a power of two, so B * (alpha / r) in the file and back is exact
ALL = lora.LoRAConfig(r=4, alpha=8.0, targets=tuple(lora.TARGETS))
HEADS = TINY.num_attention_heads
# the last block's text projection and MLP feed nothing (blocks.py): no gradient in either model
UNUSED = {f"transformer_blocks.{TINY.num_layers - 1}.{m}"
          for m in ("attn.to_add_out", "txt_mlp.net.0.proj", "txt_mlp.net.2")}


def _model(ref):
    return load_hf_weights(QwenImageTransformer(TINY), ref.state_dict())


def _modules(base):
    """The diffusers modules a base weight rule stands for."""
    return [h[:-len(".weight")] for h in base.hf]


def _split(base, b):
    """Our whole B -> diffusers' per-module B's: the fused q / k / v rows are [q_h, k_h, v_h] per head
    (written out here, not taken from the layout under test)."""
    if base.merge == "same":
        return [b]
    return [t.flatten(0, 1) for t in b.unflatten(0, (HEADS, 3, -1)).unbind(1)]


def _fuse(base, parts):
    if base.merge == "same":
        return parts[0]
    return torch.stack([p.unflatten(0, (HEADS, -1)) for p in parts], dim=1).flatten(0, 2)


def random_adapters(config, seed=5, std=0.2):
    """Whole random adapters {base weight's first diffusers name: (A, B)}, B non-zero unlike a new one's."""
    shapes = expected_hf_shapes(TINY)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for base in lora.base_rules(TINY, config.targets):
        rows, cols = sum(shapes[h][0] for h in base.hf), shapes[base.hf[0]][1]
        out[base.hf[0]] = (torch.randn(config.r, cols, generator=g) * std,
                           torch.randn(rows, config.r, generator=g) * std)
    return out


def adapted_model(ref, config, full):
    model = _model(ref)
    lora.add_adapters(model, config, seed=1)
    lora.copy_full_adapters(model, full, config)
    return model


def with_peft_adapters(ref, config, full):
    """`ref` with peft's LoRA on the same diffusers modules, holding the same A (shared by q / k / v) and B."""
    from peft import LoraConfig
    bases = list(lora.base_rules(TINY, config.targets))
    ref.add_adapter(LoraConfig(r=config.r, lora_alpha=config.alpha,
                               target_modules=[m for base in bases for m in _modules(base)]))
    with torch.no_grad():
        for base in bases:
            a, b = full[base.hf[0]]
            for module, b_part in zip(_modules(base), _split(base, b)):
                layer = ref.get_submodule(module)
                layer.lora_A["default"].weight.copy_(a)
                layer.lora_B["default"].weight.copy_(b_part)
    return ref


def test_new_adapters_give_the_base_output_bit_for_bit(parallel_1proc):
    model = _model(random_reference(TINY, seed=3))
    inputs = make_inputs(TINY, lengths=(6, 2), height=3, width=4)
    with torch.no_grad():
        base = model(**inputs)
        lora.add_adapters(model, ALL, seed=1)
        assert torch.equal(model(**inputs), base)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    # 2 blocks x 2 streams x (qkv, proj, fc1, fc2, adaLN) + the head's adaLN; A and B each
    assert len(trainable) == 2 * (TINY.num_layers * 2 * 5 + 1)
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    params = dict(model.named_parameters())
    assert all(params[n].abs().max() > 0 if ".lora_A." in n else not params[n].any() for n in trainable)


def test_adapters_match_diffusers_with_peft_outputs_and_gradients(parallel_1proc, peft_without_mindspeed_te_dummies):
    ref = random_reference(TINY, seed=4)
    full = random_adapters(ALL)
    model = adapted_model(ref, ALL, full)
    peft_ref = with_peft_adapters(ref, ALL, full)
    inputs = make_inputs(TINY, lengths=(6, 2), height=3, width=4, seed=2)
    weight = torch.randn(2, 12, TINY.output_channels, generator=torch.Generator().manual_seed(3))
    out, expected = model(**inputs), reference_output(peft_ref, inputs)
    assert rel_err(out.detach(), expected.detach()) <= TOL
    with torch.no_grad(), lora.adapters_disabled([model]):
        peft_ref.disable_adapters()
        assert rel_err(out.detach(), model(**inputs)) > 1e-2  # the adapters change the output
        assert rel_err(model(**inputs), reference_output(peft_ref, inputs)) <= TOL
        peft_ref.enable_adapters()
    (out * weight).sum().backward()
    (expected * weight).sum().backward()

    params = dict(model.named_parameters())
    errs, no_grad = {}, set()
    for base in lora.base_rules(TINY, ALL.targets):
        rule_a, rule_b = lora.adapter_rules(base)
        layers = [peft_ref.get_submodule(m) for m in _modules(base)]
        grads_a = [layer.lora_A["default"].weight.grad for layer in layers]
        grads_b = [layer.lora_B["default"].weight.grad for layer in layers]
        ours_a, ours_b = params[rule_a.megatron].grad, params[rule_b.megatron].grad
        if grads_a[0] is None:
            no_grad.add(_modules(base)[0])
            assert ours_a is None and ours_b is None, base.megatron
            continue
        errs[rule_a.megatron] = rel_err(ours_a, sum(grads_a))  # one A shared by q / k / v: their gradients add
        errs[rule_b.megatron] = rel_err(ours_b, _fuse(base, grads_b))
    assert no_grad == UNUSED
    assert len(errs) == 2 * (TINY.num_layers * 2 * 5 + 1 - len(UNUSED))
    worst = max(errs, key=errs.get)
    assert errs[worst] <= TOL, worst
    assert all(p.grad is None for n, p in params.items() if ".lora_" not in n)  # the base is frozen


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_the_diffusers_file_loads_in_qwen_image_pipeline_and_reads_back_exactly(
        parallel_1proc, peft_without_mindspeed_te_dummies, tmp_path):
    """QwenImagePipeline.load_lora_weights reads the transformer only: the pipeline is built with it and
    the scheduler (no text encoder, tokenizer or VAE, which the loading never touches)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    from peft.utils import get_peft_model_state_dict
    ref = random_reference(TINY, seed=6)
    full = random_adapters(ALL, seed=7)
    model = adapted_model(ref, ALL, full)
    (tmp_path / "lora").mkdir()
    written = to_diffusers(full, TINY, ALL)
    save_file(written, tmp_path / "lora" / LORA_FILE)
    # diffusers modules: 2 blocks x 2 streams x (q, k, v, out, 2 MLP, modulation), the head's adaLN; A and B each
    assert len(written) == 2 * (TINY.num_layers * 2 * 7 + 1)
    block = "transformer.transformer_blocks.0.attn."
    assert all(torch.equal(written[f"{block}to_q.lora_A.weight"], written[f"{block}{m}.lora_A.weight"])
               for m in ("to_k", "to_v"))

    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None,
                             tokenizer=None, transformer=ref)
    records = _Records()
    logging.getLogger("diffusers").addHandler(records)
    try:
        pipe.load_lora_weights(str(tmp_path / "lora"))
    finally:
        logging.getLogger("diffusers").removeHandler(records)
    assert records.messages == []  # no unmatched or unexpected keys
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name=pipe.transformer.active_adapters()[0])
    assert {f"transformer.{k}" for k in loaded} == set(written)
    inputs = make_inputs(TINY, lengths=(5, 3), height=4, width=3, seed=8)
    with torch.no_grad():
        ours = model(**inputs)
        theirs = reference_output(pipe.transformer, inputs)
        pipe.transformer.disable_lora()
        base = reference_output(pipe.transformer, inputs)
    assert rel_err(ours, theirs) <= TOL
    assert rel_err(theirs, base) > 1e-2

    back = read_diffusers_lora(str(tmp_path / "lora"), TINY, ALL)
    assert back.keys() == full.keys()
    assert all(torch.equal(back[k][0], a) and torch.equal(back[k][1], b) for k, (a, b) in full.items())


def test_a_peft_lora_saved_by_diffusers_is_the_starting_adapter(parallel_1proc, peft_without_mindspeed_te_dummies,
                                                                 tmp_path):
    """diffusers' own LoRA (peft's separate to_q / to_k / to_v adapters, their own A's; alpha / r in the
    file's metadata) read by read_diffusers_lora: q / k / v as one adapter of their summed rank, and the
    Megatron model's output is diffusers'."""
    from diffusers import QwenImagePipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    ref = random_reference(TINY, seed=9)
    model = _model(ref)
    peft_config = LoraConfig(r=2, lora_alpha=3, init_lora_weights="gaussian",
                             target_modules=["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj",
                                             "add_v_proj", "to_add_out", "img_mlp.net.2", "txt_mlp.net.2"])
    ref.add_adapter(peft_config)
    g = torch.Generator().manual_seed(10)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    QwenImagePipeline.save_lora_weights(tmp_path / "peft", transformer_lora_layers=get_peft_model_state_dict(ref),
                                        transformer_lora_adapter_metadata=peft_config.to_dict())
    config = lora.LoRAConfig(r=4, alpha=4.0, targets=("linear_qkv", "linear_proj", "linear_fc2"))
    loaded = read_diffusers_lora(str(tmp_path / "peft"), TINY, config)
    lora.add_adapters(model, config, seed=1, ranks={name: a.shape[0] for name, (a, _) in loaded.items()})
    lora.copy_full_adapters(model, loaded, config)
    assert model.blocks[0].img_attn.linear_qkv.lora_A.weight.shape[0] == 6  # 3 parts x rank 2
    assert model.blocks[0].txt_mlp.linear_fc2.lora_A.weight.shape[0] == 2
    inputs = make_inputs(TINY, lengths=(4, 7), height=2, width=5, seed=11)
    with torch.no_grad():
        ours = model(**inputs)
        theirs = reference_output(ref, inputs)
        ref.disable_adapters()
        base = reference_output(ref, inputs)
    assert rel_err(ours, theirs) <= TOL
    assert rel_err(theirs, base) > 1e-2


@pytest.mark.parametrize("kwargs, match", [
    (dict(targets=("to_q",)), r"^unknown --lora-target-modules \['to_q'\]; choose from \['adaln', 'linear_fc1', "
                              r"'linear_fc2', 'linear_proj', 'linear_qkv'\]$"),
    (dict(targets=("linear_in",)), r"^unknown --lora-target-modules \['linear_in'\]"),  # FLUX's single blocks only
    (dict(targets=()), "^LoRA needs at least one target module$"),
    (dict(r=0), r"^--lora-r must be >= 1, got 0$"),
    (dict(dropout=1.0), r"^--lora-dropout must be in \[0, 1\), got 1.0$"),
])
def test_bad_lora_settings_are_refused_in_one_line(kwargs, match):
    assert_one_line_error(lambda: lora.LoRAConfig(**kwargs), match)


def test_defaults_are_the_recommended_targets_and_files_of_other_modules_are_refused(tmp_path):
    assert lora.LoRAConfig().targets == lora.RECOMMENDED_TARGETS == ("linear_qkv", "linear_proj", "linear_fc1",
                                                                      "linear_fc2")
    config = lora.LoRAConfig(targets=("linear_qkv",))
    dim = TINY.hidden_size
    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, dim),
               "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(dim, 2),
               "transformer.img_in.lora_A.weight": torch.zeros(2, TINY.in_channels)}, tmp_path / "x.safetensors")
    assert_one_line_error(lambda: read_diffusers_lora(str(tmp_path / "x.safetensors"), TINY, config),
                          "1 tensors are not LoRAs of --lora-target-modules linear_qkv")
    assert_one_line_error(lambda: read_diffusers_lora(str(tmp_path / "none"), TINY, config),
                          "no such LoRA file", FileNotFoundError)
