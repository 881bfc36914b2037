"""Vector-Jacobian products, one rule per differentiable op of the registry, looked up by
op name (docs/architecture.md: the VJP rule hangs off the registry entry, in layer 3).

A rule is `rule(b, op, cotangents) -> list[Value | None]`:

- `b` is the `FuncBuilder` of the function being built; the rule emits its ops with it.
- `op` is the forward op; its operands and results are Values already defined in that
  function, so a rule may use forward values (x, the result y, ...).
- `cotangents[i]` is the cotangent of `op.results[i]` (None: zero); it has the result's type.
- It returns one entry per operand: the operand's cotangent, of exactly the operand's type
  (broadcast operands are summed back to their own shape), or None where the operand gets
  no gradient (integer, bool or index operands, attributes-like operands, zero gradients).

Ops that carry no gradient at all are listed in `NON_DIFFERENTIABLE`. Conventions shared
with torch, chosen so that tests can compare against torch.autograd:

- `reduce_max` / `reduce_min`: the cotangent is split evenly among the tied extrema
  (torch.amax / torch.amin); elementwise `max` / `min` give half to each side on a tie
  (torch.maximum / torch.minimum).
- `abs`: the subgradient at 0 is 0 (sign(x)).
- `reduce_prod` handles zeros exactly: with no zero in a slice the gradient is
  prod / x; with exactly one zero only the zero element gets the product of the others;
  with two or more zeros the whole slice gets 0.
- `pow`: d/dx is 0 where the exponent is 0, d/dy is 0 where x == 0 and y >= 0 (torch).
- `mod` (C fmod): d/dx = 1, d/dy = -trunc(x / y).

`call` is differentiated in autodiff.py (it builds a VJP function for the callee).
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

from ..errors import DTMError, ErrorCode as E
from ..ir.builder import FuncBuilder
from ..ir.dtypes import i64
from ..ir.module import Op, Value
from ..ir.registry import REGISTRY
from ..ir.symbolic import Dim, dim_add, dim_sub, is_static
from ..ir.types import TensorType

Ct = Optional[Value]
Rule = Callable[[FuncBuilder, Op, Sequence[Ct]], list]

VJP: dict[str, Rule] = {}

# Ops through which no gradient flows: comparisons and logic, integer-valued or
# piecewise-constant results (their derivative is zero almost everywhere), creation ops,
# bit reinterpretation, and effects that do not compute a function of their operands on
# this rank (state, p2p, barrier, store). `assign` is copied as an effect but never
# differentiated: gradients flow only through uses of its target before the assign.
NON_DIFFERENTIABLE: set[str] = {
    "sign", "floor", "ceil", "round", "logical_not", "bitcast",
    "logical_and", "logical_or", "logical_xor",
    "eq", "ne", "lt", "le", "gt", "ge",
    "argmax", "argmin", "argsort",
    "constant", "full", "iota", "random",
    "assign", "barrier", "send", "recv", "store_get", "store_put",
}


def rule(*names: str):
    def deco(fn: Rule) -> Rule:
        for n in names:
            assert n not in VJP, n
            VJP[n] = fn
        return fn
    return deco


# --- helpers -----------------------------------------------------------------------------

def scalar(b: FuncBuilder, value: float, dtype) -> Value:
    """A rank-0 constant of `dtype` (binary ops broadcast it)."""
    if dtype.is_float:
        value = float(value)
    elif dtype.is_int:
        value = int(value)
    return b.full(type=TensorType(dtype, ()), value=value)


def zeros(b: FuncBuilder, t: TensorType) -> Value:
    return b.full(type=t, value=0.0 if t.dtype.is_float else (False if t.dtype.name == "bool" else 0))


def count(b: FuncBuilder, dims: Sequence[Dim], dtype) -> Value:
    """The number of elements of `dims` as a rank-0 value of `dtype` (symbolic dims are
    counted at run time: the sum of a tensor of ones)."""
    static, symbolic = 1, []
    for d in dims:
        if is_static(d):
            static *= d
        else:
            symbolic.append(d)
    if not symbolic:
        return scalar(b, static, dtype)
    ones = scalar(b, 1, dtype)
    ones = b.broadcast_to(ones, shape=symbolic)
    n = b.reduce_sum(ones, axes=list(range(len(symbolic))))
    return n if static == 1 else b.mul(n, scalar(b, static, dtype))


def unbroadcast(b: FuncBuilder, g: Value, t: TensorType) -> Value:
    """Sum `g` over the dims along which a value of type `t` was broadcast to g's shape."""
    if g.type.shape == t.shape:
        return g
    lead = g.type.rank - t.rank
    axes = list(range(lead)) + [lead + i for i, d in enumerate(t.shape) if d == 1 and g.type.shape[lead + i] != 1]
    if axes:
        g = b.reduce_sum(g, axes=axes, keepdims=True)
    if g.type.shape != t.shape:
        g = b.reshape(g, shape=list(t.shape))
    return g


