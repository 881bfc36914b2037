"""The nn additions of issue 16 against torch 2.13: nn.init (torch's fans and gains, so
torch's distributions; the draws themselves are DTM's), Identity / SiLU / Softmax /
Flatten / MSELoss / ModuleDict, Module.to and its dtype shorthands, non-persistent
buffers, Embedding(padding_idx), and F.one_hot / normalize / cross_entropy with
label_smoothing / scaled_dot_product_attention with dropout. Ops run on both backends."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import dtm
import dtm.nn.functional as F
from dtm.nn import init
from dtm.runtime.backend import BACKENDS


@pytest.fixture(params=["ref"] + (["cpu"] if "cpu" in BACKENDS else []))
def backend(request, monkeypatch):
    monkeypatch.setenv("DTM_BACKEND", request.param)
    return request.param


def pair(shape, seed=0, dtype=np.float32):
    """The same random values as a dtm and a torch tensor, both requiring grad."""
    a = np.random.default_rng(seed).standard_normal(shape).astype(dtype)
    return dtm.tensor(a, requires_grad=True), torch.tensor(a, requires_grad=True)


def assert_close(d, t, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(d.numpy(), t.detach().numpy(), rtol=rtol, atol=atol)


def check_grads(out, tout, *pairs):
    """Backward of sum(out * cotangent) on both sides; the gradients of each (dtm, torch)."""
    ct = np.random.default_rng(9).standard_normal(tuple(tout.shape)).astype(np.float32)
    (out * dtm.tensor(ct)).sum().backward()
    (tout * torch.tensor(ct)).sum().backward()
    for d, t in pairs:
        assert_close(d.grad, t.grad)


# --- nn.init --------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(5, 3), (7, 4, 3), (6, 2, 3, 5)])
def test_fans_match_torch(shape):
    assert init._calculate_fan_in_and_fan_out(dtm.zeros(*shape)) == \
        torch.nn.init._calculate_fan_in_and_fan_out(torch.zeros(shape))


@pytest.mark.parametrize("nonlinearity,param", [("linear", None), ("sigmoid", None), ("tanh", None), ("relu", None),
                                                ("leaky_relu", None), ("leaky_relu", 0.2), ("leaky_relu", math.sqrt(5)),
                                                ("selu", None), ("conv2d", None)])
def test_calculate_gain_matches_torch(nonlinearity, param):
    assert init.calculate_gain(nonlinearity, param) == pytest.approx(torch.nn.init.calculate_gain(nonlinearity, param),
                                                                    rel=1e-15)


def test_constant_inits_are_torchs_and_keep_the_parameter():
    w = dtm.nn.Parameter(dtm.randn(3, 4))
    assert init.constant_(w, 0.25) is w and w.requires_grad
    np.testing.assert_array_equal(w.numpy(), torch.nn.init.constant_(torch.empty(3, 4), 0.25).numpy())
    np.testing.assert_array_equal(init.zeros_(w).numpy(), np.zeros((3, 4), np.float32))
    np.testing.assert_array_equal(init.ones_(w).numpy(), np.ones((3, 4), np.float32))
    h = dtm.zeros(2, dtype="f16")
    assert init.ones_(h).dtype is dtm.float16


INITS = {  # name: (call with dtm, call with torch); a 256 x 384 x 3 tensor has fans 1152 and 768
    "uniform": (lambda t: init.uniform_(t, -0.5, 2.0), lambda t: torch.nn.init.uniform_(t, -0.5, 2.0)),
    "normal": (lambda t: init.normal_(t, 1.0, 0.3), lambda t: torch.nn.init.normal_(t, 1.0, 0.3)),
    "xavier_uniform": (lambda t: init.xavier_uniform_(t, gain=2.0), lambda t: torch.nn.init.xavier_uniform_(t, 2.0)),
    "xavier_normal": (init.xavier_normal_, torch.nn.init.xavier_normal_),
    "kaiming_uniform": (init.kaiming_uniform_, torch.nn.init.kaiming_uniform_),
    "kaiming_uniform_linear": (lambda t: init.kaiming_uniform_(t, a=math.sqrt(5)),
                               lambda t: torch.nn.init.kaiming_uniform_(t, a=math.sqrt(5))),
    "kaiming_normal_fan_out": (lambda t: init.kaiming_normal_(t, mode="fan_out", nonlinearity="relu"),
                               lambda t: torch.nn.init.kaiming_normal_(t, mode="fan_out", nonlinearity="relu")),
    "trunc_normal": (lambda t: init.trunc_normal_(t, 0.5, 1.5, -1.0, 2.5),
                     lambda t: torch.nn.init.trunc_normal_(t, 0.5, 1.5, -1.0, 2.5)),
    "trunc_normal_default": (init.trunc_normal_, torch.nn.init.trunc_normal_),
}


@pytest.mark.parametrize("name", list(INITS))
def test_random_inits_follow_torchs_distribution(backend, name):
    ours, theirs = INITS[name]
    torch.manual_seed(0)
    dtm.manual_seed(0)
    w = dtm.nn.Parameter(dtm.zeros(256, 384, 3))
    assert ours(w) is w and w.requires_grad and w.dtype is dtm.float32
    a, b = w.numpy().astype(np.float64), theirs(torch.empty(256, 384, 3)).numpy().astype(np.float64)
    # 295k draws: the moments agree to 1% (of the std for the mean: 4 standard errors);
    # the bounded ones (uniform, truncated) reach their bounds to the extreme draws' spacing.
    np.testing.assert_allclose([a.mean(), a.std()], [b.mean(), b.std()], rtol=0.01, atol=0.01 * b.std())
    if "uniform" in name or "trunc" in name:
        np.testing.assert_allclose([a.min(), a.max()], [b.min(), b.max()], atol=1e-3 * b.std())


def test_init_errors_name_the_users_line():
    for call in (lambda: init.xavier_uniform_(dtm.zeros(5)), lambda: init.kaiming_normal_(dtm.zeros(2, 2), mode="x"),
                 lambda: init.calculate_gain("swish"), lambda: init.normal_(dtm.zeros(2, dtype="i64")),
                 lambda: init.trunc_normal_(dtm.zeros(2), a=1.0, b=1.0)):
        with pytest.raises(dtm.TensorError) as e:
            call()
        assert e.value.where.startswith(__file__)


def test_kaiming_uniform_is_linears_init_bound():
    """nn.Linear's init is kaiming_uniform_(a=sqrt(5)): bound 1 / sqrt(fan_in)."""
    dtm.manual_seed(3)
    w = init.kaiming_uniform_(dtm.zeros(64, 100), a=math.sqrt(5)).numpy()
    assert np.abs(w).max() <= 0.1 and np.abs(w).max() > 0.099


