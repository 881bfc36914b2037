"""Every op of the registry on sharded inputs: for each placement of each input on a 1-D
mesh of 2 (every combination) and on a 2 x 2 mesh (a seeded sample of combinations), the
function is partitioned, each rank's local function runs on its own thread with real
collectives (dtm.ref.local_group), and the result, reassembled, equals the single-device
reference run of the global function.

The oracle is written here, independently of dtm.compiler.spmd: the spec's chunks
(ceil(D/n), the last ones short or empty) and the meaning of partial placements (pieces
that reduce to the value). Inputs sit on a grid of multiples of 1/64, so partial sums are
exact and rounding cannot blur a wrong answer. Dims of 3 and 5 over 2 make chunks uneven.
"""

from __future__ import annotations

import itertools
import threading
import zlib
from dataclasses import dataclass, field

import numpy as np
import pytest

import dtm.ir as ir
from dtm.compiler.spmd import partition
from dtm.compiler.spmd.propagate import propagate
from dtm.ir.dtypes import numpy_dtype
from dtm.ir.types import Partial, Replicate, Shard, Sharding
from dtm.ref.context import RefContext
from dtm.ref.interpreter import run
from dtm.ref.local_group import LocalGroup

MESHES = {"1d": (("x", 2),), "2d": (("a", 2), ("b", 2))}
SAMPLES_2D = 6        # combinations per case on the 2 x 2 mesh
MAX_1D = 36           # every combination on the 1-D mesh, up to this many per case


# --- the oracle ------------------------------------------------------------------------------

def chunks(size: int, n: int) -> list[tuple[int, int]]:
    k = -(-size // n)
    return [(min(i * k, size), min((i + 1) * k, size)) for i in range(n)]


def grid(rng, shape, lo=-200, hi=200) -> np.ndarray:
    return rng.integers(lo, hi, size=shape) / 64.0


def split_one(rng, v: np.ndarray, p, n: int) -> list[np.ndarray]:
    """Pieces of v along one mesh axis of size n under placement p."""
    if p.kind == "replicate":
        return [v.copy() for _ in range(n)]
    if p.kind == "shard":
        return [np.take(v, range(a, b), axis=p.arg) for a, b in chunks(v.shape[p.arg], n)]
    f = v.dtype.kind == "f"
    noise = [(grid(rng, v.shape) if f else rng.integers(0, 20, v.shape)).astype(v.dtype) for _ in range(n)]
    if p.arg == "sum":  # integers wrap around and back
        rest = sum(noise[1:], np.zeros_like(v))
        return [(v - rest).astype(v.dtype)] + noise[1:]
    if p.arg in ("max", "min"):  # one piece holds the value, the others are below (above) it
        owner = rng.integers(0, n, v.shape)
        bound = np.minimum if p.arg == "max" else np.maximum
        return [np.where(owner == c, v, bound(v, noise[c])).astype(v.dtype) for c in range(n)]
    if p.arg == "avg":  # floats: pieces spread around the value, their mean exactly it
        spread = [q - sum(noise, np.zeros_like(v)) / n for q in noise]
        return [(v + q).astype(v.dtype) for q in spread]
    assert p.arg == "prod"
    owner = rng.integers(0, n, v.shape)
    return [np.where(owner == c, v, np.ones_like(v)) for c in range(n)]


def make_pieces(rng, x: np.ndarray, placements, sizes) -> list[np.ndarray]:
    """Every rank's piece of x, rank-major over the mesh coordinates. Replicas along one axis
    are split alike along the next, as a program's own partial values are: pieces that differ
    between replicas would round differently after a division and break their agreement."""
    values = {(): x}
    for p, n in zip(placements, sizes):
        splits: dict = {}
        for v in values.values():
            if (v.shape, v.tobytes()) not in splits:
                splits[v.shape, v.tobytes()] = split_one(rng, v, p, n)
        values = {key + (c,): part for key, v in values.items() for c, part in enumerate(splits[v.shape, v.tobytes()])}
    return [values[c] for c in itertools.product(*(range(n) for n in sizes))]


def reassemble(pieces: list[np.ndarray], placements, sizes) -> np.ndarray:
    """The value the pieces hold; replicas must agree bit for bit."""
    values = dict(zip(itertools.product(*(range(n) for n in sizes)), pieces))
    for a in reversed(range(len(sizes))):
        p, out = placements[a], {}
        for key in {k[:a] for k in values}:
            parts = [values[key + (c,)] for c in range(sizes[a])]
            if p.kind == "replicate":
                for q in parts[1:]:
                    assert q.shape == parts[0].shape and np.array_equal(q, parts[0], equal_nan=q.dtype.kind == "f"), \
                        f"replicas differ on mesh axis {a}"
                out[key] = parts[0]
            elif p.kind == "shard":
                out[key] = np.concatenate(parts, axis=p.arg)
            else:
                fn = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}[p.arg]
                acc = parts[0]
                for q in parts[1:]:
                    acc = fn(acc, q)
                out[key] = (acc / len(parts) if p.arg == "avg" else acc).astype(parts[0].dtype)
        values = out
    return values[()]


