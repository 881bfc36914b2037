"""Sharding propagation and partitioning beyond single ops: the rule table covers the
registry, the fallback warns once, redistributions pick the collectives of the spec's
table (one axis at a time, uneven chunks included) and are exact for every pair of
shardings, a tensor-parallel MLP has exactly one all_reduce, and bad shardings are
DTMErrors that name the tensor, the mesh and the placement."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest

import dtm.ir as ir
from dtm.compiler.spmd import (assemble, local_module, local_type, partition, propagate_shardings,
                               split_array)
from dtm.compiler.spmd import rules
from dtm.ir.chunks import chunk, coords
from dtm.errors import DTMError, ErrorCode as E
from dtm.ir.types import Partial, Replicate, Shard, Sharding
from dtm.ref.interpreter import run
from test_spmd_ops import check_partitioned, chunks, make_pieces, reassemble, run_ranks, valid


def collectives(f: ir.Func) -> list[str]:
    return [op.name for op in f.ops if op.name in rules.LOCAL_VIEW_ONLY]


# --- the rule table --------------------------------------------------------------------------

def test_every_registry_op_has_a_rule_or_is_local_view_only():
    missing = [n for n in ir.REGISTRY if n not in rules.RULES and n not in rules.LOCAL_VIEW_ONLY]
    assert not missing, f"ops with no sharding rule: {missing}"
    assert set(rules.RULES) <= set(ir.REGISTRY)
    assert not set(rules.RULES) & rules.LOCAL_VIEW_ONLY
    assert rules.LOCAL_VIEW_ONLY == {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all",
                                     "barrier", "send", "recv"}
    assert [n for n, fn in rules.RULES.items() if fn is rules.fallback] == ["call"]


def _call_module() -> ir.Module:
    b = ir.Builder()
    b.mesh("m", x=2)
    g = b.func("twice")
    a = g.param("f64[3, 4]", name="a")
    g.ret(g.add(a, a))
    f = b.func("f")
    x = f.param("f64[3, 4]", name="x", sharding="@m[shard(0)]")
    y = f.call(x, callee="twice")
    f.ret(f.call(y, callee="twice"))
    return b.build()


def test_fallback_runs_replicated_and_warns_once_naming_the_op():
    rules._warned.discard("call")
    m = _call_module()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        f0 = partition(m, "f", 0)
        partition(m, "f", 1)
    msgs = [str(w.message) for w in seen]
    assert len(msgs) == 1 and "op call has no sharding rule" in msgs[0], msgs
    assert collectives(f0) == ["all_gather"]  # the operand is made whole once, then reused
    rng = np.random.default_rng(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_partitioned(m, "f", [rng.standard_normal((3, 4))], rng)


def test_store_ops_run_replicated():
    b = ir.Builder()
    b.mesh("m", x=2)
    f = b.func("f")
    x = f.param("f64[3, 4]", name="x", sharding="@m[partial(sum)]")
    f.store_put(x, key="k")
    f.ret(f.store_get(type="f64[3, 4]", key="k"))
    m = b.build()
    f0 = partition(m, "f", 0)
    assert collectives(f0) == ["all_reduce"]
    assert [op.name for op in f0.ops] == ["all_reduce", "store_put", "store_get"]


def test_local_view_and_unsharded_functions_are_returned_as_they_are():
    m = ir.parse("dtm 1.0\nmesh @m[x = 2]\n"
                 "func @f(%g: f32[4] @m[partial(sum)]) -> (f32[4]) {\n"
                 "  %y = all_reduce %g {axes = [\"x\"], mesh = @m} : f32[4]\n  return %y\n}\n"
                 "func @h(%a: f32[4]) -> (f32[4]) {\n  %b = neg %a : f32[4]\n  return %b\n}\n")
    assert partition(m, "f", 1) is m.funcs["f"]
    assert partition(m, "h", 0) is m.funcs["h"]


# --- redistribution --------------------------------------------------------------------------

def _identity(mesh: dict, t: str, src: Sharding, dst: Sharding) -> ir.Module:
    b = ir.Builder()
    b.mesh("m", **mesh)
    f = b.func("f")
    x = f.param(t, name="x", sharding=src)
    f.ret(x)
    f.func.result_types = [(x.type, dst)]
    return b.build()


S, R, P = Shard, Replicate(), Partial


@pytest.mark.parametrize("src, dst, expected", [
    (P("sum"), R, ["all_reduce"]),
    (P("max"), R, ["all_reduce"]),
    (P("sum"), S(1), ["reduce_scatter"]),
    (S(0), R, ["all_gather"]),
    (S(0), S(1), ["all_to_all"]),
    (R, S(0), []),
    (R, P("sum"), []),
    (S(1), P("sum"), ["all_gather"]),
    (P("sum"), P("max"), ["all_reduce"]),
])
def test_redistribution_picks_the_collective_of_the_table(src, dst, expected):
    m = _identity({"x": 2}, "f64[5, 3]", Sharding("m", (src,)), Sharding("m", (dst,)))
    for r in range(2):
        assert collectives(partition(m, "f", r)) == expected
    check_partitioned(m, "f", [np.random.default_rng(1).integers(-50, 50, (5, 3)) / 8.0], np.random.default_rng(2))


def test_a_change_over_several_axes_is_planned_per_axis():
    def ops(src, dst):
        m = _identity({"a": 2, "b": 2}, "f64[4, 6]", Sharding("m", src), Sharding("m", dst))
        f = partition(m, "f", 3)
        return [(op.name, op.attrs.get("axes")) for op in f.ops if op.name in rules.LOCAL_VIEW_ONLY]

    assert ops((S(0), S(1)), (R, R)) == [("all_gather", ("a",)), ("all_gather", ("b",))]
    assert ops((S(0), P("sum")), (S(1), R)) == [("all_reduce", ("b",)), ("all_to_all", ("a",))]
    assert ops((P("sum"), P("sum")), (R, R)) == [("all_reduce", ("a", "b"))]  # one collective for both
    assert ops((S(0), S(1)), (S(1), S(0))) == [("all_gather", ("a",)), ("all_to_all", ("b",))]
    assert ops((R, P("sum")), (S(0), R)) == [("all_reduce", ("b",))]  # slice first: less to reduce


MESH_SHAPES = [({"x": 4}, "f64[5, 3]"), ({"a": 2, "b": 2}, "f64[5, 3]"), ({"a": 2, "b": 3}, "i64[3, 5]")]


@pytest.mark.parametrize("mesh, t", MESH_SHAPES, ids=["4", "2x2", "2x3"])
def test_every_redistribution_is_exact(mesh, t):
    """Every pair of shardings (replicate, shard of each dim, partial sum / max), uneven
    and empty chunks included (5 and 3 over 4)."""
    rank = ir.tensor_type(t).rank
    options = [R] + [S(d) for d in range(rank)] + [P("sum"), P("max")]
    if len(mesh) == 1:
        options += [P("min"), P("prod"), P("avg")]
    shardings = [Sharding("m", ps) for ps in itertools.product(options, repeat=len(mesh)) if valid(ps)]
    rng = np.random.default_rng(3)
    pairs = list(itertools.product(shardings, shardings))
    if len(pairs) > 120:
        pairs = [pairs[i] for i in sorted(rng.choice(len(pairs), 120, replace=False))]
    shape = tuple(ir.tensor_type(t).shape)
    x = rng.integers(-50, 50, shape) if t.startswith("i") else rng.integers(-50, 50, shape) / 8.0
    for src, dst in pairs:
        try:
            check_partitioned(_identity(mesh, t, src, dst), "f", [x], rng)
        except AssertionError as e:
            raise AssertionError(f"{src} -> {dst} on {mesh}: {e}") from None


def test_uneven_chunks_follow_the_spec():
    assert [chunk(5, 4, i) for i in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert [chunk(3, 2, i) for i in range(2)] == [(0, 2), (2, 3)]
    assert [chunk(5, 4, i) for i in range(4)] == chunks(5, 4)
    mesh = ir.Mesh("m", (("a", 2), ("b", 4)))
    t = ir.tensor_type("f32[3, 5]")
    sh = Sharding("m", (S(0), S(1)))
    assert [str(local_type(t, sh, mesh, coords(mesh, r))) for r in range(8)] == \
        ["f32[2, 2]", "f32[2, 2]", "f32[2, 1]", "f32[2, 0]", "f32[1, 2]", "f32[1, 2]", "f32[1, 1]", "f32[1, 0]"]


def test_symbolic_dims_split_exactly():
    b = ir.Builder()
    b.mesh("m", x=2)
    f = b.func("f")
    x = f.param("f64[2*B, 4]", name="x", sharding="@m[shard(0)]")
    f.ret(f.reduce_sum(f.exp(x), axes=[0], sharding="@m[replicate]"))
    m = b.build()
    f1 = partition(m, "f", 1)
    assert str(f1.params[0].type) == "f64[B, 4]" and collectives(f1) == ["all_reduce"]
    rng = np.random.default_rng(4)
    check_partitioned(m, "f", [rng.standard_normal((6, 4))], rng, tol=dict(rtol=1e-12, atol=1e-12))


def test_host_split_and_assemble_agree_with_the_oracle():
    mesh = ir.Mesh("m", (("a", 2), ("b", 3)))
    rng = np.random.default_rng(5)
    x = rng.integers(-9, 9, (5, 4)).astype(np.int64)
    for ps in [(S(0), S(1)), (S(1), R), (R, S(0)), (P("sum"), S(0)), (S(1), P("sum")), (P("max"), P("max"))]:
        sh = Sharding("m", ps)
        pieces = [split_array(x, sh, mesh, r) for r in range(6)]
        np.testing.assert_array_equal(assemble(pieces, sh, mesh), x)
        np.testing.assert_array_equal(reassemble(pieces, ps, [2, 3]), x)
        oracle = make_pieces(rng, x, ps, [2, 3])
        np.testing.assert_array_equal(assemble(oracle, sh, mesh), x)
        assert [p.shape for p in pieces] == [p.shape for p in oracle]


# --- models ----------------------------------------------------------------------------------

def mlp(mesh: dict, x_sharding: str) -> ir.Module:
    """Megatron's MLP: column-parallel Linear, gelu, row-parallel Linear; one all_reduce."""
    b = ir.Builder()
    b.mesh("m", **mesh)
    tp = ["replicate"] * len(mesh)
    tp[-1] = "{}"
    place = lambda p: "@m[" + ", ".join(tp).format(p) + "]"  # noqa: E731 - the tp axis is last
    f = b.func("mlp")
    x = f.param("f32[8, 16]", name="x", sharding=x_sharding)
    w1 = f.param("f32[16, 64]", name="w1", sharding=place("shard(1)"))
    b1 = f.param("f32[64]", name="b1", sharding=place("shard(0)"))
    w2 = f.param("f32[64, 16]", name="w2", sharding=place("shard(0)"))
    b2 = f.param("f32[16]", name="b2", sharding=place("replicate"))
    h = f.gelu(f.add(f.matmul(x, w1, name="h0"), b1, name="h1"), name="h")
    out = f.add(f.matmul(h, w2, name="y0"), b2, name="y", sharding=x_sharding)
    f.ret(out)
    return b.build()


