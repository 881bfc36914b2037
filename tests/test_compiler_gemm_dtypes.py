"""Products of every pair of dtypes on the `cpu` backend against the reference (issue 37).

The `cpu` compiler sends an f32 or f64 product to the tiled runtime kernel, and reads a
narrow weight (bf16, q8_0, q4_0) through its cast when that cast is B's. A cast anywhere
else (A's, a stored one, f16 -> f32, f32 -> f64 from promotion) is computed by a kernel of
its own and read as the product's dtype. Mistaking one for the other gave wrong products in
silence (a bf16 A read as if it were B's narrow weight) or crashed (`undefined symbol
dtm_rt_gemm_f64_f32`). Every product here runs on both backends and must agree with the
`ref` backend, and for float results also with numpy on the promoted inputs in f64.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import dtm
import dtm.debug
import dtm.runtime.backend
from dtm.ir.dtypes import numpy_dtype

pytestmark = pytest.mark.skipif("cpu" not in dtm.runtime.backend.BACKENDS, reason="no C compiler: no cpu backend")

DTYPES = {"f32": dtm.float32, "f64": dtm.float64, "f16": dtm.float16, "bf16": dtm.bfloat16,
          "f8e4m3": dtm.float8_e4m3fn, "i32": dtm.int32, "i64": dtm.int64}
# a few ulps of the result dtype: the backends may sum in another order
TOL = {"f64": 1e-12, "f32": 1e-5, "f16": 4e-3, "bf16": 3e-2, "f8e4m3": 0.15}

# the products a user reaches the GEMM path through, each of two [.., M, K] and [.., K, N]-ish tensors
PRODUCTS = {
    "matmul": (lambda a, b: a @ b, (3, 5), (5, 4)),
    "linear": (lambda a, b: dtm.nn.functional.linear(a, b), (3, 5), (4, 5)),
    "bmm": (lambda a, b: dtm.bmm(a, b), (2, 3, 5), (2, 5, 4)),
    "einsum": (lambda a, b: dtm.einsum("bik,bkj->bij", a, b), (2, 3, 5), (2, 5, 4)),
}


def _values(shape: tuple, seed: int) -> np.ndarray:
    """Small integers and halves: exact in every dtype here (f8e4m3 holds -4..4 in halves),
    so products of a few of them are exact in each float result dtype too."""
    return np.random.default_rng(seed).integers(-8, 9, size=shape).astype(np.float64) / 2


def _inputs(a_np, b_np, da: str, db: str, via: str | None) -> tuple:
    a = dtm.tensor(a_np.astype(np.float32))
    if via is not None:
        a = a.to(DTYPES[via])  # the value converted from one dtype to another before the product
    return a.to(DTYPES[da]), dtm.tensor(b_np.astype(np.float32)).to(DTYPES[db])


def _check(op: str, da: str, db: str, monkeypatch, seed: int, via: str | None = None) -> None:
    """op on the cpu backend against the ref backend; a float result also against numpy in
    f64 on the inputs as numpy converts them (exact here, see _values)."""
    fn, sa, sb = PRODUCTS[op]
    a_np, b_np = _values(sa, seed), _values(sb, seed + 1)
    results = {}
    for backend in ("cpu", "ref"):
        monkeypatch.setenv("DTM_BACKEND", backend)
        out = fn(*_inputs(a_np, b_np, da, db, via))
        results[backend] = (out.numpy(), out.dtype)
    (got, dtype), (want, want_dtype) = results["cpu"], results["ref"]
    assert dtype == want_dtype and got.shape == want.shape
    name = dtype.name
    if name not in TOL:
        np.testing.assert_array_equal(got, want)
        return
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=TOL[name], atol=TOL[name])
    a_ref = a_np.astype(np.float32)
    for step in (via, da):
        if step is not None:
            a_ref = a_ref.astype(numpy_dtype(DTYPES[step]))
    b_ref = b_np.astype(np.float32).astype(numpy_dtype(DTYPES[db])).astype(np.float64)
    b_ref = b_ref.T if op == "linear" else b_ref
    np.testing.assert_allclose(got.astype(np.float64), np.matmul(a_ref.astype(np.float64), b_ref),
                               rtol=TOL[name], atol=TOL[name])


@pytest.mark.parametrize("da,db", list(itertools.product(DTYPES, DTYPES)))
def test_matmul_every_pair_of_dtypes(da, db, monkeypatch):
    _check("matmul", da, db, monkeypatch, seed=3)


@pytest.mark.parametrize("op", ["linear", "bmm", "einsum"])
@pytest.mark.parametrize("da,db", [("bf16", "f32"), ("f32", "bf16"), ("f32", "f64"), ("f64", "f32"),
                                   ("f16", "f32"), ("f32", "f16"), ("i64", "f32"), ("f8e4m3", "f32"),
                                   ("bf16", "bf16"), ("f16", "bf16"), ("i32", "i64")])
def test_products_mixed_dtypes(op, da, db, monkeypatch):
    _check(op, da, db, monkeypatch, seed=5)


@pytest.mark.parametrize("op", ["matmul", "linear"])
@pytest.mark.parametrize("via,da", [(v, d) for v, d in itertools.product(["bf16", "f16", "f64", "f8e4m3", "i32"],
                                                                          ["f32", "f64", "bf16", "f16"]) if v != d])
def test_converted_operands(op, via, da, monkeypatch):
    """x.to(via).to(da) @ w: a chain of casts under A, B f32 (the common x_f16.float() @ w)."""
    _check(op, da, "f32", monkeypatch, seed=7, via=via)


def test_bf16_left_operand_of_ones(monkeypatch):
    """The issue's own example gave [[1.0019, 1.0019], [0, 0]] instead of all 2.0."""
    monkeypatch.setenv("DTM_BACKEND", "cpu")
    twos = np.full((2, 2), 2.0, np.float32)
    np.testing.assert_array_equal((dtm.ones(2, 2, dtype=dtm.bfloat16) @ dtm.ones(2, 2)).numpy(), twos)
    np.testing.assert_array_equal((dtm.ones(2, 2, dtype=dtm.bfloat16).to(dtm.float32) @ dtm.ones(2, 2)).numpy(), twos)


def test_only_a_narrow_weight_of_b_is_read_narrow():
    """x_f32 @ W_bf16.T reads W itself (one kernel: the cast is absorbed into c_narrow's
    product), through F.linear as through a quantized Linear; W_bf16 @ x_f32.T computes its
    cast in a kernel of its own, then the product."""
    rng = np.random.default_rng(0)
    x = dtm.tensor(rng.standard_normal((4, 64)).astype(np.float32))
    w = dtm.tensor(rng.standard_normal((32, 64)).astype(numpy_dtype(dtm.bfloat16)))  # a weight, not a computed value
    assert dtm.debug.count_kernels(lambda x: dtm.nn.functional.linear(x, w), x) == 1
    lin = dtm.nn.Linear(64, 32, bias=False)
    dtm.quant.quantize(lin, "bf16")
    assert dtm.debug.count_kernels(lin, x) == 1
    assert dtm.debug.count_kernels(lambda x: w @ x.T, x) == 2
