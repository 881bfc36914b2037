"""Runtime L0 (dtm.runtime.l0): local-view programs on in-process devices, one compiled plan
per rank on its own device thread, collectives between the device threads.

The oracle is numpy, written here from the spec's definitions (3.11): group members by
row-major mesh coordinates, concatenation and splitting in group-rank order. Each collective
runs on the direct path and on the ring path (forced with ring_min_bytes=0), on a 2 x 2 mesh,
over one axis and over both in either order. Failures: a rank that skips a collective times
out naming the op and the ranks that did not come; ranks that disagree report a mismatch.
"""

from __future__ import annotations

import numpy as np
import pytest

import dtm.ir as ir
from dtm.errors import DTMError, ErrorCode as E
from dtm.runtime.l0 import Device, L0Executor, default_device_count

MESH = (("a", 2), ("b", 2))


def coords(r: int) -> tuple[int, int]:
    return divmod(r, 2)


def group(r: int, axes: list[str]) -> list[int]:
    """The spec's group of rank r over `axes` (2.6), in group-rank order."""
    a, b = coords(r)
    if axes == ["a"]:
        return [0 * 2 + b, 1 * 2 + b]
    if axes == ["b"]:
        return [a * 2 + 0, a * 2 + 1]
    if axes == ["a", "b"]:
        return [0, 1, 2, 3]
    assert axes == ["b", "a"]
    return [0, 2, 1, 3]


def expected(op: str, attrs: dict, xs: list[np.ndarray], r: int) -> np.ndarray:
    g = group(r, attrs["axes"])
    mine = [xs[m] for m in g]
    i = g.index(r)
    n = len(g)
    if op == "all_reduce":
        fn = {"sum": np.add, "max": np.maximum, "prod": np.multiply, "min": np.minimum, "avg": np.add}[attrs["op"]]
        acc = mine[0]
        for x in mine[1:]:
            acc = fn(acc, x)
        return acc / n if attrs["op"] == "avg" else acc
    if op == "all_gather":
        return np.concatenate(mine, axis=attrs["dim"])
    if op == "reduce_scatter":
        return np.split(sum(mine), n, axis=attrs["dim"])[i]
    if op == "all_to_all":
        return np.concatenate([np.split(x, n, axis=attrs["split_dim"])[i] for x in mine], axis=attrs["concat_dim"])
    assert op == "broadcast"
    return mine[attrs["src"]]


def module(op: str, attrs: dict, shape=(4, 6), dtype="f64") -> tuple[ir.Module, str]:
    b = ir.Builder()
    b.mesh("m", **dict(MESH))
    f = b.func("f")
    x = f.param(f"{dtype}[{', '.join(map(str, shape))}]", name="x")
    f.ret(getattr(f, op)(x, mesh="m", **attrs))
    return b.build(), "f"


CASES = [
    ("all_reduce", dict(axes=["b"], op="sum")),
    ("all_reduce", dict(axes=["a", "b"], op="max")),
    ("all_reduce", dict(axes=["b", "a"], op="avg")),
    ("all_gather", dict(axes=["a"], dim=1)),
    ("all_gather", dict(axes=["b", "a"], dim=0)),
    ("reduce_scatter", dict(axes=["b"], dim=0, op="sum")),
    ("reduce_scatter", dict(axes=["a", "b"], dim=0, op="sum")),
    ("reduce_scatter", dict(axes=["a"], dim=1, op="sum")),
    ("all_to_all", dict(axes=["a"], split_dim=1, concat_dim=0)),
    ("all_to_all", dict(axes=["b", "a"], split_dim=0, concat_dim=1)),
    ("broadcast", dict(axes=["a", "b"], src=2)),
]


@pytest.fixture(scope="module")
def ex():
    ex = L0Executor(4, timeout=10)
    yield ex
    ex.close()


@pytest.mark.parametrize("ring", [False, True], ids=["direct", "ring"])
@pytest.mark.parametrize("op,attrs", CASES, ids=[f"{o}-{'.'.join(a['axes'])}" for o, a in CASES])
def test_collectives_match_numpy(ex, op, attrs, ring):
    m, f = module(op, attrs, shape=(4, 8))
    rng = np.random.default_rng(0)
    xs = [rng.integers(-50, 50, (4, 8)).astype(np.float64) / 8 for _ in range(4)]
    ex.ring_min_bytes = 0 if ring else 1 << 40
    try:
        outs = ex.run([m] * 4, f, [[x] for x in xs])
    finally:
        ex.ring_min_bytes = 1 << 20
    for r in range(4):
        np.testing.assert_allclose(outs[r][0], expected(op, attrs, xs, r), rtol=1e-12, err_msg=f"rank {r}")
    if op in ("all_reduce", "reduce_scatter"):  # every rank of a group gets the same bits
        for r in range(4):
            for s in group(r, attrs["axes"]):
                if op == "all_reduce":
                    assert np.array_equal(outs[r][0], outs[s][0])


