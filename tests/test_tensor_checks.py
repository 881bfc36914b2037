"""Issue 16: bad values that gave silent wrong results now raise, as in torch: integer
indices out of range (indexing, index_select, gather, embedding, cross_entropy targets),
integer division by zero; and bad creation input (negative or huge sizes, operands of no
tensor kind) is a DTMError at the user's line, not numpy's error from deep inside.
Each case is compared with what torch does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dtm
import dtm.nn as nn
import dtm.nn.functional as F
from dtm.errors import ErrorCode, TensorError
from dtm.runtime.backend import BACKENDS

BACKEND_NAMES = ["ref"] + (["cpu"] if "cpu" in BACKENDS else [])


@pytest.fixture(params=BACKEND_NAMES)
def backend(request, monkeypatch):
    monkeypatch.setenv("DTM_BACKEND", request.param)
    return request.param


def raised_here(info: pytest.ExceptionInfo, code: ErrorCode, *words: str) -> None:
    """The error carries `code`, names each of `words`, and points at this file."""
    assert info.value.code is code
    assert info.value.where is not None and info.value.where.startswith(__file__), info.value.where
    for w in words:
        assert w in info.value.message, (w, info.value.message)


# --- indices ---------------------------------------------------------------------------------

ROWS = np.arange(8, dtype=np.float32).reshape(4, 2)


@pytest.mark.parametrize("index", [[7], [4], [-5], [0, 99], [0, 1, 2, 3] * 5 + [9, -6]])  # the last: past 16 indices
def test_index_out_of_range_raises_like_torch(backend, index):
    with pytest.raises(IndexError):
        torch.tensor(ROWS)[torch.tensor(index)]
    a = dtm.tensor(ROWS)
    with pytest.raises(IndexError) as e:
        a[dtm.tensor(index)]
    assert isinstance(e.value, TensorError)
    bad = next(i for i in index if not -4 <= i < 4)
    raised_here(e, ErrorCode.INDEX_OUT_OF_RANGE, str(bad), "size 4")


def test_negative_indices_as_torch(backend):
    """x[idx] wraps a negative index once; index_select, gather and embedding refuse it."""
    index = [-1, -4, 0, 3]
    t = torch.tensor(ROWS)[torch.tensor(index)]
    np.testing.assert_array_equal(dtm.tensor(ROWS)[dtm.tensor(index)].numpy(), t.numpy())
    np.testing.assert_array_equal(dtm.tensor(ROWS)[:, dtm.tensor([-1, -2])].numpy(),
                                  torch.tensor(ROWS)[:, torch.tensor([-1, -2])].numpy())
    for tf, df in ((lambda x, i: x.index_select(0, i), lambda x, i: x.index_select(0, i)),
                   (lambda x, i: torch.nn.functional.embedding(i, x), lambda x, i: F.embedding(i, x)),
                   (lambda x, i: torch.gather(x, 1, i.reshape(1, 1)), lambda x, i: dtm.gather(x, 1, i.reshape(1, 1)))):
        with pytest.raises((IndexError, RuntimeError)):
            tf(torch.tensor(ROWS), torch.tensor([-1]))
        with pytest.raises(IndexError) as e:
            df(dtm.tensor(ROWS), dtm.tensor([-1]))
        raised_here(e, ErrorCode.INDEX_OUT_OF_RANGE, "-1", "0 <= index")


def test_index_select_gather_setitem_check_indices(backend):
    a = dtm.tensor(ROWS)
    with pytest.raises(IndexError):
        torch.tensor(ROWS).index_select(0, torch.tensor([4]))
    with pytest.raises(IndexError) as e:
        a.index_select(0, dtm.tensor([4]))
    raised_here(e, ErrorCode.INDEX_OUT_OF_RANGE, "4")
    with pytest.raises(RuntimeError):  # torch: "index 2 is out of bounds for dimension 1 with size 2"
        torch.gather(torch.tensor(ROWS), 1, torch.tensor([[0], [2], [1], [0]]))
    with pytest.raises(IndexError) as e:
        dtm.gather(a, 1, dtm.tensor([[0], [2], [1], [0]]))
    raised_here(e, ErrorCode.INDEX_OUT_OF_RANGE, "2", "size 2")
    b = dtm.tensor(ROWS)
    with pytest.raises(IndexError):
        torch.tensor(ROWS)[torch.tensor([9])] = 1.0
    with pytest.raises(IndexError) as e:
        b[dtm.tensor([9])] = 1.0
    raised_here(e, ErrorCode.INDEX_OUT_OF_RANGE, "9")
    np.testing.assert_array_equal(b.numpy(), ROWS)  # unchanged


def test_embedding_checks_ids(backend):
    dtm.manual_seed(0)
    emb = nn.Embedding(4, 2)
    with pytest.raises(IndexError):
        torch.nn.Embedding(4, 2)(torch.tensor([99]))
    with pytest.raises(IndexError) as e:
        emb(dtm.tensor([[1, 99]]))
    raised_here(e, ErrorCode.INDEX_OUT_OF_RANGE, "99", "size 4")
    # A reshape or a widening cast of known ids is checked too (their values are known).
    with pytest.raises(IndexError):
        emb(dtm.tensor([[1, 99]], dtype=dtm.int32).reshape(-1))
    np.testing.assert_array_equal(emb(dtm.tensor([3, 0])).numpy(), emb.weight.numpy()[[3, 0]])


def test_cross_entropy_checks_targets(backend):
    logits = np.array([[0.5, -1.0], [2.0, 0.25]], np.float32)
    for target, bad in (([5, 0], 5), ([0, -1], -1)):
        with pytest.raises(IndexError):
            torch.nn.functional.cross_entropy(torch.tensor(logits), torch.tensor(target))
        with pytest.raises(IndexError) as e:
            F.cross_entropy(dtm.tensor(logits), dtm.tensor(target))
        raised_here(e, ErrorCode.INDEX_OUT_OF_RANGE, f"target {bad} ", "2 classes")
    # ignore_index is no class and is allowed; the loss matches torch's
    got = F.cross_entropy(dtm.tensor(logits), dtm.tensor([[1, -100]]).reshape(-1)).item()
    want = torch.nn.functional.cross_entropy(torch.tensor(logits), torch.tensor([1, -100])).item()
    assert got == pytest.approx(want, rel=1e-6)


def test_jit_checks_index_arguments_on_every_call(backend):
    """Inside dtm.jit the ids are placeholders at the trace; the compiled step checks the
    arguments that reach an index on each call."""
    dtm.manual_seed(0)
    emb = nn.Embedding(4, 2)

    @dtm.jit
    def step(ids, y):
        return F.cross_entropy(emb(ids).reshape(-1, 2), y.reshape(-1))

    ok = step(dtm.tensor([[1, 3]]), dtm.tensor([[0, 1]])).item()
    t_emb = torch.nn.Embedding(4, 2)
    with torch.no_grad():
        t_emb.weight.copy_(torch.tensor(emb.weight.numpy()))
    want = torch.nn.functional.cross_entropy(t_emb(torch.tensor([1, 3])), torch.tensor([0, 1])).item()
    assert ok == pytest.approx(want, rel=1e-6)
    with pytest.raises(IndexError) as e:
        step(dtm.tensor([[1, 99]]), dtm.tensor([[0, 1]]))
    raised_here(e, ErrorCode.INDEX_OUT_OF_RANGE, "99", "size 4", "traced at")
    with pytest.raises(IndexError) as e:
        step(dtm.tensor([[1, 2]]), dtm.tensor([[0, 5]]))
    raised_here(e, ErrorCode.INDEX_OUT_OF_RANGE, "5", "2 classes")


# --- values still to be computed: the `check` op (issue 37) ----------------------------------

# Each case computes its bad operand inside the program, so the front end cannot know it
# when it records the op; torch raises on the same computation, and so must DTM when the
# program runs, at the line that recorded the op. (Before the `check` op they clamped: row 9
# for index 20, [3.] for index 7, [0, 0] for a zero divisor, a row of zeros for class 5.)
IDX, ZERO = ErrorCode.INDEX_OUT_OF_RANGE, ErrorCode.DIVISION_BY_ZERO
COMPUTED = {  # the program (M: dtm or torch, x: a 4 x 2 table), the error, the value it names
    "embedding": (lambda M, x: M.nn.functional.embedding(M.tensor([1, 2]) * 10, x), IDX, "10"),
    "index": (lambda M, x: M.arange(4)[M.tensor([3]) + M.tensor([4])], IDX, "7"),
    "index_select": (lambda M, x: x.index_select(0, M.tensor([2, 1]) * 2), IDX, "4"),
    "gather": (lambda M, x: M.gather(x, 1, M.tensor([[0], [1], [1], [0]]) * 2), IDX, "2"),
    "floor_divide": (lambda M, x: M.tensor([5, 6]) // (M.tensor([1, 2]) - M.tensor([1, 2])), ZERO, ""),
    "remainder": (lambda M, x: M.tensor([5, 6]) % (M.tensor([1, 2]) - 1), ZERO, ""),
    "one_hot": (lambda M, x: M.nn.functional.one_hot(M.tensor([1]) + 4, 3), IDX, "5"),
    "cross_entropy": (lambda M, x: M.nn.functional.cross_entropy(x, M.tensor([1, 0, 1, 0]) * 3), IDX, "3"),
}


@pytest.mark.parametrize("case", list(COMPUTED))
def test_computed_bad_values_raise_like_torch(backend, case):
    fn, code, value = COMPUTED[case]
    with pytest.raises((IndexError, RuntimeError)):  # torch: RuntimeError("ZeroDivisionError") for //
        fn(torch, torch.tensor(ROWS))
    with pytest.raises(TensorError) as e:
        fn(dtm, dtm.tensor(ROWS)).numpy()
    raised_here(e, code, value, "check")
    assert isinstance(e.value, IndexError if code is IDX else ZeroDivisionError)


@pytest.mark.parametrize("case", ["embedding", "index", "index_select", "gather", "one_hot", "floor_divide"])
def test_computed_good_values_match_torch(backend, case):
    """The same programs with values in range: the check passes and changes nothing."""
    good = {
        "embedding": lambda M, x: M.nn.functional.embedding(M.tensor([1, 2]) * 2 - 1, x),
        "index": lambda M, x: M.arange(4)[M.tensor([3, 0]) - M.tensor([7, 4])],  # -4 and -4 wrap
        "index_select": lambda M, x: x.index_select(0, M.tensor([2, 1]) + 1),
        "gather": lambda M, x: M.gather(x, 1, M.tensor([[0], [1], [1], [0]]) * 1),
        "one_hot": lambda M, x: M.nn.functional.one_hot(M.tensor([1, 0]) + 1, 3),
        "floor_divide": lambda M, x: M.tensor([5, -6]) // (M.tensor([1, 2]) + 1),
    }[case]
    np.testing.assert_array_equal(good(dtm, dtm.tensor(ROWS)).numpy(), good(torch, torch.tensor(ROWS)).numpy())


def test_jit_checks_computed_indices_on_every_call(backend):
    """Inside dtm.jit an index computed from an argument is checked by the compiled program
    itself, on each call, at the line that traced it."""
    step = dtm.jit(lambda ids, table: F.embedding(ids * 2, table))
    table = dtm.tensor(ROWS)
    np.testing.assert_array_equal(step(dtm.tensor([0, 1]), table).numpy(), ROWS[[0, 2]])
    with pytest.raises(IndexError) as e:
        step(dtm.tensor([1, 2]), table)
    raised_here(e, ErrorCode.INDEX_OUT_OF_RANGE, "index 4 ", "size 4")
    np.testing.assert_array_equal(step(dtm.tensor([1, 0]), table).numpy(), ROWS[[2, 0]])


def test_a_failed_check_stops_a_training_step_before_its_updates(backend):
    """A jitted step whose embedding ids are computed: with a bad id it raises, and neither
    the weights nor the optimizer's state change (nothing half-written)."""
    dtm.manual_seed(0)
    emb = nn.Embedding(4, 2)
    opt = dtm.optim.AdamW(emb.parameters(), lr=0.1)

    @dtm.jit
    def step(ids):
        opt.zero_grad()
        loss = (emb(ids + 1) ** 2).sum()
        loss.backward()
        opt.step()
        return loss

    step(dtm.tensor([0, 1]))
    before = emb.weight.numpy().copy()
    with pytest.raises(IndexError) as e:
        step(dtm.tensor([0, 3]))
    raised_here(e, ErrorCode.INDEX_OUT_OF_RANGE, "index 4 ")
    np.testing.assert_array_equal(emb.weight.numpy(), before)
    step(dtm.tensor([2, 1]))
    assert not np.array_equal(emb.weight.numpy(), before)


