"""Issue 30, "What a script reaches for": more of torch's API, each compared with torch on
both backends (values and gradients): Tensor.data, retain_grad, nonzero / one-argument
where, randperm, format of 0-d tensors, set_num_threads, load(map_location=), index_add_
and scatter_, Module buffers and devices, and the losses nll / l1 / bce / bce-with-logits
and cross_entropy over [B, C, T]."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dtm
import dtm.nn.functional as DF
import torch.nn.functional as TF
from dtm.errors import DTMError, ErrorCode
from test_inplace_views import backend  # noqa: F401 - the fixture: each test on ref and cpu
from test_tensor_ops import TOL

F32 = TOL["f32"]
RNG = np.random.default_rng(30)


def close(got, want, tol: dict = F32) -> None:
    """A DTM result against torch's (tensors or tuples of them)."""
    np.testing.assert_allclose(np.asarray(got.numpy() if isinstance(got, dtm.Tensor) else got),
                               want.detach().numpy() if isinstance(want, torch.Tensor) else np.asarray(want), **tol)


def leaves(*arrays: np.ndarray) -> tuple[list[dtm.Tensor], list[torch.Tensor]]:
    """The same arrays as DTM and torch leaves that require grad."""
    return ([dtm.tensor(a, requires_grad=True) for a in arrays],
            [torch.tensor(a, requires_grad=True) for a in arrays])


def same_loss_and_grads(fn_dtm, fn_torch, *arrays: np.ndarray) -> None:
    """fn over leaves made of `arrays`: the value and every leaf's gradient agree with torch."""
    d, t = leaves(*arrays)
    got, want = fn_dtm(*d), fn_torch(*t)
    close(got, want)
    want.sum().backward()
    got.sum().backward()
    for a, b in zip(d, t):
        close(a.grad, b.grad)


# --- Tensor ----------------------------------------------------------------------------------

def test_data_shares_the_value_without_history(backend):
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    p, q = dtm.nn.Parameter(dtm.tensor(w)), torch.nn.Parameter(torch.tensor(w))
    for x in (p, q):
        assert not x.data.requires_grad
        x.data.mul_(0.5)        # an old-style optimizer's update, outside no_grad
        x.data[0, 1] = 7.0      # through a view of .data
        x.data = x.data + 1     # the setter
    close(p, q)
    assert p.requires_grad and p.is_leaf
    (p * p).sum().backward()
    (q * q).sum().backward()
    close(p.grad, q.grad)


def test_retain_grad_fills_a_non_leafs_grad(backend):
    a = RNG.standard_normal((3, 4)).astype(np.float32)
    (x,), (tx,) = leaves(a)
    ys = []
    for m, v in ((dtm, x), (torch, tx)):
        y = v * 3
        y.retain_grad()
        y.retain_grad()  # twice: once
        (m.tanh(y) * y).sum().backward()
        ys.append(y)
    close(ys[0].grad, ys[1].grad)
    close(x.grad, tx.grad)
    with pytest.raises(DTMError):
        dtm.ones(2).retain_grad()


def test_nonzero_and_one_argument_where(backend):
    a = np.array([[0, 1.5, 0], [2, 0, -1]], np.float32)
    d, t = dtm.tensor(a) * 1, torch.tensor(a)
    close(dtm.nonzero(d), torch.nonzero(t))
    close(d.nonzero(), t.nonzero())
    assert d.nonzero().dtype is dtm.int64
    for got, want in zip(d.nonzero(as_tuple=True), t.nonzero(as_tuple=True)):
        close(got, want)
    for got, want in zip(dtm.where(d > 0), torch.where(t > 0)):
        close(got, want)
    assert len(dtm.where(dtm.tensor(3.0))) == len(torch.where(torch.tensor(3.0)))


def test_randperm_draws_a_permutation_from_its_generator(backend):
    perms = [dtm.randperm(50, generator=dtm.Generator().manual_seed(s)).numpy() for s in (1, 1, 2)]
    want = torch.randperm(50, generator=torch.Generator().manual_seed(1))
    assert perms[0].dtype == want.numpy().dtype and perms[0].shape == tuple(want.shape)
    assert sorted(perms[0].tolist()) == list(range(50))
    assert (perms[0] == perms[1]).all() and not (perms[0] == perms[2]).all()
    assert dtm.randperm(0).shape == (0,)


