"""CPU references of the torch_npu fused kernels mm-grpo calls (`npu_fusion_attention`,
`npu_rms_norm`, `npu_rotary_mul`), written from their documented contracts: docs/adaptor.md
("Fused NPU kernels: contracts") gives each rule with its source. The stand-in torch_npu
(tests/standins/npu_only.py) carries them, so mm_grpo/kernels.py's NPU glue runs on a CPU.

Each reference first checks its arguments against the contract and raises `ContractError`
naming the rule a call breaks: a call the real kernel would refuse, or compute wrongly, fails
here. Values are computed in float64 and rounded once to the documented output dtype, the best
a kernel can do, so a comparison measures the caller's glue and its dtypes, not this code's
rounding. Parts of the contracts mm-grpo does not use (TND / varlen, prefix, pse, dropout,
sparse modes 2-8) raise NotImplementedError.
"""
import math

import torch

__all__ = ("npu_fusion_attention", "npu_rms_norm", "npu_rotary_mul")

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
ALL_TOKENS = 2147483647  # pre_tockens / next_tockens default: the band holds every key
SOFTMAX_STAT_WIDTH = 8  # softmax_max / softmax_sum are [B, N, Sq, 8] float32
MAX_HEAD_DIM = 768  # npu_fusion_attention: D in 1..768
MAX_HEADS = 256  # npu_fusion_attention: Nq in 1..256
ROTARY_MAX_HEAD_DIM = 896  # npu_rotary_mul: D < 896, even
ROTARY_MAX_BN = 1000  # npu_rotary_mul: B*N < 1000 (interleave), B, N < 1000 (half)
RMS_NORM_DIMS = (2, 8)  # npu_rms_norm: self has 2 to 8 dims


class ContractError(ValueError):
    """A call outside a kernel's documented contract."""


def _check(ok, rule):
    if not ok:
        raise ContractError(rule)


def _dtype_rule(name, *tensors):
    dtypes = {t.dtype for t in tensors}
    _check(len(dtypes) == 1, f"{name}: inputs must share one dtype, got {sorted(map(str, dtypes))}")
    dtype = dtypes.pop()
    _check(dtype in KERNEL_DTYPES, f"{name}: dtype {dtype} is not float16, bfloat16 or float32")
    return dtype


# --- npu_fusion_attention ------------------------------------------------------------------
def _to_bnsd(t, layout, heads):
    """q, k or v in `layout` -> [B, N, S, D] (a view), with its head count."""
    if layout in ("BSH", "SBH"):
        _check(t.dim() == 3, f"npu_fusion_attention: {layout} takes 3-D tensors, got {tuple(t.shape)}")
        bsh = t if layout == "BSH" else t.transpose(0, 1)
        return bsh.unflatten(-1, (heads, -1)).transpose(1, 2)
    _check(t.dim() == 4, f"npu_fusion_attention: {layout} takes 4-D tensors, got {tuple(t.shape)}")
    return t if layout == "BNSD" else t.transpose(1, 2)


def _from_bnsd(out, layout):
    if layout == "BNSD":
        return out
    bsnd = out.transpose(1, 2)
    if layout == "BSND":
        return bsnd
    bsh = bsnd.flatten(2)
    return bsh if layout == "BSH" else bsh.transpose(0, 1)


def _allowed(atten_mask, sparse_mode, pre_tockens, next_tockens, shape):
    """[B|1, N|1, Sq, Skv] bool, True where a query attends to a key."""
    b, n, sq, skv = shape
    if atten_mask is None:  # sparse_mode, pre_tockens, next_tockens take no effect: full computation
        return torch.ones(1, 1, sq, skv, dtype=torch.bool)
    _check(atten_mask.dtype in (torch.bool, torch.uint8),
           f"npu_fusion_attention: atten_mask must be bool or uint8, got {atten_mask.dtype}")
    accepted = {(b, n, sq, skv), (b, 1, sq, skv), (1, 1, sq, skv), (sq, skv)}
    _check(tuple(atten_mask.shape) in accepted,
           f"npu_fusion_attention: atten_mask shape {tuple(atten_mask.shape)} is not BNSS, B1SS, 11SS or SS "
           f"for B={b}, N={n}, Sq={sq}, Skv={skv}")
    masked = atten_mask.bool() if atten_mask.dim() == 4 else atten_mask.bool()[None, None]  # 1 = masked out
    if sparse_mode == 1:  # allMask: the mask alone, the tokens ignored
        return ~masked
    if sparse_mode != 0:
        raise NotImplementedError(f"npu_fusion_attention reference: sparse_mode {sparse_mode} (mm-grpo uses 0)")
    # defaultMask: the band -pre_tockens <= key - query <= next_tockens (origin top left), which
    # the mask must agree with: the kernel computes the band only.
    offset = torch.arange(skv)[None, :] - torch.arange(sq)[:, None]
    band = (offset >= -pre_tockens) & (offset <= next_tockens)
    _check(not (~masked & ~band).any(),
           "npu_fusion_attention: atten_mask leaves keys outside the pre_tockens/next_tockens band unmasked "
           "(sparse_mode 0: the mask must agree with the band)")
    return ~masked & band


