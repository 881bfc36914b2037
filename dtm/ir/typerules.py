"""Result-type rules, one per op family; the registry (registry.py) names which rule each op
uses. A rule takes the operand types, the attributes and the declared result types and
returns the result types, or raises `TypeRuleError` with a spec error code. Rules are pure,
so the verifier memoises them.

Conventions every rule relies on: axes are normalised (0 <= axis < rank, lists strictly
increasing), binary ops need equal dtypes (the frontend inserts casts), and shapes
broadcast as numpy does, where a symbolic dim only broadcasts against itself or 1.
"""

from __future__ import annotations

from typing import Callable, Sequence

from ..errors import ErrorCode as E
from .diagnostics import TypeRuleError
from .dtypes import DTYPES, Kind, bool_, i64
from .symbolic import Dim, dim_add, dim_div_exact, dim_mul, dim_prod, dim_sub, format_dim, is_static
from .types import TensorType


def fail(code: E, message: str):
    raise TypeRuleError(code, message)


# --- dtype classes ---------------------------------------------------------------------

DTYPE_CLASSES: dict[str, Callable] = {
    "any": lambda d: not d.is_quant,
    "numeric": lambda d: d.is_numeric,
    "float": lambda d: d.is_float,
    "int": lambda d: d.is_int,
    "bool": lambda d: d.kind is Kind.BOOL,
}


def check_class(opname: str, t: TensorType, cls: str, what: str = "operand") -> None:
    if not DTYPE_CLASSES[cls](t.dtype):
        code = E.QUANTIZED_MISUSE if t.dtype.is_quant else E.DTYPE_MISMATCH
        fail(code, f"{opname} expects a {cls} {what}, found {t}")


def expect_type(found: TensorType, expected: TensorType, what: str) -> None:
    if found.dtype != expected.dtype:
        fail(E.DTYPE_MISMATCH, f"{what}: expected {expected}, found {found}")
    if found.shape != expected.shape:
        fail(E.SHAPE_MISMATCH, f"{what}: expected {expected}, found {found}")


def broadcast_shapes(opname: str, *types: TensorType) -> tuple[Dim, ...]:
    rank = max(t.rank for t in types)
    out: list[Dim] = []
    for i in range(rank):
        d: Dim = 1
        for t in types:
            j = i - (rank - t.rank)
            if j < 0:
                continue
            e = t.shape[j]
            if e == d or e == 1:
                continue
            if d == 1:
                d = e
            else:
                fail(E.SHAPE_MISMATCH, f"{opname}: shapes {', '.join(str(t) for t in types)} do not broadcast "
                     f"(dim {i - rank}: {format_dim(d)} vs {format_dim(e)})")
        out.append(d)
    return tuple(out)


def check_axis(opname: str, axis: int, rank: int, attr: str = "axis") -> None:
    if not 0 <= axis < rank:
        fail(E.ATTRIBUTE_VALUE, f"{opname}: {attr} = {axis} is out of range for rank {rank} (0 <= {attr} < {rank})")


def check_axes(opname: str, axes: Sequence[int], rank: int, attr: str = "axes") -> None:
    for a in axes:
        check_axis(opname, a, rank, attr)
    if any(b <= a for a, b in zip(axes, axes[1:])):
        fail(E.ATTRIBUTE_VALUE, f"{opname}: {attr} = {list(axes)} must be strictly increasing")


# --- elementwise -----------------------------------------------------------------------

def unary(cls: str):
    def rule(op, ins, attrs, declared, ctx):
        check_class(op, ins[0], cls)
        return (ins[0],)
    return rule


def binary(cls: str, to_bool: bool = False):
    def rule(op, ins, attrs, declared, ctx):
        a, b = ins
        check_class(op, a, cls)
        if a.dtype != b.dtype:
            fail(E.DTYPE_MISMATCH, f"{op} needs operands of one dtype, found {a} and {b}")
        shape = broadcast_shapes(op, a, b)
        return (TensorType(bool_ if to_bool else a.dtype, shape),)
    return rule


