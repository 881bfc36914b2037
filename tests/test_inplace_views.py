"""Issue 30: in-place ops and views with torch's semantics (dtm/tensor/inplace.py).

Every case runs the same code on torch and on DTM (`M` is the module) and compares what
every reference sees afterwards: the tensor written, another name for it, its views and its
base. Before, each of the issue's five cases gave a stale value in silence."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dtm
from dtm.errors import ErrorCode, TensorError
from dtm.runtime.backend import BACKENDS

BACKEND_NAMES = ["ref"] + (["cpu"] if "cpu" in BACKENDS else [])


@pytest.fixture(params=BACKEND_NAMES)
def backend(request, monkeypatch):
    monkeypatch.setenv("DTM_BACKEND", request.param)
    return request.param


def same(fn) -> None:
    """fn(M) returns arrays (or tensors); torch's and DTM's must be equal."""
    want, got = fn(torch), fn(dtm)
    want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
    for w, g in zip(want, got):
        w = w.detach().numpy() if isinstance(w, torch.Tensor) else np.asarray(w)
        g = g.numpy() if isinstance(g, dtm.Tensor) else np.asarray(g)
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def start(M):
    return M.tensor(np.arange(12, dtype=np.float32).reshape(3, 4))


# --- the five cases -------------------------------------------------------------------

def test_manual_sgd_under_no_grad_changes_the_weights(backend):
    def fn(M):
        M.manual_seed(0)
        w = M.tensor([[1.0, 2.0]], requires_grad=True)
        (w * 3).sum().backward()
        with M.no_grad():
            for p in [w]:
                p -= 0.1 * p.grad
        return w
    same(fn)


def test_a_write_through_a_view_changes_its_base(backend):
    def fn(M):
        x = M.zeros(2, 2)
        y = x.view(-1)
        y[0] = 100.0
        return x, y
    same(fn)


def test_a_write_to_the_base_changes_its_views(backend):
    def fn(M):
        x = M.zeros(2, 2)
        v = x[0]
        x += 1
        return v, x
    same(fn)


def test_augmented_assignment_changes_the_tensor_itself(backend):
    x = dtm.zeros(2)
    a = x
    x += 1
    assert a is x
    np.testing.assert_array_equal(a.numpy(), [1, 1])


def test_indexed_add_with_repeated_indices(backend):
    same(lambda M: _indexed_add(M))


def _indexed_add(M):
    x = M.zeros(3)
    x[M.tensor([0, 0])] += 1
    y = M.zeros(5)
    y[M.tensor([3, 1, 3, 3])] = M.tensor([1.0, 2.0, 3.0, 4.0])  # the last write to 3 stays
    return x, y


# --- every in-place method, on the tensor, an alias and a view ----------------------------------

METHODS = {
    "add_": lambda M, x: x.add_(2.5), "add_alpha": lambda M, x: x.add_(M.ones(4), alpha=2),
    "sub_": lambda M, x: x.sub_(1.5), "mul_": lambda M, x: x.mul_(-2), "div_": lambda M, x: x.div_(4),
    "pow_": lambda M, x: x.pow_(2), "neg_": lambda M, x: x.neg_(), "abs_": lambda M, x: x.sub_(5).abs_(),
    "exp_": lambda M, x: x.div_(10).exp_(), "sqrt_": lambda M, x: x.sqrt_(), "tanh_": lambda M, x: x.tanh_(),
    "sigmoid_": lambda M, x: x.sigmoid_(), "floor_": lambda M, x: x.div_(3).floor_(),
    "clamp_": lambda M, x: x.clamp_(2, 7), "clamp_min": lambda M, x: x.clamp_(min=4),
    "relu_": lambda M, x: x.sub_(5).relu_(), "zero_": lambda M, x: x.zero_(), "fill_": lambda M, x: x.fill_(7),
    "copy_": lambda M, x: x.copy_(M.ones(3, 4) * 9), "copy_bcast": lambda M, x: x.copy_(M.arange(4.0)),
    "masked_fill_": lambda M, x: x.masked_fill_(x > 5, -1.0), "lerp_": lambda M, x: x.lerp_(M.zeros(3, 4), 0.25),
    "iadd": lambda M, x: x.__iadd__(1), "isub": lambda M, x: x.__isub__(M.ones(4)),
    "imul": lambda M, x: x.__imul__(3), "itruediv": lambda M, x: x.__itruediv__(2),
    "ifloordiv": lambda M, x: x.__ifloordiv__(2), "imod": lambda M, x: x.__imod__(5),
    "ipow": lambda M, x: x.__ipow__(2),
}


@pytest.mark.parametrize("name", list(METHODS))
def test_in_place_methods_as_torch(backend, name):
    def fn(M):
        x = start(M)
        alias, row, col = x, x[1], x[:, 2]
        out = METHODS[name](M, x)
        assert out is x
        return x, alias, row, col
    same(fn)


# --- writes through each view op ------------------------------------------------------------

VIEWS = {
    "view": lambda x: x.view(12), "view2": lambda x: x.view(2, 6), "reshape": lambda x: x.reshape(4, 3),
    "flatten": lambda x: x.flatten(), "transpose": lambda x: x.transpose(0, 1), "T": lambda x: x.T,
    "permute": lambda x: x.permute(1, 0), "unsqueeze": lambda x: x.unsqueeze(0), "squeeze": lambda x: x[None].squeeze(0),
    "row": lambda x: x[1], "col": lambda x: x[:, 2], "slice": lambda x: x[1:, ::2], "step": lambda x: x[::2, 1::2],
    "narrow": lambda x: x.narrow(1, 1, 2), "chain": lambda x: x.view(2, 6)[1].view(3, 2).T,
    "ellipsis": lambda x: x[..., 1:3],
    # views that torch gives and DTM shared later
    "detach": lambda x: x.detach(), "detach_row": lambda x: x.detach()[1], "t": lambda x: x.t(),
    "unbind": lambda x: x.unbind(1)[2], "unbind0": lambda x: x.unbind()[0], "split": lambda x: x.split(3, dim=1)[1],
    "split_sizes": lambda x: x.split([1, 2], 0)[1], "chunk": lambda x: x.chunk(2, 1)[0],
    "select": lambda x: x.select(1, 2), "select_neg": lambda x: x.select(0, -1), "diagonal": lambda x: x.diagonal(),
    "diagonal_above": lambda x: x.diagonal(1), "diagonal_below": lambda x: x.diagonal(-1),
    "diagonal_T": lambda x: x.diagonal(0, 1, 0), "view_as": lambda x: x.view_as(x.reshape(6, 2)),
    "unflatten": lambda x: x.unflatten(1, (2, 2)), "movedim": lambda x: x.movedim(0, 1),
    "moveaxis": lambda x: x.moveaxis(1, 0), "swapaxes": lambda x: x.swapaxes(0, 1), "swapdims": lambda x: x.swapdims(1, 0),
}
# views that repeat elements of their base: writes to the base reach them; writes through them are refused
REPEATING = {"expand_as": lambda x: x[:1].expand_as(x), "expand_as_col": lambda x: x[:, 1:2].expand_as(x)}


@pytest.mark.parametrize("name", list(VIEWS))
def test_writes_through_a_view_reach_the_base_and_other_views(backend, name):
    def fn(M):
        x = start(M)
        v = VIEWS[name](x)
        other = x[2]
        v += 100
        v[0] = -1
        return x, v, other
    same(fn)


@pytest.mark.parametrize("name", list(VIEWS) + list(REPEATING))
def test_writes_to_the_base_reach_every_view(backend, name):
    def fn(M):
        x = start(M)
        v = {**VIEWS, **REPEATING}[name](x)
        x.mul_(2)
        x[0, 0] = 50
        return v
    same(fn)


@pytest.mark.parametrize("name", list(REPEATING))
def test_writes_through_a_view_that_repeats_elements_are_refused(name):
    with pytest.raises(RuntimeError):
        REPEATING[name](start(torch)).add_(1)
    with pytest.raises(TensorError):
        REPEATING[name](start(dtm)).add_(1)


# one of several views one call returns: torch refuses in-place writes to it under autograd
SEVERAL = ("unbind", "unbind0", "split", "split_sizes", "chunk")


@pytest.mark.parametrize("name", [n for n in VIEWS if "detach" not in n])
def test_gradients_through_writes_to_a_view_and_to_its_base(name):
    """Each view op records its gradient: a write through the view, then one to the base,
    and both read after: the gradients are torch's."""
    def fn(M):
        w = M.tensor(np.linspace(0.5, 2.0, 12, dtype=np.float32).reshape(3, 4), requires_grad=True)
        u = M.tensor(np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(3, 4), requires_grad=True)
        x = w * 1.0
        v = VIEWS[name](x)
        v.mul_(3)
        v.add_(VIEWS[name](u))
        x.sub_(u * 0.5)
        loss = (x * M.arange(12.0).reshape(3, 4)).sum() + (v * v).sum()
        if M.is_grad_enabled():
            loss.backward()
        return x, v, w.grad, u.grad
    if name in SEVERAL:
        with pytest.raises(RuntimeError, match="inplace"):
            fn(torch)
        with pytest.raises(TensorError, match="in place") as e:
            fn(dtm)
        assert e.value.code is ErrorCode.ATTRIBUTE_VALUE
        with dtm.no_grad():  # torch allows it outside autograd
            fn(dtm)
        return
    same(fn)


