"""Sharding propagation: give every value of a global-view function a sharding.

    g = propagate_shardings(module, "step")     # a copy of @step, every value placed

Parameters without a sharding are replicated. Ops are visited in program order; for each,
`choose` asks the op's rule (rules.py) for its strategies on every mesh axis and takes the
cheapest: the one whose operands need the fewest bytes moved to reach the placements it
asks for (redistribute.transition_cost), then the one that reduces fewest partial operands
(a reduction deferred may never be needed, or merge with a later one), then the one that
changes fewest placements, then the rule's own order. The all-replicated strategy is always a candidate, so every op has a
plan. A strategy that would shard one dim by two axes, split a symbolic dim unevenly or
mix partial ops is skipped. A result the user annotated keeps its annotation (partitioning
redistributes to it); every other result gets its strategy's placement. Declared result
shardings are kept; missing ones are filled with the returned value's.

The choice is greedy and local: it looks at one op at a time. It is deterministic, so
partitioning calls `choose` again on the propagated function and gets the same plan.

A local-view function (one with a collective or point-to-point op, directly or through
`call`: spec 1.2) and a function with no shardings are returned unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ...errors import DTMError, ErrorCode as E
from ...ir.module import Func, Module, Op, Value
from ...ir.symbolic import SymDim
from ...ir.types import Mesh, Placement, Replicate, Sharding, TensorType
from ...ir.chunks import coords
from .layout import function_mesh, local_type, replicated, shardable
from .redistribute import transition_cost
from .rules import LOCAL_VIEW_ONLY, Strategy, rule_for

R = Replicate()
SYMBOL_GUESS = 1024  # the size a symbol stands for when pricing a redistribution
# A placement left open (a redistribute that names only some mesh axes): the value keeps on
# that axis what propagation gives it. Filled by `resolve_free` before a function is
# partitioned; never in a module that is printed, encoded or run.
FREE = Placement("free")


@dataclass(frozen=True)
class OpPlan:
    """How one op runs: the sharding each operand is brought to, each result's sharding,
    and the special local lowerings by mesh axis index (rules.Strategy.local)."""

    ins: tuple[Sharding, ...]
    outs: tuple[Sharding, ...]
    local: tuple[tuple[int, str], ...] = ()


def _nbytes(t: TensorType, sh: Sharding, mesh: Mesh) -> float:
    """Bytes of the largest piece of a value of type t under sh (coordinate 0 has it)."""
    n = 1
    for d in local_type(t, sh, mesh, coords(mesh, 0)).shape:
        n *= d if isinstance(d, int) else _guess(d)
    return n * t.dtype.bits / 8 / t.dtype.block


def _guess(d: SymDim) -> int:
    return max(1, sum(c * SYMBOL_GUESS ** len(m) for m, c in d.terms))


def _fits(t: TensorType, chosen: Sequence[Placement], p: Placement, n: int) -> bool:
    """Whether placement p on the next axis (of size n) fits a value of type t that has
    `chosen` on the axes before it."""
    if p.kind == "shard":
        return 0 <= p.arg < t.rank and shardable(t, p.arg, n) and p not in chosen
    if p.kind == "partial":
        return t.dtype.is_numeric and all(q.kind != "partial" or q == p for q in chosen)
    return True


# choose's plans by what decides them: the rules read an op's name, attributes and types
# only, so the ops of a model's repeated layers (and of a program traced again, at a resized
# mesh's shape) take their plans from here; bounded by starting over
_PLANS: dict[tuple, "OpPlan"] = {}
PLANS_MAX = 1 << 16


def choose(op: Op, ins: Sequence[Sharding], mesh: Mesh) -> OpPlan:
    """The cheapest plan for `op` given its operands' shardings."""
    key = (op.name, op.attrs_key, tuple(v.type for v in op.operands), tuple(r.type for r in op.results),
           tuple(ins), mesh)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= PLANS_MAX:
            _PLANS.clear()
        plan = _PLANS[key] = _choose(op, ins, mesh)
    return plan


