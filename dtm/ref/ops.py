"""The reference semantics: one numpy implementation per op of the registry (the
collectives and point-to-point ops are in collectives.py, `call` in interpreter.py: they
register into the same table).

`IMPLS[name](ctx, attrs, *inputs, out_types=...)` returns the op's results as a tuple of
numpy arrays (the ops in TAKES_IN_TYPES also take `in_types=`, their operands' static types). `attrs` holds every attribute with symbolic dims already evaluated, and
`out_types` the result types with static shapes, which creation ops read their shape and
dtype from. Each result has exactly the shape and numpy dtype of its type (quantized types:
the uint8 block storage of `dtm.ref.quant`).

Conventions that hold for every op below:
- Narrow floats (f16, bf16, f8e4m3, f8e5m2) are computed in f32 and the result rounded
  once to the result dtype; f32 computes in f32 and f64 in f64. Exceptions, computed in
  f64 and rounded once: `erf`, exact `gelu` and `random`.
- Integers wrap around (two's complement), never raise, never promote; division by zero
  gives 0. No op warns: the interpreter silences numpy's floating-point warnings.
- Results never alias operands (the interpreter copies a result that might).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from ..errors import DTMError, ErrorCode as E, tensor_error
from ..ir.dtypes import NARROW_FLOATS
from ..ir.types import TensorType
from . import philox, quant
from .mathfn import erf as _erf_f64

Impl = Callable[..., tuple]
IMPLS: dict[str, Impl] = {}



# --- helpers -----------------------------------------------------------------------------

def _wide(x: np.ndarray) -> np.ndarray:
    """The array to compute with: narrow floats as f32, everything else as is."""
    return x.astype(np.float32) if x.dtype in NARROW_FLOATS else x


def _np(t: TensorType) -> np.dtype:
    return quant.storage_dtype(t.dtype)


def _as(x, t: TensorType) -> np.ndarray:
    """x rounded (or converted) to the numpy dtype of type t."""
    return np.asarray(x).astype(_np(t), copy=False)


def _scalar(value, dtype: np.dtype):
    """An attribute scalar as a 0-d array of `dtype` (integers wrap, floats round)."""
    return np.array(value).astype(dtype)


def _is_int(x: np.ndarray) -> bool:
    return x.dtype.kind in "iu"


def _is_float(x: np.ndarray) -> bool:
    return x.dtype.kind == "f" or x.dtype in NARROW_FLOATS  # ml_dtypes' kind is "V"


def _clamp_index(idx: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Integer indices of any dtype clamped into [lo, hi] (hi >= lo), as int64."""
    idx = np.asarray(idx)
    if idx.dtype.kind == "u":  # large u64 values must not wrap to negatives
        return np.maximum(np.minimum(idx.astype(np.uint64), np.uint64(hi)).astype(np.int64), lo)
    return np.clip(idx.astype(np.int64), lo, hi)


# Ops whose implementation needs its operands' static types, passed as `in_types=`: a
# quantized operand's uint8 block storage does not say which type it holds.
TAKES_IN_TYPES = frozenset({"store_put"})


def register(name: str):
    def deco(fn: Impl) -> Impl:
        assert name not in IMPLS, name
        IMPLS[name] = fn
        return fn
    return deco


def elementwise(name: str, fn: Callable) -> None:
    """Register an op that applies fn to its (widened) operands; numpy broadcasting."""
    def impl(ctx, attrs, *xs, out_types):
        return (_as(fn(*[_wide(x) for x in xs]), out_types[0]),)
    impl.__name__ = f"ref_{name}"
    register(name)(impl)


# --- elementwise unary -------------------------------------------------------------------

def _sigmoid(x):
    return 1 / (1 + np.exp(-x))  # exp overflow gives inf and 1/inf = 0: exact limits


for _name, _fn in {
    "neg": np.negative, "abs": np.abs,        # integers wrap: abs(MIN) = MIN
    "sign": np.sign,                          # NaN stays NaN
    "exp": np.exp, "exp2": np.exp2, "log": np.log, "log2": np.log2, "sqrt": np.sqrt,
    "rsqrt": lambda x: np.reciprocal(np.sqrt(x)), "reciprocal": np.reciprocal,
    "sin": np.sin, "cos": np.cos, "tanh": np.tanh,
    "erf": _erf_f64,                          # in f64 (fdlibm's, < 1 ulp), then rounded
    "sigmoid": _sigmoid, "floor": np.floor, "ceil": np.ceil,
    "round": np.rint,                         # half to even
    "logical_not": np.logical_not,
}.items():
    elementwise(_name, _fn)