def test_every_piece_of_split_chunk_and_unbind_is_a_view():
    def fn(M):
        x = start(M)
        a, b = x.split(2, dim=1)
        c, d = x.chunk(2, 0)
        rows = x.unbind(0)
        a += 1
        d.mul_(-1)
        rows[1][0] = 7
        return x, a, b, c, d, *rows
    same(fn)


def test_detach_shares_the_elements_and_records_no_gradient():
    def fn(M):
        w = M.tensor([1.0, 2.0, 3.0], requires_grad=True)
        d = w.detach()
        assert not d.requires_grad
        d.zero_()  # changes w, outside autograd (torch allows it on a leaf that requires grad)
        (w * M.tensor([1.0, 2.0, 3.0])).sum().backward()
        d2 = w.detach()
        with M.no_grad():
            w += 1
        return w, d, d2, w.grad
    same(fn)
    x = dtm.ones(3)
    x.detach().zero_()
    np.testing.assert_array_equal(x.numpy(), [0, 0, 0])


def test_clone_does_not_share():
    def fn(M):
        x = start(M)
        c = x.clone()
        x += 1
        c.mul_(2)
        return x, c
    same(fn)


def test_a_view_of_a_computed_tensor_and_gradients_through_writes(backend):
    def fn(M):
        w = M.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
        y = w * 2
        y[1:3] *= w[:2]  # in place on a non-leaf, through a view
        y.sum().backward()
        return y, w.grad
    same(fn)


