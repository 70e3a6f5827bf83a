"""What a forward costs besides its matrix products, counted on any device (CPU included).

`Traffic` is a TorchDispatchMode that sees every aten op a forward runs and sorts it:

    matmul      GEMMs (mm, addmm, bmm, ...) and attention: the work the FLOP floor counts
    cast        an op whose only job is a dtype change (`_to_copy`, `copy_` across dtypes): it
                reads and writes a whole tensor and computes nothing
    copy        a same-dtype copy (`cat`, `clone`, `contiguous`, `_to_copy` without a dtype change)
    elementwise everything else that reads or writes memory (norms, modulation, RoPE, GELU, residuals)
    view        views, metadata and allocations (no bytes)

and adds up, per kind, the op count and the bytes it reads and writes (every tensor argument and
output at its full size; a broadcast [B, D] operand counts once, as a GPU kernel reads it). On an
accelerator the element-wise kinds run at memory speed, so their bytes are their time: the
figures that `tests/test_dtype_layout.py` holds the model's bf16 layout to.

    with Traffic() as t:
        block(x, n_txt, vec, rope)
    t.bytes("elementwise"), t.count("cast"), t.summary()
"""
import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MATMUL = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addmv", "mv", "dot",
          "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
          "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
          "_scaled_dot_product_attention_math", "_flash_attention_forward", "_efficient_attention_forward"}
ALLOCATION = ("empty", "new_empty")  # allocates, touches no memory
COPY = {"cat", "clone", "contiguous", "stack", "_to_copy", "copy_", "index_select", "repeat"}
VIEW_TAGS = (torch.Tag.pointwise,)  # not used to classify: views are recognised by aliasing below


def _tensors(tree):
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    """The bytes a kernel touches: the elements a (possibly broadcast / strided) view spans, not
    the expanded size (an expanded [B, D] operand is read once)."""
    if t.numel() == 0:
        return 0
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if stride)
    return min(span, t.numel()) * t.element_size()


def _is_view(func) -> bool:
    schema = func._schema
    return bool(schema.returns) and all(r.alias_info is not None and not r.alias_info.is_write
                                        for r in schema.returns)


class Traffic(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()  # kind -> ops
        self.traffic = collections.Counter()  # kind -> bytes read + written
        self.by_op = collections.Counter()  # (kind, op name) -> bytes

    def kind(self, func, args, kwargs, out) -> str:
        name = func.overloadpacket.__name__
        if name in MATMUL:
            return "matmul"
        if _is_view(func) or name in ("detach", "_unsafe_view", "alias", "lift_fresh") or name.startswith(ALLOCATION):
            return "view"
        if name in ("_to_copy", "copy_"):
            ins = [t for t in _tensors((args, kwargs))]
            outs = _tensors(out)
            dtypes = {t.dtype for t in ins + outs}
            return "cast" if len(dtypes) > 1 else "copy"
        if name in COPY:
            return "copy"
        return "elementwise"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = self.kind(func, args, kwargs, out)
        if kind != "view":
            # An `out=` tensor, and copy_'s destination, are written, not read: counted once, as outputs.
            read = _tensors((args, {k: v for k, v in kwargs.items() if k != "out"}))
            if func.overloadpacket.__name__ == "copy_":
                read = read[1:]
            moved = sum(_nbytes(t) for t in read + _tensors(out))
            self.ops[kind] += 1
            self.traffic[kind] += moved
            self.by_op[(kind, func.overloadpacket.__name__)] += moved
        return out

    def count(self, kind: str) -> int:
        return self.ops[kind]

    def bytes(self, kind: str) -> int:
        return self.traffic[kind]

    def summary(self) -> str:
        rows = [f"{k:12s} {self.ops[k]:5d} ops {self.traffic[k] / 2**20:10.2f} MiB" for k in sorted(self.ops)]
        top = sorted(self.by_op.items(), key=lambda kv: -kv[1])[:12]
        rows += [f"  {k}/{op}: {b / 2**20:.2f} MiB" for (k, op), b in top]
        return "\n".join(rows)
