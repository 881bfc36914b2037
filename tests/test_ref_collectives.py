"""Collectives and point-to-point ops on the in-process device group (L0): run_spmd on a
2 x 2 mesh [dp, tp], checked against the group rules computed in numpy."""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest

from dtm.errors import DTMError, ErrorCode as E
from dtm.ir import Builder, parse
from dtm.ir.dtypes import DTYPES
from dtm.ref import RefContext, quantize, run_spmd

rng = np.random.default_rng(11)
SIZES = {"dp": 2, "tp": 2}
AXES = [["dp"], ["tp"], ["dp", "tp"], ["tp", "dp"]]


def coords(rank: int) -> dict[str, int]:
    return {"dp": rank // 2, "tp": rank % 2}


def group(rank: int, axes: list[str]) -> list[int]:
    """The spec's rule, written out: ranks agreeing with `rank` off `axes`, row-major over `axes`."""
    c = coords(rank)
    out = []
    for combo in itertools.product(*(range(SIZES[a]) for a in axes)):
        cc = dict(c, **dict(zip(axes, combo)))
        out.append(cc["dp"] * 2 + cc["tp"])
    return out


def test_group_rule():
    ctx = RefContext(rank=3, meshes=parse("dtm 1.0\nmesh @m[dp = 2, tp = 2]\n").meshes)
    assert ctx.coords("m") == {"dp": 1, "tp": 1}
    assert ctx.group("m", ["tp"]) == ((2, 3), 1)
    assert ctx.group("m", ["dp"]) == ((1, 3), 1)
    assert ctx.group("m", ["dp", "tp"]) == ((0, 1, 2, 3), 3)
    assert ctx.group("m", ["tp", "dp"]) == ((0, 2, 1, 3), 3)
    for r in range(4):
        for axes in AXES:
            members, index = RefContext(rank=r, meshes=ctx.meshes).group("m", axes)
            assert list(members) == group(r, axes) and members[index] == r


def spmd(opname: str, xs: list[np.ndarray], type=None, **attrs):
    """Run a one-op module with collective `opname` on the 2 x 2 mesh; each rank's result."""
    b = Builder()
    b.mesh("m", dp=2, tp=2)
    f = b.func("f")
    from dtm.ir.dtypes import from_numpy
    from dtm.ir.types import TensorType

    p = f.param(TensorType(from_numpy(xs[0].dtype), xs[0].shape))
    f.ret(f.op(opname, p, type=type, mesh="m", **attrs))
    return [outs[0] for outs in run_spmd(b.build(), "f", [[x] for x in xs], "m", timeout=20)]


REDUCE = {"sum": lambda vs: sum(vs[1:], vs[0]), "prod": lambda vs: np.prod(np.stack(vs), axis=0),
          "max": lambda vs: np.max(np.stack(vs), axis=0), "min": lambda vs: np.min(np.stack(vs), axis=0)}


def reduce_in_order(vs: list[np.ndarray], op: str) -> np.ndarray:
    if op == "avg":
        total = reduce_in_order(vs, "sum")
        if total.dtype.kind in "iu":
            return (np.trunc(total.astype(np.float64) / len(vs))).astype(total.dtype)
        return total / total.dtype.type(len(vs))
    if op == "sum":
        acc = vs[0]
        for v in vs[1:]:
            acc = acc + v  # group order, left to right
        return acc
    return REDUCE[op](vs)


@pytest.mark.parametrize("op", ["sum", "prod", "max", "min", "avg"])
@pytest.mark.parametrize("dtype", [np.float32, np.int32], ids=["f32", "i32"])
def test_all_reduce(op, dtype):
    xs = [(rng.standard_normal((3, 4)) * 10).astype(dtype) for _ in range(4)]
    for axes in AXES:
        outs = spmd("all_reduce", xs, axes=axes, op=op)
        for r in range(4):
            want = reduce_in_order([xs[g] for g in group(r, axes)], op)
            np.testing.assert_array_equal(outs[r], want)  # bit for bit: the order is the group's


def test_all_reduce_bf16_accumulates_in_f32():
    import ml_dtypes

    xs = [np.full((2,), v, ml_dtypes.bfloat16) for v in (256.0, 1.0, 1.0, 0.0)]
    outs = spmd("all_reduce", xs, axes=["dp", "tp"], op="sum")
    assert float(outs[0][0]) == 258.0  # bf16 left to right would round 257 back to 256 twice


def test_all_gather_and_reduce_scatter():
    xs = [rng.standard_normal((4, 8)).astype(np.float32) for _ in range(4)]
    for axes in AXES:
        for dim in (0, 1):
            outs = spmd("all_gather", xs, axes=axes, dim=dim)
            for r in range(4):
                np.testing.assert_array_equal(outs[r], np.concatenate([xs[g] for g in group(r, axes)], axis=dim))
            outs = spmd("reduce_scatter", xs, axes=axes, dim=dim, op="sum")
            for r in range(4):
                g = group(r, axes)
                total = reduce_in_order([xs[m] for m in g], "sum")
                np.testing.assert_array_equal(outs[r], np.split(total, len(g), axis=dim)[g.index(r)])


def test_broadcast_and_all_to_all():
    xs = [rng.standard_normal((4, 6)).astype(np.float32) for _ in range(4)]
    for axes in AXES:
        n = len(group(0, axes))
        for src in range(n):
            outs = spmd("broadcast", xs, axes=axes, src=src)
            for r in range(4):
                np.testing.assert_array_equal(outs[r], xs[group(r, axes)[src]])
        for split_dim, concat_dim in [(0, 0), (0, 1), (1, 0)]:
            if xs[0].shape[split_dim] % n:
                continue
            outs = spmd("all_to_all", xs, axes=axes, split_dim=split_dim, concat_dim=concat_dim)
            for r in range(4):
                g = group(r, axes)
                blocks = [np.split(xs[s], n, axis=split_dim)[g.index(r)] for s in g]
                np.testing.assert_array_equal(outs[r], np.concatenate(blocks, axis=concat_dim))


def test_quantized_all_gather_along_the_last_dim():
    xs = [quantize(rng.standard_normal((2, 32)).astype(np.float32), DTYPES["q8_0"]) for _ in range(4)]
    b = Builder()
    b.mesh("m", dp=2, tp=2)
    f = b.func("f")
    p = f.param("q8_0[2, 32]")
    f.ret(f.all_gather(p, mesh="m", axes=["tp"], dim=1))
    outs = run_spmd(b.build(), "f", [[x] for x in xs], "m")
    np.testing.assert_array_equal(outs[1][0], np.concatenate([xs[0], xs[1]], axis=1))


RING = parse("""dtm 1.0
mesh @m[dp = 2, tp = 2]

func @f(%x: f32[3]) -> (f32[3]) {
  send %x {mesh = @m, axes = ["tp"], dst = 1}
  send %x {mesh = @m, axes = ["tp"], dst = 0}
  %a = recv {mesh = @m, axes = ["tp"], src = 0} : f32[3]
  %b = recv {mesh = @m, axes = ["tp"], src = 1} : f32[3]
  %c = sub %b, %a : f32[3]
  barrier {mesh = @m, axes = ["dp", "tp"]}
  return %c
}
""")


def test_send_recv_barrier():
    xs = [np.full(3, r, np.float32) for r in range(4)]
    outs = run_spmd(RING, "f", [[x] for x in xs], "m")
    for r in range(4):
        peer = r ^ 1  # the other member of the tp group
        lo, hi = sorted((r, peer))
        np.testing.assert_array_equal(outs[r][0], xs[hi] - xs[lo])


def test_a_missing_rank_times_out_with_a_clear_error():
    m = parse("""dtm 1.0
mesh @m[dp = 2, tp = 2]

func @f(%x: f32[2], %k: i64[]) -> (f32[2]) {
  %y = all_reduce %x {mesh = @m, axes = ["dp"], op = "sum"} : f32[2]
  return %y
}

func @g(%x: f32[2], %k: i64[]) -> (f32[2]) {
  return %x
}
""")
    # Rank 3 never calls the collective: ranks 0, 2 and 1 pair up, 3 does not, so 1 waits.
    from dtm.ref import local_group

    orig_run = local_group.run

    def run(module, func, inputs, ctx):
        if ctx.rank == 3:
            time.sleep(0.05)
            return orig_run(module, "g", inputs, ctx)
        return orig_run(module, func, inputs, ctx)

    local_group.run = run
    try:
        t0 = time.monotonic()
        with pytest.raises(DTMError) as e:
            run_spmd(m, "f", [[np.ones(2, np.float32), np.array(0)]] * 4, "m", timeout=0.5)
        assert time.monotonic() - t0 < 5
    finally:
        local_group.run = orig_run
    assert e.value.code is E.TIMEOUT
    msg = str(e.value)
    assert "rank 1" in msg and "all_reduce" in msg and "[3]" in msg and "0.5 s" in msg


def test_one_failing_rank_releases_the_others_at_once():
    m = parse("""dtm 1.0
mesh @m[dp = 2, tp = 2]

func @f(%c: f32[2], %x: f32[N]) -> (f32[N]) {
  %y = all_gather %x {mesh = @m, axes = ["dp", "tp"], dim = 0} : f32[4*N]
  %z = reshape %y {shape = [N, 4]} : f32[N, 4]
  %w = reduce_sum %z {axes = [1]} : f32[N]
  return %w
}
""")
    inputs = [[np.zeros(2, np.float32), np.ones(2, np.float32)] for _ in range(4)]
    inputs[2][0] = np.zeros(3, np.float32)  # rank 2 fails its input check
    t0 = time.monotonic()
    with pytest.raises(DTMError) as e:
        run_spmd(m, "f", inputs, "m", timeout=30)
    assert time.monotonic() - t0 < 5
    assert e.value.code is E.SHAPE_MISMATCH and e.value.message.startswith("rank 2:")
    assert not [t for t in threading.enumerate() if t.name.startswith("dtm-ref-rank")]


def test_mismatched_collectives_are_reported():
    m = parse("""dtm 1.0
mesh @m[dp = 2, tp = 2]

func @f(%x: f32[2]) -> (f32[2]) {
  %y = all_reduce %x {mesh = @m, axes = ["tp"], op = "sum"} : f32[2]
  return %y
}

func @g(%x: f32[2]) -> (f32[2]) {
  %y = all_reduce %x {mesh = @m, axes = ["tp"], op = "max"} : f32[2]
  return %y
}
""")
    from dtm.ref import local_group

    orig_run = local_group.run
    local_group.run = lambda module, func, inputs, ctx: orig_run(module, "g" if ctx.rank == 1 else func, inputs, ctx)
    try:
        with pytest.raises(DTMError) as e:
            run_spmd(m, "f", [[np.ones(2, np.float32)]] * 4, "m", timeout=5)
    finally:
        local_group.run = orig_run
    assert e.value.code is E.COLLECTIVE_MISMATCH
    assert "all_reduce(sum)" in str(e.value) and "all_reduce(max)" in str(e.value)


def test_run_spmd_checks_its_arguments():
    with pytest.raises(DTMError) as e:
        run_spmd(RING, "f", [[np.ones(3, np.float32)]] * 3, "m")
    assert e.value.code is E.INVALID_GROUP
    with pytest.raises(DTMError) as e:
        run_spmd(RING, "f", [], "nope")
    assert e.value.code is E.UNDEFINED_MESH
