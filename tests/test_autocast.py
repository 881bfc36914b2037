"""Issue 30, mixed precision: dtm.autocast("cpu", dtype=dtm.bfloat16) as torch's CPU
autocast, and the bf16 x bf16 -> f32 products the cpu compiler sends to the CPU's bf16
instructions (AVX512-BF16's vdpbf16ps; a portable path beside it, dtm.backends.cpu.c_bf16).

- the dtype of each op's result inside and outside the context equals torch's (torch 2.13);
- a small MLP and a GPT-2-shaped block under autocast: values and f32 gradients against
  torch's autocast, eagerly and under dtm.jit, within bf16 tolerances;
- the bf16 product against numpy on the bf16-rounded inputs, shapes odd and even, and the
  kernel the library selects (AVX512-BF16 where the CPU has it) against its portable path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dtm
import dtm.nn.functional as F
from dtm.errors import DTMError
from dtm.runtime.backend import BACKENDS

HAVE_CPU = "cpu" in BACKENDS
TF = torch.nn.functional


@pytest.fixture(params=["ref"] + (["cpu"] if HAVE_CPU else []))
def backend(request, monkeypatch):
    monkeypatch.setenv("DTM_BACKEND", request.param)
    return request.param


def _arr(*shape, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _dtype_name(t) -> str:
    return {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.float64: "f64",
            torch.int64: "i64"}[t.dtype] if isinstance(t, torch.Tensor) else t.dtype.name


# each case: (name, fn(lib, F, *tensors), shapes); lib is torch or dtm
CASES = [
    ("matmul", lambda L, F, a, b: a @ b, [(4, 8), (8, 5)]),
    ("matmul_vec", lambda L, F, a, b: a @ b, [(4, 8), (8,)]),
    ("mm", lambda L, F, a, b: L.matmul(a, b), [(4, 8), (8, 5)]),
    ("bmm", lambda L, F, a, b: L.bmm(a, b), [(2, 4, 8), (2, 8, 5)]),
    ("linear", lambda L, F, x, w, b: F.linear(x, w, b), [(4, 8), (6, 8), (6,)]),
    ("einsum", lambda L, F, a, b: L.einsum("ij,kj->ik", a, b), [(4, 8), (6, 8)]),
    ("sdpa", lambda L, F, q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
     [(1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8)]),
    ("conv1d", lambda L, F, x, w: F.conv1d(x, w), [(1, 3, 10), (4, 3, 3)]),
    ("conv2d", lambda L, F, x, w, b: F.conv2d(x, w, b, padding=1), [(1, 3, 6, 6), (4, 3, 3, 3), (4,)]),
    ("softmax", lambda L, F, x: F.softmax(x, -1), [(4, 8)]),
    ("layer_norm", lambda L, F, x: F.layer_norm(x, (8,)), [(4, 8)]),
    ("gelu", lambda L, F, x: F.gelu(x, approximate="tanh"), [(4, 8)]),
    ("add", lambda L, F, x: x + 1, [(4, 8)]),
    ("sum", lambda L, F, x: x.sum(), [(4, 8)]),
    ("prod", lambda L, F, x: x.prod(), [(4, 8)]),
    ("cross_entropy", lambda L, F, x: F.cross_entropy(x, L.tensor([0, 1, 2, 3])), [(4, 8)]),
    ("mse_loss", lambda L, F, x, y: F.mse_loss(x, y), [(4, 8), (4, 8)]),
    ("l1_loss", lambda L, F, x, y: F.l1_loss(x, y), [(4, 8), (4, 8)]),
    ("bce_logits", lambda L, F, x, y: F.binary_cross_entropy_with_logits(x, y.sigmoid()), [(4, 8), (4, 8)]),
    ("f64_matmul", lambda L, F, a, b: a.double() @ b.double(), [(4, 8), (8, 5)]),
    ("int_matmul", lambda L, F, a, b: a.long() @ b.long(), [(4, 8), (8, 5)]),
    ("linear_then_add", lambda L, F, x, w: F.linear(x, w) + x[:, :6], [(4, 8), (6, 8)]),
    ("linear_then_ln", lambda L, F, x, w: F.layer_norm(F.linear(x, w), (6,)), [(4, 8), (6, 8)]),
    ("linear_then_ce", lambda L, F, x, w: F.cross_entropy(F.linear(x, w), L.tensor([0, 1, 2, 3])),
     [(4, 8), (6, 8)]),
]


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("name,fn,shapes", CASES, ids=[c[0] for c in CASES])
def test_result_dtypes_equal_torchs(name, fn, shapes, dtype, monkeypatch):
    """The dtype of each op's result under autocast (and outside it) is torch's."""
    monkeypatch.setenv("DTM_BACKEND", "ref")  # dtypes only: nothing needs compiling
    arrays = [_arr(*s, seed=i) for i, s in enumerate(shapes)]
    tdt, ddt = {"bf16": (torch.bfloat16, dtm.bfloat16), "f16": (torch.float16, dtm.float16)}[dtype]
    for enabled in (True, False):
        with torch.autocast("cpu", dtype=tdt, enabled=enabled):
            want = fn(torch, TF, *[torch.from_numpy(a) for a in arrays])
        with dtm.autocast("cpu", dtype=ddt, enabled=enabled):
            got = fn(dtm, F, *[dtm.tensor(a) for a in arrays])
        assert _dtype_name(got) == _dtype_name(want), (name, enabled)
    # outside every context: as without autocast
    assert _dtype_name(fn(dtm, F, *[dtm.tensor(a) for a in arrays])) == _dtype_name(
        fn(torch, TF, *[torch.from_numpy(a) for a in arrays]))


def test_context_nests_restores_and_decorates():
    x = dtm.ones(2, 2)
    with dtm.autocast("cpu"):
        assert (x @ x).dtype is dtm.bfloat16
        with dtm.autocast("cpu", enabled=False):
            assert (x @ x).dtype is dtm.float32
        with dtm.cpu.amp.autocast(dtype=dtm.float16):
            assert (x @ x).dtype is dtm.float16
        assert (x @ x).dtype is dtm.bfloat16 and dtm.is_autocast_enabled()
    assert (x @ x).dtype is dtm.float32 and not dtm.is_autocast_enabled()

    @dtm.amp.autocast("cpu", dtype=dtm.bfloat16)
    def f(a):
        return a @ a
    assert f(x).dtype is dtm.bfloat16 and (x @ x).dtype is dtm.float32
    with pytest.raises(DTMError, match="device_type"):
        dtm.autocast("cuda")
    with pytest.raises(DTMError, match="bfloat16 and float16"):
        dtm.autocast("cpu", dtype=dtm.float64)


# --- models against torch's autocast ---------------------------------------------------------

def _close(got, want, rel: float, what: str) -> None:
    got = got.numpy().astype(np.float64) if isinstance(got, dtm.Tensor) else np.asarray(got, np.float64)
    want = want.detach().float().numpy().astype(np.float64) if isinstance(want, torch.Tensor) else np.asarray(want)
    assert got.shape == want.shape, what
    err = np.abs(got - want).max()
    assert err <= rel * max(np.abs(want).max(), 1e-3), f"{what}: max error {err}, scale {np.abs(want).max()}"


def _mlp(L, F, x, w1, b1, w2, b2, y):
    h = F.gelu(F.linear(x, w1, b1), approximate="tanh")
    return F.cross_entropy(F.linear(h, w2, b2), y)


def _block(L, F, x, ln1w, ln1b, wqkv, bqkv, wo, bo, ln2w, ln2b, w1, b1, w2, b2, y, heads=2):
    B, T, C = x.shape
    h = F.layer_norm(x, (C,), ln1w, ln1b)
    q, k, v = F.linear(h, wqkv, bqkv).split(C, dim=2)
    q, k, v = (t.reshape(B, T, heads, C // heads).transpose(1, 2) for t in (q, k, v))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
    x = x + F.linear(a, wo, bo)
    m = F.linear(F.gelu(F.linear(F.layer_norm(x, (C,), ln2w, ln2b), w1, b1), approximate="tanh"), w2, b2)
    x = x + m
    return F.cross_entropy(x.reshape(B * T, C), y.reshape(-1))


def _params_mlp():
    return [_arr(16, 12, seed=1), _arr(32, 12, seed=2, scale=0.3), _arr(32, seed=3, scale=0.1),
            _arr(10, 32, seed=4, scale=0.3), _arr(10, seed=5, scale=0.1)], np.arange(16) % 10


def _params_block():
    C = 32
    rng = np.random.default_rng(7)
    ws = [_arr(2, 8, C, seed=1), 1 + 0.1 * _arr(C, seed=2), 0.1 * _arr(C, seed=3), _arr(3 * C, C, seed=4, scale=0.2),
          _arr(3 * C, seed=5, scale=0.1), _arr(C, C, seed=6, scale=0.2), _arr(C, seed=7, scale=0.1),
          1 + 0.1 * _arr(C, seed=8), 0.1 * _arr(C, seed=9), _arr(4 * C, C, seed=10, scale=0.2),
          _arr(4 * C, seed=11, scale=0.1), _arr(C, 4 * C, seed=12, scale=0.1), _arr(C, seed=13, scale=0.1)]
    return ws, rng.integers(0, C, (2, 8))


@pytest.mark.parametrize("model", ["mlp", "block"])
@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_model_values_and_grads_match_torch_autocast(model, jitted, backend):
    fn, (arrays, target) = {"mlp": (_mlp, _params_mlp()), "block": (_block, _params_block())}[model]
    # torch
    tp = [torch.from_numpy(a.copy()).requires_grad_(i > 0) for i, a in enumerate(arrays)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tloss = fn(torch, TF, *tp, torch.from_numpy(target))
    tloss.backward()
    # dtm
    dp = [dtm.tensor(a, requires_grad=i > 0) for i, a in enumerate(arrays)]

    def step(x, y):
        with dtm.autocast("cpu", dtype=dtm.bfloat16):
            loss = fn(dtm, F, x, *dp[1:], y)
        loss.backward()
        return loss

    run = dtm.jit(step) if jitted else step
    loss = run(dp[0], dtm.tensor(target))
    assert loss.dtype is dtm.float32 and tloss.dtype is torch.float32
    _close(loss, tloss, 2e-2, "loss")
    for i, (d, t) in enumerate(zip(dp[1:], tp[1:])):
        assert d.grad is not None and d.grad.dtype is dtm.float32, i  # f32 master weights get f32 gradients
        _close(d.grad, t.grad, 6e-2, f"grad {i}")


def test_jit_traces_again_outside_the_context(monkeypatch):
    monkeypatch.setenv("DTM_BACKEND", "cpu" if HAVE_CPU else "ref")
    f = dtm.jit(lambda a, b: a @ b)
    a, b = dtm.tensor(_arr(4, 8)), dtm.tensor(_arr(8, 3, seed=1))
    with dtm.autocast("cpu"):
        assert f(a, b).dtype is dtm.bfloat16
    assert f(a, b).dtype is dtm.float32


# --- the bf16 product --------------------------------------------------------------------------

def _bf16(a: np.ndarray) -> np.ndarray:
    import ml_dtypes
    return a.astype(ml_dtypes.bfloat16)


GEMM_SHAPES = [(1, 7, 5), (3, 5, 4), (2, 1, 3), (17, 33, 19), (64, 128, 96), (13, 300, 257), (100, 65, 300),
               (257, 40, 31)]


def _plan_source(fn, *args) -> str:
    from dtm.backends.cpu.passes import compile_func
    module = dtm.jit(fn).ir(*args)
    program = compile_func(module, "main")
    return "\n".join(step.source for step in program.kernels)


@pytest.mark.skipif(not HAVE_CPU, reason="no C compiler: no cpu backend")
@pytest.mark.parametrize("m,k,n", GEMM_SHAPES)
@pytest.mark.parametrize("layout", ["nn", "nt", "tn"])
def test_bf16_product_against_numpy(m, k, n, layout, monkeypatch):
    """bf16 x bf16 with f32 sums against numpy in f64 on the same bf16 values: the f32
    result read as f32, and the bf16 result (the product rounded once)."""
    monkeypatch.setenv("DTM_BACKEND", "cpu")
    a32, b32 = _arr(m, k, seed=m), _arr(k, n, seed=n + 1)
    a16, b16 = _bf16(a32), _bf16(b32)
    want = a16.astype(np.float64) @ b16.astype(np.float64)
    if layout == "nn":
        fn, args = (lambda a, b: a.float() @ b.float()), (a16, b16)
    elif layout == "nt":  # B a Linear's weight: columns contiguous
        fn, args = (lambda a, w: F.linear(a.float(), w.float())), (a16, np.ascontiguousarray(b16.T))
    else:  # A transposed (a weight's gradient, X^T @ dY)
        fn, args = (lambda at, b: at.float().T @ b.float()), (np.ascontiguousarray(a16.T), b16)
    targs = [dtm.tensor(x) for x in args]
    got = fn(*targs).numpy().astype(np.float64)
    tol = 1e-5 * np.sqrt(k) * np.abs(a16.astype(np.float64)) @ np.abs(b16.astype(np.float64)) + 1e-30
    assert (np.abs(got - want) <= tol).all()
    if layout == "nn":
        assert "dtm_rt_gemm_bf16" in _plan_source(fn, *targs)
        r16 = (targs[0] @ targs[1]).numpy()  # bf16 @ bf16 -> bf16: f32 sums rounded once
        np.testing.assert_allclose(r16.astype(np.float64), _bf16(want.astype(np.float32)).astype(np.float64),
                                   rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not HAVE_CPU, reason="no C compiler: no cpu backend")
def test_batched_and_broadcast_bf16_products(monkeypatch):
    monkeypatch.setenv("DTM_BACKEND", "cpu")
    a16, b16, w16 = _bf16(_arr(3, 2, 17, 40)), _bf16(_arr(3, 2, 40, 9, seed=1)), _bf16(_arr(40, 9, seed=2))
    got = (dtm.tensor(a16).float() @ dtm.tensor(b16).float()).numpy()
    np.testing.assert_allclose(got, a16.astype(np.float64) @ b16.astype(np.float64), rtol=1e-5, atol=1e-4)
    got = (dtm.tensor(a16).float() @ dtm.tensor(w16).float()).numpy()
    np.testing.assert_allclose(got, a16.astype(np.float64) @ w16.astype(np.float64), rtol=1e-5, atol=1e-4)


def _cpu_has(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(flag in line.split() for line in f if line.startswith("flags"))
    except OSError:
        return False


@pytest.mark.skipif(not HAVE_CPU, reason="no C compiler: no cpu backend")
def test_bf16_kernel_selected_and_portable_path_agrees(monkeypatch):
    """Where the CPU has AVX512-BF16 (and the compiler offers it) the library runs
    vdpbf16ps; the portable path, forced, gives the same sums (the products of two bf16 are
    exact in f32, and both paths add the pair of a 32-bit lane in the same order)."""
    from dtm import toolchain
    from dtm.backends.cpu import build
    monkeypatch.setenv("DTM_BACKEND", "cpu")
    native = build.bf16_kernel()
    if _cpu_has("avx512_bf16") and toolchain.compiler_offers("avx512bf16"):
        assert native == "avx512bf16"
    else:
        assert native == "portable"
    a16, b16 = _bf16(_arr(70, 1031, seed=3)), _bf16(_arr(1031, 45, seed=4))  # K odd, past one KC
    f = dtm.jit(lambda a, b: a.float() @ b.float())
    args = [dtm.tensor(a16), dtm.tensor(b16)]
    fast = f(*args).numpy()
    with build.bf16_forced("portable"):
        assert build.bf16_kernel() == "portable"
        slow = f(*args).numpy()
    assert build.bf16_kernel() == native
    np.testing.assert_array_equal(fast, slow)
    np.testing.assert_allclose(fast, a16.astype(np.float64) @ b16.astype(np.float64), rtol=1e-5, atol=1e-4)
