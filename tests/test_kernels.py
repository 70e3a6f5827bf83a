"""mm_grpo/kernels.py: the torch kernels against diffusers; torch_npu's fused kernels as CPU
references of their documented contracts, and mm-grpo's NPU calls against them in fp32 and bf16;
the torch / torch_npu selection."""
import importlib
import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.normalization import RMSNorm

from mm_grpo import kernels
from mm_grpo.families.flux.transformer import FluxConfig, FluxTransformer
from mm_grpo.families.flux.transformer.embeddings import rope_tables
from mm_grpo.families.flux.transformer.latents import prepare_latent_image_ids
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.testbed import install_standins
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


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("compiling", [False, True], ids=["complex", "real-form"])
def test_qk_norm_rope_is_diffusers_rmsnorm_then_rope(monkeypatch, dtype, tol, compiling):
    """q and k of each head together ([S, B, H, 2, d], strided views of the fused projection, as the
    blocks pass them): diffusers' RMSNorm of q and of k with their own weights, then its RoPE; values
    and gradients (input and weights), in the input's dtype. The form torch.compile traces (real
    arithmetic) is the same function."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    cos, sin = _tables()
    g = torch.Generator().manual_seed(2)
    d = sum(AXES)
    qkv = (3 * torch.randn(cos.shape[0], 2, 3, 3, d, generator=g)).to(dtype)
    norms = [RMSNorm(d, eps=1e-6).double() for _ in range(2)]  # the oracle, in float64
    with torch.no_grad():
        for norm in norms:
            norm.weight.copy_(torch.randn(d, generator=g))
    ours_in, ref_in = qkv.clone().requires_grad_(), qkv.double().requires_grad_()
    weight = torch.stack([n.weight for n in norms]).detach().float().requires_grad_()
    ours = kernels.qk_norm_rope_torch(ours_in[..., :2, :], weight, 1e-6, kernels.rope_table_torch(cos, sin))
    ref = torch.stack([apply_rotary_emb(norms[i](ref_in[..., i, :]).transpose(0, 1), (cos.double(), sin.double()),
                                        sequence_dim=1).transpose(0, 1) for i in (0, 1)], dim=-2)
    assert ours.dtype == dtype and ours.shape == ref.shape
    assert rel_err(ours, ref) <= tol
    grad = torch.randn(ref.shape, generator=g)
    (ours.float() * grad).sum().backward()
    (ref * grad).sum().backward()
    assert rel_err(ours_in.grad.float(), ref_in.grad.float()) <= tol
    assert rel_err(weight.grad, torch.stack([n.weight.grad for n in norms])) <= tol


def test_qk_norm_rope_backward_is_its_forwards_derivative():
    """The written-out backward of the eager QK norm + RoPE against numerical derivatives (float64),
    for the input and the weights, and it leaves the incoming gradient untouched."""
    cos, sin = _tables()
    g = torch.Generator().manual_seed(3)
    d = sum(AXES)
    qkv = torch.randn(cos.shape[0], 2, 2, 3, d, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(2, d, generator=g, dtype=torch.float64, requires_grad=True)
    table = kernels.rope_table_torch(cos.double(), sin.double())
    assert torch.autograd.gradcheck(lambda x, w: kernels.qk_norm_rope_torch(x[..., :2, :], w, 1e-6, table),
                                    (qkv, weight))
    out = kernels.qk_norm_rope_torch(qkv[..., :2, :], weight, 1e-6, table)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    kept = grad.clone()
    out.backward(grad)
    assert torch.equal(grad, kept)


# --- torch_npu's fused kernels: the references, then mm-grpo's calls against them -------------
# The stand-in torch_npu (tests/testbed.py) carries CPU references of npu_fusion_attention,
# npu_rms_norm and npu_rotary_mul written from their documented contracts (docs/adaptor.md,
# "Fused NPU kernels: contracts"; tests/standins/npu_kernels.py): float64 values rounded once to
# the documented output dtype, every argument checked first.
#
# Bounds on rel_err (max |a - b| / max |b|) by the dtype the outputs are rounded to. bf16 keeps 8
# significant bits (eps = 2^-7): one rounding moves a value by up to eps / 2 of itself, so two
# results rounded once each from the same real number differ by up to eps of the largest; the
# torch versions round once more on the way (a bf16 intermediate), hence 2 eps. fp32: the same
# math summed in another order over a few dozen terms, far inside 1e-6.
TOL = {torch.float32: 1e-6, torch.bfloat16: 2 * torch.finfo(torch.bfloat16).eps}


@pytest.fixture(scope="module")
def torch_npu():
    install_standins()
    return importlib.import_module("torch_npu")


@pytest.fixture(scope="module")
def references(torch_npu):
    """The module of the references (its ContractError)."""
    return sys.modules[torch_npu.npu_fusion_attention.__module__]


@pytest.fixture
def npu(torch_npu):
    """mm-grpo's NPU kernels, selected as on an NPU; the torch ones again afterwards."""
    yield kernels.select_kernels("npu", torch_npu)
    kernels.select_kernels("cpu")