def run_ranks(modules, func: str, inputs, timeout: float = 20.0) -> list[list[np.ndarray]]:
    """Run rank r's module on inputs[r], all ranks at once on threads over one device group
    (dtm.ref.run_spmd runs one module on every rank; uneven chunks give ranks different ones)."""
    n = len(modules)
    group = LocalGroup(n)
    results: list = [None] * n
    errors: list = []

    def main(r: int) -> None:
        ctx = RefContext(rank=r, meshes=dict(modules[r].meshes), comm=group, timeout=timeout)
        try:
            results[r] = run(modules[r], func, inputs[r], ctx)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append((r, e))
            group.abort(f"rank {r} failed: {e}")

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    if errors:
        raise errors[0][1]
    return results


def module_with(global_module: ir.Module, func: ir.Func) -> ir.Module:
    m = ir.Module(global_module.version)
    m.meshes = dict(global_module.meshes)
    m.funcs = dict(global_module.funcs)
    m.funcs[func.name] = func
    return m


def check_partitioned(module: ir.Module, func: str, xs: list[np.ndarray], rng, tol=None) -> None:
    """Partition @func (whose parameters carry shardings), run it on every rank with pieces of
    xs, and compare the reassembled results (and assigned parameters) with the global run."""
    f = module.funcs[func]
    g, mesh = propagate(module, func)
    sizes = [n for _, n in mesh.axes]
    modules = [module_with(module, partition(module, func, r)) for r in range(mesh.size)]
    per_param = [make_pieces(rng, x, p.sharding.placements, sizes) for x, p in zip(xs, g.params)]
    inputs = [[pieces[r] for pieces in per_param] for r in range(mesh.size)]
    global_inputs = [x.copy() for x in xs]
    want = run(module, func, global_inputs)
    got = run_ranks(modules, func, inputs)
    for i, ((t, sh), w) in enumerate(zip(g.result_types, want)):
        value = reassemble([got[r][i] for r in range(mesh.size)], sh.placements, sizes)
        compare(value, w, f"result {i} ({sh})", tol)
    for op in f.ops:  # assign wrote each rank's piece of the parameter
        if op.name == "assign":
            k = f.params.index(op.operands[0])
            value = reassemble([inputs[r][k] for r in range(mesh.size)], g.params[k].sharding.placements, sizes)
            compare(value, global_inputs[k], f"assigned parameter {k}", tol)


def compare(got: np.ndarray, want: np.ndarray, what: str, tol=None) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.dtype, want.shape)
    if want.dtype.kind == "f":
        np.testing.assert_allclose(got, want, **(tol or dict(rtol=1e-12, atol=1e-12)), err_msg=what)
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


# --- the cases -------------------------------------------------------------------------------

@dataclass
class Case:
    op: str
    inputs: list  # (type text, kind) with kind: "any", "pos", "nonzero", "bool", ("index", n), "small",
                  # "false" (a bool all false: a check's fault)
    attrs: dict = field(default_factory=dict)
    type: str | None = None  # a declared result type
    id: str = ""


def array(rng, spec) -> np.ndarray:
    t = ir.tensor_type(spec[0])
    kind, shape, dt = spec[1], tuple(t.shape), numpy_dtype(t.dtype)
    if t.dtype.name == "bool":
        return np.zeros(shape, bool) if kind == "false" else rng.integers(0, 2, shape).astype(bool)
    if isinstance(kind, tuple):  # indices into a dim of kind[1], a few out of range (clamped)
        return rng.integers(-1, kind[1] + 1, shape).astype(dt)
    if t.dtype.is_int:
        return rng.integers(-20, 20, shape).astype(dt)
    if kind == "pos":
        return grid(rng, shape, 16, 200).astype(dt)
    if kind == "nonzero":
        return (grid(rng, shape, 16, 200) * rng.choice([-1, 1], shape)).astype(dt)
    if kind == "small":
        return grid(rng, shape, 32, 96).astype(dt)
    return grid(rng, shape).astype(dt)


F = "f64[3, 5]"
CASES: list[Case] = []


