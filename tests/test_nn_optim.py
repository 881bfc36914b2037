"""dtm.nn and dtm.optim against their torch equivalents: modules with weights copied from
torch give torch's outputs and gradients; state dicts name tensors as torch does and
round-trip through safetensors (bf16 included); cross_entropy matches with ignore_index;
SGD and AdamW take torch's steps; CosineAnnealingLR gives torch's learning rates. Every
test runs once per backend, set through DTM_BACKEND."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import safetensors.torch
import torch

import dtm
import dtm.nn.functional as F
from dtm.runtime.backend import BACKENDS

BACKEND_NAMES = ["ref"] + (["cpu"] if "cpu" in BACKENDS else [])


@pytest.fixture(params=BACKEND_NAMES)
def backend(request, monkeypatch):
    monkeypatch.setenv("DTM_BACKEND", request.param)
    return request.param


TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-10, atol=1e-12)}


def close(d, t, **tol) -> None:
    t = t.detach()
    np.testing.assert_allclose(d.numpy(), t.numpy(), **(tol or TOL[t.dtype]))


def copy_into(dtm_module: dtm.nn.Module, torch_module: torch.nn.Module) -> None:
    """torch's weights into the dtm module, keeping each torch tensor's dtype."""
    dtm_params = dict(dtm_module.named_parameters())
    for name, p in torch_module.named_parameters():
        owner, _, attr = name.rpartition(".")
        target = dtm_module
        for part in owner.split(".") if owner else ():
            target = getattr(target, part) if not part.isdigit() else target[int(part)]
        assert name in dtm_params, name
        setattr(target, attr, dtm.nn.Parameter(dtm.tensor(p.detach().numpy())))


def inputs(shape, dtype=torch.float32, seed=0):
    a = np.random.default_rng(seed).standard_normal(shape)
    t = torch.tensor(a, dtype=dtype, requires_grad=True)
    return dtm.tensor(a, dtype=dtype, requires_grad=True), t


def check_module(dm, tm, shape, dtype=torch.float32):
    """Forward, and gradients w.r.t. input and every parameter, of sum(out * cotangent)."""
    x, tx = inputs(shape, dtype)
    out, tout = dm(x), tm(tx)
    close(out, tout)
    ct = np.random.default_rng(1).standard_normal(tuple(tout.shape))
    (out * dtm.tensor(ct, dtype=dtype)).sum().backward()
    (tout * torch.tensor(ct, dtype=dtype)).sum().backward()
    close(x.grad, tx.grad)
    dparams = dict(dm.named_parameters())
    for name, p in tm.named_parameters():
        close(dparams[name].grad, p.grad)


# --- modules ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("bias", [True, False])
def test_linear(backend, dtype, bias):
    torch.manual_seed(0)
    tm = torch.nn.Linear(4, 3, bias=bias).to(dtype)
    dm = dtm.nn.Linear(4, 3, bias=bias)
    copy_into(dm, tm)
    check_module(dm, tm, (2, 5, 4), dtype)
    assert dm.weight.shape == (3, 4) and (dm.bias is None) == (not bias)


def test_linear_init_matches_torch_bounds(backend):
    dtm.manual_seed(0)
    m = dtm.nn.Linear(100, 50)
    w, b = m.weight.numpy(), m.bias.numpy()
    assert w.shape == (50, 100) and b.shape == (50,) and m.weight.requires_grad
    assert np.abs(w).max() <= 0.1 and np.abs(w).max() > 0.09 and np.abs(b).max() <= 0.1
    assert abs(w.std() - 0.1 / np.sqrt(3)) < 0.005  # uniform(-1/sqrt(in), 1/sqrt(in))


def test_embedding(backend):
    torch.manual_seed(0)
    tm, dm = torch.nn.Embedding(10, 4), dtm.nn.Embedding(10, 4)
    copy_into(dm, tm)
    ids = np.array([[1, 3, 3], [9, 0, 1]])
    out, tout = dm(dtm.tensor(ids)), tm(torch.tensor(ids))
    close(out, tout)
    ct = np.random.default_rng(1).standard_normal((2, 3, 4)).astype(np.float32)
    (out * dtm.tensor(ct)).sum().backward()
    (tout * torch.tensor(ct)).sum().backward()
    close(dm.weight.grad, tm.weight.grad)  # repeated ids accumulate


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm(backend, affine):
    tm = torch.nn.LayerNorm(6, elementwise_affine=affine).double()
    if affine:
        with torch.no_grad():
            tm.weight.normal_()
            tm.bias.normal_()
    dm = dtm.nn.LayerNorm(6, elementwise_affine=affine)
    copy_into(dm, tm)
    check_module(dm, tm, (3, 6), torch.float64)


def test_layer_norm_2d_shape(backend):
    tm, dm = torch.nn.LayerNorm((3, 4), eps=1e-3), dtm.nn.LayerNorm((3, 4), eps=1e-3)
    with torch.no_grad():
        tm.weight.normal_()
    copy_into(dm, tm)
    check_module(dm, tm, (2, 3, 4))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_module(backend, approximate):
    check_module(dtm.nn.GELU(approximate), torch.nn.GELU(approximate), (3, 5), torch.float64)


def test_relu_tanh_modules(backend):
    check_module(dtm.nn.ReLU(), torch.nn.ReLU(), (4, 5), torch.float64)
    check_module(dtm.nn.Tanh(), torch.nn.Tanh(), (4, 5), torch.float64)


def test_dropout_eval_is_identity(backend):
    m = dtm.nn.Dropout(0.5).eval()
    x = dtm.randn(100)
    assert np.array_equal(m(x).numpy(), x.numpy())
    assert np.array_equal(dtm.nn.Dropout(0.0)(x).numpy(), x.numpy())


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_dropout_train(backend, p):
    dtm.manual_seed(3)
    m = dtm.nn.Dropout(p)
    assert m.training
    x = dtm.ones(100_000, requires_grad=True)
    y = m(x)
    a = y.numpy()
    zeroed = a == 0
    assert abs(zeroed.mean() - p) < 0.01, zeroed.mean()
    np.testing.assert_allclose(a[~zeroed], 1 / (1 - p), rtol=1e-6)
    y.sum().backward()
    g = x.grad.numpy()
    assert (g[zeroed] == 0).all()
    np.testing.assert_allclose(g[~zeroed], 1 / (1 - p), rtol=1e-6)
    assert not np.array_equal(m(x).numpy() == 0, zeroed), "each call draws a new mask"


def _pair():
    torch.manual_seed(0)
    tm = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))
    dm = dtm.nn.Sequential(dtm.nn.Linear(4, 8), dtm.nn.GELU(), dtm.nn.Linear(8, 3))
    copy_into(dm, tm)
    return dm, tm


def test_sequential(backend):
    dm, tm = _pair()
    check_module(dm, tm, (5, 4))
    assert len(dm) == 3 and isinstance(dm[1], dtm.nn.GELU) and isinstance(dm[-1], dtm.nn.Linear)
    assert [n for n, _ in dm.named_parameters()] == [n for n, _ in tm.named_parameters()]


def test_module_list_and_nesting(backend):
    class Block(dtm.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = dtm.nn.ModuleList([dtm.nn.Linear(3, 3) for _ in range(2)])
            self.norm = dtm.nn.LayerNorm(3)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x).relu()
            return self.norm(x)

    class TBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(3, 3) for _ in range(2)])
            self.norm = torch.nn.LayerNorm(3)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x).relu()
            return self.norm(x)

    dm, tm = Block(), TBlock()
    assert len(dm.layers) == 2 and isinstance(dm.layers[1], dtm.nn.Linear)
    assert list(dm.state_dict()) == list(tm.state_dict())
    copy_into(dm, tm)
    check_module(dm, tm, (4, 3))
    dm.layers.append(dtm.nn.Linear(3, 3))
    assert len(list(dm.parameters())) == 8
    dm.eval()
    assert not any(m.training for m in dm.modules())
    dm.zero_grad()
    assert all(p.grad is None for p in dm.parameters())


def test_state_dict_from_torch(backend):
    dm, tm = _pair()
    fresh = dtm.nn.Sequential(dtm.nn.Linear(4, 8), dtm.nn.GELU(), dtm.nn.Linear(8, 3))
    assert list(fresh.state_dict()) == list(tm.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    fresh.load_state_dict(tm.state_dict())  # torch tensors, as they come
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    close(fresh(dtm.tensor(x)), tm(torch.tensor(x)))
    assert all(p.requires_grad and p.is_leaf for p in fresh.parameters())
    fresh.load_state_dict(dm.state_dict())  # dtm tensors
    with pytest.raises(dtm.DTMError):
        fresh.load_state_dict({k: v for k, v in tm.state_dict().items() if k != "0.bias"})
    with pytest.raises(dtm.DTMError):
        fresh.load_state_dict({**tm.state_dict(), "extra": torch.zeros(1)})
    with pytest.raises(dtm.DTMError):
        fresh.load_state_dict({**tm.state_dict(), "0.bias": torch.zeros(7)})
    fresh.load_state_dict({"0.bias": torch.full((8,), 2.0)}, strict=False)
    assert fresh[0].bias.tolist() == [2.0] * 8


def test_safetensors_round_trip(backend, tmp_path):
    state = {"w": dtm.tensor(np.arange(6.0).reshape(2, 3), dtype="f32"),
             "b16": dtm.tensor([1.5, -2.25, 3e38], dtype="bf16"), "h": dtm.tensor([0.1, 65504.0], dtype="f16"),
             "d": dtm.tensor([1e-300], dtype="f64"), "i": dtm.arange(5), "m": dtm.tensor([True, False]),
             "e": dtm.zeros(0, 3)}
    path = str(tmp_path / "state.safetensors")
    dtm.nn.save_safetensors(state, path)
    back = dtm.nn.load_safetensors(path)
    assert set(back) == set(state)
    for k, v in state.items():
        assert back[k].dtype is v.dtype and back[k].shape == v.shape, k
        assert np.array_equal(back[k].numpy(), v.numpy()), k
    # torch reads what dtm wrote, and dtm reads what torch wrote
    theirs = safetensors.torch.load_file(path)
    assert theirs["b16"].dtype == torch.bfloat16
    assert theirs["b16"].float().tolist() == back["b16"].numpy().astype(np.float32).tolist()
    assert theirs["e"].shape == (0, 3)
    path2 = str(tmp_path / "torch.safetensors")
    safetensors.torch.save_file(theirs, path2)
    again = dtm.nn.load_safetensors(path2)
    for k, v in state.items():
        assert again[k].dtype is v.dtype and np.array_equal(again[k].numpy(), v.numpy()), k


def test_safetensors_rank0(backend, tmp_path):
    path = str(tmp_path / "s.safetensors")
    dtm.nn.save_safetensors({"s": dtm.tensor(2.5)}, path)
    assert dtm.nn.load_safetensors(path)["s"].shape == ()


def test_module_save_load_bf16(backend, tmp_path):
    dm, _ = _pair()
    dm[0].weight = dtm.nn.Parameter(dm[0].weight.to("bf16"))
    path = str(tmp_path / "m.safetensors")
    dm.save(path)
    other = dtm.nn.Sequential(dtm.nn.Linear(4, 8), dtm.nn.GELU(), dtm.nn.Linear(8, 3))
    other[0].weight = dtm.nn.Parameter(dtm.zeros(8, 4, dtype="bf16"))
    other.load(path)
    for (k, a), (_, b) in zip(dm.state_dict().items(), other.state_dict().items()):
        assert a.dtype is b.dtype and np.array_equal(a.numpy(), b.numpy()), k
    assert other[0].weight.numpy().dtype == ml_dtypes.bfloat16


def test_bad_safetensors_file(backend, tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"\xff" * 64)
    with pytest.raises(dtm.DTMError):
        dtm.nn.load_safetensors(str(path))


# --- cross entropy ------------------------------------------------------------------------

@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [-100, 2])
def test_cross_entropy(backend, reduction, ignore_index):
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((6, 4))
    target = np.array([0, 2, 3, ignore_index, 2, ignore_index])
    x, tx = dtm.tensor(logits, dtype="f64", requires_grad=True), torch.tensor(logits, requires_grad=True)
    out = F.cross_entropy(x, dtm.tensor(target), ignore_index=ignore_index, reduction=reduction)
    tout = torch.nn.functional.cross_entropy(tx, torch.tensor(target), ignore_index=ignore_index, reduction=reduction)
    close(out, tout)
    out.sum().backward()
    tout.sum().backward()
    close(x.grad, tx.grad)


def test_cross_entropy_module_and_1d(backend):
    logits = np.random.default_rng(6).standard_normal((3, 5)).astype(np.float32)
    target = np.array([4, 0, 1])
    close(dtm.nn.CrossEntropyLoss()(dtm.tensor(logits), dtm.tensor(target)),
          torch.nn.CrossEntropyLoss()(torch.tensor(logits), torch.tensor(target)))
    close(F.cross_entropy(dtm.tensor(logits[0]), dtm.tensor(4)),
          torch.nn.functional.cross_entropy(torch.tensor(logits[0]), torch.tensor(4)))
    with pytest.raises(dtm.DTMError):
        F.cross_entropy(dtm.tensor(logits), dtm.tensor(target.astype(np.float32)))


# --- optimizers ---------------------------------------------------------------------------

def _models(dtype):
    torch.manual_seed(1)
    tm = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).to(dtype)
    dm = dtm.nn.Sequential(dtm.nn.Linear(3, 5), dtm.nn.Tanh(), dtm.nn.Linear(5, 2))
    copy_into(dm, tm)
    return dm, tm


OPTIMIZERS = {
    "sgd": (dict(lr=0.1), None),
    "sgd-momentum": (dict(lr=0.1, momentum=0.9), None),
    "sgd-dampening-wd": (dict(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.01), None),
    "sgd-nesterov-wd": (dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1), None),
    "adamw": (None, dict(lr=0.01)),
    "adamw-betas-wd": (None, dict(lr=0.02, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_steps_match_torch(backend, name, dtype):
    sgd, adamw = OPTIMIZERS[name]
    dm, tm = _models(dtype)
    if sgd is not None:
        dopt, topt = dtm.optim.SGD(dm.parameters(), **sgd), torch.optim.SGD(tm.parameters(), **sgd)
    else:
        dopt, topt = dtm.optim.AdamW(dm.parameters(), **adamw), torch.optim.AdamW(tm.parameters(), **adamw)
    rng = np.random.default_rng(2)
    for _ in range(5):
        x, y = rng.standard_normal((8, 3)), rng.standard_normal((8, 2))
        dopt.zero_grad()
        topt.zero_grad()
        loss = F.mse_loss(dm(dtm.tensor(x, dtype=dtype)), dtm.tensor(y, dtype=dtype))
        tloss = torch.nn.functional.mse_loss(tm(torch.tensor(x, dtype=dtype)), torch.tensor(y, dtype=dtype))
        loss.backward()
        tloss.backward()
        dopt.step()
        topt.step()
        close(loss, tloss, rtol=1e-6 if dtype == torch.float64 else 1e-5)
    rtol = 1e-6 if dtype == torch.float64 else 1e-5
    for (n, p), (_, tp) in zip(dm.named_parameters(), tm.named_parameters()):
        assert p.dtype.name == {torch.float32: "f32", torch.float64: "f64"}[dtype]
        np.testing.assert_allclose(p.numpy(), tp.detach().numpy(), rtol=rtol, atol=rtol * 1e-2, err_msg=n)


def test_optimizer_skips_params_without_grad(backend):
    a, b = dtm.nn.Parameter(dtm.ones(2)), dtm.nn.Parameter(dtm.ones(2))
    opt = dtm.optim.SGD([a, b], lr=0.5)
    (a * 2).sum().backward()
    opt.step()
    assert a.tolist() == [0.0, 0.0] and b.tolist() == [1.0, 1.0]
    opt.zero_grad()
    assert a.grad is None
    with pytest.raises(dtm.DTMError):
        dtm.optim.SGD([], lr=0.1)


def test_param_groups(backend):
    dm, tm = _models(torch.float64)
    def groups(m):
        return [{"params": list(m[0].parameters()), "lr": 0.5}, {"params": list(m[2].parameters())}]

    dopt, topt = dtm.optim.SGD(groups(dm), lr=0.1), torch.optim.SGD(groups(tm), lr=0.1)
    x = np.ones((2, 3))
    dm(dtm.tensor(x, dtype="f64")).sum().backward()
    tm(torch.tensor(x)).sum().backward()
    dopt.step()
    topt.step()
    for p, tp in zip(dm.parameters(), tm.parameters()):
        close(p, tp)


# --- learning-rate schedule ---------------------------------------------------------------

def _lrs(T_max, eta_min, steps):  # noqa: N803
    tp = torch.nn.Parameter(torch.zeros(1))
    topt = torch.optim.SGD([tp], lr=0.1)
    ts = torch.optim.lr_scheduler.CosineAnnealingLR(topt, T_max=T_max, eta_min=eta_min)
    dp = dtm.nn.Parameter(dtm.zeros(1))
    dopt = dtm.optim.SGD([dp], lr=0.1)
    ds = dtm.optim.lr_scheduler.CosineAnnealingLR(dopt, T_max=T_max, eta_min=eta_min)
    got, want = [ds.get_last_lr()[0]], [ts.get_last_lr()[0]]
    for _ in range(steps):
        topt.step()
        ts.step()
        dopt.step()
        ds.step()
        got.append(ds.get_last_lr()[0])
        want.append(ts.get_last_lr()[0])
    return got, want


@pytest.mark.parametrize("eta_min", [0.0, 0.01])
def test_cosine_annealing_lr(backend, eta_min):
    got, want = _lrs(20, eta_min, 20)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


def test_cosine_annealing_lr_past_t_max(backend):
    got, want = _lrs(8, 0.01, 20)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, float("inf")])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_grad_norm_matches_torch(backend, norm_type, max_norm):
    rng = np.random.default_rng(4)
    grads = [rng.standard_normal(s).astype(np.float32) for s in ((3, 5), (7,), ())]
    ours = [dtm.tensor(np.zeros_like(g), requires_grad=True) for g in grads] + [dtm.zeros(2, requires_grad=True)]
    theirs = [torch.zeros(g.shape, requires_grad=True) for g in grads] + [torch.zeros(2, requires_grad=True)]
    for p, q, g in zip(ours, theirs, grads):
        p.grad, q.grad = dtm.tensor(g), torch.tensor(g)  # the last parameter has no gradient
    total = dtm.nn.utils.clip_grad_norm_(ours, max_norm, norm_type=norm_type)
    want = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type=norm_type)
    np.testing.assert_allclose(total.numpy(), want.numpy(), rtol=1e-5)
    for p, q in zip(ours[:3], theirs[:3]):
        np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(), rtol=1e-5, atol=1e-7)
    assert ours[3].grad is None


def test_clip_grad_norm_traces_no_concat():
    # a stack of one norm per weight is a concat its reduction's kernel reads through a select
    # per weight (GPT-2's 148 made the largest kernel of its step): the norms are folded instead
    ws = [dtm.tensor(np.ones((3, 2), np.float32), requires_grad=True) for _ in range(12)]

    def step(x):
        sum((w * w * x).sum() for w in ws).backward()
        return dtm.nn.utils.clip_grad_norm_(ws, 1.0)

    f, x = dtm.jit(step), dtm.tensor(np.ones((3, 2), np.float32))
    assert not any(op.name == "concat" for op in f.ir(x).funcs["main"].ops)
    np.testing.assert_allclose(float(f(x).numpy()), np.sqrt(12 * 6 * 2.0 ** 2), rtol=1e-6)  # every grad 2


def test_clip_grad_norm_nonfinite_and_clip_value(backend):
    p = dtm.zeros(3, requires_grad=True)
    p.grad = dtm.tensor([1.0, float("nan"), 2.0])
    with pytest.raises(dtm.TensorError) as e:
        dtm.nn.utils.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
    assert e.value.code is dtm.ErrorCode.ATTRIBUTE_VALUE and e.value.where.startswith(__file__)
    q, tq = dtm.zeros(4, requires_grad=True), torch.zeros(4, requires_grad=True)
    q.grad, tq.grad = dtm.tensor([-3.0, -0.5, 0.5, 3.0]), torch.tensor([-3.0, -0.5, 0.5, 3.0])
    dtm.nn.utils.clip_grad_value_([q], 1.0)
    torch.nn.utils.clip_grad_value_([tq], 1.0)
    np.testing.assert_array_equal(q.grad.numpy(), tq.grad.numpy())
