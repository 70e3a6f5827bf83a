"""mm_grpo/kernels.py: the torch kernels against diffusers, and the torch / torch_npu selection."""
import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.normalization import RMSNorm

from mm_grpo import kernels
from mm_grpo.models.flux import FluxConfig, FluxTransformer
from mm_grpo.models.flux.embeddings import rope_tables
from mm_grpo.pipeline.latents import prepare_latent_image_ids
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.utils import make_inputs, rel_err

S_TXT, GRID, AXES = 5, (3, 4), (4, 6, 6)


@pytest.fixture
def restore_kernels():
    yield
    kernels.select_kernels("cpu")


def _tables():
    ids = torch.cat([torch.zeros(S_TXT, 3), prepare_latent_image_ids(*GRID)])
    return rope_tables(ids, AXES, 10000)


# --- torch kernels against diffusers -------------------------------------------------------
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_rope_matches_diffusers_values_and_gradients(dtype, tol):
    cos, sin = _tables()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(cos.shape[0], 2, 3, sum(AXES), generator=g).to(dtype)  # [S, B, H, d]
    ours_in, ref_in = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours = kernels.rope_torch(ours_in, kernels.rope_table_torch(cos, sin))
    # diffusers takes [B, S, H, d] with sequence_dim=1.
    ref = apply_rotary_emb(ref_in.transpose(0, 1), (cos, sin), sequence_dim=1).transpose(0, 1)
    assert ours.dtype == dtype and ours.shape == x.shape
    assert rel_err(ours.float(), ref.float()) <= tol
    weight = torch.randn(x.shape, generator=g)
    (ours.float() * weight).sum().backward()
    (ref.float() * weight).sum().backward()
    assert rel_err(ours_in.grad.float(), ref_in.grad.float()) <= tol


def test_rope_accepts_strided_views():
    """q, k, v are views into the fused projection: not contiguous."""
    cos, sin = _tables()
    qkv = torch.randn(cos.shape[0], 2, 3, 3 * sum(AXES))
    q = qkv[..., :sum(AXES)]
    table = kernels.rope_table_torch(cos, sin)
    assert torch.equal(kernels.rope_torch(q, table), kernels.rope_torch(q.contiguous(), table))


@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                              (torch.bfloat16, torch.bfloat16)])
def test_rms_norm_matches_diffusers(x_dtype, w_dtype):
    g = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(7, 2, 3, 16, generator=g)).to(x_dtype)
    ref = RMSNorm(16, eps=1e-6).to(w_dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(16, generator=g))
    ours = kernels.rms_norm_torch(x, ref.weight, 1e-6)
    expected = ref(x)
    assert ours.dtype == expected.dtype
    assert rel_err(ours.float(), expected.float()) <= (1e-6 if x_dtype == torch.float32 else 1e-2)


# --- selection ------------------------------------------------------------------------------
def _fake_torch_npu():
    """torch_npu's three fused ops, written from their documented semantics with plain torch."""
    def npu_fusion_attention(q, k, v, heads, input_layout, atten_mask=None, scale=1.0, keep_prob=1.0):
        assert input_layout == "BNSD" and keep_prob == 1.0 and q.shape[1] == heads
        scores = q @ k.transpose(-1, -2) * scale
        if atten_mask is not None:  # True = masked out
            scores = scores.masked_fill(atten_mask, -math.inf)
        return (scores.softmax(-1) @ v, None, None)

    def npu_rms_norm(x, gamma, epsilon):
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + epsilon)
        return ((x.float() * rstd).to(x.dtype) * gamma, rstd)

    def npu_rotary_mul(x, r1, r2, rotary_mode):
        assert rotary_mode == "interleave"
        pairs = x.unflatten(-1, (-1, 2))
        rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
        return x * r1 + rotated * r2

    return types.SimpleNamespace(npu_fusion_attention=npu_fusion_attention, npu_rms_norm=npu_rms_norm,
                                 npu_rotary_mul=npu_rotary_mul)


