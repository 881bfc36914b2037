"""Tensor ops, named and behaving as in PyTorch, each written as DTM IR ops.

The IR is strict (equal dtypes, normalised axes, rank >= 2 matmul); this layer does what
a PyTorch user expects on top: dtype promotion, negative dims, Python scalars, 1-D matmul,
int-to-float for transcendental functions, torch's `gather`, `view(-1)`, indexing.
Every function records lazily through `apply`; nothing here computes.
"""

from __future__ import annotations

import builtins
import math
import operator
from collections import namedtuple
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from .errors import ErrorCode, user_line
from .ir.dtypes import numpy_dtype
from .ir.types import TensorType
from .tensor import (DEFAULT_FLOAT, STATE, Tensor, apply, as_dtype, bool_, capture, error, float32, int64,
                     is_grad_enabled, normalize_dim, rand, result_type, tensor)
from .tensor.devices import check_device, device_type
from .tensor.dtypes import check_fits, convert_scalar
from .tensor.jit import value_fault
from .tensor import versions as _versions  # what torch's gradients of composites read (version counter)
from .tensor import autocast as _autocast  # torch's CPU autocast lists: @_autocast.lower, @_autocast.fp32

# --- helpers ------------------------------------------------------------------------------


def _scalar(value: Any, dtype) -> Tensor:
    """A rank-0 constant: broadcasting in the IR takes it to any shape."""
    return apply("full", type=TensorType(dtype, ()), value=value)


def as_tensor(x: Any, dtype=None) -> Tensor:
    """A Tensor from a Tensor, a Python or numpy scalar (a rank-0 constant of `dtype`, else
    the scalar's promotion type), or array data (lists and arrays keep their own dtype)."""
    if isinstance(x, Tensor):
        return x if dtype is None or x.dtype is dtype else cast(x, dtype)
    if isinstance(x, (bool, int, float, np.generic)):
        d = dtype if dtype is not None else result_type(x)
        return _scalar(convert_scalar(x.item() if isinstance(x, np.generic) else x, d), d)
    return tensor(x, dtype=dtype)


def _axes(dim, rank: int) -> tuple[int, ...]:
    """Normalised reduction axes. A rank-0 tensor accepts dim 0 or -1, as in torch, and
    has no axis to reduce."""
    if dim is None:
        return tuple(range(rank))
    dims = [dim] if isinstance(dim, int) else list(dim)
    axes = {normalize_dim(d, rank) for d in dims}
    return tuple(sorted(axes)) if rank else ()


def cast(x: Tensor, dtype) -> Tensor:
    """x converted to `dtype` (a dtype or its name) by the IR's cast: float to integer rounds toward
    zero and saturates, integer to integer wraps. x itself when it has that dtype already."""
    dtype = as_dtype(dtype)
    return x if x.dtype is dtype else apply("cast", x, to=dtype)


def _float(x: Tensor) -> Tensor:
    """Integer and bool inputs of float functions compute in the default float, as in torch."""
    return x if x.dtype.is_float else cast(x, DEFAULT_FLOAT)


def _binary(op: str, a: Any, b: Any, dtype=None) -> Tensor:
    d = dtype if dtype is not None else result_type(a, b)
    return apply(op, as_tensor(a, d), as_tensor(b, d))


def _arithmetic(op: str, a: Any, b: Any, dtype=None) -> Tensor:
    """add, sub, mul, div. A narrow float tensor (f16, bf16) with a Python scalar computes
    in f32 with the scalar unrounded, then rounds once, as torch's kernels do: f16 0.04 *
    1e6 is 4e4 (rounding 1e6 to f16 first would give inf)."""
    d = dtype if dtype is not None else result_type(a, b)
    if d.is_float and d.bits < 32 and not (isinstance(a, Tensor) and isinstance(b, Tensor)):
        return cast(_binary(op, a, b, float32), d)
    return _binary(op, a, b, d)


def _index_arithmetic(fn: Callable[[int, int], int], a: Any, b: Any) -> Tensor | None:
    """a + b, a - b or a * b of a known i64 number (an index from iterating a tensor) and a
    Python int or another such number, in Python at once (wrapping as i64 does): the
    arithmetic of a data loader's loop, `data[i:i + T]`. None: the general way."""
    buf = getattr(a, "_buffer", None)
    if type(buf) is not np.ndarray or buf.ndim or buf.dtype is not _I64 or a._mesh is not None:
        return None
    if type(b) is not int:
        other = getattr(b, "_buffer", None)
        if type(other) is not np.ndarray or other.ndim or other.dtype is not _I64 or b._mesh is not None:
            return None
        b = int(other)
    if STATE.trace is not None:
        return None
    v = fn(int(buf), b)
    if not -2**63 <= v < 2**63:
        v = (v + 2**63) % 2**64 - 2**63
    return Tensor(_I64_SCALAR, buffer=np.array(v, np.int64))


_I64 = np.dtype(np.int64)
_I64_SCALAR = TensorType(int64, ())
_QUANT = as_dtype("q8_0").kind


# --- checks on values the front end already knows ----------------------------------------

# Ops through which every value of their operand reaches the result unchanged: a check on
# the result's values is a check on the operand's (a cast only when it is value-safe).
_SAME_VALUES = ("reshape", "permute", "broadcast_to")


def _value_source(t: Tensor) -> Tensor:
    """The tensor whose values t holds unchanged: t itself, or what a chain of reshapes,
    permutes, broadcasts and widening casts starts from (`targets.view(-1)` is the batch's
    targets), so a check can read values that are known though t is still pending."""
    while t._buffer is None and t._inputs and (t._op in _SAME_VALUES or (
            t._op == "cast" and np.can_cast(numpy_dtype(t._inputs[0].dtype), numpy_dtype(t.dtype), "safe"))):
        t = t._inputs[0]
    return t


class ValueCheck(NamedTuple):
    """What an op asks of an operand's values where torch raises when they fail. `fault`
    reads values already known: the message, or None. `mask` marks with IR ops the values
    still to be computed that fail (bool, the operand's shape), or is None when no value of
    the operand's dtype can; `message` is then the error's text, `{value}` standing for the
    first failing value."""

    code: ErrorCode
    fault: Callable[[np.ndarray], str | None]
    mask: Callable[[Tensor], Tensor | None]
    message: str


def _checked(t: Tensor, check: ValueCheck) -> Tensor:
    """t, its values checked as torch checks them, at the user's line: values already
    known now (data, a realized result, through _value_source); a dtm.jit argument's on
    every call of the compiled program; values still to be computed by a `check` op in the
    program (spec 3.15), which stops it before anything reads them. Use the tensor this
    returns: the check travels with it."""
    src = _value_source(t)
    if src._buffer is not None:
        message = value_fault(src._buffer, check.fault)
        if message:
            raise error(check.code, message)
        return t
    trace = STATE.trace
    if trace is not None and id(src) in trace.placeholders:
        trace.checks.append(([src], None, check.code, check.fault, user_line()))
        return t
    sources = function_of_known(t, trace.placeholders) if trace is not None else None
    if sources is not None:
        derive, _ = capture([t], params=sources)
        trace.checks.append((sources, derive, check.code, check.fault, user_line()))
        return t
    bad = check.mask(t)
    if bad is None:
        return t
    return apply("check", t, bad, code=check.code.value, message=check.message, where=user_line() or "")


_SMALL_OPS, _SMALL_ELEMENTS = 16, 4096  # a computation cheap enough to evaluate in numpy before each call


def function_of_known(t: Tensor, placeholders: set, most_ops: float = _SMALL_OPS,
                      most_elements: float = _SMALL_ELEMENTS) -> list[Tensor] | None:
    """The dtm.jit arguments and known tensors t is computed from, when t is a computation
    of them alone of at most `most_ops` ops over `most_elements` elements (by default a
    small one, a decoding step's positions, `pos + arange(T)`: its check can then be made on
    each call before the program runs, instead of inside it). None otherwise (a distributed
    t, an intermediate of the traced function, a larger one)."""
    sources: list[Tensor] = []
    seen: set[int] = set()
    stack, ops, elements = [t], 0, 0
    while stack:
        u = stack.pop()
        if id(u) in seen:
            continue
        seen.add(id(u))
        if u._mesh is not None or not all(type(d) is int for d in u.shape):
            return None
        elements += u.numel()
        known = u._buffer is not None or id(u) in placeholders
        if known:
            sources.append(u)
        else:
            ops += 1
            stack.extend(u._inputs)
        if (u._op is None and not known) or ops > most_ops or elements > most_elements:
            return None
    return sources


def _outside(t: Tensor, low: int, high: int) -> Tensor | None:
    """Where integer t is outside [low, high), compared in t's own dtype (None when no value
    of that dtype is: a bound beyond the dtype's range is never crossed)."""
    info = np.iinfo(numpy_dtype(t.dtype))
    parts = []
    if low > info.min:
        parts.append(apply("lt", t, _scalar(low, t.dtype)))
    if high <= info.max:
        parts.append(apply("ge", t, _scalar(high, t.dtype)))
    return parts[0] if len(parts) == 1 else apply("logical_or", *parts) if parts else None


