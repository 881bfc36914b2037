"""Kernels that differ only in integer literals share one C function (dtm/compiler/share.py).
Results are checked against numpy."""

from __future__ import annotations

import numpy as np

import dtm
from dtm import functional as F
from dtm.backends.cpu.build import _anonymous
from dtm.backends.cpu.passes import compile_func

rng = np.random.default_rng(7)


def T(*shape):
    return dtm.tensor(rng.standard_normal(shape).astype(np.float32))


def np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def two_softmaxes(a, b):
    return F.softmax(a, -1), F.softmax(b, -1)


def test_kernels_that_differ_only_in_extents_share_one_function():
    a, b = T(8, 16), T(8, 40)
    program = compile_func(dtm.jit(two_softmaxes).ir(a, b), "main")
    k0, k1 = (s.kernel for s in program.kernels)
    assert len({_anonymous(s.cfunc) for s in program.kernels}) == 1
    assert k0.body is k1.body and k0.dims == k1.dims == ["dtm_c0", "dtm_c1"]
    # the row width (every use of it is one argument) and the work estimate differ; the row count agrees
    assert (k0.consts, k1.consts) == ({"dtm_c0": 16, "dtm_c1": 640}, {"dtm_c0": 40, "dtm_c1": 1600})
    assert "i0 < 8;" in program.kernels[0].cfunc.code and "i1 < dtm_c0;" in program.kernels[0].cfunc.code
    got = dtm.jit(two_softmaxes, backend="cpu")(a, b)
    for g, x in zip(got, (a, b)):
        np.testing.assert_allclose(g.numpy(), np_softmax(x.numpy()), rtol=1e-5, atol=1e-6)


def test_a_kernel_alone_keeps_its_literals():
    program = compile_func(dtm.jit(lambda a: F.softmax(a, -1)).ir(T(8, 16)), "main")
    (step,) = program.kernels
    assert step.kernel.dims == [] and not step.kernel.consts and "i1 < 16;" in step.cfunc.code


def test_a_divisor_is_never_an_argument():
    # flat index arithmetic divides by the permuted extents: kernels that differ there stay apart
    def f(x, y):
        return (x.permute(2, 0, 1) * 2).reshape(-1, 4), (y.permute(2, 0, 1) * 2).reshape(-1, 4)

    x, y = T(4, 6, 8), T(4, 10, 8)
    program = compile_func(dtm.jit(f).ir(x, y), "main")
    assert len({_anonymous(s.cfunc) for s in program.kernels}) == 2
    assert all(not s.kernel.consts for s in program.kernels)
    got = dtm.jit(f, backend="cpu")(x, y)
    for g, v in zip(got, (x, y)):
        np.testing.assert_array_equal(g.numpy(), (v.numpy().transpose(2, 0, 1) * 2).reshape(-1, 4))


def test_a_shared_product_epilogue_reads_its_arguments():
    # products of different extents with a bias and GELU in their epilogues: one function
    def f(x1, w1, b1, x2, w2, b2):
        return F.gelu(x1 @ w1 + b1), F.gelu(x2 @ w2 + b2)

    args = (T(16, 32), T(32, 48), T(48), T(24, 32), T(32, 80), T(80))
    program = compile_func(dtm.jit(f).ir(*args), "main")
    assert len(program.kernels) == 2 and len({_anonymous(s.cfunc) for s in program.kernels}) == 1
    assert program.kernels[0].kernel.consts
    got = dtm.jit(f, backend="cpu")(*args)
    want = dtm.jit(f, backend="ref")(*args)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-4, atol=1e-5)