def keepdims_shape(x: TensorType, axes: Sequence[int]) -> list:
    return [1 if i in axes else d for i, d in enumerate(x.shape)]


def with_keepdims(b: FuncBuilder, v: Value, x: TensorType, axes: Sequence[int], keepdims: bool) -> Value:
    """A reduction's result (or cotangent) in its keepdims shape, to broadcast against x."""
    if keepdims:
        return v
    return b.reshape(v, shape=keepdims_shape(x, axes))


def swap_last(b: FuncBuilder, v: Value) -> Value:
    r = v.type.rank
    return b.permute(v, perm=list(range(r - 2)) + [r - 1, r - 2])


def group_size(b: FuncBuilder, op: Op) -> int:
    mesh = b.module.meshes[op.attrs["mesh"]]
    sizes = dict(mesh.axes)
    n = 1
    for a in op.attrs["axes"]:
        n *= sizes[a]
    return n


def group(op: Op) -> dict:
    return {"mesh": op.attrs["mesh"], "axes": list(op.attrs["axes"])}


def trunc(b: FuncBuilder, z: Value) -> Value:
    return b.where(b.lt(z, scalar(b, 0.0, z.type.dtype)), b.ceil(z), b.floor(z))


# --- elementwise unary -------------------------------------------------------------------

def unary(name: str):
    """Register a rule `dx = f(b, x, y, ct)` for a one-operand op."""
    def deco(fn):
        @rule(name)
        def _r(b, op, cts):
            ct = cts[0]
            if ct is None:
                return [None]
            return [fn(b, op.operands[0], op.results[0], ct)]
        return fn
    return deco


@unary("neg")
def _neg(b, x, y, ct):
    return b.neg(ct)


@unary("abs")
def _abs(b, x, y, ct):
    return b.mul(ct, b.sign(x))


@unary("exp")
def _exp(b, x, y, ct):
    return b.mul(ct, y)


@unary("exp2")
def _exp2(b, x, y, ct):
    return b.mul(ct, b.mul(y, scalar(b, math.log(2.0), x.type.dtype)))


@unary("log")
def _log(b, x, y, ct):
    return b.div(ct, x)


@unary("log2")
def _log2(b, x, y, ct):
    return b.div(ct, b.mul(x, scalar(b, math.log(2.0), x.type.dtype)))


@unary("sqrt")
def _sqrt(b, x, y, ct):
    return b.div(ct, b.mul(y, scalar(b, 2.0, x.type.dtype)))


@unary("rsqrt")
def _rsqrt(b, x, y, ct):
    return b.mul(b.mul(ct, scalar(b, -0.5, x.type.dtype)), b.mul(y, b.mul(y, y)))


@unary("reciprocal")
def _reciprocal(b, x, y, ct):
    return b.neg(b.mul(ct, b.mul(y, y)))


@unary("sin")
def _sin(b, x, y, ct):
    return b.mul(ct, b.cos(x))


@unary("cos")
def _cos(b, x, y, ct):
    return b.neg(b.mul(ct, b.sin(x)))


@unary("tanh")
def _tanh(b, x, y, ct):
    return b.mul(ct, b.sub(scalar(b, 1.0, x.type.dtype), b.mul(y, y)))


@unary("erf")
def _erf(b, x, y, ct):
    dt = x.type.dtype
    return b.mul(ct, b.mul(scalar(b, 2.0 / math.sqrt(math.pi), dt), b.exp(b.neg(b.mul(x, x)))))