def test_format_of_a_0d_tensor(backend):
    for spec in (".4f", "e", "", ">10.2f"):
        assert format(dtm.tensor(3.14159) * 1, spec) == format(torch.tensor(3.14159), spec)
    assert f"{dtm.tensor(7) + 1:03d}" == f"{torch.tensor(7) + 1:03d}"
    for m in (torch, dtm):
        with pytest.raises(TypeError):
            format(m.ones(2), ".2f")


def test_set_num_threads_sets_the_kernels_threads(backend):
    before = dtm.get_num_threads()
    try:
        dtm.set_num_threads(1)
        assert dtm.get_num_threads() == 1
        close(dtm.ones(4) * 2, torch.ones(4) * 2)  # kernels still run
    finally:
        dtm.set_num_threads(before)
    assert dtm.get_num_threads() == before
    with pytest.raises(DTMError):
        dtm.set_num_threads(0)


def test_load_takes_a_cpu_map_location(tmp_path, backend):
    path = str(tmp_path / "ckpt.safetensors")
    dtm.save({"w": dtm.arange(4)}, path)
    for where in ("cpu", "cpu:0", torch.device("cpu")):
        close(dtm.load(path, map_location=where)["w"], torch.arange(4))
    with pytest.raises(DTMError, match="cuda"):
        dtm.load(path, map_location="cuda:0")


def test_index_add_(backend):
    x, src = RNG.standard_normal((4, 3)).astype(np.float32), RNG.standard_normal((5, 3)).astype(np.float32)
    idx = [0, 2, 0, 3, 2]

    def run(m, a, s):
        return (a * 1).index_add_(0, m.tensor(idx), s, alpha=2.0)
    same_loss_and_grads(lambda a, s: run(dtm, a, s), lambda a, s: run(torch, a, s), x, src)
    d, t = dtm.zeros(2, 3), torch.zeros(2, 3)
    d.index_add_(1, dtm.tensor([2, 0]), dtm.ones(2, 2))
    t.index_add_(1, torch.tensor([2, 0]), torch.ones(2, 2))
    close(d, t)


def test_scatter_(backend):
    x, src = RNG.standard_normal((3, 5)).astype(np.float32), RNG.standard_normal((3, 3)).astype(np.float32)
    idx = [[4, 0, 2], [1, 3, 0], [2, 1, 4]]  # no position written twice: torch leaves that unspecified

    def run(m, a, s):
        return (a * 1).scatter_(1, m.tensor(idx), s)
    same_loss_and_grads(lambda a, s: run(dtm, a, s), lambda a, s: run(torch, a, s), x, src)
    big = RNG.standard_normal((4, 6)).astype(np.float32)  # src larger than index: read over index's shape
    close(dtm.tensor(x).scatter_(1, dtm.tensor(idx), dtm.tensor(big)),
          torch.tensor(x).scatter_(1, torch.tensor(idx), torch.tensor(big)))
    d, t = dtm.zeros(3, 5), torch.zeros(3, 5)
    close(d.scatter_(0, dtm.tensor([[2, 0, 1]]), 4.0), t.scatter_(0, torch.tensor([[2, 0, 1]]), 4.0))
    with pytest.raises(DTMError):
        dtm.zeros(3, 5).scatter_(1, dtm.tensor([[5]]), 1.0)


# --- nn --------------------------------------------------------------------------------------

def test_named_buffers_and_buffers(backend):
    def build(nn, m):
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        model[0].register_buffer("steps", m.zeros(1))
        model[1].register_buffer("mask", m.ones(2), persistent=False)
        return model
    got, want = build(dtm.nn, dtm), build(torch.nn, torch)
    assert [n for n, _ in got.named_buffers()] == [n for n, _ in want.named_buffers()]
    for g, w in zip(got.buffers(), want.buffers()):
        close(g, w)