def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                         atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=ALL_TOKENS,
                         next_tockens=ALL_TOKENS, inner_precise=0, prefix=None, actual_seq_qlen=None,
                         actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False):
    """softmax(scale q k^T, masked) v. Returns the kernel's 7 outputs: attention_out (query's layout
    and dtype), softmax_max and softmax_sum ([B, N, Sq, 8] float32, the row max of the scaled
    scores and the sum of their exponentials after subtracting it), softmax_out (reserved, empty),
    and the dropout mask's seed, offset and length."""
    _check(input_layout in LAYOUTS, f"npu_fusion_attention: input_layout {input_layout!r} is not one of {LAYOUTS}")
    _check(isinstance(head_num, int) and head_num > 0, f"npu_fusion_attention: head_num must be an int > 0, "
           f"got {head_num!r}")
    _check(0 < keep_prob <= 1, f"npu_fusion_attention: keep_prob must be in (0, 1], got {keep_prob}")
    _check(0 <= sparse_mode <= 8, f"npu_fusion_attention: sparse_mode must be in 0..8, got {sparse_mode}")
    for name, arg in (("TND layout", input_layout == "TND"), ("pse", pse is not None),
                      ("padding_mask", padding_mask is not None), ("prefix", prefix is not None),
                      # varlen lengths: MindSpeed-MM passes empty lists outside TND, which the kernel reads as none
                      ("actual_seq_qlen/kvlen", bool(actual_seq_qlen) or bool(actual_seq_kvlen)),
                      ("dropout (keep_prob < 1)", keep_prob != 1)):
        if arg:
            raise NotImplementedError(f"npu_fusion_attention reference: {name} (mm-grpo does not use it)")
    dtype = _dtype_rule("npu_fusion_attention", query, key, value)
    _check(key.shape == value.shape, f"npu_fusion_attention: key {tuple(key.shape)} and value "
           f"{tuple(value.shape)} must have one shape")
    kv_heads = None  # BSH / SBH: from H and D; the 4-D layouts name it
    if input_layout in ("BSH", "SBH"):
        _check(query.shape[-1] % head_num == 0, f"npu_fusion_attention: H={query.shape[-1]} is no multiple of "
               f"head_num={head_num}")
        head_dim = query.shape[-1] // head_num
        _check(key.shape[-1] % head_dim == 0, f"npu_fusion_attention: key H={key.shape[-1]} is no multiple of D")
        kv_heads = key.shape[-1] // head_dim
    q = _to_bnsd(query, input_layout, head_num)
    _check(q.shape[1] == head_num, f"npu_fusion_attention: head_num={head_num} but query has {q.shape[1]} "
           f"heads in {input_layout}")
    k, v = (_to_bnsd(t, input_layout, kv_heads) for t in (key, value))
    b, n, sq, d = q.shape
    _check(k.shape[0] == b and k.shape[-1] == d, f"npu_fusion_attention: key's B and D must equal query's "
           f"({tuple(k.shape)} vs {tuple(q.shape)}, as BNSD)")
    _check(d <= MAX_HEAD_DIM and n <= MAX_HEADS, f"npu_fusion_attention: D={d} (max {MAX_HEAD_DIM}) or "
           f"N={n} (max {MAX_HEADS}) out of range")
    _check(n % k.shape[1] == 0, f"npu_fusion_attention: query heads {n} are no multiple of key heads {k.shape[1]}")
    allowed = _allowed(atten_mask, sparse_mode, pre_tockens, next_tockens, (b, n, sq, k.shape[2]))
    _check(allowed.any(-1).all(), "npu_fusion_attention: a query row has every key masked (its output "
           "is not specified)")
    group = n // k.shape[1]  # GQA: query head h reads key/value head h // group
    k64, v64 = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = (q.double() @ k64.transpose(-1, -2) * scale).masked_fill(~allowed, -math.inf)
    row_max = scores.amax(-1, keepdim=True)
    weights = torch.exp(scores - row_max)
    row_sum = weights.sum(-1, keepdim=True)
    out = _from_bnsd((weights / row_sum) @ v64, input_layout).to(dtype)
    stat = lambda t: t.float().expand(b, n, sq, SOFTMAX_STAT_WIDTH)  # noqa: E731
    return out, stat(row_max), stat(row_sum), torch.empty(0, dtype=dtype), 0, 0, b * n * sq * k.shape[2]


