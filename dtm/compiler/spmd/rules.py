"""Sharding rules, one per op of the registry, looked up by op name (docs/architecture.md: the sharding
rule hangs off the registry entry, in layer 3).

A rule looks at one mesh axis at a time. `rule(op, cur, n)` gets the op (its operand and
result types and attributes), the placement `cur[i]` of each operand on that axis, and the
axis size `n`; it returns the `Strategy`s under which the op can run on local pieces: the
placement each operand must have on the axis and the placement each result then has. Every
strategy it returns MUST be exact: running the op on every rank's pieces gives the pieces of
the global result. Propagation (propagate.py) adds "everything replicated" as the last
candidate, prices each candidate by the redistributions its operands need and picks the
cheapest; so a rule lists what it *can* do, not what it prefers (on equal cost the earlier
candidate wins). Axes are independent because a tensor dim is sharded by one axis at most;
propagate.py rejects candidates that would shard a dim twice.

What the rules know, by family:

- elementwise: a dim passes through where no operand broadcasts along it; partial values
  pass through the ops that are linear in them (`partial(sum)`: add, sub, neg, mul or div by
  a replicated value, ...), and `partial(max|min)` through non-decreasing ones (exp, add of
  a replicated value, max, ...). A replicated operand can join partial ones for free (it
  becomes `partial(sum)` by keeping its value on coordinate 0 and zeros elsewhere).
- reductions: a reduced sharded dim gives `partial(op)` for sum, prod, max and min; argmax,
  argmin, argsort and cumsum need their dim whole (cumsum carries a partial sum).
- matmul: batch, row and column dims pass through; the contraction dim sharded on both sides
  gives `partial(sum)`.
- movement: dims that the op leaves whole pass through (reshape: when the chunks line up);
  sliced, padded, flipped or concatenated dims must be whole. `gather` from a table sharded
  by rows (a vocab-parallel embedding) is a masked local lookup giving `partial(sum)`, and
  `scatter_add` into such a table a masked local update.
- composites: every dim but the one they normalise over or attend across.

Ops whose rule is `fallback` (and any op missing from RULES) have no better rule: their
operands are made replicated and they run whole on every rank, with a one-time warning
naming the op. `LOCAL_VIEW_ONLY` ops (collectives, point-to-point) make a function a
local-view function (spec 1.2), which is not partitioned.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

from ...ir.module import Op
from ...ir.registry import REGISTRY, Category
from ...ir.symbolic import dim_div_exact, dim_prod
from ...ir.types import Partial, Placement, Replicate, Shard, TensorType

R = Replicate()


@dataclass(frozen=True)
class Strategy:
    """On one mesh axis: the placement each operand must have and each result then has.
    `local` names a special local lowering in partition.py (None: the op itself, run on the
    local pieces with its shape attributes made local)."""

    ins: tuple[Placement, ...]
    outs: tuple[Placement, ...]
    local: str | None = None


Rule = Callable[[Op, tuple[Placement, ...], int], list[Strategy]]
RULES: dict[str, Rule] = {}

LOCAL_VIEW_ONLY: frozenset[str] = frozenset(
    n for n, d in REGISTRY.items() if d.category in (Category.COLLECTIVE, Category.P2P))


def rule(*names: str):
    def deco(fn: Rule) -> Rule:
        for n in names:
            assert n in REGISTRY and n not in RULES, n
            RULES[n] = fn
        return fn
    return deco


def fallback(op: Op, cur, n) -> list[Strategy]:
    """The rule of an op with no better one: no candidate but the all-replicated one that
    propagation always adds."""
    return []


_warned: set[str] = set()


def rule_for(name: str) -> Rule:
    """The op's rule. For an op without one, or whose rule is `fallback`, warns once per op
    name that it runs replicated."""
    fn = RULES.get(name, fallback)
    if fn is fallback and name not in _warned:
        _warned.add(name)
        warnings.warn(f"dtm: op {name} has no sharding rule: its operands are gathered to replicated "
                      "tensors and it runs whole on every rank", stacklevel=3)
    return fn


# --- helpers -----------------------------------------------------------------------------

def _types(op: Op) -> list[TensorType]:
    return [v.type for v in op.operands]


def _sums(p: Placement, t: TensorType) -> bool:
    """Whether p is a partial that linear ops carry: sum (exact modulo 2^bits for integers
    too), or avg for floats (integer avg truncates, which is not linear)."""
    return p.kind == "partial" and (p.arg == "sum" or (p.arg == "avg" and t.dtype.is_float))


def _extreme(p: Placement) -> bool:
    return p.kind == "partial" and p.arg in ("max", "min")


def _partials(cur: Sequence[Placement]) -> list[Placement]:
    """The distinct partial placements among the operands, in operand order."""
    out: list[Placement] = []
    for p in cur:
        if p.kind == "partial" and p not in out:
            out.append(p)
    return out


def _aligned(inner: TensorType, outer: TensorType, o: int) -> int | None:
    """The dim of `inner` that result dim `o` of `outer` reads under numpy broadcasting, or
    None when inner lacks it or broadcasts along it."""
    j = o - (outer.rank - inner.rank)
    if j < 0 or inner.shape[j] != outer.shape[o]:
        return None
    return j


def _pointwise(op: Op) -> list[Strategy]:
    """Shard any result dim; each operand is sharded along it where it has it, replicated
    where it broadcasts."""
    out = op.results[0].type
    strategies = []
    for o in range(out.rank):
        ins = tuple(Shard(j) if (j := _aligned(t, out, o)) is not None else R for t in _types(op))
        strategies.append(Strategy(ins, (Shard(o),)))
    return strategies


def _carry(op: Op, cur) -> list[Strategy]:
    """A selection or rearrangement of the first operand's elements carries any partial:
    the pieces' results reduce to the result. Other operands stay replicated."""
    p = cur[0]
    if p.kind != "partial":
        return []
    return [Strategy((p,) + (R,) * (len(op.operands) - 1), (p,) * len(op.results))]