@unary("sigmoid")
def _sigmoid(b, x, y, ct):
    return b.mul(ct, b.mul(y, b.sub(scalar(b, 1.0, x.type.dtype), y)))


@unary("silu")
def _silu(b, x, y, ct):
    dt = x.type.dtype
    s = b.sigmoid(x)
    one = scalar(b, 1.0, dt)
    return b.mul(ct, b.mul(s, b.add(one, b.mul(x, b.sub(one, s)))))


@rule("gelu")
def _gelu(b, op, cts):
    ct = cts[0]
    if ct is None:
        return [None]
    x = op.operands[0]
    dt = x.type.dtype
    half, one = scalar(b, 0.5, dt), scalar(b, 1.0, dt)
    if op.attrs["approximate"] == "tanh":
        # y = x/2 (1 + tanh(u)), u = k (x + c x^3)
        # dy/dx = (1 + t)/2 + x/2 (1 - t^2) k (1 + 3 c x^2)
        k, c = math.sqrt(2.0 / math.pi), 0.044715
        x2 = b.mul(x, x)
        u = b.mul(scalar(b, k, dt), b.add(x, b.mul(scalar(b, c, dt), b.mul(x, x2))))
        t = b.tanh(u)
        du = b.mul(scalar(b, k, dt), b.add(one, b.mul(scalar(b, 3.0 * c, dt), x2)))
        d = b.add(b.mul(half, b.add(one, t)), b.mul(b.mul(half, x), b.mul(b.sub(one, b.mul(t, t)), du)))
    else:
        # y = x Phi(x): dy/dx = Phi(x) + x phi(x)
        cdf = b.mul(half, b.add(one, b.erf(b.mul(x, scalar(b, 1.0 / math.sqrt(2.0), dt)))))
        pdf = b.mul(scalar(b, 1.0 / math.sqrt(2.0 * math.pi), dt), b.exp(b.mul(scalar(b, -0.5, dt), b.mul(x, x))))
        d = b.add(cdf, b.mul(x, pdf))
    return [b.mul(ct, d)]


@rule("cast")
def _cast(b, op, cts):
    ct, x = cts[0], op.operands[0]
    # Only float -> float casts carry a gradient; integer, bool and quantized values carry none.
    if ct is None or not (x.type.dtype.is_float and op.results[0].type.dtype.is_float):
        return [None]
    return [b.cast(ct, to=x.type.dtype)]


# --- elementwise binary ------------------------------------------------------------------

def binary(name: str):
    """Register a rule `(gx, gy) = f(b, x, y, out, ct)` in the broadcast shape; the
    driver-facing rule sums each back to its operand's shape."""
    def deco(fn):
        @rule(name)
        def _r(b, op, cts):
            ct = cts[0]
            if ct is None:
                return [None, None]
            x, y = op.operands
            gx, gy = fn(b, x, y, op.results[0], ct)
            return [None if gx is None else unbroadcast(b, gx, x.type),
                    None if gy is None else unbroadcast(b, gy, y.type)]
        return fn
    return deco


@binary("add")
def _add(b, x, y, out, ct):
    return ct, ct


@binary("sub")
def _sub(b, x, y, out, ct):
    return ct, b.neg(ct)


@binary("mul")
def _mul(b, x, y, out, ct):
    return b.mul(ct, y), b.mul(ct, x)


@binary("div")
def _div(b, x, y, out, ct):
    gx = b.div(ct, y)
    return gx, b.neg(b.mul(gx, b.div(x, y)))


@binary("pow")
def _pow(b, x, y, out, ct):
    dt = x.type.dtype
    zero, one = scalar(b, 0.0, dt), scalar(b, 1.0, dt)
    gx = b.where(b.eq(y, zero), zero, b.mul(ct, b.mul(y, b.pow(x, b.sub(y, one)))))
    gy = b.where(b.logical_and(b.eq(x, zero), b.ge(y, zero)), zero, b.mul(ct, b.mul(out, b.log(x))))
    return gx, gy


