"""The Tensor API around the ops, against PyTorch where it has the same thing: creation,
random numbers, dtypes and promotion, numpy and DLPack interop, item/tolist, laziness,
jit, error messages at the user's line, __setitem__, and autograd (no_grad, detach,
accumulation, explicit gradients). Every test runs once per backend, set through
DTM_BACKEND as a user would."""

from __future__ import annotations

import inspect
import itertools

import ml_dtypes
import numpy as np
import pytest
import torch

import dtm
from dtm.runtime.backend import BACKENDS

BACKEND_NAMES = ["ref"] + (["cpu"] if "cpu" in BACKENDS else [])


@pytest.fixture(params=BACKEND_NAMES)
def backend(request, monkeypatch):
    monkeypatch.setenv("DTM_BACKEND", request.param)
    return request.param


TORCH = {"bool": torch.bool, "u8": torch.uint8, "i8": torch.int8, "i16": torch.int16, "i32": torch.int32,
         "i64": torch.int64, "f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32,
         "f64": torch.float64}
NAME_OF_TORCH = {v: k for k, v in TORCH.items()}


def same(d: dtm.Tensor, t: torch.Tensor) -> None:
    """Equal shape, dtype and values (exactly)."""
    assert d.shape == tuple(t.shape)
    assert d.dtype.name == NAME_OF_TORCH[t.dtype], (d.dtype, t.dtype)
    a = d.numpy()
    b = t.detach().float().numpy() if t.dtype == torch.bfloat16 else t.detach().numpy()
    np.testing.assert_array_equal(a.astype(np.float32) if a.dtype == ml_dtypes.bfloat16 else a, b)


# --- creation -----------------------------------------------------------------------------

@pytest.mark.parametrize("data", [
    [1.5, 2.0], [[1, 2], [3, 4]], [True, False], 3, 2.5, True, [], [[1.0], [2.0]], [1, 2.5],
    np.arange(6, dtype=np.int32).reshape(2, 3), np.float64(2.5), np.array([1.0, 2.0], np.float16),
    np.arange(12.0).reshape(3, 4)[:, ::2], np.arange(6.0)[::-1], np.array(7, np.uint8),
], ids=lambda d: repr(d)[:30])
def test_tensor_from_data(backend, data):
    same(dtm.tensor(data), torch.tensor(data.copy() if isinstance(data, np.ndarray) else data))


@pytest.mark.parametrize("dtype", ["f32", "f64", "f16", "bf16", "i32", "i64", "bool", "u8"])
def test_tensor_dtype_argument(backend, dtype):
    data = [[0.0, 1.7], [-2.2, 3.0]] if dtype != "u8" else [[0, 1], [2, 255]]
    for spelling in (dtype, TORCH[dtype], getattr(dtm, {"f32": "float32", "f64": "float64", "f16": "float16",
                                                        "bf16": "bfloat16", "i32": "int32", "i64": "int64",
                                                        "bool": "bool_", "u8": "uint8"}[dtype])):
        same(dtm.tensor(data, dtype=spelling), torch.tensor(data, dtype=TORCH[dtype]))


def test_tensor_from_torch_and_tensor(backend):
    for t in (torch.arange(6.0).reshape(2, 3).T, torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
              torch.tensor([True, False]), torch.ones(2, requires_grad=True)):
        same(dtm.tensor(t), t)
    x = dtm.tensor([1.0, 2.0])
    y = dtm.tensor(x * 2, dtype="f64")
    assert y.dtype is dtm.float64 and y.tolist() == [2.0, 4.0]


def test_tensor_requires_grad(backend):
    assert dtm.tensor([1.0], requires_grad=True).requires_grad
    assert not dtm.tensor([1.0]).requires_grad
    with pytest.raises(dtm.DTMError):
        dtm.tensor([1, 2], requires_grad=True)


def test_tensor_copies_its_data(backend):
    a = np.ones(3)
    t = dtm.tensor(a)
    a[0] = 5
    assert t.tolist() == [1.0, 1.0, 1.0]