# --- npu_rms_norm ------------------------------------------------------------------------------
def npu_rms_norm(self, gamma, epsilon=1e-6):
    """x / sqrt(mean(x^2) + epsilon) * gamma over gamma's trailing dims. Returns (y in self's
    dtype, rstd float32 with gamma's dims kept as 1)."""
    _dtype_rule("npu_rms_norm (self and gamma)", self, gamma)
    _check(RMS_NORM_DIMS[0] <= self.dim() <= RMS_NORM_DIMS[1],
           f"npu_rms_norm: self must have 2 to 8 dims, got {self.dim()}")
    norm_dims = tuple(range(-gamma.dim(), 0))
    _check(0 < gamma.dim() < self.dim() and gamma.shape == self.shape[-gamma.dim():],
           f"npu_rms_norm: gamma {tuple(gamma.shape)} must be self's trailing dims {tuple(self.shape)}")
    x = self.double()
    rstd = torch.rsqrt(x.square().mean(norm_dims, keepdim=True) + epsilon)
    return (x * rstd * gamma.double()).to(self.dtype), rstd.float()


# --- npu_rotary_mul ----------------------------------------------------------------------------
def _rotate(x, rotary_mode):
    if rotary_mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def _sequence_axes(x, r):
    """Axes of x (of its first three) that r's S can sit on: r is 11SD, 1S1D or S11D."""
    return [a for a in range(3) if all(r.shape[i] == (x.shape[a] if i == a else 1) for i in range(3))]


def npu_rotary_mul(input, r1, r2, rotary_mode="half"):  # noqa: A002 (torch_npu's argument name)
    """r1 * input + r2 * rotate(input): `half` rotates the two halves of D (x1, x2 -> -x2, x1),
    `interleave` the adjacent pairs. Output: input's shape and dtype."""
    _check(rotary_mode in ("half", "interleave"), f"npu_rotary_mul: rotary_mode {rotary_mode!r} is not "
           "'half' or 'interleave'")
    _check(input.dim() == r1.dim() == r2.dim() == 4, "npu_rotary_mul: input, r1 and r2 must be 4-D")
    # The dtypes each may take are listed per argument; every MindSpeed-MM call passes one dtype
    # for all three, and this reference requires it.
    dtype = _dtype_rule("npu_rotary_mul (input, r1, r2)", input, r1, r2)
    d = input.shape[-1]
    _check(d % 2 == 0 and d < ROTARY_MAX_HEAD_DIM, f"npu_rotary_mul: D={d} must be even and < {ROTARY_MAX_HEAD_DIM}")
    _check(r1.shape == r2.shape and r1.shape[-1] == d, f"npu_rotary_mul: r1 {tuple(r1.shape)} and r2 "
           f"{tuple(r2.shape)} must have one shape, ending in D={d}")
    if rotary_mode == "interleave":  # r1, r2: 11SD (x BNSD), 1S1D (BSND) or S11D (SBND); B*N < 1000
        axes = _sequence_axes(input, r1)
        _check(axes, f"npu_rotary_mul: interleave takes r1 as 11SD, 1S1D or S11D of input "
               f"{tuple(input.shape)}, got {tuple(r1.shape)}")
        _check(any(input.shape[:3].numel() // input.shape[a] < ROTARY_MAX_BN for a in axes),
               f"npu_rotary_mul: interleave needs B*N < {ROTARY_MAX_BN}, input {tuple(input.shape)}")
    else:
        _check(all(r == 1 or r == s for r, s in zip(r1.shape, input.shape)),
               f"npu_rotary_mul: r1 {tuple(r1.shape)} does not broadcast to input {tuple(input.shape)}")
        _check(any(all(input.shape[i] < ROTARY_MAX_BN for i in range(3) if i != a) for a in range(3)),
               f"npu_rotary_mul: half needs B, N < {ROTARY_MAX_BN}, input {tuple(input.shape)}")
    _check(bool(r1.abs().max() <= 1) and bool(r2.abs().max() <= 1), "npu_rotary_mul: r1 and r2 must lie in [-1, 1]")
    x = input.double()
    return (r1.double() * x + r2.double() * _rotate(x, rotary_mode)).to(dtype)