def test_gradient_through_a_checked_index_matches_torch(backend):
    w = np.arange(8, dtype=np.float32).reshape(4, 2) / 8
    dw = dtm.tensor(w, requires_grad=True)
    tw = torch.tensor(w, requires_grad=True)
    (F.embedding(dtm.tensor([0, 1, 1]) * 2 + 1, dw) ** 2).sum().backward()
    (torch.nn.functional.embedding(torch.tensor([0, 1, 1]) * 2 + 1, tw) ** 2).sum().backward()
    np.testing.assert_allclose(dw.grad.numpy(), tw.grad.numpy(), rtol=1e-6)


def test_where_a_jitted_step_checks_computed_values():
    """A u8 index into a dim of 300 can never be out of range: nothing is checked. An index
    computed from arguments alone (a step's positions) is checked before each call; one
    computed from a larger intermediate (an argmax over 10,000 values) by a `check` op in
    the program. Both raise when an index is out of range."""
    table = dtm.tensor(np.arange(600, dtype=np.float32).reshape(300, 2))
    rows = np.zeros((2, 5000), np.float32)
    rows[0, 7], rows[1, 299] = 1, 1

    def checks(f, *args) -> int:
        return str(dtm.jit(f).ir(*args)).count(" = check ")
    assert checks(lambda x: F.embedding(x.argmax(-1).to(dtm.uint8), table), dtm.tensor(rows)) == 0
    assert checks(lambda ids: F.embedding(ids * 2 + 1, table), dtm.tensor([1, 2])) == 0
    inside = lambda x: F.embedding((x * 2).argmax(-1) * 2, table)  # noqa: E731 - x * 2: 10,000 values
    assert checks(inside, dtm.tensor(rows)) == 1
    rows[1, 299], rows[1, 149] = 0, 1
    np.testing.assert_array_equal(dtm.jit(inside)(dtm.tensor(rows)).numpy(), table.numpy()[[14, 298]])
    rows[1, 149], rows[1, 150] = 0, 1
    with pytest.raises(IndexError) as e:
        dtm.jit(inside)(dtm.tensor(rows))
    raised_here(e, ErrorCode.INDEX_OUT_OF_RANGE, "index 300 ", "check")