CREATION = {
    "zeros-varargs": lambda M: M.zeros(2, 3), "zeros-tuple": lambda M: M.zeros((2, 3)),
    "zeros-list": lambda M: M.zeros([4]), "zeros-rank0": lambda M: M.zeros(()), "zeros-size0": lambda M: M.zeros(0, 3),
    "ones-f64": lambda M: M.ones(2, 3, dtype=M.float64), "ones-i32": lambda M: M.ones(3, dtype=M.int32),
    "ones-bool": lambda M: M.ones((2, 1), dtype=M.bool), "full-int": lambda M: M.full((2, 3), 7),
    "full-float": lambda M: M.full((2,), 2.5), "full-bool": lambda M: M.full((2,), True),
    "full-f16": lambda M: M.full((3,), -1, dtype=M.float16), "full-rank0": lambda M: M.full([], 3.0),
    "arange": lambda M: M.arange(5), "arange-step": lambda M: M.arange(2, 9, 3),
    "arange-neg-step": lambda M: M.arange(5, 0, -2), "arange-float-step": lambda M: M.arange(0, 1, 0.25),
    "arange-float": lambda M: M.arange(5.0), "arange-f64": lambda M: M.arange(3, dtype=M.float64),
    "arange-i32": lambda M: M.arange(-3, 3, dtype=M.int32), "arange-empty": lambda M: M.arange(0),
}


@pytest.mark.parametrize("make", list(CREATION.values()), ids=list(CREATION))
def test_creation(backend, make):
    same(make(dtm), make(torch))


@pytest.mark.parametrize("fn", ["zeros_like", "ones_like"])
@pytest.mark.parametrize("dtype", ["f32", "f16", "i32", "bool"])
def test_like(backend, fn, dtype):
    x = dtm.tensor([[1, 0, 1]], dtype=dtype)
    same(getattr(dtm, fn)(x), getattr(torch, fn)(torch.tensor([[1, 0, 1]], dtype=TORCH[dtype])))
    same(getattr(dtm, fn)(x, dtype="f64"), getattr(torch, fn)(torch.ones(1, 3), dtype=torch.float64))


def test_full_like_and_random_like(backend):
    x = dtm.zeros(2, 3, dtype="f64")
    same(dtm.full_like(x, 4.5), torch.full_like(torch.zeros(2, 3, dtype=torch.float64), 4.5))
    same(dtm.full_like(x, 1, dtype="i32"), torch.full((2, 3), 1, dtype=torch.int32))
    for fn in (dtm.rand_like, dtm.randn_like):
        r = fn(x)
        assert r.shape == (2, 3) and r.dtype is dtm.float64


def test_from_numpy(backend):
    for a in (np.arange(6.0).reshape(2, 3), np.arange(6, dtype=np.int16).reshape(3, 2).T, np.array(3.5, np.float32),
              np.array([1.5, 2], dtype=ml_dtypes.bfloat16), np.zeros((0, 2), np.uint8), np.array([True])):
        t = dtm.from_numpy(a)
        assert t.shape == a.shape and t.dtype.name == dtm.as_dtype(a.dtype).name
        np.testing.assert_array_equal(t.numpy(), a)
    with pytest.raises(dtm.DTMError):
        dtm.from_numpy(np.array(["a"]))


def test_bad_data(backend):
    with pytest.raises(dtm.DTMError):
        dtm.tensor([[1, 2], [3]])
    with pytest.raises(dtm.DTMError):
        dtm.tensor("abc")
    with pytest.raises(dtm.DTMError):
        dtm.zeros(2, dtype="nope")


# --- random numbers -----------------------------------------------------------------------

def test_manual_seed_determinism(backend):
    dtm.manual_seed(123)
    a, b = dtm.randn(4, 5).numpy(), dtm.rand(7).numpy()
    dtm.manual_seed(123)
    np.testing.assert_array_equal(dtm.randn(4, 5).numpy(), a)
    np.testing.assert_array_equal(dtm.rand(7).numpy(), b)
    dtm.manual_seed(124)
    assert not np.array_equal(dtm.randn(4, 5).numpy(), a)
    dtm.manual_seed(123)
    first, second = dtm.randn(4, 5).numpy(), dtm.randn(4, 5).numpy()
    assert not np.array_equal(first, second), "each call draws new numbers"


def test_random_shapes_and_dtypes(backend):
    dtm.manual_seed(0)
    for fn in (dtm.rand, dtm.randn):
        assert fn(2, 3).shape == (2, 3) and fn(2, 3).dtype is dtm.float32
        assert fn((4,)).shape == (4,)
        assert fn(0, 2).shape == (0, 2)
        assert fn(3, dtype="f64").dtype is dtm.float64
        assert fn(3, dtype=torch.float16).dtype is dtm.float16
        assert fn(3, dtype="bf16").dtype is dtm.bfloat16
        assert fn(3, requires_grad=True).requires_grad
        with pytest.raises(dtm.DTMError):
            fn(3, dtype="i32")