def test_explicit_selection(restore_kernels):
    fake = _fake_torch_npu()
    assert kernels.select_kernels("npu", fake).name == "npu"
    assert kernels.current().name == "npu"
    assert kernels.select_kernels("npu", None).name == "torch"  # torch_npu missing
    assert kernels.select_kernels("npu", fake, enabled=False).name == "torch"
    assert kernels.select_kernels("cuda", fake).name == "torch"
    assert kernels.select_kernels("cpu").name == "torch"


def _platform(name):
    return types.SimpleNamespace(name=name)


def test_first_use_selects_by_platform(monkeypatch, restore_kernels):
    import mm_grpo
    monkeypatch.setattr(kernels, "_selected", None)
    assert kernels.current().name == "torch"  # this machine: CPU
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu())
    monkeypatch.setattr(mm_grpo, "get_platform", lambda: _platform("npu"))
    monkeypatch.setattr(kernels, "_selected", None)
    assert kernels.current().name == "npu"
    monkeypatch.setenv("MM_GRPO_FUSED_KERNELS", "0")
    assert kernels.select_for_platform().name == "torch"
    monkeypatch.setattr(mm_grpo, "get_platform", lambda: _platform("cuda"))
    monkeypatch.delenv("MM_GRPO_FUSED_KERNELS")
    assert kernels.select_for_platform().name == "torch"


def test_npu_kernels_give_the_torch_model_output(parallel_1proc, restore_kernels):
    """The whole FLUX forward with the NPU glue (table layout, mask, arguments) against torch's."""
    config = FluxConfig.preset("tiny", axes_dims_rope=(4, 6, 6))
    model = FluxTransformer(config)
    inputs = make_inputs(config)
    with torch.no_grad():
        kernels.select_kernels("cpu")
        expected = model(**inputs)
        kernels.select_kernels("npu", _fake_torch_npu())
        out = model(**inputs)
    assert rel_err(out, expected) <= 1e-5


def test_npu_rope_table_keeps_cos_and_sin():
    kernels_npu = kernels.select_kernels("npu", _fake_torch_npu())
    try:
        cos, sin = _tables()
        table = kernels_npu.rope_table(cos, sin)
        assert table[0].shape == (cos.shape[0], 1, 1, cos.shape[1])
        x = torch.randn(cos.shape[0], 2, 3, sum(AXES))
        expected = kernels.rope_torch(x, kernels.rope_table_torch(cos, sin))
        assert rel_err(kernels.rope(x, table), expected) <= 1e-6
    finally:
        kernels.select_kernels("cpu")


def test_torch_attention_is_softmax_attention():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 9, 8, generator=g) for _ in range(3))
    expected = F.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), dim=-1) @ v
    assert rel_err(kernels.attention_torch(q, k, v), expected) <= 1e-6


@pytest.mark.parametrize("compiling", [False, True], ids=["eager", "sigmoid-form"])
def test_gelu_tanh_is_torch_gelu_in_both_forms(monkeypatch, compiling):
    """The compiled form (sigmoid identity) and the eager one are torch's tanh GELU, values and
    gradients, to fp32 rounding; and torch.compile really traces the sigmoid form."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    x = (4 * torch.randn(4096, generator=torch.Generator().manual_seed(0), dtype=torch.float64)).float()
    x = x.requires_grad_()
    ref_x = x.detach().double().requires_grad_()
    out, ref = kernels.gelu_tanh(x), F.gelu(ref_x, approximate="tanh")
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-6)
    grad = torch.randn(4096, dtype=torch.float64)
    out.backward(grad.float())
    ref.backward(grad)
    torch.testing.assert_close(x.grad.double(), ref_x.grad, atol=1e-5, rtol=1e-5)


def test_compiled_gelu_tanh_traces_the_sigmoid_form():
    ops = []

    def backend(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch.compile(kernels.gelu_tanh, backend=backend, fullgraph=True)(torch.randn(8))
    assert any("sigmoid" in op for op in ops) and not any("gelu" in op for op in ops), ops