# --- what torch refuses -----------------------------------------------------------------------

@pytest.mark.parametrize("case", ["leaf", "expand", "int += float", "copy_ of another shape"])
def test_what_torch_refuses_is_refused(backend, case):
    def run(M):
        if case == "leaf":
            M.ones(2, requires_grad=True).add_(1)
        elif case == "expand":
            M.zeros(1, 3).expand(2, 3).add_(1)
        elif case == "copy_ of another shape":
            M.zeros(2, 3).copy_(M.ones(4))
        else:
            x = M.zeros(2, dtype=M.int64)
            x += 0.5
    with pytest.raises(RuntimeError):
        run(torch)
    with pytest.raises(TensorError) as e:
        run(dtm)
    assert e.value.code in (ErrorCode.ATTRIBUTE_VALUE, ErrorCode.DTYPE_MISMATCH, ErrorCode.SHAPE_MISMATCH)


# --- inside dtm.jit -----------------------------------------------------------------------------

def test_an_in_place_update_inside_jit_persists_across_calls(backend):
    """A buffer updated in place by a traced step is updated on every call (the step's
    `assign` effect), as the eager step would update it."""
    count = dtm.zeros(2)

    @dtm.jit
    def step(x):
        count.add_(x)
        return x * 2

    for i in range(3):
        step(dtm.ones(2) * (i + 1))
    np.testing.assert_array_equal(count.numpy(), [6, 6])


def test_reading_a_tensor_after_its_in_place_update_inside_jit_is_refused(backend):
    count = dtm.zeros(2)

    @dtm.jit
    def step(x):
        count.add_(x)
        return count * 2  # the updated value is not there until the step has run: refused, not stale

    with pytest.raises(TensorError) as e:
        step(dtm.ones(2))
    assert e.value.code is ErrorCode.USE_AFTER_ASSIGN


# --- a batch cut from a dataset ---------------------------------------------------------------

def test_a_batch_sliced_from_a_dataset_is_computed_at_once_and_shares_its_elements(backend):
    """nanoGPT's get_batch: slices of a realized tensor, stacked, are numpy's at once (no
    program is built: the result holds its value), equal to torch's; the slices are views."""
    data = np.arange(1000, dtype=np.int64)
    ix = [3, 500, 17]
    batch = dtm.stack([dtm.tensor(data)[i:i + 8] for i in ix])
    assert batch._buffer is not None
    np.testing.assert_array_equal(batch.numpy(), torch.stack([torch.tensor(data)[i:i + 8] for i in ix]).numpy())
    assert dtm.cat([dtm.tensor(data)[:2], dtm.tensor(data)[5:7]])._buffer is not None

    def fn(M):
        d = M.tensor(data)
        piece = d[10:14]
        d[11] = -5
        piece[0] = -7
        return d[8:16], piece
    same(fn)