@register("cast")
def _cast(ctx, attrs, x, *, out_types):
    """Float -> int truncates toward zero, saturates out of range, NaN -> 0; any -> bool is
    x != 0 (NaN -> true); int -> int wraps; other pairs round to nearest even (numpy astype).
    Quantized: float -> q8_0/q4_0 quantizes, and back dequantizes (dtm.ref.quant)."""
    t = out_types[0]
    if t.dtype.is_quant:
        return (quant.quantize(x, t.dtype),)
    if x.shape != tuple(t.shape):  # uint8 block storage of a quantized operand
        src = quant.dtype_of_storage(x.shape[-1], t.shape[-1])
        return (quant.dequantize(x, src, _np(t)),)
    out = _np(t)
    if out == np.bool_:
        return (x != 0,)
    if out.kind in "iu" and _is_float(x):
        return (_float_to_int(x, out),)
    return (x.astype(out),)


def _float_to_int(x: np.ndarray, out: np.dtype) -> np.ndarray:
    t = np.trunc(x.astype(np.float64))
    info = np.iinfo(out)
    high = t >= float(info.max)  # float(max) rounds up to 2^63 / 2^64 for 64-bit: still right
    low = t <= float(info.min)
    inside = np.where(high | low | np.isnan(t), 0, t).astype(out)
    return np.where(high, info.max, np.where(low, info.min, inside)).astype(out)


@register("bitcast")
def _bitcast(ctx, attrs, x, *, out_types):
    """The same bits read as the result dtype; to bool, a nonzero byte reads as true."""
    out = _np(out_types[0])
    if out == np.bool_:
        return (x.view(np.uint8) != 0,)
    return (x.view(out),)


# --- elementwise binary, comparisons, where ------------------------------------------------