def _index_check(what: str, n: int, wrap: bool) -> ValueCheck:
    """Indices into a dim of size n, as torch checks them: -n <= index < n where negative
    indices count from the end (x[idx]), else 0 <= index < n (index_select, gather,
    embedding)."""
    low = -n if wrap else 0
    message = f"{what}: index {{value}} is out of range for a dim of size {n} (expected {low} <= index < {n})"

    def fault(v: np.ndarray) -> str | None:
        if v.size <= 16:  # a decoding step's ids: a Python loop costs less than numpy's four calls
            first = next((i for i in v.ravel().tolist() if not low <= i < n), None)
        else:
            bad = (v >= n) if v.dtype.kind == "u" else (v < low) | (v >= n)
            first = v[bad].flat[0] if bad.any() else None
        return None if first is None else message.replace("{value}", str(first))
    return ValueCheck(ErrorCode.INDEX_OUT_OF_RANGE, fault, lambda t: _outside(t, low, n), message)


def _check_divisor(op: str, b: Any, d) -> Any:
    """b, checked: integer division and remainder by zero raise, as in torch; floats give
    inf / NaN."""
    if d.is_float:
        return b
    message = f"{op}: integer division by zero (the divisor {{}} holds a 0; torch raises ZeroDivisionError too)"
    if isinstance(b, Tensor):
        text = message.format(b._type)
        return _checked(b, ValueCheck(ErrorCode.DIVISION_BY_ZERO, lambda v: text if not v.all() else None,
                                      lambda t: apply("eq", t, _scalar(0, t.dtype)), text))
    if isinstance(b, (bool, int, np.integer)) and int(b) == 0:
        raise error(ErrorCode.DIVISION_BY_ZERO, message.format(repr(b)))
    return b


# --- elementwise --------------------------------------------------------------------------

def _unary_float(op: str):
    def fn(x: Tensor) -> Tensor:
        """torch's function of this name (exp, exp2, log, log2, sqrt, rsqrt, reciprocal, sin,
        cos, tanh, erf or sigmoid), elementwise, as the IR op of that name; integer and bool
        inputs compute in the default float, as in torch."""
        return apply(op, _float(x))
    fn.__name__ = op
    return fn


exp, exp2, log, log2, sqrt, rsqrt, reciprocal = (_unary_float(o) for o in
                                                 ("exp", "exp2", "log", "log2", "sqrt", "rsqrt", "reciprocal"))
sin, cos, tanh, erf, sigmoid = (_unary_float(o) for o in ("sin", "cos", "tanh", "erf", "sigmoid"))


def neg(x: Tensor) -> Tensor:
    """torch.neg: -x. Integers wrap (the most negative signed value is its own negation); a bool
    tensor raises (E0402), as torch refuses one."""
    return apply("neg", x)


def abs(x: Tensor) -> Tensor:  # noqa: A001 - torch's name
    """torch.abs: |x|. The most negative value of a signed integer dtype is its own absolute value
    (it wraps), as in torch."""
    return apply("abs", x)


def sign(x: Tensor) -> Tensor:
    """torch.sign: as the IR's sign, except that torch gives 0 for NaN (the IR keeps NaN)."""
    y = apply("sign", x)
    return apply("where", apply("ne", x, x), _scalar(0.0, x.dtype), y) if x.dtype.is_float else y


def _rounding(op: str):
    def fn(x: Tensor) -> Tensor:
        """torch's floor, ceil or round (this function's name) of a float tensor, in its dtype
        (round takes halves to even and has no `decimals` argument); an integer or bool tensor is
        returned as it is."""
        return apply(op, x) if x.dtype.is_float else x
    fn.__name__ = op
    return fn


floor, ceil, round = (_rounding(o) for o in ("floor", "ceil", "round"))  # noqa: A001


def logical_not(x: Tensor) -> Tensor:
    """torch.logical_not: a bool tensor, True where x is zero or False."""
    return apply("logical_not", cast(x, bool_))


def add(a, b, alpha=1) -> Tensor:
    """torch.add: a + alpha * b, tensors and Python scalars promoted as in torch; bool + bool is
    logical or. A narrow float tensor (f16, bf16) with a Python scalar computes in f32 and rounds
    once, as torch's kernels do."""
    quick = _index_arithmetic(operator.add, a, b) if alpha == 1 else None
    if quick is not None:
        return quick
    if alpha != 1:
        return _arithmetic("add", a, mul(b, alpha))
    d = result_type(a, b)
    if d is bool_:
        return logical_or(a, b)  # torch: bool + bool is bool (True + True is True)
    return _arithmetic("add", a, b, d)


def sub(a, b, alpha=1) -> Tensor:
    """torch.sub: a - alpha * b, tensors and Python scalars promoted as in torch (a narrow float
    tensor with a Python scalar computes in f32 and rounds once)."""
    quick = _index_arithmetic(operator.sub, a, b) if alpha == 1 else None
    if quick is not None:
        return quick
    return _arithmetic("sub", a, b if alpha == 1 else mul(b, alpha))


def mul(a, b) -> Tensor:
    """torch.mul: a * b, tensors and Python scalars promoted as in torch; bool * bool is logical
    and. A narrow float tensor with a Python scalar computes in f32 and rounds once."""
    quick = _index_arithmetic(operator.mul, a, b)
    if quick is not None:
        return quick
    d = result_type(a, b)
    if d is bool_:
        return logical_and(a, b)  # torch: bool * bool is bool
    return _arithmetic("mul", a, b, d)


def div(a, b, rounding_mode: str | None = None) -> Tensor:
    """True division (ints give floats); rounding_mode "trunc" or "floor" as in torch."""
    d = result_type(a, b)
    if rounding_mode is None:
        d = d if d.is_float else DEFAULT_FLOAT
        return _arithmetic("div", a, b, d)
    if rounding_mode == "trunc":
        b = _check_divisor("div", b, d)
        return _binary("div", a, b, d) if not d.is_float else trunc(_binary("div", a, b, d))
    if rounding_mode == "floor":
        return floor_divide(a, b)
    raise error(ErrorCode.ATTRIBUTE_VALUE, f"rounding_mode must be None, 'trunc' or 'floor', found {rounding_mode!r}")


def trunc(x: Tensor) -> Tensor:
    """torch.trunc: float values rounded toward zero; an integer or bool tensor is returned as it
    is."""
    return where(x < 0, ceil(x), floor(x)) if x.dtype.is_float else x


def floor_divide(a, b) -> Tensor:
    """torch.floor_divide, Python's a // b: the quotient rounded toward -inf, in the promoted dtype
    (integers stay integers). An integer divisor holding a 0 raises, as in torch; floats follow
    Python's // (1 // 0.1 is 9.0), except that a float divisor of 0 gives inf or NaN, as torch's."""
    d = result_type(a, b)
    b = _check_divisor("floor_divide", b, d)
    a, b = as_tensor(a, d), as_tensor(b, d)
    if d.is_float:
        return _floor_divide_float(a, b)
    q = apply("div", a, b)  # truncated; step down where the signs differ and it was inexact
    inexact = apply("ne", apply("mul", q, b), a)
    differ = apply("ne", apply("lt", a, _scalar(0, d)), apply("lt", b, _scalar(0, d)))
    return where(apply("logical_and", inexact, differ), apply("sub", q, _scalar(1, d)), q)


def _floor_divide_float(a: Tensor, b: Tensor) -> Tensor:
    """Python's and torch's float a // b, derived from fmod as torch does: floor(a / b)
    differs when the quotient rounds (1 // 0.1 is 9, floor(1 / 0.1) is 10) and at infinities
    (inf // 1 is nan; 1 // -inf is -1)."""
    d = a.dtype
    zero = _scalar(0, d)
    mod = apply("mod", a, b)
    div = apply("div", apply("sub", a, mod), b)
    fix = apply("logical_and", apply("ne", mod, zero), apply("ne", apply("lt", b, zero), apply("lt", mod, zero)))
    div = apply("where", fix, apply("sub", div, _scalar(1, d)), div)
    fl = apply("floor", div)
    fl = apply("where", apply("gt", apply("sub", div, fl), _scalar(0.5, d)), apply("add", fl, _scalar(1, d)), fl)
    quotient = apply("div", a, b)
    fl = apply("where", apply("eq", div, zero), apply("mul", zero, quotient), fl)  # 0 with the sign of a / b
    return apply("where", apply("eq", b, zero), quotient, fl)


def remainder(a, b) -> Tensor:
    """Python's modulo: the result has the sign of the divisor (torch.remainder)."""
    d = result_type(a, b)
    b = _check_divisor("remainder", b, d)
    a, b = as_tensor(a, d), as_tensor(b, d)
    r = apply("mod", a, b)
    zero = _scalar(0, d)
    fix = apply("logical_and", apply("ne", r, zero), apply("ne", apply("lt", r, zero), apply("lt", b, zero)))
    return where(fix, apply("add", r, b), r)


def fmod(a, b) -> Tensor:
    """torch.fmod: the remainder of a / b with the sign of a (C's fmod), in the promoted dtype. An
    integer divisor holding a 0 raises, as in torch; a float 0 gives NaN."""
    b = _check_divisor("fmod", b, result_type(a, b))
    return _binary("mod", a, b)


