"""Distributed tensors through the Tensor API (dtm.parallel): each op family on sharded
inputs, on a 1-D mesh of 2 and a 2 x 2 mesh, against the same code on plain tensors run by
the reference backend on one device; distribute / redistribute / full_tensor / local_shards
round trips, uneven dims included, against the spec's chunks computed here; gradients of
distributed leaves against torch; and the bad inputs, each a TensorError at the user's line
naming the tensor, the mesh and the placement.

The compiler level (every op, every placement) is tested in test_spmd_*.py; here each family
runs as one program with several placements at once, so the test stays fast.
"""

from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest
import torch

import dtm
import dtm.nn.functional as NF
from dtm import Partial, Replicate, Shard
from dtm.errors import ErrorCode as E, TensorError


@pytest.fixture(scope="module", autouse=True)
def four_devices():
    dtm.devices(4)


@pytest.fixture(scope="module")
def m1():
    return dtm.Mesh({"x": 2})


@pytest.fixture(scope="module")
def m2():
    return dtm.Mesh({"a": 2, "b": 2})


def grid(rng, shape, lo=-100, hi=100):
    return (rng.integers(lo, hi, shape) / 32).astype(np.float32)


def check(fn, arrays, placements, mesh, rtol=1e-5, atol=1e-5):
    """fn on distributed inputs (realized as one program on the mesh) equals fn on plain
    inputs run by the reference backend."""
    want = fn(*[dtm.tensor(a) for a in arrays])
    dtm.realize(*want, backend="ref")
    dist = [dtm.distribute(dtm.tensor(a), mesh, p) for a, p in zip(arrays, placements)]
    got = fn(*dist)
    dtm.realize(*got)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.device_mesh == mesh and g.placements is not None
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=rtol, atol=atol, err_msg=f"output {i}")
        np.testing.assert_allclose(g.full_tensor().numpy(), w.numpy(), rtol=rtol, atol=atol)


def elementwise(x, y, z):
    return [dtm.exp(x) * y + z, dtm.where(x > 0.5, x, -y), dtm.tanh(x) - dtm.sigmoid(z), (x * 2).to(dtm.float64),
            (x == z).to(dtm.int32), dtm.maximum(x, z) / (dtm.abs(y) + 1)]


def reductions(x):
    return [x.sum(1), dtm.amax(x, -1), x.mean(0), dtm.argmax(x, 1), x.sum()]


def matmuls(a, b, c):
    return [a @ b, dtm.matmul(a, c), (a @ b).sum(-1)]


def movement(x, y):
    return [x.reshape(2, 3, 4)[1], x.transpose(0, 1), x[1:3], dtm.cat([x, y], 0), dtm.flip(x, [1]),
            dtm.pad(x, (1, 2)), x.unsqueeze(0).expand(3, 6, 4), x.reshape(24)]


def composites(x, w, b):
    return [dtm.softmax(x, -1), dtm.layer_norm(x, (8,), w, b), dtm.gelu(x), dtm.log_softmax(x, 0)]


def attention(q, k, v):
    return [dtm.scaled_dot_product_attention(q, k, v, is_causal=True), dtm.scaled_dot_product_attention(q, k, v)]


def lookup(table, ids):
    return [NF.embedding(ids, table), NF.embedding(ids, table).sum(0)]


S0, S1, S2, R, P = Shard(0), Shard(1), Shard(2), Replicate(), Partial("sum")

# (fn, input shapes (None: int64 ids), placements on the 1-D mesh, placements on the 2 x 2 mesh)
FAMILIES = {
    "elementwise": (elementwise, [(5, 6), (6,), (5, 1)], [[S0], [S0], [P]], [[S0, S1], [R, S0], [S0, P]]),
    "reductions": (reductions, [(5, 6, 3)], [[S1]], [[S1, S0]]),
    "matmul": (matmuls, [(2, 5, 4), (4, 3), (2, 4, 3)], [[S2], [S0], [S0]], [[S1, S2], [R, S1], [S0, P]]),
    "movement": (movement, [(6, 4), (2, 4)], [[S0], [S1]], [[S1, S0], [S0, R]]),
    "composites": (composites, [(5, 8), (8,), (8,)], [[S1], [S0], [R]], [[S0, S1], [R, S0], [S0, R]]),
    "attention": (attention, [(2, 3, 5, 4)] * 3, [[S1], [S1], [S1]], [[S0, S1], [S0, R], [S0, S1]]),
    "lookup": (lookup, [(7, 5), None], [[S0], [R]], [[S0, S1], [R, S0]]),
}


