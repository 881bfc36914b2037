"""Every registry op on the `cpu` backend agrees with `ref`, the oracle: one-op modules with
random inputs (f32, f64, integers, bool, special float values), broadcasting, size-0 and
size-1 dims. Ops the compiler does not lower run as fallback kernels, so they agree too;
the walk over the registry fails when an op has no case here."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from dtm.errors import ErrorCode
from dtm.ir import REGISTRY, Builder, TensorType, parse
from dtm.ir.dtypes import from_numpy
from dtm.ir.types import Literal
from dtm.ref import run as ref_run
from cuda_emulation import run_cuda_emulated
from dtm.runtime.backend import get_backend

CPU = get_backend("cpu")
rng = np.random.default_rng(7)
F32, F64 = np.dtype(np.float32), np.dtype(np.float64)
INTS = [np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)]
SPECIAL = np.array([0.0, -0.0, 1.0, -1.0, 0.5, -2.5, 3.5, np.inf, -np.inf, np.nan, 1e-40, 3e38, -1e30, 7.0],
                   np.float64)


def ttype(a: np.ndarray) -> TensorType:
    return TensorType(from_numpy(a.dtype), tuple(a.shape))


def one_op(name: str, *arrays: np.ndarray, type=None, **attrs):
    """A module @f running op `name` on one parameter per array."""
    batch = Batch()
    batch.add(name, *arrays, type=type, **attrs)
    return batch.module()


class Batch:
    """Many one-op cases in one module (one plan, so its kernels compile a few per compiler
    call): `add` a case, then `check()` runs the module on both backends."""

    def __init__(self):
        self.b = Builder()
        self.f = self.b.func("f")
        self.inputs: list = []
        self.outs: list = []
        self.tols: list = []

    def add(self, name: str, *arrays: np.ndarray, type=None, rtol=None, atol=None, **attrs) -> None:
        params = [self.f.param(ttype(a)) for a in arrays]
        self.inputs += list(arrays)
        r = self.f.op(name, *params, type=type, **attrs)
        rs = r if isinstance(r, tuple) else ((r,) if r is not None else ())
        self.outs += list(rs)
        self.tols += [(rtol, atol, f"{name} {attrs} on {[ttype(a) for a in arrays]}")] * len(rs)

    def module(self):
        self.f.ret(*self.outs)
        return self.b.build()

    def check(self):
        return check(self.module(), self.inputs, tols=self.tols)


def check(module, inputs, rtol=None, atol=None, func="f", tols=None):
    """Run module on ref, cpu and the cuda backend's kernels (compiled to PTX by NVRTC without
    a warning, then run on the CPU by its emulator: tests/cuda_emulation.py) on fresh copies
    of the inputs, and compare results and inputs afterwards (assign writes into them)."""
    ins_ref = [np.array(x, copy=True) for x in inputs]
    want = ref_run(module, func, ins_ref)
    tols = (tols or [(rtol, atol, f"result {i}") for i in range(len(want))]) + \
        [(None, None, f"input {i} afterwards") for i in range(len(inputs))]
    results = {}
    for backend, run in (("cpu", lambda ins: CPU.run(module, func, ins)),
                         ("cuda", lambda ins: run_cuda_emulated(module, func, ins))):
        ins = [np.array(x, copy=True) for x in inputs]
        got = results[backend] = run(ins)
        assert len(want) == len(got)
        for w, g, (rt, at, what) in zip(list(want) + ins_ref, list(got) + ins, tols):
            what = f"{backend}: {what}"
            assert g.dtype == w.dtype and g.shape == w.shape, (what, g.dtype, g.shape, w.dtype, w.shape)
            if w.dtype in (F32, F64):
                tol = {F32: (2e-6, 1e-6), F64: (1e-13, 1e-14)}[w.dtype]
                np.testing.assert_allclose(g, w, rtol=rt or tol[0], atol=at or tol[1], equal_nan=True, err_msg=what)
            elif (w.dtype.kind == "V" or w.dtype == np.float16) and rt is not None:  # a case's own tolerance
                np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32), rtol=rt, atol=at or 0,
                                           equal_nan=True, err_msg=what)
            elif w.dtype.kind == "V" or w.dtype == np.float16:
                np.testing.assert_array_equal(g.astype(np.float32), w.astype(np.float32), err_msg=what)
            else:
                np.testing.assert_array_equal(g, w, err_msg=what)
    return results["cpu"]


def randn(shape, dtype=F32, scale=3.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def randint(shape, dtype):
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)


def special(dtype=F32, n=None):
    x = SPECIAL.astype(dtype)
    return x if n is None else np.resize(x, n)


COVERED: set[str] = set()


def covers(*names):
    def deco(fn):
        COVERED.update(names)
        return fn
    return deco


# --- elementwise ---------------------------------------------------------------------------

UNARY_FLOAT = ["neg", "abs", "sign", "exp", "exp2", "log", "log2", "sqrt", "rsqrt", "reciprocal", "sin", "cos",
               "tanh", "erf", "sigmoid", "floor", "ceil", "round"]


@covers(*UNARY_FLOAT)
@pytest.mark.parametrize("dtype", [F32, F64], ids=str)
def test_unary_float(dtype):
    rtol, atol = (4e-7 * 8, 1e-30) if dtype == F32 else (1e-15 * 8, 1e-300)
    bt = Batch()
    for name in UNARY_FLOAT:
        for x in (randn((3, 5), dtype), special(dtype), randn((0, 3), dtype), randn((), dtype)):
            bt.add(name, x, rtol=rtol, atol=atol)
    bt.check()


@covers("neg", "abs", "sign")
def test_unary_int():
    bt = Batch()
    for dtype in INTS:
        info = np.iinfo(dtype)
        x = np.concatenate([randint((20,), dtype), np.array([info.min, info.max, 0, 1], dtype)])
        for name in ("neg", "abs", "sign"):
            bt.add(name, x)
    bt.check()


@covers("logical_not")
def test_logical_not():
    x = rng.random((4, 5)) < 0.5
    check(one_op("logical_not", x), [x])


CASTABLE = [np.dtype(t) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                                  np.uint64, np.float32, np.float64)]


@covers("cast")
def test_cast():
    bt = Batch()
    for src in CASTABLE:
        if src.kind == "f":
            x = np.concatenate([special(src), randn((10,), src, 1e3),
                                np.array([2.0**31, -2.0**31 - 1, 2.0**63, 1e19, -1e19, 255.5, -128.9, 65535.9], src)])
        elif src == np.bool_:
            x = rng.random(9) < 0.5
        else:
            x = randint((20,), src)
        for dst in CASTABLE + [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]:
            bt.add("cast", x, to=from_numpy(dst))
    bt.check()


@covers("bitcast")
def test_bitcast():
    bt = Batch()
    for src, dst in [(F32, np.int32), (F32, np.uint32), (np.int32, F32), (F64, np.int64), (np.uint64, F64),
                     (np.int8, np.uint8), (np.uint16, np.int16)]:
        x = special(src) if np.dtype(src).kind == "f" else randint((12,), np.dtype(src))
        bt.add("bitcast", x, to=from_numpy(np.dtype(dst)))
    bt.check()


BINARY = ["add", "sub", "mul", "div", "max", "min", "mod"]
SHAPES2 = [((3, 5), (3, 5)), ((2, 1, 4), (3, 1)), ((4,), ()), ((0, 3), (1, 3)), ((), ())]


@covers(*BINARY, "pow")
@pytest.mark.parametrize("dtype", [F32, F64], ids=str)
def test_binary_float(dtype):
    rtol, atol = (1e-6, 1e-30) if dtype == F32 else (1e-14, 1e-300)
    bt = Batch()
    for name in BINARY + ["pow"]:
        for sa, sb in SHAPES2:
            bt.add(name, randn(sa, dtype), randn(sb, dtype), rtol=rtol, atol=atol)
        bt.add(name, special(dtype), special(dtype)[::-1].copy(), rtol=rtol, atol=atol)
    bt.check()


@covers(*BINARY)
def test_binary_int():
    bt = Batch()
    for dtype in INTS:
        info = np.iinfo(dtype)
        x = np.concatenate([randint((30,), dtype), np.array([info.min, info.min, info.max, 7,
                                                            -7 if info.min else 7, 0], dtype)])
        y = np.concatenate([randint((30,), dtype), np.array([-1 if info.min else 1, 0, 2, 0, 2, 3], dtype)])
        y[::5] = 0
        for name in BINARY:
            bt.add(name, x, y)
            bt.add(name, randint((2, 1, 4), dtype), randint((3, 1), dtype))
    bt.check()


@covers("logical_and", "logical_or", "logical_xor")
def test_logical_binary():
    bt = Batch()
    for name in ("logical_and", "logical_or", "logical_xor"):
        bt.add(name, rng.random((3, 4)) < 0.5, rng.random((4,)) < 0.5)
    bt.check()


COMPARE = ["eq", "ne", "lt", "le", "gt", "ge"]


@covers(*COMPARE)
def test_compare():
    bt = Batch()
    for dtype in [F32, F64, np.dtype(np.int8), np.dtype(np.uint32), np.dtype(np.int64)]:
        if dtype.kind == "f":
            x, y = special(dtype), special(dtype)[::-1].copy()
        else:
            x, y = randint((20,), dtype), randint((20,), dtype)
            y[::3] = x[::3]
        for name in COMPARE:
            bt.add(name, x, y)
    for name in ("eq", "ne"):
        bt.add(name, rng.random(6) < 0.5, rng.random(6) < 0.5)
    bt.check()


@covers("where")
def test_where():
    bt = Batch()
    for dtype in [F32, F64, np.dtype(np.int16), np.dtype(np.bool_)]:
        c = rng.random((3, 1, 4)) < 0.5
        x = randn((2, 4), dtype) if dtype.kind == "f" else (rng.random((2, 4)) < 0.5).astype(dtype)
        y = randn((4,), dtype) if dtype.kind == "f" else (rng.random((4,)) < 0.5).astype(dtype)
        bt.add("where", c, x, y)
    bt.check()


# --- reductions ----------------------------------------------------------------------------

REDUCE = ["reduce_sum", "reduce_prod", "reduce_max", "reduce_min"]


@covers(*REDUCE)
@pytest.mark.parametrize("dtype", [F32, F64, np.dtype(np.int32), np.dtype(np.uint8), np.dtype(np.int64)], ids=str)
def test_reduce(dtype):
    bt = Batch()
    rtol = 1e-5 if dtype == F32 else None
    for name in REDUCE:
        scale = 1.0 if name == "reduce_prod" else 3.0
        x = randn((3, 4, 5), dtype, scale) if dtype.kind == "f" else randint((3, 4, 5), dtype)
        for axes in ([2], [0], [1], [0, 2], [0, 1, 2], []):
            for keep in (False, True):
                bt.add(name, x, axes=axes, keepdims=keep, rtol=rtol)
        e = randn((2, 0, 3), dtype) if dtype.kind == "f" else randint((2, 0, 3), dtype)
        bt.add(name, e, axes=[1])
        none = randn((3, 0), dtype) if dtype.kind == "f" else randint((3, 0), dtype)
        bt.add(name, none, axes=[0])  # down no columns (a block of 0 columns divided by 0 once)
        if dtype.kind == "f":
            bt.add(name, special(dtype).reshape(2, 7), axes=[1], keepdims=True, rtol=rtol)
    bt.check()


@covers("argmax", "argmin")
def test_arg_reduce():
    bt = Batch()
    for dtype in [F32, F64, np.dtype(np.int8), np.dtype(np.uint16)]:
        for name in ("argmax", "argmin"):
            x = randn((4, 6), dtype) if dtype.kind == "f" else randint((4, 6), dtype)
            x[1, 2] = x[1, 4] = x[1].max() if name == "argmax" else x[1].min()  # ties: the first wins
            if dtype.kind == "f":
                x[2, 3] = x[2, 5] = np.nan
                x[3] = -np.inf if name == "argmax" else np.inf
            for axis in (0, 1):
                for keep in (False, True):
                    bt.add(name, x, axis=axis, keepdims=keep)
            bt.add(name, randn((0, 3), dtype) if dtype.kind == "f" else randint((0, 3), dtype), axis=0)
            # rows long enough to be read in vectors: ties and NaNs in different lanes and blocks
            w = randn((4, 1003), dtype) if dtype.kind == "f" else randint((4, 1003), dtype)
            w[0, 997] = w[0, 13] = w[0].max() if name == "argmax" else w[0].min()
            if dtype.kind == "f":
                w[1, 700] = w[1, 41] = np.nan
                w[2, 500:] = np.inf if name == "argmax" else -np.inf
            bt.add(name, w, axis=1)
    bt.check()


@covers("argsort")
def test_argsort():
    bt = Batch()
    for dtype in [F32, F64, np.dtype(np.int8), np.dtype(np.uint16)]:
        x = randn((4, 6), dtype) if dtype.kind == "f" else randint((4, 6), dtype)
        x[1, 2] = x[1, 4] = x[1, 0]  # ties keep their order
        if dtype.kind == "f":
            x[2, 3] = x[2, 5] = np.nan
            x[3, 1] = -np.inf
        for axis in (0, 1):
            for desc in (False, True):
                bt.add("argsort", x, axis=axis, descending=desc)
        bt.add("argsort", randn((0, 3), dtype) if dtype.kind == "f" else randint((0, 3), dtype), axis=0)
    bt.check()


@covers("cumsum")
def test_cumsum():
    """Along the last dim (one running sum per row) and down the others (blocks of columns),
    over axes of size 0 and 1, long enough for several column blocks; integers wrap."""
    bt = Batch()
    for dtype in [F32, F64, np.dtype(np.int8), np.dtype(np.uint16), np.dtype(np.int64)]:
        for shape in [(3, 5, 7), (2, 130, 3), (4, 1, 150), (0, 3, 2), (5, 0, 1)]:
            x = randn(shape, dtype) if dtype.kind == "f" else randint(shape, dtype)
            for axis in range(3):
                bt.add("cumsum", x, axis=axis)
    bt.add("cumsum", special(F32, 40).reshape(2, 20), axis=1)  # NaN and infinities carry on
    bt.check()


# --- movement ------------------------------------------------------------------------------

@covers("reshape", "permute", "broadcast_to", "flip")
def test_movement():
    bt = Batch()
    for dtype in [F32, np.dtype(np.int64), np.dtype(np.bool_)]:
        x = randn((2, 3, 4), dtype) if dtype.kind == "f" else \
            (randint((2, 3, 4), np.dtype(np.int64)) % 7).astype(dtype)
        for shape in ([6, 4], [24], [4, 3, 2], [2, 12], [1, 2, 1, 12, 1], [3, 8]):
            bt.add("reshape", x, shape=shape)
        for perm in ([2, 0, 1], [1, 0, 2], [0, 1, 2]):
            bt.add("permute", x, perm=perm)
        bt.add("broadcast_to", x[:, :1].copy(), shape=[5, 2, 3, 4])
        for axes in ([0], [1, 2], []):
            bt.add("flip", x, axes=axes)
        bt.add("reshape", x.reshape(6, 4), shape=[2, 3, 4])
    bt.add("reshape", randn((0, 4), F32), shape=[4, 0])
    bt.check()


@covers("slice", "pad", "concat")
def test_slice_pad_concat():
    bt = Batch()
    x = randn((5, 7))
    bt.add("slice", x, start=[1, 0], stop=[5, 7], step=[2, 3])
    bt.add("slice", x, start=[0, 2], stop=[0, 4], step=[1, 1])
    bt.add("pad", x, low=[1, 0], high=[2, 3], value=-1.5)
    bt.add("pad", randn((0, 2)), low=[1, 1], high=[0, 1], value=2.0)
    bt.add("pad", randint((3, 2), np.dtype(np.int32)), low=[0, 2], high=[1, 0], value=7)
    a, b, c = randn((2, 3)), randn((2, 0)), randn((2, 4))
    bt.add("concat", a, b, c, axis=1)
    bt.add("concat", a, a, axis=0)
    bt.check()


@covers("gather", "scatter_add", "dynamic_slice", "dynamic_update_slice")
def test_indexing_ops():
    bt = Batch()
    x = randn((5, 4))
    idx = np.array([[0, 4], [7, -1], [2, 2]], np.int64)
    bt.add("gather", x, idx, axis=0)
    bt.add("scatter_add", x, idx, randn((3, 2, 4)), axis=0)
    for s in (np.array(2, np.int64), np.array(-3, np.int32), np.array(9, np.int64)):
        bt.add("dynamic_slice", x, s, axis=0, size=3)
        bt.add("dynamic_update_slice", x, randn((5, 2)), s, axis=1)
    bt.check()


# --- linear algebra ------------------------------------------------------------------------

@covers("matmul")
@pytest.mark.parametrize("dtype", [F32, F64], ids=str)
def test_matmul_float(dtype):
    tol = 2e-5 if dtype == F32 else 1e-12
    bt = Batch()
    for sa, sb in [((3, 4), (4, 5)), ((2, 3, 7, 9), (3, 9, 5)), ((1, 37, 70), (4, 70, 33)), ((5, 0), (0, 6)),
                   ((0, 3), (3, 4)), ((6, 16), (16, 1)), ((130, 300), (300, 70))]:
        bt.add("matmul", randn(sa, dtype, 1.0), randn(sb, dtype, 1.0), rtol=tol, atol=tol)
    bt.check()


@covers("matmul")
def test_matmul_int():
    bt = Batch()
    for dtype in [np.dtype(np.int32), np.dtype(np.uint8), np.dtype(np.int64)]:
        bt.add("matmul", randint((2, 3, 5), dtype), randint((5, 4), dtype))
    bt.check()


# --- creation ------------------------------------------------------------------------------

@covers("constant", "full", "iota")
def test_creation():
    b = Builder()
    f = b.func("f")
    outs = []
    for dt in (F32, F64, np.dtype(np.int8), np.dtype(np.uint64), np.dtype(np.bool_)):
        t = TensorType(from_numpy(dt), (2, 3))
        outs.append(f.op("full", type=t, value=True if dt == np.bool_ else 3))
        outs.append(f.op("constant", type=t, value=Literal.from_numpy((np.arange(6).reshape(2, 3) % 2).astype(dt))))
        if dt != np.bool_:
            outs.append(f.op("iota", type=t, dim=1))
    f.ret(*outs)
    check(b.build(), [])


@covers("random")
def test_random():
    m = parse("""dtm 1.0