# --- elementwise -------------------------------------------------------------------------

# Non-decreasing functions defined on every value (a piece of a partial(max) may be any
# value below the maximum, -inf included, so log and sqrt are out): max and min of the
# pieces commute with them.
_MONOTONE = {"exp", "exp2", "tanh", "erf", "sigmoid", "floor", "ceil", "round", "sign"}
_SWAP = {"max": "min", "min": "max"}


@rule(*(n for n, d in REGISTRY.items() if d.category is Category.UNARY))
def _unary(op: Op, cur, n) -> list[Strategy]:
    out = _pointwise(op)
    p, t = cur[0], op.operands[0].type
    if p.kind != "partial":
        return out
    if op.name == "neg" and _sums(p, t):
        out.append(Strategy((p,), (p,)))
    elif op.name == "neg" and _extreme(p) and t.dtype.is_float:  # -max(x) = min(-x); ints wrap at MIN
        out.append(Strategy((p,), (Partial(_SWAP[p.arg]),)))
    elif _extreme(p) and (op.name in _MONOTONE or (op.name == "cast" and _keeps_order(t, op.attrs["to"]))):
        out.append(Strategy((p,), (p,)))
    return out


def _keeps_order(t: TensorType, to) -> bool:
    """Whether cast from t to dtype `to` is non-decreasing everywhere: to a float dtype with
    infinities (f8e4m3 turns overflow into NaN), from a plain dtype."""
    return to.is_float and not to.name.startswith("f8e4m3") and not t.dtype.is_quant


def _binary_partials(name: str, p: Placement, t: TensorType) -> list[tuple[Placement, Placement]]:
    """Operand placements under which binary op `name` carries partial p to its result."""
    # Shifting by a replicated value keeps order for floats only (integers wrap).
    sums, fl = _sums(p, t), t.dtype.is_float
    ext = _extreme(p) and fl
    table = {
        "add": [(p, p)] if sums else [(p, R), (R, p)] if ext else [],
        "sub": [(p, p)] if sums else [(p, R)] if ext else [],
        "mul": [(p, R), (R, p)] if sums else [(p, p)] if p.arg == "prod" else [],
        "div": [(p, R)] if sums and fl else [(p, p)] if p.arg == "prod" and fl else [],
        "max": [(p, p), (p, R), (R, p)] if p == Partial("max") else [],
        "min": [(p, p), (p, R), (R, p)] if p == Partial("min") else [],
    }
    return table.get(name, [])


