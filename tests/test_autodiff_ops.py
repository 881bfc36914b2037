"""Every differentiable op's VJP against torch.autograd: build a one-op (or tiny) module,
apply `grad` (seeded with a random cotangent), run it with the reference interpreter and
compare the outputs and gradients with torch on the same inputs, in f64 and f32."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dtm.ir as ir
from dtm.compiler.autodiff import grad
from dtm.ref.interpreter import run

TOL = {"f64": dict(rtol=1e-9, atol=1e-10), "f32": dict(rtol=2e-4, atol=2e-5)}
NP = {"f64": np.float64, "f32": np.float32}


@dataclass
class Case:
    """`build(f, *params) -> Value`; `ref(*tensors) -> tensor`; `inputs(rng, np_dtype)`
    gives the inputs (float arrays take the test's dtype); gradients w.r.t. `wrt`."""

    id: str
    build: Callable
    ref: Callable
    inputs: Callable
    wrt: list[int] | None = None          # default: every float input
    tol: dict = field(default_factory=dict)
    seed: str = "param"


def _type(a: np.ndarray) -> ir.TensorType:
    dt = ir.DTYPES[{np.dtype(np.float64): "f64", np.dtype(np.float32): "f32", np.dtype(np.int64): "i64",
                    np.dtype(np.int32): "i32", np.dtype(np.bool_): "bool"}[a.dtype]]
    return ir.TensorType(dt, tuple(a.shape))


def check(case: Case, dtype: str) -> None:
    rng = np.random.default_rng(zlib.crc32(case.id.encode()))
    inputs = [np.asarray(a) for a in case.inputs(rng, NP[dtype])]
    wrt = case.wrt if case.wrt is not None else [i for i, a in enumerate(inputs) if a.dtype.kind == "f"]
    b = ir.Builder()
    f = b.func("f")
    params = [f.param(_type(a), name=f"p{i}") for i, a in enumerate(inputs)]
    f.ret(case.build(f, *params))
    module = b.build()
    name = grad(module, "f", wrt, seed=case.seed)
    ir.verify(module)
    # torch
    ts = [torch.tensor(a, requires_grad=(i in wrt)) for i, a in enumerate(inputs)]
    out = case.ref(*ts)
    ct = rng.standard_normal(out.shape).astype(NP[dtype]) if case.seed == "param" else np.ones(out.shape, NP[dtype])
    out.backward(torch.tensor(ct))
    args = inputs + ([np.asarray(ct)] if case.seed == "param" else [])
    got = run(module, name, args)
    assert len(got) == 1 + len(wrt)
    tol = {**TOL[dtype], **case.tol.get(dtype, {})}
    np.testing.assert_allclose(got[0], out.detach().numpy(), **tol, err_msg=f"{case.id}: forward")
    for k, i in enumerate(wrt):
        want = ts[i].grad.numpy() if ts[i].grad is not None else np.zeros_like(inputs[i])
        assert got[1 + k].shape == want.shape, (case.id, i, got[1 + k].shape, want.shape)
        assert got[1 + k].dtype == inputs[i].dtype, (case.id, i, got[1 + k].dtype)
        np.testing.assert_allclose(got[1 + k], want, **tol, err_msg=f"{case.id}: gradient of input {i}")


# --- input makers ----------------------------------------------------------------------------

def normal(*shapes):
    return lambda rng, dt: [rng.standard_normal(s).astype(dt) for s in shapes]


def positive(*shapes, lo=0.5, hi=2.0):
    return lambda rng, dt: [rng.uniform(lo, hi, s).astype(dt) for s in shapes]


def ints(values, dtype=np.int64):
    return np.array(values, dtype=dtype)


CASES: list[Case] = []


def case(*a, **kw):
    CASES.append(Case(*a, **kw))


# --- elementwise unary ----------------------------------------------------------------------

UNARY = [
    ("neg", torch.neg, normal((3, 4))),
    ("abs", torch.abs, normal((3, 4))),
    ("exp", torch.exp, normal((3, 4))),
    ("exp2", torch.exp2, normal((3, 4))),
    ("log", torch.log, positive((3, 4))),
    ("log2", torch.log2, positive((3, 4))),
    ("sqrt", torch.sqrt, positive((3, 4))),
    ("rsqrt", torch.rsqrt, positive((3, 4))),
    ("reciprocal", torch.reciprocal, positive((3, 4))),
    ("sin", torch.sin, normal((3, 4))),
    ("cos", torch.cos, normal((3, 4))),
    ("tanh", torch.tanh, normal((3, 4))),
    ("erf", torch.erf, normal((3, 4))),
    ("sigmoid", torch.sigmoid, normal((3, 4))),
    ("silu", F.silu, normal((3, 4))),
    # zero gradient almost everywhere (non-differentiable ops: no cotangent flows)
    ("floor", torch.floor, normal((3, 4))),
    ("ceil", torch.ceil, normal((3, 4))),
    ("round", torch.round, normal((3, 4))),
    ("sign", torch.sign, normal((3, 4))),
]
for _n, _t, _in in UNARY:
    case(_n, lambda f, x, n=_n: f.op(n, x), _t, _in)
case("unary_rank0", lambda f, x: f.tanh(x), torch.tanh, normal(()))
case("gelu_exact", lambda f, x: f.gelu(x), lambda x: F.gelu(x), normal((4, 5)))
case("gelu_tanh", lambda f, x: f.gelu(x, approximate="tanh"), lambda x: F.gelu(x, approximate="tanh"), normal((4, 5)))
case("cast_up", lambda f, x: f.cast(f.cast(x, to="f64"), to=x.type.dtype), lambda x: x.double().to(x.dtype),
     normal((2, 3)))

# --- elementwise binary ---------------------------------------------------------------------

BINARY_SHAPES = [((3, 4), (3, 4)), ((3, 4), (4,)), ((2, 1, 4), (3, 1)), ((1,), (3, 4)), ((), (2, 3)),
                 ((2, 3), ())]
for _sx, _sy in BINARY_SHAPES:
    _tag = f"{list(_sx)}x{list(_sy)}".replace(" ", "")
    case(f"add{_tag}", lambda f, x, y: f.add(x, y), torch.add, normal(_sx, _sy))
    case(f"sub{_tag}", lambda f, x, y: f.sub(x, y), torch.sub, normal(_sx, _sy))
    case(f"mul{_tag}", lambda f, x, y: f.mul(x, y), torch.mul, normal(_sx, _sy))
    case(f"div{_tag}", lambda f, x, y: f.div(x, y), torch.div,
         lambda rng, dt, a=_sx, c=_sy: [rng.standard_normal(a).astype(dt), rng.uniform(0.5, 2, c).astype(dt)
                                        * rng.choice([-1, 1], c).astype(dt)])
    case(f"pow{_tag}", lambda f, x, y: f.pow(x, y), torch.pow,
         lambda rng, dt, a=_sx, c=_sy: [rng.uniform(0.5, 2, a).astype(dt), rng.standard_normal(c).astype(dt)])
    case(f"max{_tag}", lambda f, x, y: f.max(x, y), torch.maximum, normal(_sx, _sy))
    case(f"min{_tag}", lambda f, x, y: f.min(x, y), torch.minimum, normal(_sx, _sy))


def _ties(rng, dt):
    x = rng.integers(-2, 3, (4, 5)).astype(dt)
    y = rng.integers(-2, 3, (5,)).astype(dt)
    return [x, y]


case("max_ties", lambda f, x, y: f.max(x, y), torch.maximum, _ties)
case("min_ties", lambda f, x, y: f.min(x, y), torch.minimum, _ties)
case("mod", lambda f, x, y: f.mod(x, y), torch.fmod,
     lambda rng, dt: [rng.uniform(-5, 5, (3, 4)).astype(dt), rng.choice([-1.7, 0.9, 2.3], (4,)).astype(dt)])
case("pow_zero_base", lambda f, x, y: f.pow(x, y), torch.pow,
     lambda rng, dt: [np.array([0.0, 0.0, 0.0, 1.5, 2.0], dt), np.array([0.0, 2.0, 3.0, 0.0, 1.5], dt)])
case("where", lambda f, c, x, y: f.where(c, x, y), torch.where,
     lambda rng, dt: [rng.random((3, 4)) > 0.5, rng.standard_normal((4,)).astype(dt),
                      rng.standard_normal((3, 1)).astype(dt)])
case("mul_same_operand", lambda f, x: f.mul(x, x), lambda x: x * x, normal((3, 4)))

# --- reductions ------------------------------------------------------------------------------

for _axes in ([0], [1], [2], [0, 2], [0, 1, 2]):
    for _kd in (False, True):
        case(f"reduce_sum{_axes}{'_kd' if _kd else ''}".replace(" ", ""),
             lambda f, x, a=_axes, k=_kd: f.reduce_sum(x, axes=a, keepdims=k),
             lambda x, a=_axes, k=_kd: torch.sum(x, dim=a, keepdim=k), normal((2, 3, 4)))
        case(f"reduce_max{_axes}{'_kd' if _kd else ''}".replace(" ", ""),
             lambda f, x, a=_axes, k=_kd: f.reduce_max(x, axes=a, keepdims=k),
             lambda x, a=_axes, k=_kd: torch.amax(x, dim=a, keepdim=k), normal((2, 3, 4)))
        case(f"reduce_min{_axes}{'_kd' if _kd else ''}".replace(" ", ""),
             lambda f, x, a=_axes, k=_kd: f.reduce_min(x, axes=a, keepdims=k),
             lambda x, a=_axes, k=_kd: torch.amin(x, dim=a, keepdim=k), normal((2, 3, 4)))


def _tprod(x, axes, keepdim):
    for a in sorted(axes, reverse=True):
        x = torch.prod(x, dim=a, keepdim=True)
    return x if keepdim else x.reshape([d for i, d in enumerate(x.shape) if i not in axes])


for _axes in ([1], [0, 2]):
    case(f"reduce_prod{_axes}".replace(" ", ""), lambda f, x, a=_axes: f.reduce_prod(x, axes=a),
         lambda x, a=_axes: _tprod(x, a, False), normal((2, 3, 4)))
    case(f"reduce_prod_kd{_axes}".replace(" ", ""), lambda f, x, a=_axes: f.reduce_prod(x, axes=a, keepdims=True),
         lambda x, a=_axes: _tprod(x, a, True), normal((2, 3, 4)))


def _with_zeros(rng, dt):
    # rows with no zero, one zero, two zeros, all zeros
    x = rng.uniform(0.5, 2, (4, 5)).astype(dt)
    x[1, 2] = 0
    x[2, 0] = x[2, 3] = 0
    x[3, :] = 0
    return [x]


case("reduce_prod_zeros", lambda f, x: f.reduce_prod(x, axes=[1]), lambda x: torch.prod(x, dim=1), _with_zeros)
case("reduce_max_ties", lambda f, x: f.reduce_max(x, axes=[1]), lambda x: torch.amax(x, dim=1),
     lambda rng, dt: [rng.integers(0, 3, (4, 6)).astype(dt)])
case("reduce_min_ties_all", lambda f, x: f.reduce_min(x, axes=[0, 1]), lambda x: torch.amin(x, dim=(0, 1)),
     lambda rng, dt: [rng.integers(0, 2, (3, 4)).astype(dt)])
case("reduce_sum_scalar_loss", lambda f, x: f.reduce_sum(f.mul(x, x), axes=[0, 1]), lambda x: (x * x).sum(),
     normal((3, 4)), seed="ones")
for _axis in (0, 1, 2):
    case(f"cumsum{_axis}", lambda f, x, a=_axis: f.cumsum(x, axis=a), lambda x, a=_axis: torch.cumsum(x, a),
         normal((3, 4, 5)))

# --- movement ----------------------------------------------------------------------------------

case("reshape", lambda f, x: f.reshape(x, shape=[4, 1, 6]), lambda x: x.reshape(4, 1, 6), normal((2, 3, 4)))
case("permute", lambda f, x: f.permute(x, perm=[2, 0, 1]), lambda x: x.permute(2, 0, 1), normal((2, 3, 4)))
case("broadcast_to", lambda f, x: f.broadcast_to(x, shape=[2, 3, 4]), lambda x: x.expand(2, 3, 4), normal((3, 1)))
case("broadcast_to_rank0", lambda f, x: f.broadcast_to(x, shape=[2, 3]), lambda x: x.expand(2, 3), normal(()))
case("flip", lambda f, x: f.flip(x, axes=[0, 2]), lambda x: torch.flip(x, (0, 2)), normal((2, 3, 4)))
for _st, _sp, _step in [([0, 1, 0], [2, 3, 4], [1, 1, 1]), ([1, 0, 1], [2, 3, 4], [1, 2, 2]),
                        ([0, 0, 0], [2, 3, 4], [2, 3, 3]), ([0, 1, 1], [1, 3, 2], [1, 1, 5]),
                        ([0, 2, 0], [2, 3, 4], [1, 1, 2])]:
    case(f"slice{_st}{_sp}{_step}".replace(" ", ""), lambda f, x, a=_st, c=_sp, s=_step: f.slice(x, start=a, stop=c, step=s),
         lambda x, a=_st, c=_sp, s=_step: x[tuple(slice(i, j, k) for i, j, k in zip(a, c, s))], normal((2, 3, 4)))
case("slice_empty", lambda f, x: f.slice(x, start=[1, 0], stop=[1, 3], step=[1, 1]), lambda x: x[1:1, :],
     normal((2, 3)))
case("pad", lambda f, x: f.pad(x, low=[1, 0, 2], high=[0, 3, 1], value=1.5),
     lambda x: F.pad(x, (2, 1, 0, 3, 1, 0), value=1.5), normal((2, 3, 4)))
case("concat", lambda f, x, y, z: f.concat(x, y, z, axis=1), lambda x, y, z: torch.cat([x, y, z], 1),
     normal((2, 1, 3), (2, 4, 3), (2, 2, 3)))
case("concat_same", lambda f, x: f.concat(x, x, axis=0), lambda x: torch.cat([x, x], 0), normal((2, 3)))


def _take(x, idx, axis):
    flat = x.index_select(axis, idx.reshape(-1))
    return flat.reshape(x.shape[:axis] + idx.shape + x.shape[axis + 1:])


def _scatter(x, idx, upd, axis):
    return x.index_add(axis, idx.reshape(-1), upd.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 1:]))