@pytest.mark.parametrize("dtype,np_dtype", [("f32", np.float32), ("i32", np.int32)])
def test_ring_all_reduce_of_a_large_uneven_operand(ex, dtype, np_dtype):
    """A size that does not split evenly into chunks, past the ring threshold."""
    m, f = module("all_reduce", dict(axes=["a", "b"], op="sum"), shape=(257, 1031), dtype=dtype)
    rng = np.random.default_rng(1)
    xs = [rng.integers(-100, 100, (257, 1031)).astype(np_dtype) for _ in range(4)]
    assert xs[0].nbytes >= ex.ring_min_bytes
    outs = ex.run([m] * 4, f, [[x] for x in xs])
    for r in range(4):
        np.testing.assert_array_equal(outs[r][0], xs[0] + xs[1] + xs[2] + xs[3])


def test_a_0d_operand_keeps_its_shape(ex):
    """A scalar's all_reduce is a scalar on every rank (it once came back as shape [1])."""
    m, f = module("all_reduce", dict(axes=["a", "b"], op="sum"), shape=())
    xs = [np.array(r + 0.5) for r in range(4)]
    outs = ex.run([m] * 4, f, [[x] for x in xs])
    assert [o[0].shape for o in outs] == [()] * 4
    assert [float(o[0]) for o in outs] == [8.0] * 4


def test_each_rank_runs_its_own_module(ex):
    """Uneven shards give ranks different local types: rank r's module is modules[r]."""
    mods, xs = [], []
    for r in range(2):
        n = 3 - r  # rank 0 holds 3 rows, rank 1 holds 2: padded to 3 around the all_gather
        b = ir.Builder()
        b.mesh("m", x=2)
        f = b.func("f")
        x = f.param(f"f64[{n}, 2]", name="x")
        padded = f.pad(x, low=[0, 0], high=[3 - n, 0], value=0)
        whole = f.all_gather(padded, mesh="m", axes=["x"], dim=0)
        f.ret(f.slice(whole, start=[0, 0], stop=[5, 2], step=[1, 1]))
        mods.append(b.build())
        xs.append(np.arange(n * 2, dtype=np.float64).reshape(n, 2) + 10 * r)
    outs = ex.run(mods, "f", [[x] for x in xs], devices=[3, 1])
    for r in range(2):
        np.testing.assert_array_equal(outs[r][0], np.concatenate(xs))


def test_a_missing_rank_times_out_naming_the_op_and_the_ranks():
    ex = L0Executor(2, timeout=0.5)
    m, f = module("all_reduce", dict(axes=["b"], op="sum"))
    b = ir.Builder()  # rank 1 returns without the collective
    b.mesh("m", **dict(MESH))
    g = b.func("f")
    g.ret(g.neg(g.param("f64[4, 6]", name="x")))
    quiet = b.build()
    x = np.zeros((4, 6))
    with pytest.raises(DTMError) as e:
        ex.run([m, quiet], f, [[x], [x]])
    ex.close()
    assert e.value.code is E.TIMEOUT
    assert "all_reduce" in e.value.message and "rank 0" in e.value.message and "[1]" in e.value.message


def test_ranks_that_disagree_report_a_mismatch(ex):
    m0, f = module("all_gather", dict(axes=["b"], dim=0))
    m1, _ = module("all_gather", dict(axes=["b"], dim=1))
    x = np.zeros((4, 6))
    with pytest.raises(DTMError) as e:
        ex.run([m0, m1, m0, m1], f, [[x]] * 4)
    assert e.value.code is E.COLLECTIVE_MISMATCH
    assert "dim=0" in e.value.message and "dim=1" in e.value.message


def test_more_ranks_than_devices_is_refused(ex):
    m, f = module("all_reduce", dict(axes=["b"], op="sum"))
    x = np.zeros((4, 6))
    with pytest.raises(DTMError) as e:
        L0Executor(2).run([m] * 4, f, [[x]] * 4)  # refused before any thread starts
    assert e.value.code is E.MESH_TOO_LARGE


def test_device_count_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("DTM_DEVICES", "3")
    assert default_device_count() == 3
    assert L0Executor().devices == [Device(0), Device(1), Device(2)]
    monkeypatch.setenv("DTM_DEVICES", "zero")
    with pytest.raises(DTMError) as e:
        default_device_count()
    assert e.value.code is E.INVALID_MESH