def test_rand_in_unit_interval(backend):
    dtm.manual_seed(1)
    for dtype in ("f32", "f64", "f16", "bf16"):
        u = dtm.rand(100_000, dtype=dtype).numpy().astype(np.float64)
        assert u.min() >= 0.0 and u.max() < 1.0, dtype
        assert abs(u.mean() - 0.5) < 0.01 and abs(u.std() - (1 / 12) ** 0.5) < 0.01, dtype


def test_randn_moments(backend):
    dtm.manual_seed(2)
    for dtype in ("f32", "f64"):
        z = dtm.randn(100_000, dtype=dtype).numpy()
        assert abs(z.mean()) < 0.02 and abs(z.std() - 1.0) < 0.02, dtype
        assert np.isfinite(z).all()
        assert 0.3 < (np.abs(z) < 0.5).mean() < 0.4  # P(|z| < 0.5) = 0.383 for a normal


# --- dtypes and promotion -----------------------------------------------------------------

DTYPES = list(TORCH)


@pytest.mark.parametrize("a,b", list(itertools.combinations_with_replacement(DTYPES, 2)))
def test_promote_types(backend, a, b):
    want = NAME_OF_TORCH[torch.promote_types(TORCH[a], TORCH[b])]
    assert dtm.promote_types(dtm.as_dtype(a), dtm.as_dtype(b)).name == want
    assert dtm.promote_types(dtm.as_dtype(b), dtm.as_dtype(a)).name == want


SCALARS = [True, 3, -2, 2.5]


@pytest.mark.parametrize("a", DTYPES)
def test_result_type_with_scalars_and_rank0(backend, a):
    ta, da = torch.zeros(2, dtype=TORCH[a]), dtm.zeros(2, dtype=a)
    for s in SCALARS:
        assert dtm.result_type(da, s).name == NAME_OF_TORCH[torch.result_type(ta, s)], (a, s)
        assert dtm.result_type(s, da).name == NAME_OF_TORCH[torch.result_type(s, ta)], (a, s)
    for b in DTYPES:  # a tensor with dims and a rank-0 tensor: two different tiers in torch
        t0, d0 = torch.zeros((), dtype=TORCH[b]), dtm.zeros((), dtype=b)
        assert dtm.result_type(da, d0).name == NAME_OF_TORCH[torch.result_type(ta, t0)], (a, b)
        assert dtm.result_type(d0, da).name == NAME_OF_TORCH[torch.result_type(t0, ta)], (a, b)
        assert dtm.result_type(dtm.zeros((), dtype=a), d0).name == NAME_OF_TORCH[
            torch.result_type(torch.zeros((), dtype=TORCH[a]), t0)], (a, b)
        for s in SCALARS:
            want = NAME_OF_TORCH[(ta + t0 + s).dtype] if a != "bool" or b != "bool" else None
            if want is not None:
                assert dtm.result_type(da, d0, s).name == want, (a, b, s)


@pytest.mark.parametrize("name,torch_dtype", [("f8e4m3", torch.float8_e4m3fn), ("f8e5m2", torch.float8_e5m2)])
def test_float8_casts(backend, name, torch_dtype):
    """Casts round as torch's do within the finite range. (Beyond it the spec gives NaN for
    f8e4m3 and an infinity for f8e5m2; torch saturates f8e4m3 to +-448.)"""
    v = np.concatenate([np.random.default_rng(0).uniform(-400, 400, 200), [0.1, -0.0, 1e-9, 0.3125, 448.0]])
    d = dtm.tensor(v).to(name)
    assert d.dtype.name == name
    t = torch.tensor(v, dtype=torch.float32).to(torch_dtype)
    np.testing.assert_array_equal(d.float().numpy(), t.float().numpy())
    np.testing.assert_array_equal((d.float() * 2).numpy(), (t.float() * 2).numpy())


def test_as_dtype_spellings(backend):
    for spelling, name in [("float32", "f32"), ("float", "f32"), ("double", "f64"), ("half", "f16"),
                           ("bfloat16", "bf16"), ("long", "i64"), ("bool", "bool"), (np.float16, "f16"),
                           (np.dtype("int32"), "i32"), (torch.bfloat16, "bf16"), (torch.uint8, "u8"),
                           (dtm.float64, "f64"), (dtm.half, "f16"), (dtm.long, "i64"), (dtm.bool, "bool")]:
        assert dtm.as_dtype(spelling).name == name
    with pytest.raises(dtm.DTMError):
        dtm.as_dtype("float128")


# --- numpy, DLPack, item, tolist ----------------------------------------------------------