for _axis, _idx in [(0, [2, 0, 2, 2]), (1, [[1, 1], [0, 3]]), (2, [0])]:
    case(f"gather_axis{_axis}", lambda f, x, i, a=_axis: f.gather(x, i, axis=a),
         lambda x, i, a=_axis: _take(x, i, a),
         lambda rng, dt, v=_idx: [rng.standard_normal((3, 4, 2)).astype(dt), ints(v)])
    case(f"scatter_add_axis{_axis}", lambda f, x, i, u, a=_axis: f.scatter_add(x, i, u, axis=a),
         lambda x, i, u, a=_axis: _scatter(x, i, u, a),
         lambda rng, dt, v=_idx, a=_axis: [
             rng.standard_normal((3, 4, 2)).astype(dt), ints(v),
             rng.standard_normal((3, 4, 2)[:a] + np.array(v).shape + (3, 4, 2)[a + 1:]).astype(dt)])

for _start in (1, -3, 7):  # in range, clamped low, clamped high
    case(f"dynamic_update_slice{_start}", lambda f, x, u, p: f.dynamic_update_slice(x, u, p, axis=1),
         lambda x, u, p: _dus(x, u, int(p), 1),
         lambda rng, dt, s=_start: [rng.standard_normal((2, 6, 3)).astype(dt),
                                    rng.standard_normal((2, 2, 3)).astype(dt), np.array(s, np.int32)])


