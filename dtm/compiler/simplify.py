"""The simplification pass: a few algebraic rewrites and constant folding, then common
subexpressions and dead code. IR in, IR out; the result verifies. Each rule is exact (the
result is bit for bit the program's):

- identities: x * 1, x / 1, x - 0, x + 0 (integers; for floats only x + -0.0, since
  -0.0 + 0.0 is +0.0), reshape / broadcast_to to the operand's own shape, the identity
  permute, cast to the operand's own dtype, a slice of everything, a pad of nothing, a flip
  of no axes, a concat of one operand, a reduction over no axes: the result is the operand (never a parameter that
  an `assign` overwrites: the value before the assign must survive);
- constant folding: an elementwise op whose operands are all `full` is a `full` (computed
  with the reference implementation), and so is a movement op (reshape, permute,
  broadcast_to, slice, flip) of a `full`;
- products: the transpose of a matrix product nothing else reads is the product of the
  transposes, swapped (the result in the layout wanted: a Linear's weight gradient);
- chains: reshape of reshape is one reshape, permute of permute one permute, broadcast_to
  of broadcast_to one broadcast_to, a concat of concats along its axis one concat (a
  sampling loop's `idx = cat([idx, next], 1)` becomes one concat of every token, not a
  nest of them);
- common subexpressions: a pure op with the same operands and attributes as an earlier one
  is that one; dead code: pure ops whose results are unused are removed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..ir.dtypes import numpy_dtype
from ..ir.module import Func, Op, Value
from ..ir.registry import REGISTRY, Category
from ..ref.context import RefContext
from ..ref.ops import IMPLS
from .irutil import Emitter, new_func

_EW = (Category.UNARY, Category.BINARY, Category.COMPARE, Category.TERNARY)
_FOLD_MOVES = ("reshape", "permute", "broadcast_to", "slice", "flip")


def _full_value(v: Value, defs: dict) -> Any:
    """The scalar a `full` op fills v with, or None."""
    op = defs.get(v)
    if op is not None and op.name == "full":
        return op.attrs["value"]
    return None


def _is_scalar(v: Value, defs: dict, want: float, neg_zero: bool = False) -> bool:
    val = _full_value(v, defs)
    if val is None or isinstance(val, bool):
        return False
    if neg_zero:
        return val == 0 and np.signbit(val)
    return val == want


def _pure(op: Op) -> bool:
    return not REGISTRY[op.name].effect and op.name != "call"


def _identity(op: Op, defs: dict) -> Value | None:
    """The operand this op returns unchanged, or None."""
    r = op.results[0] if op.results else None
    if r is None or not op.operands:
        return None
    x = op.operands[0]
    if op.name in ("mul", "div", "add", "sub") and len(op.operands) == 2:
        y = op.operands[1]
        is_int = r.type.dtype.is_int
        cands = []
        if op.name == "mul":
            cands = [(x, y, 1), (y, x, 1)]
        elif op.name == "div":
            cands = [(x, y, 1)]
        elif op.name == "sub":
            cands = [(x, y, 0)]
        elif op.name == "add":
            cands = [(x, y, 0), (y, x, 0)]
        for keep, const, want in cands:
            if keep.type != r.type:
                continue
            if op.name == "add" and not is_int:
                if _is_scalar(const, defs, 0, neg_zero=True):
                    return keep
            elif op.name == "sub" and not is_int:
                if _is_scalar(const, defs, 0) and not np.signbit(_full_value(const, defs)):
                    return keep
            elif _is_scalar(const, defs, want):
                return keep
        return None
    if x.type != r.type:
        return None
    a = op.attrs
    if op.name in ("reshape", "broadcast_to", "cast"):
        return x
    if op.name == "permute" and list(a["perm"]) == list(range(len(a["perm"]))):
        return x
    if op.name == "slice" and all(s == 1 for s in a["step"]):
        return x  # same type, step 1: start 0 and stop the dim
    if op.name == "pad" and not any(a["low"]) and not any(a["high"]):
        return x
    if op.name == "flip" and not a["axes"]:
        return x
    if op.name == "concat" and len(op.operands) == 1:
        return x
    if op.name.startswith("reduce_") and not a["axes"]:
        return x  # a reduction over no axes
    return None


def _fold(op: Op, defs: dict, e: Emitter) -> bool:
    """Emit a `full` computing this op's result from `full` operands; True when done."""
    if not op.results or len(op.results) != 1 or not op.operands:
        return False
    r = op.results[0]
    if r.type.dtype.is_quant or any(v.type.dtype.is_quant for v in op.operands):
        return False
    vals = [_full_value(v, defs) for v in op.operands]
    if any(v is None for v in vals):
        return False
    if op.name in _FOLD_MOVES or (op.name == "pad" and vals[0] == op.attrs["value"]):
        e("full", type=r.type, value=vals[0], result=r)
        return True
    if REGISTRY[op.name].category not in _EW:
        return False
    args = [np.array(val).astype(numpy_dtype(v.type.dtype)) for val, v in zip(vals, op.operands)]
    out_t = r.type.with_shape(())
    with np.errstate(all="ignore"):
        (res,) = IMPLS[op.name](RefContext(), op.attrs, *args, out_types=(out_t,))
    value = np.asarray(res).reshape(()).item()
    e("full", type=r.type, value=value, result=r)
    return True