def test_numpy_interop(backend):
    x = dtm.tensor([[1.0, 2.0], [3.0, 4.0]]) * 2
    a = np.asarray(x)
    assert a.dtype == np.float32 and a.tolist() == [[2.0, 4.0], [6.0, 8.0]]
    assert np.array(x, dtype=np.float64).dtype == np.float64
    assert x.numpy().shape == (2, 2)
    y = np.ones((2, 2), np.float32) + x  # numpy defers to the Tensor's operator
    assert isinstance(y, dtm.Tensor) and y.tolist() == [[3.0, 5.0], [7.0, 9.0]]
    b = np.asarray(dtm.tensor([1.5], dtype="bf16"))
    assert b.dtype == ml_dtypes.bfloat16 and b.astype(np.float32).tolist() == [1.5]


@pytest.mark.parametrize("dtype", ["f32", "f64", "f16", "i64", "i32", "u8", "bool"])
def test_dlpack_to_torch(backend, dtype):
    x = dtm.arange(6).reshape(2, 3).to(dtype) * 1 if dtype != "bool" else dtm.arange(6).reshape(2, 3) > 2
    t = torch.from_dlpack(x)
    assert t.dtype == TORCH[dtype] and tuple(t.shape) == (2, 3)
    np.testing.assert_array_equal(t.numpy(), x.numpy())
    np.testing.assert_array_equal(np.from_dlpack(x), x.numpy())


@pytest.mark.parametrize("dtype", ["f32", "f64", "f16", "i64", "i32", "u8", "bool"])
def test_dlpack_from_torch(backend, dtype):
    t = (torch.arange(6).reshape(2, 3) % 2).to(TORCH[dtype])
    for src in (t, t.T, t[:, ::2]):
        same(dtm.from_dlpack(src), src)


def test_dlpack_bf16(backend):
    """bfloat16 both ways (numpy's DLPack has none: DTM relabels the capsule), sharing memory
    as DLPack does, and a torch view's strides kept."""
    t = torch.tensor([[1.5, -2.0, 3.25], [0.5, 7.0, -0.125]], dtype=torch.bfloat16)
    same(dtm.from_dlpack(t), t)
    same(dtm.from_dlpack(t.T), t.T)
    same(dtm.tensor(t), torch.from_dlpack(dtm.tensor(t)))
    same(dtm.from_dlpack(dtm.tensor(t)), t)
    d = dtm.tensor(t)
    back = torch.from_dlpack(d)
    assert back.dtype == torch.bfloat16 and back.data_ptr() == d.numpy().ctypes.data  # no copy
    shared = dtm.from_dlpack(t)
    t[0, 0] = 9.0
    assert float(shared.numpy()[0, 0]) == 9.0
    with pytest.raises((BufferError, TypeError)):  # numpy alone still refuses: DTM's own path is needed
        torch.from_dlpack(d.numpy())


def test_dlpack_of_a_dtype_numpy_cannot_take_is_a_dtm_error(backend):
    with pytest.raises(dtm.DTMError) as e:
        dtm.from_dlpack(torch.zeros(2, dtype=torch.float8_e4m3fn))
    assert e.value.code == "E0401" and "float8_e4m3fn" in str(e.value)


def test_item_and_tolist(backend):
    assert dtm.tensor([[2.5]]).item() == 2.5 and isinstance(dtm.tensor([[2.5]]).item(), float)
    assert dtm.tensor(3).item() == 3 and isinstance(dtm.tensor(3).item(), int)
    assert dtm.tensor([True]).item() is True
    assert (dtm.tensor([1.0, 2.0]).sum() * 2).item() == 6.0
    with pytest.raises(dtm.DTMError):
        dtm.tensor([1.0, 2.0]).item()
    for data in ([[1.5, 2.0], [3.0, 4.0]], [1, 2, 3], [True, False], 4.0, [[]]):
        assert dtm.tensor(data).tolist() == torch.tensor(data).tolist()
    assert float(dtm.tensor(2.5)) == 2.5 and int(dtm.tensor(7)) == 7 and bool(dtm.tensor([1]))
    assert len(dtm.zeros(4, 2)) == 4 and [r.shape for r in dtm.zeros(3, 2)] == [(2,)] * 3
    assert list(range(10))[dtm.tensor(3)] == 3  # __index__


def test_shape_queries(backend):
    x = dtm.zeros(2, 3, 4)
    assert x.shape == (2, 3, 4) and x.size() == (2, 3, 4) and x.size(-1) == 4 and x.ndim == 3 and x.dim() == 3
    assert x.numel() == 24 and x.device == "cpu"