def where_rule(op, ins, attrs, declared, ctx):
    c, x, y = ins
    if c.dtype is not bool_:
        fail(E.DTYPE_MISMATCH, f"where: condition must be bool, found {c}")
    check_class(op, x, "any")
    if x.dtype != y.dtype:
        fail(E.DTYPE_MISMATCH, f"where: branches need one dtype, found {x} and {y}")
    return (TensorType(x.dtype, broadcast_shapes(op, c, x, y)),)


def cast_rule(op, ins, attrs, declared, ctx):
    x, to = ins[0], attrs["to"]
    if x.dtype.is_quant and to.is_quant:
        fail(E.QUANTIZED_MISUSE, f"cast: {x.dtype} to {to}: one side must be a plain dtype")
    if (x.dtype.is_quant and not to.is_float) or (to.is_quant and not x.dtype.is_float):
        fail(E.QUANTIZED_MISUSE, f"cast: quantized dtypes convert only to and from float dtypes, found {x.dtype} to {to}")
    out = TensorType(to, x.shape)
    check_quant_shape(out)
    return (out,)


def bitcast_rule(op, ins, attrs, declared, ctx):
    x, to = ins[0], attrs["to"]
    check_class(op, x, "any")
    if to.is_quant or to.bits != x.dtype.bits:
        fail(E.DTYPE_MISMATCH, f"bitcast: {x.dtype} ({x.dtype.bits} bits) to {to} ({to.bits} bits): element sizes must be equal")
    return (TensorType(to, x.shape),)


def check_quant_shape(t: TensorType) -> None:
    if t.dtype.is_quant:
        last = t.shape[-1] if t.shape else 1
        if dim_div_exact(last, t.dtype.block) is None:
            fail(E.QUANTIZED_MISUSE, f"{t}: the last dim of a {t.dtype} tensor must be a multiple of {t.dtype.block}")


# --- reductions ------------------------------------------------------------------------

def _reduced_shape(x: TensorType, axes, keepdims: bool) -> tuple[Dim, ...]:
    if keepdims:
        return tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    return tuple(d for i, d in enumerate(x.shape) if i not in axes)


def reduce_rule(cls: str):
    def rule(op, ins, attrs, declared, ctx):
        x = ins[0]
        check_class(op, x, cls)
        check_axes(op, attrs["axes"], x.rank)
        return (TensorType(x.dtype, _reduced_shape(x, attrs["axes"], attrs["keepdims"])),)
    return rule


def arg_rule(op, ins, attrs, declared, ctx):
    x = ins[0]
    check_class(op, x, "numeric")
    check_axis(op, attrs["axis"], x.rank)
    return (TensorType(i64, _reduced_shape(x, (attrs["axis"],), attrs["keepdims"])),)


def argsort_rule(op, ins, attrs, declared, ctx):
    x = ins[0]
    check_class(op, x, "numeric")
    check_axis(op, attrs["axis"], x.rank)
    return (TensorType(i64, x.shape),)


def scan_rule(op, ins, attrs, declared, ctx):
    x = ins[0]
    check_class(op, x, "numeric")
    check_axis(op, attrs["axis"], x.rank)
    return (x,)


# --- movement --------------------------------------------------------------------------

def reshape_rule(op, ins, attrs, declared, ctx):
    x, shape = ins[0], attrs["shape"]
    check_class(op, x, "any")
    if dim_prod(x.shape) != dim_prod(shape):
        fail(E.SHAPE_MISMATCH, f"reshape: {x} has {format_dim(dim_prod(x.shape))} elements, "
             f"shape [{', '.join(format_dim(d) for d in shape)}] has {format_dim(dim_prod(shape))}")
    return (TensorType(x.dtype, shape),)


def permute_rule(op, ins, attrs, declared, ctx):
    x, perm = ins[0], attrs["perm"]
    check_class(op, x, "any")
    if sorted(perm) != list(range(x.rank)):
        fail(E.ATTRIBUTE_VALUE, f"permute: perm = {list(perm)} is not a permutation of 0..{x.rank - 1}")
    return (TensorType(x.dtype, tuple(x.shape[p] for p in perm)),)