@rule(*(n for n, d in REGISTRY.items() if d.category in (Category.BINARY, Category.COMPARE)))
def _binary(op: Op, cur, n) -> list[Strategy]:
    out = _pointwise(op)
    t = op.operands[0].type
    for p in _partials(cur):
        out += [Strategy(ins, (p,)) for ins in _binary_partials(op.name, p, t)]
    return out


@rule("where")
def _where(op: Op, cur, n) -> list[Strategy]:
    out = _pointwise(op)
    # A selection between two partial operands of one op is the partial of the selections.
    out += [Strategy((R, p, p), (p,)) for p in _partials(cur[1:])]
    return out


# --- reductions --------------------------------------------------------------------------

_REDUCE_OP = {"reduce_sum": "sum", "reduce_prod": "prod", "reduce_max": "max", "reduce_min": "min"}


def _kept(d: int, axes: Sequence[int], keepdims: bool) -> int:
    """The result dim of operand dim d (not reduced)."""
    return d if keepdims else d - sum(1 for a in axes if a < d)


@rule(*_REDUCE_OP)
def _reduce(op: Op, cur, n) -> list[Strategy]:
    x = op.operands[0].type
    axes, keep, red = op.attrs["axes"], op.attrs["keepdims"], _REDUCE_OP[op.name]
    out = []
    for d in range(x.rank):
        if d in axes:  # each rank reduces its chunk; the chunks' results reduce with the same op
            out.append(Strategy((Shard(d),), (Partial(red),)))
        else:
            out.append(Strategy((Shard(d),), (Shard(_kept(d, axes, keep)),)))
    p = cur[0]
    if p.kind == "partial" and (p.arg == red or (red == "sum" and _sums(p, x))):
        out.append(Strategy((p,), (p,)))
    return out


@rule("argmax", "argmin")
def _arg(op: Op, cur, n) -> list[Strategy]:
    x, axis = op.operands[0].type, op.attrs["axis"]
    return [Strategy((Shard(d),), (Shard(_kept(d, (axis,), op.attrs["keepdims"])),))
            for d in range(x.rank) if d != axis]


@rule("argsort", "cumsum")
def _along_axis(op: Op, cur, n) -> list[Strategy]:
    """Each slice along `axis` is sorted or summed on its own: any other dim may be
    sharded. A running sum is linear, so it carries a partial sum too."""
    x, axis = op.operands[0].type, op.attrs["axis"]
    out = [Strategy((Shard(d),), (Shard(d),)) for d in range(x.rank) if d != axis]
    if op.name == "cumsum" and _sums(cur[0], x):
        out.append(Strategy((cur[0],), (cur[0],)))
    return out


# --- movement ----------------------------------------------------------------------------

def _divides(d, n: int) -> bool:
    return dim_div_exact(d, n) is not None


def reshape_dim(src: Sequence, dst: Sequence, d: int, n: int) -> int | None:
    """The result dim of a reshape from shape `src` to `dst` that holds operand dim d's
    chunks when d is split n ways, or None when the chunks do not line up. Dim d must sit
    at the same row-major offset in both shapes; then it is kept (equal sizes: any split),
    is the leading dim merged with the next ones (d divisible by n), or is split with its
    leading part first (that part divisible by n)."""
    before = dim_prod(src[:d])
    through = dim_prod(src[:d + 1])
    for o in range(len(dst)):
        if dim_prod(dst[:o]) != before:
            continue
        if dst[o] == src[d]:
            return o
        if any(dim_prod(src[:e + 1]) == dim_prod(dst[:o + 1]) for e in range(d + 1, len(src))):
            return o if _divides(src[d], n) else None  # merged: [d, d+1, ...] -> o
        if any(dim_prod(dst[:e + 1]) == through for e in range(o + 1, len(dst))):
            return o if _divides(dst[o], n) else None  # split: d -> [o, o+1, ...]
    return None