# --- laziness and backends ----------------------------------------------------------------

@pytest.fixture
def runs(backend, monkeypatch):
    """Counts the programs the backend runs."""
    b = BACKENDS[backend]
    count = [0]
    original = b.run

    def counting(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(b, "run", counting)
    return count


def test_ops_are_lazy(backend, runs):
    x = dtm.tensor([1.0, 2.0, 3.0])
    y = (x * 2 + 1).exp().sum(0)
    z = (x @ x) - y
    assert runs[0] == 0, "recording ops runs nothing"
    assert z._buffer is None
    z.realize()
    assert runs[0] == 1, "one program for the whole pending graph"
    z.numpy(), z.item(), z.tolist()
    assert runs[0] == 1, "a realized tensor is not computed again"
    np.testing.assert_allclose(z.item(), 14.0 - np.exp([3.0, 5.0, 7.0]).sum(), rtol=1e-5)


def test_realize_many_in_one_program(backend, runs):
    x = dtm.tensor([1.0, 2.0])
    a, b = x + 1, x * 3
    dtm.realize(a, b)
    assert runs[0] == 1 and a.tolist() == [2.0, 3.0] and b.tolist() == [3.0, 6.0]
    c = a + b  # built on realized tensors: reads their buffers, computes only the new op
    assert c.tolist() == [5.0, 9.0] and runs[0] == 2


def test_backend_per_call_and_by_env(backend, monkeypatch):
    x = dtm.tensor([1.0]) + 1
    with pytest.raises(dtm.DTMError, match="unknown backend 'nope'"):
        x.realize(backend="nope")
    assert x.realize(backend=backend).tolist() == [2.0]
    monkeypatch.setenv("DTM_BACKEND", "nope")
    with pytest.raises(dtm.DTMError) as e:
        (dtm.tensor([1.0]) * 2).numpy()
    assert e.value.code is dtm.ErrorCode.UNKNOWN_BACKEND


# --- jit ----------------------------------------------------------------------------------

def test_jit_traces_once_per_signature(backend, runs):
    traces = []

    def f(x, y):
        traces.append((x.shape, x.dtype))
        return (x * y).sum(-1) + 1

    jf = dtm.jit(f)
    a, b = np.arange(6.0).reshape(2, 3), np.linspace(0, 1, 3)
    out = jf(dtm.tensor(a), dtm.tensor(b))
    np.testing.assert_allclose(out.numpy(), (a * b).sum(-1) + 1, rtol=1e-6)
    assert len(traces) == 1 and runs[0] == 1
    out2 = jf(dtm.tensor(a + 1), dtm.tensor(b))
    np.testing.assert_allclose(out2.numpy(), ((a + 1) * b).sum(-1) + 1, rtol=1e-6)
    assert len(traces) == 1, "same signature: replayed, not traced again"
    jf(dtm.zeros(4, 3), dtm.tensor(b))
    assert len(traces) == 2, "a new shape traces again"
    jf(dtm.zeros(4, 3, dtype="f64"), dtm.tensor(b, dtype="f64"))
    assert len(traces) == 3, "a new dtype traces again"
    jf(dtm.tensor(a), dtm.tensor(b))
    assert len(traces) == 3


def test_jit_non_tensor_args_are_part_of_the_signature(backend):
    traces = []

    def f(x, k):
        traces.append(k)
        return x * k

    jf = dtm.jit(f)
    assert jf(dtm.ones(2), 3).tolist() == [3.0, 3.0]
    assert jf(dtm.ones(2), 3).tolist() == [3.0, 3.0]
    assert jf(dtm.ones(2), 5).tolist() == [5.0, 5.0]
    assert traces == [3, 5]


def test_jit_tuple_outputs_match_eager(backend):
    def f(x):
        return x.softmax(-1), x.max(-1).values, x[:, ::-1]

    x = dtm.tensor(np.random.default_rng(0).standard_normal((3, 4)))
    for got, want in zip(dtm.jit(f)(x), f(x)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12)


def test_jit_ir_module(backend):
    def f(x, y):
        return (x @ y).relu()

    jf = dtm.jit(f)
    x, y = dtm.ones(2, 3), dtm.ones(3, 4)
    m = jf.ir(x, y)
    assert isinstance(m, dtm.ir.Module)
    dtm.ir.verify(m)
    text = dtm.ir.format(m)
    assert "matmul" in text and "f32[2, 3]" in text
    assert dtm.ir.parse(text) == m
    assert jf.ir(x, y).hash() == m.hash(), "the hash is stable across calls"
    assert dtm.jit(f).ir(dtm.zeros(2, 3), dtm.zeros(3, 4)).hash() == m.hash(), "and across traces"
    assert jf.ir(dtm.ones(5, 3), y).hash() != m.hash()


def test_jit_sees_updated_closure_weights(backend):
    w = dtm.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)

    @dtm.jit
    def f(x):
        return x @ w

    x = dtm.tensor([[1.0, 1.0]])
    assert f(x).tolist() == [[4.0, 6.0]]
    with dtm.no_grad():
        w[0, 0] = 10.0
    assert f(x).tolist() == [[13.0, 6.0]]
    (x @ w).sum().backward()
    dtm.optim.SGD([w], lr=1.0).step()  # w -= grad (1 in every row)
    assert f(x).tolist() == [[11.0, 4.0]]