def _minmax(b, x, y, ct, pick):
    """x wins where pick(x, y); a tie gives half to each side (torch.maximum)."""
    dt = x.type.dtype
    zero = scalar(b, 0.0, dt)
    half = b.mul(ct, scalar(b, 0.5, dt))
    tie = b.eq(x, y)
    gx = b.where(pick(x, y), ct, b.where(tie, half, zero))
    gy = b.where(pick(y, x), ct, b.where(tie, half, zero))
    return gx, gy


@binary("max")
def _max(b, x, y, out, ct):
    return _minmax(b, x, y, ct, b.gt)


@binary("min")
def _min(b, x, y, out, ct):
    return _minmax(b, x, y, ct, b.lt)


@binary("mod")
def _mod(b, x, y, out, ct):
    return ct, b.neg(b.mul(ct, trunc(b, b.div(x, y))))


@rule("where")
def _where(b, op, cts):
    ct = cts[0]
    if ct is None:
        return [None, None, None]
    c, x, y = op.operands
    zero = scalar(b, 0.0, ct.type.dtype)
    return [None, unbroadcast(b, b.where(c, ct, zero), x.type), unbroadcast(b, b.where(c, zero, ct), y.type)]


@rule("check")
def _check(b, op, cts):
    """The checked value itself: its cotangent passes through; the fault has none."""
    return [cts[0], None]


# --- reductions --------------------------------------------------------------------------

@rule("reduce_sum")
def _reduce_sum(b, op, cts):
    ct = cts[0]
    if ct is None:
        return [None]
    x = op.operands[0]
    g = with_keepdims(b, ct, x.type, op.attrs["axes"], op.attrs["keepdims"])
    return [b.broadcast_to(g, shape=list(x.type.shape)) if g.type.shape != x.type.shape else g]


@rule("reduce_max", "reduce_min")
def _reduce_extremum(b, op, cts):
    ct = cts[0]
    if ct is None:
        return [None]
    x = op.operands[0]
    dt = x.type.dtype
    axes, kd = op.attrs["axes"], op.attrs["keepdims"]
    y = with_keepdims(b, op.results[0], x.type, axes, kd)
    g = with_keepdims(b, ct, x.type, axes, kd)
    hit = b.eq(x, y)
    n = b.reduce_sum(b.cast(hit, to=dt), axes=list(axes), keepdims=True)
    return [b.where(hit, b.div(g, n), scalar(b, 0.0, dt))]


@rule("reduce_prod")
def _reduce_prod(b, op, cts):
    ct = cts[0]
    if ct is None:
        return [None]
    x = op.operands[0]
    dt = x.type.dtype
    axes, kd = list(op.attrs["axes"]), op.attrs["keepdims"]
    g = with_keepdims(b, ct, x.type, axes, kd)
    zero, one = scalar(b, 0.0, dt), scalar(b, 1.0, dt)
    is_zero = b.eq(x, zero)
    nzeros = b.reduce_sum(b.cast(is_zero, to=dt), axes=axes, keepdims=True)
    safe = b.where(is_zero, one, x)
    p = b.reduce_prod(safe, axes=axes, keepdims=True)            # product of the non-zero elements
    none = b.div(p, safe)                                        # no zero in the slice: prod / x
    only = b.where(b.logical_and(is_zero, b.eq(nzeros, one)), p, zero)  # one zero: it gets the rest
    d = b.where(b.eq(nzeros, zero), none, only)
    return [b.mul(d, g)]


@rule("cumsum")
def _cumsum(b, op, cts):
    """Each element feeds every later running sum: the cotangent summed from the end, a
    cumsum of it reversed along the axis (torch's cumsum_backward)."""
    ct = cts[0]
    if ct is None:
        return [None]
    axes = [op.attrs["axis"]]
    return [b.flip(b.cumsum(b.flip(ct, axes=axes), axis=axes[0]), axes=axes)]


# --- movement ----------------------------------------------------------------------------

@rule("reshape")
def _reshape(b, op, cts):
    ct = cts[0]
    return [None if ct is None else b.reshape(ct, shape=list(op.operands[0].type.shape))]


@rule("permute")
def _permute(b, op, cts):
    ct = cts[0]
    if ct is None:
        return [None]
    perm = op.attrs["perm"]
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return [b.permute(ct, perm=inv)]


@rule("broadcast_to")
def _broadcast_to(b, op, cts):
    ct = cts[0]
    return [None if ct is None else unbroadcast(b, ct, op.operands[0].type)]


