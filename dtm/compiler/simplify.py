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
- slices: a slice of a value nothing else reads is computed from slices of its operands,
  through elementwise ops, broadcasts, permutes, reductions over other dims, the first
  elements of a running sum, and matrix products (rows of the product from rows of A,
  columns from columns of B), as far as values read only there: a prefill's
  `logits[:, -1]` computes one row of the vocabulary projection, not one per token (each
  element is the same expression of the same operands; a product's sums in the order its
  kernel picks, as for any product);
- selects: an elementwise op of where(c, x, k), k smaller than its result (a mask's -inf,
  a row value) and so are its other operands, is where(c, f(x), f(k)), f(k) computed at
  k's own shape: a masked softmax takes exp of -inf once per row, not once per masked
  element (which vector exp handles element by element, slowly);
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
from ..ir.typerules import broadcast_shapes
from ..ir.types import TensorType
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


Spec = tuple  # (start, stop, step) of a slice, one entry per dim


def _spec_of(op: Op) -> Spec:
    return tuple(zip(op.attrs["start"], op.attrs["stop"], op.attrs["step"]))


def _whole(spec: Spec, shape: tuple) -> bool:
    return all(lo == 0 and hi == d and st == 1 for (lo, hi, st), d in zip(spec, shape))


def _aligned(spec: Spec, out_shape: tuple, shape: tuple) -> Spec:
    """The spec for an operand of `shape` broadcast to `out_shape` (numpy rules): its dims of
    size 1 under a larger one stay whole."""
    lead = len(out_shape) - len(shape)
    return tuple((0, d, 1) if d == 1 and out_shape[lead + i] != 1 else spec[lead + i] for i, d in enumerate(shape))


def _slice_spec(op: Op, spec: Spec) -> list[Spec] | None:
    """The slices of op's operands that compute `spec` of its result, or None when the slice
    does not sink through op (sources, effects, movement other than broadcast and permute,
    quantized values)."""
    r = op.results[0].type.shape if len(op.results) == 1 else None
    cat = REGISTRY[op.name].category
    if r is None or not op.operands or not _pure(op) or \
            any(v.type.dtype.is_quant for v in (*op.operands, *op.results)):
        return None
    if cat in _EW:
        return [_aligned(spec, r, x.type.shape) for x in op.operands]
    x = op.operands[0].type.shape
    if op.name == "broadcast_to":
        return [_aligned(spec, r, x)] if all(isinstance(lo, int) and isinstance(hi, int) for lo, hi, _ in spec) \
            else None
    if op.name == "permute":
        inv = [None] * len(x)
        for i, p in enumerate(op.attrs["perm"]):
            inv[p] = spec[i]
        return [tuple(inv)]
    if op.name == "argsort":  # each slice along the axis sorts on its own: any part of the others
        a = op.attrs["axis"]
        return [spec] if _whole((spec[a],), (x[a],)) else None
    if op.name == "cumsum":  # a running sum's first k elements are those of the operand's first k
        lo, _, step = spec[op.attrs["axis"]]
        return [spec] if lo == 0 and step == 1 else None
    if cat is Category.REDUCE:
        axes = (op.attrs["axis"],) if "axis" in op.attrs else tuple(op.attrs["axes"])
        axes = tuple(a % len(x) for a in axes)
        kept = iter(spec) if not op.attrs["keepdims"] else None
        out = []
        for i, d in enumerate(x):
            if i in axes:
                if kept is None and not _whole((spec[i],), (1,)):
                    return None
                out.append((0, d, 1))
            else:
                out.append(next(kept) if kept is not None else spec[i])
        return [tuple(out)]
    if op.name == "matmul":
        a, b = (v.type.shape for v in op.operands)
        batch = spec[:-2]
        sa = _aligned(batch, r[:-2], a[:-2]) + (spec[-2], (0, a[-1], 1))
        sb = _aligned(batch, r[:-2], b[:-2]) + ((0, b[-2], 1), spec[-1])
        return [sa, sb]
    return None