def _swap_last(rank: int) -> list[int]:
    return list(range(rank - 2)) + [rank - 1, rank - 2]


def _transposed_product(op: Op, defs: dict, uses: dict, e: Emitter) -> bool:
    """permute(matmul(a, b)) swapping the last two dims, where nothing else reads the
    product, is matmul(b^T, a^T): the product is computed in the layout wanted (a weight's
    gradient, for a Linear), its operands' transposes read as strided views, instead of a
    transpose of it read with strides or copied. Each element is the same dot product, in
    the same order."""
    inner = defs.get(op.operands[0])
    r = op.results[0].type.rank
    if inner is None or inner.name != "matmul" or r < 2 or list(op.attrs["perm"]) != _swap_last(r) \
            or uses.get(op.operands[0], 0) != 1:
        return False
    a, b = inner.operands
    bt = e("permute", b, perm=_swap_last(b.type.rank))
    at = e("permute", a, perm=_swap_last(a.type.rank))
    e("matmul", bt, at, result=op.results[0])
    return True


def _chain(op: Op, defs: dict, e: Emitter) -> bool:
    """Merge reshape(reshape), permute(permute), broadcast_to(broadcast_to), concat(concat)."""
    if op.name == "concat":
        axis = op.attrs["axis"]
        parts = [defs[v].operands if defs.get(v) is not None and defs[v].name == "concat"
                 and defs[v].attrs["axis"] == axis else (v,) for v in op.operands]
        if all(len(p) == 1 and p[0] is v for p, v in zip(parts, op.operands)):
            return False
        e("concat", *(v for p in parts for v in p), axis=axis, result=op.results[0])
        return True
    if op.name not in ("reshape", "permute", "broadcast_to"):
        return False
    inner = defs.get(op.operands[0])
    if inner is None or inner.name != op.name:
        return False
    src, r = inner.operands[0], op.results[0]
    if op.name == "permute":
        p1, p2 = inner.attrs["perm"], op.attrs["perm"]
        e("permute", src, perm=[p1[i] for i in p2], result=r)
    else:
        e(op.name, src, shape=list(r.type.shape), result=r)
    return True


def simplify(func: Func) -> Func:
    assigned = {op.operands[0] for op in func.ops if op.name == "assign"}
    uses: dict[Value, int] = {v: 0 for v in func.returns}
    for op in func.ops:
        for v in op.operands:
            uses[v] = uses.get(v, 0) + 1
    for v in func.returns:
        uses[v] += 1
    repl: dict[Value, Value] = {}
    defs: dict[Value, Op] = {}
    seen: dict[tuple, Op] = {}
    ops: list[Op] = []
    e = Emitter(ops, prefix="s")
    for op in func.ops:
        if any(v in repl for v in op.operands):
            op = Op(op.name, tuple(repl.get(v, v) for v in op.operands), op.attrs, op.results, op.loc, op.attrs_key)
        if _pure(op) and op.results:
            if _fold(op, defs, e) or _chain(op, defs, e):
                op = ops.pop()
            elif op.name == "permute" and _transposed_product(op, defs, uses, e):
                op = ops.pop()
            same = _identity(op, defs)
            if same is not None and same not in assigned:
                repl[op.results[0]] = same
                continue
            key = (op.name, op.operands, op.attrs_key, tuple(r.type for r in op.results))
            if key in seen:
                for a, b in zip(op.results, seen[key].results):
                    repl[a] = b
                continue
            seen[key] = op
            ops.append(op)
        else:
            ops.append(op)
        for r in op.results:
            defs[r] = op
    returns = [repl.get(v, v) for v in func.returns]
    return new_func(func, _dce(ops, returns), returns)


def _dce(ops: list[Op], returns: list[Value]) -> list[Op]:
    live = set(returns)
    keep = []
    for op in reversed(ops):
        if not _pure(op) or any(r in live for r in op.results):
            keep.append(op)
            live.update(op.operands)
    keep.reverse()
    return keep
