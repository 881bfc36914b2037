"""cumsum, the IR's running sum: torch's results to the bit (dtypes, promotion, dims, layouts,
empty and size-1 dims, gradients) on both backends, a kernel whose C does not grow with the
scanned dim, and no op of the API whose C grows with a dim of its operands.

The `cpu` lowering is a sequential loop along the axis with an f64 accumulator for floats;
a scan of log2(n) shifted adds, which it replaced, inlined into one kernel 320 bytes of C
per element (16,384 elements: 5.2 MB of C, 127 s to compile)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dtm
import dtm.nn.functional as NF
from dtm.compiler.autodiff import grad
from dtm.backends.cpu.passes import compile_func
from dtm.ir import Builder, Module, parse
from dtm.ref.interpreter import run as ref_run
from dtm.runtime.backend import BACKENDS as REGISTERED, get_backend

BACKENDS = ["ref"] + (["cpu"] if "cpu" in REGISTERED else [])


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("DTM_BACKEND", request.param)
    return request.param


def _array(shape: tuple, dtype: str, layout: str, rng: np.random.Generator) -> np.ndarray:
    """Values of `dtype` in `shape`, laid out contiguous ("c"), as a transpose ("T"), every
    other element of the last dim ("s") or with the last dim reversed ("r")."""
    base = tuple(reversed(shape)) if layout == "T" else shape[:-1] + (2 * shape[-1],) if layout == "s" else shape
    if dtype == "bool":
        a = rng.random(base) < 0.5
    elif dtype in ("i8", "u8", "i32", "i64"):
        lo = 0 if dtype == "u8" else -100
        a = rng.integers(lo, 100, base).astype({"i8": np.int8, "u8": np.uint8, "i32": np.int32, "i64": np.int64}[dtype])
    else:
        a = rng.uniform(-2, 2, base).astype(np.float32 if dtype == "f32" else np.float64)
    if layout == "T":
        return a.T
    return a[..., ::2] if layout == "s" else a[..., ::-1] if layout == "r" else a


SHAPES = [((7,), 0), ((3, 70), 0), ((3, 70), 1), ((2, 5, 66), 0), ((2, 5, 66), 1), ((2, 5, 66), -1),
          ((4, 1, 3), 1), ((0, 3), 0), ((0, 3), 1), ((3, 0), 0), ((1,), 0)]


@pytest.mark.parametrize("layout", ["c", "T", "s", "r"])
@pytest.mark.parametrize("dtype", ["f32", "f64", "i32", "i64", "i8", "u8", "bool"])
def test_cumsum_matches_torch(backend, dtype, layout):
    """Every dim of every shape, equal to torch's values and dtype (integers and bool give
    int64): floats to the bit, since both add left to right in double."""
    rng = np.random.default_rng(7)
    for shape, dim in SHAPES:
        x = _array(shape, dtype, layout, rng)
        got = dtm.tensor(x).cumsum(dim).numpy()
        want = torch.from_numpy(x.copy()).cumsum(dim).numpy()
        assert got.dtype == want.dtype and got.shape == want.shape, (shape, dim)
        np.testing.assert_array_equal(got, want, err_msg=f"{shape} dim {dim}")


def test_cumsum_dtype_argument_scalar_and_numpy(backend):
    """`dtype=` casts first (torch's rule); a 0-d tensor is its own running sum; an f32
    running sum past 2^24 keeps growing (it is summed in f64), where numpy's f32 one stops."""
    x = np.arange(-5, 7, dtype=np.int32).reshape(3, 4)
    got = dtm.cumsum(dtm.tensor(x), 1, dtype=dtm.float64).numpy()
    np.testing.assert_array_equal(got, torch.cumsum(torch.from_numpy(x), 1, dtype=torch.float64).numpy())
    assert dtm.tensor(np.float32(2.5)).cumsum(0).numpy() == np.float32(2.5)
    assert dtm.tensor(np.int8(3)).cumsum(-1).numpy().dtype == np.int64
    ones = np.ones(2**24 + 8, np.float32)
    assert dtm.tensor(ones).cumsum(0).numpy()[-1] == np.float32(2**24 + 8)
    assert np.cumsum(ones)[-1] == np.float32(2**24)


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_cumsum_gradient_matches_torch(backend, dtype):
    """The gradient of sum(cumsum(x) * c) is the reverse running sum of c, along each dim of
    contiguous and strided inputs."""
    rng = np.random.default_rng(3)
    for shape, dim in [((9,), 0), ((4, 70), 0), ((4, 70), 1), ((2, 3, 5), 1), ((3, 1), 1)]:
        for layout in ("c", "T"):
            x, c = _array(shape, dtype, layout, rng), _array(shape, dtype, "c", rng)
            xd = dtm.tensor(x, requires_grad=True)
            (xd.cumsum(dim) * dtm.tensor(c)).sum().backward()
            xt = torch.from_numpy(x.copy()).requires_grad_(True)
            (xt.cumsum(dim) * torch.from_numpy(c)).sum().backward()
            np.testing.assert_array_equal(xd.grad.numpy(), xt.grad.numpy(), err_msg=f"{shape} dim {dim} {layout}")


def test_cumsum_inside_larger_programs():
    """A running sum of an expression, of a product (along rows: written over the product
    in place), of values minus their maximum (a
    reduction its kernel cannot compute in place: stored first), of another running sum,
    read back through a flip, and sliced (the first elements computed alone: simplify sinks
    the slice; the last ones not): each as numpy computes it, in f64."""
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((6, 40)), rng.standard_normal((40, 40))
    progs = [(lambda M, a, b: ((a * 2 + 1).cumsum(1) - a).exp(),
              lambda a, b: np.exp(np.cumsum(a * 2 + 1, 1) - a)),
             (lambda M, a, b: (a @ b).cumsum(0), lambda a, b: np.cumsum(a @ b, 0)),
             (lambda M, a, b: (a @ b).cumsum(1) * 2, lambda a, b: np.cumsum(a @ b, 1) * 2),  # over the product
             (lambda M, a, b: (a - a.amax(0)).cumsum(0), lambda a, b: np.cumsum(a - a.max(0), 0)),
             (lambda M, a, b: a.cumsum(1).cumsum(0) + a.cumsum(0), lambda a, b: np.cumsum(np.cumsum(a, 1), 0)
              + np.cumsum(a, 0)),
             (lambda M, a, b: a.flip(1).cumsum(1).flip(1) * a, lambda a, b: np.cumsum(a[:, ::-1], 1)[:, ::-1] * a),
             (lambda M, a, b: M.cat([a.cumsum(1)[:, :5], a.cumsum(1)[:, -3:]], 1),
              lambda a, b: np.concatenate([np.cumsum(a, 1)[:, :5], np.cumsum(a, 1)[:, -3:]], 1)),
             (lambda M, a, b: a.cumsum(0)[:2] * 3, lambda a, b: np.cumsum(a, 0)[:2] * 3)]
    for fn, want in progs:
        got = dtm.jit(lambda a, b, fn=fn: fn(dtm, a, b))(dtm.tensor(x), dtm.tensor(w)).numpy()
        np.testing.assert_allclose(got, want(x, w), rtol=1e-12, atol=1e-12)


def test_cumsum_over_symbolic_dims():
    """One plan for every [B, T]: the cpu backend's results equal the reference's to the bit,
    down the columns and along the rows, empty and size-1 dims included."""
    m = parse("""dtm 1.1

func @f(%x: f32[B, T], %y: i32[B, T]) -> (f32[B, T], f32[B, T], i32[B, T]) {
  %a = cumsum %x {axis = 0} : f32[B, T]
  %b = cumsum %x {axis = 1} : f32[B, T]
  %c = cumsum %y {axis = 0} : i32[B, T]
  return %a, %b, %c
}
""")
    plan = get_backend("cpu").plan(m, "f")
    rng = np.random.default_rng(11)
    for shape in [(5, 70), (3, 200), (1, 1), (0, 4), (4, 0)]:
        x, y = rng.random(shape, dtype=np.float32), rng.integers(-2**31, 2**31, shape, dtype=np.int32)
        for got, want in zip(plan.run([x, y]), ref_run(m, "f", [x, y])):
            np.testing.assert_array_equal(got, want, err_msg=str(shape))


def _c_bytes(module: Module, func: str = "main") -> int:
    """Bytes of C the cpu backend generates for `func` (the passes only: nothing is built)."""
    return sum(len(step.source) for step in compile_func(module, func).kernels)


def test_a_long_cumsum_is_a_small_kernel():
    """100,000 ones (1e5 compiled for more than 300 s before): a few hundred bytes of C,
    whatever the length, and every running sum exact."""
    x = dtm.ones(100_000)
    assert _c_bytes(dtm.jit(lambda x: x.cumsum(0)).ir(x)) < 1500
    np.testing.assert_array_equal(x.cumsum(0).numpy(), np.arange(1, 100_001, dtype=np.float32))


def _cumsum_grad_module(n: int) -> Module:
    """sum(cumsum(x, 1) * x) of x: f32[3, n] and its gradient, as IR."""
    b = Builder()
    f = b.func("f")
    x = f.param(f"f32[3, {n}]")
    f.ret(f.reduce_sum(f.mul(f.cumsum(x, axis=1), x), axes=[0, 1]))
    m = b.build()
    grad(m, "f", [0])
    return m


def _t(*shape: int) -> dtm.Tensor:
    return dtm.tensor(np.random.default_rng(0).random(shape, dtype=np.float32))


# Each op of the API whose loops run over a dim of size n: (n -> function, arguments).
GROWTH_CASES = {
    "cumsum": lambda n: (lambda x: x.cumsum(0), _t(n)),
    "cumsum-columns": lambda n: (lambda x: x.cumsum(0), _t(n, n // 8)),
    "flip": lambda n: (lambda x: x.flip(0) * 2, _t(n)),
    "pad": lambda n: (lambda x: NF.pad(x, (3, 5)) * 2, _t(n)),
    "repeat": lambda n: (lambda x: x.repeat(3) * 2, _t(n)),
    "tril": lambda n: (lambda x: x.tril() * 2, _t(n, 4)),
    "sort": lambda n: (lambda x: x.sort()[0] * 2, _t(n)),
    "topk": lambda n: (lambda x: x.topk(5)[0] * 2, _t(n)),
    "one_hot": lambda n: (lambda i: NF.one_hot(i, n) * 2, dtm.tensor(np.arange(7) % 5)),
    "gather": lambda n: (lambda x, i: x.gather(0, i) * 2, _t(n), dtm.tensor(np.arange(n) % 3)),
    "index_select": lambda n: (lambda x, i: x.index_select(0, i) * 2, _t(n), dtm.tensor(np.arange(n) % 3)),
    "cat": lambda n: (lambda x, y: dtm.cat([x, y]) * 2, _t(n), _t(n)),
    "chunk-cat": lambda n: (lambda x: dtm.cat(list(x.chunk(4))[::-1]) * 2, _t(n)),
    "stack": lambda n: (lambda x, y: dtm.stack([x, y]) * 2, _t(n), _t(n)),
    "getitem-step": lambda n: (lambda x: x[::3] * 2, _t(n)),
    "softmax": lambda n: (lambda x: x.softmax(-1), _t(4, n)),
    "layer_norm": lambda n: (lambda x: NF.layer_norm(x, (n,)), _t(4, n)),
    "cross_entropy": lambda n: (lambda x, t: NF.cross_entropy(x, t), _t(4, n), dtm.tensor(np.arange(4))),
    "einsum-diagonal": lambda n: (lambda x: dtm.einsum("ii->i", x) * 2, _t(n, n)),
    "norm": lambda n: (lambda x: x.norm(), _t(n)),
    "argmax": lambda n: (lambda x: x.argmax(0), _t(n)),
    "linspace": lambda n: (lambda x: x + dtm.linspace(0, 1, n), _t(n)),
    "sdpa": lambda n: (lambda q: NF.scaled_dot_product_attention(q, q, q, is_causal=True), _t(1, 2, n, 8)),
}


@pytest.mark.parametrize("name", sorted(GROWTH_CASES) + ["cumsum-grad"])
def test_no_ops_code_grows_with_a_dim(name):
    """The C of each op at 64 and at 4,096 along a dim: less than twice as large (the digits
    of its literals, a parallel loop's pragma and, past 2,048 terms, each float sum's loop
    over blocks, spec 2.8), where code that grew with the dim would be 64 times larger."""
    sizes = []
    for n in (64, 4096):
        if name == "cumsum-grad":
            sizes.append(_c_bytes(_cumsum_grad_module(n), "f_grad"))
            continue
        fn, *args = GROWTH_CASES[name](n)
        sizes.append(_c_bytes(dtm.jit(fn).ir(*args)))
    assert sizes[1] < 2 * sizes[0], sizes