def test_jit_cannot_read_values_while_tracing(backend):
    @dtm.jit
    def f(x):
        return x * x.sum().item()

    with pytest.raises(dtm.DTMError):
        f(dtm.ones(2))


# --- errors at the user's line ------------------------------------------------------------

def _raises_here(fn, *words):
    """fn() raises a TensorError naming this file, the line of the call in fn, and words."""
    line = inspect.getsourcelines(fn)[1]
    with pytest.raises(dtm.TensorError) as e:
        fn()
    msg = str(e.value)
    assert f"{__file__}:{line}:" in msg, msg
    for w in words:
        assert w in msg, (w, msg)
    return e.value


def test_errors_name_the_user_line(backend):
    a, b = dtm.ones(2, 3), dtm.ones(4)
    err = _raises_here(lambda: a + b, "add", "[2, 3]", "[4]")
    assert err.code is dtm.ErrorCode.SHAPE_MISMATCH
    _raises_here(lambda: a @ dtm.ones(4, 2), "matmul", "f32[2, 3]", "f32[4, 2]")
    _raises_here(lambda: dtm.cat([a, dtm.ones(2, 4)]), "concat", "f32[2, 3]", "f32[2, 4]")
    _raises_here(lambda: dtm.where(a > 0, dtm.ones(3, 3), 0.0), "where", "[2, 3]", "[3, 3]")
    _raises_here(lambda: a.reshape(4, 2), "reshape", "[2, 3]", "[4, 2]")
    _raises_here(lambda: a.sum(dim=2), "dim 2")
    _raises_here(lambda: a.softmax(-3), "dim -3")
    _raises_here(lambda: a[2], "index 2")
    _raises_here(lambda: a.expand(4, 4), "broadcast_to")
    _raises_here(lambda: a.gather(1, dtm.ones(2, 3)), "gather", "f32")
    _raises_here(lambda: dtm.ones(3, dtype="i32").mean(), "mean", "i32")
    _raises_here(lambda: dtm.nn.functional.layer_norm(a, (3,), dtm.ones(3, dtype="f64"), dtm.ones(3)),
                 "layer_norm", "f32[3]", "f64[3]")
    _raises_here(lambda: dtm.ones(3, dtype="i32") & dtm.ones(3, dtype="i32"), "i32")


def test_error_line_of_a_call_inside_a_helper(backend):
    def model(x):
        return x @ dtm.ones(5, 2)  # the error is reported here, in the user's helper

    line = inspect.getsourcelines(model)[1] + 1
    with pytest.raises(dtm.TensorError) as e:
        model(dtm.ones(3, 4))
    assert f"{__file__}:{line}:" in str(e.value)
    lin = dtm.nn.Linear(4, 2)
    line = inspect.currentframe().f_lineno + 2
    with pytest.raises(dtm.TensorError) as e:
        lin(dtm.ones(3, 5))  # inside dtm.nn: still the user's line
    assert f"{__file__}:{line}:" in str(e.value)


# --- __setitem__ against torch ------------------------------------------------------------

def _t(index):
    """The index with dtm tensors as torch tensors."""
    if isinstance(index, tuple):
        return tuple(_t(i) for i in index)
    return torch.from_numpy(index.numpy().copy()) if isinstance(index, dtm.Tensor) else index