@pytest.mark.parametrize("mesh, x_sharding", [({"tp": 2}, "@m[replicate]"),
                                              ({"dp": 2, "tp": 2}, "@m[shard(0), replicate]")])
def test_tensor_parallel_mlp_has_one_all_reduce(mesh, x_sharding):
    m = mlp(mesh, x_sharding)
    n = int(np.prod(list(mesh.values())))
    for r in range(n):
        text = ir.format(local_module(m, "mlp", r))
        assert text.count(" = all_reduce ") == 1 and 'axes = ["tp"]' in text, text
        assert not any(c in text for c in ("all_gather", "reduce_scatter", "all_to_all", "broadcast")), text
        assert ir.parse(text) == local_module(m, "mlp", r)  # printable, parses back, verifies
    rng = np.random.default_rng(6)
    xs = [(rng.standard_normal(tuple(p.type.shape)) * 0.5).astype(np.float32) for p in m.funcs["mlp"].params]
    check_partitioned(m, "mlp", xs, rng, tol=dict(rtol=1e-5, atol=1e-5))


def test_vocab_parallel_embedding_and_its_gradient():
    """gather from a table sharded by rows gives partial sums (one all_reduce to replicate);
    scatter_add into it adds each update on the rank that holds its row, no collective."""
    b = ir.Builder()
    b.mesh("m", tp=2)
    f = b.func("f")
    w = f.param("f32[5, 4]", name="wte", sharding="@m[shard(0)]")
    tok = f.param("i32[2, 3]", name="tokens")
    g = f.param("f32[2, 3, 4]", name="grad")
    h = f.gather(w, tok, axis=0, name="h", sharding="@m[replicate]")
    dw = f.scatter_add(w, tok, g, axis=0, name="dw")
    f.ret(h, dw)
    m = b.build()
    f1 = partition(m, "f", 1)
    assert collectives(f1) == ["all_reduce"]
    assert [str(sh) for _, sh in f1.result_types] == ["@m[replicate]", "@m[shard(0)]"]
    rng = np.random.default_rng(7)
    xs = [rng.integers(-64, 64, (5, 4)).astype(np.float32) / 8, rng.integers(-1, 6, (2, 3)).astype(np.int32),
          rng.integers(-64, 64, (2, 3, 4)).astype(np.float32) / 8]
    check_partitioned(m, "f", xs, rng)