def test_get_batch_runs_no_program_but_randint(monkeypatch):
    """nanoGPT's get_batch as written: iterating the drawn offsets, `i + T` on each and the
    slices and stacks are numpy's at once; only randint runs a program. Equal to torch's
    for the same offsets."""
    from dtm.runtime import execute
    data_np = np.arange(10_000, dtype=np.int64) * 3
    data, T = dtm.tensor(data_np).realize(), 8
    runs = []
    real_run = execute.run
    monkeypatch.setattr(execute, "run", lambda *a, **k: runs.append(1) or real_run(*a, **k))
    ix = dtm.randint(len(data) - T, (5,))
    x = dtm.stack([data[i:i + T] for i in ix])
    y = dtm.stack([data[i + 1:i + 1 + T] for i in ix])
    assert len(runs) == 1 and x._buffer is not None and y._buffer is not None
    t_data, t_ix = torch.tensor(data_np), torch.tensor(ix.numpy())
    np.testing.assert_array_equal(x.numpy(), torch.stack([t_data[i:i + T] for i in t_ix]).numpy())
    np.testing.assert_array_equal(y.numpy(), torch.stack([t_data[i + 1:i + 1 + T] for i in t_ix]).numpy())


def test_arithmetic_on_an_index_is_torchs():
    """The quick i64 arithmetic on 0-d known numbers wraps as torch's does, keeps i64, and
    leaves other dtypes and Python-number types to the general path."""
    def fn(M):
        big = M.tensor(2**63 - 1)
        i = M.tensor([4, 5])[1]
        return (big + 1, big * 2, M.tensor(-2**63) - 1, i + 3, i - M.tensor(7), i * i, 3 + i, i + 0.5, i * True,
                M.tensor(3, dtype=M.int32) + 2)
    want, got = fn(torch), fn(dtm)
    for w, g in zip(want, got):
        assert g.numpy().dtype == w.numpy().dtype
        np.testing.assert_array_equal(g.numpy(), w.numpy())


def test_iterating_a_tensor_gives_views():
    def fn(M):
        x = start(M)
        rows = list(x)
        rows[1] += 100
        x[2, 0] = -5
        items = list(M.tensor([1, 2, 3]))
        return (x, *rows, *items)
    same(fn)


def test_views_of_a_weight_follow_an_optimizer_step():
    """A view held across optimizer steps (a transposed weight) shows the stepped weight and
    keeps its gradient history, as torch's does."""
    def fn(M):
        w = M.tensor(np.arange(6, dtype=np.float32).reshape(2, 3), requires_grad=True)
        wt, row = w.T, w[1]
        opt = M.optim.SGD([w], lr=0.5)
        for _ in range(2):
            opt.zero_grad()
            (wt * M.arange(6.0).reshape(3, 2)).sum().backward()
            opt.step()
        return w, wt, row, w.grad
    same(fn)


def test_views_of_a_buffer_follow_a_jitted_update(backend):
    count = dtm.zeros(2, 2)
    view = count.T

    @dtm.jit
    def step(x):
        count.add_(x)
        return x * 2

    for i in range(2):
        step(dtm.tensor([[1.0, 2.0], [3.0, 4.0]]) * (i + 1))
        np.testing.assert_array_equal(view.numpy(), count.numpy().T)
    np.testing.assert_array_equal(view.numpy(), [[3, 9], [6, 12]])


def test_a_first_power_is_a_new_tensor_as_torch_s():
    """x ** 1 was x itself: an in-place write to the result changed x."""
    x, tx = dtm.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0])
    y, ty = x ** 1, tx ** 1
    y.add_(1)
    ty.add_(1)
    np.testing.assert_array_equal(x.numpy(), tx.numpy())
    np.testing.assert_array_equal(y.numpy(), ty.numpy())


@pytest.mark.parametrize("call", [
    lambda M, x: M.transpose(x, 0, 1), lambda M, x: M.reshape(x, (-1,)), lambda M, x: M.flatten(x),
    lambda M, x: M.permute(x, (1, 0)), lambda M, x: M.unsqueeze(x, 0), lambda M, x: M.narrow(x, 1, 1, 2),
    lambda M, x: M.split(x, 1)[1], lambda M, x: M.chunk(x, 2, 1)[0], lambda M, x: M.unbind(x)[0],
    lambda M, x: M.select(x, 1, 2), lambda M, x: M.movedim(x, 0, 1), lambda M, x: M.swapaxes(x, 0, 1),
    lambda M, x: M.diagonal(x), lambda M, x: M.t(x), lambda M, x: M.detach(x), lambda M, x: M.squeeze(x)])
def test_torch_functions_that_give_views_give_them(call):
    """dtm.transpose(x, 0, 1) as torch.transpose: a write through it reaches x."""
    got = []
    for M in (torch, dtm):
        x = M.tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
        v = call(M, x)
        v.mul_(10)
        got.append(x.numpy().copy())
    np.testing.assert_array_equal(got[1], got[0])