SETITEM = [
    (1, 7.0), (1, np.arange(5.0)), ((slice(None), 2), np.arange(4.0)), (slice(1, 3), np.arange(5.0)),
    ((slice(None, None, 2), slice(None, None, 2)), np.arange(6.0).reshape(2, 3)), ((Ellipsis, -1), -3.0),
    ((None, 1), np.arange(5.0)), (-1, np.ones((1, 5))),
    ((slice(1, None), slice(None, 4, 3)), np.array([[1.0], [2.0], [3.0]])),
    (dtm.tensor([0, 2]), 5.0), (dtm.tensor([3, -4]), np.arange(10.0).reshape(2, 5)),
    ((dtm.tensor([0, 1, 3]), dtm.tensor([4, 0, 2])), np.array([7.0, 8.0, 9.0])),
    ((slice(None), dtm.tensor([1, 3])), np.arange(8.0).reshape(4, 2)),
    ((dtm.tensor([[0], [2]]), dtm.tensor([1, 2])), 0.5),
    ((1, dtm.tensor([0, 4])), np.array([5.0])),
    ("mask2d", 0.0), ("mask2d", np.float64(4.0)), ("mask1d", np.arange(5.0)), ("mask1d", -1.0), ("mask_values", None),
    ((), 9.0), ((Ellipsis,), np.arange(5.0)), (slice(5, 9), 1.0),
]


@pytest.mark.parametrize("dtype", ["f32", "i64"])
@pytest.mark.parametrize("index,value", SETITEM, ids=[str(k) for k in range(len(SETITEM))])
def test_setitem_matches_torch(backend, index, value, dtype):
    base = np.arange(20.0).reshape(4, 5) - 7
    d, t = dtm.tensor(base, dtype=dtype), torch.tensor(base, dtype=TORCH[dtype])
    if isinstance(index, str):
        mask = base % 3 == 0 if index != "mask1d" else np.array([True, False, True, False])
        index = dtm.tensor(mask)
        if value is None:  # x[mask] = tensor of the selected count
            value = np.arange(float(mask.sum()))
    d_value = dtm.tensor(value) if isinstance(value, np.ndarray) else value
    t_value = torch.tensor(value, dtype=t.dtype) if isinstance(value, np.ndarray) else value
    d[index] = d_value
    t[_t(index)] = t_value
    same(d, t)


def test_setitem_negative_steps_match_numpy(backend):
    for index, value in [((slice(None, None, -1), 0), np.arange(4.0)), ((1, slice(3, 0, -2)), np.array([8.0, 9.0])),
                         ((slice(None, None, -2), slice(None, None, -1)), np.arange(10.0).reshape(2, 5))]:
        a = np.arange(20.0).reshape(4, 5)
        d = dtm.tensor(a)
        d[index] = dtm.tensor(value)
        a[index] = value
        np.testing.assert_array_equal(d.numpy(), a)


def test_setitem_keeps_earlier_reads(backend):
    x = dtm.ones(3)
    before = x * 2  # lazy: must still see the value x had here
    x[0] = 5.0
    after = x * 2
    x[1] = 7.0
    assert before.tolist() == [2.0, 2.0, 2.0]
    assert after.tolist() == [10.0, 2.0, 2.0]
    assert x.tolist() == [5.0, 7.0, 1.0]
    alias = x
    x[2] = 0.0
    assert alias.tolist() == [5.0, 7.0, 0.0], "the same object: an alias sees the write, as in torch"


def test_setitem_with_grad(backend):
    x = dtm.tensor([1.0, 2.0, 3.0], requires_grad=True)
    v = dtm.tensor(5.0, requires_grad=True)
    with pytest.raises(dtm.DTMError):
        x[0] = 1.0  # a leaf that requires grad, as in torch
    y = x * 2
    z = y * 3
    y[1] = v
    (z.sum() + (y * y).sum()).backward()
    tx = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    tv = torch.tensor(5.0, requires_grad=True)
    ty = tx * 2
    tz = ty * 3
    ty[1] = tv
    (tz.sum() + (ty * ty).sum()).backward()
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy())
    np.testing.assert_allclose(v.grad.numpy(), tv.grad.numpy())


def test_setitem_under_no_grad_keeps_a_leaf(backend):
    w = dtm.tensor([1.0, 2.0], requires_grad=True)
    with dtm.no_grad():
        w[0] = 3.0
    assert w.requires_grad and w.is_leaf and w.tolist() == [3.0, 2.0]
    (w * w).sum().backward()
    assert w.grad.tolist() == [6.0, 4.0]


# --- autograd -----------------------------------------------------------------------------