func @f(%k: u32[2]) -> (f32[3, 4], f64[5]) {
  %a = random %k : f32[3, 4]
  %b = random %k {distribution = "normal"} : f64[5]
  return %a, %b
}
""")
    check(m, [np.array([1, 2], np.uint32)])


# --- composites ----------------------------------------------------------------------------

COMPOSITES = ["softmax", "log_softmax", "layer_norm", "gelu", "silu", "scaled_dot_product_attention"]


@covers(*COMPOSITES)
@pytest.mark.parametrize("dtype", [F32, F64, np.dtype(np.float16)], ids=str)
def test_composites(dtype):
    # f16: computed in f32, rounded once (spec 2.8); the f32 math functions are within a few
    # ulp of the reference's, so a result next to a rounding boundary of f16 may round the
    # other way: one f16 ulp (2^-10 relative; 2^-24 near zero)
    tol = {F32: 1e-5, F64: 1e-12, np.dtype(np.float16): 1e-3}[dtype]
    atol = 2.0**-24 if dtype == np.float16 else tol
    bt = Batch()
    x = randn((3, 8), dtype, 2.0)
    for axis in (0, 1):
        bt.add("softmax", x, axis=axis, rtol=tol, atol=atol)
        bt.add("log_softmax", x, axis=axis, rtol=tol, atol=atol)
    bt.add("layer_norm", x, randn((8,), dtype), randn((8,), dtype), eps=1e-3, rtol=tol, atol=atol)
    bt.add("layer_norm", x, rtol=tol, atol=atol)
    for approx in ("none", "tanh"):
        bt.add("gelu", x, approximate=approx, rtol=tol, atol=atol)
    bt.add("silu", x, rtol=tol, atol=atol)
    q, k, v = randn((2, 3, 5, 4), dtype, 1.0), randn((2, 3, 6, 4), dtype, 1.0), randn((2, 3, 6, 3), dtype, 1.0)
    for causal in (False, True):
        for scale in (None, 0.7):
            bt.add("scaled_dot_product_attention", q, k, v, causal=causal, scale=scale, rtol=tol, atol=atol)
    bt.add("scaled_dot_product_attention", randn((2, 3, 4), dtype), randn((2, 0, 4), dtype), randn((2, 0, 2), dtype))
    bt.check()


# --- state, collectives, p2p, store, call ---------------------------------------------------

@covers("assign", "store_put", "store_get", "call")
def test_state_store_call():
    m = parse("""dtm 1.0