def test_propagation_places_every_value_and_keeps_annotations():
    m = mlp({"tp": 2}, "@m[replicate]")
    g = propagate_shardings(m, "mlp")
    values = g.params + [r for op in g.ops for r in op.results]
    assert all(v.sharding is not None for v in values)
    placed = {v.name: str(v.sharding) for v in values}
    assert placed["h"] == "@m[shard(1)]" and placed["y0"] == "@m[partial(sum)]" and placed["y"] == "@m[replicate]"
    assert m.funcs["mlp"].ops[0].results[0].sharding is None  # the input function is not changed


@pytest.mark.parametrize("w_sharding, expected", [
    ("@m[replicate, shard(0)]", [("all_reduce", ("dp",), "f64[3, 3]")]),     # DDP: reduce the tp piece only
    ("@m[shard(1), shard(0)]", [("reduce_scatter", ("dp",), "f64[3, 4]")]),  # FSDP: 3 columns padded to 4
])
def test_sgd_step_updates_each_piece_in_place(w_sharding, expected):
    b = ir.Builder()
    b.mesh("m", dp=2, tp=2)
    f = b.func("sgd")
    w = f.param("f64[5, 3]", name="w", sharding=w_sharding)
    grad = f.param("f64[5, 3]", name="g", sharding="@m[partial(sum), replicate]")
    f.assign(w, f.sub(w, f.mul(grad, f.full(type="f64[]", value=0.5))))
    m = b.build()
    f0 = partition(m, "sgd", 0)
    assert [(op.name, op.attrs["axes"], str(op.operands[0].type)) for op in f0.ops
            if op.name in rules.LOCAL_VIEW_ONLY] == expected
    rng = np.random.default_rng(8)
    check_partitioned(m, "sgd", [rng.integers(-9, 9, (5, 3)) / 4.0, rng.integers(-9, 9, (5, 3)) / 4.0], rng)


