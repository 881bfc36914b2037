"""Issue 30: autograd refuses a value changed in place after an op saved it for its gradient,
as torch's version counter does (dtm/tensor/versions.py).

DTM is lazy: an op recorded before an in-place write keeps reading a snapshot of the old
value, so DTM could compute a gradient; torch refuses instead, and so does DTM, at
backward(). Every case runs the same code on torch and on DTM (`M` is the module): both
refuse, or both give the same gradients. The generated set crosses the ops (those whose
gradient reads an operand, those that save their result, those that save nothing) with
the tensor written (the result, either operand, a leaf under no_grad), which operands
require grad, and the in-place write used."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import dtm
from dtm.errors import DTMError, ErrorCode

PHRASE = "modified by an inplace operation"
# DTM's refusal of a tensor with gradient history written outside autograd (detach(), .data,
# no_grad), where torch lets the gradient through as if it had not changed
CUT = "under no_grad, or through .data or detach()"


@pytest.fixture(autouse=True)
def _ref_backend(monkeypatch):
    """The check is the front end's: the reference backend runs the few programs fastest."""
    monkeypatch.setenv("DTM_BACKEND", "ref")


def nn_f(M):
    return M.nn.functional


# producer name -> (out = fn(M, x, w), shape of w): x is f32[3, 4], values in [0.5, 1.5)
PRODUCERS = {
    # the result is saved
    "sigmoid": lambda M, x, w: x.sigmoid(), "exp": lambda M, x, w: x.exp(), "tanh": lambda M, x, w: x.tanh(),
    "relu": lambda M, x, w: x.relu(), "sqrt": lambda M, x, w: x.sqrt(), "rsqrt": lambda M, x, w: x.rsqrt(),
    "reciprocal": lambda M, x, w: x.reciprocal(), "softmax": lambda M, x, w: x.softmax(-1),
    "log_softmax": lambda M, x, w: x.log_softmax(-1), "nn.relu": lambda M, x, w: nn_f(M).relu(x),
    "F.softmax": lambda M, x, w: nn_f(M).softmax(x, dim=0),
    # an operand is saved
    "log": lambda M, x, w: x.log(), "sin": lambda M, x, w: x.sin(), "cos": lambda M, x, w: x.cos(),
    "abs": lambda M, x, w: x.abs(), "erf": lambda M, x, w: x.erf(), "gelu": lambda M, x, w: nn_f(M).gelu(x),
    "silu": lambda M, x, w: nn_f(M).silu(x), "pow3": lambda M, x, w: x ** 3, "pow2": lambda M, x, w: x ** 2,
    "pow_tensor": lambda M, x, w: x ** w, "clamp": lambda M, x, w: x.clamp(0.7, 1.2),
    "clamp_min": lambda M, x, w: x.clamp(min=0.9), "mul": lambda M, x, w: x * w, "div": lambda M, x, w: x / w,
    "matmul": lambda M, x, w: x @ w.T, "linear": lambda M, x, w: nn_f(M).linear(x, w),
    "maximum": lambda M, x, w: M.maximum(x, w), "minimum": lambda M, x, w: M.minimum(x, w),
    "amax": lambda M, x, w: x.amax(-1), "max_all": lambda M, x, w: x.max(), "prod": lambda M, x, w: x.prod(-1),
    "var": lambda M, x, w: x.var(-1), "std": lambda M, x, w: x.std(-1),
    "layer_norm": lambda M, x, w: nn_f(M).layer_norm(x, (4,), w[0], w[1]),
    "layer_norm_plain": lambda M, x, w: nn_f(M).layer_norm(x, (4,)),
    "remainder": lambda M, x, w: x % w,
    "sdpa": lambda M, x, w: nn_f(M).scaled_dot_product_attention(x[None], w[None], w[None])[0],
    # nothing (or only an index, a mask, a constant) is saved
    "add": lambda M, x, w: x + w, "sub": lambda M, x, w: x - w, "add_scalar": lambda M, x, w: x + 1,
    "mul_scalar": lambda M, x, w: x * 2, "div_scalar": lambda M, x, w: x / 4, "neg": lambda M, x, w: -x,
    "sum": lambda M, x, w: x.sum(), "mean": lambda M, x, w: x.mean(-1), "cumsum": lambda M, x, w: x.cumsum(-1),
    "max_dim": lambda M, x, w: x.max(-1)[0], "where": lambda M, x, w: M.where(x > 1, x, w),
    "masked_fill": lambda M, x, w: x.masked_fill(w > 1, 0.0), "transpose": lambda M, x, w: x.t(),
    "reshape": lambda M, x, w: x.reshape(2, 6), "slice": lambda M, x, w: x[1:], "cat": lambda M, x, w: M.cat([x, w]),
    "index_select": lambda M, x, w: x.index_select(0, M.tensor([2, 0])),
    "index": lambda M, x, w: x[M.tensor([2, 0, 2])], "embedding": lambda M, x, w: nn_f(M).embedding(M.tensor([1, 1]), x),
    "cross_entropy": lambda M, x, w: nn_f(M).cross_entropy(x, M.tensor([0, 3, 1])),
    "gather": lambda M, x, w: x.gather(1, M.tensor([[0, 1], [2, 3], [1, 1]])),  # torch's saves x, unlike indexing
    "norm": lambda M, x, w: x.norm(),
}
# Ops DTM computes from others than torch does, so that what their gradient reads differs:
# DTM gives the gradient of the program as written (the snapshot), torch refuses.
KNOWN = {
    "norm": "DTM's norm is sqrt(sum(x * x)): its gradient reads no saved x or result",
}