func @g(%a: f32[3], %b: f32[3]) -> (f32[3]) {
  %c = mul %a, %b : f32[3]
  return %c
}

func @f(%p: f32[3], %x: f32[3]) -> (f32[3], f32[3]) {
  %y = add %p, %x : f32[3]
  %z = call %y, %x {callee = @g} : f32[3]
  store_put %z {key = "z"}
  %w = store_get {key = "z"} : f32[3]
  assign %p, %w
  return %y, %w
}
""")
    check(m, [randn((3,)), randn((3,))])


@covers("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "barrier", "send", "recv")
def test_collectives_on_one_rank():
    m = parse("""dtm 1.0

mesh @m[dp = 1]

func @f(%x: f32[4, 2]) -> (f32[4, 2], f32[4, 2], f32[4, 2], f32[4, 2], f32[4, 2]) {
  %a = all_reduce %x {axes = ["dp"], mesh = @m} : f32[4, 2]
  %b = all_gather %a {axes = ["dp"], dim = 0, mesh = @m} : f32[4, 2]
  %c = reduce_scatter %b {axes = ["dp"], dim = 0, mesh = @m} : f32[4, 2]
  %d = broadcast %c {axes = ["dp"], mesh = @m} : f32[4, 2]
  %e = all_to_all %d {axes = ["dp"], concat_dim = 1, mesh = @m, split_dim = 0} : f32[4, 2]
  barrier {axes = ["dp"], mesh = @m}
  send %e {axes = ["dp"], dst = 0, mesh = @m}
  %r = recv {axes = ["dp"], mesh = @m, src = 0} : f32[4, 2]
  return %a, %b, %c, %e, %r
}
""")
    check(m, [randn((4, 2))])


@covers("check")
def test_check():
    """A check passes its operand through, fused or not, and stops the run with the same
    error on both backends when a fault is set."""
    m = parse("""dtm 1.1