# --- bad input -------------------------------------------------------------------------------

def _unverified(*params, mesh2=False) -> ir.Module:
    b = ir.Builder()
    b.mesh("m", dp=2, tp=2)
    if mesh2:
        b.mesh("other", x=2)
    f = b.func("f")
    xs = [f.param(t, name=name, sharding=ir.sharding(sh)) for name, t, sh in params]
    f.ret(f.eq(xs[0], xs[-1]))
    return b.module  # not verified: partition checks shardings itself, naming what is wrong


@pytest.mark.parametrize("params, code, words", [
    ([("act", "f32[4, 4]", "@m[shard(2), replicate]")], E.SHARD_DIM_OUT_OF_RANGE,
     ["%act", "@m", "shard(2)", "dp"]),
    ([("act", "f32[4, 4]", "@m[shard(1), shard(1)]")], E.DIM_SHARDED_TWICE, ["%act", "@m", "'dp'", "'tp'"]),
    ([("act", "f32[4, 4]", "@m[shard(0)]")], E.PLACEMENT_COUNT, ["%act", "@m", "1 placement"]),
    ([("act", "f32[4, 4]", "@nowhere[replicate]")], E.UNDEFINED_MESH, ["%act", "@nowhere"]),
    ([("mask", "bool[4, 4]", "@m[partial(sum), replicate]")], E.INVALID_PLACEMENT, ["%mask", "@m", "partial(sum)"]),
    ([("act", "f32[4, 4]", "@m[partial(sum), partial(max)]")], E.INVALID_PLACEMENT, ["%act", "@m", "partial"]),
    ([("act", "f32[B, 4]", "@m[shard(0), replicate]")], E.SHAPE_MISMATCH, ["%act", "@m", "shard(0)", "B"]),
    ([("a", "f32[4, 4]", "@m[shard(0), replicate]"), ("b", "f32[4, 4]", "@other[replicate]")], E.MESH_MISMATCH,
     ["%a", "%b", "@m", "@other"]),
])
def test_bad_shardings_name_the_tensor_mesh_and_placement(params, code, words):
    m = _unverified(*params, mesh2=True)
    with pytest.raises(DTMError) as info:
        partition(m, "f", 0)
    assert info.value.code is code, info.value
    for w in words:
        assert w in info.value.message, (w, info.value.message)