def pow(a, b) -> Tensor:  # noqa: A001
    """torch.pow: integer powers of integers stay integers; otherwise in float."""
    d = result_type(a, b)
    if d.is_int:
        return _int_pow(a, b, d)
    d = d if d.is_float else DEFAULT_FLOAT
    if isinstance(b, (int, float)) and not isinstance(b, bool) and isinstance(a, Tensor):
        if b == 2:
            a = as_tensor(a, d)
            return apply("mul", a, a)
        if b == 1:  # a new tensor, as torch's: writing to it in place must not change a
            x = as_tensor(a, d)
            return apply("broadcast_to", x, shape=x.shape) if x is a else x
        if b == 0.5:
            return _versions.saves(sqrt(as_tensor(a, d)), "pow", _versions.INPUT)
        return _versions.saves(_binary("pow", a, b, d), "pow", _versions.INPUT)  # torch's saves x, not the result
    return _binary("pow", a, b, d)


def _int_pow(a, b, d) -> Tensor:
    """Integer pow (the IR's pow is float only), as torch's. A number exponent must fit the
    dtype and not be negative (torch raises: "Integers to negative integer powers are not
    allowed", whatever the base); with a tensor base it multiplies by repeated squaring:
    exact, and wrapping on overflow as torch does. Otherwise pow computes in f64 and rounds,
    exact while the result stays below 2**53; a negative tensor exponent gives torch's
    integer quotient: 1 for a base of 1, 1 or -1 for -1, else 0."""
    if not isinstance(b, Tensor):
        b = int(b)
        check_fits("pow", b, d)
        if b < 0:
            raise error(ErrorCode.ATTRIBUTE_VALUE, "pow: integers to negative integer powers are not allowed")
    if isinstance(b, Tensor) or not isinstance(a, Tensor):
        p = apply("round", _binary("pow", a, b, as_dtype("f64")))
        if isinstance(b, Tensor):  # f64 gives 0 to a negative power an infinity; torch gives 0
            p = where(logical_and(eq(a, 0), lt(b, 0)), 0.0, p)
        return cast(p, d)
    base, out = as_tensor(a, d), None
    while b:
        if b & 1:
            out = base if out is None else apply("mul", out, base)
        b >>= 1
        if b:
            base = apply("mul", base, base)
    return out if out is not None else expand(_scalar(1, d), a.shape)


def maximum(a, b) -> Tensor:
    """torch.maximum: the larger of a and b elementwise, in their promoted dtype; a NaN in either
    gives NaN."""
    return _binary("max", a, b)


def minimum(a, b) -> Tensor:
    """torch.minimum: the smaller of a and b elementwise, in their promoted dtype; a NaN in either
    gives NaN."""
    return _binary("min", a, b)


def _compare(op: str):
    def fn(a, b) -> Tensor:
        """torch's comparison of this name (eq, ne, lt, le, gt or ge), elementwise: a bool
        tensor, the operands (tensors or Python scalars) first promoted to one dtype as in torch."""
        return _binary(op, a, b)
    fn.__name__ = op
    return fn


eq, ne, lt, le, gt, ge = (_compare(o) for o in ("eq", "ne", "lt", "le", "gt", "ge"))


def _boolean_operator(fn):
    """`&`, `|`, `^` on bool tensors and bools. torch's are bitwise on integers, which the IR
    has no op for: that is an error here, never a silently logical result."""
    def op(a, b) -> Tensor:
        for v in (a, b):
            if not (v.dtype is bool_ if isinstance(v, Tensor) else isinstance(v, (bool, np.bool_))):
                what = v.dtype if isinstance(v, Tensor) else type(v).__name__
                raise error(ErrorCode.DTYPE_MISMATCH, f"{fn.__name__}: the operators &, |, ^ and ~ need bool "
                            f"operands (bitwise integer ops are not supported), found {what}")
        return fn(a, b)
    return op


def _invert(x: Tensor) -> Tensor:
    if x.dtype is not bool_:
        raise error(ErrorCode.DTYPE_MISMATCH, f"~ needs a bool tensor (bitwise integer ops are not supported), "
                    f"found {x.dtype}")
    return logical_not(x)


def logical_and(a, b) -> Tensor:
    """torch.logical_and: a bool tensor, True where a and b are both nonzero."""
    return apply("logical_and", cast(as_tensor(a), bool_), cast(as_tensor(b), bool_))


def logical_or(a, b) -> Tensor:
    """torch.logical_or: a bool tensor, True where a or b is nonzero."""
    return apply("logical_or", cast(as_tensor(a), bool_), cast(as_tensor(b), bool_))


def logical_xor(a, b) -> Tensor:
    """torch.logical_xor: a bool tensor, True where exactly one of a and b is nonzero."""
    return apply("logical_xor", cast(as_tensor(a), bool_), cast(as_tensor(b), bool_))


def _fill_value(op: str, value: Any, dtype) -> Tensor:
    """`value` as a tensor of `dtype`, to be stored in one (where's operands, clamp's
    bounds, masked_fill, x[i] = v): a Python number that does not fit the dtype raises
    E0410, as torch raises (arithmetic with one wraps instead: i8 tensor + 1000)."""
    if isinstance(value, (bool, int, float, np.generic)):
        check_fits(op, value.item() if isinstance(value, np.generic) else value, dtype)
    return as_tensor(value, dtype)


def where(cond, x=None, y=None):
    """torch.where: x where cond holds, else y; with cond alone, nonzero(cond, as_tuple=True)."""
    if x is None and y is None:
        return nonzero(as_tensor(cond), as_tuple=True)
    d = result_type(x, y)
    return apply("where", cast(as_tensor(cond), bool_), _fill_value("where", x, d), _fill_value("where", y, d))


def nonzero(x: Tensor, as_tuple: bool = False):
    """torch.nonzero: the coordinates of the nonzero elements in row-major order, int64
    [n, ndim]; with as_tuple, one 1-D tensor per dim (a 0-d x counts as 1-D). The result's
    shape depends on the values, so this runs the pending graph, as torch syncs for it."""
    found = np.argwhere(x.numpy()).astype(np.int64)
    if not as_tuple:
        return Tensor.from_numpy(found)
    columns = found.T if x.ndim else np.zeros((1, len(found)), np.int64)
    return tuple(Tensor.from_numpy(np.ascontiguousarray(c)) for c in columns)


def clamp(x: Tensor, min=None, max=None) -> Tensor:  # noqa: A002
    """torch.clamp: values beyond a bound become the bound. Written with `where`, not
    maximum/minimum, so a value equal to a bound keeps its whole gradient, as in torch
    (maximum would split it at the tie)."""
    x = as_tensor(x, result_type(x, *(b for b in (min, max) if b is not None)))
    min, max = (b if b is None else _fill_value("clamp", b, x.dtype) for b in (min, max))
    if min is not None:
        x = _versions.saves(where(lt(x, min), min, x), "clamp", _versions.CLAMP)
    if max is not None:
        x = _versions.saves(where(gt(x, max), max, x), "clamp", _versions.CLAMP)
    return x


def relu(x: Tensor) -> Tensor:
    """torch.relu: max(x, 0), in x's dtype (a NaN stays NaN)."""
    return _versions.saves(apply("max", x, _scalar(0, x.dtype)), "relu", _versions.RESULT)


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """torch.nn.functional.gelu: x * Phi(x), Phi the standard normal CDF, exact with erf
    (approximate="none") or by the tanh approximation ("tanh"). Integer and bool inputs compute in
    the default float (torch refuses them)."""
    return apply("gelu", _float(x), approximate=approximate)


def silu(x: Tensor) -> Tensor:
    """torch.nn.functional.silu: x * sigmoid(x). Integer and bool inputs compute in the default
    float (torch refuses them)."""
    return apply("silu", _float(x))


def masked_fill(x: Tensor, mask, value) -> Tensor:
    """torch.masked_fill: the value takes x's dtype (2.5 fills an int tensor with 2)."""
    return where(mask, _fill_value("masked_fill", value, x.dtype), x)


# --- reductions ---------------------------------------------------------------------------

def _sum_dtype(x: Tensor):
    return int64 if not x.dtype.is_float else x.dtype


def sum(x: Tensor, dim=None, keepdim: bool = False, dtype=None) -> Tensor:  # noqa: A001
    """torch.sum over `dim` (an int, a sequence of ints, or None for every dim). Integer and bool
    tensors sum in int64, as in torch; `dtype` casts x to that dtype first."""
    x = cast(x, as_dtype(dtype) if dtype is not None else _sum_dtype(x))
    return apply("reduce_sum", x, axes=_axes(dim, x.ndim), keepdims=keepdim)


@_autocast.fp32
def prod(x: Tensor, dim=None, keepdim: bool = False, dtype=None) -> Tensor:
    """torch.prod over `dim` (an int, a sequence of ints, or None for every dim); torch's prod takes
    one dim only. Integer and bool tensors multiply in int64; `dtype` casts x first. Inside
    dtm.autocast, f16 and bf16 operands compute in f32, as on torch's CPU autocast list."""
    x = cast(x, as_dtype(dtype) if dtype is not None else _sum_dtype(x))
    return apply("reduce_prod", x, axes=_axes(dim, x.ndim), keepdims=keepdim)