# --- integer division by zero ----------------------------------------------------------------

INTS = [7, -7, 3]


def _fmod(x, z):
    return (torch if isinstance(x, torch.Tensor) else dtm).fmod(x, z)


@pytest.mark.parametrize("expr", [lambda x, z: x // z, lambda x, z: x % z, _fmod,
                                  lambda x, z: x.div(z, rounding_mode="trunc"),
                                  lambda x, z: x.div(z, rounding_mode="floor")])
@pytest.mark.parametrize("divisor", ["scalar", "tensor"])
def test_integer_division_by_zero_raises_like_torch(backend, expr, divisor):
    tz = 0 if divisor == "scalar" else torch.tensor([1, 0, 2])
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        expr(torch.tensor(INTS), tz)
    dz = 0 if divisor == "scalar" else dtm.tensor([1, 0, 2])
    with pytest.raises(ZeroDivisionError) as e:
        expr(dtm.tensor(INTS), dz)
    raised_here(e, ErrorCode.DIVISION_BY_ZERO, "division by zero")


def test_jit_checks_divisor_arguments_on_every_call(backend):
    step = dtm.jit(lambda x, y: x // y + x % y)
    x, y = [7, -7, 3], [2, 3, -2]
    np.testing.assert_array_equal(step(dtm.tensor(x), dtm.tensor(y)).numpy(),
                                  (torch.tensor(x) // torch.tensor(y) + torch.tensor(x) % torch.tensor(y)).numpy())
    with pytest.raises(ZeroDivisionError) as e:
        step(dtm.tensor(x), dtm.tensor([2, 0, 1]))
    raised_here(e, ErrorCode.DIVISION_BY_ZERO, "division by zero", "traced at")


def test_division_without_zero_and_float_division_match_torch(backend):
    x, y = [7, -7, 3, -8], [2, 2, -2, 3]
    tx, ty, dx, dy = torch.tensor(x), torch.tensor(y), dtm.tensor(x), dtm.tensor(y)
    for f in (lambda a, b: a // b, lambda a, b: a % b, lambda a, b: a / b, _fmod):
        np.testing.assert_array_equal(f(dx, dy).numpy(), f(tx, ty).numpy())
    # ints / 0 is float division in torch: inf, no error; floats // 0 and % 0 do not raise either
    np.testing.assert_array_equal((dx / 0).numpy(), (tx / 0).numpy())
    fx = [7.0, -7.0, 0.0]
    np.testing.assert_array_equal((dtm.tensor(fx) // 0).numpy(), (torch.tensor(fx) // 0).numpy())
    np.testing.assert_array_equal((dtm.tensor(fx) % 0).numpy(), (torch.tensor(fx) % 0).numpy())


# --- creation input ---------------------------------------------------------------------------

@pytest.mark.parametrize("make", [lambda m: m.zeros(-3), lambda m: m.ones(2, -1), lambda m: m.randn(-1),
                                  lambda m: m.full((3, -2), 1.0), lambda m: m.zeros(2.5)])
def test_bad_sizes_raise_at_the_users_line(make):
    with pytest.raises((RuntimeError, TypeError)):
        make(torch)
    with pytest.raises(TensorError) as e:
        make(dtm)
    raised_here(e, ErrorCode.INVALID_DIM, "size")


@pytest.mark.parametrize("make", [lambda: dtm.zeros(10**12), lambda: dtm.randn(10**10), lambda: dtm.ones(10**6, 10**7),
                                  lambda: dtm.full((10**13,), 2, dtype=dtm.int8)])
def test_too_large_to_allocate_raises_before_allocating(make):
    """No machine this runs on has 4 TB free; 10**10 f32 needs 37 GiB, more than CI has.
    (torch would try to allocate and fail, or be killed.)"""
    with pytest.raises(TensorError) as e:
        make()
    raised_here(e, ErrorCode.OUT_OF_MEMORY, "GiB", "memory free")


def test_sizes_as_torch_takes_them():
    for args in [(2, 3), ((2, 3),), ([2, 3],), (0,), ((),), (np.int64(4),)]:
        assert dtm.zeros(*args).shape == tuple(torch.zeros(*args).shape)
        assert dtm.ones(*args).shape == tuple(torch.ones(*args).shape)
        assert dtm.randn(*args).shape == tuple(torch.randn(*args).shape)
    np.testing.assert_array_equal(dtm.full((2, 2), 7).numpy(), torch.full((2, 2), 7).numpy())


@pytest.mark.parametrize("expr", [lambda x: x + "x", lambda x: "x" + x, lambda x: x * None, lambda x: x < "a",
                                  lambda x: x - {}])
def test_unsupported_operands_raise_type_errors(expr):
    with pytest.raises(TypeError):
        expr(torch.tensor([1, 2]))
    with pytest.raises(TypeError) as e:
        expr(dtm.tensor([1, 2]))
    assert isinstance(e.value, TensorError)
    raised_here(e, ErrorCode.DTYPE_MISMATCH, "unsupported operand")


def test_complex_scalars_are_refused():
    """torch has complex dtypes; DTM has none (spec 2.1), so a complex scalar is refused."""
    with pytest.raises(TypeError) as e:
        dtm.tensor([1.0]) + 1j
    raised_here(e, ErrorCode.DTYPE_MISMATCH, "complex")


# --- long float sums ------------------------------------------------------------------------

def test_sum_of_a_billion_ones(backend):
    """One running f32 sum stops at 2^24 ones (2^28 over 16 vector lanes); torch and numpy
    sum blockwise / pairwise. DTM blocks (spec 2.8)."""
    assert torch.ones(1).expand(10**9).sum().item() == 1e9
    assert dtm.ones(1).expand(10**9).sum().item() == 1e9
    assert dtm.ones(1).expand(10**9).mean().item() == 1.0
    np.testing.assert_array_equal(dtm.ones(1, 1).expand(10**8, 3).sum(0).numpy(), [1e8] * 3)  # down columns
    assert dtm.ones(1, 1, 1).expand(3, 10**8, 2).sum((0, 1, 2)).item() == 6e8  # several summed loops


@pytest.mark.parametrize("shape, dims", [((2**25,), None), ((2**23, 5), 0), ((5, 2**23), 1), ((2**22, 3, 3), (0, 2)),
                                         ((2**24, 2), None)])
def test_long_sums_stay_accurate(backend, shape, dims):
    """Random data, against numpy in f64: the f32 result is within a few ulp of the exact sum."""
    x = np.random.default_rng(0).random(shape, dtype=np.float32)
    want = x.astype(np.float64).sum(axis=dims)
    got = dtm.tensor(x).sum(dims).numpy() if dims is not None else dtm.tensor(x).sum().numpy()
    np.testing.assert_allclose(got, want, rtol=2e-6)