def test_a_mesh_larger_than_the_devices_and_a_rank_off_the_mesh():
    m = mlp({"dp": 2, "tp": 2}, "@m[shard(0), replicate]")
    with pytest.raises(DTMError) as info:
        partition(m, "mlp", 0, devices=2)
    assert info.value.code is E.MESH_TOO_LARGE and "@m" in info.value.message and "4 devices" in info.value.message
    with pytest.raises(DTMError) as info:
        partition(m, "mlp", 4)
    assert info.value.code is E.INVALID_GROUP
    assert len(partition(m, "mlp", 3, devices=4).ops) > 0


def test_run_ranks_helper_reports_a_failing_rank():
    """The harness itself fails loudly (so the sweep cannot pass by running nothing)."""
    m = _identity({"x": 2}, "f64[4]", Sharding("m", (S(0),)), Sharding("m", (R,)))
    modules = [local_module(m, "f", r) for r in range(2)]
    with pytest.raises(DTMError):
        run_ranks(modules, "f", [[np.zeros(2)], [np.zeros(3)]], timeout=2)
    out = run_ranks(modules, "f", [[np.arange(2.0)], [np.arange(2.0, 4.0)]])
    np.testing.assert_array_equal(out[1][0], np.arange(4.0))
    assert run(m, "f", [np.arange(4.0)])[0].shape == (4,)


def test_the_spec_example_is_what_partition_prints():
    import pathlib
    import re

    spec = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "spec" / "dtm-spec.md").read_text()
    section = spec[spec.index("### 2.9 Sharding propagation"):spec.index("## 3. Ops")]
    global_text, local_text = re.findall(r"```dtm\n(.*?)```", section, re.S)
    m = ir.parse(global_text)
    assert [ir.format(local_module(m, "mlp", r)) for r in range(2)] == [local_text, local_text]


def test_quantized_values_gather_whole_blocks_and_refuse_uneven_chunks():
    def module(rows: int) -> ir.Module:
        return _identity({"x": 2}, f"q8_0[{rows}, 32]", Sharding("m", (S(0),)), Sharding("m", (R,)))

    assert collectives(partition(module(4), "f", 1)) == ["all_gather"]
    with pytest.raises(DTMError) as info:
        partition(module(3), "f", 1)  # the short chunk would need a pad, which quantized values do not take
    assert info.value.code is E.QUANTIZED_MISUSE and "%x" in info.value.message and "@m" in info.value.message