def mean(x: Tensor, dim=None, keepdim: bool = False, dtype=None) -> Tensor:
    """torch.mean over `dim` (an int, a sequence of ints, or None for every dim). x must be a float
    tensor (after `dtype` casts it): an integer or bool one raises, as in torch."""
    x = cast(x, as_dtype(dtype)) if dtype is not None else x
    if not x.dtype.is_float:
        raise error(ErrorCode.DTYPE_MISMATCH, f"mean() needs a float tensor, found {x.dtype}; pass dtype= or cast first")
    axes = _axes(dim, x.ndim)
    n = 1
    for a in axes:
        n *= x.shape[a]
    s = apply("reduce_sum", x, axes=axes, keepdims=keepdim)
    return apply("div", s, _scalar(float(n), x.dtype))


def var(x: Tensor, dim=None, unbiased: bool | None = None, keepdim: bool = False, correction: int | None = None) -> Tensor:
    """Variance with Bessel's correction by default (correction=1), as torch.var."""
    if correction is None:
        correction = 0 if unbiased is False else 1
    x = _float(x)
    axes = _axes(dim, x.ndim)
    n = 1
    for a in axes:
        n *= x.shape[a]
    centered = sub(x, mean(x, axes, keepdim=True))
    s = apply("reduce_sum", apply("mul", centered, centered), axes=axes, keepdims=keepdim)
    out = apply("div", s, _scalar(float(builtins.max(n - correction, 0)), x.dtype))
    return _versions.saves(out, "var", (((0, 0, 0, 0),),)) if centered._op == "sub" else out  # torch's saves x


def std(x: Tensor, dim=None, unbiased: bool | None = None, keepdim: bool = False, correction: int | None = None) -> Tensor:
    """Standard deviation, the square root of `var` (Bessel's correction by default), as
    torch.std."""
    v = var(x, dim, unbiased, keepdim, correction)
    return _versions.saves(sqrt(v), "std", ((_versions.OUT, (0, 0, 0, 0, 0)),) if v._saves else _versions.RESULT)


MinMax = namedtuple("MinMax", ["values", "indices"])


def _extremum(op: str, x: Tensor, axes: tuple[int, ...], keepdim: bool) -> Tensor:
    """reduce_max / reduce_min; bool tensors (numeric-only in the IR) reduce as u8."""
    if x.dtype is bool_:
        return cast(apply(op, cast(x, "u8"), axes=axes, keepdims=keepdim), bool_)
    return apply(op, x, axes=axes, keepdims=keepdim)


def _nonempty(name: str, x: Tensor, dim) -> None:
    """max, min, argmax and argmin have no identity, so over no elements torch raises
    (E0403 here) rather than give -inf or index 0: over a dim of size 0, or over all of a
    tensor with no elements. A dim of size 0 that is not reduced leaves an empty result."""
    if dim is None:
        if x.numel() == 0:
            raise error(ErrorCode.SHAPE_MISMATCH, f"{name}(): {x._type} has no elements, and the {name} of none is "
                        "not defined (torch raises too); give dim= to reduce over dims of nonzero size")
        return
    for a in _axes(dim, x.ndim):
        if x.shape[a] == 0:
            raise error(ErrorCode.SHAPE_MISMATCH, f"{name}(): dim {a} of {x._type} has size 0, and the {name} of no "
                        "elements is not defined (torch raises too)")


def _minmax(op: str, arg: str, x: Tensor, dim, keepdim: bool):
    if dim is None:
        return _extremum(op, x, tuple(range(x.ndim)), False)
    if not isinstance(dim, int):
        return _extremum(op, x, _axes(dim, x.ndim), keepdim)
    values = _versions.saves(_extremum(op, x, _axes(dim, x.ndim), keepdim), op[7:], _versions.NOTHING)  # torch's: indices
    return MinMax(values, _arg(arg, cast(x, "u8") if x.dtype is bool_ else x, dim, keepdim))


def max(x: Tensor, dim=None, keepdim: bool = False):  # noqa: A001
    """max(x) is the maximum; max(x, dim) is (values, indices), as in torch."""
    if isinstance(dim, Tensor):
        return maximum(x, dim)
    _nonempty("max", x, dim)
    return _minmax("reduce_max", "argmax", x, dim, keepdim)


def min(x: Tensor, dim=None, keepdim: bool = False):  # noqa: A001
    """min(x) is the minimum; min(x, dim) is (values, indices), as in torch; a sequence of dims
    (which torch refuses) gives the values only; min(x, other) with a tensor is minimum. Over no
    elements it raises, as torch does."""
    if isinstance(dim, Tensor):
        return minimum(x, dim)
    _nonempty("min", x, dim)
    return _minmax("reduce_min", "argmin", x, dim, keepdim)


