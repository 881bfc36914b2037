"""The names of issue 16 that the op table (test_tensor_ops.py) cannot hold: creation
(linspace, empty, randint), Generator and `generator=`, multinomial (statistically, with a
fixed seed), grad modes, dtm.autograd.grad against torch.autograd.grad, Tensor.type,
copy.deepcopy, sort's stability and NaNs, and the errors bad input raises at the user's line."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import dtm
import dtm.runtime.backend

BACKENDS = ["ref"] + (["cpu"] if "cpu" in dtm.runtime.backend.BACKENDS else [])


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("DTM_BACKEND", request.param)
    return request.param


def code_of(fn) -> str:
    with pytest.raises(dtm.DTMError) as e:
        fn()
    assert "test_torch_names.py" in str(e.value), "the error is reported at the caller's line"
    return e.value.code.value


# --- creation -----------------------------------------------------------------------------

@pytest.mark.parametrize("start,end,steps", [(0, 1, 7), (-3.3, 10.1, 50), (5, -5, 11), (2.5, 2.5, 3), (1, 4, 1),
                                             (0, 1, 0)])
@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_linspace_matches_torch(start, end, steps, dtype):
    td = {"f32": torch.float32, "f64": torch.float64}[dtype]
    got = dtm.linspace(start, end, steps, dtype=dtype)
    want = torch.linspace(start, end, steps, dtype=td).numpy()
    assert got.dtype.name == dtype and got.shape == want.shape
    # torch's vectorised loop steps lane by lane: its middle values may be an ulp or two (of
    # the ends' magnitude) off the formula
    eps = np.finfo(want.dtype).eps * max(abs(start), abs(end))
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=4 * eps)
    if steps > 1:
        assert got.numpy()[0] == want[0] and got.numpy()[-1] == want[-1]


def test_linspace_int_and_default_dtype():
    assert dtm.linspace(0, 1, 5).dtype is dtm.float32
    np.testing.assert_array_equal(dtm.linspace(0, 10, 4, dtype=dtm.int64).numpy(),
                                  torch.linspace(0, 10, 4, dtype=torch.int64).numpy())


def test_empty():
    e = dtm.empty(2, 3)
    assert e.shape == (2, 3) and e.dtype is dtm.float32
    assert dtm.empty((4,), dtype=dtm.int64).dtype is dtm.int64
    assert dtm.empty(2, requires_grad=True).requires_grad


def test_randint_range_dtype_and_forms():
    dtm.manual_seed(0)
    x = dtm.randint(-3, 5, (2000,))
    assert x.dtype is dtm.int64 and x.shape == (2000,)
    v = x.numpy()
    assert v.min() == -3 and v.max() == 4  # every value of [low, high) drawn, nothing outside
    counts = np.bincount(v + 3, minlength=8)
    assert counts.min() > 2000 / 8 * 0.7 and counts.max() < 2000 / 8 * 1.3
    y = dtm.randint(10, (3, 4), dtype=dtm.int32)
    assert y.shape == (3, 4) and y.dtype is dtm.int32 and 0 <= y.numpy().min() and y.numpy().max() < 10
    assert code_of(lambda: dtm.randint(5, 5, (2,))) == "E0306"


def test_generator_is_reproducible_and_independent():
    g = dtm.Generator().manual_seed(7)
    a = dtm.randn(5, generator=g).numpy()
    b = dtm.randn(5, generator=g).numpy()
    assert not np.array_equal(a, b)
    assert g.initial_seed() == 7
    g.manual_seed(7)
    np.testing.assert_array_equal(dtm.randn(5, generator=g).numpy(), a)
    state = g.get_state()
    r1 = dtm.rand(3, generator=g).numpy()
    g.set_state(state)
    np.testing.assert_array_equal(dtm.rand(3, generator=g).numpy(), r1)
    # a generator seeded like the default one draws what the default one would
    dtm.manual_seed(7)
    np.testing.assert_array_equal(dtm.randn(5).numpy(), a)
    # and drawing from g leaves the default generator's sequence alone
    dtm.manual_seed(1)
    want = dtm.randint(0, 100, (4,)).numpy()
    dtm.manual_seed(1)
    dtm.randint(0, 100, (4,), generator=dtm.Generator().manual_seed(3))
    np.testing.assert_array_equal(dtm.randint(0, 100, (4,)).numpy(), want)
    assert isinstance(dtm.manual_seed(3), dtm.Generator)


# --- multinomial --------------------------------------------------------------------------

def test_multinomial_with_replacement_follows_the_weights(backend):
    w = dtm.tensor([[1.0, 0.0, 3.0, 6.0], [5.0, 5.0, 0.0, 0.0]])
    s = dtm.multinomial(w, 4000, replacement=True, generator=dtm.Generator().manual_seed(0))
    assert s.dtype is dtm.int64 and s.shape == (2, 4000)
    v = s.numpy()
    for row, weights in zip(v, w.numpy()):
        freq = np.bincount(row, minlength=4) / row.size
        p = weights / weights.sum()
        np.testing.assert_array_equal(freq[p == 0], 0)  # zero weight: never drawn
        sigma = np.sqrt(p * (1 - p) / row.size)
        assert np.all(np.abs(freq - p) <= 5 * sigma + 1e-12), (freq, p)


def test_multinomial_without_replacement(backend):
    w = dtm.tensor([0.5, 0.0, 0.25, 0.25, 1.0])
    g = dtm.Generator().manual_seed(1)
    draws = np.stack([dtm.multinomial(w, 4, generator=g).numpy() for _ in range(600)])
    assert draws.shape == (600, 4)
    for d in draws:
        assert len(set(d.tolist())) == 4 and 1 not in d  # distinct, and the zero weight only when forced
    # the first draw follows the weights; the second, the weights left (as torch draws)
    p = np.array([0.5, 0.0, 0.25, 0.25, 1.0]) / 2.0
    first = np.bincount(draws[:, 0], minlength=5) / len(draws)
    assert np.all(np.abs(first - p) <= 5 * np.sqrt(p * (1 - p) / len(draws)) + 1e-12), first
    # with torch: the same statistics from torch's own sampler
    torch.manual_seed(0)
    t = np.stack([torch.multinomial(torch.tensor([0.5, 0.0, 0.25, 0.25, 1.0]), 4).numpy() for _ in range(600)])
    for pos in range(2):
        ours, theirs = (np.bincount(a[:, pos], minlength=5) / 600 for a in (draws, t))
        assert np.abs(ours - theirs).max() < 0.1, (pos, ours, theirs)
    assert code_of(lambda: dtm.multinomial(w, 6)) == "E0306"
    assert code_of(lambda: dtm.multinomial(dtm.tensor([1, 2]), 1)) == "E0402"


# --- sort ---------------------------------------------------------------------------------

@pytest.mark.parametrize("descending", [False, True])
def test_sort_is_stable_and_puts_nan_as_torch(backend, descending):
    x = np.array([[3.0, 1.0, np.nan, 1.0, -np.inf, 3.0, 0.0, -0.0]], np.float32)
    v, i = dtm.sort(dtm.tensor(x), descending=descending)
    tv, ti = torch.sort(torch.tensor(x), descending=descending, stable=True)
    np.testing.assert_array_equal(v.numpy(), tv.numpy())
    np.testing.assert_array_equal(i.numpy(), ti.numpy())
    tk = dtm.tensor(x).topk(3, largest=descending)
    np.testing.assert_array_equal(tk.values.numpy(), torch.tensor(x).topk(3, largest=descending).values.numpy())


def test_topk_of_a_vocabulary_and_errors(backend):
    logits = np.random.default_rng(0).standard_normal((2, 5000)).astype(np.float32)
    # a slice of a sort along other dims sorts only that part (the compiler sinks slices)
    np.testing.assert_array_equal(dtm.argsort(dtm.tensor(logits), -1)[1:].numpy(),
                                  np.argsort(logits[1:], -1, kind="stable"))
    v, i = dtm.tensor(logits).topk(40)
    tv, ti = torch.tensor(logits).topk(40)
    np.testing.assert_array_equal(v.numpy(), tv.numpy())
    np.testing.assert_array_equal(i.numpy(), ti.numpy())
    assert code_of(lambda: dtm.tensor(logits).topk(5001)) == "E0306"


def test_sort_inside_jit():
    f = dtm.jit(lambda x: x.topk(2).indices)
    x = dtm.tensor([[1.0, 5.0, 3.0], [9.0, 0.0, 4.0]])
    np.testing.assert_array_equal(f(x).numpy(), [[1, 2], [0, 2]])


# --- grad modes and autograd.grad ---------------------------------------------------------

def test_grad_modes_nest_and_decorate():
    w = dtm.ones(2, requires_grad=True)
    with dtm.no_grad():
        assert not (w * 2).requires_grad
        with dtm.enable_grad():
            assert (w * 2).requires_grad
        assert not dtm.is_grad_enabled()
    assert dtm.is_grad_enabled()
    with dtm.inference_mode():
        assert not (w * 2).requires_grad
    with dtm.inference_mode(False):
        assert (w * 2).requires_grad

    @dtm.no_grad
    def bare(a):
        return a * 2

    @dtm.enable_grad()
    def called(a):
        return a * 2

    assert bare.__name__ == "bare" and not bare(w).requires_grad
    with dtm.no_grad():
        assert called(w).requires_grad
    assert dtm.autograd.no_grad is dtm.no_grad and dtm.autograd.enable_grad is dtm.enable_grad


def _pair(shape, seed):
    a = np.random.default_rng(seed).standard_normal(shape)
    return dtm.tensor(a, requires_grad=True), torch.tensor(a, requires_grad=True)


def test_autograd_grad_matches_torch(backend):
    (x, tx), (w, tw) = _pair((3, 4), 0), _pair((4, 2), 1)
    h, th = (x @ w).tanh(), (tx @ tw).tanh()
    gx, gw = dtm.autograd.grad((h * h).sum(), [x, w], retain_graph=True)
    tgx, tgw = torch.autograd.grad((th * th).sum(), [tx, tw], retain_graph=True)
    np.testing.assert_allclose(gx.numpy(), tgx.numpy(), rtol=1e-10)
    np.testing.assert_allclose(gw.numpy(), tgw.numpy(), rtol=1e-10)
    assert x.grad is None and w.grad is None and not gx.requires_grad  # nothing accumulated
    # with respect to an intermediate, with grad_outputs, several outputs
    ct = np.random.default_rng(2).standard_normal((3, 2))
    (gh,) = dtm.autograd.grad([h.exp(), h.sum()], h, grad_outputs=[dtm.tensor(ct), None])
    (tgh,) = torch.autograd.grad([th.exp(), th.sum()], th, grad_outputs=[torch.tensor(ct), None])
    np.testing.assert_allclose(gh.numpy(), tgh.numpy(), rtol=1e-10)


def test_autograd_grad_create_graph_gives_second_derivatives(backend):
    (x, tx) = _pair((5,), 3)
    (g,) = dtm.autograd.grad((x ** 3).sum(), x, create_graph=True)
    (tg,) = torch.autograd.grad((tx ** 3).sum(), tx, create_graph=True)
    assert g.requires_grad
    np.testing.assert_allclose(g.numpy(), tg.detach().numpy(), rtol=1e-10)
    (gg,) = dtm.autograd.grad(g.sum(), x)
    (tgg,) = torch.autograd.grad(tg.sum(), tx)
    np.testing.assert_allclose(gg.numpy(), tgg.numpy(), rtol=1e-10)
    # a gradient penalty: backward() through the gradient
    x.grad = None
    (g2,) = dtm.autograd.grad((x.sin() * x).sum(), x, create_graph=True)
    (tg2,) = torch.autograd.grad((tx.sin() * tx).sum(), tx, create_graph=True)
    (g2 * g2).sum().backward()
    (tg2 * tg2).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-9)


def test_autograd_grad_stops_at_no_grad_values():
    w = dtm.tensor([1.0, 2.0], requires_grad=True)
    with dtm.no_grad():
        c = w * 3
    (g,) = dtm.autograd.grad((w * c).sum(), w)
    np.testing.assert_array_equal(g.numpy(), [3.0, 6.0])  # c is a constant, as in torch


def test_autograd_grad_inside_jit():
    w = dtm.tensor([1.0, 2.0, 3.0], requires_grad=True)

    @dtm.jit
    def step(x):
        (g,) = dtm.autograd.grad(((w * x) ** 2).sum(), w)
        return g

    for k in (1.0, 2.0):
        x = dtm.tensor([k, -k, 0.5])
        np.testing.assert_allclose(step(x).numpy(), 2 * w.numpy() * x.numpy() ** 2, rtol=1e-6)
    assert w.grad is None


def test_autograd_grad_errors_unused_and_freed_graph():
    x, _ = _pair((3,), 4)
    y, _ = _pair((3,), 5)
    loss = (x * 2).sum()
    assert code_of(lambda: dtm.autograd.grad(loss, [x, y])) == "E0306"
    gx, gy = dtm.autograd.grad(loss, [x, y], allow_unused=True, retain_graph=True)
    np.testing.assert_array_equal(gx.numpy(), [2.0, 2.0, 2.0])
    assert gy is None
    assert code_of(lambda: dtm.autograd.grad(x * 2, x)) == "E0403"  # a non-scalar needs grad_outputs
    inner = x.exp()
    out = inner.sum()
    dtm.autograd.grad(out, x)
    assert code_of(lambda: dtm.autograd.grad(out, x)) == "E0807"  # freed, as backward() frees it


# --- Tensor.type, deepcopy, errors --------------------------------------------------------

def test_type_method():
    x = dtm.tensor([1.5, -2.0])
    assert x.type() == "dtm.FloatTensor"
    assert x.type(dtm.float64).dtype is dtm.float64
    assert x.type("torch.IntTensor").dtype is dtm.int32
    assert x.long().type() == "dtm.LongTensor" and (x > 0).type() == "dtm.BoolTensor"
    assert x.type(x.double().type()).dtype is dtm.float64


def test_deepcopy_of_tensors_and_modules():
    t = dtm.tensor([1.0, 2.0], requires_grad=True)
    (t * t).sum().backward()
    c = copy.deepcopy(t)
    assert c.requires_grad and c.is_leaf
    np.testing.assert_array_equal(c.grad.numpy(), [2.0, 4.0])
    with dtm.no_grad():
        c[0] = 9.0
    assert t.numpy()[0] == 1.0
    assert code_of(lambda: copy.deepcopy(t * 2)) == "E0306"  # only leaves, as in torch
    m = dtm.nn.Sequential(dtm.nn.Linear(3, 2), dtm.nn.ReLU())
    m2 = copy.deepcopy(m)
    for (n1, p1), (n2, p2) in zip(m.named_parameters(), m2.named_parameters()):
        assert n1 == n2 and type(p2) is dtm.nn.Parameter and p2.requires_grad and p1 is not p2
        np.testing.assert_array_equal(p1.numpy(), p2.numpy())
    with dtm.no_grad():
        next(m2.parameters())[0, 0] = 100.0
    assert next(m.parameters()).numpy()[0, 0] != 100.0
    m2(dtm.ones(1, 3)).sum().backward()
    assert next(m2.parameters()).grad is not None and next(m.parameters()).grad is None


def test_errors():
    a = dtm.ones(2, 3)
    assert code_of(lambda: dtm.bmm(a, a)) == "E0406"
    assert code_of(lambda: dtm.bmm(dtm.ones(2, 3, 4), dtm.ones(3, 4, 5))) == "E0403"
    assert code_of(lambda: dtm.outer(a, a)) == "E0406"
    assert code_of(lambda: dtm.einsum("ij,jk->ik", a, a)) == "E0403"
    assert code_of(lambda: dtm.einsum("ij->ik", a)) == "E0306"
    assert code_of(lambda: dtm.einsum("ijk->i", a)) == "E0406"
    assert code_of(lambda: dtm.einsum("ij,jk->ik", a)) == "E0302"
    assert code_of(lambda: dtm.norm(dtm.ones(3, dtype=dtm.int64))) == "E0402"
    assert code_of(lambda: a.repeat(2)) == "E0406"


def test_allclose_and_isnan():
    a = dtm.tensor([1.0, float("nan"), float("inf")])
    assert dtm.allclose(a, a, equal_nan=True) and not dtm.allclose(a, a)
    assert dtm.allclose(dtm.tensor([1.0, 2.0]), dtm.tensor([1.0, 2.0 + 1e-6]))
    assert not dtm.allclose(dtm.tensor([1.0]), dtm.tensor([1.1]))
    assert dtm.allclose(dtm.tensor([1.0]), 1.05, rtol=0.1) is True
    np.testing.assert_array_equal(dtm.isnan(a).numpy(), [False, True, False])
    assert not dtm.isnan(dtm.tensor([1, 2])).any().item()