def case(op, inputs, **kw):
    c = Case(op, [i if isinstance(i, tuple) else (i, "any") for i in inputs], **kw)
    c.id = c.id or f"{op}-" + "-".join(i[0].replace(" ", "") for i in c.inputs)
    CASES.append(c)


for name in ["neg", "abs", "sign", "exp", "exp2", "sin", "cos", "tanh", "erf", "sigmoid", "floor", "ceil", "round"]:
    case(name, [F])
for name in ["log", "log2", "sqrt", "rsqrt", "reciprocal"]:
    case(name, [(F, "pos")])
case("neg", ["i64[5, 3]"])
case("logical_not", ["bool[3, 5]"])
case("cast", [F], attrs=dict(to="f32"))
case("cast", [F], attrs=dict(to="i32"))
case("bitcast", [F], attrs=dict(to="i64"))
for name in ["add", "sub", "mul", "max", "min"]:
    case(name, [F, F])
case("add", [F, "f64[5]"])
case("mul", ["f64[3, 1]", "f64[1, 5]"])
case("sub", ["f64[5]", F])
case("add", ["i32[3, 5]", "i32[3, 5]"])
case("div", [F, (F, "nonzero")])
case("div", ["i64[3, 5]", "i64[3, 5]"])
case("pow", [(F, "pos"), (F, "small")])
case("mod", [F, (F, "nonzero")])
for name in ["logical_and", "logical_or", "logical_xor"]:
    case(name, ["bool[3, 5]", "bool[3, 5]"])
for name in ["eq", "ne", "lt", "le", "gt", "ge"]:
    case(name, [F, "f64[5]"])
case("where", ["bool[3, 5]", F, "f64[5]"])
for name in ["reduce_sum", "reduce_max", "reduce_min"]:
    case(name, [F], attrs=dict(axes=[1]))
    case(name, ["f64[5, 2, 3]"], attrs=dict(axes=[0, 2], keepdims=True), id=f"{name}-keep")
case("reduce_sum", ["i64[3, 5]"], attrs=dict(axes=[0, 1]))
case("reduce_prod", [(F, "small")], attrs=dict(axes=[0]))
case("argmax", [F], attrs=dict(axis=1))
case("argmin", ["f64[5, 3]"], attrs=dict(axis=0, keepdims=True))
case("argsort", [F], attrs=dict(axis=1))
case("argsort", ["f64[5, 3]"], attrs=dict(axis=0, descending=True), id="argsort-desc")
case("cumsum", [F], attrs=dict(axis=1))
case("cumsum", ["i64[5, 3]"], attrs=dict(axis=0), id="cumsum-int")
case("check", [F, ("bool[3, 5]", "false")], attrs=dict(code="E0808", message="index {value}"))
case("reshape", [F], attrs=dict(shape=[15]))
case("reshape", ["f64[6, 5]"], attrs=dict(shape=[2, 3, 5]))
case("reshape", ["f64[4, 6]"], attrs=dict(shape=[2, 2, 3, 2]))
case("reshape", ["f64[4, 3, 2]"], attrs=dict(shape=[12, 2]))
case("permute", ["f64[3, 5, 2]"], attrs=dict(perm=[2, 0, 1]))
case("broadcast_to", ["f64[5]"], attrs=dict(shape=[3, 5]))
case("broadcast_to", ["f64[3, 1]"], attrs=dict(shape=[2, 3, 5]))
case("slice", ["f64[5, 6]"], attrs=dict(start=[1, 0], stop=[5, 6], step=[2, 1]))
case("pad", [F], attrs=dict(low=[1, 0], high=[0, 2], value=0.0))
case("pad", [F], attrs=dict(low=[0, 0], high=[0, 1], value=1.5), id="pad-value")
case("concat", ["f64[2, 5]", F], attrs=dict(axis=0))
case("concat", [F, "f64[3, 2]", "f64[3, 1]"], attrs=dict(axis=1))
case("gather", ["f64[7, 4]", ("i64[3, 2]", ("index", 7))], attrs=dict(axis=0))
case("gather", ["f64[3, 5]", ("i32[4]", ("index", 5))], attrs=dict(axis=1))
case("scatter_add", ["f64[7, 4]", ("i64[5]", ("index", 7)), "f64[5, 4]"], attrs=dict(axis=0))
case("flip", [F], attrs=dict(axes=[1]))
case("dynamic_slice", ["f64[6, 5]", ("i64[]", ("index", 4))], attrs=dict(axis=0, size=3))
case("dynamic_update_slice", ["f64[6, 5]", "f64[2, 5]", ("i64[]", ("index", 5))], attrs=dict(axis=0))
case("matmul", ["f64[3, 4]", "f64[4, 5]"])
case("matmul", ["f64[2, 3, 4]", "f64[4, 5]"])
case("matmul", ["f64[2, 3, 4]", "f64[2, 4, 3]"])
case("matmul", ["i64[3, 4]", "i64[4, 5]"])
case("constant", [], attrs=dict(value=[[1.0, 2.0], [3.0, 4.5], [5.0, 6.0]]), type="f64[3, 2]")
case("full", [], attrs=dict(value=2.5), type="f64[3, 5]")
case("iota", [], attrs=dict(dim=1), type="i64[3, 5]")
case("random", [("u32[2]", "any")], attrs=dict(distribution="normal"), type="f32[3, 5]")
case("softmax", [F], attrs=dict(axis=1))
case("log_softmax", ["f64[5, 3]"], attrs=dict(axis=0))
case("layer_norm", ["f64[3, 6]", "f64[6]", "f64[6]"])
case("layer_norm", ["f64[2, 3, 5]"], id="layer_norm-plain")
case("gelu", [F])
case("gelu", [F], attrs=dict(approximate="tanh"), id="gelu-tanh")
case("silu", [F])
case("scaled_dot_product_attention", ["f64[2, 3, 4]", "f64[2, 5, 4]", "f64[2, 5, 3]"])
case("scaled_dot_product_attention", ["f64[2, 3, 4]", "f64[2, 3, 4]", "f64[2, 3, 4]"], attrs=dict(causal=True),
     id="sdpa-causal")