def test_no_grad(backend):
    x = dtm.tensor([1.0, 2.0], requires_grad=True)
    assert dtm.is_grad_enabled()
    with dtm.no_grad():
        assert not dtm.is_grad_enabled()
        y = x * 2
        with dtm.no_grad():
            pass
        assert not dtm.is_grad_enabled()
    assert dtm.is_grad_enabled() and not y.requires_grad
    assert (x * 2).requires_grad

    @dtm.no_grad()
    def f(t):
        return t * 3

    assert not f(x).requires_grad and dtm.is_grad_enabled()
    with pytest.raises(dtm.DTMError):
        y.sum().backward()


def test_detach(backend):
    x = dtm.tensor([1.0, 2.0], requires_grad=True)
    y = x * 3
    d = y.detach()
    assert not d.requires_grad and d.is_leaf and d.tolist() == [3.0, 6.0]
    (y * d).sum().backward()  # d is a constant: d(y * d)/dx = 3 * d
    assert x.grad.tolist() == [9.0, 18.0]
    e = (x * 2).detach()  # detach of a pending tensor
    assert e.tolist() == [2.0, 4.0] and not e.requires_grad


def test_grad_accumulates(backend):
    x = dtm.tensor([1.0, -2.0], requires_grad=True)
    (x * x).sum().backward()
    assert x.grad.tolist() == [2.0, -4.0]
    (x * 3).sum().backward()
    assert x.grad.tolist() == [5.0, -1.0]
    x.grad = None
    x.sum().backward()
    assert x.grad.tolist() == [1.0, 1.0]


def test_backward_twice_through_one_graph(backend):
    """As in torch: retain_graph=True keeps the graph for a second backward() (the grads
    add up); without it the graph is freed and going through it again is an error (it
    silently doubled the gradient once)."""
    x = dtm.tensor([2.0], requires_grad=True)
    y = (x * x).exp()
    loss = y.sum()
    loss.item()  # realized first: backward still sees the graph
    loss.backward(retain_graph=True)
    loss.backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * 4 * np.exp(4.0), rtol=1e-6)
    with pytest.raises(dtm.TensorError) as e:
        loss.backward()
    assert e.value.code is dtm.ErrorCode.GRAPH_FREED and e.value.where.startswith(__file__)
    with pytest.raises(dtm.TensorError):
        (y * 2).sum().backward()  # y's graph went with loss's
    assert loss.item() == pytest.approx(np.exp(4.0)) and y.numpy() == pytest.approx(np.exp(4.0))
    np.testing.assert_allclose(x.grad.numpy(), 2 * 4 * np.exp(4.0), rtol=1e-6)  # unchanged by the refusals
    tx = torch.tensor([2.0], requires_grad=True)
    tloss = (tx * tx).exp().sum()
    tloss.backward()
    with pytest.raises(RuntimeError, match="second time"):
        tloss.backward()


def test_backward_with_explicit_gradient(backend):
    a = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    g = np.array([[1.0, -1.0, 0.5], [2.0, 0.0, 1.0]])
    x = dtm.tensor(a, requires_grad=True)
    y = (x * x).sin()
    with pytest.raises(dtm.DTMError):
        y.backward()  # non-scalar: needs a gradient
    with pytest.raises(dtm.DTMError):
        y.backward(dtm.ones(3))
    y.backward(dtm.tensor(g))
    tx = torch.tensor(a, dtype=torch.float32, requires_grad=True)
    (tx * tx).sin().backward(torch.tensor(g, dtype=torch.float32))
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-5)


def test_grad_flags(backend):
    x = dtm.tensor([1.0, 2.0], requires_grad=True)
    c = dtm.tensor([3.0, 4.0])
    y = x * c
    assert y.requires_grad and not y.is_leaf and x.is_leaf and c.is_leaf
    assert not (x > 1).requires_grad, "bool results carry no gradient"
    assert not x.argmax().requires_grad
    y.sum().backward()
    assert x.grad.tolist() == [3.0, 4.0] and c.grad is None and y.grad is None
    assert x.grad.dtype is dtm.float32 and not x.grad.requires_grad
    with pytest.raises(dtm.DTMError):
        c.sum().backward()


def test_grad_of_unused_and_mixed_dtype_leaves(backend):
    x = dtm.tensor([1.0, 2.0], dtype="f64", requires_grad=True)
    h = dtm.tensor([1.0, 2.0], dtype="f16", requires_grad=True)
    (x * h).sum().backward()  # promotes to f64; grads come back in each leaf's dtype
    assert x.grad.dtype is dtm.float64 and h.grad.dtype is dtm.float16
    assert x.grad.tolist() == [1.0, 2.0] and h.grad.tolist() == [1.0, 2.0]