for _start in (2, -1, 9):
    case(f"dynamic_slice{_start}", lambda f, x, p: f.dynamic_slice(x, p, axis=1, size=3),
         lambda x, p: x.narrow(1, min(max(int(p), 0), 3), 3),
         lambda rng, dt, s=_start: [rng.standard_normal((2, 6, 3)).astype(dt), np.array(s, np.int64)])


def _dus(x, u, s, axis):
    n = u.shape[axis]
    s = min(max(s, 0), x.shape[axis] - n)
    out = x.clone()
    out.narrow(axis, s, n).copy_(u)
    return out


# --- linear algebra --------------------------------------------------------------------------

for _sa, _sb in [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((3, 4), (2, 4, 5)), ((2, 1, 3, 4), (5, 4, 6)),
                 ((1, 3, 4), (2, 4, 1)), ((1, 1), (1, 1))]:
    case(f"matmul{list(_sa)}x{list(_sb)}".replace(" ", ""), lambda f, a, b: f.matmul(a, b), torch.matmul,
         normal(_sa, _sb))

# --- composites ------------------------------------------------------------------------------

for _axis in (0, 1, 2):
    case(f"softmax{_axis}", lambda f, x, a=_axis: f.softmax(x, axis=a), lambda x, a=_axis: torch.softmax(x, a),
         normal((2, 3, 4)))
    case(f"log_softmax{_axis}", lambda f, x, a=_axis: f.log_softmax(x, axis=a),
         lambda x, a=_axis: torch.log_softmax(x, a), normal((2, 3, 4)))