@rule("reshape")
def _reshape(op: Op, cur, n) -> list[Strategy]:
    src, dst = op.operands[0].type.shape, op.results[0].type.shape
    out = [Strategy((Shard(d),), (Shard(o),)) for d in range(len(src))
           if (o := reshape_dim(src, dst, d, n)) is not None]
    return out + _carry(op, cur)


@rule("permute")
def _permute(op: Op, cur, n) -> list[Strategy]:
    perm = op.attrs["perm"]
    return [Strategy((Shard(p),), (Shard(i),)) for i, p in enumerate(perm)] + _carry(op, cur)


@rule("broadcast_to")
def _broadcast_to(op: Op, cur, n) -> list[Strategy]:
    x, y = op.operands[0].type, op.results[0].type
    out = [Strategy((Shard(j),), (Shard(o),)) for o in range(y.rank) if (j := _aligned(x, y, o)) is not None]
    return out + _carry(op, cur)


def _whole_dims(op: Op) -> list[int]:
    """The dims a slice or pad leaves as they are."""
    x, a = op.operands[0].type, op.attrs
    if op.name == "slice":
        return [d for d in range(x.rank) if a["start"][d] == 0 and a["stop"][d] == x.shape[d] and a["step"][d] == 1]
    return [d for d in range(x.rank) if a["low"][d] == 0 and a["high"][d] == 0]


@rule("slice")
def _slice(op: Op, cur, n) -> list[Strategy]:
    return [Strategy((Shard(d),), (Shard(d),)) for d in _whole_dims(op)] + _carry(op, cur)


_PAD_IDENTITY = {"sum": 0, "avg": 0, "prod": 1}  # max and min: any fill value commutes


@rule("pad")
def _pad(op: Op, cur, n) -> list[Strategy]:
    out = [Strategy((Shard(d),), (Shard(d),)) for d in _whole_dims(op)]
    p = cur[0]
    if p.kind == "partial" and (_extreme(p) or op.attrs["value"] == _PAD_IDENTITY[p.arg]):
        out += _carry(op, cur)
    return out


@rule("flip")
def _flip(op: Op, cur, n) -> list[Strategy]:
    x = op.operands[0].type
    return [Strategy((Shard(d),), (Shard(d),)) for d in range(x.rank) if d not in op.attrs["axes"]] + _carry(op, cur)


@rule("concat")
def _concat(op: Op, cur, n) -> list[Strategy]:
    k, rank, axis = len(op.operands), op.results[0].type.rank, op.attrs["axis"]
    out = [Strategy((Shard(d),) * k, (Shard(d),)) for d in range(rank) if d != axis]
    return out + [Strategy((p,) * k, (p,)) for p in _partials(cur)]


def _gathered(d: int, axis: int, idx_rank: int) -> int:
    """The result dim of gather that operand dim d (not `axis`) becomes."""
    return d if d < axis else d + idx_rank - 1


@rule("gather")
def _gather(op: Op, cur, n) -> list[Strategy]:
    x, idx = _types(op)
    axis = op.attrs["axis"]
    out = [Strategy((Shard(d), R), (Shard(_gathered(d, axis, idx.rank)),)) for d in range(x.rank) if d != axis]
    out += [Strategy((R, Shard(j)), (Shard(axis + j),)) for j in range(idx.rank)]
    if x.dtype.is_numeric:  # rows sharded: each rank looks up the rows it holds, zeros elsewhere
        out.append(Strategy((Shard(axis), R), (Partial("sum"),), local="masked_gather"))
    return out + _carry(op, cur)


@rule("scatter_add")
def _scatter_add(op: Op, cur, n) -> list[Strategy]:
    x, idx, _ = _types(op)
    axis, s = op.attrs["axis"], Partial("sum")
    out = [Strategy((Shard(d), R, Shard(_gathered(d, axis, idx.rank))), (Shard(d),))
           for d in range(x.rank) if d != axis]
    # Indices (and their updates) split across ranks: each adds its share into its addend.
    out += [Strategy((s, Shard(j), Shard(axis + j)), (s,)) for j in range(idx.rank)]
    out.append(Strategy((s, R, s), (s,)))
    out.append(Strategy((Shard(axis), R, R), (Shard(axis),), local="masked_scatter_add"))
    return out