def test_cpu_and_to_a_device(backend):
    model = dtm.nn.Linear(2, 3)
    assert model.cpu() is model
    for device in ("cpu", "cpu:0", torch.device("cpu")):
        assert model.to(device) is model
        close(dtm.ones(2).to(device), torch.ones(2).to(device))
    close(dtm.ones(2).to("cpu", dtm.float64), torch.ones(2).to("cpu", torch.float64), TOL["f64"])
    for bad in ("cuda", torch.device("cuda:1"), "mps"):
        for call in (lambda: model.to(bad), lambda: dtm.ones(2).to(bad), lambda: dtm.ones(2).to(device=bad)):
            with pytest.raises(DTMError, match=str(bad)) as e:
                call()
            assert e.value.code is ErrorCode.UNKNOWN_BACKEND


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_nll_loss(backend, reduction):
    logp = np.log(RNG.dirichlet(np.ones(4), size=6)).astype(np.float32)
    target = [0, 3, 1, -100, 2, 3]
    weight = np.array([0.5, 1.0, 2.0, 1.5], np.float32)
    same_loss_and_grads(
        lambda x: DF.nll_loss(x, dtm.tensor(target), weight=dtm.tensor(weight), reduction=reduction),
        lambda x: TF.nll_loss(x, torch.tensor(target), weight=torch.tensor(weight), reduction=reduction), logp)
    counted = [0, 3, 1, 1, 2, 3]
    same_loss_and_grads(lambda x: dtm.nn.NLLLoss(ignore_index=3)(x, dtm.tensor(counted)),
                        lambda x: torch.nn.NLLLoss(ignore_index=3)(x, torch.tensor(counted)), logp)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_l1_loss(backend, reduction):
    a, b = (RNG.standard_normal((3, 4)).astype(np.float32) for _ in range(2))
    same_loss_and_grads(lambda x, y: DF.l1_loss(x, y, reduction=reduction),
                        lambda x, y: TF.l1_loss(x, y, reduction=reduction), a, b)
    same_loss_and_grads(lambda x, y: dtm.nn.L1Loss()(x, y), lambda x, y: torch.nn.L1Loss()(x, y), a, b)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_binary_cross_entropy(backend, reduction):
    p = RNG.uniform(0.05, 0.95, (3, 4)).astype(np.float32)
    t = RNG.uniform(0, 1, (3, 4)).astype(np.float32)
    w = RNG.uniform(0.5, 2, (4,)).astype(np.float32)
    same_loss_and_grads(lambda x, y: DF.binary_cross_entropy(x, y, weight=dtm.tensor(w), reduction=reduction),
                        lambda x, y: TF.binary_cross_entropy(x, y, weight=torch.tensor(w), reduction=reduction), p, t)
    same_loss_and_grads(lambda x: dtm.nn.BCELoss()(x, dtm.tensor(t)), lambda x: torch.nn.BCELoss()(x, torch.tensor(t)), p)
    # log clamped to >= -100: probabilities of exactly 0 and 1 give torch's finite loss
    edge, target = np.array([0.0, 1.0, 0.0], np.float32), np.array([1.0, 0.0, 0.0], np.float32)
    close(DF.binary_cross_entropy(dtm.tensor(edge), dtm.tensor(target)),
          TF.binary_cross_entropy(torch.tensor(edge), torch.tensor(target)))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_binary_cross_entropy_with_logits(backend, reduction):
    x = (RNG.standard_normal((3, 4)) * 4).astype(np.float32)
    x[0, :2] = [80.0, -80.0]  # exp(80) overflows f32: the stable form does not
    t = RNG.uniform(0, 1, (3, 4)).astype(np.float32)
    pos = RNG.uniform(0.5, 3, (4,)).astype(np.float32)
    w = RNG.uniform(0.5, 2, (3, 1)).astype(np.float32)
    same_loss_and_grads(
        lambda a: DF.binary_cross_entropy_with_logits(a, dtm.tensor(t), weight=dtm.tensor(w), reduction=reduction,
                                                      pos_weight=dtm.tensor(pos)),
        lambda a: TF.binary_cross_entropy_with_logits(a, torch.tensor(t), weight=torch.tensor(w),
                                                      reduction=reduction, pos_weight=torch.tensor(pos)), x)
    same_loss_and_grads(lambda a: dtm.nn.BCEWithLogitsLoss()(a, dtm.tensor(t)),
                        lambda a: torch.nn.BCEWithLogitsLoss()(a, torch.tensor(t)), x)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_over_b_c_t(backend, reduction):
    logits = RNG.standard_normal((2, 5, 3)).astype(np.float32)
    target = [[0, 4, -100], [2, 2, 1]]
    same_loss_and_grads(lambda x: DF.cross_entropy(x, dtm.tensor(target), reduction=reduction),
                        lambda x: TF.cross_entropy(x, torch.tensor(target), reduction=reduction), logits)
    same_loss_and_grads(lambda x: DF.cross_entropy(x, dtm.tensor(target), label_smoothing=0.1),
                        lambda x: TF.cross_entropy(x, torch.tensor(target), label_smoothing=0.1), logits)
    vec = RNG.standard_normal(5).astype(np.float32)  # one row of class scores: a 0-d loss
    same_loss_and_grads(lambda x: DF.cross_entropy(x, dtm.tensor(3), reduction=reduction),
                        lambda x: TF.cross_entropy(x, torch.tensor(3), reduction=reduction), vec)