case("softmax_large", lambda f, x: f.softmax(x, axis=1), lambda x: torch.softmax(x, 1),
     lambda rng, dt: [(rng.standard_normal((3, 5)) * 30 + 500).astype(dt)])
case("layer_norm", lambda f, x: f.layer_norm(x), lambda x: F.layer_norm(x, (5,)), normal((2, 3, 5)))
case("layer_norm_affine", lambda f, x, w, c: f.layer_norm(x, w, c, eps=1e-3),
     lambda x, w, c: F.layer_norm(x, (5,), w, c, eps=1e-3), normal((2, 3, 5), (5,), (5,)))
case("layer_norm_rank1", lambda f, x, w, c: f.layer_norm(x, w, c), lambda x, w, c: F.layer_norm(x, (6,), w, c),
     normal((6,), (6,), (6,)))


def _sdpa(causal, scale, sq, sk, sv):
    return Case(f"sdpa{'_causal' if causal else ''}{'' if scale is None else '_scale'}_{sq[-2]}x{sk[-2]}",
                lambda f, q, k, v: f.scaled_dot_product_attention(q, k, v, causal=causal, scale=scale),
                lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale),
                normal(sq, sk, sv))


for _c in (False, True):
    for _s in (None, 0.3):
        CASES.append(_sdpa(_c, _s, (2, 3, 5, 4), (2, 3, 5, 4), (2, 3, 5, 6)))