@rule("flip")
def _flip(b, op, cts):
    ct = cts[0]
    return [None if ct is None else b.flip(ct, axes=list(op.attrs["axes"]))]


@rule("slice")
def _slice(b, op, cts):
    ct = cts[0]
    if ct is None:
        return [None]
    x = op.operands[0]
    xs = x.type.shape
    start, step = op.attrs["start"], op.attrs["step"]
    g = ct
    if any(d == 0 for d in g.type.shape):
        return [zeros(b, x.type)]
    # Steps: spread each strided dim out to (n-1)*step + 1 elements, zeros in between.
    for i, s in enumerate(step):
        if s == 1:
            continue
        n = g.type.shape[i]
        shp = list(g.type.shape)
        g = b.reshape(g, shape=shp[:i + 1] + [1] + shp[i + 1:])
        low, high = [0] * (len(shp) + 1), [0] * (len(shp) + 1)
        high[i + 1] = s - 1
        g = b.pad(g, low=low, high=high, value=0.0)
        g = b.reshape(g, shape=shp[:i] + [n * s] + shp[i + 1:])
        ext = (n - 1) * s + 1
        if ext != n * s:
            g = b.slice(g, start=[0] * len(shp), stop=shp[:i] + [ext] + shp[i + 1:], step=[1] * len(shp))
    # Symbolic dims (step 1): concatenate zeros before and after.
    low, high = [0] * x.type.rank, [0] * x.type.rank
    for i, (d, lo) in enumerate(zip(xs, start)):
        ext = g.type.shape[i]
        hi = dim_sub(dim_sub(d, lo), ext)
        if is_static(d) and is_static(lo) and is_static(hi):
            low[i], high[i] = lo, hi
            continue
        parts = []
        for size in (lo, None, hi):
            if size is None:
                parts.append(g)
            elif not (is_static(size) and size == 0):
                shp = list(g.type.shape)
                shp[i] = size
                parts.append(zeros(b, TensorType(g.type.dtype, tuple(shp))))
        g = b.concat(*parts, axis=i) if len(parts) > 1 else g
    if any(low) or any(high):
        g = b.pad(g, low=low, high=high, value=0.0)
    return [g]


@rule("pad")
def _pad(b, op, cts):
    ct = cts[0]
    if ct is None:
        return [None]
    x = op.operands[0]
    low = op.attrs["low"]
    return [b.slice(ct, start=list(low), stop=[dim_add(lo, d) for lo, d in zip(low, x.type.shape)],
                    step=[1] * x.type.rank)]


@rule("concat")
def _concat(b, op, cts):
    ct = cts[0]
    if ct is None:
        return [None] * len(op.operands)
    axis = op.attrs["axis"]
    out, off = [], 0
    shape = ct.type.shape
    for x in op.operands:
        end = dim_add(off, x.type.shape[axis])
        start = [0] * len(shape)
        stop = list(shape)
        start[axis], stop[axis] = off, end
        out.append(b.slice(ct, start=start, stop=stop, step=[1] * len(shape)))
        off = end
    return out


@rule("gather")
def _gather(b, op, cts):
    ct = cts[0]
    if ct is None:
        return [None, None]
    x, idx = op.operands
    return [b.scatter_add(zeros(b, x.type), idx, ct, axis=op.attrs["axis"]), None]


@rule("scatter_add")
def _scatter_add(b, op, cts):
    ct = cts[0]
    if ct is None:
        return [None, None, None]
    _, idx, _ = op.operands
    return [ct, None, b.gather(ct, idx, axis=op.attrs["axis"])]


@rule("dynamic_slice")
def _dynamic_slice(b, op, cts):
    ct = cts[0]
    if ct is None:
        return [None, None]
    x, pos = op.operands
    # The same clamped start in both directions.
    return [b.dynamic_update_slice(zeros(b, x.type), ct, pos, axis=op.attrs["axis"]), None]


@rule("dynamic_update_slice")
def _dynamic_update_slice(b, op, cts):
    ct = cts[0]
    if ct is None:
        return [None, None, None]
    x, upd, pos = op.operands
    axis = op.attrs["axis"]
    gx = b.dynamic_update_slice(ct, zeros(b, upd.type), pos, axis=axis)
    return [gx, b.dynamic_slice(ct, pos, axis=axis, size=upd.type.shape[axis]), None]


