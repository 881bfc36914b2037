"""Every op of the reference semantics against PyTorch (or, where the spec departs from
torch or torch lacks the op, against the rule written out in numpy), run through the
interpreter on a one-op module: broadcasting, size-0 and size-1 dims, every float dtype
torch has, integers where the op takes them."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from dtm.ir import Builder, TensorType
from dtm.ir.dtypes import from_numpy
from dtm.ir.types import Literal
from dtm.ref import run, storage_dtype, storage_shape

torch = pytest.importorskip("torch")

BF16 = np.dtype(ml_dtypes.bfloat16)
F8E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
F8E5M2 = np.dtype(ml_dtypes.float8_e5m2)
FLOATS = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]
INTS = [np.dtype(t) for t in (np.int8, np.int32, np.int64, np.uint8)]
ALL_INTS = [np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)]
# (rtol, atol): a few units in the last place of each dtype.
TOL = {np.dtype(np.float16): (2e-3, 2e-3), BF16: (1.6e-2, 1.6e-2),
       np.dtype(np.float32): (1e-5, 1e-6), np.dtype(np.float64): (1e-12, 1e-13)}
rng = np.random.default_rng(20240501)


# --- helpers ---------------------------------------------------------------------------

def ttype(a: np.ndarray) -> TensorType:
    return TensorType(from_numpy(a.dtype), tuple(a.shape))


def op1(name: str, *arrays: np.ndarray, type=None, **attrs):
    """Run a one-op module: op `name` on `arrays` (one parameter each); its result(s)."""
    b = Builder()
    f = b.func("f")
    params = [f.param(ttype(a)) for a in arrays]
    r = f.op(name, *params, type=type, **attrs)
    rs = r if isinstance(r, tuple) else (r,)
    f.ret(*rs)
    outs = run(b.build(), "f", [np.array(a, copy=True) for a in arrays])
    for v, o in zip(rs, outs):  # every result has its type's exact dtype and shape
        assert o.dtype == storage_dtype(v.type.dtype) and o.shape == storage_shape(v.type)
    return outs[0] if len(outs) == 1 else outs


def T(a: np.ndarray):
    """numpy -> torch (bf16 through f32, which is exact)."""
    a = np.array(a, order="C")  # (ascontiguousarray would make a 0-d array 1-d)
    if a.dtype == BF16:
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(a.copy())


def N(t) -> np.ndarray:
    """torch -> numpy."""
    if t.dtype == torch.bfloat16:
        return t.float().numpy().astype(BF16)
    return t.numpy()


def close(ours: np.ndarray, ref, dtype=None, tol=None):
    ref = N(ref) if isinstance(ref, torch.Tensor) else np.asarray(ref)
    dtype = np.dtype(dtype or ours.dtype)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    assert ours.dtype == dtype, (ours.dtype, dtype)
    if dtype.kind in "biu":
        np.testing.assert_array_equal(ours, ref.astype(dtype))
        return
    rtol, atol = tol or TOL.get(dtype, (0.13, 0.13))
    np.testing.assert_allclose(ours.astype(np.float64), ref.astype(np.float64), rtol=rtol, atol=atol, equal_nan=True)


def wrap(exact, dtype) -> np.ndarray:
    """Exact Python integers reduced modulo 2^bits into `dtype` (two's complement)."""
    dtype = np.dtype(dtype)
    bits = 8 * dtype.itemsize
    def one(v):
        v = int(v) % (1 << bits)
        return v - (1 << bits) if dtype.kind == "i" and v >= 1 << (bits - 1) else v
    exact = np.asarray(exact, dtype=object)
    return np.array([one(v) for v in exact.reshape(-1)], dtype=dtype).reshape(exact.shape)


def W(t):
    """A torch tensor in the precision the spec computes it: narrow floats in f32."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def randn(shape, dtype, scale=3.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(dtype)


def randint(shape, dtype) -> np.ndarray:
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)


SHAPES = [(3, 5), (2, 1, 4), (0, 3), (1,), ()]


# --- elementwise unary -------------------------------------------------------------------

POSITIVE = {"log", "log2", "sqrt", "rsqrt"}
UNARY_FLOAT = {
    "neg": torch.neg, "abs": torch.abs, "sign": torch.sign, "exp": torch.exp, "exp2": torch.exp2,
    "log": torch.log, "log2": torch.log2, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
    "reciprocal": torch.reciprocal, "sin": torch.sin, "cos": torch.cos, "tanh": torch.tanh,
    "erf": torch.erf, "sigmoid": torch.sigmoid, "floor": torch.floor, "ceil": torch.ceil,
    "round": torch.round,
}


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("name", sorted(UNARY_FLOAT))
def test_unary_float(name, dtype):
    for shape in SHAPES:
        x = randn(shape, np.float64)
        if name in POSITIVE:
            x = np.abs(x) + 0.05
        if name == "reciprocal":
            x = np.sign(x + 1e-9) * (np.abs(x) + 0.1)
        x = x.astype(dtype)
        close(op1(name, x), UNARY_FLOAT[name](T(x)))


def test_unary_special_values():
    x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 0.5, 1.5, 2.5, -0.5, -2.5, 1e-310], np.float64)
    for name in ("neg", "abs", "exp", "exp2", "tanh", "erf", "sigmoid", "floor", "ceil", "round"):
        close(op1(name, x), UNARY_FLOAT[name](T(x)))
    np.testing.assert_array_equal(op1("round", x[5:10]), [0.0, 2.0, 2.0, -0.0, -2.0])  # half to even
    s = op1("sign", x)
    assert np.isnan(s[4]) and list(s[[0, 2, 3, 5, 8]]) == [0, 1, -1, 1, -1]  # NaN stays NaN (torch: 0)


@pytest.mark.parametrize("dtype", INTS, ids=str)
@pytest.mark.parametrize("name", ["neg", "abs", "sign"])
def test_unary_int(name, dtype):
    x = randint((4, 7), dtype)
    x.flat[0] = np.iinfo(dtype).min
    if dtype.kind == "u":  # torch has no neg / sign on every unsigned type: the rule in numpy
        expected = {"neg": lambda v: (0 - v.astype(np.int64)).astype(dtype), "abs": lambda v: v,
                    "sign": lambda v: (v > 0).astype(dtype)}[name](x)
        close(op1(name, x), expected)
    else:
        close(op1(name, x), UNARY_FLOAT[name](T(x)))
    if dtype.kind == "i":
        assert op1("abs", np.array([np.iinfo(dtype).min], dtype))[0] == np.iinfo(dtype).min  # wraps


def test_unary_f8():
    # f8 is computed in f32 and rounded once.
    for dt in (F8E4M3, F8E5M2):
        x = randn((5, 6), np.float32, 1.0).astype(dt)
        fns = {"exp": np.exp, "tanh": np.tanh, "neg": np.negative, "sigmoid": lambda v: 1 / (1 + np.exp(-v))}
        for name, fn in fns.items():
            want = fn(x.astype(np.float32)).astype(dt).astype(np.float32)
            np.testing.assert_array_equal(op1(name, x).astype(np.float32), want)


def test_logical_not():
    x = rng.integers(0, 2, (3, 4)).astype(bool)
    close(op1("logical_not", x), torch.logical_not(T(x)))


# --- elementwise binary ------------------------------------------------------------------

BINARY_FLOAT = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "pow": torch.pow,
                "max": torch.maximum, "min": torch.minimum, "mod": torch.fmod}
BROADCAST_PAIRS = [((3, 5), (3, 5)), ((3, 1, 4), (2, 4)), ((0, 3), (1, 3)), ((), (2,)), ((1,), (5, 1)), ((2, 0), ())]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("name", sorted(BINARY_FLOAT))
def test_binary_float(name, dtype):
    for sx, sy in BROADCAST_PAIRS:
        x, y = randn(sx, np.float64), randn(sy, np.float64)
        if name == "pow":
            x = np.abs(x) + 0.1
            y = y / 2
        x, y = x.astype(dtype), y.astype(dtype)
        close(op1(name, x, y), BINARY_FLOAT[name](T(x), T(y)))


def test_binary_float_special_values():
    v = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan])
    x, y = np.meshgrid(v, v)
    for name in sorted(BINARY_FLOAT):
        close(op1(name, x, y), BINARY_FLOAT[name](T(x), T(y)))


@pytest.mark.parametrize("dtype", INTS, ids=str)
@pytest.mark.parametrize("name", ["add", "sub", "mul", "div", "max", "min", "mod"])
def test_binary_int(name, dtype):
    x, y = randint((6, 5), dtype), randint((5,), dtype)
    if name in ("div", "mod"):
        y[y == 0] = 3
        if dtype.kind == "i":
            y[0] = -1  # keep MIN / -1 out of torch's way; tested below
            x[:, 0][x[:, 0] == np.iinfo(dtype).min] += 1
        fn = (lambda a, b: torch.div(a, b, rounding_mode="trunc")) if name == "div" else torch.fmod
    else:
        fn = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "max": torch.maximum, "min": torch.minimum}[name]
    close(op1(name, x, y), fn(T(x), T(y)))


@pytest.mark.parametrize("dtype", ALL_INTS, ids=str)
def test_int_division_rules(dtype):
    info = np.iinfo(dtype)
    x = np.array([7, 7, 0, info.max, info.min, 5], dtype)
    y = np.array([2, 0, 0, 0, 3, 1], dtype)
    # truncation toward zero, x / 0 = 0 and x mod 0 = 0, never raising
    q = [(abs(a) // abs(b)) * (-1 if (a < 0) != (b < 0) else 1) if b else 0 for a, b in zip(x.tolist(), y.tolist())]
    r = [a - b * qq if b else 0 for a, b, qq in zip(x.tolist(), y.tolist(), q)]
    np.testing.assert_array_equal(op1("div", x, y), wrap(q, dtype))
    np.testing.assert_array_equal(op1("mod", x, y), wrap(r, dtype))
    if dtype.kind == "i":
        x = np.array([-7, 7, -7, info.min, info.min], dtype)
        y = np.array([2, -2, -2, -1, 1], dtype)
        # MIN / -1 wraps to MIN
        np.testing.assert_array_equal(op1("div", x, y), np.array([-3, -3, 3, info.min, info.min], dtype))
        np.testing.assert_array_equal(op1("mod", x, y), np.array([-1, 1, -1, 0, 0], dtype))  # sign of x


@pytest.mark.parametrize("dtype", ALL_INTS, ids=str)
def test_int_arithmetic_wraps(dtype):
    info = np.iinfo(dtype)
    x = np.array([info.max, info.min, info.max], dtype)
    y = np.array([1, 1, 2], dtype)
    np.testing.assert_array_equal(op1("add", x, y), (x.astype(object) + y.astype(object)) % (1 << info.bits) + 0
                                  if dtype.kind == "u" else np.array([info.min, info.min + 1, info.min + 1], dtype))
    np.testing.assert_array_equal(op1("mul", x, y), (x.astype(np.uint64) * y.astype(np.uint64)).astype(dtype))


@pytest.mark.parametrize("name", ["logical_and", "logical_or", "logical_xor"])
def test_logical_binary(name):
    x, y = rng.integers(0, 2, (3, 1, 4)).astype(bool), rng.integers(0, 2, (2, 4)).astype(bool)
    close(op1(name, x, y), getattr(torch, name)(T(x), T(y)))


COMPARE = {"eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge}


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
@pytest.mark.parametrize("name", sorted(COMPARE))
def test_compare(name, dtype):
    if dtype.kind in "iu":
        x, y = rng.integers(0, 3, (4, 1, 3)).astype(dtype), rng.integers(0, 3, (5, 3)).astype(dtype)
    else:
        x = np.round(randn((4, 1, 3), np.float64)).astype(dtype)
        y = np.round(randn((5, 3), np.float64)).astype(dtype)
        x.flat[0] = np.nan
    close(op1(name, x, y), COMPARE[name](T(x), T(y)), dtype=np.bool_)


def test_compare_bool():
    x, y = np.array([True, False, True]), np.array([True, True, False])
    np.testing.assert_array_equal(op1("eq", x, y), x == y)
    np.testing.assert_array_equal(op1("ne", x, y), x != y)


@pytest.mark.parametrize("dtype", FLOATS + [np.dtype(np.int32), np.dtype(np.bool_)], ids=str)
def test_where(dtype):
    c = rng.integers(0, 2, (3, 1, 4)).astype(bool)
    x = randn((2, 4), np.float64).astype(dtype)
    y = randn((3, 2, 1), np.float64).astype(dtype)
    close(op1("where", c, x, y), torch.where(T(c), T(x), T(y)))


# --- reductions ----------------------------------------------------------------------------

AXES = [(), (0,), (1,), (0, 2), (0, 1, 2)]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("name", ["reduce_sum", "reduce_max", "reduce_min"])
def test_reduce_float(name, dtype):
    fn = {"reduce_sum": torch.sum, "reduce_max": torch.amax, "reduce_min": torch.amin}[name]
    x = randn((3, 4, 5), np.float32, 1.0).astype(dtype)
    for axes in AXES:
        for keepdims in (False, True):
            ours = op1(name, x, axes=list(axes), keepdims=keepdims)
            if not axes:  # torch reads dim=() as "every dim"; the spec: reduce nothing
                close(ours, x)
                continue
            ref = fn(W(T(x)), dim=axes, keepdim=keepdims).to(T(x).dtype)  # f32 accumulation, rounded
            tol = (4e-6, 4e-6) if dtype == np.float32 else None
            close(ours, ref, tol=tol)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_reduce_prod_float(dtype):
    x = (rng.uniform(0.5, 1.5, (3, 4, 5))).astype(dtype)
    for axes in AXES:
        ref = np.prod(x.astype(np.float64), axis=axes, keepdims=True).astype(dtype)
        close(op1("reduce_prod", x, axes=list(axes), keepdims=True), ref)


def test_reduce_nan_and_empty():
    x = np.array([[1.0, np.nan, 3.0], [4.0, 5.0, 6.0]])
    for name in ("reduce_max", "reduce_min", "reduce_sum", "reduce_prod"):
        r = op1(name, x, axes=[1])
        assert np.isnan(r[0]) and not np.isnan(r[1])
    e = np.zeros((2, 0, 3), np.float32)
    np.testing.assert_array_equal(op1("reduce_sum", e, axes=[1]), np.zeros((2, 3)))
    np.testing.assert_array_equal(op1("reduce_prod", e, axes=[1]), np.ones((2, 3)))
    np.testing.assert_array_equal(op1("reduce_max", e, axes=[1]), np.full((2, 3), -np.inf))
    np.testing.assert_array_equal(op1("reduce_min", e, axes=[1]), np.full((2, 3), np.inf))
    ei = np.zeros((0, 2), np.int8)
    np.testing.assert_array_equal(op1("reduce_max", ei, axes=[0]), [-128, -128])
    np.testing.assert_array_equal(op1("reduce_min", ei, axes=[0]), [127, 127])


@pytest.mark.parametrize("dtype", INTS, ids=str)
@pytest.mark.parametrize("name", ["reduce_sum", "reduce_prod", "reduce_max", "reduce_min"])
def test_reduce_int(name, dtype):
    x = randint((3, 4, 5), dtype)
    for axes in AXES:
        ours = op1(name, x, axes=list(axes), keepdims=False)
        if name in ("reduce_sum", "reduce_prod"):  # wraps in the operand's dtype
            fn = np.sum if name == "reduce_sum" else np.prod
            ref = wrap(fn(x.astype(object), axis=axes) if axes else x.astype(object), dtype)
        else:
            ref = (np.max if name == "reduce_max" else np.min)(x, axis=axes) if axes else x
        close(ours, np.asarray(ref))


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
@pytest.mark.parametrize("name", ["argmax", "argmin"])
def test_arg_reductions(name, dtype):
    x = rng.integers(0, 3, (4, 5, 6)).astype(dtype)  # many ties: the first index wins
    fn = getattr(torch, name)
    for axis in range(3):
        for keepdims in (False, True):
            close(op1(name, x, axis=axis, keepdims=keepdims), fn(T(x).float(), dim=axis, keepdim=keepdims))
    if dtype.kind == "f":
        y = np.array([[1.0, np.nan, 7.0, np.nan]], dtype)
        assert op1(name, y, axis=1)[0] == 1  # the first NaN
    assert op1(name, np.zeros((2, 0), dtype), axis=1).tolist() == [0, 0]


# --- movement ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16, np.dtype(np.int64), np.dtype(np.bool_)], ids=str)
def test_reshape_permute_broadcast_flip(dtype):
    x = randn((2, 3, 4), np.float64).astype(dtype)
    close(op1("reshape", x, shape=[4, 6]), T(x).reshape(4, 6))
    close(op1("reshape", x, shape=[24, 1, 1]), T(x).reshape(24, 1, 1))
    close(op1("reshape", np.zeros((0, 3), dtype), shape=[3, 0, 5]), np.zeros((3, 0, 5), dtype))
    close(op1("permute", x, perm=[2, 0, 1]), T(x).permute(2, 0, 1))
    close(op1("broadcast_to", x[:, :1], shape=[5, 2, 3, 4]), torch.broadcast_to(T(x[:, :1]), (5, 2, 3, 4)))
    close(op1("broadcast_to", x[:1], shape=[0, 3, 4]), np.zeros((0, 3, 4), dtype))
    for axes in ([], [0], [1, 2], [0, 1, 2]):
        close(op1("flip", x, axes=axes), torch.flip(T(x), axes))


def test_slice():
    x = randn((5, 6, 7), np.float32)
    for start, stop, step in [([0, 0, 0], [5, 6, 7], [1, 1, 1]), ([1, 2, 0], [4, 6, 7], [2, 3, 4]),
                              ([2, 3, 7], [2, 6, 7], [1, 2, 1]), ([4, 0, 1], [5, 1, 7], [5, 1, 6])]:
        ref = T(x)[tuple(slice(a, b, s) for a, b, s in zip(start, stop, step))]
        close(op1("slice", x, start=start, stop=stop, step=step), ref)


@pytest.mark.parametrize("dtype", [np.dtype(t) for t in (np.float16, BF16, np.float32, np.int8, np.bool_)], ids=str)
def test_pad(dtype):
    x = randn((2, 3), np.float64).astype(dtype)
    value = True if dtype == np.bool_ else (7 if dtype.kind == "i" else 1.5)
    ref = torch.nn.functional.pad(T(x), (0, 2, 1, 3), value=value)
    close(op1("pad", x, low=[1, 0], high=[3, 2], value=value), ref)
    close(op1("pad", np.zeros((0, 2), dtype), low=[1, 0], high=[0, 0], value=value),
          np.full((1, 2), value, dtype))


def test_concat():
    xs = [randn((2, n, 3), np.float32) for n in (1, 0, 4)]
    b = Builder()
    f = b.func("f")
    ps = [f.param(ttype(a)) for a in xs]
    f.ret(f.concat(*ps, axis=1))
    close(run(b.build(), "f", xs)[0], torch.cat([T(a) for a in xs], dim=1))
    close(op1("concat", xs[0], axis=2), xs[0])


@pytest.mark.parametrize("idx_dtype", [np.int32, np.int64, np.uint8, np.uint64], ids=lambda d: np.dtype(d).name)
def test_gather(idx_dtype):
    x = randn((4, 5, 3), np.float32)
    for axis in range(3):
        n = x.shape[axis]
        for ishape in [(6,), (2, 3), (), (0,)]:
            idx = rng.integers(0, n, ishape).astype(idx_dtype)
            ref = torch.index_select(T(x), axis, T(idx.reshape(-1).astype(np.int64)))
            ref = ref.reshape(x.shape[:axis] + ishape + x.shape[axis + 1:])
            close(op1("gather", x, idx, axis=axis), ref)
    # out-of-range indices clamp into [0, n - 1]; negatives do not wrap
    idx = np.array([-1, -100, 0, 4, 5, 1000], np.int64) if np.dtype(idx_dtype).kind == "i" else \
        np.array([0, 4, 5, np.iinfo(idx_dtype).max], idx_dtype)
    clamped = np.clip(idx.astype(np.float64), 0, 4).astype(np.int64)
    close(op1("gather", x, idx.astype(idx.dtype), axis=1), np.take(x, clamped, axis=1))
    assert op1("gather", np.zeros((0, 2), np.float32), np.array([0, 3]), axis=0).tolist() == [[0, 0], [0, 0]]


@pytest.mark.parametrize("dtype", [np.dtype(t) for t in (np.float16, BF16, np.float32, np.float64, np.int32)], ids=str)
def test_scatter_add(dtype):
    x = randn((4, 5, 3), np.float64).astype(dtype)
    for axis in range(3):
        n = x.shape[axis]
        for ishape in [(7,), (2, 3), ()]:
            idx = rng.integers(0, n, ishape).astype(np.int64)  # repeats accumulate
            upd = randn(x.shape[:axis] + ishape + x.shape[axis + 1:], np.float64).astype(dtype)
            flat = upd.reshape(x.shape[:axis] + (idx.size,) + x.shape[axis + 1:])
            wide = torch.float32 if dtype in (np.float16, BF16) else T(x).dtype
            ref = torch.index_add(T(x).to(wide), axis, T(idx.reshape(-1)), T(flat).to(wide)).to(T(x).dtype)
            close(op1("scatter_add", x, idx, upd, axis=axis), ref)
    idx = np.array([-5, 99])  # clamped like gather
    upd = np.ones((4, 2, 3), dtype)
    expected = x.copy()
    expected[:, 0] += 1
    expected[:, 4] += 1
    close(op1("scatter_add", x, idx, upd, axis=1), expected)


def test_dynamic_slice_and_update():
    x = randn((6, 4), np.float32)
    for start in [-3, 0, 2, 4, 5, 100]:
        s = min(max(start, 0), 6 - 3)  # clamped into [0, dim - size]
        for sdt in (np.int32, np.int64, np.uint32):
            if start < 0 and sdt is np.uint32:
                continue
            st = np.array(start, sdt)
            close(op1("dynamic_slice", x, st, axis=0, size=3), torch.narrow(T(x), 0, s, 3))
            u = randn((3, 4), np.float32)
            ref = T(x).clone()
            ref[s:s + 3] = T(u)
            close(op1("dynamic_update_slice", x, u, st, axis=0), ref)
    close(op1("dynamic_slice", x, np.array(2, np.int64), axis=1, size=0), np.zeros((6, 0), np.float32))
    u = randn((6, 4), np.float32)
    close(op1("dynamic_update_slice", x, u, np.array(3, np.int64), axis=1), u)


# --- linear algebra ------------------------------------------------------------------------

MATMUL_SHAPES = [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((2, 1, 3, 4), (5, 4, 2)), ((0, 4), (4, 3)),
                 ((3, 0), (0, 2)), ((1, 1), (1, 1)), ((4, 1, 2, 3), (1, 3, 3, 2))]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_matmul_float(dtype):
    for sa, sb in MATMUL_SHAPES:
        a, b = randn(sa, np.float32, 1.0).astype(dtype), randn(sb, np.float32, 1.0).astype(dtype)
        tol = {np.float32: (1e-5, 1e-5)}.get(dtype.type)
        close(op1("matmul", a, b), torch.matmul(T(a), T(b)), tol=tol)


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint8], ids=lambda d: np.dtype(d).name)
def test_matmul_int_wraps(dtype):
    a, b = randint((2, 3, 40), np.dtype(dtype)), randint((40, 4), np.dtype(dtype))
    close(op1("matmul", a, b), wrap(a.astype(object) @ b.astype(object), dtype))


# --- creation ------------------------------------------------------------------------------

def test_constant_full_iota():
    for arr in [np.arange(6, dtype=np.float32).reshape(2, 3), np.array(True), np.array([-1, 2], np.int8),
                np.array([1.5, -2.0], BF16), np.zeros((0, 2), np.float64)]:
        lit = Literal.from_numpy(arr)
        out = op1("constant", type=ttype(arr), value=lit)
        assert out.dtype == arr.dtype
        np.testing.assert_array_equal(out, arr)
    close(op1("full", type="bf16[2, 3]", value=0.1), np.full((2, 3), 0.1, BF16))
    close(op1("full", type="i8[4]", value=-7), np.full(4, -7, np.int8))
    close(op1("full", type="bool[2]", value=True), np.ones(2, bool))
    close(op1("full", type="f32[0, 2]", value=1.0), np.ones((0, 2), np.float32))
    close(op1("iota", type="i64[3, 4]", dim=1), np.broadcast_to(np.arange(4), (3, 4)))
    close(op1("iota", type="f32[3, 4]", dim=0), torch.arange(3, dtype=torch.float32)[:, None].expand(3, 4))
    close(op1("iota", type="u8[300]", dim=0), np.arange(300).astype(np.uint8))  # wraps like a cast


# --- composites ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_softmax_log_softmax(dtype):
    x = randn((3, 4, 5), np.float32).astype(dtype)
    for axis in range(3):
        close(op1("softmax", x, axis=axis), torch.softmax(W(T(x)), dim=axis).to(T(x).dtype))
        close(op1("log_softmax", x, axis=axis), torch.log_softmax(W(T(x)), dim=axis).to(T(x).dtype))
    big = np.array([[1000.0, 0.0, -1000.0], [-np.inf, 0.0, 1.0]], dtype)  # subtracting the max: no overflow
    close(op1("softmax", big, axis=1), torch.softmax(W(T(big)), dim=1).to(T(big).dtype))
    close(op1("softmax", np.zeros((2, 0), dtype), axis=1), np.zeros((2, 0), dtype))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_layer_norm(dtype):
    x = (randn((2, 3, 16), np.float32) + 5).astype(dtype)
    w, b = randn((16,), np.float32, 1.0).astype(dtype), randn((16,), np.float32, 1.0).astype(dtype)
    F = torch.nn.functional
    close(op1("layer_norm", x, w, b, eps=1e-5), F.layer_norm(W(T(x)), (16,), W(T(w)), W(T(b)), 1e-5).to(T(x).dtype))
    close(op1("layer_norm", x, eps=0.1), F.layer_norm(W(T(x)), (16,), eps=0.1).to(T(x).dtype))
    close(op1("layer_norm", x[:, :, :1]), F.layer_norm(W(T(x[:, :, :1])), (1,)).to(T(x).dtype))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_gelu_silu(dtype):
    x = randn((4, 33), np.float32).astype(dtype)
    F = torch.nn.functional
    for approximate in ("none", "tanh"):
        close(op1("gelu", x, approximate=approximate), F.gelu(W(T(x)), approximate=approximate).to(T(x).dtype))
    close(op1("silu", x), F.silu(W(T(x))).to(T(x).dtype))


SDPA_SHAPES = [((2, 3, 5, 8), (2, 3, 5, 8), (2, 3, 5, 4)), ((1, 4, 8), (1, 6, 8), (1, 6, 8)),
               ((2, 6, 4), (2, 3, 4), (2, 3, 5)), ((1, 1, 8), (1, 1, 8), (1, 1, 8))]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_scaled_dot_product_attention(dtype):
    F = torch.nn.functional
    for sq, sk, sv in SDPA_SHAPES:
        q, k, v = (randn(s, np.float32, 1.0).astype(dtype) for s in (sq, sk, sv))
        for causal in (False, True):
            for scale in (None, 0.3):
                ref = F.scaled_dot_product_attention(W(T(q)), W(T(k)), W(T(v)),
                                                     is_causal=causal, scale=scale).to(T(q).dtype)
                tol = (1e-5, 1e-5) if dtype == np.float32 else (1e-11, 1e-11) if dtype == np.float64 else None
                close(op1("scaled_dot_product_attention", q, k, v, causal=causal, scale=scale), ref, tol=tol)
    # the causal mask is top-left aligned: query i sees keys 0..i, even when L != S
    q, k = np.zeros((1, 2, 4), dtype), np.zeros((1, 4, 4), dtype)
    v = np.arange(4, dtype=np.float32).reshape(1, 4, 1).astype(dtype)
    close(op1("scaled_dot_product_attention", q, k, v, causal=True), np.array([[[0.0], [0.5]]], dtype))


# --- cast and bitcast ----------------------------------------------------------------------

FLOAT_SPECIALS = np.array([-3.7, -0.5, -0.0, 0.5, 2.9, 126.6, 127.5, 300.0, -300.0, 1e10, -1e10,
                           3e19, np.nan, np.inf, -np.inf])


@pytest.mark.parametrize("src", FLOATS + [F8E4M3, F8E5M2], ids=str)
@pytest.mark.parametrize("dst", ALL_INTS, ids=str)
def test_cast_float_to_int_truncates_and_saturates(src, dst):
    with np.errstate(over="ignore"):
        x = FLOAT_SPECIALS.astype(src)
    v = x.astype(np.float64)
    info = np.iinfo(dst)
    expected = [0 if math.isnan(a) else info.max if a >= info.max else info.min if a <= info.min else int(a)
                for a in v.tolist()]
    np.testing.assert_array_equal(op1("cast", x, to=from_numpy(dst)), np.array(expected, dtype=object).astype(dst))


@pytest.mark.parametrize("src", FLOATS, ids=str)
@pytest.mark.parametrize("dst", FLOATS, ids=str)
def test_cast_float_to_float(src, dst):
    with np.errstate(over="ignore"):
        x = np.concatenate([randn((50,), np.float64, 100.0), FLOAT_SPECIALS, [1e-40, 65520.0, 1 + 2**-9]]).astype(src)
    close(op1("cast", x, to=from_numpy(dst)), T(x).to(T(np.zeros(0, dst)).dtype), tol=(0, 0))


@pytest.mark.parametrize("src", INTS + [np.dtype(np.bool_)], ids=str)
@pytest.mark.parametrize("dst", INTS + FLOATS + [np.dtype(np.bool_)], ids=str)
def test_cast_int_and_bool(src, dst):
    x = randint((40,), src) if src != np.bool_ else rng.integers(0, 2, 40).astype(bool)
    ref = T(x).to(T(np.zeros(0, dst)).dtype)  # int -> int wraps, -> float rounds, -> bool is x != 0
    close(op1("cast", x, to=from_numpy(dst)), ref, tol=(0, 0))


def test_cast_to_bool_and_f8():
    x = np.array([0.0, -0.0, 1e-30, np.nan, -np.inf, 2.0])
    np.testing.assert_array_equal(op1("cast", x, to="bool"), [False, False, True, True, True, True])
    y = randn((30,), np.float32, 10.0)
    for dt in (F8E4M3, F8E5M2):
        got = op1("cast", y, to=from_numpy(dt))
        np.testing.assert_array_equal(got.astype(np.float32), y.astype(dt).astype(np.float32))


def test_bitcast():
    x = randn((3, 4), np.float32)
    close(op1("bitcast", x, to="i32"), T(x).view(torch.int32))
    close(op1("bitcast", op1("bitcast", x, to="u32"), to="f32"), x)
    h = randn((5,), np.float32).astype(BF16)
    close(op1("bitcast", h, to="i16"), T(h).view(torch.int16))
    close(op1("bitcast", np.array(-1, np.int8), to="u8"), np.array(255, np.uint8))
    close(op1("bitcast", np.array([0, 1, 2], np.uint8), to="bool"), np.array([False, True, True]))
    close(op1("bitcast", np.array([-1.5], np.float64), to="u64"), np.array([-1.5]).view(np.uint64))
