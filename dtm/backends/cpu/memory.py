"""Memory planning: which temporaries share memory.

Walking the steps in order, each temporary a kernel writes takes a slot: the slot of an
input whose last use is this kernel when the kernel can write in place (below), else a free
slot of the same byte size (sizes are dims, so equal means equal for every value of the
symbols), else a new slot. A slot is free again after the step that last reads its
occupant. Returned values and parameters never share: the caller owns them. Fallback
results are the reference's own arrays and are only dropped after their last use, except
for ops whose reference works in place (scatter_add, `program.INTO_FALLBACKS`): their
result takes a slot like a kernel's, x's own when this is x's last read. Move steps
(`program.MoveStep`) take slots like kernels; a dynamic_update_slice takes its operand's
when this is the operand's last read, and then writes only the window.

In place: a kernel may write output o over input p when both have the same number of
elements of the same size, the kernel has a single store (to o, the last statement of its
innermost loop), and every load of p reads exactly the element that store writes (one
index expression for all of them): each element is then read before it is overwritten, and
never read after. Matrix products never write in place.

Updates in place: when a kernel computes the value an `assign` gives a parameter (an
optimizer's new weight or state), reads that parameter at most in place, and no later step
but the assign reads it, the kernel writes the parameter's own memory and the assign has
nothing left to do (`Program.done_in_place`): no temporary, no copy.
"""

from __future__ import annotations

from ...compiler import loopir as L
from ...compiler.program import Buffer, FallbackStep, KernelStep, MoveStep, Program, writes_into
from ...ir.symbolic import dim_mul, dim_prod


def nbytes(b: Buffer):
    return dim_mul(dim_prod(b.type.shape), b.type.dtype.itemsize)


def _accesses(body: list, loads: dict, stores: dict) -> bool:
    """Collect the index expressions of loads and stores per buffer param; False if the
    body holds a Gemm."""
    def expr(e):
        for ld in L.loads_of(e):
            loads.setdefault(ld.buf, set()).add(ld.index)

    for s in body:
        if isinstance(s, (L.Gemm, L.Quant)):
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


def in_place_pairs(step: KernelStep, several: bool = False) -> list[tuple[str, str]]:
    """(output param, input param) pairs the kernel could compute in place. With `several`,
    a kernel with several stores qualifies too: for each pair, the input is read at the one
    index the output is written at, never after that store, and each element is stored once
    (an optimizer's kernel updating weights and their state)."""
    loads: dict = {}
    stores: dict = {}
    if not _accesses(step.kernel.body, loads, stores):
        return []
    if not several and (sum(len(ix) for ix in stores.values()) != 1 or _store_count(step.kernel.body) != 1):
        return []  # one store, the last statement of its loop body: every load comes before it
    # (several: each pair is checked below: one index, no read after the store, no repeated store)
    params = {p.name: (p, b) for p, b in zip(step.kernel.params, step.args)}
    order = _positions(step.kernel.body, ({}, {}, set()), [0]) if several else None
    pairs = []
    for o, o_idx in stores.items():
        if o not in params:
            continue  # a local array
        po, bo = params[o]
        for i, i_idx in loads.items():
            if i not in params:
                continue
            pi, bi = params[i]
            if pi.output or len(o_idx) != 1 or i_idx != o_idx:
                continue
            if several and (order[1].get(i, -1) > order[0][o] or o in order[2]):
                continue  # read after the store to o, or o written more than once
            if nbytes(bo) == nbytes(bi) and bo.type.shape == bi.type.shape \
                    and bo.type.dtype.itemsize == bi.type.dtype.itemsize:
                pairs.append((o, i))
    return pairs


def _positions(body: list, order: tuple, n: list[int], loops: tuple = (), deps: dict | None = None) -> tuple:
    """In statement order: the position of the first store to each buffer, of the last load
    from each, and the buffers some store writes more than once (its index leaves out a
    loop around it: a row value stored in a loop over its reduced axis)."""
    stored, loaded, repeated = order
    deps = {} if deps is None else deps  # a bound name -> the loop variables it depends on
    for st in body:
        if isinstance(st, L.Loop):
            _positions(st.body, order, n, loops + (st.var,), deps)
            continue
        if isinstance(st, L.If):
            _positions(st.body, order, n, loops, deps)
            continue
        n[0] += 1
        values = [st.value] if isinstance(st, (L.Let, L.Assign, L.Bind)) else \
            [st.index, st.value] if isinstance(st, L.Store) else []
        for e in values:
            for ld in L.loads_of(e):
                loaded[ld.buf] = n[0]
        if isinstance(st, (L.Let, L.Bind)):
            name = st.var.name if isinstance(st, L.Let) else st.name
            deps[name] = {v for x in L.free_syms(st.value) for v in deps.get(x, {x})}
        if isinstance(st, L.Store):
            stored.setdefault(st.buf, n[0])
            if not set(loops) <= {v for x in L.free_syms(st.index) for v in deps.get(x, {x})}:
                repeated.add(st.buf)
    return order