# --- modules --------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda nn: nn.Identity(54, unused=True), lambda nn: nn.SiLU(), lambda nn: nn.Softmax(dim=-1),
    lambda nn: nn.Softmax(dim=1), lambda nn: nn.Softmax(), lambda nn: nn.Flatten(),
    lambda nn: nn.Flatten(0, 1)], ids=["identity", "silu", "softmax-1", "softmax1", "softmax-none", "flatten",
                                       "flatten01"])
def test_parameterless_modules(backend, make):
    x, tx = pair((2, 3, 4))
    dm, tm = make(dtm.nn), make(torch.nn)
    out, tout = dm(x), tm(tx)
    assert out.shape == tuple(tout.shape)
    assert_close(out, tout)
    check_grads(out, tout, (x, tx))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_mse_loss_module(backend, reduction):
    (x, tx), (y, ty) = pair((4, 3)), pair((4, 3), seed=1)
    out, tout = dtm.nn.MSELoss(reduction)(x, y), torch.nn.MSELoss(reduction=reduction)(tx, ty)
    assert_close(out, tout)
    check_grads(out, tout, (x, tx), (y, ty))
    with pytest.raises(dtm.TensorError):
        F.mse_loss(x, y, reduction="avg")


def test_module_dict_names_like_torch():
    def build(nn):
        d = nn.ModuleDict({"enc": nn.Linear(2, 3), "act": nn.ReLU()})
        d["dec"] = nn.Linear(3, 2)
        d.update([("extra", nn.Linear(2, 2))])
        del d["extra"]
        return d

    dm, tm = build(dtm.nn), build(torch.nn)
    assert list(dm) == list(tm) == list(dm.keys()) == ["enc", "act", "dec"]
    assert list(dm.state_dict()) == list(tm.state_dict())
    assert "dec" in dm and "extra" not in dm and len(dm) == 3 and dm["dec"] is dict(dm.items())["dec"]
    assert [type(m).__name__ for m in dm.values()] == ["Linear", "ReLU", "Linear"]
    with pytest.raises(dtm.TensorError):
        dm["bad"] = 3


@pytest.mark.parametrize("method,dtype", [("half", torch.float16), ("bfloat16", torch.bfloat16),
                                          ("float", torch.float32), ("double", torch.float64)])