func @f(%x: i64[2, 3], %y: f32[2, 3]) -> (i64[2, 3], f32[2, 3]) {
  %k = full {value = 5} : i64[]
  %a = add %x, %k : i64[2, 3]
  %bad = ge %a, %k : bool[2, 3]
  %c = check %a, %bad {code = "E0808", message = "index {value} is too large", where = "job.py:7"} : i64[2, 3]
  %ay = cast %c {to = f32} : f32[2, 3]
  %z = mul %ay, %y : f32[2, 3]
  return %c, %z
}
""")
    check(m, [-np.arange(6, dtype=np.int64).reshape(2, 3) - 1, randn((2, 3))])
    x = -np.arange(6, dtype=np.int64).reshape(2, 3) - 1
    x[1, 1] = 2
    for backend in ("ref", "cpu"):
        with pytest.raises(IndexError) as e:
            get_backend(backend).run(m, "f", [x, randn((2, 3))])
        assert e.value.code is ErrorCode.INDEX_OUT_OF_RANGE and e.value.where == "job.py:7"
        assert "index 7 is too large" in e.value.message, e.value.message


def test_every_registry_op_has_a_case():
    assert set(REGISTRY) - COVERED == set(), f"ops without a cpu-vs-ref case: {sorted(set(REGISTRY) - COVERED)}"


__all__ = ["check", "one_op", "randn", "math"]