def _store_count(body: list) -> int:
    n = 0
    for s in body:
        if isinstance(s, L.Store):
            n += 1
        elif isinstance(s, (L.Loop, L.If)):
            n += _store_count(s.body)
    return n


def _updates_in_place(program: Program) -> None:
    """Mark the assigns whose value's kernel can write the parameter itself (see above)."""
    steps = program.steps
    writer = {id(b): (i, s) for i, s in enumerate(steps) if isinstance(s, KernelStep) for b in s.outputs}
    readers: dict[int, list[int]] = {}
    for i, s in enumerate(steps):
        for b in s.inputs:
            readers.setdefault(id(b), []).append(i)
    returned = {id(b) for b in program.returns}
    pairs: dict[int, list] = {}  # per kernel, computed once: a merged one serves many assigns
    for j, s in enumerate(steps):
        if not (isinstance(s, FallbackStep) and s.op.name == "assign"):
            continue
        target, value = s.inputs
        if target.kind != "param" or value.kind != "temp" or id(value) in returned or id(value) not in writer \
                or value.type != target.type:
            continue
        i, k = writer[id(value)]
        if any(n > i and n != j for n in readers.get(id(target), ())):
            continue  # another step reads the parameter after the kernel
        names = {id(b): p.name for p, b in zip(k.kernel.params, k.args)}
        if id(target) in names:
            if id(k) not in pairs:
                pairs[id(k)] = in_place_pairs(k, several=True)
            if (names[id(value)], names[id(target)]) not in pairs[id(k)]:
                continue
            k.kernel.aliases[names[id(value)]] = names[id(target)]
        value.alias = target
        program.done_in_place.add(id(s))


def plan_memory(program: Program) -> Program:
    _updates_in_place(program)
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

    def take_slot(b: Buffer) -> None:
        size = nbytes(b)
        for n in free:
            if slots[n] == size:
                free.remove(n)
                b.slot = n
                return
        b.slot = len(slots)
        slots.append(size)

    for i, s in enumerate(steps):
        if isinstance(s, KernelStep):
            pairs = {o: p for o, p in in_place_pairs(s)}
            names = {id(b): p.name for p, b in zip(s.kernel.params, s.args)}
            by_name = {p.name: b for p, b in zip(s.kernel.params, s.args)}
            for b in s.outputs:
                if b.kind != "temp" or b.slot is not None or b.alias is not None:
                    continue
                cand = pairs.get(names[id(b)])
                src = by_name.get(cand) if cand else None
                if src is not None and src.kind == "temp" and last.get(src) == i and src.slot is not None:
                    b.slot, b.alias = src.slot, src
                    s.kernel.aliases[names[id(b)]] = cand
                    continue
                take_slot(b)
        elif isinstance(s, MoveStep):
            # dynamic_update_slice: over its operand x when this is x's last use (the window alone
            # is written); the other moves read rows of x anywhere, so never over an input
            b, x = s.outputs[0], s.inputs[0]
            if b.kind != "temp":
                pass
            elif s.op.name == "dynamic_update_slice" and x.kind == "temp" and last.get(x) == i \
                    and x.slot is not None and x not in s.inputs[1:] and nbytes(x) == nbytes(b):
                b.slot, b.alias = x.slot, x
            else:
                take_slot(b)
        elif writes_into(s.op) and s.outputs[0].kind == "temp":
            # scatter_add: over its operand x when this is x's last use (it only adds to it)
            b, x = s.outputs[0], s.inputs[0]
            if x.kind == "temp" and last.get(x) == i and x.slot is not None and x not in s.inputs[1:] \
                    and nbytes(x) == nbytes(b):
                b.slot, b.alias = x.slot, x
            else:
                take_slot(b)
        for b in program.frees[i]:
            if b.slot is not None and not any(o.alias is b for o in s.outputs):
                free.append(b.slot)
    program.slots = slots
    return program