def test_module_dtype_casts_like_torch(backend, method, dtype):
    def build(lib):
        m = lib.nn.Sequential(lib.nn.Linear(3, 4), lib.nn.LayerNorm(4))
        m.register_buffer("count", lib.zeros(2, dtype=lib.int64))  # an integer buffer keeps its dtype
        m.register_buffer("scale", lib.ones(2))
        return m

    dm, tm = build(dtm), build(torch)
    dm.load_state_dict({k: v.numpy() for k, v in tm.state_dict().items()})
    weight = dm[0].weight
    opt = dtm.optim.SGD(dm.parameters(), lr=0.1)
    assert getattr(dm, method)() is dm
    getattr(tm, method)()
    assert dm[0].weight is weight and opt.param_groups[0]["params"][0] is weight  # cast in place
    for (k, d), (_, t) in zip(dm.state_dict().items(), tm.state_dict().items()):
        assert str(t.dtype) == "torch." + {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64",
                                           "i64": "int64"}[d.dtype.name], k
        np.testing.assert_array_equal(d.numpy().astype(np.float64), t.double().numpy(), err_msg=k)
    x = np.random.default_rng(0).standard_normal((2, 3))
    out, tout = dm(dtm.tensor(x, dtype=weight.dtype)), tm(torch.tensor(x, dtype=dtype))
    np.testing.assert_allclose(out.numpy().astype(np.float64), tout.detach().double().numpy(), rtol=2e-2, atol=2e-2)


def test_module_to_forms():
    m = dtm.nn.Linear(2, 2)
    assert m.to("cpu").weight.dtype is dtm.float32
    assert m.to(dtm.float64).weight.dtype is dtm.float64
    assert m.to("cpu", dtm.float16).weight.dtype is dtm.float16
    assert m.to(dtm.zeros(1, dtype="bf16")).bias.dtype is dtm.bfloat16
    assert m.to(dtype="f32").weight.dtype is dtm.float32
    with pytest.raises(dtm.TensorError) as e:
        m.to(dtm.int64)
    assert e.value.where.startswith(__file__)


def test_non_persistent_buffers_like_torch(tmp_path):
    def build(lib):
        m = lib.nn.Linear(2, 2)
        m.register_buffer("mask", lib.ones(2, 2), persistent=False)
        m.register_buffer("stat", lib.zeros(2))
        return m

    dm, tm = build(dtm), build(torch)
    assert list(dm.state_dict()) == list(tm.state_dict()) == ["weight", "bias", "stat"]
    assert dm.mask.shape == (2, 2)
    dm.save(str(tmp_path / "m.safetensors"))
    dm.load(str(tmp_path / "m.safetensors"))  # strict: the mask is neither missing nor unexpected
    dm.register_buffer("mask", dtm.ones(2, 2))  # registered again as persistent
    assert "mask" in dm.state_dict()


@pytest.mark.parametrize("padding_idx", [1, -2])
def test_embedding_padding_idx(backend, padding_idx):
    dm = dtm.nn.Embedding(6, 3, padding_idx=padding_idx)
    tm = torch.nn.Embedding(6, 3, padding_idx=padding_idx)
    assert dm.padding_idx == tm.padding_idx
    np.testing.assert_array_equal(dm.weight.numpy()[tm.padding_idx], np.zeros(3, np.float32))
    w = np.random.default_rng(0).standard_normal((6, 3)).astype(np.float32)  # a nonzero padding row too
    dm.weight = dtm.nn.Parameter(dtm.tensor(w))
    with torch.no_grad():
        tm.weight.copy_(torch.tensor(w))
    ids = [[4, 1, 1], [0, 4, 5]]
    out, tout = dm(dtm.tensor(ids)), tm(torch.tensor(ids))
    assert_close(out, tout)
    check_grads(out, tout, (dm.weight, tm.weight))
    assert not dm.weight.grad.numpy()[tm.padding_idx].any()
    with pytest.raises(dtm.TensorError):
        dtm.nn.Embedding(6, 3, padding_idx=6)


# --- functional -----------------------------------------------------------------------------

@pytest.mark.parametrize("num_classes", [-1, 7])
def test_one_hot(backend, num_classes):
    ids = [[0, 3], [2, 2], [5, 1]]
    out = F.one_hot(dtm.tensor(ids), num_classes)
    want = torch.nn.functional.one_hot(torch.tensor(ids), num_classes)
    assert out.dtype is dtm.int64 and out.shape == tuple(want.shape)
    np.testing.assert_array_equal(out.numpy(), want.numpy())


def test_one_hot_errors():
    for bad in (lambda: F.one_hot(dtm.tensor([0.5])), lambda: F.one_hot(dtm.tensor([-1, 2])),
                lambda: F.one_hot(dtm.tensor([2]), -3), lambda: F.one_hot(dtm.zeros(0, dtype="i64"))):
        with pytest.raises(dtm.TensorError) as e:
            bad()
        assert e.value.where.startswith(__file__)