# --- linear algebra ----------------------------------------------------------------------

@rule("matmul")
def _matmul(b, op, cts):
    ct = cts[0]
    if ct is None:
        return [None, None]
    a, w = op.operands
    ga = unbroadcast(b, b.matmul(ct, swap_last(b, w)), a.type)
    if w.type.rank == 2 and a.type.rank > 2 and a.type.is_static and w.type.is_static:
        # a weight shared by a batch of rows (x [B, T, k] @ w [k, n]): one product over all
        # B*T rows, not a product per batch entry summed afterwards
        k, n = w.type.shape
        m = math.prod(a.type.shape[:-1])
        gw = b.matmul(swap_last(b, b.reshape(a, shape=[m, k])), b.reshape(ct, shape=[m, n]))
    else:
        gw = unbroadcast(b, b.matmul(swap_last(b, a), ct), w.type)
    return [ga, gw]



# --- composites --------------------------------------------------------------------------

@rule("softmax")
def _softmax(b, op, cts):
    ct = cts[0]
    if ct is None:
        return [None]
    y, axis = op.results[0], op.attrs["axis"]
    s = b.reduce_sum(b.mul(ct, y), axes=[axis], keepdims=True)
    return [b.mul(y, b.sub(ct, s))]


@rule("log_softmax")
def _log_softmax(b, op, cts):
    ct = cts[0]
    if ct is None:
        return [None]
    y, axis = op.results[0], op.attrs["axis"]
    s = b.reduce_sum(ct, axes=[axis], keepdims=True)
    return [b.sub(ct, b.mul(b.exp(y), s))]


@rule("layer_norm")
def _layer_norm(b, op, cts):
    ct = cts[0]
    n_ops = len(op.operands)
    if ct is None:
        return [None] * n_ops
    x = op.operands[0]
    dt, r = x.type.dtype, x.type.rank
    last = [r - 1]
    inv_n = b.reciprocal(count(b, [x.type.shape[-1]], dt))
    mean = b.mul(b.reduce_sum(x, axes=last, keepdims=True), inv_n)
    xc = b.sub(x, mean)
    var = b.mul(b.reduce_sum(b.mul(xc, xc), axes=last, keepdims=True), inv_n)
    rstd = b.rsqrt(b.add(var, scalar(b, op.attrs["eps"], dt)))
    xhat = b.mul(xc, rstd)
    g = b.mul(ct, op.operands[1]) if n_ops == 3 else ct
    mg = b.mul(b.reduce_sum(g, axes=last, keepdims=True), inv_n)
    mgx = b.mul(b.reduce_sum(b.mul(g, xhat), axes=last, keepdims=True), inv_n)
    gx = b.mul(rstd, b.sub(b.sub(g, mg), b.mul(xhat, mgx)))
    if n_ops == 1:
        return [gx]
    lead = list(range(r - 1))

    def over_rows(v):
        return b.reduce_sum(v, axes=lead) if lead else v

    return [gx, over_rows(b.mul(ct, xhat)), over_rows(ct)]


@rule("scaled_dot_product_attention")
def _sdpa(b, op, cts):
    """Recompute the attention weights p (flash-attention style), then
    dv = p^T ct, dp = ct v^T, ds = p (dp - rowsum(dp p)), dq = scale ds k, dk = scale ds^T q.
    Causal masking keeps key j for query i when j <= i (top-left, as torch's is_causal);
    masked weights are exactly 0, so ds is 0 there too."""
    ct = cts[0]
    if ct is None:
        return [None, None, None]
    q, k, v = op.operands
    dt, r = q.type.dtype, q.type.rank
    scale = op.attrs["scale"]
    d = q.type.shape[-1]
    if scale is not None:
        sc = scalar(b, scale, dt)
    elif is_static(d):
        sc = scalar(b, 1.0 / math.sqrt(d) if d else math.inf, dt)
    else:
        sc = b.rsqrt(count(b, [d], dt))
    s = b.mul(b.matmul(q, swap_last(b, k)), sc)
    if op.attrs["causal"]:
        L, S = q.type.shape[-2], k.type.shape[-2]
        it = TensorType(i64, (L, S))
        keep = b.ge(b.iota(type=it, dim=0), b.iota(type=it, dim=1))
        s = b.where(keep, s, scalar(b, -math.inf, dt))
    p = b.softmax(s, axis=r - 1)
    dv = b.matmul(swap_last(b, p), ct)
    dp = b.matmul(ct, swap_last(b, v))
    ds = b.mul(p, b.sub(dp, b.reduce_sum(b.mul(dp, p), axes=[r - 1], keepdims=True)))
    ds = b.mul(ds, sc)
    return [b.matmul(ds, k), b.matmul(swap_last(b, ds), q), dv]