def _write(M, t, how: str, leaf: bool) -> None:
    with M.no_grad() if leaf else torch.enable_grad():
        if how == "add_":
            t.add_(0.5)
        elif how == "mul_":
            t.mul_(2)
        elif how == "iadd":
            t += 1
        elif how == "view":  # through a view, which shares the base's version
            t.view(-1)[0] = 2.0
        elif how == "copy_":
            t.copy_(t * 3)
        elif how == "detach":  # detach() shares storage and version, unlike .data
            t.detach().zero_()


WRITES = ["add_", "mul_", "iadd", "view", "copy_", "detach"]


def run(M, producer: str, target: str, kind: str, grads: str, how: str):
    """What (out, a.grad, b.grad) are, or "refused"."""
    rng = np.random.default_rng(0)
    a_np = rng.uniform(0.5, 1.5, (3, 4)).astype(np.float32)
    b_np = rng.uniform(0.5, 1.5, (3, 4)).astype(np.float32)
    a = M.tensor(a_np, requires_grad="x" in grads)
    b = M.tensor(b_np, requires_grad="w" in grads)
    x, w = (a, b) if kind == "leaf" else (a * 1.0, b * 1.0)
    out = PRODUCERS[producer](M, x, w)
    t = {"out": out, "x": x, "w": w}[target]
    _write(M, t, how, leaf=kind == "leaf" and target != "out")
    if not out.requires_grad:
        return "no grad"
    try:
        (out * M.tensor(np.linspace(0.5, 1.5, out.numel(), dtype=np.float32).reshape(out.shape))).sum().backward()
    except RuntimeError as e:  # torch's
        assert PHRASE in str(e), e
        return "refused"
    except DTMError as e:
        assert e.code is ErrorCode.USE_AFTER_ASSIGN and PHRASE in str(e), e
        return "cut" if CUT in str(e) else "refused"
    return tuple(np.asarray(v.detach().numpy() if isinstance(v, torch.Tensor) else v.numpy()) if v is not None else None
                 for v in (out, a.grad, b.grad))


def _cases():
    writes = itertools.cycle(WRITES)
    for producer in PRODUCERS:
        for target, kind, grads in itertools.product(("out", "x", "w"), ("nonleaf", "leaf"), ("xw", "x", "w")):
            if kind == "leaf" and target == "out":
                continue
            how = next(writes)
            if kind == "leaf" and how == "detach":
                how = "add_"
            yield pytest.param(producer, target, kind, grads, how, id=f"{producer}-{target}-{kind}-{grads}-{how}")


@pytest.mark.parametrize("producer,target,kind,grads,how", list(_cases()))
def test_refused_where_torch_refuses_else_torchs_gradients(producer, target, kind, grads, how):
    want = run(torch, producer, target, kind, grads, how)
    got = run(dtm, producer, target, kind, grads, how)
    if got == "cut":
        assert how == "detach" and kind == "nonleaf"
        got = "refused" if want == "refused" else want
    if isinstance(want, str) or isinstance(got, str):
        if want == "refused" and got != "refused" and producer in KNOWN:
            pytest.xfail(KNOWN[producer])
        assert got == want
        return
    for w_, g_ in zip(want, got):
        assert (w_ is None) == (g_ is None)
        if w_ is not None:
            np.testing.assert_allclose(g_, w_, rtol=1e-4, atol=1e-5)


# --- the cases, one by one ----------------------------------------------------------

def _refusal(fn) -> DTMError:
    with pytest.raises(RuntimeError, match=PHRASE):
        fn(torch)
    with pytest.raises(DTMError) as e:
        fn(dtm)
    assert e.value.code is ErrorCode.USE_AFTER_ASSIGN
    assert PHRASE in str(e.value)
    return e.value