CASES.append(_sdpa(True, None, (2, 4, 3), (2, 6, 3), (2, 6, 2)))   # L < S
CASES.append(_sdpa(True, None, (6, 3), (4, 3), (4, 5)))            # L > S

IDS = [c.id for c in CASES]
assert len(set(IDS)) == len(IDS), [i for i in IDS if IDS.count(i) > 1]


@pytest.mark.parametrize("dtype", ["f64", "f32"])
@pytest.mark.parametrize("c", CASES, ids=IDS)
def test_op_vjp(c: Case, dtype: str):
    check(c, dtype)


# --- end to end ------------------------------------------------------------------------------

def test_mlp_cross_entropy_against_torch():
    rng = np.random.default_rng(0)
    B, D, H, C = 8, 5, 16, 4
    x = rng.standard_normal((B, D))
    w1, b1 = rng.standard_normal((D, H)) * 0.5, rng.standard_normal(H) * 0.1
    w2, b2 = rng.standard_normal((H, C)) * 0.5, rng.standard_normal(C) * 0.1
    g, be = 1 + rng.standard_normal(H) * 0.1, rng.standard_normal(H) * 0.1
    labels = rng.integers(0, C, B)

    bld = ir.Builder()
    f = bld.func("loss")
    px, pw1, pb1, pg, pbe, pw2, pb2 = (f.param(ir.TensorType(ir.DTYPES["f64"], a.shape), name=n) for a, n in
                                       [(x, "x"), (w1, "w1"), (b1, "b1"), (g, "g"), (be, "be"), (w2, "w2"),
                                        (b2, "b2")])
    plab = f.param("i64[8]", name="labels")
    h = f.gelu(f.layer_norm(f.add(f.matmul(px, pw1), pb1), pg, pbe), approximate="tanh")
    logits = f.add(f.matmul(h, pw2), pb2)
    lp = f.log_softmax(logits, axis=1)
    # pick lp[i, labels[i]]: gather rows of the flattened log-probs at i*C + label
    flat = f.reshape(lp, shape=[B * C])
    pos = f.add(f.mul(f.iota(type="i64[8]", dim=0), f.full(type="i64[]", value=C)), plab)
    picked = f.gather(flat, pos, axis=0)
    loss = f.div(f.neg(f.reduce_sum(picked, axes=[0])), f.full(type="f64[]", value=float(B)))
    f.ret(loss, logits)
    m = bld.build()
    name = grad(m, "loss", wrt=[0, 1, 2, 3, 4, 5, 6, 7])
    got = run(m, name, [x, w1, b1, g, be, w2, b2, labels])

    ts = [torch.tensor(a, requires_grad=True) for a in (x, w1, b1, g, be, w2, b2)]
    tx, tw1, tb1, tg, tbe, tw2, tb2 = ts
    th = F.gelu(F.layer_norm(tx @ tw1 + tb1, (H,), tg, tbe), approximate="tanh")
    tlogits = th @ tw2 + tb2
    tloss = F.cross_entropy(tlogits, torch.tensor(labels))
    tloss.backward()
    np.testing.assert_allclose(got[0], tloss.item(), rtol=1e-10)
    np.testing.assert_allclose(got[1], tlogits.detach().numpy(), rtol=1e-10)
    for k, t in enumerate(ts):
        np.testing.assert_allclose(got[2 + k], t.grad.numpy(), rtol=1e-8, atol=1e-12)
    assert got[2 + 7].dtype == np.int64 and not got[2 + 7].any()  # labels: an integer param gets zeros
