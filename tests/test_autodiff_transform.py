"""The autodiff transform itself: the VJP table covers the registry, the shape of the
function `grad` builds, accumulation, zero gradients, effects and `assign`, `call`,
symbolic dims, and the collectives' rules run on several ranks against torch."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dtm.ir as ir
from dtm.compiler import autodiff
from dtm.compiler.autodiff import NON_DIFFERENTIABLE, VJP, AutodiffError, grad
from dtm.errors import DTMError, ErrorCode as E
from dtm.ir.symbolic import sym
from dtm.ref.collectives import result as collective_result
from dtm.ref.context import RefContext
from dtm.ref.interpreter import run
from test_store_programs import fresh

f64 = ir.DTYPES["f64"]


# --- the table -------------------------------------------------------------------------------

def test_every_registry_op_has_a_rule_or_is_non_differentiable():
    missing = [n for n in ir.REGISTRY if n not in VJP and n not in NON_DIFFERENTIABLE]
    assert not missing, f"ops with neither a VJP rule nor a place in NON_DIFFERENTIABLE: {missing}"


def test_rules_name_registry_ops_and_never_both():
    assert set(VJP) <= set(ir.REGISTRY), set(VJP) - set(ir.REGISTRY)
    assert NON_DIFFERENTIABLE <= set(ir.REGISTRY), NON_DIFFERENTIABLE - set(ir.REGISTRY)
    assert not set(VJP) & NON_DIFFERENTIABLE


def test_non_differentiable_ops_are_the_expected_ones():
    assert NON_DIFFERENTIABLE == {
        "sign", "floor", "ceil", "round", "logical_not", "bitcast", "logical_and", "logical_or", "logical_xor",
        "eq", "ne", "lt", "le", "gt", "ge", "argmax", "argmin", "argsort", "constant", "full", "iota", "random",
        "assign", "barrier", "send", "recv", "store_get", "store_put"}


# --- the function grad builds ----------------------------------------------------------------

def _two_outputs():
    b = ir.Builder()
    f = b.func("f")
    x, w, n, u = f.param("f64[3, 4]", name="x"), f.param("f64[4]", name="w"), f.param("i64[3]", name="n"), \
        f.param("f64[2]", name="u")
    y = f.mul(x, w)
    s = f.reduce_sum(f.mul(y, y), axes=[0, 1])
    f.ret(y, s, n)
    return b.build()


def test_signature_and_results():
    m = _two_outputs()
    assert grad(m, "f", [0, 1, 2, 3], out_index=1) == "f_grad"
    g = m.funcs["f_grad"]
    assert [p.type for p in g.params] == [p.type for p in m.funcs["f"].params]
    assert [str(t) for t, _ in g.result_types] == ["f64[3, 4]", "f64[]", "i64[3]", "f64[3, 4]", "f64[4]",
                                                   "i64[3]", "f64[2]"]
    ir.verify(m)
    x, w, n, u = np.arange(12.0).reshape(3, 4), np.array([1.0, -2.0, 0.5, 3.0]), np.arange(3), np.ones(2)
    y, s, n2, gx, gw, gn, gu = run(m, "f_grad", [x, w, n, u])
    np.testing.assert_allclose(s, np.sum((x * w) ** 2))
    np.testing.assert_allclose(gx, 2 * x * w * w)
    np.testing.assert_allclose(gw, np.sum(2 * x * x * w, axis=0))
    assert gn.dtype == np.int64 and not gn.any()      # an integer param: zeros of its type
    assert gu.dtype == np.float64 and not gu.any()    # a param the output does not depend on: zeros
    # The text form round-trips, and the copy did not touch the original function.
    assert ir.parse(ir.format(m)) == m
    assert len(m.funcs["f"].ops) == 3


def test_seed_param_and_new_name():
    m = _two_outputs()
    name = grad(m, "f", [1], out_index=0, seed="param", new_name="vjp_w")
    assert name == "vjp_w"
    g = m.funcs[name]
    assert len(g.params) == 5 and str(g.params[-1].type) == "f64[3, 4]"
    x, w, ct = np.random.default_rng(1).standard_normal((3, 3, 4))
    w = w[0]
    out = run(m, name, [x, w, np.arange(3), np.ones(2), ct])
    np.testing.assert_allclose(out[-1], np.sum(ct * x, axis=0))


def test_errors():
    m = _two_outputs()
    grad(m, "f", [0])
    with pytest.raises(AutodiffError) as e:
        grad(m, "f", [0])
    assert e.value.code is E.DUPLICATE_SYMBOL
    with pytest.raises(AutodiffError) as e:
        grad(m, "nope", [0])
    assert e.value.code is E.UNDEFINED_FUNC
    for bad in ([4], [-1], ["x"]):
        with pytest.raises(AutodiffError) as e:
            grad(m, "f", bad, new_name="g1")
        assert e.value.code is E.ATTRIBUTE_VALUE
    with pytest.raises(AutodiffError) as e:
        grad(m, "f", [0], out_index=2, new_name="g2")      # an integer output
    assert e.value.code is E.DTYPE_MISMATCH
    with pytest.raises(AutodiffError):
        grad(m, "f", [0], out_index=3, new_name="g3")
    with pytest.raises(AutodiffError):
        grad(m, "f", [0], seed="zeros", new_name="g4")
    assert set(m.funcs) == {"f", "f_grad"}  # failures leave nothing behind
    assert isinstance(e.value, DTMError)


def test_uses_accumulate_and_dead_backward_code_is_removed():
    b = ir.Builder()
    f = b.func("f")
    x, c = f.param("f64[5]", name="x"), f.param("f64[5]", name="c")
    a = f.sin(x)
    y = f.add(f.mul(a, x), f.add(f.exp(x), f.mul(c, x)))   # x used four times, c only as a factor
    f.ret(f.reduce_sum(y, axes=[0]))
    m = b.build()
    grad(m, "f", [0])
    g = m.funcs["f_grad"]
    # c's cotangent (ct * x) is not wanted: every backward op's result is used
    fwd = len(m.funcs["f"].ops)
    used = set(g.returns) | {v for op in g.ops for v in op.operands}
    assert all(r in used for op in g.ops[fwd:] for r in op.results)
    xv, cv = np.linspace(-1, 1, 5), np.linspace(2, 3, 5)
    gx = run(m, "f_grad", [xv, cv])[1]
    np.testing.assert_allclose(gx, np.cos(xv) * xv + np.sin(xv) + np.exp(xv) + cv)


def test_output_is_a_param_and_output_is_independent():
    b = ir.Builder()
    f = b.func("f")
    x, y = f.param("f64[2]", name="x"), f.param("f64[2]", name="y")
    f.ret(x, f.full(type="f64[]", value=2.0))
    m = b.build()
    grad(m, "f", [0, 1], seed="param")
    out = run(m, "f_grad", [np.ones(2), np.ones(2), np.array([3.0, 4.0])])
    np.testing.assert_allclose(out[2], [3.0, 4.0])
    np.testing.assert_allclose(out[3], [0.0, 0.0])
    grad(m, "f", [0], out_index=1, new_name="g2")
    out = run(m, "g2", [np.ones(2), np.ones(2)])
    np.testing.assert_allclose(out[2], [0.0, 0.0])


def test_effects_are_copied_in_order_and_not_differentiated():
    b = ir.Builder()
    f = b.func("f")
    x = f.param("f64[3]", name="x")
    f.store_put(x, key="a")
    y = f.store_get(type="f64[3]", key="a")
    z = f.mul(x, y)                           # y comes from the store: a constant to autodiff
    f.store_put(z, key="b")
    f.ret(f.reduce_sum(z, axes=[0]))
    m = b.build()
    grad(m, "f", [0])
    g = m.funcs["f_grad"]
    effects = [(op.name, op.attrs["key"]) for op in g.ops if ir.REGISTRY[op.name].effect]
    assert effects == [("store_put", "a"), ("store_get", "a"), ("store_put", "b")]
    ctx = RefContext(store=fresh())
    xv = np.array([1.0, 2.0, 3.0])
    out = run(m, "f_grad", [xv], ctx)
    np.testing.assert_allclose(out[1], xv)   # d(x * stop_gradient(x)) / dx
    np.testing.assert_allclose(ctx.store.get_array("b"), xv * xv)


def test_assign_target_is_differentiated_only_before_the_assign():
    # an SGD step on w, after the loss used w: the backward pass needs w's old value
    b = ir.Builder()
    f = b.func("step")
    w, x = f.param("f64[3]", name="w"), f.param("f64[3]", name="x")
    y = f.mul(w, x)
    loss = f.reduce_sum(f.mul(y, y), axes=[0])
    f.assign(w, f.sub(w, f.mul(x, f.full(type="f64[]", value=0.1))))
    f.ret(loss)
    m = b.build()
    grad(m, "step", [0, 1])
    ir.verify(m)
    g = m.funcs["step_grad"]
    assert [op.name for op in g.ops].count("assign") == 1
    wv, xv = np.array([1.0, -2.0, 3.0]), np.array([0.5, 0.25, -1.0])
    w_in = wv.copy()
    loss_v, gw, gx = run(m, "step_grad", [w_in, xv])
    np.testing.assert_allclose(w_in, wv - 0.1 * xv)          # the assign ran, in place
    np.testing.assert_allclose(loss_v, np.sum((wv * xv) ** 2))
    np.testing.assert_allclose(gw, 2 * wv * xv * xv)
    np.testing.assert_allclose(gx, 2 * wv * wv * xv)          # needs w before the assign


def test_call_is_differentiated_through_a_vjp_function():
    b = ir.Builder()
    inner = b.func("inner")
    a, k, s = inner.param("f64[2, 3]", name="a"), inner.param("i64[2]", name="k"), inner.param("f64[3]", name="s")
    h = inner.tanh(inner.mul(a, s))
    inner.ret(h, inner.gather(h, k, axis=0), k)
    f = b.func("f")
    x, idx, w = f.param("f64[2, 3]", name="x"), f.param("i64[2]", name="idx"), f.param("f64[3]", name="w")
    r1, r2, _ = f.call(x, idx, w, callee="inner")
    r3 = f.call(r1, idx, w, callee="inner")[0]          # the callee twice: one vjp function
    f.ret(f.reduce_sum(f.add(f.mul(r2, r2), r3), axes=[0, 1]))
    m = b.build()
    grad(m, "f", [0, 2])
    assert "inner_vjp" in m.funcs and sum(n.startswith("inner_vjp") for n in m.funcs) == 1
    rng = np.random.default_rng(3)
    xv, wv, iv = rng.standard_normal((2, 3)), rng.standard_normal(3), np.array([1, 1])
    out = run(m, "f_grad", [xv, iv, wv])
    tx, tw = torch.tensor(xv, requires_grad=True), torch.tensor(wv, requires_grad=True)
    h1 = torch.tanh(tx * tw)
    h2 = torch.tanh(h1 * tw)
    loss = ((h1[torch.tensor(iv)] ** 2) + h2).sum()
    loss.backward()
    np.testing.assert_allclose(out[0], loss.item())
    np.testing.assert_allclose(out[1], tx.grad.numpy())
    np.testing.assert_allclose(out[2], tw.grad.numpy())


def test_call_of_a_function_with_effects_is_refused():
    b = ir.Builder()
    inner = b.func("inner")
    a = inner.param("f64[2]", name="a")
    inner.store_put(a, key="k")
    inner.ret(inner.exp(a))
    f = b.func("f")
    x = f.param("f64[2]", name="x")
    f.ret(f.reduce_sum(f.call(x, callee="inner"), axes=[0]))
    m = b.build()
    with pytest.raises(AutodiffError):
        grad(m, "f", [0])
    assert set(m.funcs) == {"inner", "f"}


def test_cast_to_integer_stops_the_gradient():
    b = ir.Builder()
    f = b.func("f")
    x = f.param("f64[3]", name="x")
    i = f.cast(x, to="i32")
    y = f.mul(f.cast(i, to="f64"), x)
    f.ret(f.reduce_sum(y, axes=[0]))
    m = b.build()
    grad(m, "f", [0])
    xv = np.array([1.5, -2.5, 3.2])
    np.testing.assert_allclose(run(m, "f_grad", [xv])[1], np.trunc(xv))


def test_narrow_float_dtypes():
    b = ir.Builder()
    f = b.func("f")
    x = f.param("bf16[4]", name="x")
    y = f.mul(f.exp(x), f.cast(f.cast(x, to="f32"), to="bf16"))
    f.ret(f.reduce_sum(y, axes=[0]))
    m = b.build()
    grad(m, "f", [0])
    assert str(m.funcs["f_grad"].result_types[1][0]) == "bf16[4]"
    xv = np.array([0.5, -1.0, 0.25, 2.0], dtype=ir.dtypes.numpy_dtype(ir.DTYPES["bf16"]))
    g = run(m, "f_grad", [xv])[1].astype(np.float64)
    w = xv.astype(np.float64)
    np.testing.assert_allclose(g, np.exp(w) * (w + 1), rtol=3e-2)


# --- symbolic dims -------------------------------------------------------------------------

def test_symbolic_dims():
    B, T = sym("B"), sym("T")
    b = ir.Builder()
    f = b.func("f")
    x = f.param(ir.TensorType(f64, (B, T, 4)), name="x")
    w, c = f.param("f64[4]", name="w"), f.param("f64[4]", name="c")
    q = f.param(ir.TensorType(f64, (B, T, T)), name="q")
    h = f.layer_norm(x, w, c)
    a = f.scaled_dot_product_attention(q, q, h, causal=True)          # default scale 1/sqrt(T)
    s = f.slice(a, start=[0, 1, 0], stop=[B, T, 4], step=[1, 1, 1])    # symbolic stop and size
    m2 = f.reduce_max(s, axes=[1])
    f.ret(f.reduce_sum(f.mul(m2, m2), axes=[0, 1]))
    m = b.build()
    grad(m, "f", [0, 1, 2, 3])
    rng = np.random.default_rng(5)
    xv, wv, cv, qv = rng.standard_normal((3, 5, 4)), rng.standard_normal(4), rng.standard_normal(4), \
        rng.standard_normal((3, 5, 5))
    out = run(m, "f_grad", [xv, wv, cv, qv])
    ts = [torch.tensor(v, requires_grad=True) for v in (xv, wv, cv, qv)]
    tx, tw, tc, tq = ts
    th = F.layer_norm(tx, (4,), tw, tc)
    ta = F.scaled_dot_product_attention(tq, tq, th, is_causal=True)
    tm = torch.amax(ta[:, 1:, :], dim=1)
    loss = (tm * tm).sum()
    loss.backward()
    np.testing.assert_allclose(out[0], loss.item(), rtol=1e-10)
    for k, t in enumerate(ts):
        np.testing.assert_allclose(out[1 + k], t.grad.numpy(), rtol=1e-8, atol=1e-12)


def test_symbolic_pad_concat_dynamic_update_slice():
    B = sym("B")
    b = ir.Builder()
    f = b.func("f")
    x, u = f.param(ir.TensorType(f64, (B, 3)), name="x"), f.param(ir.TensorType(f64, (2, 3)), name="u")
    p = f.param("i64[]", name="p")
    y = f.dynamic_update_slice(f.pad(f.concat(x, x, axis=0), low=[1, 0], high=[0, 2], value=0.0),
                               f.pad(u, low=[0, 0], high=[0, 2], value=0.0), p, axis=0)
    z = f.slice(y, start=[1, 0], stop=[y.type.shape[0], 5], step=[1, 1])
    f.ret(f.mul(z, z))
    m = b.build()
    grad(m, "f", [0, 1], seed="param")
    rng = np.random.default_rng(6)
    xv, uv = rng.standard_normal((4, 3)), rng.standard_normal((2, 3))
    for pv in (0, 3, 100):
        ct = rng.standard_normal((8, 5))
        out = run(m, "f_grad", [xv, uv, np.array(pv), ct])
        tx, tu = torch.tensor(xv, requires_grad=True), torch.tensor(uv, requires_grad=True)
        ty = F.pad(torch.cat([tx, tx], 0), (0, 2, 1, 0)).clone()
        s = min(pv, ty.shape[0] - 2)
        ty[s:s + 2] = F.pad(tu, (0, 2))
        tz = ty[1:]
        (tz * tz).backward(torch.tensor(ct))
        np.testing.assert_allclose(out[1], tx.grad.numpy())
        np.testing.assert_allclose(out[2], tu.grad.numpy())


def test_dynamic_slice():
    b = ir.Builder()
    f = b.func("f")
    x, p = f.param("f64[3, 6]", name="x"), f.param("i32[]", name="p")
    y = f.dynamic_slice(x, p, axis=1, size=2)
    f.ret(y)
    m = b.build()
    grad(m, "f", [0], seed="param")
    rng = np.random.default_rng(7)
    xv = rng.standard_normal((3, 6))
    for pv in (-2, 1, 4, 9):
        ct = rng.standard_normal((3, 2))
        s = min(max(pv, 0), 4)
        want = np.zeros((3, 6))
        want[:, s:s + 2] = ct
        np.testing.assert_allclose(run(m, "f_grad", [xv, np.array(pv, np.int32), ct])[1], want)


# --- collectives on several ranks ----------------------------------------------------------

class ThreadComm:
    """The smallest in-process device group: every member's contribution is gathered, then
    each computes its result with the reference's meaning of the collective."""

    def __init__(self):
        self.cond = threading.Condition()
        self.slots: dict = {}
        self.seq: dict = {}

    def collective(self, name, attrs, x, group, index, rank, timeout):
        with self.cond:
            n = self.seq.get((rank, group), 0)
            self.seq[(rank, group)] = n + 1
            slot = self.slots.setdefault((group, n), {})
            slot[rank] = (name, np.array(x, copy=True))
            self.cond.notify_all()
            if not self.cond.wait_for(lambda: len(slot) == len(group), timeout):
                raise TimeoutError(f"rank {rank}: {name} timed out")
            assert len({o for o, _ in slot.values()}) == 1, slot
            xs = [slot[r][1] for r in group]
        return collective_result(name, attrs, xs, index)