def amax(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    """torch.amax: the maximum over `dim` (an int, a sequence of ints, or None for every dim), no
    indices; a NaN in a reduced slice gives NaN. Over no elements it raises, as torch does."""
    _nonempty("amax", x, dim)
    return _extremum("reduce_max", x, _axes(dim, x.ndim), keepdim)


def amin(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    """torch.amin: the minimum over `dim` (an int, a sequence of ints, or None for every dim), no
    indices; a NaN in a reduced slice gives NaN. Over no elements it raises, as torch does."""
    _nonempty("amin", x, dim)
    return _extremum("reduce_min", x, _axes(dim, x.ndim), keepdim)


def _arg(op: str, x: Tensor, dim, keepdim: bool) -> Tensor:
    """argmax / argmin; a rank-0 tensor (which torch accepts with dim 0 or -1) has index 0."""
    if dim is None or x.ndim == 0:
        if dim is not None:
            normalize_dim(dim, 0)
        return apply(op, reshape(x, (-1,)), axis=0, keepdims=False)
    return apply(op, x, axis=normalize_dim(dim, x.ndim), keepdims=keepdim)


def argmax(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    """torch.argmax: the int64 index of the maximum along `dim` (of the flattened x when dim is
    None), the first one on ties; a NaN counts as the maximum. Over no elements it raises."""
    _nonempty("argmax", x, dim)
    return _arg("argmax", x, dim, keepdim)


def argmin(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    """torch.argmin: the int64 index of the minimum along `dim` (of the flattened x when dim is
    None), the first one on ties. Over no elements it raises."""
    _nonempty("argmin", x, dim)
    return _arg("argmin", x, dim, keepdim)


# --- movement -----------------------------------------------------------------------------

def _sizes(args) -> tuple:
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        return tuple(args[0])
    return tuple(args)


def reshape(x: Tensor, *shape) -> Tensor:
    """torch.reshape; `view` is the same function (no contiguity requirement). The shape is a
    tuple or separate ints, one of which may be -1; x itself when the shape is unchanged."""
    shape = list(_sizes(shape))
    if shape.count(-1) > 1:
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"reshape: only one dim can be -1, found {shape}")
    if -1 in shape:
        known = 1
        for s in shape:
            if s != -1:
                known *= s
        if known == 0 or x.numel() % known:
            raise error(ErrorCode.SHAPE_MISMATCH, f"reshape: cannot view {x._type} as {tuple(shape)}")
        shape[shape.index(-1)] = x.numel() // known
    shape = tuple(int(s) for s in shape)
    return x if shape == x.shape else apply("reshape", x, shape=shape)


view = reshape


def permute(x: Tensor, *dims) -> Tensor:
    """torch.permute: x with its dims reordered (a tuple or separate ints, negative ones counting
    from the end); x itself for the identity order."""
    dims = tuple(normalize_dim(d, x.ndim) for d in _sizes(dims))
    return x if dims == tuple(range(x.ndim)) else apply("permute", x, perm=dims)


def transpose(x: Tensor, dim0: int, dim1: int) -> Tensor:
    """torch.transpose: x with dims dim0 and dim1 swapped."""
    perm = list(range(x.ndim))
    a, b = normalize_dim(dim0, x.ndim), normalize_dim(dim1, x.ndim)
    perm[a], perm[b] = perm[b], perm[a]
    return permute(x, perm)


def expand(x: Tensor, *sizes) -> Tensor:
    """Tensor.expand: x broadcast to `sizes` (a tuple or separate ints; -1 keeps a dim's size,
    new dims go in front); x itself when the shape is unchanged."""
    sizes = list(_sizes(sizes))
    lead = len(sizes) - x.ndim
    if lead < 0:
        raise error(ErrorCode.RANK_MISMATCH, f"expand: {len(sizes)} sizes for a tensor of rank {x.ndim}")
    for i, s in enumerate(sizes):
        if s == -1 and i < lead or s < -1:  # (-1 keeps a dim's size: a new dim has none)
            raise error(ErrorCode.INVALID_DIM, f"expand: size {s} at dim {i} of {sizes} for {x._type}: -1 only "
                        "keeps the size of an existing dim, and no other size is negative")
    shape = tuple(x.shape[i - lead] if s == -1 else int(s) for i, s in enumerate(sizes))
    return x if shape == x.shape else apply("broadcast_to", x, shape=shape)


def broadcast_to(x: Tensor, shape) -> Tensor:
    """torch.broadcast_to: expand(x, shape)."""
    return expand(x, tuple(shape))


def squeeze(x: Tensor, dim=None) -> Tensor:
    """torch.squeeze: x without its size-1 dims, all of them or those in `dim` (an int or a
    sequence); a named dim whose size is not 1 stays."""
    axes = range(x.ndim) if dim is None else _axes(dim, x.ndim)
    shape = tuple(s for i, s in enumerate(x.shape) if not (i in axes and s == 1))
    return reshape(x, shape)


def unsqueeze(x: Tensor, dim: int) -> Tensor:
    """torch.unsqueeze: x with a new size-1 dim at `dim` (in [-rank - 1, rank])."""
    d = normalize_dim(dim, x.ndim + 1)
    return reshape(x, x.shape[:d] + (1,) + x.shape[d:])


def flatten(x: Tensor, start_dim: int = 0, end_dim: int = -1) -> Tensor:
    """torch.flatten: dims start_dim..end_dim merged into one; a rank-0 x becomes shape (1,)."""
    if x.ndim == 0:
        return reshape(x, (1,))
    s, e = normalize_dim(start_dim, x.ndim), normalize_dim(end_dim, x.ndim)
    n = 1
    for d in x.shape[s:e + 1]:
        n *= d
    return reshape(x, x.shape[:s] + (n,) + x.shape[e + 1:])


def cat(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    """torch.cat (also named concat): the tensors joined along `dim`, promoted to one dtype first.
    An empty sequence raises. Tensors whose values are already known join at once, in numpy."""
    tensors = list(tensors)
    if not tensors:
        raise error(ErrorCode.OPERAND_COUNT, "cat() needs at least one tensor")
    d = result_type(*tensors)
    tensors = [cast(t, d) for t in tensors]
    if len(tensors) == 1:
        return tensors[0]
    axis = normalize_dim(dim, tensors[0].ndim)
    if _known(*tensors) and all(t.shape[:axis] + t.shape[axis + 1:] == tensors[0].shape[:axis] + tensors[0].shape[axis + 1:]
                                for t in tensors):
        return Tensor.from_numpy(np.concatenate([t._buffer for t in tensors], axis=axis))
    return apply("concat", *tensors, axis=axis)


concat = cat


def stack(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    """torch.stack: the tensors (of one shape) joined along a new dim `dim`. An empty sequence
    raises. Tensors whose values are already known stack at once, in numpy."""
    tensors = list(tensors)
    if not tensors:
        raise error(ErrorCode.OPERAND_COUNT, "stack() needs at least one tensor")
    d = normalize_dim(dim, tensors[0].ndim + 1)
    if _known(*tensors) and all(t._type == tensors[0]._type for t in tensors):
        arrays = [t._buffer for t in tensors]
        out = (np.concatenate(arrays).reshape((len(arrays),) + tensors[0].shape) if d == 0 and tensors[0].ndim
               else np.stack(arrays, d))
        return Tensor.from_numpy(out)
    return cat([unsqueeze(t, d) for t in tensors], d)


def narrow(x: Tensor, dim: int, start: int, length: int) -> Tensor:
    """torch.narrow: `length` elements of x along `dim` from `start` (a negative start counts
    from the end), as an IR slice."""
    d = normalize_dim(dim, x.ndim)
    n = x.shape[d]
    at = start + n if start < 0 else start
    if not 0 <= at <= n or length < 0 or at + length > n:
        raise error(ErrorCode.INVALID_DIM, f"narrow: start {start} and length {length} do not fit dim {d} of "
                    f"{x._type} (start in [{-n}, {n}], start + length at most {n})")
    return _slice(x, d, at, at + length, 1)


def _slice(x: Tensor, axis: int, start: int, stop: int, step: int) -> Tensor:
    if (start, stop, step) == (0, x.shape[axis], 1):
        return x
    starts = [0] * x.ndim
    stops = list(x.shape)
    steps = [1] * x.ndim
    starts[axis], stops[axis], steps[axis] = start, stop, step
    return apply("slice", x, start=tuple(starts), stop=tuple(stops), step=tuple(steps))


def dynamic_slice(x: Tensor, start, dim: int, size: int) -> Tensor:
    """`size` elements of `x` along `dim` from a run-time `start` (an int or a 0-d integer
    tensor), clamped into range as jax.lax.dynamic_slice does. The start is data, not
    shape: a jitted function replays one plan for every start."""
    d = normalize_dim(dim, x.ndim)
    return apply("dynamic_slice", x, as_tensor(start, int64), axis=d, size=size)


def dynamic_update_slice(x: Tensor, update: Tensor, start, dim: int) -> Tensor:
    """`x` with `update` written along `dim` at a run-time `start` (clamped into range);
    the KV cache of a decoder writes each step's keys this way."""
    d = normalize_dim(dim, x.ndim)
    return apply("dynamic_update_slice", x, as_tensor(update, x.dtype), as_tensor(start, int64), axis=d)


def split(x: Tensor, split_size_or_sections, dim: int = 0) -> tuple[Tensor, ...]:
    """torch.split: a tuple of slices of x along `dim`, each of split_size elements (the last may
    be smaller), or of the listed sizes, which must add up to the dim's size."""
    d = normalize_dim(dim, x.ndim)
    n = x.shape[d]
    if isinstance(split_size_or_sections, int):
        size = split_size_or_sections
        if size < 0 or size == 0 and n:
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"split: split_size must be positive (0 only for a dim of size "
                        f"0), found {size} for dim {d} of {x._type}")
        sizes = [builtins.min(size, n - i) for i in range(0, n, size)] if n else [0]
    else:
        sizes = list(split_size_or_sections)
        if builtins.sum(sizes) != n:
            raise error(ErrorCode.SHAPE_MISMATCH, f"split: sizes {sizes} do not add up to dim {d} of {x._type}")
    out, at = [], 0
    for s in sizes:
        out.append(_slice(x, d, at, at + s, 1))
        at += s
    return tuple(out)


def chunk(x: Tensor, chunks: int, dim: int = 0) -> tuple[Tensor, ...]:
    """torch.chunk: x split along `dim` into pieces of ceil(size / chunks) elements, so there may be
    fewer than `chunks` of them, as in torch."""
    if chunks <= 0:
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"chunk: chunks must be positive, found {chunks}")
    n = x.shape[normalize_dim(dim, x.ndim)]
    return split(x, -(-n // chunks) if n else 1, dim)


def flip(x: Tensor, dims) -> Tensor:
    """torch.flip: x with the order of its elements reversed along `dims` (an int or a sequence)."""
    return apply("flip", x, axes=_axes(dims, x.ndim))


_PAD_MODES = ("constant", "reflect", "replicate", "circular")


def pad(x: Tensor, pad: Sequence[int], mode: str = "constant", value: float = 0.0) -> Tensor:
    """torch.nn.functional.pad: `pad` lists (left, right) for the last dim, then the one
    before it, and so on; negative amounts crop. `mode` is torch's: 'constant' (`value`),
    'reflect' (mirrored about the edge element), 'replicate' (the edge element repeated)
    or 'circular' (wrapped around), the last three padding what is left after cropping."""
    if mode not in _PAD_MODES:
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"pad: mode must be one of {', '.join(map(repr, _PAD_MODES))}, "
                    f"found {mode!r}")
    if len(pad) % 2 or len(pad) // 2 > x.ndim:
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"pad: {list(pad)} must hold (left, right) pairs for at most {x.ndim} dims")
    low, high = [0] * x.ndim, [0] * x.ndim
    for i in range(len(pad) // 2):
        low[x.ndim - 1 - i], high[x.ndim - 1 - i] = int(pad[2 * i]), int(pad[2 * i + 1])
    for a in range(x.ndim):  # crop first for negative amounts
        if low[a] < 0 or high[a] < 0:
            x = _slice(x, a, -builtins.min(low[a], 0), x.shape[a] + builtins.min(high[a], 0), 1)
    low = tuple(builtins.max(v, 0) for v in low)
    high = tuple(builtins.max(v, 0) for v in high)
    if not any(low) and not any(high):
        return x
    if mode != "constant":
        return _pad_from_edges(x, low, high, mode)
    return apply("pad", x, low=low, high=high, value=value)


def _pad_from_edges(x: Tensor, low: tuple[int, ...], high: tuple[int, ...], mode: str) -> Tensor:
    """pad's reflect, replicate and circular modes, one dim at a time: slices of x (flipped
    or broadcast) concatenated around it, so that autodiff and the compiler see movement
    ops they already know and no new IR op is needed."""
    for a in range(x.ndim):
        lo, hi, n = low[a], high[a], x.shape[a]
        if not lo and not hi:
            continue
        if mode == "reflect" and builtins.max(lo, hi) >= n:
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"pad: reflect padding ({lo}, {hi}) at dim {a} must be less than "
                        f"the size of that dim of input {list(x.shape)}")
        if mode == "circular" and builtins.max(lo, hi) > n:
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"pad: circular padding ({lo}, {hi}) at dim {a} of input "
                        f"{list(x.shape)} would wrap around more than once")
        if mode == "replicate" and n == 0:
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"pad: replicate padding of dim {a}, which is empty in input "
                        f"{list(x.shape)}")
        if mode == "reflect":  # the edge element itself is not repeated
            left, right = _slice(x, a, 1, lo + 1, 1), _slice(x, a, n - 1 - hi, n - 1, 1)
            left, right = flip(left, a) if lo else left, flip(right, a) if hi else right
        elif mode == "replicate":
            left = expand(_slice(x, a, 0, 1, 1), x.shape[:a] + (lo,) + x.shape[a + 1:])
            right = expand(_slice(x, a, n - 1, n, 1), x.shape[:a] + (hi,) + x.shape[a + 1:])
        else:
            left, right = _slice(x, a, n - lo, n, 1), _slice(x, a, 0, hi, 1)
        x = cat([part for part, size in ((left, lo), (x, n), (right, hi)) if size], a)
    return x


def _iota(shape: tuple[int, ...], dim: int) -> Tensor:
    return apply("iota", type=TensorType(int64, shape), dim=dim)


def _size_scalar(n: int) -> Tensor:
    """The size n as an int64 rank-0 value read from a type (the last element of an iota over
    n + 1; the compiler computes that one element), not a literal: a program whose sizes
    change then stays one program of its family (dtm.tensor.dynamic), where a literal n
    would make every size another."""
    return reshape(_slice(_iota((n + 1,), 0), 0, n, n + 1, 1), ())


def take(x: Tensor, index: Tensor, axis: int, wrap: bool = True) -> Tensor:
    """numpy.take along `axis`, with negative indices wrapped as Python does; with
    wrap=False negative indices are out of range, as in torch's index_select and embedding."""
    index = as_tensor(index)
    if not index.dtype.is_int:
        raise error(ErrorCode.DTYPE_MISMATCH, f"indices must be an integer tensor, found {index.dtype}")
    n = x.shape[axis]
    index = _checked(index, _index_check(f"index along dim {axis}", n, wrap))
    index = cast(index, int64)
    if wrap:
        index = where(apply("lt", index, _scalar(0, int64)), apply("add", index, _scalar(n, int64)), index)
    return apply("gather", x, index, axis=axis)


def gather(x: Tensor, dim: int, index: Tensor) -> Tensor:
    """torch.gather: `out[i][j][k] = x[i][index[i][j][k]][k]` for dim 1 (take along an axis),
    as one IR gather on the flattened tensor."""
    out = apply("gather", reshape(x, (-1,)), _positions_along("gather", x, dim, index), axis=0)
    return _versions.saves(out, "gather", ((_versions.A, _versions.B),))  # torch's saves x too


def scatter(x: Tensor, dim: int, index: Tensor, src: Any) -> Tensor:
    """torch.scatter (no reduce): x with `out[i][index[i][j]] = src[i][j]` for dim 1, src a
    tensor (read over index's shape) or a number. Where index repeats a position, the last
    write in row-major order wins (torch leaves it unspecified)."""
    positions = _positions_along("scatter", x, dim, index)
    if isinstance(src, Tensor):
        if src.ndim != x.ndim or any(s < i for s, i in zip(src.shape, positions.shape)):
            raise error(ErrorCode.SHAPE_MISMATCH, f"scatter: src {src._type} must have the rank of {x._type} and "
                        f"be at least as large as index {list(positions.shape)} in every dim")
        src = getitem(src, tuple(builtins.slice(0, n) for n in positions.shape))
    src = expand(_fill_value("scatter", src, x.dtype), positions.shape)
    return _scatter_into(x, positions, cast(src, x.dtype))


def _positions_along(op: str, x: Tensor, dim: int, index: Any) -> Tensor:
    """The flat positions in x that torch's gather / scatter `index` names along `dim`:
    index * stride(dim) plus the position of the element's other coordinates (int64,
    index's shape; indices checked as torch checks them)."""
    d = normalize_dim(dim, x.ndim)
    index = as_tensor(index)
    if not index.dtype.is_int:
        raise error(ErrorCode.DTYPE_MISMATCH, f"{op}: index must be an integer tensor, found {index.dtype}")
    if index.ndim != x.ndim or any(i > n for a, (i, n) in enumerate(zip(index.shape, x.shape)) if a != d):
        raise error(ErrorCode.RANK_MISMATCH, f"{op}: index {index._type} must have the rank of {x._type} and be no "
                    f"larger in the dims other than {d}")
    index = cast(index, int64)
    strides = [1] * x.ndim
    for a in range(x.ndim - 2, -1, -1):
        strides[a] = strides[a + 1] * x.shape[a + 1]
    n = x.shape[d]
    index = _checked(index, _index_check(f"{op} along dim {d}", n, False))
    # Unchecked (pending) negative indices still wrap, so a flat index stays within its row.
    index = where(apply("lt", index, _scalar(0, int64)), apply("add", index, _scalar(n, int64)), index)
    flat = apply("mul", index, _scalar(strides[d], int64))
    for a in range(x.ndim):
        if a != d:
            flat = apply("add", flat, apply("mul", _iota(index.shape, a), _scalar(strides[a], int64)))
    return flat


def index_add(x: Tensor, dim: int, index: Any, source: Any, alpha: Any = 1) -> Tensor:
    """torch.index_add: x with alpha * source's slice i added to x's slice index[i] along
    `dim`, repeated indices accumulating: the IR's scatter_add, the transpose of index_select."""
    d = normalize_dim(dim, x.ndim)
    index = as_tensor(index)
    if not index.dtype.is_int or index.ndim != 1:
        raise error(ErrorCode.DTYPE_MISMATCH, f"index_add: index must be a 1-D integer tensor, found {index._type}")
    index = cast(_checked(index, _index_check(f"index_add along dim {d}", x.shape[d], False)), int64)
    source = as_tensor(source) if alpha == 1 else mul(source, alpha)
    return apply("scatter_add", x, index, cast(source, x.dtype), axis=d)


def index_select(x: Tensor, dim: int, index: Tensor) -> Tensor:
    """torch.index_select: the slices of x along `dim` that the integer tensor `index` names, in its
    order. An index outside [0, size) raises, as in torch (negative ones included)."""
    return take(x, index, normalize_dim(dim, x.ndim), wrap=False)


def tril(x: Tensor, diagonal: int = 0) -> Tensor:
    """torch.tril: x with the elements above the `diagonal`-th diagonal of its last two dims set to
    zero (False for bool)."""
    return _triangle(x, diagonal, lower=True)


def triu(x: Tensor, diagonal: int = 0) -> Tensor:
    """torch.triu: x with the elements below the `diagonal`-th diagonal of its last two dims set to
    zero (False for bool)."""
    return _triangle(x, diagonal, lower=False)


def _triangle(x: Tensor, k: int, lower: bool) -> Tensor:
    shape = x.shape[-2:]
    rows, cols = _iota(shape, 0), _iota(shape, 1)
    diff = apply("sub", cols, rows)  # j - i
    keep = apply("le", diff, _scalar(k, int64)) if lower else apply("ge", diff, _scalar(k, int64))
    return apply("where", keep, x, _scalar(0 if not x.dtype.is_float else 0.0, x.dtype) if x.dtype is not bool_
                 else _scalar(False, bool_))


# --- linear algebra -----------------------------------------------------------------------

@_autocast.lower
def matmul(a: Tensor, b: Tensor) -> Tensor:
    """torch.matmul: 1-D operands are promoted to matrices and the added dim removed."""
    d = result_type(a, b)
    a, b = as_tensor(a, d), as_tensor(b, d)
    if a.ndim == 0 or b.ndim == 0:
        raise error(ErrorCode.RANK_MISMATCH, f"matmul: both operands need at least one dim, found {a._type} and {b._type}")
    squeeze_a, squeeze_b = a.ndim == 1, b.ndim == 1
    if squeeze_a:
        a = reshape(a, (1, a.shape[0]))
    if squeeze_b:
        b = reshape(b, (b.shape[0], 1))
    out = apply("matmul", a, b)
    if squeeze_a:
        out = squeeze(out, -2)
    if squeeze_b:
        out = squeeze(out, -1)
    return out


@_autocast.lower
def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T + bias (weight is [out, in], as in torch). Operands of two dtypes are
    promoted (torch refuses them), the weight before its transpose: a bf16 weight's product
    then reads the weight itself (the compiler's narrow weights)."""
    weight = as_tensor(weight, result_type(x, weight))
    y = matmul(x, transpose(weight, 0, 1))
    return add(y, bias) if bias is not None else y


# --- composites ---------------------------------------------------------------------------

def softmax(x: Tensor, dim: int = -1, dtype=None) -> Tensor:
    """torch.softmax along `dim`; `dtype` casts x first. Integer and bool inputs compute in the
    default float (torch refuses them)."""
    x = cast(_float(x), as_dtype(dtype)) if dtype is not None else _float(x)
    return apply("softmax", x, axis=normalize_dim(dim, x.ndim))


def log_softmax(x: Tensor, dim: int = -1, dtype=None) -> Tensor:
    """torch.log_softmax along `dim`; `dtype` casts x first. Integer and bool inputs compute in the
    default float (torch refuses them)."""
    x = cast(_float(x), as_dtype(dtype)) if dtype is not None else _float(x)
    return apply("log_softmax", x, axis=normalize_dim(dim, x.ndim))


def _normalized_shape(name: str, x: Tensor, normalized_shape) -> tuple[int, ...]:
    """`normalized_shape` (an int or a sequence) as a tuple, checked to be how x's shape ends:
    the trailing dims that layer_norm and rms_norm normalise over."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if x.shape[x.ndim - len(shape):] != shape:
        raise error(ErrorCode.SHAPE_MISMATCH, f"{name}: normalized_shape {shape} does not end {x._type}")
    return shape


def layer_norm(x: Tensor, normalized_shape, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5) -> Tensor:
    """torch.nn.functional.layer_norm: x normalised over its trailing dims `normalized_shape`
    (biased variance, `eps` added), then scaled by weight and shifted by bias where given."""
    shape = _normalized_shape("layer_norm", x, normalized_shape)
    lead = x.shape[:x.ndim - len(shape)]
    flat = reshape(x, lead + (int(np.prod(shape)),)) if len(shape) != 1 else x
    w = reshape(weight, (-1,)) if weight is not None else None
    b = reshape(bias, (-1,)) if bias is not None else None
    if (w is None) != (b is None):  # the IR takes both or neither
        n = flat.shape[-1]
        w = w if w is not None else as_tensor(np.ones(n, numpy_dtype(flat.dtype)))
        b = b if b is not None else as_tensor(np.zeros(n, numpy_dtype(flat.dtype)))
    out = apply("layer_norm", flat, w, b, eps=eps) if w is not None else apply("layer_norm", flat, eps=eps)
    return reshape(out, x.shape)


def _check_p(p: float, what: str) -> None:
    """A dropout probability: a number in [0, 1] (torch's ValueError otherwise)."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"{what}: p must be between 0 and 1, found {p!r}")


def dropout(x: Tensor, p: float = 0.5, training: bool = True) -> Tensor:
    """Zero each element with probability p and scale the rest by 1 / (1 - p); p = 1 zeros
    everything, as torch's."""
    _check_p(p, "dropout")
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return mul(x, 0.0)
    keep = rand(*x.shape) >= p
    return where(keep, mul(x, 1.0 / (1.0 - p)), 0.0)


@_autocast.lower
def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask=None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None) -> Tensor:
    """torch.nn.functional.scaled_dot_product_attention: softmax(q @ k^T * scale + mask) @ v, scale
    1 / sqrt(q.shape[-1]) by default. A bool attn_mask marks the keys each query may attend to, a
    float one is added to the scores; is_causal masks as a top-left lower triangle and cannot be
    combined with attn_mask. dropout_p applies whenever it is nonzero (pass 0 in eval); without a
    mask or dropout this is the IR's fused op. Inside dtm.autocast its float operands (not f64)
    are cast to the autocast dtype, as on torch's CPU autocast list."""
    if attn_mask is not None and is_causal:
        raise error(ErrorCode.ATTRIBUTE_VALUE, "scaled_dot_product_attention: give attn_mask or is_causal=True, not both")
    if attn_mask is None and not dropout_p:
        return apply("scaled_dot_product_attention", q, k, v, causal=is_causal, scale=scale)
    # Composed, with torch's semantics: a bool mask says which keys each query may attend
    # to, a float mask is added to the scores, and dropout applies to the attention weights
    # (as torch's does, always: the caller passes dropout_p=0 in eval).
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = mul(matmul(q, transpose(k, -2, -1)), scale)
    if is_causal:
        attn_mask = tril(apply("full", type=TensorType(bool_, (q.shape[-2], k.shape[-2])), value=True))
    if attn_mask is not None:
        attn_mask = as_tensor(attn_mask)
        if attn_mask.dtype is bool_:
            scores = masked_fill(scores, logical_not(attn_mask), float("-inf"))
        else:
            scores = add(scores, attn_mask)
    return matmul(dropout(softmax(scores, dim=-1), dropout_p), v)


# --- indexing -----------------------------------------------------------------------------

def _expand_index(x: Tensor, index) -> list:
    index = list(index) if isinstance(index, tuple) else [index]
    index = [np.asarray(i) if isinstance(i, list) else i for i in index]
    # A k-D bool mask covers k dims; None and ... cover none; anything else one.
    consumed = builtins.sum(i.ndim if isinstance(i, (Tensor, np.ndarray)) and i.dtype in (bool_, np.bool_) else
                            0 if i is None or i is Ellipsis else 1 for i in index)
    if builtins.sum(1 for i in index if i is Ellipsis) > 1:
        raise error(ErrorCode.ATTRIBUTE_VALUE, "an index can hold only one Ellipsis (...)")
    if consumed > x.ndim:
        raise error(ErrorCode.RANK_MISMATCH, f"too many indices ({consumed}) for a tensor of rank {x.ndim}")
    # Identity tests: `in` and `.index` would compare tensors in the index with `==`.
    at = next((k for k, i in enumerate(index) if i is Ellipsis), None)
    if at is not None:
        index[at:at + 1] = [slice(None)] * (x.ndim - consumed)
        return index
    return index + [slice(None)] * (x.ndim - consumed)


def _known(*tensors: Tensor) -> bool:
    """Whether these tensors' values are plain arrays already, and an op on them records
    nothing: not traced, no gradient to track, not distributed or quantized. Movement of
    such values is numpy's, at once: a batch sliced out of a dataset and stacked
    (nanoGPT's get_batch) builds and compiles no program."""
    if STATE.trace is not None:
        return False
    for t in tensors:  # (a loop, not all(...): this runs for every slice a data loader cuts)
        if type(t._buffer) is not np.ndarray or t._mesh is not None or (t.requires_grad and is_grad_enabled()) \
                or t._type.dtype.kind is _QUANT:
            return False
    return True


def _basic_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or isinstance(i, slice) or
               (isinstance(i, (int, np.integer)) and not isinstance(i, bool)) for i in parts)


def getitem(x: Tensor, index) -> Tensor:
    """Basic indexing (ints, slices with any step, None, ...) as slices and reshapes;
    integer tensors and lists as gathers (torch's advanced-indexing layout)."""
    if _known(x) and _basic_index(index):
        try:
            return Tensor.from_numpy(x._buffer[index])
        except IndexError:
            pass  # an index out of range: the error below names it as the recorded op would
    index = _expand_index(x, index)
    out = x
    axis = 0  # the dim of `out` that the next index entry applies to
    advanced: list[tuple[int, Tensor]] = []
    for i in index:
        if i is None:
            out = unsqueeze(out, axis)
            axis += 1
        elif isinstance(i, slice):
            n = out.shape[axis]
            start, stop, step = i.indices(n)
            if step < 0:
                # x[a:b:-s] is the flip of the ascending slice over the same elements.
                count = builtins.max(0, (start - stop - step - 1) // -step)
                lo = start + step * (count - 1) if count else 0
                out = flip(_slice(out, axis, lo, lo + (count - 1) * -step + 1 if count else 0, -step), axis)
            else:
                count = builtins.max(0, (stop - start + step - 1) // step)
                out = _slice(out, axis, start, start + (count - 1) * step + 1 if count else start, step)
            axis += 1
        elif isinstance(i, (int, np.integer)) and not isinstance(i, bool):
            n = out.shape[axis]
            if not -n <= i < n:
                raise error(ErrorCode.ATTRIBUTE_VALUE, f"index {i} is out of range for dim {axis} of size {n}")
            out = squeeze(_slice(out, axis, int(i) % n, int(i) % n + 1, 1), axis)
        elif isinstance(i, (Tensor, list, np.ndarray)):
            t = as_tensor(i) if not isinstance(i, Tensor) else i
            if t.dtype is bool_:
                # A mask's result shape depends on its values: read it now (like torch, which
                # syncs). A k-D mask covers k dims: the k index tensors of its True elements.
                if t.shape != out.shape[axis:axis + t.ndim]:
                    raise error(ErrorCode.SHAPE_MISMATCH, f"the mask {t._type} does not match dims {axis}.. "
                                f"of {out._type}")
                for k, where_true in enumerate(np.nonzero(t.numpy())):
                    advanced.append((axis + k, as_tensor(where_true.astype(np.int64))))
                axis += t.ndim
                continue
            advanced.append((axis, t))
            axis += 1
        else:
            raise error(ErrorCode.ATTRIBUTE_TYPE, f"unsupported index {i!r} of type {type(i).__name__}")
    if advanced:
        out = _advanced(out, advanced)
    return out


def _advanced(x: Tensor, advanced: list[tuple[int, Tensor]]) -> Tensor:
    """torch's advanced indexing with integer tensors at dims `axes`: the broadcast index
    shape replaces those dims (in place when they are adjacent, else at the front)."""
    axes = [a for a, _ in advanced]
    for a, t in advanced:
        if not t.dtype.is_int:
            raise error(ErrorCode.DTYPE_MISMATCH, f"tensors used as indices must be integer or bool tensors, "
                        f"found {t.dtype}")
    idx = [cast(_checked(t, _index_check(f"index into dim {a}", x.shape[a], True)), int64) for a, t in advanced]
    shape = np.broadcast_shapes(*[t.shape for t in idx])
    adjacent = axes == list(range(axes[0], axes[0] + len(axes)))
    rest = [a for a in range(x.ndim) if a not in axes]
    x = permute(x, axes + rest)
    # Merge the indexed dims into one and compute the flat index into it.
    sizes = [x.shape[i] for i in range(len(axes))]
    merged = int(np.prod(sizes)) if sizes else 1
    x = reshape(x, (merged,) + x.shape[len(axes):])
    flat = None
    stride = 1
    for t, n in reversed(list(zip(idx, sizes))):
        t = where(apply("lt", t, _scalar(0, int64)), apply("add", t, _scalar(n, int64)), t)
        term = expand(t, shape) if t.shape != tuple(shape) else t
        term = apply("mul", term, _scalar(stride, int64)) if stride != 1 else term
        flat = term if flat is None else apply("add", flat, term)
        stride *= n
    out = apply("gather", x, flat, axis=0)
    if adjacent and axes[0] > 0:
        k = len(shape)
        front = list(range(k, k + axes[0]))
        out = permute(out, front + list(range(k)) + list(range(k + axes[0], out.ndim)))
    return out


def setitem(x: Tensor, index, value) -> Tensor:
    """The value of x after `x[index] = value`, as a new lazy tensor: the flat positions
    the index selects are found by indexing an iota, and the values scattered there.
    `x[mask] = scalar` (the common masking idiom) is a `where`, which reads no values."""
    if isinstance(index, Tensor) and index.dtype is bool_ and index.shape == x.shape[:index.ndim] and (
            not isinstance(value, Tensor) or value.ndim == 0):
        mask = reshape(index, index.shape + (1,) * (x.ndim - index.ndim))
        return where(mask, _fill_value("setitem", value, x.dtype), x)
    positions = getitem(reshape(_iota((x.numel(),), 0), x.shape), index)
    value = _fill_value("setitem", value, x.dtype)
    extra = value.ndim - positions.ndim
    if extra > 0 and value.shape[:extra] == (1,) * extra:  # torch drops leading size-1 dims
        value = reshape(value, value.shape[extra:])
    value = expand(value, positions.shape) if value.shape != positions.shape else value
    return _scatter_into(x, positions, value)


def _scatter_into(x: Tensor, positions: Tensor, value: Tensor) -> Tensor:
    """x with `value` written at the flat positions `positions` (int64, value's shape). A
    position written more than once takes the last of its values in row-major order, as
    torch's index_put_ on the CPU (x[[0, 0]] += 1 adds 1 once): the writes are sorted by
    position (a stable sort), and only the last of each run of equal positions is kept."""
    flat_pos = reshape(positions, (-1,))
    flat_val = reshape(value, (-1,))
    n, k = x.numel(), flat_pos.numel()
    if k > 1:
        order = apply("argsort", flat_pos, axis=0)
        flat_pos, flat_val = apply("gather", flat_pos, order, axis=0), apply("gather", flat_val, order, axis=0)
        after = apply("concat", _slice(flat_pos, 0, 1, k, 1), apply("full", type=TensorType(int64, (1,)), value=-1),
                      axis=0)
        last = apply("ne", flat_pos, after)  # the next write goes elsewhere: this one stays
        flat_pos = where(last, flat_pos, _size_scalar(n))  # the others go past the end (ignored)
    hit = apply("scatter_add", apply("full", type=TensorType(int64, (n + 1,)), value=0), flat_pos,
                apply("full", type=TensorType(int64, flat_pos.shape), value=1), axis=0)
    vals_dtype = x.dtype if x.dtype is not bool_ else int64
    placed = apply("scatter_add", apply("full", type=TensorType(vals_dtype, (n + 1,)), value=0), flat_pos,
                   cast(flat_val, vals_dtype), axis=0)
    hit, placed = _slice(hit, 0, 0, n, 1), cast(_slice(placed, 0, 0, n, 1), x.dtype)
    new = where(apply("gt", hit, _scalar(0, int64)), placed, reshape(x, (-1,)))
    return reshape(new, x.shape)


def to(x: Tensor, *args, **kwargs) -> Tensor:
    """x.to(dtype) / x.to("cpu") / x.to(device, dtype) / x.to(other) (other's dtype)."""
    dtype = _to_dtype(args, kwargs)
    return cast(x, dtype) if dtype is not None else x


def _to_dtype(args: tuple, kwargs: dict):
    """The dtype a torch-style .to(...) call names (a Tensor names its own), or None for
    a device alone (which must be the CPU): Tensor.to and Module.to read their arguments alike."""
    dtype = kwargs.get("dtype")
    if kwargs.get("device") is not None:
        check_device(kwargs["device"], ".to")
    for a in args:
        if device_type(a) is not None:
            check_device(a, ".to")
            continue
        dtype = a.dtype if isinstance(a, Tensor) else a
    return dtype





def _format(x: Tensor, spec: str) -> str:
    """format(x, spec), as torch: a 0-d tensor formats as its number (f"{loss:.4f}"); any
    other takes only the empty spec (str(x))."""
    return format(x.item(), spec) if x.ndim == 0 else object.__format__(x, spec)


def _reflected(fn):
    return lambda self, other: fn(other, self)


_METHODS = {
    # operators
    "__add__": add, "__radd__": _reflected(add), "__sub__": sub, "__rsub__": _reflected(sub),
    "__mul__": mul, "__rmul__": _reflected(mul), "__truediv__": div, "__rtruediv__": _reflected(div),
    "__floordiv__": floor_divide, "__rfloordiv__": _reflected(floor_divide), "__mod__": remainder,
    "__rmod__": _reflected(remainder), "__pow__": pow, "__rpow__": _reflected(pow), "__matmul__": matmul,
    "__rmatmul__": _reflected(matmul), "__neg__": neg, "__abs__": abs, "__eq__": eq, "__ne__": ne,
    "__lt__": lt, "__le__": le, "__gt__": gt, "__ge__": ge, "__and__": _boolean_operator(logical_and),
    "__or__": _boolean_operator(logical_or), "__xor__": _boolean_operator(logical_xor), "__invert__": _invert,
    "__rand__": _reflected(_boolean_operator(logical_and)), "__ror__": _reflected(_boolean_operator(logical_or)),
    "__rxor__": _reflected(_boolean_operator(logical_xor)), "__getitem__": getitem,
    # methods
    "add": add, "sub": sub, "mul": mul, "div": div, "pow": pow, "neg": neg, "abs": abs, "sign": sign,
    "exp": exp, "exp2": exp2, "log": log, "log2": log2, "sqrt": sqrt, "rsqrt": rsqrt, "reciprocal": reciprocal,
    "sin": sin, "cos": cos, "tanh": tanh, "erf": erf, "sigmoid": sigmoid, "floor": floor, "ceil": ceil,
    "round": round, "trunc": trunc, "relu": relu, "gelu": gelu, "silu": silu, "clamp": clamp, "clip": clamp,
    "maximum": maximum, "minimum": minimum, "eq": eq, "ne": ne, "lt": lt, "le": le, "gt": gt, "ge": ge,
    "logical_not": logical_not, "logical_and": logical_and, "logical_or": logical_or,
    "masked_fill": masked_fill, "where": lambda self, cond, other: where(cond, self, other),
    "sum": sum, "prod": prod, "mean": mean, "var": var, "std": std, "max": max, "min": min, "amax": amax,
    "amin": amin, "argmax": argmax, "argmin": argmin,
    "reshape": reshape, "view": view, "permute": permute, "transpose": transpose, "expand": expand,
    "broadcast_to": broadcast_to, "squeeze": squeeze, "unsqueeze": unsqueeze, "flatten": flatten,
    "split": split, "chunk": chunk, "flip": flip, "narrow": narrow, "gather": gather,
    "index_select": index_select, "scatter": scatter, "index_add": index_add, "nonzero": nonzero, "tril": tril,
    "triu": triu, "matmul": matmul,
    "softmax": softmax, "log_softmax": log_softmax, "to": to, "type_as": lambda self, o: cast(self, o.dtype),
    "contiguous": lambda self: self, "clone": lambda self: self.detach() if not self.requires_grad else add(self, 0),
    "float": lambda self: cast(self, float32), "double": lambda self: cast(self, "f64"),
    "half": lambda self: cast(self, "f16"), "bfloat16": lambda self: cast(self, "bf16"),
    "long": lambda self: cast(self, int64), "int": lambda self: cast(self, "i32"), "bool": lambda self: cast(self, bool_),
    "cpu": lambda self: self, "__format__": _format,
    "t": lambda self: transpose(self, 0, 1) if self.ndim == 2 else self,
    "T": property(lambda self: permute(self, tuple(reversed(range(self.ndim))))),
    "mT": property(lambda self: transpose(self, -2, -1)),
}
for _name, _fn in _METHODS.items():
    setattr(Tensor, _name, _fn)


__all__ = [n for n in dir() if not n.startswith("_") and n not in (
    "annotations", "builtins", "namedtuple", "NamedTuple", "np", "Any", "Sequence", "ErrorCode", "TensorType", "Tensor",
    "apply", "as_dtype", "bool_", "capture", "error", "float32", "int64", "is_grad_enabled", "result_type", "numpy_dtype",
    "normalize_dim", "tensor", "check_device",
    "DEFAULT_FLOAT", "MinMax", "Callable", "STATE", "user_line", "value_fault", "ValueCheck")]
