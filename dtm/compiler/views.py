"""Movement ops as index arithmetic, shared by the scheduler and the lowering.

- `strided_view(v, is_base)`: when v is a chain of movement ops over a base value that is
  a plain strided view of it (permute, broadcast_to, slice, flip, and reshapes that only
  split or merge contiguous dims), the base, the offset and the strides, all as dims
  (ints or polynomials over the symbols). The matrix product reads its operands this way,
  without copies.
- `reshape_groups(src, dst)`: a reshape as groups of source and result dims with equal
  element counts, so that index arithmetic stays within a group.
"""

from __future__ import annotations

from typing import Callable

from ..ir.module import Op, Value
from ..ir.symbolic import Dim, dim_add, dim_mul, dim_prod, dim_sub

MOVES = ("reshape", "permute", "broadcast_to", "slice", "pad", "concat", "flip")
STRIDED_MOVES = ("reshape", "permute", "broadcast_to", "slice", "flip")


def contiguous_strides(shape: tuple) -> tuple:
    out: list[Dim] = []
    stride: Dim = 1
    for d in reversed(shape):
        out.append(stride)
        stride = dim_mul(stride, d)
    return tuple(reversed(out))


def reshape_groups(src: tuple, dst: tuple) -> list[tuple[list[int], list[int]]] | None:
    """Split a reshape into consecutive groups (source dims, result dims) whose element
    counts are equal; None when none is found (only the whole reshape as one group)."""
    groups = []
    i = j = 0
    while i < len(src) or j < len(dst):
        found = None
        for a in range(i + 1 if i < len(src) else i, len(src) + 1):
            pa = dim_prod(src[i:a])
            for b in range(j + 1 if j < len(dst) else j, len(dst) + 1):
                if dim_prod(dst[j:b]) == pa:
                    found = (a, b)
                    break
            if found:
                break
        if found is None:
            return None
        a, b = found
        # absorb trailing size-1 dims into this group so later groups start on real dims
        while a < len(src) and src[a] == 1 and (len(dst) == b or dst[b] != 1):
            a += 1
        while b < len(dst) and dst[b] == 1 and (len(src) == a or src[a] != 1):
            b += 1
        groups.append((list(range(i, a)), list(range(j, b))))
        i, j = a, b
    return groups


def _reshape_strides(src: tuple, strides: tuple, dst: tuple) -> tuple | None:
    """Strides of a reshape of a strided view, or None when it needs a copy."""
    groups = reshape_groups(src, dst)
    if groups is None:
        return None
    out: list[Dim] = [0] * len(dst)
    for si, di in groups:
        real = [k for k in si if src[k] != 1]
        for a, b in zip(real, real[1:]):  # the group's source dims must be contiguous with each other
            if strides[a] != dim_mul(strides[b], src[b]):
                return None
        inner = strides[real[-1]] if real else 0
        stride = inner
        for k in reversed(di):
            out[k] = stride if dst[k] != 1 else 0
            stride = dim_mul(stride, dst[k])
    return tuple(out)


def strided_view(v: Value, producer: dict, is_base: Callable[[Value], bool]):
    """(base, offset, strides) with element i of v at base[offset + sum(i_k * strides_k)]
    (base contiguous), or None when v is not such a view. The walk stops at values for
    which is_base holds and at values no movement op produced."""
    op: Op | None = producer.get(v)
    if is_base(v) or op is None or op.name not in STRIDED_MOVES:
        return v, 0, contiguous_strides(v.type.shape)
    inner = strided_view(op.operands[0], producer, is_base)
    if inner is None:
        return None
    base, off, st = inner
    src, dst, a = op.operands[0].type.shape, v.type.shape, op.attrs
    if op.name == "permute":
        return base, off, tuple(st[p] for p in a["perm"])
    if op.name == "broadcast_to":
        lead = len(dst) - len(src)
        out = [0] * lead + [0 if (s == 1 and d != 1) else t for s, d, t in zip(src, dst[lead:], st)]
        return base, off, tuple(out)
    if op.name == "slice":
        for k, (s, t) in enumerate(zip(a["start"], st)):
            off = dim_add(off, dim_mul(s, t))
        return base, off, tuple(dim_mul(t, step) for t, step in zip(st, a["step"]))
    if op.name == "flip":
        out = list(st)
        for k in a["axes"]:
            off = dim_add(off, dim_mul(dim_sub(src[k], 1), st[k]))
            out[k] = dim_mul(st[k], -1)
        return base, off, tuple(out)
    if op.name == "reshape":
        new = _reshape_strides(src, st, dst)
        return None if new is None else (base, off, new)
    return None  # pragma: no cover