def _choose(op: Op, ins: Sequence[Sharding], mesh: Mesh) -> OpPlan:
    rule = rule_for(op.name)
    in_types = [v.type for v in op.operands]
    out_types = [r.type for r in op.results]
    nbytes = [_nbytes(t, sh, mesh) for t, sh in zip(in_types, ins)]
    everywhere = Strategy((R,) * len(in_types), (R,) * len(out_types))
    chosen_in: list[list[Placement]] = [[] for _ in in_types]
    chosen_out: list[list[Placement]] = [[] for _ in out_types]
    local = []
    for a, (_, n) in enumerate(mesh.axes):
        cur = tuple(sh.placements[a] for sh in ins)
        candidates = list(rule(op, cur, n)) + [everywhere]

        def price(item: tuple[int, Strategy]) -> tuple:
            i, s = item
            moves = [(c, w, b) for c, w, b in zip(cur, s.ins, nbytes) if c != w]
            reductions = sum(1 for c, w, _ in moves if c.kind == "partial")
            return sum(transition_cost(c, w, b, n) for c, w, b in moves), reductions, len(moves), i

        for _, s in sorted(enumerate(candidates), key=price):
            if all(_fits(t, c, p, n) for t, c, p in zip(in_types, chosen_in, s.ins)) and \
                    all(_fits(t, c, p, n) for t, c, p in zip(out_types, chosen_out, s.outs)):
                break
        for c, p in zip(chosen_in, s.ins):
            c.append(p)
        for c, p in zip(chosen_out, s.outs):
            c.append(p)
        if s.local is not None:
            local.append((a, s.local))
    return OpPlan(tuple(Sharding(mesh.name, tuple(c)) for c in chosen_in),
                  tuple(Sharding(mesh.name, tuple(c)) for c in chosen_out), tuple(local))


def is_local_view(module: Module, f: Func, _seen: frozenset[str] = frozenset()) -> bool:
    """Whether f holds a collective or point-to-point op, directly or through `call`."""
    for op in f.ops:
        if op.name in LOCAL_VIEW_ONLY:
            return True
        if op.name == "call":
            callee = module.funcs.get(op.attrs["callee"])
            if callee is not None and callee.name not in _seen and is_local_view(module, callee, _seen | {f.name}):
                return True
    return False


def propagate(module: Module, func: str) -> tuple[Func, Mesh | None]:
    """(@func with every value placed, its mesh); the function itself and None when it is
    local-view or has no shardings."""
    f = module.funcs.get(func)
    if f is None:
        raise DTMError(E.UNDEFINED_FUNC, f"sharding propagation: the module has no function @{func} (it has: "
                       f"{', '.join('@' + n for n in module.funcs) or 'none'})")
    if is_local_view(module, f):
        return f, None
    mesh = function_mesh(module, f)
    if mesh is None:
        return f, None
    rep = replicated(mesh)
    vmap: dict[Value, Value] = {}
    params = []
    for p in f.params:
        vmap[p] = Value(p.type, p.name, p.sharding or rep)
        params.append(vmap[p])
    ops = []
    for op in f.ops:
        plan = choose(op, [vmap[v].sharding for v in op.operands], mesh)
        results = tuple(Value(r.type, r.name, r.sharding or out) for r, out in zip(op.results, plan.outs))
        vmap.update(zip(op.results, results))
        ops.append(Op(op.name, tuple(vmap[v] for v in op.operands), op.attrs, results, op.loc, op.attrs_key))
    returns = [vmap[v] for v in f.returns]
    result_types = [(t, sh or v.sharding) for (t, sh), v in zip(f.result_types, returns)]
    return Func(f.name, params, result_types, ops, returns, f.loc, f.return_loc), mesh


def propagate_shardings(module: Module, func: str) -> Func:
    """A copy of global-view function @func in which every value has a sharding (see the
    module docstring); raises DTMError for shardings that do not fit their values."""
    return propagate(module, func)[0]


def resolve_free(module: Module, func: str) -> None:
    """Fill, in place, the open (FREE) axes of pinned shardings in @func with what
    propagation gives those values without the pins. (One propagation for all of them:
    each mesh axis is placed on its own, so a pin on one axis barely moves the others; and
    any complete sharding is correct, the open axes only decide what is cheaper.)"""
    f = module.funcs[func]
    pinned = [(i, k, r.sharding) for i, op in enumerate(f.ops) for k, r in enumerate(op.results)
              if r.sharding is not None and FREE in r.sharding.placements]
    if not pinned:
        return
    for i, k, _ in pinned:
        f.ops[i].results[k].sharding = None
    g = propagate_shardings(module, func)
    for i, k, sh in pinned:
        got = g.ops[i].results[k].sharding.placements
        f.ops[i].results[k].sharding = Sharding(sh.mesh, tuple(q if p == FREE else p
                                                               for p, q in zip(sh.placements, got)))
