"""nn.MultiheadAttention (issue 30) against torch 2.13's, loaded from torch's state_dict:
outputs, attention weights and gradients for self- and cross-attention, both layouts,
bool and float masks, the is_causal hint, kdim / vdim, unbatched inputs. On both backends."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dtm
from dtm.errors import DTMError
from test_inplace_views import backend  # noqa: F401 - the fixture: each test on ref and cpu
from test_tensor_ops import TOL

E, H, L, S, N = 8, 2, 4, 5, 3


def modules(**kw):
    """A torch MultiheadAttention and a DTM one holding the same parameters."""
    torch.manual_seed(0)
    t = torch.nn.MultiheadAttention(E, H, **kw)
    with torch.no_grad():  # torch starts the biases at zero; nonzero ones test more
        for p in t.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    d = dtm.nn.MultiheadAttention(E, H, **kw)
    d.load_state_dict(t.state_dict())
    return d, t


def arrays(*shapes, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def bool_mask(shape, seed=2):
    """True (not allowed) at random, never at key 0: no query loses every key."""
    m = np.random.default_rng(seed).random(shape) < 0.4
    m[..., 0] = False
    return m


def float_mask(shape, seed=3):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def close(got, want) -> None:
    np.testing.assert_allclose(got.numpy(), want.detach().numpy(), **TOL["f32"])


def compare(d, t, q, k, v, self_attention=False, grads=True, **kw):
    """Call both modules on the same inputs and masks (numpy arrays); outputs, weights and,
    with `grads`, the gradients of inputs and parameters must agree."""
    dq, dk, dv = (dtm.tensor(a, requires_grad=True) for a in (q, k, v))
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    if self_attention:  # the same tensor three times, as a script passes it
        dk = dv = dq
        tk = tv = tq
    dkw = {n: dtm.tensor(a) if isinstance(a, np.ndarray) else a for n, a in kw.items()}
    tkw = {n: torch.tensor(a) if isinstance(a, np.ndarray) else a for n, a in kw.items()}
    dout, dw = d(dq, dk, dv, **dkw)
    tout, tw = t(tq, tk, tv, **tkw)
    close(dout, tout)
    assert (dw is None) == (tw is None)
    if tw is not None:
        assert dw.shape == tuple(tw.shape)
        close(dw, tw)
    if grads:
        ct = np.random.default_rng(4).standard_normal(tuple(tout.shape)).astype(np.float32)
        (dout * dtm.tensor(ct)).sum().backward()
        (tout * torch.tensor(ct)).sum().backward()
        for da, ta in ((dq, tq), (dk, tk), (dv, tv)):
            close(da.grad, ta.grad)
        tparams = dict(t.named_parameters())
        for name, p in d.named_parameters():
            close(p.grad, tparams[name].grad)
    return dout, dw


@pytest.mark.parametrize("batch_first", [False, True])
def test_self_attention(backend, batch_first):
    d, t = modules(batch_first=batch_first)
    (x,) = arrays((N, L, E) if batch_first else (L, N, E))
    compare(d, t, x, x, x, self_attention=True)


@pytest.mark.parametrize("batch_first", [False, True])
def test_cross_attention(backend, batch_first):
    d, t = modules(batch_first=batch_first)
    shape = (lambda n: (N, n, E)) if batch_first else (lambda n: (n, N, E))
    compare(d, t, *arrays(shape(L), shape(S), shape(S)))


@pytest.mark.parametrize("mask", ["bool", "float"])
def test_key_padding_mask(backend, mask):
    d, t = modules(batch_first=True)
    kpm = bool_mask((N, S)) if mask == "bool" else float_mask((N, S))
    compare(d, t, *arrays((N, L, E), (N, S, E), (N, S, E)), key_padding_mask=kpm)


@pytest.mark.parametrize("mask", ["bool", "float"])
@pytest.mark.parametrize("rank", [2, 3])
def test_attn_mask(backend, mask, rank):
    d, t = modules()
    shape = (L, S) if rank == 2 else (N * H, L, S)
    am = bool_mask(shape) if mask == "bool" else float_mask(shape)
    compare(d, t, *arrays((L, N, E), (S, N, E), (S, N, E)), attn_mask=am)


def test_attn_mask_with_key_padding_mask(backend):
    d, t = modules(batch_first=True)
    compare(d, t, *arrays((N, L, E), (N, S, E), (N, S, E)), attn_mask=bool_mask((L, S)),
            key_padding_mask=bool_mask((N, S), seed=5))


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("padded", [False, True])
def test_is_causal_with_attn_mask(backend, need_weights, padded):
    d, t = modules(batch_first=True)
    (x,) = arrays((N, L, E))
    causal = ~np.tril(np.ones((L, L), dtype=bool))
    kpm = {"key_padding_mask": bool_mask((N, L))} if padded else {}
    compare(d, t, x, x, x, self_attention=True, attn_mask=causal, is_causal=True, need_weights=need_weights, **kpm)


def test_need_weights_false(backend):
    d, t = modules()
    _, weights = compare(d, t, *arrays((L, N, E), (S, N, E), (S, N, E)), need_weights=False,
                         attn_mask=float_mask((L, S)))
    assert weights is None


def test_per_head_weights(backend):
    d, t = modules(batch_first=True)
    _, weights = compare(d, t, *arrays((N, L, E), (N, S, E), (N, S, E)), average_attn_weights=False,
                         key_padding_mask=bool_mask((N, S)))
    assert weights.shape == (N, H, L, S)


def test_kdim_vdim(backend):
    d, t = modules(kdim=3, vdim=6, batch_first=True)
    assert d.in_proj_weight is None and d.k_proj_weight.shape == (E, 3) and d.v_proj_weight.shape == (E, 6)
    compare(d, t, *arrays((N, L, E), (N, S, 3), (N, S, 6)), attn_mask=bool_mask((L, S)))


@pytest.mark.parametrize("average", [True, False])
def test_unbatched(backend, average):
    d, t = modules(batch_first=True)  # batch_first is ignored for unbatched inputs, as in torch
    compare(d, t, *arrays((L, E), (S, E), (S, E)), key_padding_mask=float_mask((S,)),
            attn_mask=float_mask((H, L, S), seed=6), average_attn_weights=average)


def test_without_bias(backend):
    d, t = modules(bias=False)
    assert d.in_proj_bias is None and d.out_proj.bias is None
    compare(d, t, *arrays((L, N, E), (S, N, E), (S, N, E)))


def test_dropout_is_identity_in_eval(backend):
    d, t = modules(dropout=0.5)
    d.eval()
    t.eval()
    compare(d, t, *arrays((L, N, E), (S, N, E), (S, N, E)))


def test_state_dict_round_trip(backend):
    d, t = modules(kdim=3, vdim=6)
    assert list(d.state_dict()) == list(t.state_dict())
    back = torch.nn.MultiheadAttention(E, H, kdim=3, vdim=6)
    back.load_state_dict({k: torch.tensor(v.numpy()) for k, v in d.state_dict().items()})
    for k, v in back.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), t.state_dict()[k].numpy())


def test_initialisation_shapes():
    m = dtm.nn.MultiheadAttention(E, H)
    assert m.in_proj_weight.shape == (3 * E, E) and m.in_proj_bias.shape == (3 * E,)
    assert not m.in_proj_bias.numpy().any() and not m.out_proj.bias.numpy().any()  # zero, as torch's
    bound = np.sqrt(6.0 / (4 * E))  # xavier_uniform_ on [3E, E]
    assert np.abs(m.in_proj_weight.numpy()).max() <= bound


def test_refusals():
    with pytest.raises(DTMError, match="add_bias_kv"):
        dtm.nn.MultiheadAttention(E, H, add_bias_kv=True)
    with pytest.raises(DTMError, match="divisible"):
        dtm.nn.MultiheadAttention(E, 3)
    x = dtm.randn(L, N, E)
    with pytest.raises(DTMError, match="is_causal needs attn_mask"):
        dtm.nn.MultiheadAttention(E, H)(x, x, x, is_causal=True)
