"""torch's signatures and edge cases where DTM differed (found while writing the docstrings):
a class weight passed as torch passes it (the third argument of cross_entropy, the first of
CrossEntropyLoss) was taken as ignore_index; expand with -1 in a new leading dim gave a
shape; narrow refused a negative start; split of an empty dim raised Python's ValueError;
nesterov SGD without momentum ran as plain SGD; zero_grad(set_to_none=False) set None; a
shared sub-module came twice from named_modules; a Sequential's slice was a list. Each case
against torch itself."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch

import dtm
from dtm.errors import DTMError

rng = np.random.default_rng(7)
LOGITS = rng.standard_normal((6, 5)).astype(np.float32)
TARGET = np.array([0, 4, 2, -100, 1, 4])
WEIGHT = rng.uniform(0.2, 2.0, 5).astype(np.float32)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_cross_entropy_takes_a_class_weight_where_torch_does(reduction, smoothing):
    want = torch.nn.functional.cross_entropy(torch.tensor(LOGITS), torch.tensor(TARGET), torch.tensor(WEIGHT),
                                             reduction=reduction, label_smoothing=smoothing)
    got = dtm.nn.functional.cross_entropy(dtm.tensor(LOGITS), dtm.tensor(TARGET), dtm.tensor(WEIGHT),
                                          reduction=reduction, label_smoothing=smoothing)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=2e-5, atol=2e-6)
    module = dtm.nn.CrossEntropyLoss(dtm.tensor(WEIGHT), reduction=reduction, label_smoothing=smoothing)
    np.testing.assert_allclose(module(dtm.tensor(LOGITS), dtm.tensor(TARGET)).numpy(), want.numpy(), rtol=2e-5,
                               atol=2e-6)


def test_the_other_losses_take_torchs_arguments_in_torchs_order():
    logp = torch.log_softmax(torch.tensor(LOGITS), 1)
    want = torch.nn.NLLLoss(torch.tensor(WEIGHT))(logp, torch.tensor(TARGET))
    got = dtm.nn.NLLLoss(dtm.tensor(WEIGHT))(dtm.tensor(logp.numpy()), dtm.tensor(TARGET))
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=2e-5)
    p, t, w = rng.uniform(0.05, 0.95, (4, 3)), rng.integers(0, 2, (4, 3)).astype(np.float64), rng.uniform(0, 2, (4, 3))
    want = torch.nn.BCELoss(torch.tensor(w))(torch.tensor(p), torch.tensor(t))
    np.testing.assert_allclose(dtm.nn.BCELoss(dtm.tensor(w))(dtm.tensor(p), dtm.tensor(t)).numpy(), want.numpy(),
                               rtol=1e-12)
    for make in (lambda: dtm.nn.CrossEntropyLoss(size_average=True), lambda: dtm.nn.NLLLoss(reduce=False),
                 lambda: dtm.nn.BCELoss(None, True)):
        with pytest.raises(DTMError, match="reduction="):
            make()


def test_expand_keeps_only_an_existing_dim_with_minus_one():
    assert dtm.zeros(3).expand(2, -1).shape == torch.zeros(3).expand(2, -1).shape == (2, 3)
    with pytest.raises(RuntimeError):
        torch.zeros(3).expand(-1, 3)
    with pytest.raises(DTMError, match="-1 only keeps the size of an existing dim"):
        dtm.zeros(3).expand(-1, 3)
    with pytest.raises(DTMError):
        dtm.zeros(3).expand(2, -2)


def test_narrow_counts_a_negative_start_from_the_end():
    for start, length in ((-2, 2), (0, 3), (3, 0), (-3, 1)):
        want = torch.narrow(torch.arange(3), 0, start, length)
        np.testing.assert_array_equal(dtm.narrow(dtm.arange(3), 0, start, length).numpy(), want.numpy())
    for start, length in ((-4, 1), (2, 2), (4, 0)):
        with pytest.raises((IndexError, RuntimeError)):
            torch.narrow(torch.arange(3), 0, start, length)
        with pytest.raises(DTMError, match="narrow"):
            dtm.narrow(dtm.arange(3), 0, start, length)


def test_split_of_an_empty_dim_and_a_size_of_zero():
    (want,) = torch.split(torch.zeros(0), 0)
    (got,) = dtm.split(dtm.zeros(0), 0)
    assert got.shape == tuple(want.shape) == (0,)
    with pytest.raises(RuntimeError):
        torch.split(torch.zeros(2), 0)
    with pytest.raises(DTMError, match="split_size"):
        dtm.split(dtm.zeros(2), 0)


def test_dropout_checks_p_when_made_and_takes_p_of_one():
    with pytest.raises(ValueError):
        torch.nn.Dropout(1.5)
    with pytest.raises(DTMError, match="between 0 and 1"):
        dtm.nn.Dropout(1.5)
    x = np.array([np.nan, np.inf, 2.0, -1.0], np.float32)
    want = torch.nn.functional.dropout(torch.tensor(x), 1.0, True)
    np.testing.assert_array_equal(dtm.nn.Dropout(1.0)(dtm.tensor(x)).numpy(), want.numpy())
    np.testing.assert_array_equal(dtm.nn.Dropout(1.0).eval()(dtm.tensor(x)).numpy(), x)


def test_nesterov_sgd_needs_momentum_and_no_dampening():
    for kwargs in (dict(nesterov=True), dict(nesterov=True, momentum=0.9, dampening=0.1)):
        with pytest.raises(ValueError):
            torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1, **kwargs)
        with pytest.raises(DTMError, match="nesterov"):
            dtm.optim.SGD([dtm.zeros(1, requires_grad=True)], lr=0.1, **kwargs)
    dtm.optim.SGD([dtm.zeros(1, requires_grad=True)], lr=0.1, nesterov=True, momentum=0.9)


def test_zero_grad_can_keep_zeroed_gradients():
    for lib in (torch, dtm):
        lin = lib.nn.Linear(3, 2)
        opt = lib.optim.SGD(lin.parameters(), lr=0.1)
        lin(lib.ones(4, 3)).sum().backward()
        opt.zero_grad(set_to_none=False)
        assert all(p.grad is not None and not p.grad.numpy().any() for p in lin.parameters())
        lin(lib.ones(4, 3)).sum().backward()
        lin.zero_grad(set_to_none=False)
        assert all(p.grad is not None and not p.grad.numpy().any() for p in lin.parameters())
        opt.zero_grad()
        assert all(p.grad is None for p in lin.parameters())


def _shared(lib):
    inner = lib.nn.Linear(2, 2)
    return lib.nn.Sequential(OrderedDict([("a", inner), ("b", lib.nn.ReLU()), ("c", inner)]))


def test_a_shared_module_comes_once_but_its_state_under_each_name():
    mine, theirs = _shared(dtm), _shared(torch)
    assert [n for n, _ in mine.named_modules()] == [n for n, _ in theirs.named_modules()] == ["", "a", "b"]
    assert [n for n, _ in mine.named_modules(remove_duplicate=False)] == \
        [n for n, _ in theirs.named_modules(remove_duplicate=False)]
    assert list(mine.state_dict()) == list(theirs.state_dict()) == ["a.weight", "a.bias", "c.weight", "c.bias"]
    assert len(list(mine.parameters())) == len(list(theirs.parameters())) == 2


def test_a_sequentials_slice_is_a_sequential():
    seq = dtm.nn.Sequential(dtm.nn.Linear(2, 3), dtm.nn.ReLU(), dtm.nn.Linear(3, 1))
    head = seq[0:2]
    assert isinstance(head, dtm.nn.Sequential) and len(head) == 2 and isinstance(head[1], dtm.nn.ReLU)
    assert head(dtm.ones(4, 2)).shape == (4, 3)
    assert isinstance(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Tanh())[0:1], torch.nn.Sequential)