# --- collectives -------------------------------------------------------------------------
# The SPMD convention: every rank runs the same function, and the loss is the sum of every
# rank's loss, so an op's input on rank r gets the cotangents of all ranks' outputs that
# depend on it.

@rule("all_reduce")
def _all_reduce(b, op, cts):
    ct = cts[0]
    if ct is None:
        return [None]
    x, y = op.operands[0], op.results[0]
    red = op.attrs["op"]
    if red in ("sum", "avg"):
        # linear: sum -> sum of the cotangents; avg -> their average
        return [b.all_reduce(ct, op=red, **group(op))]
    total = b.all_reduce(ct, op="sum", **group(op))
    dt = x.type.dtype
    if red == "prod":
        # d(prod_r x_r)/dx_r = y / x_r (x_r == 0 gives inf/nan, as prod / x does)
        return [b.mul(total, b.div(y, x))]
    # max / min: the winners share the summed cotangent evenly (as reduce_max).
    hit = b.eq(x, y)
    n = b.all_reduce(b.cast(hit, to=dt), op="sum", **group(op))
    return [b.where(hit, b.div(total, n), scalar(b, 0.0, dt))]


@rule("all_gather")
def _all_gather(b, op, cts):
    ct = cts[0]
    if ct is None:
        return [None]
    return [b.reduce_scatter(ct, dim=op.attrs["dim"], op="sum", **group(op))]


@rule("reduce_scatter")
def _reduce_scatter(b, op, cts):
    ct = cts[0]
    if ct is None:
        return [None]
    x, y = op.operands[0], op.results[0]
    dt = x.type.dtype
    red, dim = op.attrs["op"], op.attrs["dim"]
    g = b.all_gather(ct, dim=dim, **group(op))
    if red == "sum":
        return [g]
    if red == "avg":
        return [b.div(g, scalar(b, float(group_size(b, op)), dt))]
    yfull = b.all_gather(y, dim=dim, **group(op))
    if red == "prod":
        return [b.mul(g, b.div(yfull, x))]
    hit = b.eq(x, yfull)
    n = b.all_reduce(b.cast(hit, to=dt), op="sum", **group(op))
    return [b.where(hit, b.div(g, n), scalar(b, 0.0, dt))]


@rule("all_to_all")
def _all_to_all(b, op, cts):
    ct = cts[0]
    if ct is None:
        return [None]
    # A permutation of blocks: its transpose is the all_to_all with the dims swapped.
    return [b.all_to_all(ct, split_dim=op.attrs["concat_dim"], concat_dim=op.attrs["split_dim"], **group(op))]


@rule("broadcast")
def _broadcast(b, op, cts):
    ct = cts[0]
    if ct is None:
        return [None]
    # Every rank's output is rank src's input, so src's input gets the sum of all ranks'
    # cotangents: all_reduce(sum). The result is meaningful only on rank src; the true
    # cotangent on the other ranks is zero, which needs the rank id to express (the other
    # ranks' inputs do not influence anything, so their gradient should be discarded).
    return [b.all_reduce(ct, op="sum", **group(op))]


def check_rules() -> None:
    """Every registry op has a rule or is declared non-differentiable (not both)."""
    missing = [n for n in REGISTRY if n not in VJP and n not in NON_DIFFERENTIABLE]
    both = [n for n in VJP if n in NON_DIFFERENTIABLE]
    if missing or both:
        raise DTMError(E.UNKNOWN_OP, f"VJP table out of date: no rule for {missing}, both for {both}")