def _trunc_div(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Integer x / y rounded toward zero (C semantics); y == 0 gives 0; MIN / -1 wraps to MIN."""
    safe = np.where(y == 0, 1, y).astype(y.dtype)
    q = np.floor_divide(x, safe)
    if x.dtype.kind == "i":  # floor -> trunc: inexact quotients of unlike signs step toward zero
        step = (np.remainder(x, safe) != 0) & ((x < 0) != (safe < 0))
        q = q + step.astype(q.dtype)
    return np.where(y == 0, np.zeros((), q.dtype), q)


def _div(x, y):
    return _trunc_div(x, y) if _is_int(x) else x / y


def _mod(x, y):
    if _is_int(x):  # C fmod: the sign of x; y == 0 gives 0
        safe = np.where(y == 0, 1, y).astype(y.dtype)
        return np.where(y == 0, np.zeros((), x.dtype), np.fmod(x, safe))
    return np.fmod(x, y)



for _name, _fn in {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": _div, "pow": np.power,
    "max": np.maximum, "min": np.minimum,    # NaN propagates
    "mod": _mod,
    "logical_and": np.logical_and, "logical_or": np.logical_or, "logical_xor": np.logical_xor,
    "eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
    "gt": np.greater, "ge": np.greater_equal,
}.items():
    elementwise(_name, _fn)


@register("where")
def _where(ctx, attrs, cond, x, y, *, out_types):
    return (_as(np.where(cond, x, y), out_types[0]),)


# --- reductions ----------------------------------------------------------------------------

def _identity(ufunc, dtype: np.dtype):
    """The initial value of a max / min reduction: what an empty reduction returns."""
    if dtype.kind == "f":
        return -np.inf if ufunc is np.maximum else np.inf
    info = np.iinfo(dtype)
    return info.min if ufunc is np.maximum else info.max


def _reduction(name: str, ufunc) -> None:
    """Reduce over `axes` (an empty list reduces nothing); integers wrap; max / min
    propagate NaN and of an empty set are -inf / +inf (integers: the dtype's min / max).
    Float sums accumulate in f64 and round once (spec 2.8): numpy adds pairwise only along
    a contiguous axis, and one running f32 sum stops growing at 2^24 ones."""
    def impl(ctx, attrs, x, *, out_types):
        w = _wide(x)
        acc = np.dtype(np.float64) if ufunc is np.add and w.dtype.kind == "f" else w.dtype
        kw = {"initial": _identity(ufunc, w.dtype)} if ufunc in (np.maximum, np.minimum) else {"dtype": acc}
        r = ufunc.reduce(w, axis=tuple(attrs["axes"]), keepdims=attrs["keepdims"], **kw)
        return (_as(r, out_types[0]),)
    impl.__name__ = f"ref_{name}"
    register(name)(impl)


_reduction("reduce_sum", np.add)
_reduction("reduce_prod", np.multiply)
_reduction("reduce_max", np.maximum)
_reduction("reduce_min", np.minimum)


def _arg_reduction(name: str, fn) -> None:
    """The first index of the extreme along `axis` (a NaN counts as the extreme, so the
    first NaN wins); 0 where the axis is empty."""
    def impl(ctx, attrs, x, *, out_types):
        axis = attrs["axis"]
        if x.shape[axis] == 0:
            return (np.zeros(out_types[0].shape, np.int64),)
        return (_as(fn(_wide(x), axis=axis, keepdims=attrs["keepdims"]), out_types[0]),)
    impl.__name__ = f"ref_{name}"
    register(name)(impl)


_arg_reduction("argmax", np.argmax)
_arg_reduction("argmin", np.argmin)


@register("argsort")
def _argsort(ctx, attrs, x, *, out_types):
    """Stable: equal elements keep their order (numpy's stable sort puts NaN last). In
    descending order the operand is reversed, sorted ascending, and the result reversed:
    equal elements then keep their order too, and NaN comes first."""
    axis, x = attrs["axis"], _wide(x)
    if not attrs["descending"]:
        return (np.argsort(x, axis=axis, kind="stable").astype(np.int64),)
    n = x.shape[axis]
    rev = np.argsort(np.flip(x, axis), axis=axis, kind="stable")
    return (np.flip(n - 1 - rev, axis).astype(np.int64),)


@register("cumsum")
def _cumsum(ctx, attrs, x, *, out_types):
    """Left to right along `axis` (numpy's accumulate is sequential): floats in f64, each
    element rounded once; integers wrap in their own dtype."""
    acc = np.float64 if _is_float(x) else x.dtype
    return (_as(np.cumsum(_wide(x), axis=attrs["axis"], dtype=acc), out_types[0]),)


# --- movement ------------------------------------------------------------------------------

@register("reshape")
def _reshape(ctx, attrs, x, *, out_types):
    return (np.reshape(x, tuple(attrs["shape"])),)  # row-major


@register("permute")
def _permute(ctx, attrs, x, *, out_types):
    return (np.transpose(x, attrs["perm"]),)


@register("broadcast_to")
def _broadcast_to(ctx, attrs, x, *, out_types):
    return (np.broadcast_to(x, tuple(attrs["shape"])),)


@register("slice")
def _slice(ctx, attrs, x, *, out_types):
    for i, (a, b, d) in enumerate(zip(attrs["start"], attrs["stop"], x.shape)):
        if not 0 <= a <= b <= d:  # reachable only through symbolic bounds: the verifier checks the rest
            raise DTMError(E.ATTRIBUTE_VALUE, f"slice: dim {i} of size {d} needs 0 <= start <= stop <= {d}, "
                           f"found {a}:{b}")
    return (x[tuple(slice(a, b, s) for a, b, s in zip(attrs["start"], attrs["stop"], attrs["step"]))],)


@register("pad")
def _pad(ctx, attrs, x, *, out_types):
    out = np.full(out_types[0].shape, _scalar(attrs["value"], x.dtype), x.dtype)
    out[tuple(slice(lo, lo + d) for lo, d in zip(attrs["low"], x.shape))] = x
    return (out,)


@register("concat")
def _concat(ctx, attrs, *xs, out_types):
    return (np.concatenate(xs, axis=attrs["axis"]),)


def _along(axis: int, index) -> tuple:
    """An index expression selecting `index` on dim `axis`."""
    return (slice(None),) * axis + (index,)


@register("gather")
def _gather(ctx, attrs, x, indices, *, out_types):
    """np.take with every index clamped into [0, n - 1] (negatives clamp to 0, no wrap);
    from an empty axis every element is 0."""
    axis, n = attrs["axis"], x.shape[attrs["axis"]]
    if n == 0:
        return (np.zeros(out_types[0].shape, x.dtype),)
    return (np.take(x, _clamp_index(indices, 0, n - 1), axis=axis),)


@register("scatter_add")
def _scatter_add(ctx, attrs, x, indices, updates, *, out_types):
    """x plus every update added at its clamped index (the transpose of gather); repeated
    indices accumulate in row-major order of `indices`."""
    out = _wide(x).copy()
    scatter_add_into(out, indices, updates, attrs["axis"])
    return (_as(out, out_types[0]),)


def scatter_add_into(out: np.ndarray, indices: np.ndarray, updates: np.ndarray, axis: int) -> None:
    """scatter_add's accumulation, in place: `out` holds x on entry and the result on exit
    (a compiled plan gives it memory it planned, so no fresh array is made per call)."""
    n = out.shape[axis]
    if n > 0:
        np.add.at(out, _along(axis, _clamp_index(indices, 0, n - 1)), _wide(updates))


@register("flip")
def _flip(ctx, attrs, x, *, out_types):
    return (np.flip(x, axis=tuple(attrs["axes"])) if attrs["axes"] else x,)


def _start(start: np.ndarray, dim: int, size: int) -> int:
    """A run-time start clamped into [0, dim - size], so the window always fits."""
    return int(_clamp_index(start, 0, max(dim - size, 0)))


@register("dynamic_slice")
def _dynamic_slice(ctx, attrs, x, start, *, out_types):
    axis, size = attrs["axis"], attrs["size"]
    if size > x.shape[axis]:
        raise DTMError(E.ATTRIBUTE_VALUE, f"dynamic_slice: size {size} does not fit dim {axis} of size {x.shape[axis]}")
    s = _start(start, x.shape[axis], size)
    return (x[_along(axis, slice(s, s + size))],)


@register("dynamic_update_slice")
def _dynamic_update_slice(ctx, attrs, x, update, start, *, out_types):
    axis = attrs["axis"]
    size, dim = update.shape[axis], x.shape[axis]
    if size > dim:
        raise DTMError(E.SHAPE_MISMATCH, f"dynamic_update_slice: the update has {size} elements along dim "
                       f"{axis}, the operand only {dim}")
    out = x.copy()
    s = _start(start, dim, size)
    out[_along(axis, slice(s, s + size))] = update
    return (out,)


# --- linear algebra ------------------------------------------------------------------------

@register("matmul")
def _matmul(ctx, attrs, a, b, *, out_types):
    """np.matmul over the last two dims, batch dims broadcast; integers accumulate in their
    own dtype, wrapping (the result is exact modulo 2^bits)."""
    return (_as(np.matmul(_wide(a), _wide(b)), out_types[0]),)


# --- creation ------------------------------------------------------------------------------

@register("constant")
def _constant(ctx, attrs, *, out_types):
    return (attrs["value"].to_numpy(),)


@register("full")
def _full(ctx, attrs, *, out_types):
    t = out_types[0]
    return (np.full(t.shape, _scalar(attrs["value"], _np(t)), _np(t)),)


@register("iota")
def _iota(ctx, attrs, *, out_types):
    t, dim = out_types[0], attrs["dim"]
    shape = tuple(t.shape)
    line = np.arange(shape[dim], dtype=np.int64).reshape([-1 if i == dim else 1 for i in range(len(shape))])
    return (np.broadcast_to(line, shape).astype(_np(t)),)


@register("random")
def _random(ctx, attrs, key, *, out_types):
    """Philox4x32-10 of each element's row-major index under `key` (dtm.ref.philox)."""
    t = out_types[0]
    draw = philox.uniform if attrs["distribution"] == "uniform" else philox.normal
    return (draw(key, tuple(t.shape), _np(t)),)


# --- composites (computed in f32 for narrow floats, then rounded once) ---------------------

def _softmax_f(x: np.ndarray, axis: int) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True, initial=-np.inf)  # subtract the max: no overflow
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


@register("softmax")
def _softmax(ctx, attrs, x, *, out_types):
    return (_as(_softmax_f(_wide(x), attrs["axis"]), out_types[0]),)


@register("log_softmax")
def _log_softmax(ctx, attrs, x, *, out_types):
    w, axis = _wide(x), attrs["axis"]
    m = np.max(w, axis=axis, keepdims=True, initial=-np.inf)
    return (_as(w - m - np.log(np.sum(np.exp(w - m), axis=axis, keepdims=True)), out_types[0]),)


@register("layer_norm")
def _layer_norm(ctx, attrs, x, *affine, out_types):
    """(x - mean) / sqrt(var + eps) over the last dim, var biased (divide by n); NaN for
    a row whose squares overflowed (var + eps infinite), not the 0s of d / inf."""
    w = _wide(x)
    mean = np.mean(w, axis=-1, keepdims=True)
    var = np.mean(np.square(w - mean), axis=-1, keepdims=True)
    ve = var + attrs["eps"]
    y = (w - mean) / np.where(np.isinf(ve), np.nan, np.sqrt(ve))
    if affine:
        weight, bias = affine
        y = y * _wide(weight) + _wide(bias)
    return (_as(y, out_types[0]),)


@register("gelu")
def _gelu(ctx, attrs, x, *, out_types):
    """exact: 0.5 x (1 + erf(x / sqrt 2)), in f64; tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    if attrs["approximate"] == "none":
        w = x.astype(np.float64)
        return (_as(0.5 * w * (1.0 + _erf_f64(w / math.sqrt(2.0))), out_types[0]),)
    w = _wide(x)
    inner = math.sqrt(2.0 / math.pi) * (w + 0.044715 * w * w * w)
    return (_as(0.5 * w * (1 + np.tanh(inner)), out_types[0]),)


@register("silu")
def _silu(ctx, attrs, x, *, out_types):
    w = _wide(x)
    return (_as(w * _sigmoid(w), out_types[0]),)


@register("scaled_dot_product_attention")
def _sdpa(ctx, attrs, q, k, v, *, out_types):
    """softmax(q k^T * scale) v over [..., L, D], [..., S, D], [..., S, Dv]; scale defaults
    to 1/sqrt(D); causal keeps key j for query i iff j <= i (top-left aligned, as
    torch's is_causal); with S = 0 the result is 0."""
    q, k, v = _wide(q), _wide(k), _wide(v)
    d = q.shape[-1]
    scale = attrs["scale"] if attrs["scale"] is not None else float(np.float64(1.0) / np.sqrt(np.float64(d)))
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
    if attrs["causal"]:
        L, S = s.shape[-2:]
        s = np.where(np.tri(L, S, dtype=bool), s, -np.inf)
    return (_as(np.matmul(_softmax_f(s, -1), v), out_types[0]),)


# --- state ---------------------------------------------------------------------------------

@register("assign")
def _assign(ctx, attrs, target, value, *, out_types):
    """Write value into the caller's buffer for the parameter `target`, in place."""
    if not target.flags.writeable:
        raise DTMError(E.READ_ONLY_INPUT, "assign: the input array bound to the target is read-only; "
                       "pass a writable array the caller owns")
    np.copyto(target, value)
    return ()


# --- run-time checks -------------------------------------------------------------------------

@register("check")
def _check(ctx, attrs, x, fault, *, out_types):
    """x, unless a fault is set: then the error the front end asked for, `{value}` in its
    message replaced by the first element of x (row-major) whose fault is set."""
    raise_fault(x, fault, attrs)
    return (x,)


def raise_fault(x: np.ndarray, fault: np.ndarray, attrs: dict) -> None:
    """Raise the `check` op's error (attrs: code, message, where) when any fault is set."""
    if fault.any():
        message = attrs["message"].replace("{value}", str(x[fault].flat[0].item()))
        raise tensor_error(E(attrs["code"]), message, attrs["where"] or None)


# --- checking a value that arrives from another rank (recv) ----------------------------------

def expect_value(x: np.ndarray, t: TensorType, what: str) -> None:
    """Raise unless x holds a value of static type t."""
    if x.dtype != _np(t):
        raise DTMError(E.DTYPE_MISMATCH, f"{what}: expected {t}, found a {x.dtype} array")
    if x.shape != quant.storage_shape(t):
        raise DTMError(E.SHAPE_MISMATCH, f"{what}: expected {t} (array shape {list(quant.storage_shape(t))}), "
                       f"found shape {list(x.shape)}")


# --- store ------------------------------------------------------------------------

@register("store_get")
def _store_get(ctx, attrs, *, out_types):
    """The store checks the stored type against the declared one (E0402, then E0403) before
    it reads any bytes, and every chunk's CRC32C as it reads them."""
    t = out_types[0]
    x = ctx.tensor_store().get_array(attrs["key"], dtype=t.dtype, shape=t.shape)
    return (np.array(x, copy=True),)  # the store's array is read-only, maybe a map of its file


@register("store_put")
def _store_put(ctx, attrs, x, *, out_types, in_types):
    ctx.tensor_store().put_array(attrs["key"], x, dtype=in_types[0].dtype)  # the store copies x
    return ()
