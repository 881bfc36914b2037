"""Memory planning: which temporaries share memory.

Walking the steps in order, each temporary a kernel writes takes a slot: the slot of an
input whose last use is this kernel when the kernel can write in place (below), else a free
slot of the same byte size (sizes are dims, so equal means equal for every value of the
symbols), else a new slot. A slot is free again after the step that last reads its
occupant. Returned values and parameters never share: the caller owns them. Fallback
results are the reference's own arrays and are only dropped after their last use.

In place: a kernel may write output o over input p when both have the same number of
elements of the same size, the kernel has a single store (to o, the last statement of its
innermost loop), and every load of p reads exactly the element that store writes (one
index expression for all of them): each element is then read before it is overwritten, and
never read after. Matrix products never write in place.
"""

from __future__ import annotations

from ..ir.symbolic import dim_mul, dim_prod
from . import loopir as L
from .program import Buffer, KernelStep, Program


def nbytes(b: Buffer):
    return dim_mul(dim_prod(b.type.shape), b.type.dtype.itemsize)


def _accesses(body: list, loads: dict, stores: dict) -> bool:
    """Collect the index expressions of loads and stores per buffer param; False if the
    body holds a Gemm."""
    def expr(e):
        for ld in L.loads_of(e):
            loads.setdefault(ld.buf, set()).add(ld.index)

    for s in body:
        if isinstance(s, L.Gemm):
            return False
        if isinstance(s, L.Loop):
            expr(s.start), expr(s.stop)
            if not _accesses(s.body, loads, stores):
                return False
        elif isinstance(s, (L.Let, L.Assign, L.Bind)):
            expr(s.value)
        elif isinstance(s, L.Store):
            expr(s.index), expr(s.value)
            stores.setdefault(s.buf, set()).add(s.index)
        elif isinstance(s, L.If):
            expr(s.cond)
            if not _accesses(s.body, loads, stores):
                return False
    return True


def in_place_pairs(step: KernelStep) -> list[tuple[str, str]]:
    """(output param, input param) pairs the kernel could compute in place."""
    loads: dict = {}
    stores: dict = {}
    if not _accesses(step.kernel.body, loads, stores):
        return []
    if sum(len(ix) for ix in stores.values()) != 1 or _store_count(step.kernel.body) != 1:
        return []  # one store, the last statement of its loop body: every load comes before it
    params = {p.name: (p, b) for p, b in zip(step.kernel.params, step.args)}
    pairs = []
    for o, o_idx in stores.items():
        po, bo = params[o]
        for i, i_idx in loads.items():
            pi, bi = params[i]
            if pi.output or len(o_idx) != 1 or i_idx != o_idx:
                continue
            if nbytes(bo) == nbytes(bi) and bo.type.shape == bi.type.shape \
                    and bo.type.dtype.itemsize == bi.type.dtype.itemsize:
                pairs.append((o, i))
    return pairs


def _store_count(body: list) -> int:
    n = 0
    for s in body:
        if isinstance(s, L.Store):
            n += 1
        elif isinstance(s, (L.Loop, L.If)):
            n += _store_count(s.body)
    return n


def plan_memory(program: Program) -> Program:
    steps = program.steps
    last: dict[Buffer, int] = {}
    for i, s in enumerate(steps):
        for b in s.inputs:
            last[b] = i
    program.frees = [[] for _ in steps]
    returned = set(program.returns)
    for b, i in last.items():
        if b.kind in ("temp", "fallback") and b not in returned:
            program.frees[i].append(b)
    slots: list = []          # size of each slot
    free: list[int] = []      # free slot numbers
    for i, s in enumerate(steps):
        if isinstance(s, KernelStep):
            pairs = {o: p for o, p in in_place_pairs(s)}
            names = {id(b): p.name for p, b in zip(s.kernel.params, s.args)}
            by_name = {p.name: b for p, b in zip(s.kernel.params, s.args)}
            for b in s.outputs:
                if b.kind != "temp" or b.slot is not None:
                    continue
                cand = pairs.get(names[id(b)])
                src = by_name.get(cand) if cand else None
                if src is not None and src.kind == "temp" and last.get(src) == i and src.slot is not None:
                    b.slot, b.alias = src.slot, src
                    s.kernel.aliases[names[id(b)]] = cand
                    continue
                size = nbytes(b)
                for n in free:
                    if slots[n] == size:
                        free.remove(n)
                        b.slot = n
                        break
                else:
                    b.slot = len(slots)
                    slots.append(size)
        for b in program.frees[i]:
            if b.slot is not None and not any(o.alias is b for o in s.outputs):
                free.append(b.slot)
    program.slots = slots
    return program

