"""The decomposition pass: every composite op (softmax, log_softmax, layer_norm, gelu, silu,
scaled_dot_product_attention) becomes the primitive ops of its normative decomposition
(spec 3.9), in the dtype of its operand. IR in, IR out; the result verifies.

The composite's result Value is kept as the result of the decomposition's last op, so the
rest of the function is untouched. Left as they are (the executor runs them through the
reference): composites on narrow floats (f16, bf16, f8: the spec computes those in f32 and
rounds once, which the decomposition in the operand's dtype would not), a layer_norm whose
last dim is symbolic and an attention without `scale` whose head dim is symbolic (the
decomposition writes N or 1/sqrt(D) as a constant).

A `cast` between a block type (q8_0, q4_0) and a float dtype other than f32 becomes two
casts through f32, which the compiler quantizes and dequantizes in C (exact: the reference
computes it so).
"""

from __future__ import annotations

import math

import numpy as np

from ..ir.dtypes import DTYPES
from ..ir.module import Func, Op, Value
from ..ir.registry import REGISTRY, Category
from ..ir.types import TensorType
from .irutil import Emitter, new_func

NATIVE_FLOATS = ("f32", "f64")


def _scalar(x: Value) -> TensorType:
    return TensorType(x.type.dtype, ())


def _softmax(e: Emitter, op: Op, log: bool) -> None:
    (x,), axis, y = op.operands, op.attrs["axis"], op.results[0]
    m = e("reduce_max", x, axes=[axis], keepdims=True)
    d = e("sub", x, m)
    ex = e("exp", d)
    s = e("reduce_sum", ex, axes=[axis], keepdims=True)
    if log:
        ls = e("log", s)
        e("sub", d, ls, result=y)
    else:
        e("div", ex, s, result=y)


def _layer_norm(e: Emitter, op: Op) -> None:
    x, y = op.operands[0], op.results[0]
    last = x.type.rank - 1
    count = e.full(float(x.type.shape[-1]), _scalar(x))
    eps = e.full(op.attrs["eps"], _scalar(x))
    inf, nan = e.full(math.inf, _scalar(x)), e.full(math.nan, _scalar(x))
    total = e("reduce_sum", x, axes=[last], keepdims=True)
    mean = e("div", total, count)
    d = e("sub", x, mean)
    sq = e("mul", d, d)
    sqsum = e("reduce_sum", sq, axes=[last], keepdims=True)
    var = e("div", sqsum, count)
    ve = e("add", var, eps)
    root = e("sqrt", ve)
    # a row whose squares overflowed (var + eps infinite) is NaN, as torch's kernel gives
    # for [1e38, -1e38, 1e38]: d / inf would be 0 for every element, which passes for a
    # normalised row (spec 3.9, layer_norm)
    over = e("eq", ve, inf)
    sd = e("where", over, nan, root)
    if len(op.operands) == 1:
        e("div", d, sd, result=y)
        return
    n = e("div", d, sd)
    nw = e("mul", n, op.operands[1])
    e("add", nw, op.operands[2], result=y)


def _gelu(e: Emitter, op: Op) -> None:
    (x,), y = op.operands, op.results[0]
    half = e.full(0.5, _scalar(x))
    one = e.full(1.0, _scalar(x))
    xh = e("mul", x, half)
    if op.attrs["approximate"] == "none":
        sqrt2 = e.full(_rounded(math.sqrt(2.0), x), _scalar(x))
        xs = e("div", x, sqrt2)
        erf = e("erf", xs)
        e1 = e("add", erf, one)
        e("mul", xh, e1, result=y)
        return
    c1 = e.full(_rounded(math.sqrt(2.0 / math.pi), x), _scalar(x))
    c2 = e.full(_rounded(0.044715, x), _scalar(x))
    a = e("mul", x, c2)
    b = e("mul", a, x)
    cx3 = e("mul", b, x)
    inner = e("add", x, cx3)
    arg = e("mul", inner, c1)
    th = e("tanh", arg)
    t1 = e("add", th, one)
    e("mul", xh, t1, result=y)