case("assign", [F, F])

COVERED = {c.op for c in CASES}
ELSEWHERE = {"call", "store_get", "store_put"}  # tests/test_spmd_partition.py


def global_module(c: Case, mesh: str, shardings, result=None) -> ir.Module:
    b = ir.Builder()
    b.mesh("m", **dict(MESHES[mesh]))
    f = b.func("f")
    xs = [f.param(t, name=f"x{i}", sharding=sh) for i, ((t, _), sh) in enumerate(zip(c.inputs, shardings))]
    out = f.op(c.op, *xs, type=c.type, sharding=result, **c.attrs)
    outs = () if out is None else out if isinstance(out, tuple) else (out,)
    f.ret(*outs)
    return b.build()


def placements(t: ir.TensorType) -> list:
    out = [Replicate()] + [Shard(d) for d in range(t.rank)]
    if t.dtype.is_numeric:
        out += [Partial("sum"), Partial("max")]
    return out


def combos(c: Case, mesh: str, rng) -> list[list]:
    """Placement lists (one per input) to try: every one on the 1-D mesh (capped), a sample
    of the valid ones on the 2-D mesh."""
    types = [ir.tensor_type(t) for t, _ in c.inputs] or [ir.tensor_type(c.type)]
    axes = len(MESHES[mesh])
    per_input = []
    for t in types:
        opts = [ps for ps in itertools.product(placements(t), repeat=axes) if valid(ps)]
        per_input.append(opts)
    every = list(itertools.product(*per_input))
    limit = MAX_1D if mesh == "1d" else SAMPLES_2D
    if len(every) > limit:
        every = [every[i] for i in sorted(rng.choice(len(every), limit, replace=False))]
    return every


def valid(ps) -> bool:
    dims = [p.arg for p in ps if p.kind == "shard"]
    ops = {p.arg for p in ps if p.kind == "partial"}
    return len(dims) == len(set(dims)) and len(ops) <= 1


@pytest.mark.parametrize("mesh", ["1d", "2d"])
@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_op_on_sharded_inputs(c: Case, mesh: str):
    rng = np.random.default_rng(zlib.crc32(f"{c.id} {mesh}".encode()))
    xs = [array(rng, spec) for spec in c.inputs]
    tol = dict(rtol=1e-6, atol=1e-6) if any("f32" in t for t, _ in c.inputs) or (c.type or "").startswith("f32") \
        else None
    for ps in combos(c, mesh, rng):
        shardings = [Sharding("m", tuple(p)) for p in ps]
        # Ops without operands are placed by annotating their result.
        result = shardings.pop() if not c.inputs else None
        module = global_module(c, mesh, shardings, result)
        try:
            check_partitioned(module, "f", xs, rng, tol)
        except AssertionError as e:
            raise AssertionError(f"{c.id} on {mesh} with inputs {shardings}: {e}") from None


def test_cases_cover_the_registry():
    from dtm.compiler.spmd.rules import LOCAL_VIEW_ONLY

    missing = set(ir.REGISTRY) - COVERED - ELSEWHERE - LOCAL_VIEW_ONLY
    assert not missing, f"ops with no sharded-input case: {sorted(missing)}"