def test_sigmoid_saves_its_output():
    def fn(M):
        x = M.tensor([0.5, 1.0, 2.0], requires_grad=True)
        y = x.sigmoid()
        y.mul_(2)  # the line the error names
        y.sum().backward()
    e = _refusal(fn)
    message = str(e)
    assert "sigmoid" in message and "f32[3]" in message and "mul_" in message
    assert f"{__file__}:" in message  # the line of the in-place op


def test_mul_saves_the_other_operand():
    def fn(M):
        x = M.tensor([1.0, 2.0], requires_grad=True)
        w = M.tensor([3.0, 4.0]) * 1.0  # a non-leaf
        a = x * w
        w.add_(1)
        a.sum().backward()
    assert "mul" in str(_refusal(fn))


def test_exp_then_augmented_assignment():
    def fn(M):
        x = M.tensor([1.0, 2.0], requires_grad=True)
        y = x.exp()
        y += 1
        y.sum().backward()
    assert "exp" in str(_refusal(fn))


def _same_grads(fn):
    want, got = fn(torch), fn(dtm)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g.numpy(), w.detach().numpy(), rtol=1e-6)


def test_add_saves_nothing():
    def fn(M):
        a = M.tensor([1.0, 2.0], requires_grad=True)
        x = a * 1.0
        y = x + 1
        x.add_(5)
        (y * x).sum().backward()
        return a.grad, y, x
    _same_grads(fn)


def test_mul_by_a_python_scalar_saves_nothing_relevant():
    def fn(M):
        a = M.tensor([1.0, 2.0], requires_grad=True)
        x = a * 1.0
        y = x * 2
        x.add_(1)
        y.sum().backward()
        return a.grad, y
    _same_grads(fn)


def test_a_gradient_of_a_leaf_changed_under_no_grad_reaches_the_leaf():
    """A leaf changed in place is the same tensor: its gradient lands in its .grad, from
    the uses before the change and after."""
    def fn(M):
        w = M.tensor([1.0, 2.0], requires_grad=True)
        y = w + 1
        with M.no_grad():
            w.mul_(3)
        (y + w * 2).sum().backward()
        return w.grad, w
    _same_grads(fn)


def test_an_optimizer_step_between_forward_and_backward():
    """torch refuses a step that changed a weight a later layer's product saved; a step
    that changed only what no gradient reads is fine, the gradient reaching the weight."""
    def two_layers(M):
        M.manual_seed(0)
        w1 = M.tensor(np.ones((4, 4), np.float32) * 0.1, requires_grad=True)
        w2 = M.tensor(np.ones((4, 2), np.float32) * 0.2, requires_grad=True)
        loss = ((M.ones(3, 4) @ w1) @ w2).sum()
        with M.no_grad():
            w2 -= 0.1
        loss.backward()
    _refusal(two_layers)

    def one_layer(M):
        w = M.tensor(np.ones((4, 2), np.float32) * 0.2, requires_grad=True)
        loss = (M.ones(3, 4) @ w).sum()
        with M.no_grad():
            w -= 0.1
        loss.backward()
        return w.grad, w
    _same_grads(one_layer)


def test_a_write_through_data_after_a_save_is_refused():
    """torch's .data writes bypass its version counter, so torch's gradient then reads the
    changed value; DTM's snapshot cannot give that, so it refuses: an error, not a
    gradient that differs from torch's."""
    x = dtm.tensor([1.0, 2.0], requires_grad=True)
    y = x.exp()
    y.data.mul_(2)
    with pytest.raises(DTMError) as e:
        y.sum().backward()
    assert e.value.code is ErrorCode.USE_AFTER_ASSIGN


def test_autograd_grad_refuses_too():
    def fn(M):
        x = M.tensor([1.0, 2.0], requires_grad=True)
        y = x.tanh()
        y.add_(1)
        M.autograd.grad(y.sum(), x)
    assert "tanh" in str(_refusal(fn))


def test_refused_inside_jit():
    w = dtm.tensor([1.0, 2.0], requires_grad=True)

    @dtm.jit
    def bad(x):
        y = (x * w).sigmoid()
        y.mul_(2)
        y.sum().backward()
        return y

    with pytest.raises(DTMError) as e:
        bad(dtm.ones(2))
    assert e.value.code is ErrorCode.USE_AFTER_ASSIGN and "sigmoid" in str(e.value)

    @dtm.jit
    def good(x):
        y = x * w
        y.mul_(2)
        y.sum().backward()
        return y

    good(dtm.ones(2))
    np.testing.assert_allclose(w.grad.numpy(), [2.0, 2.0])
