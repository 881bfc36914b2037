"""dtm.shard_map (the local view) and its explicit collectives, on a 2 x 2 mesh of in-process
devices, against numpy: each rank's piece is cut here by the spec's chunks, each collective
computed here from the spec's group definition (2.6, 3.11)."""

from __future__ import annotations

import numpy as np
import pytest

import dtm
from dtm import Partial, Replicate, Shard
from dtm.errors import ErrorCode as E, TensorError


@pytest.fixture(scope="module", autouse=True)
def four_devices():
    dtm.devices(4)


@pytest.fixture(scope="module")
def mesh():
    return dtm.Mesh({"dp": 2, "tp": 2})


X = np.arange(4 * 8, dtype=np.float32).reshape(4, 8) / 4
SPEC = {"dp": Shard(0), "tp": Shard(1)}  # rank (d, t) holds rows 2d.., columns 4t..


def piece(d: int, t: int) -> np.ndarray:
    return X[2 * d:2 * d + 2, 4 * t:4 * t + 4]


def run(mesh, fn, out_spec):
    return dtm.shard_map(fn, mesh, in_specs=(SPEC,), out_specs=out_spec)(dtm.tensor(X))


def test_all_reduce(mesh):
    y = run(mesh, lambda a: dtm.all_reduce(a, axis="tp"), {"dp": Shard(0)})
    want = np.concatenate([piece(d, 0) + piece(d, 1) for d in range(2)])
    assert y.placements == (Shard(0), Replicate())
    np.testing.assert_array_equal(y.numpy(), want)
    for r, p in enumerate(y.local_shards()):
        np.testing.assert_array_equal(p.numpy(), piece(r // 2, 0) + piece(r // 2, 1))


def test_all_reduce_max_over_both_axes(mesh):
    y = run(mesh, lambda a: dtm.all_reduce(a, op="max", axis=("dp", "tp")), Replicate())
    np.testing.assert_array_equal(y.numpy(), np.maximum.reduce([piece(d, t) for d in range(2) for t in range(2)]))


def test_all_gather(mesh):
    y = run(mesh, lambda a: dtm.all_gather(a, dim=0, axis="dp"), {"tp": Shard(1)})
    np.testing.assert_array_equal(y.numpy(), X)
    assert [p.shape for p in y.local_shards()] == [(4, 4)] * 4


def test_reduce_scatter(mesh):
    y = run(mesh, lambda a: dtm.reduce_scatter(a, dim=1, axis="tp"), SPEC)
    for r, p in enumerate(y.local_shards()):
        d, t = divmod(r, 2)
        total = piece(d, 0) + piece(d, 1)
        np.testing.assert_array_equal(p.numpy(), total[:, 2 * t:2 * t + 2])


def test_all_to_all(mesh):
    # rank (d, t) sends column block j of its piece to tp rank j and stacks what it gets by rows
    y = run(mesh, lambda a: dtm.all_to_all(a, split_dim=1, concat_dim=0, axis="tp"), SPEC)
    for r, p in enumerate(y.local_shards()):
        d, t = divmod(r, 2)
        want = np.concatenate([piece(d, s)[:, 2 * t:2 * t + 2] for s in range(2)], axis=0)
        np.testing.assert_array_equal(p.numpy(), want)


def test_broadcast(mesh):
    y = run(mesh, lambda a: dtm.broadcast(a, src=1, axis="dp"), {"tp": Shard(1)})
    np.testing.assert_array_equal(y.numpy(), X[2:, :].reshape(2, 8))


def test_megatron_mlp_in_the_local_view(mesh):
    rng = np.random.default_rng(0)
    x, w1, w2 = (rng.integers(-8, 8, s).astype(np.float32) / 8 for s in ((4, 6), (6, 8), (8, 6)))

    def mlp(x, w1, w2):  # each rank: its columns of w1, its rows of w2, one all_reduce
        return dtm.all_reduce(dtm.relu(x @ w1) @ w2, axis="tp")

    y = dtm.shard_map(mlp, mesh, in_specs=({"dp": Shard(0)}, {"tp": Shard(1)}, {"tp": Shard(0)}),
                      out_specs={"dp": Shard(0)})(dtm.tensor(x), dtm.tensor(w1), dtm.tensor(w2))
    np.testing.assert_allclose(y.numpy(), np.maximum(x @ w1, 0) @ w2, rtol=1e-6)


def test_partial_output_and_uneven_pieces(mesh):
    x = np.arange(5 * 3, dtype=np.float32).reshape(5, 3)  # 5 rows over dp: 3 and 2
    y = dtm.shard_map(lambda a: a * 2, mesh, in_specs=({"dp": Shard(0)},), out_specs={"dp": Shard(0), "tp": Partial()})(
        dtm.tensor(x))
    np.testing.assert_array_equal(y.numpy(), 4 * x)  # two tp ranks each hold 2x: partial sum
    assert [p.shape for p in y.local_shards()] == [(3, 3), (3, 3), (2, 3), (2, 3)]


def test_collectives_outside_shard_map_need_a_process_group():
    with pytest.raises(TensorError) as e:
        dtm.all_reduce(dtm.ones(3))
    assert e.value.code is E.NOT_INITIALIZED and "shard_map" in e.value.message and "dtm.init()" in e.value.message
    assert e.value.where.startswith(__file__)


def test_bad_specs_are_errors(mesh):
    with pytest.raises(TensorError) as e:
        run(mesh, lambda a: dtm.all_reduce(a, axis="pp"), {"dp": Shard(0)})
    assert e.value.code is E.UNKNOWN_MESH_AXIS and "'pp'" in e.value.message
    with pytest.raises(TensorError) as e:  # pieces of 6 and 4 rows are not the chunks of 10 rows (5 and 5)
        dtm.shard_map(lambda a: dtm.cat([a, a]), mesh, in_specs=({"dp": Shard(0)},), out_specs={"dp": Shard(0)})(
            dtm.ones(5, 3))
    assert e.value.code is E.SHAPE_MISMATCH and "rank 0" in e.value.message and "[5, 3]" in e.value.message
    with pytest.raises(TensorError) as e:
        dtm.shard_map(lambda a: a, mesh, in_specs=(SPEC,), out_specs=SPEC)(dtm.ones(4, 8, requires_grad=True))
    assert e.value.code is E.ATTRIBUTE_VALUE and "no_grad" in e.value.message