def run_ranks(module, func, per_rank_inputs):
    comm, results, errors = ThreadComm(), {}, []

    def work(r):
        try:
            results[r] = run(module, func, per_rank_inputs[r], RefContext(rank=r, comm=comm, timeout=20.0))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(len(per_rank_inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return [results[r] for r in range(len(per_rank_inputs))]


N = 3


def _torch_collective(name, attrs, xs):
    """Every rank's output of collective `name` over all N ranks, in torch."""
    if name == "all_reduce":
        st = torch.stack(xs)
        red = {"sum": lambda: st.sum(0), "avg": lambda: st.mean(0), "max": lambda: torch.amax(st, 0),
               "min": lambda: torch.amin(st, 0), "prod": lambda: torch.prod(st, 0)}[attrs["op"]]()
        return [red] * N
    if name == "all_gather":
        return [torch.cat(xs, attrs["dim"])] * N
    if name == "reduce_scatter":
        st = torch.stack(xs)
        full = {"sum": lambda: st.sum(0), "avg": lambda: st.mean(0), "max": lambda: torch.amax(st, 0),
                "min": lambda: torch.amin(st, 0), "prod": lambda: torch.prod(st, 0)}[attrs["op"]]()
        return list(torch.chunk(full, N, attrs["dim"]))
    if name == "all_to_all":
        s, c = attrs["split_dim"], attrs["concat_dim"]
        return [torch.cat([torch.chunk(x, N, s)[j] for x in xs], c) for j in range(N)]
    if name == "broadcast":
        return [xs[attrs["src"]]] * N
    raise AssertionError(name)


COLLECTIVES = [
    ("all_reduce", {"op": "sum"}, (2, 6)), ("all_reduce", {"op": "avg"}, (2, 6)),
    ("all_reduce", {"op": "max"}, (2, 6)), ("all_reduce", {"op": "min"}, (2, 6)),
    ("all_reduce", {"op": "prod"}, (2, 6)),
    ("all_gather", {"dim": 1}, (2, 6)), ("all_gather", {"dim": 0}, (2, 6)),
    ("reduce_scatter", {"dim": 1, "op": "sum"}, (2, 6)), ("reduce_scatter", {"dim": 0, "op": "avg"}, (3, 2)),
    ("reduce_scatter", {"dim": 1, "op": "max"}, (2, 6)), ("reduce_scatter", {"dim": 1, "op": "prod"}, (2, 6)),
    ("all_to_all", {"split_dim": 1, "concat_dim": 0}, (2, 6)),
    ("all_to_all", {"split_dim": 0, "concat_dim": 1}, (3, 6)),
    ("broadcast", {"src": 1}, (2, 6)),
]


COLLECTIVE_CASES = [(n, a, s, False) for n, a, s in COLLECTIVES] + [
    (n, a, s, True) for n, a, s in COLLECTIVES if a.get("op") in ("max", "min")]  # ties: integer inputs


@pytest.mark.parametrize("name,attrs,shape,ties", COLLECTIVE_CASES,
                         ids=[f"{n}-{a}{'-ties' if t else ''}" for n, a, _, t in COLLECTIVE_CASES])
def test_collective_vjp_on_ranks(name, attrs, shape, ties):
    b = ir.Builder()
    b.mesh("m", r=N)
    f = b.func("f")
    x = f.param(ir.TensorType(f64, shape), name="x")
    y = f.op(name, f.sin(x), mesh="m", axes=["r"], **attrs)
    f.ret(y)
    m = b.build()
    grad(m, "f", [0], seed="param")
    rng = np.random.default_rng(8)
    xs = [rng.integers(0, 2, shape).astype(np.float64) if ties else rng.standard_normal(shape) for _ in range(N)]
    ts = [torch.tensor(v, requires_grad=True) for v in xs]
    outs = _torch_collective(name, attrs, [torch.sin(t) for t in ts])
    cts = [rng.standard_normal(tuple(o.shape)) for o in outs]
    sum(torch.sum(o * torch.tensor(c)) for o, c in zip(outs, cts)).backward()
    got = run_ranks(m, "f_grad", [[xv, c] for xv, c in zip(xs, cts)])
    for r in range(N):
        np.testing.assert_allclose(got[r][0], outs[r].detach().numpy(), rtol=1e-12)
        if name == "broadcast" and r != attrs["src"]:
            continue  # the rule's result is meaningful on src only (its true gradient elsewhere is 0)
        np.testing.assert_allclose(got[r][1], ts[r].grad.numpy(), rtol=1e-10, atol=1e-12,
                                   err_msg=f"rank {r}")


def test_collective_over_one_axis_of_a_2d_mesh():
    b = ir.Builder()
    b.mesh("m", dp=2, tp=2)
    f = b.func("f")
    x = f.param("f64[4]", name="x")
    y = f.all_gather(f.all_reduce(f.mul(x, x), mesh="m", axes=["tp"]), mesh="m", axes=["dp"], dim=0)
    f.ret(y)
    m = b.build()
    grad(m, "f", [0], seed="param")
    rng = np.random.default_rng(9)
    xs, cts = [rng.standard_normal(4) for _ in range(4)], [rng.standard_normal(8) for _ in range(4)]
    got = run_ranks(m, "f_grad", [[xv, c] for xv, c in zip(xs, cts)])
    ts = [torch.tensor(v, requires_grad=True) for v in xs]
    sq = [t * t for t in ts]
    red = {r: sq[2 * (r // 2)] + sq[2 * (r // 2) + 1] for r in range(4)}      # tp groups: [0, 1], [2, 3]
    outs = {r: torch.cat([red[r % 2], red[r % 2 + 2]]) for r in range(4)}     # dp groups: [0, 2], [1, 3]
    sum(torch.sum(outs[r] * torch.tensor(cts[r])) for r in range(4)).backward()
    for r in range(4):
        np.testing.assert_allclose(got[r][0], outs[r].detach().numpy())
        np.testing.assert_allclose(got[r][1], ts[r].grad.numpy())


def test_module_exports():
    assert autodiff.__all__ and callable(autodiff.grad) and callable(autodiff.vjp_function)