@pytest.mark.parametrize("p,dim", [(2.0, 1), (1.0, -1), (3.0, 0), (float("inf"), 1)])
def test_normalize(backend, p, dim):
    x, tx = pair((3, 4, 2))
    out, tout = F.normalize(x, p=p, dim=dim), torch.nn.functional.normalize(tx, p=p, dim=dim)
    assert_close(out, tout)
    check_grads(out, tout, (x, tx))


def test_normalize_short_vectors_divide_by_eps(backend):
    x = np.array([[0.0, 0.0], [3e-13, 4e-13], [3.0, 4.0]], np.float32)
    assert_close(F.normalize(dtm.tensor(x)), torch.nn.functional.normalize(torch.tensor(x)))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.1, 1.0])
def test_cross_entropy_label_smoothing(backend, reduction, smoothing):
    x, tx = pair((6, 5))
    target = [0, 4, -100, 2, 2, -100]
    out = F.cross_entropy(x, dtm.tensor(target), reduction=reduction, label_smoothing=smoothing)
    tout = torch.nn.functional.cross_entropy(tx, torch.tensor(target), reduction=reduction, label_smoothing=smoothing)
    assert_close(out, tout)
    check_grads(out, tout, (x, tx))
    module = dtm.nn.CrossEntropyLoss(reduction=reduction, label_smoothing=smoothing)
    assert_close(module(x, dtm.tensor(target)), tout)
    with pytest.raises(dtm.TensorError):
        F.cross_entropy(x, dtm.tensor(target), label_smoothing=1.5)


def test_sdpa_dropout_zero_is_unchanged(backend):
    (q, tq), (k, tk), (v, tv) = pair((2, 3, 5, 4)), pair((2, 3, 6, 4), 1), pair((2, 3, 6, 4), 2)
    mask = np.random.default_rng(3).random((5, 6)) > 0.3
    for kw in (dict(), dict(is_causal=True), dict(attn_mask=mask)):
        tkw = {**kw, "attn_mask": torch.tensor(kw["attn_mask"])} if "attn_mask" in kw else kw
        want = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, dropout_p=0.0, **tkw)
        assert_close(F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, **kw), want)


@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_dropout_statistics(backend, is_causal):
    """Scores all equal and v the identity: the result is the dropped attention weights
    themselves, each either 0 or (1 / n) / (1 - p) for a query that sees n keys."""
    p, s, heads = 0.3, 16, 64
    dtm.manual_seed(5)
    q = dtm.zeros(heads, s, 4, requires_grad=True)
    v = dtm.tensor(np.broadcast_to(np.eye(s, dtype=np.float32), (heads, s, s)).copy(), requires_grad=True)
    out = F.scaled_dot_product_attention(q, dtm.zeros(heads, s, 4), v, dropout_p=p, is_causal=is_causal)
    w = out.numpy()
    seen = np.tril(np.ones((s, s))) if is_causal else np.ones((s, s))
    scale = (1 / seen.sum(-1, keepdims=True)) / (1 - p)
    kept = w > 0
    np.testing.assert_allclose(w[kept], np.broadcast_to(scale, w.shape)[kept], rtol=1e-6)
    assert not (w * (1 - seen)).any()  # masked keys stay 0
    dropped = 1 - kept.sum() / (heads * seen.sum())
    assert abs(dropped - p) < 0.02  # 64 * 256 or 64 * 136 draws: 4+ standard deviations
    out.sum().backward()
    np.testing.assert_allclose(v.grad.numpy(), w.transpose(0, 2, 1) @ np.ones((heads, s, s), np.float32), rtol=1e-5)


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("v", [[0.0, 0.0, 0.0], [3.0, -4.0, 0.0]])
def test_norm_and_normalize_gradients_match_torch_also_at_a_zero_vector(v, p):
    """torch gives the norm of a zero vector a zero gradient (not the root's infinite one
    times zero: NaN)."""

    w = np.array([[1.0, 2.0, 3.0]], np.float32)
    x = dtm.tensor(np.array([v], np.float32), requires_grad=True)
    y = dtm.tensor(np.array([v], np.float32), requires_grad=True)
    dtm.norm(x, p).backward()
    (dtm.nn.functional.normalize(y, p) * dtm.tensor(w)).sum().backward()
    tx, ty = torch.tensor([v], requires_grad=True), torch.tensor([v], requires_grad=True)
    torch.norm(tx, p).backward()
    (torch.nn.functional.normalize(ty, p) * torch.from_numpy(w)).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(y.grad.numpy(), ty.grad.numpy(), rtol=1e-5, atol=1e-7)