@pytest.mark.parametrize("mesh_name", ["1d", "2d"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_op_families_on_sharded_inputs_equal_one_device(family, mesh_name, m1, m2):
    fn, shapes, p1, p2 = FAMILIES[family]
    rng = np.random.default_rng(zlib.crc32(family.encode()))
    # ids in range of the 7-row table: the front end refuses others, as torch does (the IR's
    # clamping of out-of-range indices under sharding is tested in test_spmd_ops)
    arrays = [grid(rng, s) if s is not None else rng.integers(0, 7, (3, 4)).astype(np.int64) for s in shapes]
    mesh, placements = (m1, p1) if mesh_name == "1d" else (m2, p2)
    check(fn, arrays, placements, mesh)


# --- round trips ---------------------------------------------------------------------------

def chunks(size: int, n: int) -> list[tuple[int, int]]:
    k = -(-size // n)
    return [(min(i * k, size), min((i + 1) * k, size)) for i in range(n)]


def pieces(x: np.ndarray, placements, sizes) -> list[np.ndarray]:
    """The spec's piece of every rank (row-major mesh order) for shard/replicate placements."""
    out = []
    for at in itertools.product(*(range(n) for n in sizes)):
        idx = [slice(None)] * x.ndim
        for c, n, p in zip(at, sizes, placements):
            if p.kind == "shard":
                lo, hi = chunks(x.shape[p.arg], n)[c]
                idx[p.arg] = slice(lo, hi)
        out.append(x[tuple(idx)])
    return out


def test_distribute_redistribute_round_trips_with_uneven_dims(m2):
    x = np.arange(5 * 3, dtype=np.float32).reshape(5, 3)
    t = dtm.distribute(dtm.tensor(x), m2, [S0, S1])
    assert t.placements == (S0, S1)
    assert [p.shape for p in t.local_shards()] == [(3, 2), (3, 1), (2, 2), (2, 1)]
    chain = [(R, S0), (S1, R), (S0, S1), (R, R), (S1, S0), (P, S1), (S0, R)]
    ys, y = [], t
    for pl in chain:
        y = y.redistribute(list(pl))
        ys.append(y)
    dtm.realize(*ys)  # one program: every pinned layout is honoured on the way
    for pl, y in zip(chain, ys):
        assert y.placements == pl
        np.testing.assert_array_equal(y.numpy(), x)
        if P not in pl:
            for got, want in zip(y.local_shards(), pieces(x, pl, (2, 2))):
                np.testing.assert_array_equal(got.numpy(), want)
    whole = ys[-1].full_tensor()
    assert whole.device_mesh is None and whole.placements is None
    np.testing.assert_array_equal(whole.numpy(), x)


def test_local_arrays_are_the_pieces_read_only_without_a_copy(m2):
    x = np.arange(5 * 3, dtype=np.float32).reshape(5, 3)
    t = dtm.distribute(dtm.tensor(x), m2, [S0, S1])
    arrays = t.local_arrays()
    for got, want in zip(arrays, pieces(x, (S0, S1), (2, 2))):
        np.testing.assert_array_equal(got, want)
        assert not got.flags.writeable  # (a view of the tensor's own memory: the tensor stays as it is)
    assert all(np.shares_memory(a, s) for a, s in zip(t.local_arrays(), arrays))  # no copy
    plain = dtm.tensor(x)
    [whole] = plain.local_arrays()
    np.testing.assert_array_equal(whole, x)
    with pytest.raises(ValueError):
        whole[0, 0] = 1


def test_partial_pieces_add_up(m1):
    x = np.arange(6, dtype=np.float32)
    t = dtm.distribute(dtm.tensor(x), m1, [P])
    a, b = (p.numpy() for p in t.local_shards())
    np.testing.assert_array_equal(a + b, x)
    np.testing.assert_array_equal(b, np.zeros_like(x))  # the identity of sum off coordinate 0
    np.testing.assert_array_equal((t * 3).redistribute([R]).local_shards()[1].numpy(), 3 * x)


def test_placements_of_a_pending_tensor_are_propagated(m1):
    a = dtm.distribute(dtm.ones(4, 6), m1, [S1])
    b = dtm.distribute(dtm.ones(6, 2), m1, [S0])
    assert (a @ b).placements == (P,)  # contraction dim sharded on both sides
    assert dtm.exp(a).placements == (S1,)


def test_plain_tensors_join_as_replicated(m2):
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    t = dtm.distribute(dtm.tensor(x), m2, {"b": S0})
    assert t.placements == (R, S0)
    y = t + dtm.tensor(np.ones(3, np.float32))
    np.testing.assert_array_equal(y.numpy(), x + 1)


def test_sub_meshes_by_axis_name(m2):
    assert [str(d) for d in m2["b"].devices] == ["cpu:0", "cpu:1"]  # along b, at a = 0
    assert [str(d) for d in m2.submesh("b", a=1).devices] == ["cpu:2", "cpu:3"]
    assert [str(d) for d in m2["a"].devices] == ["cpu:0", "cpu:2"]
    assert [str(d) for d in m2["b", "a"].devices] == ["cpu:0", "cpu:2", "cpu:1", "cpu:3"]  # b varies slowest
    sub = m2.submesh("b", a=1)
    t = dtm.distribute(dtm.arange(6, dtype=dtm.float32), sub, [S0])
    np.testing.assert_array_equal((t * 2).numpy(), np.arange(6) * 2)
    assert (t * 2).device_mesh == sub != m2["b"]


def test_assigning_a_whole_value_keeps_the_layout(m1):
    lin = dtm.nn.Linear(4, 6)
    from dtm.parallel.dtensor import place

    place(lin.weight, m1, {"x": S0}, "weight")
    new = np.arange(24, dtype=np.float32).reshape(6, 4)
    lin.load_state_dict({"weight": new, "bias": np.zeros(6, np.float32)})
    assert lin.weight.placements == (S0,) and lin.bias.device_mesh is None
    np.testing.assert_array_equal(lin.weight.local_shards()[1].numpy(), new[3:])


# --- gradients ---------------------------------------------------------------------------

def test_distributing_a_tensor_with_history_keeps_it(m1):
    x = dtm.tensor(np.arange(6, dtype=np.float32), requires_grad=True)
    d = dtm.distribute(x * 3, m1, [S0])
    assert d.placements == (S0,)
    (d * d).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 18 * np.arange(6))
    assert x.grad.device_mesh is None


@pytest.mark.parametrize("mesh_name", ["1d", "2d"])
def test_gradients_of_distributed_leaves_keep_their_placements(mesh_name, m1, m2):
    rng = np.random.default_rng(3)
    xa, wa, ba = grid(rng, (6, 5)), grid(rng, (5, 4)), grid(rng, (4,))
    mesh, (px, pw, pb) = (m1, ([S0], [S1], [S0])) if mesh_name == "1d" else (m2, ([S0, R], [R, S1], [P, S0]))
    x = dtm.distribute(dtm.tensor(xa, requires_grad=True), mesh, px)
    w = dtm.distribute(dtm.tensor(wa, requires_grad=True), mesh, pw)
    b = dtm.distribute(dtm.tensor(ba, requires_grad=True), mesh, pb)
    loss = (dtm.tanh(x @ w + b) ** 2).mean()
    loss.backward()
    tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (xa, wa, ba))
    tloss = (torch.tanh(tx @ tw + tb) ** 2).mean()
    tloss.backward()
    assert abs(loss.item() - tloss.item()) < 1e-6
    for leaf, t, pl in ((x, tx, px), (w, tw, pw), (b, tb, pb)):
        assert leaf.grad.placements == tuple(pl)
        np.testing.assert_allclose(leaf.grad.numpy(), t.grad.numpy(), rtol=1e-5, atol=1e-6)


# --- bad input -----------------------------------------------------------------------------

def raises_here(code: E, *words: str):
    """A context expecting TensorError `code` reported at the caller's file, naming `words`."""
    class Expect:
        def __enter__(self):
            self.ctx = pytest.raises(TensorError)
            self.info = self.ctx.__enter__()

        def __exit__(self, *exc):
            self.ctx.__exit__(*exc)
            e = self.info.value
            assert e.code is code, e
            assert e.where and e.where.startswith(__file__), e.where
            for w in words:
                assert w in e.message, (w, e.message)
            return True
    return Expect()


def test_bad_input_is_an_error_at_the_users_line(m1, m2):
    x = dtm.tensor(np.zeros((5, 3), np.float32))
    with raises_here(E.SHARD_DIM_OUT_OF_RANGE, "f32[5, 3]", "shard(2)", "mesh"):
        dtm.distribute(x, m1, [Shard(2)])
    with raises_here(E.DIM_SHARDED_TWICE, "f32[5, 3]", "shard(0)", "'a'", "'b'"):
        dtm.distribute(x, m2, [S0, S0])
    with raises_here(E.PLACEMENT_COUNT, "f32[5, 3]", "2 mesh axes"):
        dtm.distribute(x, m2, [S0])
    with raises_here(E.UNKNOWN_MESH_AXIS, "'tp'"):
        dtm.distribute(x, m2, {"tp": S0})
    with raises_here(E.INVALID_PLACEMENT, "partial(median)"):
        dtm.distribute(x, m1, [Partial("median")])
    with raises_here(E.MESH_TOO_LARGE, "8 devices", "has 4"):
        dtm.Mesh({"dp": 2, "tp": 4})
    a = dtm.distribute(x, m1, [S0])
    other = dtm.Mesh({"x": 2}, devices=[2, 3])
    b = dtm.distribute(x, other, [S1])
    with raises_here(E.MESH_MISMATCH, "f32[5, 3]", "shard(0)", "shard(1)", "cpu:0", "cpu:2"):
        a + b
    with raises_here(E.MESH_MISMATCH, "cpu:0", "cpu:2"):
        dtm.distribute(a, other, [R])
    with raises_here(E.SHARD_DIM_OUT_OF_RANGE, "f32[5, 3]", "shard(3)"):
        a.redistribute([Shard(3)])
    with raises_here(E.INVALID_PLACEMENT, "not distributed"):
        x.redistribute([R])