def _randn(*shape, seed=0, dtype=torch.float32, scale=1.0):
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)).to(dtype)


def test_reference_attention_is_the_documented_example(torch_npu):
    """torch_npu's own example for sparse_mode 0: a band mask built from pre/next_tockens
    (triu(next + 1) + tril(-pre - 1) masked out), checked against matmul, + mask * -10000, softmax."""
    b, n, s, d, pre, nxt = 1, 2, 12, 16, 3, 2
    q, k, v = (_randn(b, n, s, d, seed=i) for i in range(3))
    ones = torch.ones(b, n, s, s)
    mask = torch.triu(ones, diagonal=nxt + 1) + torch.tril(ones, diagonal=-pre - 1)
    scale = 1 / math.sqrt(d)
    expected = F.softmax((q @ k.transpose(2, 3)) * scale + mask * -10000.0, dim=-1) @ v
    out = torch_npu.npu_fusion_attention(q, k, v, n, "BNSD", atten_mask=mask.bool(), scale=scale,
                                         pre_tockens=pre, next_tockens=nxt)
    assert len(out) == 7 and rel_err(out[0], expected) <= TOL[torch.float32]
    assert out[1].shape == out[2].shape == (b, n, s, 8) and out[1].dtype == out[2].dtype == torch.float32
    # the other layouts are views of the same numbers
    as_layout = {"BSND": lambda t: t.transpose(1, 2), "BSH": lambda t: t.transpose(1, 2).flatten(2),
                 "SBH": lambda t: t.permute(2, 0, 1, 3).flatten(2)}
    for layout, view in as_layout.items():
        got = torch_npu.npu_fusion_attention(view(q), view(k), view(v), n, layout, atten_mask=mask[0, 0].bool(),
                                             scale=scale, pre_tockens=pre, next_tockens=nxt)[0]
        assert rel_err(got, view(expected)) <= TOL[torch.float32], layout
    bf16 = torch_npu.npu_fusion_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), n, "BNSD", scale=scale)[0]
    assert bf16.dtype == torch.bfloat16  # the output takes the query's dtype


def test_reference_rms_norm_is_diffusers_rmsnorm(torch_npu):
    x, w = _randn(3, 2, 5, 16, scale=3), _randn(16, seed=1)
    ref = RMSNorm(16, eps=1e-6).double()
    with torch.no_grad():
        ref.weight.copy_(w)
        expected = ref(x.double())
    y, rstd = torch_npu.npu_rms_norm(x, w, epsilon=1e-6)
    assert y.dtype == torch.float32 and rel_err(y, expected) <= TOL[torch.float32]
    assert rstd.shape == (3, 2, 5, 1) and rstd.dtype == torch.float32
    y16 = torch_npu.npu_rms_norm(x.bfloat16(), w.bfloat16(), epsilon=1e-6)[0]
    assert y16.dtype == torch.bfloat16 and rel_err(y16, expected) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("mode, unbind_dim, layout", [("interleave", -1, "pairs"), ("half", -2, "halves")])