def sink_slices(func: Func) -> Func:
    """Compute sliced what is only read through a slice (see the module docstring). A value is
    computed sliced when every op reading it is a slice, or an op computed sliced, and all
    of them want the same part of it; the ops are walked last to first, so that a value's
    readers are decided before it."""
    readers: dict[Value, list[Op]] = {}
    for op in func.ops:
        for v in op.operands:
            readers.setdefault(v, []).append(op)
    returned = set(func.returns)
    specs: dict[Value, Spec] = {}
    for op in reversed(func.ops):
        if len(op.results) != 1 or op.results[0] in returned or op.results[0] not in readers:
            continue
        v = op.results[0]
        wanted = {spec for u in readers[v] for spec in _wanted(u, v, specs)}
        if None in wanted or len(wanted) != 1:
            continue
        spec = wanted.pop()
        if not _whole(spec, v.type.shape) and _slice_spec(op, spec) is not None:
            specs[v] = spec
    if not specs:
        return func
    ops: list[Op] = []
    e = Emitter(ops, prefix="k")
    sliced: dict[Value, Value] = {}
    repl: dict[Value, Value] = {}
    for op in func.ops:
        v = op.results[0] if len(op.results) == 1 else None
        if v in specs:
            operands = []
            for x, sx in zip(op.operands, _slice_spec(op, specs[v])):
                x = repl.get(x, x)
                if x in sliced:  # its readers all want sx
                    operands.append(sliced[x])
                elif _whole(sx, x.type.shape):
                    operands.append(x)
                else:
                    operands.append(e("slice", x, start=[lo for lo, _, _ in sx], stop=[hi for _, hi, _ in sx],
                                      step=[st for _, _, st in sx]))
            attrs = dict(op.attrs)
            if op.name == "broadcast_to":
                attrs["shape"] = [(hi - lo + st - 1) // st for lo, hi, st in specs[v]]
            sliced[v] = e(op.name, *operands, **attrs)
        elif op.name == "slice" and op.operands[0] in sliced:
            repl[v] = sliced[op.operands[0]]
        else:
            if any(x in repl for x in op.operands):
                op = Op(op.name, tuple(repl.get(x, x) for x in op.operands), op.attrs, op.results, op.loc,
                        op.attrs_key)
            ops.append(op)
    return new_func(func, ops, [repl.get(v, v) for v in func.returns])


def _wanted(reader: Op, v: Value, specs: dict) -> list:
    """The parts of v an op reading it wants: a slice its own, an op computed sliced what its
    spec needs of each operand that is v; None: all of v."""
    if reader.name == "slice":
        return [_spec_of(reader)]
    w = reader.results[0] if len(reader.results) == 1 else None
    if w not in specs:
        return [None]
    return [sx for x, sx in zip(reader.operands, _slice_spec(reader, specs[w])) if x is v]


def _size(t) -> int | None:
    return int(np.prod(t.shape)) if all(isinstance(d, int) for d in t.shape) else None


def _into_where(op: Op, defs: dict, e: Emitter, readers: dict | None = None) -> bool:
    """f(.., where(c, x, k), ..) -> where(c, f(.., x, ..), f(.., k, ..)) for an elementwise f
    when k and f's other operands together are smaller than f's result (see the module
    docstring); element by element the same op on the same values. True when done. Not for
    a scaling by a scalar (f's other operands of one element) of a select that an op other
    than f and reductions reads as well (`readers`: a value -> the ops reading it): a
    dropout's scaling of attention's probabilities, which the backward pass reads too, then
    read the probabilities' pieces instead of the one value the backward reads, and the two
    could not share it (the fusion stored the scores' product instead, and each kernel ran
    the softmax again from it)."""
    if REGISTRY[op.name].category not in _EW or op.name == "where" or len(op.results) != 1:
        return False
    size = _size(op.results[0].type)
    for i, v in enumerate(op.operands):
        sel = defs.get(v)
        if sel is None or sel.name != "where" or size is None:
            continue
        if (readers is not None and all(_size(u.type) == 1 for j, u in enumerate(op.operands) if j != i)
                and len(op.operands) > 1
                and any(u is not op and u.name not in _REDUCTIONS for u in readers.get(v, ()))):
            continue
        c, x, y = sel.operands
        others = [u.type for j, u in enumerate(op.operands) if j != i]
        for big, small in ((x, y), (y, x)):
            small_size = _size(TensorType(small.type.dtype, broadcast_shapes("where", small.type, *others)))
            if small_size is None or small_size >= size:
                continue
            with_big = e(op.name, *op.operands[:i], big, *op.operands[i + 1:], **op.attrs)
            with_small = e(op.name, *op.operands[:i], small, *op.operands[i + 1:], **op.attrs)
            branches = (with_big, with_small) if big is x else (with_small, with_big)
            e("where", c, *branches, result=op.results[0])
            return True
    return False


_REDUCTIONS = frozenset(("reduce_sum", "reduce_prod", "reduce_max", "reduce_min", "argmax", "argmin"))


class _Returned:
    """What reads a returned value, for _into_where's readers."""

    name = "return"


_RETURNED = _Returned()


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
    func = sink_slices(func)
    assigned = {op.operands[0] for op in func.ops if op.name == "assign"}
    uses: dict[Value, int] = {v: 0 for v in func.returns}
    for op in func.ops:
        for v in op.operands:
            uses[v] = uses.get(v, 0) + 1
    for v in func.returns:
        uses[v] += 1
    readers: dict[Value, list] = {}
    for op in func.ops:
        for v in op.operands:
            readers.setdefault(v, []).append(op)
    for v in func.returns:
        readers.setdefault(v, []).append(_RETURNED)
    repl: dict[Value, Value] = {}
    defs: dict[Value, Op] = {}
    seen: dict[tuple, Op] = {}
    ops: list[Op] = []
    e = Emitter(ops, prefix="s")

    def visit(op: Op) -> None:
        """Rewrite op (what a rule emits is visited in turn: folded, merged with an equal op),
        or keep it unless an earlier op computes the same."""
        if any(v in repl for v in op.operands):
            op = Op(op.name, tuple(repl.get(v, v) for v in op.operands), op.attrs, op.results, op.loc, op.attrs_key)
        if _pure(op) and op.results:
            start = len(ops)
            if _fold(op, defs, e) or _chain(op, defs, e) or _into_where(op, defs, e, readers) or \
                    (op.name == "permute" and _transposed_product(op, defs, uses, e)):
                emitted = ops[start:]
                del ops[start:]
                for new in emitted:
                    visit(new)
                return
            same = _identity(op, defs)
            if same is not None and same not in assigned:
                repl[op.results[0]] = same
                return
            key = (op.name, op.operands, op.attrs_key, tuple(r.type for r in op.results))
            if key in seen:
                for a, b in zip(op.results, seen[key].results):
                    repl[a] = b
                return
            seen[key] = op
        ops.append(op)
        for r in op.results:
            defs[r] = op

    for op in func.ops:
        visit(op)
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