def broadcast_to_rule(op, ins, attrs, declared, ctx):
    x, shape = ins[0], attrs["shape"]
    check_class(op, x, "any")
    if len(shape) < x.rank:
        fail(E.RANK_MISMATCH, f"broadcast_to: cannot broadcast {x} to fewer dims {list(shape)}")
    lead = len(shape) - x.rank
    for i, d in enumerate(x.shape):
        if d != 1 and d != shape[lead + i]:
            fail(E.SHAPE_MISMATCH, f"broadcast_to: dim {i} of {x} is {format_dim(d)}, target is {format_dim(shape[lead + i])}")
    return (TensorType(x.dtype, shape),)


def _check_per_dim(op: str, x: TensorType, attrs, names: Sequence[str]) -> None:
    for n in names:
        if len(attrs[n]) != x.rank:
            fail(E.ATTRIBUTE_VALUE, f"{op}: {n} has {len(attrs[n])} entries, {x} has rank {x.rank}")


def slice_rule(op, ins, attrs, declared, ctx):
    x = ins[0]
    check_class(op, x, "any")
    _check_per_dim(op, x, attrs, ("start", "stop", "step"))
    out: list[Dim] = []
    for i, (d, lo, hi, st) in enumerate(zip(x.shape, attrs["start"], attrs["stop"], attrs["step"])):
        if st < 1:
            fail(E.ATTRIBUTE_VALUE, f"slice: step {st} on dim {i} must be >= 1 (flip reverses)")
        if is_static(d) and is_static(lo) and is_static(hi):
            if not 0 <= lo <= hi <= d:
                fail(E.ATTRIBUTE_VALUE, f"slice: dim {i} of size {d} needs 0 <= start <= stop <= {d}, found {lo}:{hi}")
            out.append((hi - lo + st - 1) // st)
        else:
            if st != 1:
                fail(E.ATTRIBUTE_VALUE, f"slice: a symbolic slice of dim {i} must have step 1, found {st}")
            out.append(dim_sub(hi, lo))
    return (TensorType(x.dtype, tuple(out)),)


def pad_rule(op, ins, attrs, declared, ctx):
    x = ins[0]
    check_class(op, x, "any")
    _check_per_dim(op, x, attrs, ("low", "high"))
    if any(p < 0 for p in attrs["low"] + attrs["high"]):
        fail(E.ATTRIBUTE_VALUE, "pad: padding amounts must be >= 0 (use slice to crop)")
    shape = tuple(dim_add(dim_add(d, lo), hi) for d, lo, hi in zip(x.shape, attrs["low"], attrs["high"]))
    return (TensorType(x.dtype, shape),)


def concat_rule(op, ins, attrs, declared, ctx):
    first, axis = ins[0], attrs["axis"]
    check_class(op, first, "any")
    check_axis(op, axis, first.rank)
    total: Dim = 0
    for i, t in enumerate(ins):
        if t.dtype != first.dtype:
            fail(E.DTYPE_MISMATCH, f"concat: operand {i} is {t}, operand 0 is {first}")
        if t.rank != first.rank:
            fail(E.RANK_MISMATCH, f"concat: operand {i} is {t}, operand 0 is {first}")
        for j, (a, b) in enumerate(zip(t.shape, first.shape)):
            if j != axis and a != b:
                fail(E.SHAPE_MISMATCH, f"concat: operand {i} is {t}, operand 0 is {first}; they differ in dim {j}")
        total = dim_add(total, t.shape[axis])
    shape = list(first.shape)
    shape[axis] = total
    return (TensorType(first.dtype, tuple(shape)),)


def _gathered_shape(x: TensorType, idx: TensorType, axis: int) -> tuple[Dim, ...]:
    return x.shape[:axis] + idx.shape + x.shape[axis + 1:]


def gather_rule(op, ins, attrs, declared, ctx):
    x, idx = ins
    check_class(op, idx, "int", "index")
    check_axis(op, attrs["axis"], x.rank)
    if x.dtype.is_quant:  # whole rows of blocks only: a block never splits
        if attrs["axis"] % x.rank == x.rank - 1:
            fail(E.QUANTIZED_MISUSE, f"{op} takes a quantized {x} along a dim other than its last (its blocks)")
    else:
        check_class(op, x, "any")
    return (TensorType(x.dtype, _gathered_shape(x, idx, attrs["axis"])),)


def scatter_add_rule(op, ins, attrs, declared, ctx):
    x, idx, upd = ins
    check_class(op, x, "numeric")
    check_class(op, idx, "int", "index")
    check_axis(op, attrs["axis"], x.rank)
    expect_type(upd, TensorType(x.dtype, _gathered_shape(x, idx, attrs["axis"])), "scatter_add updates")
    return (x,)


def flip_rule(op, ins, attrs, declared, ctx):
    check_class(op, ins[0], "any")
    check_axes(op, attrs["axes"], ins[0].rank)
    return (ins[0],)


def _check_position(op: str, pos: TensorType) -> None:
    if not pos.dtype.is_int or pos.rank != 0:
        fail(E.DTYPE_MISMATCH, f"{op}: the position must be an integer scalar, found {pos}")


def dynamic_slice_rule(op, ins, attrs, declared, ctx):
    x, pos = ins
    check_class(op, x, "any")
    _check_position(op, pos)
    axis, size = attrs["axis"], attrs["size"]  # size: one dim, static or symbolic
    check_axis(op, axis, x.rank)
    if is_static(size) and (size < 0 or (is_static(x.shape[axis]) and size > x.shape[axis])):
        fail(E.ATTRIBUTE_VALUE, f"dynamic_slice: size {size} does not fit dim {axis} of {x}")
    shape = list(x.shape)
    shape[axis] = size
    return (TensorType(x.dtype, tuple(shape)),)


def dynamic_update_slice_rule(op, ins, attrs, declared, ctx):
    x, upd, pos = ins
    check_class(op, x, "any")
    _check_position(op, pos)
    axis = attrs["axis"]
    check_axis(op, axis, x.rank)
    if upd.dtype != x.dtype:
        fail(E.DTYPE_MISMATCH, f"dynamic_update_slice: update {upd} must have the dtype of {x}")
    if upd.rank != x.rank or any(a != b for i, (a, b) in enumerate(zip(upd.shape, x.shape)) if i != axis):
        fail(E.SHAPE_MISMATCH, f"dynamic_update_slice: update {upd} must match {x} in every dim but {axis}")
    if is_static(upd.shape[axis]) and is_static(x.shape[axis]) and upd.shape[axis] > x.shape[axis]:
        fail(E.SHAPE_MISMATCH, f"dynamic_update_slice: update {upd} is longer than {x} along dim {axis}")
    return (x,)


# --- linear algebra --------------------------------------------------------------------

def matmul_rule(op, ins, attrs, declared, ctx):
    a, b = ins
    check_class(op, a, "numeric")
    if a.dtype != b.dtype:
        fail(E.DTYPE_MISMATCH, f"matmul needs operands of one dtype, found {a} and {b}")
    if a.rank < 2 or b.rank < 2:
        fail(E.RANK_MISMATCH, f"matmul needs rank >= 2 operands, found {a} and {b}")
    if a.shape[-1] != b.shape[-2]:
        fail(E.SHAPE_MISMATCH, f"matmul: contracting dims differ: {a} @ {b} "
             f"({format_dim(a.shape[-1])} vs {format_dim(b.shape[-2])})")
    batch = broadcast_shapes(op, TensorType(a.dtype, a.shape[:-2]), TensorType(b.dtype, b.shape[:-2]))
    return (TensorType(a.dtype, batch + (a.shape[-2], b.shape[-1])),)


# --- creation --------------------------------------------------------------------------

def _declared_one(op, declared) -> TensorType:
    if len(declared) != 1:
        fail(E.RESULT_COUNT, f"{op} has one result, {len(declared)} declared")
    return declared[0]


def constant_rule(op, ins, attrs, declared, ctx):
    t, lit = _declared_one(op, declared), attrs["value"]
    if lit.dtype != t.dtype or lit.shape != t.shape:
        fail(E.LITERAL_MISMATCH, f"constant: the literal is {lit.dtype.name}{list(lit.shape)}, the declared type is {t}")
    return (t,)


def full_rule(op, ins, attrs, declared, ctx):
    t = _declared_one(op, declared)
    check_class(op, t, "any", "result")
    check_scalar(op, "value", attrs["value"], t.dtype)
    return (t,)


def check_scalar(op: str, name: str, value, dtype) -> None:
    ok = isinstance(value, bool) if dtype is bool_ else (
        isinstance(value, int) and not isinstance(value, bool) if dtype.is_int else isinstance(value, float))
    if not ok:
        fail(E.ATTRIBUTE_TYPE, f"{op}: {name} = {value!r} is not a {dtype} value")


def iota_rule(op, ins, attrs, declared, ctx):
    t = _declared_one(op, declared)
    check_class(op, t, "numeric", "result")
    check_axis(op, attrs["dim"], t.rank, "dim")
    return (t,)


def random_rule(op, ins, attrs, declared, ctx):
    key, t = ins[0], _declared_one(op, declared)
    expect_type(key, TensorType(DTYPES["u32"], (2,)), "random key")
    check_class(op, t, "float", "result")
    return (t,)


# --- composites ------------------------------------------------------------------------

def softmax_rule(op, ins, attrs, declared, ctx):
    check_class(op, ins[0], "float")
    check_axis(op, attrs["axis"], ins[0].rank)
    return (ins[0],)


def layer_norm_rule(op, ins, attrs, declared, ctx):
    x = ins[0]
    check_class(op, x, "float")
    if x.rank < 1:
        fail(E.RANK_MISMATCH, f"layer_norm needs rank >= 1, found {x}")
    if len(ins) == 2:
        fail(E.OPERAND_COUNT, "layer_norm takes x alone or x, weight and bias")
    for name, t in zip(("weight", "bias"), ins[1:]):
        expect_type(t, TensorType(x.dtype, (x.shape[-1],)), f"layer_norm {name}")
    return (x,)


def sdpa_rule(op, ins, attrs, declared, ctx):
    q, k, v = ins
    check_class(op, q, "float")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            fail(E.DTYPE_MISMATCH, f"scaled_dot_product_attention: {name} is {t}, q is {q}")
        if t.rank != q.rank or t.shape[:-2] != q.shape[:-2]:
            fail(E.SHAPE_MISMATCH, f"scaled_dot_product_attention: {name} is {t}, q is {q}: batch dims must be equal")
    if q.rank < 2:
        fail(E.RANK_MISMATCH, f"scaled_dot_product_attention needs rank >= 2, found {q}")
    if k.shape[-1] != q.shape[-1] or v.shape[-2] != k.shape[-2]:
        fail(E.SHAPE_MISMATCH, f"scaled_dot_product_attention: q {q}, k {k}, v {v} do not fit [.., L, D], [.., S, D], [.., S, Dv]")
    return (TensorType(q.dtype, q.shape[:-1] + (v.shape[-1],)),)


# --- state -----------------------------------------------------------------------------

def check_rule(op, ins, attrs, declared, ctx):
    x, fault = ins
    check_class(op, x, "any")
    check_class(op, fault, "bool", "fault")
    if fault.shape != x.shape:
        fail(E.SHAPE_MISMATCH, f"check: fault must have the shape of x {x}, found {fault}")
    if not any(c.value == attrs["code"] for c in E) or not attrs["code"].startswith("E08"):
        fail(E.ATTRIBUTE_VALUE, f"check: code must be a run-time error code E08xx of the spec, found {attrs['code']!r}")
    return (x,)


def assign_rule(op, ins, attrs, declared, ctx):
    expect_type(ins[1], ins[0], "assign value")
    return ()


# --- collectives and p2p ---------------------------------------------------------------

def group_size(op: str, attrs, ctx) -> int:
    mesh = ctx.meshes.get(attrs["mesh"])
    if mesh is None:
        fail(E.UNDEFINED_MESH, f"{op}: mesh @{attrs['mesh']} is not declared")
    sizes = dict(mesh.axes)
    axes = attrs["axes"]
    if not axes:
        fail(E.INVALID_GROUP, f"{op}: axes must name at least one axis of @{mesh.name}")
    if len(set(axes)) != len(axes):
        fail(E.INVALID_GROUP, f"{op}: axes {list(axes)} repeat an axis")
    n = 1
    for a in axes:
        if a not in sizes:
            fail(E.UNKNOWN_MESH_AXIS, f"{op}: mesh @{mesh.name} has axes {list(sizes)}, not {a!r}")
        n *= sizes[a]
    return n


def all_reduce_rule(op, ins, attrs, declared, ctx):
    check_class(op, ins[0], "numeric")
    group_size(op, attrs, ctx)
    return (ins[0],)


def _with_dim(t: TensorType, dim: int, d: Dim) -> TensorType:
    shape = list(t.shape)
    shape[dim] = d
    return TensorType(t.dtype, tuple(shape))


def _split(op: str, t: TensorType, dim: int, n: int) -> Dim:
    d = dim_div_exact(t.shape[dim], n)
    if d is None:
        fail(E.SHAPE_MISMATCH, f"{op}: dim {dim} of {t} is not divisible by the group size {n}")
    return d


def all_gather_rule(op, ins, attrs, declared, ctx):
    x, n = ins[0], group_size(op, attrs, ctx)
    check_axis(op, attrs["dim"], x.rank, "dim")
    return (_with_dim(x, attrs["dim"], dim_mul(x.shape[attrs["dim"]], n)),)


def reduce_scatter_rule(op, ins, attrs, declared, ctx):
    x, n = ins[0], group_size(op, attrs, ctx)
    check_class(op, x, "numeric")
    check_axis(op, attrs["dim"], x.rank, "dim")
    return (_with_dim(x, attrs["dim"], _split(op, x, attrs["dim"], n)),)


def _check_peer(op: str, attr: str, attrs, n: int) -> None:
    if not 0 <= attrs[attr] < n:
        fail(E.INVALID_GROUP, f"{op}: {attr} = {attrs[attr]} is not a rank of a group of {n}")


def broadcast_rule(op, ins, attrs, declared, ctx):
    _check_peer(op, "src", attrs, group_size(op, attrs, ctx))
    return (ins[0],)


def all_to_all_rule(op, ins, attrs, declared, ctx):
    x, n = ins[0], group_size(op, attrs, ctx)
    s, c = attrs["split_dim"], attrs["concat_dim"]
    check_axis(op, s, x.rank, "split_dim")
    check_axis(op, c, x.rank, "concat_dim")
    y = _with_dim(x, s, _split(op, x, s, n))
    return (_with_dim(y, c, dim_mul(y.shape[c], n)),)


def send_rule(op, ins, attrs, declared, ctx):
    _check_peer(op, "dst", attrs, group_size(op, attrs, ctx))
    return ()


def recv_rule(op, ins, attrs, declared, ctx):
    _check_peer(op, "src", attrs, group_size(op, attrs, ctx))
    return (_declared_one(op, declared),)


def barrier_rule(op, ins, attrs, declared, ctx):
    group_size(op, attrs, ctx)
    return ()


# --- store and calls -------------------------------------------------------------------

def store_get_rule(op, ins, attrs, declared, ctx):
    return (_declared_one(op, declared),)


def no_result_rule(op, ins, attrs, declared, ctx):
    return ()


def call_rule(op, ins, attrs, declared, ctx):
    callee = ctx.funcs.get(attrs["callee"])
    if callee is None:
        fail(E.UNDEFINED_FUNC, f"call: function @{attrs['callee']} is not defined")
    if len(ins) != len(callee.params):
        fail(E.OPERAND_COUNT, f"call: @{callee.name} takes {len(callee.params)} operands, found {len(ins)}")
    for i, (t, p) in enumerate(zip(ins, callee.params)):
        expect_type(t, p.type, f"call @{callee.name} operand {i}")
    return tuple(t for t, _ in callee.result_types)