@rule("dynamic_slice")
def _dynamic_slice(op: Op, cur, n) -> list[Strategy]:
    x = op.operands[0].type
    out = [Strategy((Shard(d), R), (Shard(d),)) for d in range(x.rank) if d != op.attrs["axis"]]
    return out + _carry(op, cur)


@rule("dynamic_update_slice")
def _dynamic_update_slice(op: Op, cur, n) -> list[Strategy]:
    x = op.operands[0].type
    out = [Strategy((Shard(d), Shard(d), R), (Shard(d),)) for d in range(x.rank) if d != op.attrs["axis"]]
    return out + [Strategy((p, p, R), (p,)) for p in _partials(cur[:2])]


# --- linear algebra ----------------------------------------------------------------------

@rule("matmul")
def _matmul(op: Op, cur, n) -> list[Strategy]:
    a, b = _types(op)
    y = op.results[0].type
    out = []
    for o in range(y.rank - 2):  # batch dims, broadcast as elementwise ops do
        ins = tuple(Shard(j) if (j := _aligned(t.with_shape(t.shape[:-2]), y.with_shape(y.shape[:-2]), o))
                    is not None else R for t in (a, b))
        out.append(Strategy(ins, (Shard(o),)))
    out.append(Strategy((Shard(a.rank - 2), R), (Shard(y.rank - 2),)))       # rows of a
    out.append(Strategy((R, Shard(b.rank - 1)), (Shard(y.rank - 1),)))       # columns of b
    out.append(Strategy((Shard(a.rank - 1), Shard(b.rank - 2)), (Partial("sum"),)))  # contraction
    for p in _partials(cur):
        if _sums(p, a):
            out += [Strategy((p, R), (p,)), Strategy((R, p), (p,))]
    return out


rule("call")(fallback)  # a callee would need partitioning for its operands' shardings


# --- creation, state, store --------------------------------------------------------------

@rule("constant", "full", "iota", "random", "store_get")
def _source(op: Op, cur, n) -> list[Strategy]:
    return []  # made whole on every rank: a random key gives every rank the same numbers


@rule("store_put")
def _store_put(op: Op, cur, n) -> list[Strategy]:
    return []  # every rank stores the whole tensor in its own store


@rule("assign")
def _assign(op: Op, cur, n) -> list[Strategy]:
    # The parameter's buffer keeps its placement; the value is brought to it.
    return [Strategy((cur[0], cur[0]), ())]


@rule("check")
def _check(op: Op, cur, n) -> list[Strategy]:
    """x and its fault are pieced alike: each rank checks the elements it holds."""
    return _pointwise(op)


# --- composites --------------------------------------------------------------------------

@rule("gelu", "silu")
def _pointwise_composite(op: Op, cur, n) -> list[Strategy]:
    return _pointwise(op)


@rule("softmax", "log_softmax")
def _softmax(op: Op, cur, n) -> list[Strategy]:
    return [s for s in _pointwise(op) if s.outs[0].arg != op.attrs["axis"]]


@rule("layer_norm")
def _layer_norm(op: Op, cur, n) -> list[Strategy]:
    x = op.operands[0].type
    return [Strategy((Shard(d),) + (R,) * (len(op.operands) - 1), (Shard(d),)) for d in range(x.rank - 1)]


@rule("scaled_dot_product_attention")
def _sdpa(op: Op, cur, n) -> list[Strategy]:
    q = op.operands[0].type
    r = q.rank
    out = [Strategy((Shard(d),) * 3, (Shard(d),)) for d in range(r - 2)]  # batch and heads
    if not op.attrs["causal"]:  # queries are independent; a causal mask needs their positions
        out.append(Strategy((Shard(r - 2), R, R), (Shard(r - 2),)))
    out.append(Strategy((R, R, Shard(r - 1)), (Shard(r - 1),)))  # value columns
    return out