def _silu(e: Emitter, op: Op) -> None:
    (x,), y = op.operands, op.results[0]
    s = e("sigmoid", x)
    e("mul", x, s, result=y)


def _attention(e: Emitter, op: Op) -> None:
    (q, k, v), o = op.operands, op.results[0]
    rank = q.type.rank
    perm = list(range(rank - 2)) + [rank - 1, rank - 2]
    kt = e("permute", k, perm=perm)
    s = e("matmul", q, kt)
    scale = op.attrs["scale"]
    if scale is None:
        scale = float(np.float64(1.0) / np.sqrt(np.float64(q.type.shape[-1])))
    sc = e.full(_rounded(scale, q), _scalar(q))
    ss = e("mul", s, sc)
    if op.attrs["causal"]:
        L, S = s.type.shape[-2:]
        pos = TensorType(DTYPES["i64"], (L, S))
        i = e("iota", type=pos, dim=0)
        j = e("iota", type=pos, dim=1)
        keep = e("ge", i, j)
        ninf = e.full(-math.inf, _scalar(q))
        ss = e("where", keep, ss, ninf)
    last = rank - 1
    m = e("reduce_max", ss, axes=[last], keepdims=True)
    d = e("sub", ss, m)
    ex = e("exp", d)
    z = e("reduce_sum", ex, axes=[last], keepdims=True)
    p = e("div", ex, z)
    e("matmul", p, v, result=o)


def _rounded(value: float, like: Value) -> float:
    """An f64 constant rounded to the dtype of `like` (as the spec writes its constants)."""
    if like.type.dtype.name == "f32":
        return float(np.float32(value))
    return float(value)


RULES = {
    "softmax": lambda e, op: _softmax(e, op, log=False),
    "log_softmax": lambda e, op: _softmax(e, op, log=True),
    "layer_norm": _layer_norm,
    "gelu": _gelu,
    "silu": _silu,
    "scaled_dot_product_attention": _attention,
}


def _block_cast(e: Emitter, op: Op) -> None:
    """cast between a block type (q8_0, q4_0) and a float dtype other than f32, through f32:
    the reference quantizes the operand's values as f32 and dequantizes to f32 values, then
    rounds them to the result dtype (dtm.ref.quant), so the two casts are the same bits."""
    (x,), y = op.operands, op.results[0]
    mid = e("cast", x, type=TensorType(DTYPES["f32"], x.type.shape), to=DTYPES["f32"])
    e("cast", mid, result=y, type=y.type, to=y.type.dtype)


def _is_block_cast(op: Op) -> bool:
    if op.name != "cast":
        return False
    a, b = op.operands[0].type.dtype, op.results[0].type.dtype
    return (a.is_quant or b.is_quant) and "f32" not in (a.name, b.name)


def decomposable(op: Op) -> bool:
    """Whether `decompose` replaces this op (see the module docstring for what it leaves)."""
    if _is_block_cast(op):
        return True
    if op.name not in RULES or op.operands[0].type.dtype.name not in NATIVE_FLOATS:
        return False
    x = op.operands[0]
    if op.name == "layer_norm" and not isinstance(x.type.shape[-1], int):
        return False
    if op.name == "scaled_dot_product_attention" and op.attrs["scale"] is None \
            and not isinstance(x.type.shape[-1], int):
        return False
    return True


def decompose(func: Func) -> Func:
    """`func` with every decomposable composite replaced by its decomposition."""
    assert set(RULES) == {n for n, d in REGISTRY.items() if d.category is Category.COMPOSITE}, \
        "a composite op has no decomposition rule"
    ops: list[Op] = []
    e = Emitter(ops, prefix="d")
    changed = False
    for op in func.ops:
        if decomposable(op):
            (_block_cast if op.name == "cast" else RULES[op.name])(e, op)
            changed = True
        else:
            ops.append(op)
    return new_func(func, ops, list(func.returns)) if changed else func
