"""The bf16 layout of the FLUX blocks, counted on CPU: what a block forward moves besides its GEMMs.

On an accelerator the element-wise work of a block (norms, modulation, QK norm and RoPE, GELU,
residuals, copies, casts) runs at memory speed, so its bytes are its time. `bench.traffic.Traffic`
counts them per aten op; these tests hold one double and one single block under --bf16, as the
trainer runs them (LoRA on the recommended targets over a frozen bf16 base), to budgets, and to
diffusers' own bf16 blocks of the same shape measured in the same test.

Measured (bytes per token x hidden element, the shapes below; `python -m pytest tests/test_dtype_layout.py -s`
prints them): double block 122, single block 92; diffusers' bf16 blocks 265 and 250; mm-grpo's
earlier fp32-residual autocast layout 287 and 267.
"""
import pytest
import torch

from bench.traffic import Traffic
from mm_grpo import kernels
from mm_grpo.families.flux.transformer import FluxConfig, FluxTransformer, lora
from tests.fixtures import parallel_1proc  # noqa: F401

# Two heads of FLUX's head_dim: the widths and per-head layout of FLUX, small enough for a CPU.
CONFIG = FluxConfig.preset("tiny").replace(num_attention_heads=2, attention_head_dim=128,
                                           axes_dims_rope=(16, 56, 56), bf16=True)
BATCH, TXT, IMG = 2, 64, 256
# Budgets: bytes per token x hidden element of one block forward, element-wise and copies (casts
# included); measured 122 and 92, so a regression of one activation-sized pass (4-6) fails.
BUDGET = {"double_blocks": 126, "single_blocks": 96}
# Against diffusers' bf16 block of the same shape (measured 0.46 and 0.37).
RATIO_TO_DIFFUSERS = {"double_blocks": 0.5, "single_blocks": 0.4}


def _units():
    return (TXT + IMG) * BATCH * CONFIG.hidden_size


def _inputs(model):
    rope = kernels.rope_table(*model.rope(torch.zeros(TXT, 3), torch.randn(IMG, 3)))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(TXT + IMG, BATCH, CONFIG.hidden_size, generator=g).bfloat16()
    vec = torch.randn(BATCH, CONFIG.hidden_size, generator=g).bfloat16()
    return x, vec, rope


def _trainer_model():
    """As the trainer builds a --bf16 LoRA run: adapters on the recommended targets, base frozen in bf16."""
    model = FluxTransformer(CONFIG)
    lora.add_adapters(model, lora.LoRAConfig(r=8, alpha=8), seed=0)
    lora.freeze_base_in_bf16(model)
    return model


def _diffusers_traffic(kind):
    from diffusers import FluxTransformer2DModel
    ref = FluxTransformer2DModel(**CONFIG.to_diffusers_config()).to(torch.bfloat16).eval()
    block = (ref.transformer_blocks if kind == "double_blocks" else ref.single_transformer_blocks)[0]
    g = torch.Generator().manual_seed(0)
    img = torch.randn(BATCH, IMG, CONFIG.hidden_size, generator=g).bfloat16()
    txt = torch.randn(BATCH, TXT, CONFIG.hidden_size, generator=g).bfloat16()
    temb = torch.randn(BATCH, CONFIG.hidden_size, generator=g).bfloat16()
    rope = ref.pos_embed(torch.cat([torch.zeros(TXT, 3), torch.randn(IMG, 3)]))
    with torch.no_grad(), Traffic() as t:
        block(img, txt, temb, rope)
    return t


def _non_gemm(t: Traffic) -> float:
    return (t.bytes("elementwise") + t.bytes("copy") + t.bytes("cast")) / _units()


@pytest.mark.parametrize("kind", ["double_blocks", "single_blocks"])
def test_a_bf16_block_moves_half_the_bytes_of_diffusers_and_casts_no_weight(parallel_1proc, kind):
    model = _trainer_model()
    block = getattr(model, kind)[0]
    x, vec, rope = _inputs(model)
    frozen = {p.data_ptr() for p in model.parameters() if not p.requires_grad and p.dim() >= 2}
    cast_inputs = []

    class Casts(Traffic):  # also records what every cast reads
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("_to_copy", "copy_") and isinstance(args[0], torch.Tensor):
                cast_inputs.append(args[0].data_ptr())
            return super().__torch_dispatch__(func, types, args, kwargs)

    with torch.no_grad(), Casts() as t:
        out = block(x, TXT, vec, rope)
    assert out.dtype == torch.bfloat16  # the residual stream stays in the compute dtype
    assert not frozen & set(cast_inputs), "a frozen bf16 base weight was cast"
    # The one activation-sized cast: q and k back to bf16 after their fp32 norm + RoPE chain
    # (2 of the 3 qkv widths x (4 read + 2 written) = 12); LoRA's A and B are r x D.
    assert t.bytes("cast") / _units() <= 12 + 3
    ours, theirs = _non_gemm(t), _non_gemm(_diffusers_traffic(kind))
    print(f"\n{kind}: {ours:.1f} bytes per token x hidden element, diffusers' bf16 {theirs:.1f}\n{t.summary()}")
    assert ours <= BUDGET[kind]
    assert ours <= RATIO_TO_DIFFUSERS[kind] * theirs


def test_the_counter_sees_a_cast_and_an_extra_pass():
    """The instrument itself: an fp32 round trip is two casts of 6 bytes per element, an addcmul of
    three same-size bf16 tensors is 8, a broadcast [B, D] operand counts once."""
    x = torch.randn(64, 4, 32).bfloat16()
    n = x.numel()
    with Traffic() as t:
        x.float().bfloat16()
    assert (t.count("cast"), t.bytes("cast")) == (2, 12 * n)
    with Traffic() as t:
        torch.addcmul(x, x, x)
    assert t.bytes("elementwise") == 8 * n
    with Traffic() as t:
        torch.addcmul(x, x[:1, :, :].expand_as(x), x)
    assert t.bytes("elementwise") == 6 * n + 2 * x[0].numel()
    with Traffic() as t:  # an out= tensor is written, not read; a copy_ reads its source only
        torch.mul(x.float(), 2.0, out=torch.empty_like(x))
        torch.empty_like(x).copy_(x)
    assert t.bytes("elementwise") == 6 * n and t.bytes("copy") == 4 * n