def test_reference_rotary_mul_modes_are_diffusers_rope(torch_npu, mode, unbind_dim, layout):
    """interleave is diffusers' FLUX RoPE (adjacent pairs, cos/sin repeat-interleaved); half is its
    rotate-half form (cos/sin concatenated)."""
    s, d = 7, 16
    angles = _randn(s, d // 2, seed=3)
    expand = (lambda t: t.repeat_interleave(2, -1)) if layout == "pairs" else (lambda t: torch.cat([t, t], -1))
    cos, sin = expand(angles.cos()), expand(angles.sin())
    x = _randn(2, 3, s, d, seed=4)  # BNSD
    expected = apply_rotary_emb(x, (cos, sin), use_real_unbind_dim=unbind_dim)
    out = torch_npu.npu_rotary_mul(x, cos[None, None], sin[None, None], rotary_mode=mode)
    assert out.dtype == x.dtype and rel_err(out, expected) <= TOL[torch.float32]


def _call(op, *args, **kwargs):
    return lambda torch_npu: getattr(torch_npu, op)(*args, **kwargs)


_Q = _randn(1, 2, 4, 8)
_ROW_MASKED = torch.zeros(4, 4, dtype=torch.bool).index_fill_(0, torch.tensor([1]), True)


@pytest.mark.parametrize("call, rule", [
    (_call("npu_fusion_attention", _Q, _Q, _Q, 2, "bnsd"), "input_layout 'bnsd'"),
    (_call("npu_fusion_attention", _Q, _Q, _Q.bfloat16(), 2, "BNSD"), "share one dtype"),
    (_call("npu_fusion_attention", _Q, _Q, _Q, 4, "BNSD"), "head_num=4 but query has 2"),
    (_call("npu_fusion_attention", _Q, _Q, _Q, 2, "BNSD", atten_mask=_ROW_MASKED.float()), "bool or uint8"),
    (_call("npu_fusion_attention", _Q, _Q, _Q, 2, "BNSD", atten_mask=_ROW_MASKED[:3]), "not BNSS"),
    (_call("npu_fusion_attention", _Q, _Q, _Q, 2, "BNSD", atten_mask=_ROW_MASKED), "every key masked"),
    (_call("npu_fusion_attention", _Q, _Q, _Q, 2, "BNSD", atten_mask=_ROW_MASKED & False, next_tockens=0),
     "outside the pre_tockens/next_tockens band"),
    (_call("npu_rms_norm", _Q.bfloat16(), _randn(8)), "share one dtype"),
    (_call("npu_rms_norm", _Q, _randn(4)), "trailing dims"),
    (_call("npu_rotary_mul", _Q, _randn(1, 1, 4, 8).tanh(), _randn(1, 1, 4, 8).tanh(), "interleaved"),
     "rotary_mode 'interleaved'"),
    (_call("npu_rotary_mul", _randn(1, 1000, 4, 8), _randn(1, 1, 4, 8).tanh(), _randn(1, 1, 4, 8).tanh(),
           "interleave"), "B\\*N < 1000"),
    (_call("npu_rotary_mul", _Q, 2 * _randn(1, 1, 4, 8), _randn(1, 1, 4, 8).tanh(), "interleave"), r"\[-1, 1\]"),
    (_call("npu_rotary_mul", _Q, _randn(1, 1, 4, 8).tanh().double(), _randn(1, 1, 4, 8).tanh(), "interleave"),
     "share one dtype|float16, bfloat16 or float32"),
])
def test_references_refuse_calls_outside_the_contracts(torch_npu, references, call, rule):
    with pytest.raises(references.ContractError, match=rule):
        call(torch_npu)


def _recorded(monkeypatch, torch_npu):
    """Each call of the three kernels, with its arguments, as it reaches the reference."""
    calls = []
    for op in ("npu_fusion_attention", "npu_rms_norm", "npu_rotary_mul"):
        def record(*args, _op=op, _kernel=getattr(torch_npu, op), **kwargs):
            calls.append((_op, args, kwargs))
            return _kernel(*args, **kwargs)
        monkeypatch.setattr(torch_npu, op, record)
    return calls


def _run(model, inputs, seed=5):
    """Output and, in fp32, parameter gradients of (out * fixed weights).sum(). Under bf16 autocast
    the forward only: megatron-core's backward needs CUDA autocast (bf16 trains on accelerators)."""
    if model.flux_config.bf16:
        with torch.no_grad():
            return model(**inputs), {}
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    (out * _randn(*out.shape, seed=seed)).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_npu_calls_keep_the_contracts(parallel_1proc, monkeypatch, torch_npu, npu, bf16):
    """What a FLUX forward (and backward, fp32) passes the kernels (the references check the rest):
    FLUX's full attention (no mask, sparse_mode 0, no token band: full computation), head_num and
    scale 1/sqrt(d) of the tensors, one dtype for q, k, v (the autocast dtype under bf16 autocast);
    RMSNorm's x in its weight's dtype; RoPE in fp32, interleaved, cos/sin as S11D of SBND x."""
    config = FluxConfig.preset("tiny", axes_dims_rope=(4, 6, 6), bf16=bf16)
    calls = _recorded(monkeypatch, torch_npu)
    _run(FluxTransformer(config), make_inputs(config))
    seen = {op for op, _, _ in calls}
    assert seen == {"npu_fusion_attention", "npu_rms_norm", "npu_rotary_mul"}
    for op, args, kwargs in calls:
        if op == "npu_fusion_attention":
            q, k, v, heads = args
            assert kwargs.keys() == {"input_layout", "atten_mask", "scale", "keep_prob"}
            assert kwargs["input_layout"] == "BNSD" and heads == q.shape[1] == config.num_attention_heads
            assert kwargs["scale"] == 1 / math.sqrt(config.attention_head_dim) and kwargs["keep_prob"] == 1.0
            assert kwargs["atten_mask"] is None
            assert q.dtype == k.dtype == v.dtype == (torch.bfloat16 if bf16 else torch.float32)
        elif op == "npu_rms_norm":
            x, weight = args
            assert x.dtype == weight.dtype == torch.float32 and kwargs == {"epsilon": config.norm_eps}
        else:
            x, cos, sin = args
            assert kwargs == {"rotary_mode": "interleave"} and x.dtype == cos.dtype == sin.dtype == torch.float32
            assert cos.shape == (x.shape[0], 1, 1, x.shape[-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", ["full", "padded-keys", "per-sample"])
def test_npu_attention_matches_torch(monkeypatch, torch_npu, npu, dtype, masked):
    """With the padding mask sequence parallelism adds ([S_k]: torch's True = attend becomes the
    kernel's True = masked out, [S_q, S_k]) and a per-sample one ([B, S_k], Qwen-Image's padded text:
    [B, 1, S_q, S_k])."""
    q, k, v = (_randn(2, 3, 9, 16, seed=i, dtype=dtype) for i in range(3))
    key_mask = {"full": None, "padded-keys": torch.arange(9) < 7,
                "per-sample": torch.arange(9) < torch.tensor([[4], [8]])}[masked]
    calls = _recorded(monkeypatch, torch_npu)
    out = kernels.attention(q, k, v, key_mask)
    expected = kernels.attention_torch(q, k, v, key_mask)
    assert out.dtype == expected.dtype == dtype and rel_err(out, expected) <= TOL[dtype]
    mask = calls[0][2]["atten_mask"]
    if masked == "full":
        assert mask is None
    elif masked == "padded-keys":
        assert torch.equal(mask, ~key_mask.expand(9, 9))
    else:
        assert torch.equal(mask, ~key_mask[:, None, None, :].expand(2, 1, 9, 9))
        # the first sample's queries see its 4 keys only: changing the others changes nothing of it
        k2 = k.clone()
        k2[0, :, 4:] += 1
        assert torch.equal(kernels.attention(q, k2, v, key_mask)[0], out[0])


def test_npu_attention_under_autocast_runs_in_the_autocast_dtype(monkeypatch, torch_npu, npu):
    """The trainer's bf16 mode: fp32 q, k, v (the projections add fp32 biases) under bf16 autocast,
    where torch's attention runs in bf16."""
    q, k, v = (_randn(2, 3, 9, 16, seed=i) for i in range(3))
    calls = _recorded(monkeypatch, torch_npu)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = kernels.attention(q, k, v)
        expected = kernels.attention_torch(q, k, v)
    assert {t.dtype for t in calls[0][1][:3]} == {torch.bfloat16}
    assert out.dtype == expected.dtype == torch.bfloat16 and rel_err(out, expected) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                              (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)])
def test_npu_rms_norm_matches_torch(npu, x_dtype, w_dtype):
    """bf16 activations with an fp32 weight reach the kernel as fp32, the weight's dtype (the
    kernel takes one dtype), and come back fp32, as diffusers' RMSNorm returns them."""
    x, w = _randn(7, 2, 3, 16, scale=3, dtype=x_dtype), _randn(16, seed=1, dtype=w_dtype)
    out, expected = kernels.rms_norm(x, w, 1e-6), kernels.rms_norm_torch(x, w, 1e-6)
    assert out.dtype == expected.dtype == w_dtype
    assert rel_err(out, expected) <= TOL[w_dtype]  # bf16 x is exact in fp32: fp32 math, fp32 bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [2, 260], ids=["B*N<1000", "B*N>=1000"])
def test_npu_rope_matches_torch(monkeypatch, torch_npu, npu, dtype, batch):
    """npu_rotary_mul's interleave mode takes B*N < 1000: a larger batch goes through in slices."""
    cos, sin = _tables()
    x = _randn(cos.shape[0], batch, 4, sum(AXES), seed=6, dtype=dtype)  # [S, B, N, d]
    calls = _recorded(monkeypatch, torch_npu)
    out = kernels.rope(x, kernels.rope_table(cos, sin))
    expected = kernels.rope_torch(x, kernels.rope_table_torch(cos, sin))
    assert out.dtype == expected.dtype == dtype and rel_err(out, expected) <= TOL[dtype]
    assert sum(args[0].shape[1] for _, args, _ in calls) == batch
    assert all(args[0].shape[1] * args[0].shape[2] < kernels.ROTARY_MUL_MAX_BN for _, args, _ in calls)


# Whole model, NPU glue against the torch kernels: fp32 agrees to rounding (3e-8 measured); in bf16
# the two runs round to bf16 at different places (the kernels' outputs), within the kernels' bound
# TOL[bf16] over the 6 blocks.
MODEL_FP32_TOL = 1e-5


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_npu_kernels_give_the_torch_model_output(parallel_1proc, npu, bf16):
    """The whole FLUX forward (and backward, fp32) with the NPU glue (table layout, mask, arguments,
    dtypes) against the torch kernels."""
    config = FluxConfig.preset("tiny", axes_dims_rope=(4, 6, 6), bf16=bf16)
    model, inputs = FluxTransformer(config), make_inputs(config)
    out, grads = _run(model, inputs)
    kernels.select_kernels("cpu")
    expected, expected_grads = _run(model, inputs)
    assert out.dtype == expected.dtype == (torch.bfloat16 if bf16 else torch.float32)
    assert rel_err(out, expected) <= (TOL[torch.bfloat16] if bf16 else MODEL_FP32_TOL)
    assert grads.keys() == expected_grads.keys() and len(grads) == (0 if bf16 else len(list(model.parameters())))
    assert all(rel_err(grads[n], expected_grads[n]) <= MODEL_FP32_TOL for n in grads)


def test_npu_rope_table_keeps_cos_and_sin(npu):
    cos, sin = _tables()
    table = kernels.rope_table(cos, sin)
    assert table[0].shape == (cos.shape[0], 1, 1, cos.shape[1])
    assert torch.equal(table[0][:, 0, 0], cos) and torch.equal(table[1][:, 0, 0], sin)


# --- selection ------------------------------------------------------------------------------
def test_explicit_selection(torch_npu, restore_kernels):
    assert kernels.select_kernels("npu", torch_npu).name == "npu"
    assert kernels.current().name == "npu"
    assert kernels.select_kernels("npu", None).name == "torch"  # torch_npu missing
    assert kernels.select_kernels("npu", torch_npu, enabled=False).name == "torch"
    assert kernels.select_kernels("cuda", torch_npu).name == "torch"
    assert kernels.select_kernels("cpu").name == "torch"


def _platform(name):
    return types.SimpleNamespace(name=name)


def test_first_use_selects_by_platform(monkeypatch, torch_npu, restore_kernels):
    """On an NPU platform the first use imports torch_npu (here the stand-in) and takes its kernels."""
    import mm_grpo
    monkeypatch.setattr(kernels, "_selected", None)
    assert kernels.current().name == "torch"  # this machine: CPU
    monkeypatch.setattr(mm_grpo, "get_platform", lambda: _platform("npu"))
    monkeypatch.setattr(kernels, "_selected", None)
    assert kernels.current().name == "npu"
    assert kernels.current().rms_norm(torch.ones(2, 4), torch.ones(4), 0.0).equal(torch.ones(2, 4))  # the stand-in's
    monkeypatch.setenv("MM_GRPO_FUSED_KERNELS", "0")
    assert kernels.select_for_platform().name == "torch"
    monkeypatch.setattr(mm_grpo, "get_platform", lambda: _platform("cuda"))
    monkeypatch.delenv("MM_GRPO_FUSED_KERNELS")
    assert kernels.select_for_platform().name == "torch"


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
    from mm_grpo.platform.adaptor import torch_compile_replaced
    if replaced_by := torch_compile_replaced():  # MindSpeed's adaptor: --compile-blocks is refused there
        pytest.skip(f"torch.compile is {replaced_by}'s function that compiles nothing: no graph to trace")
    ops = []

    def backend(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch.compile(kernels.gelu_tanh, backend=backend, fullgraph=True)(torch.randn(8))
    assert any("sigmoid" in op for op in ops) and not any("gelu" in op for op in ops), ops
