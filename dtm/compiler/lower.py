"""The loop lowering: each fused group of a Schedule becomes a loop-IR Kernel (or a move step,
`program.MOVE_OPS`, or a fallback step), over buffers that hold the function's parameters, constants and stored values.

The heart is `KernelBuilder.ev(v, index)`: the scalar expression for element `index` of
value v. A value stored elsewhere is a Load; an elementwise op applies itself to its
operands at the broadcast index; a movement op maps the index (permute, broadcast, reshape,
slice, flip) or selects (pad, concat); a reduction computed by this kernel is its
accumulator; the matrix product of a matmul kernel is read back from the output buffer.
A batched product whose B is shared along its last batch dims and whose A rows continue
across them (a weight applied to a batch of sequences) is one product with those dims as
rows: B is packed once, and the epilogue recovers each row's batch index. A running sum
(cumsum) is a sequential loop along its axis that stores each sum so far (`build_scan`).
Results are memoised per (value, index) and each new temporary is declared in the outermost
loop whose variables it reads (loop-invariant code motion), so a value a pass reads per row
is computed once per row.

Every flat index a kernel loads is inside its buffer (element 0 when the buffer is empty:
the executor backs every buffer with at least one element): pad and concat read element 0
of an operand they do not select, never a clamped neighbour.
"""

from __future__ import annotations

import math

import numpy as np

from ..ir.dtypes import DTYPES
from ..ir.module import Op, Value
from ..ir.symbolic import Dim, SymDim, dim_add, dim_mul, dim_prod
from . import loopir as L
from .loopir import INDEX, Const, Sym, Var
from .program import Buffer, FallbackStep, KernelStep, MoveStep, Program, is_move, writes_into
from .schedule import Group, Schedule, bf16_operands, gemm_dtype, narrow_weight
from .views import contiguous_strides, reshape_groups, strided_view

class LoweringError(AssertionError):
    """A schedule the lowering cannot follow: a compiler bug."""


class _Scope:
    __slots__ = ("body", "memo", "names")

    def __init__(self, body: list):
        self.body = body
        self.memo: dict = {}
        self.names: set = set()


class KernelBuilder:
    def __init__(self, group: Group, sched: Schedule, producer: dict, buffers: dict, name: str):
        self.group = group
        self.sched = sched
        self.producer = producer
        self.buffers = buffers          # Value -> Buffer
        self.name = name
        self.params: list[L.Param] = []
        self.param_bufs: list[Buffer] = []
        self.outputs: list[Buffer] = []
        self.scopes: list[_Scope] = [_Scope([])]
        self.level: dict[str, int] = {}
        self.acc: dict[Value, tuple] = {}
        self.counter = 0
        self.own = set(group.stores)
        self.floor = 0                  # temporaries are never hoisted above this scope
        self.drawn: dict[Value, str] = {}  # a row kernel's draws, stored before its passes: value -> output

    # -- scopes and temporaries --
    def fresh(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def push(self, names: tuple = ()) -> _Scope:
        s = _Scope([])
        self.scopes.append(s)
        for n in names:
            self.bind_name(n)
        return s

    def bind_name(self, name: str) -> None:
        self.level[name] = len(self.scopes) - 1
        self.scopes[-1].names.add(name)

    def pop(self) -> list:
        s = self.scopes.pop()
        for n in s.names:
            self.level.pop(n, None)
        return s.body

    def emit(self, stmt) -> None:
        self.scopes[-1].body.append(stmt)

    def let(self, e: L.Expr, key=None, prefix: str = "t") -> L.Expr:
        """Declare e as a temporary in the outermost scope that binds all it reads."""
        if isinstance(e, (Const, Sym, Var)):
            if key is not None:
                self.scopes[-1].memo[key] = e
            return e
        lvl = max([self.floor] + [self.level.get(n, 0) for n in L.free_syms(e)])
        var = Var(self.fresh(prefix), e.dtype)
        scope = self.scopes[lvl]
        scope.body.append(L.Let(var, e))
        scope.names.add(var.name)
        self.level[var.name] = lvl
        if key is not None:
            scope.memo[key] = var
        return var

    def lookup(self, key):
        for s in reversed(self.scopes):
            if key in s.memo:
                return s.memo[key]
        return None

    # -- buffers --
    def param(self, v: Value, output: bool = False) -> str:
        buf = self.buffers[v]
        for p, b in zip(self.params, self.param_bufs):
            if b is buf and p.output == output:
                return p.name
        name = f"{'out' if output else 'in'}{len([p for p in self.params if p.output == output])}"
        self.params.append(L.Param(name, buf.type.dtype, output, buf.type.shape))
        self.param_bufs.append(buf)
        if output:
            self.outputs.append(buf)
        return name

    def load(self, v: Value, ix: tuple) -> L.Expr:
        name = self.param(v)
        return L.Load(name, L.flat_index(ix, v.type.shape), v.type.dtype)

    # -- the evaluator --
    def is_loaded(self, v: Value) -> bool:
        if v in self.own:
            return False
        op = self.producer.get(v)
        return op is None or v in self.sched.stored

    def ev(self, v: Value, ix: tuple) -> L.Expr:
        key = (v, ix)
        hit = self.lookup(key)
        if hit is not None:
            return hit
        if v in self.drawn:  # stored by this row's first loop (draw_first): read back
            return self.let(L.Load(self.drawn[v], L.flat_index(ix, v.type.shape), v.type.dtype), key)
        if v in self.acc:
            want, var = self.acc[v]
            if ix != want:
                raise LoweringError(f"{self.name}: reduction read at {list(map(str, ix))}, computed at "
                                    f"{list(map(str, want))}")
            return self.let(var, key) if isinstance(var, L.Load) else var
        if self.is_loaded(v):
            return self.let(self.load(v, ix), key)
        op = self.producer[v]
        name = op.name
        if name == "full":
            return Const(op.attrs["value"], v.type.dtype)
        if name == "iota":
            return self.let(L.Op("cast", (ix[op.attrs["dim"]],), v.type.dtype), key)
        if name == "random":  # uniform: Philox of the element's row-major index (spec 3.8, dtm.ref.philox)
            words = tuple(self.ev(op.operands[0], (Const(k, INDEX),)) for k in (0, 1))
            return self.let(L.Op("philox_uniform", words + (L.flat_index(ix, v.type.shape),), v.type.dtype), key)
        if name in ("reshape", "permute", "broadcast_to", "slice", "flip"):
            return self.ev(op.operands[0], self.move_index(op, ix))
        if name == "pad":
            return self.let(self.pad(op, ix), key)
        if name == "concat":
            return self.let(self.concat(op, ix), key)
        if name == "matmul":
            g = self.group
            if g.matmul is op and gemm_dtype(op):
                return self.let(L.Load(self.param(g.stores[0], output=True),
                                       L.flat_index(ix, v.type.shape), v.type.dtype), key)
            return self.naive_matmul(op, ix, key)
        if name in ("reduce_sum", "reduce_prod", "reduce_max", "reduce_min", "argmax", "argmin"):
            raise LoweringError(f"{self.name}: reduction {name} is neither stored nor a pass of this kernel")
        # elementwise
        args = tuple(self.ev(x, broadcast_index(ix, x.type.shape, v.type.shape)) for x in op.operands)
        attrs = (("to", op.attrs["to"]),) if name in ("cast", "bitcast") else ()
        return self.let(L.Op(name, args, v.type.dtype, attrs), key)

    def move_index(self, op: Op, ix: tuple) -> tuple:
        x = op.operands[0]
        src, dst, a = x.type.shape, op.results[0].type.shape, op.attrs
        if op.name == "permute":
            out = [None] * len(src)
            for i, p in enumerate(a["perm"]):
                out[p] = ix[i]
            return tuple(out)
        if op.name == "broadcast_to":
            return broadcast_index(ix, src, dst)
        if op.name == "slice":
            return tuple(zero_if_one(d, L.iadd(L.dim_expr(s), L.imul(i, st)))
                         for i, s, st, d in zip(ix, a["start"], a["step"], src))
        if op.name == "flip":
            return tuple(L.isub(L.isub(L.dim_expr(src[k]), 1), i) if k in a["axes"] else i
                         for k, i in enumerate(ix))
        return reshape_index(ix, src, dst)

    def pad(self, op: Op, ix: tuple) -> L.Expr:
        x, a = op.operands[0], op.attrs
        valid = Const(1, INDEX)
        inner = []
        for i, lo, hi, d in zip(ix, a["low"], a["high"], x.type.shape):
            if lo == 0 and hi == 0:
                inner.append(i)
                continue
            j = self.let(L.isub(i, lo), prefix="c")  # read three times (as in concat)
            valid = L.iand(valid, L.iand(L.icmp(">=", j, 0), L.icmp("<", j, L.dim_expr(d))))
            inner.append(j)
        safe = tuple(zero_if_one(d, select_index(valid, j)) for j, d in zip(inner, x.type.shape))
        val = self.ev(x, safe)
        return L.Op("where", (valid, val, Const(a["value"], x.type.dtype)), x.type.dtype)

    def concat(self, op: Op, ix: tuple) -> L.Expr:
        axis = op.attrs["axis"]
        t = op.results[0].type
        # the index along the axis is read three times per operand: bound once, so that
        # concats nested along other axes grow the code linearly, not threefold a level
        ix = tuple(self.let(i, prefix="c") if k == axis else i for k, i in enumerate(ix))
        parts = []
        offset: Dim = 0
        for x in op.operands:
            n = x.type.shape[axis]
            if n == 0:
                continue
            start, stop = L.dim_expr(offset), L.dim_expr(dim_add(offset, n))
            sel = L.iand(L.icmp(">=", ix[axis], start), L.icmp("<", ix[axis], stop))
            local = tuple(select_index(sel, L.isub(i, start) if k == axis else i) for k, i in enumerate(ix))
            local = tuple(zero_if_one(d, i) for i, d in zip(local, x.type.shape))
            parts.append((sel, self.ev(x, local)))
            offset = dim_add(offset, n)
        if not parts:
            return Const(0, t.dtype)
        out = parts[-1][1]
        for sel, val in reversed(parts[:-1]):  # each select bound: a concat of many stays shallow
            out = self.let(L.Op("where", (sel, val, out), t.dtype), prefix="c")
        return out

    def naive_matmul(self, op: Op, ix: tuple, key) -> L.Expr:
        """Element ix of a matrix product as a loop over the contracted dim (integers, or
        an f32/f64 product inlined into its consumer)."""
        a, b = op.operands
        t = op.results[0].type
        acc = Var(self.fresh("acc"), t.dtype)
        self.emit(L.Let(acc, Const(0, t.dtype)))
        self.bind_name(acc.name)
        k = self.fresh("k")
        self.push((k,))
        batch = ix[:-2]
        ia = broadcast_index(batch, a.type.shape[:-2], t.shape[:-2]) + (ix[-2], Sym(k))
        ib = broadcast_index(batch, b.type.shape[:-2], t.shape[:-2]) + (Sym(k), ix[-1])
        ia = tuple(zero_if_one(d, i) for i, d in zip(ia, a.type.shape))
        ib = tuple(zero_if_one(d, i) for i, d in zip(ib, b.type.shape))
        prod = L.Op("mul", (self.ev(a, ia), self.ev(b, ib)), t.dtype)
        self.emit(L.Assign(acc, L.Op("add", (acc, prod), t.dtype)))
        body = self.pop()
        self.emit(L.Loop(k, Const(0, INDEX), L.dim_expr(a.type.shape[-1]), body))
        self.scopes[-1].memo[key] = acc
        return acc

    # -- reductions --
    def reduce_pass(self, op: Op, full_ix: tuple, row_ix: tuple, axes_loops: list) -> None:
        x, r = op.operands[0], op.results[0]
        dt = x.type.dtype
        if op.name in ("argmax", "argmin"):
            self.acc[r] = (row_ix, self.arg_passes(op, full_ix, axes_loops))
            return
        acc = self.accumulator(op.name, dt)
        if op.name == "reduce_sum" and dt.is_float and axes_loops:
            self.sum_level(acc, x, full_ix, self.sum_levels(axes_loops))
        else:
            self.combine_pass(_COMBINE[op.name], acc, x, full_ix, axes_loops)
        self.acc[r] = (row_ix, acc)

    def accumulator(self, name: str, dt) -> Var:
        acc = Var(self.fresh("acc"), dt)
        self.emit(L.Let(acc, Const(_init(name, dt), dt)))
        self.bind_name(acc.name)
        return acc

    def combine_pass(self, fn: str, acc: Var, x: Value, full_ix: tuple, axes_loops: list) -> None:
        """acc combined by fn (add, mul, max or min) with x over the loops: one vectorised
        loop nest. A float max or min is NaN when any element is."""
        dt = x.type.dtype
        depth = len(axes_loops)
        for var, _ in axes_loops:
            self.push((var,))
        val = self.ev(x, full_ix)
        reduction = None
        if fn in ("add", "mul") or not dt.is_float:
            self.emit(L.Assign(acc, L.Op(fn, (acc, val), dt)))
        if fn in ("add", "mul") and dt.is_float:
            reduction = (("+" if fn == "add" else "*", acc.name),)
        elif dt.is_float:
            # vectorised like a sum; lanes combine without NaN's rule, so a flag carries it: an
            # integer as wide as the float (a byte flag beside float lanes kept the loop scalar,
            # 2.3x slower), and the values compared plainly (the flag has any NaN)
            flag = _NAN_FLAG.get(dt.name, _NAN_FLAG["f32"])
            nan = Var(self.fresh("nan"), flag)
            self.scopes[-1 - depth].body.append(L.Let(nan, Const(0, flag)))
            is_nan = L.Op("cast", (L.Op("ne", (val, val), _BOOL),), flag, (("to", flag),))
            self.emit(L.Assign(nan, L.Op("max", (nan, is_nan), flag)))
            keep = L.Op("gt" if fn == "max" else "lt", (acc, val), _BOOL)
            self.emit(L.Assign(acc, L.Op("where", (keep, acc, val), dt)))
            reduction = ((fn, acc.name), ("max", nan.name))
        self.close_loops(axes_loops, reduction)
        if dt.is_float and fn in ("max", "min"):
            any_nan = L.Op("ne", (nan, Const(0, nan.dtype)), _BOOL)
            self.emit(L.Assign(acc, L.Op("where", (any_nan, Const(math.nan, dt), acc), dt)))

    def close_loops(self, axes_loops: list, reduction: tuple | None) -> None:
        """The loops opened for axes_loops, innermost first, it marked with `reduction`."""
        for var, extent in reversed(axes_loops):
            self.emit(L.Loop(var, Const(0, INDEX), extent, self.pop(), reduction=reduction))
            reduction = None

    def arg_passes(self, op: Op, full_ix: tuple, axes_loops: list) -> Var:
        """argmax / argmin as two loops that vectorise: the extreme value (as reduce_max or
        reduce_min: NaN when any element is), then the first position holding it, the least
        index whose element equals it (or is NaN, when it is NaN). One loop keeping the best
        so far, a branch per element, took 250 us on a GPT-2 logits row (50257), 1% of a
        decoding step."""
        x, r = op.operands[0], op.results[0]
        dt, it = x.type.dtype, r.type.dtype
        best = self.accumulator("reduce_max" if op.name == "argmax" else "reduce_min", dt)
        self.combine_pass("max" if op.name == "argmax" else "min", best, x, full_ix, axes_loops)
        none = int(np.iinfo(np.dtype(_NP_INT[it.name])).max)  # no element is left only by an empty axis
        first = Var(self.fresh("arg"), it)
        self.emit(L.Let(first, Const(none, it)))
        self.bind_name(first.name)
        for var, _ in axes_loops:
            self.push((var,))
        val = self.ev(x, full_ix)
        hit = L.Op("eq", (val, best), _BOOL)
        if dt.is_float:
            both_nan = L.Op("logical_and", (L.Op("ne", (best, best), _BOOL), L.Op("ne", (val, val), _BOOL)), _BOOL)
            hit = L.Op("logical_or", (hit, both_nan), _BOOL)
        pos = L.Op("cast", (full_ix[op.attrs["axis"]],), it)
        self.emit(L.Assign(first, L.Op("min", (first, L.Op("where", (hit, pos, Const(none, it)), it)), it)))
        self.close_loops(axes_loops, (("min", first.name),))
        self.emit(L.Assign(first, L.Op("where", (L.Op("eq", (first, Const(none, it)), _BOOL), Const(0, it), first), it)))
        return first

    def sum_levels(self, loops: list) -> list[tuple[str, L.Expr, L.Expr, bool]]:
        """The loops of a blocked float sum (spec 2.8), as (variable, start, stop, own),
        outermost first: each summed loop of `loops` that may be longer than SUM_BLOCK
        becomes a loop over blocks of SUM_BLOCK elements inside it, and, when there may be
        more than SUM_BLOCK blocks, a loop over groups of SUM_BLOCK blocks. A loop inside
        another keeps a running sum of its own (`own`, fresh for each iteration of the loop
        outside) unless the two together add at most SUM_BLOCK terms into the outer one's
        (a short inner loop pays no extra add). So no running sum takes more than
        SUM_BLOCK terms (but the outermost's of a sum over more than SUM_BLOCK^3 elements),
        and the error grows like SUM_BLOCK + n / SUM_BLOCK^2 instead of n: 10^9 ones sum
        to 10^9, not 2^24 per vector lane. It costs one add per block, none per element."""
        levels: list[list] = []  # [variable, start, stop, the most iterations (None: unbounded)]
        size = Const(SUM_BLOCK, INDEX)
        for var, extent in loops:
            if isinstance(extent, Const) and extent.value <= SUM_BLOCK:
                levels.append([var, Const(0, INDEX), extent, extent.value])
                continue
            count = L.idiv(L.iadd(extent, Const(SUM_BLOCK - 1, INDEX)), size)  # blocks
            blk = self.fresh("blk")
            if isinstance(count, Const) and count.value <= SUM_BLOCK:
                levels.append([blk, Const(0, INDEX), count, count.value])
            else:
                group = self.fresh("grp")
                first = L.imul(Sym(group), size)
                groups = L.idiv(L.iadd(count, Const(SUM_BLOCK - 1, INDEX)), size)
                levels += [[group, Const(0, INDEX), groups, groups.value if isinstance(groups, Const) else None],
                           [blk, first, L.imin(L.iadd(first, size), count), SUM_BLOCK]]
            first = L.imul(Sym(blk), size)
            levels.append([var, first, L.imin(L.iadd(first, size), extent), SUM_BLOCK])
        own = [False] * len(levels)
        terms = 1  # what one iteration of the level below adds into the running sum it feeds
        for k in range(len(levels) - 1, 0, -1):
            outer, inner = levels[k - 1][3], levels[k][3]
            if outer is not None and inner is not None and outer * inner * terms <= SUM_BLOCK:
                terms *= inner  # level k adds straight into its parent's running sum
            else:
                own[k], terms = True, 1
        return [(var, start, stop, o) for (var, start, stop, _), o in zip(levels, own)]

    def sum_level(self, target: Var, x: Value, full_ix: tuple, levels: list) -> None:
        """x summed over `levels` (sum_levels) into `target`: the innermost loop adds
        elements (vectorised, so its lanes are further partial sums), each loop outside it
        the sums of the loop inside (or, where that one has no sum of its own, its terms)."""
        (var, start, stop, _), inner = levels[0], levels[1:]
        dt = target.dtype
        self.push((var,))
        reduction = None
        if inner and inner[0][3]:
            part = Var(self.fresh("sum"), dt)
            self.emit(L.Let(part, Const(0, dt)))
            self.bind_name(part.name)
            self.sum_level(part, x, full_ix, inner)
            self.emit(L.Assign(target, L.Op("add", (target, part), dt)))
        elif inner:
            self.sum_level(target, x, full_ix, inner)
        else:
            self.emit(L.Assign(target, L.Op("add", (target, self.ev(x, full_ix)), dt)))
            reduction = (("+", target.name),)
        self.emit(L.Loop(var, start, stop, self.pop(), reduction=reduction))

    # -- kernels --
    def build(self) -> L.Kernel:
        g = self.group
        if g.kind == "matmul" and gemm_dtype(g.matmul):
            body = self.build_gemm()
        elif g.kind == "convert":
            body = self.build_convert()
        elif g.kind == "scan":
            body = self.build_scan()
        else:
            body = self.build_loops()
        dims = sorted(_free_dims(body) - {p.name for p in self.params})
        return L.Kernel(self.name, self.params, dims, body)

    def build_loops(self) -> list:
        g = self.group
        F, R = g.domain, g.axes
        rank = len(F)
        if _down_columns(g):
            return self.build_columns()
        full_ix = tuple(Const(0, INDEX) if d == 1 else Sym(f"i{k}") for k, d in enumerate(F))
        loops = [(f"i{k}", L.dim_expr(F[k])) for k in range(rank) if F[k] != 1]
        if g.passes:  # a row kernel (R may be empty: a reduction over no axes)
            outer = [k for k in range(rank) if k not in R and F[k] != 1]
            inner = [(f"i{k}", L.dim_expr(F[k])) for k in R if F[k] != 1]
        else:
            outer = [k for k in range(rank - 1) if F[k] != 1]
            inner = [lp for lp in loops if lp[0] == f"i{rank - 1}"]
        # the loops' work in element-ops: a small domain still runs on every thread when many
        # ops share it (an optimizer's update of a dozen same-shape weights, fused into one kernel)
        work = L.imul(L.dim_expr(dim_prod(F)), max(1, len(g.ops)))
        full_stores = [v for v in g.stores if v.type.shape == F]
        outs = {v: self.param(v, output=True) for v in g.stores}
        # the outer loops, flattened into one (parallel) loop
        o_var = None
        if outer:
            o_var = "o" if len(outer) > 1 else f"i{outer[0]}"
            self.push((o_var,))
            if len(outer) > 1:
                stride: L.Expr = Const(1, INDEX)
                binds = []
                for pos, k in enumerate(reversed(outer)):
                    e = L.idiv(Sym(o_var), stride)
                    if pos != len(outer) - 1:
                        e = L.imod(e, L.dim_expr(F[k]))
                    binds.append(L.Bind(f"i{k}", e))
                    stride = L.imul(stride, L.dim_expr(F[k]))
                for b in reversed(binds):
                    self.emit(b)
                    self.bind_name(b.name)
        if g.passes:
            full_stores = self.draw_first(full_stores, full_ix, inner, outs)
        self.row_passes(full_ix, inner)
        if full_stores:
            for var, _ in inner:
                self.push((var,))
            for v in full_stores:
                self.emit(L.Store(outs[v], L.flat_index(full_ix, F), self.ev(v, full_ix)))
            for i, (var, extent) in enumerate(reversed(inner)):
                body = self.pop()
                par = work if (o_var is None and i == len(inner) - 1 and not g.passes) else None
                # an elementwise loop's iterations are independent even where an output shares
                # memory with an input (plan_memory allows that only when the input is read at
                # the index the output is written at): vectorised without alias checks (an
                # optimizer's in-place update of a dozen weights had too many pairs to check)
                self.emit(L.Loop(var, Const(0, INDEX), extent, body, parallel=par, simd=i == 0 and not g.passes))
        if o_var is not None:
            body = self.pop()
            extent = L.dim_expr(dim_prod([F[k] for k in outer]))
            self.emit(L.Loop(o_var, Const(0, INDEX), extent, body, parallel=work))
        return self.pop_root()

    def draw_first(self, full_stores: list, full_ix: tuple, inner: list, outs: dict) -> list:
        """A row kernel's stores of the row's shape that draw (a `random`, Philox: a dropout's
        mask) and read none of its reductions: stored by a first loop over the row, which
        vectorises, then read back from memory still in cache by the passes and the stores
        (inlined, each pass drew again: a layer norm after a dropout drew three times, its
        last loop not vectorised, 0.69 ms for 131,072 elements against 0.18 now). The stores
        left for the last loop are returned."""
        first = [v for v in full_stores if self._draws_before_passes(v)]
        if not first or not inner:
            return full_stores
        for var, _ in inner:
            self.push((var,))
        for v in first:
            self.emit(L.Store(outs[v], L.flat_index(full_ix, self.group.domain), self.ev(v, full_ix)))
        for i, (var, extent) in enumerate(reversed(inner)):
            self.emit(L.Loop(var, Const(0, INDEX), extent, self.pop(), simd=i == 0))
        for v in first:
            self.drawn[v] = outs[v]
        return [v for v in full_stores if v not in self.drawn]

    def _draws_before_passes(self, v: Value) -> bool:
        """Whether v's inlined expression draws and reads none of the group's reductions."""
        passes, draws = set(self.group.passes), False
        stack, seen = [v], set()
        while stack:
            u = stack.pop()
            if u in seen or (u is not v and self.is_loaded(u)):
                continue
            seen.add(u)
            op = self.producer.get(u)
            if op is None:
                continue
            if op in passes or op.name in ("reduce_sum", "reduce_prod", "reduce_max", "reduce_min",
                                           "argmax", "argmin", "matmul"):
                return False
            draws = draws or op.name == "random"
            stack.extend(op.operands)
        return draws

    def row_passes(self, full_ix: tuple, inner: list) -> None:
        """A row kernel's reductions at full index full_ix, each a pass over the row's `inner`
        loops, then its stores of the row's shape (build_loops, and a product's row_epilogue)."""
        g = self.group
        F, R = g.domain, g.axes
        for p in g.passes:
            self.reduce_pass(p, full_ix, _row_index(full_ix, R, p.attrs.get("keepdims", False)), inner)
        keep_shape, _ = _row_shapes(F, R)
        for v in g.stores:
            if v.type.shape != F:
                rix = _row_index(full_ix, R, v.type.shape == keep_shape)
                self.emit(L.Store(self.param(v, output=True), L.flat_index(rix, v.type.shape), self.ev(v, rix)))

    def build_columns(self) -> list:
        """A row kernel whose reductions run down columns (over outer dims, the last dim
        kept: a bias's or a layer norm weight's gradient): for each block of COLUMN_BLOCK
        columns (and each index of the other kept dims, all one parallel loop), one local
        array of accumulators per reduction; the rows loop outside, the block's columns
        inside, contiguous and vectorised, so a value of a row alone is computed once per
        row. Then the stores, the same way."""
        g = self.group
        F, R = g.domain, g.axes
        last = len(F) - 1
        full_ix = tuple(Const(0, INDEX) if d == 1 else Sym(f"i{k}") for k, d in enumerate(F))
        rows = [(f"i{k}", L.dim_expr(F[k])) for k in R if F[k] != 1]
        outer = [k for k in range(last) if k not in R and F[k] != 1]
        col = f"i{last}"
        width = L.dim_expr(F[last])
        block = min(COLUMN_BLOCK, F[last]) if isinstance(F[last], int) else COLUMN_BLOCK
        blocks = L.idiv(L.iadd(width, Const(block - 1, INDEX)), Const(block, INDEX))
        outs = {v: self.param(v, output=True) for v in g.stores}
        self.push(("ob",))
        binds = [L.Bind("jb", L.imul(L.imod(Sym("ob"), blocks), Const(block, INDEX)))]
        stride = blocks
        for pos, k in enumerate(reversed(outer)):
            e = L.idiv(Sym("ob"), stride)
            if pos != len(outer) - 1:
                e = L.imod(e, L.dim_expr(F[k]))
            binds.append(L.Bind(f"i{k}", e))
            stride = L.imul(stride, L.dim_expr(F[k]))
        for b in binds:
            self.emit(b)
            self.bind_name(b.name)
        cols = (Sym("jb"), L.imin(L.iadd(Sym("jb"), Const(block, INDEX)), width))
        lane = L.isub(Sym(col), Sym("jb"))
        sweep: list[Op] = []
        for p in g.passes:  # reductions that do not read each other share one sweep over the rows
            if sweep and self.reads_any(p.operands[0], {q.results[0] for q in sweep}):
                self.column_sweep(sweep, full_ix, rows, block, cols, lane)
                sweep = []
            sweep.append(p)
        self.column_sweep(sweep, full_ix, rows, block, cols, lane)
        keep_shape, _ = _row_shapes(F, R)
        row_stores = [v for v in g.stores if v.type.shape != F]
        full_stores = [v for v in g.stores if v.type.shape == F]
        if row_stores:
            self.push((col,))
            for v in row_stores:
                rix = _row_index(full_ix, R, v.type.shape == keep_shape)
                self.emit(L.Store(outs[v], L.flat_index(rix, v.type.shape), self.ev(v, rix)))
            self.emit(L.Loop(col, *cols, self.pop(), simd=True))
        if full_stores:
            for var, _ in rows:
                self.push((var,))
            self.push((col,))
            for v in full_stores:
                self.emit(L.Store(outs[v], L.flat_index(full_ix, F), self.ev(v, full_ix)))
            self.emit(L.Loop(col, *cols, self.pop(), simd=True))
            for var, extent in reversed(rows):
                self.emit(L.Loop(var, Const(0, INDEX), extent, self.pop()))
        extent = L.imul(blocks, L.dim_expr(dim_prod([F[k] for k in outer])))
        self.emit(L.Loop("ob", Const(0, INDEX), extent, self.pop(), parallel=L.dim_expr(dim_prod(F))))
        return self.pop_root()

    def column_sweep(self, ops: list[Op], full_ix: tuple, rows: list, block: int, cols: tuple,
                     lane: L.Expr) -> None:
        """Reductions down the columns of a block, each into a local array, in one sweep over
        the rows (see build_columns)."""
        col = f"i{len(full_ix) - 1}"
        accs = []
        for op in ops:
            dt = op.operands[0].type.dtype
            acc = self.fresh("acc")
            accs.append((acc, dt))
            self.emit(L.Array(acc, dt, block))
            self.push((col,))
            self.emit(L.Store(acc, lane, Const(_init(op.name, dt), dt)))
            self.emit(L.Loop(col, *cols, self.pop(), simd=True))
        if any(op.name == "reduce_sum" and dt.is_float for op, (_, dt) in zip(ops, accs)):
            levels = self.sum_levels(rows)
        else:
            levels = [(var, Const(0, INDEX), extent, False) for var, extent in rows]
        self.column_rows(ops, accs, full_ix, levels, block, cols, lane)
        for op, (acc, dt) in zip(ops, accs):
            rix = _row_index(full_ix, self.group.axes, op.attrs.get("keepdims", False))
            self.acc[op.results[0]] = (rix, L.Load(acc, lane, dt))

    def column_rows(self, ops: list[Op], accs: list, full_ix: tuple, levels: list, block: int, cols: tuple,
                    lane: L.Expr) -> None:
        """The loops over rows of a column sweep, accumulating into the arrays `accs` (one
        per op). With float sums, `levels` are sum_levels and each loop inside another sums
        them into arrays of its own, added into its parent's after it, as in sum_level;
        the other reductions go straight into theirs."""
        (var, start, stop, _), inner = levels[0], levels[1:]
        col = f"i{len(full_ix) - 1}"
        self.push((var,))
        summed = [k for k, op in enumerate(ops) if op.name == "reduce_sum" and accs[k][1].is_float]
        if inner and inner[0][3] and summed:
            mine = list(accs)
            self.push((col,))
            for k in summed:
                dt = accs[k][1]
                mine[k] = (self.fresh("sum"), dt)
                self.scopes[-2].body.append(L.Array(mine[k][0], dt, block))
                self.emit(L.Store(mine[k][0], lane, Const(0, dt)))
            self.emit(L.Loop(col, *cols, self.pop(), simd=True))
            self.column_rows(ops, mine, full_ix, inner, block, cols, lane)
            self.push((col,))
            for k in summed:
                (acc, dt), (part, _) = accs[k], mine[k]
                self.emit(L.Store(acc, lane, L.Op("add", (L.Load(acc, lane, dt), L.Load(part, lane, dt)), dt)))
            self.emit(L.Loop(col, *cols, self.pop(), simd=True))
        elif inner:
            self.column_rows(ops, accs, full_ix, inner, block, cols, lane)
        else:
            self.push((col,))
            for op, (acc, dt) in zip(ops, accs):
                fn = _COMBINE[op.name]
                self.emit(L.Store(acc, lane, L.Op(fn, (L.Load(acc, lane, dt), self.ev(op.operands[0], full_ix)), dt)))
            self.emit(L.Loop(col, *cols, self.pop(), simd=True))
        self.emit(L.Loop(var, start, stop, self.pop()))

    def build_scan(self) -> list:
        """A running sum along axis a of the domain F: for each index of the other dims (one
        parallel loop), a sequential loop along a adds each element into an accumulator (f64
        for floats, as the spec's cumsum says) and stores the sum so far, rounded to the
        result's dtype: the same code for any length of the axis. When a is not the last
        dim, the last one is cut into blocks of COLUMN_BLOCK columns, each block with an
        array of accumulators and its column loop, contiguous and vectorised, inside the
        step along a (as build_columns sums down columns)."""
        g = self.group
        F, (axis,) = g.domain, g.axes
        y = g.stores[0]
        last = len(F) - 1
        columns = axis != last and F[last] not in (0, 1)  # (with no columns, no loop runs)
        full_ix = tuple(Sym(f"i{k}") if k == axis or F[k] != 1 else Const(0, INDEX) for k in range(len(F)))
        outer = [k for k in range(len(F)) if k != axis and F[k] != 1 and not (columns and k == last)]
        extent = L.dim_expr(dim_prod([F[k] for k in outer]))
        flat: L.Expr = Sym("o")
        self.push(("o",))
        if columns:
            block = min(COLUMN_BLOCK, F[last]) if isinstance(F[last], int) else COLUMN_BLOCK
            width = L.dim_expr(F[last])
            blocks = L.idiv(L.iadd(width, Const(block - 1, INDEX)), Const(block, INDEX))
            self.emit(L.Bind("jb", L.imul(L.imod(flat, blocks), Const(block, INDEX))))
            self.bind_name("jb")
            flat, extent = L.idiv(flat, blocks), L.imul(extent, blocks)
        for b in _batch_binds(tuple(f"i{k}" for k in outer), tuple(F[k] for k in outer), flat):
            self.emit(b)
            self.bind_name(b.name)
        if columns:
            self.scan_columns(y, full_ix, block, (Sym("jb"), L.imin(L.iadd(Sym("jb"), block), width)))
        else:
            self.scan_line(y, full_ix)
        par = None if extent == Const(1, INDEX) else L.dim_expr(dim_prod(F))
        self.emit(L.Loop("o", Const(0, INDEX), extent, self.pop(), parallel=par))
        return self.pop_root()

    def scan_add(self, y: Value, acc: L.Expr, full_ix: tuple) -> L.Expr:
        """The running sum of cumsum y at full_ix: acc, the sum before it, plus the operand."""
        dt = _scan_acc(y)
        x = self.producer[y].operands[0]
        return L.Op("add", (acc, _converted(self.ev(x, full_ix), dt)), dt)

    def scan_line(self, y: Value, full_ix: tuple) -> None:
        """build_scan along the axis at one index of the other dims: one running sum."""
        F, (axis,) = self.group.domain, self.group.axes
        acc = self.accumulator("reduce_sum", _scan_acc(y))
        self.push((f"i{axis}",))
        self.emit(L.Assign(acc, self.scan_add(y, acc, full_ix)))
        self.emit(L.Store(self.param(y, output=True), L.flat_index(full_ix, F), _converted(acc, y.type.dtype)))
        self.emit(L.Loop(f"i{axis}", Const(0, INDEX), L.dim_expr(F[axis]), self.pop()))

    def scan_columns(self, y: Value, full_ix: tuple, block: int, cols: tuple) -> None:
        """build_scan down the columns `cols` of the last dim: an array of accumulators,
        zeroed, then the sequential loop along the axis around the vectorised column loop."""
        F, (axis,) = self.group.domain, self.group.axes
        col = f"i{len(F) - 1}"
        lane = L.isub(Sym(col), Sym("jb"))
        dt = _scan_acc(y)
        acc = self.fresh("acc")
        self.emit(L.Array(acc, dt, block))
        self.push((col,))
        self.emit(L.Store(acc, lane, Const(0, dt)))
        self.emit(L.Loop(col, *cols, self.pop(), simd=True))
        self.push((f"i{axis}",))
        self.push((col,))
        total = Var(self.fresh("sum"), dt)  # declared here: a temporary reading acc is never hoisted
        self.emit(L.Let(total, self.scan_add(y, L.Load(acc, lane, dt), full_ix)))
        self.emit(L.Store(acc, lane, total))
        self.emit(L.Store(self.param(y, output=True), L.flat_index(full_ix, F), _converted(total, y.type.dtype)))
        self.emit(L.Loop(col, *cols, self.pop(), simd=True))
        self.emit(L.Loop(f"i{axis}", Const(0, INDEX), L.dim_expr(F[axis]), self.pop()))

    def reads_any(self, v: Value, values: set) -> bool:
        """Whether computing v here reads any of `values` (through what it computes inline)."""
        stack, seen = [v], set()
        while stack:
            u = stack.pop()
            if u in values:
                return True
            if u in seen or self.is_loaded(u) or u not in self.producer:
                continue
            seen.add(u)
            stack.extend(self.producer[u].operands)
        return False

    def pop_root(self) -> list:
        assert len(self.scopes) == 1
        return self.scopes[0].body

    def build_convert(self) -> list:
        """A cast between f32 and a block type: one call quantizing or dequantizing the
        operand's blocks (both buffers contiguous, K a multiple of 32)."""
        op = self.group.op
        x, y = op.operands[0], op.results[0]
        src = self.param(x)
        dst = self.param(y, output=True)
        quantize = y.type.dtype.is_quant
        blocks = L.idiv(L.dim_expr(dim_prod(x.type.shape)), 32)
        self.emit(L.Quant(quantize, (y if quantize else x).type.dtype, blocks, src, dst))
        return self.pop_root()

    def build_gemm(self) -> list:
        g = self.group
        mm = g.matmul
        t = mm.results[0].type
        sink = g.stores[0]
        out = self.param(sink, output=True)
        views = []
        casts = bf16_operands(mm, self.producer)  # both operands widened bf16 values: the bf16 product reads them
        for x in mm.operands:
            view = strided_view(x, self.producer, (lambda u: self.is_loaded(u)) if casts is None
                                else (lambda u: self.producer.get(u) in casts))
            if view is None:
                raise LoweringError(f"{self.name}: matmul operand is not a strided view of a stored value")
            views.append(view)
        nb = t.rank - 2
        kept = nb - _rows_of_batch(mm, views)  # the batch dims after `kept` are rows of one product
        bvars = tuple(f"b{k}" for k in range(nb))
        operands = []
        b_dtype = None
        # Only the schedule's absorbed cast is read narrow: B's cast of a narrow weight that no
        # kernel stored. Any other cast under an operand (A's, a stored one, f16 -> f32) was
        # computed by its own kernel and is read as the product's dtype.
        narrow = narrow_weight(mm, self.producer)
        for x, (base, off, st) in zip(mm.operands, views):
            cast = self.producer.get(base)
            if cast is not None and cast is narrow and x is mm.operands[1] and base not in self.sched.stored:
                base = cast.operands[0]
                b_dtype = base.type.dtype
            elif casts is not None:
                base = cast.operands[0]
            name = self.param(base)
            xb = x.type.rank - 2
            offset = L.dim_expr(off)
            for k in range(kept):
                j = k - (nb - xb)
                if j >= 0 and x.type.shape[j] != 1:
                    offset = L.iadd(offset, L.imul(Sym(bvars[k]), L.dim_expr(st[j])))
            operands.append(L.Strided(name, offset, L.dim_expr(st[-2]), L.dim_expr(st[-1])))
        cst = contiguous_strides(t.shape)
        c_off: L.Expr = Const(0, INDEX)
        for k in range(kept):
            c_off = L.iadd(c_off, L.imul(Sym(bvars[k]), L.dim_expr(cst[k])))
        c = L.Strided(out, c_off, L.dim_expr(t.shape[-1]), Const(1, INDEX))
        epilogue = None
        if sink is not mm.results[0]:
            # the epilogue: loops over a block [i0_, i1_) x [j0_, j1_) of batch entry bt; a row i
            # of a product whose rows span batch dims is bound back to those dims and its own row
            self.push(("bt", "i0_", "i1_", "j0_", "j1_"))
            self.floor = len(self.scopes) - 1
            for b in _batch_binds(bvars[:kept], t.shape[:kept], Sym("bt")):
                self.emit(b)
                self.bind_name(b.name)
            row = "i" if kept == nb else "r"
            ix = tuple(Sym(v) for v in bvars) + (Sym(row), Sym("j"))
            ix = tuple(Const(0, INDEX) if d == 1 else i for i, d in zip(ix, t.shape))
            self.push(("i",))
            if kept < nb:
                for b in _batch_binds(bvars[kept:] + ("r",), t.shape[kept:], Sym("i")):
                    self.emit(b)
                    self.bind_name(b.name)
            if g.passes:
                self.row_epilogue(ix)
            else:
                self.push(("j",))
                self.emit(L.Store(out, L.flat_index(ix, t.shape), self.ev(sink, ix)))
                jbody = self.pop()
                self.emit(L.Loop("j", Sym("j0_"), Sym("j1_"), jbody))
            ibody = self.pop()
            self.emit(L.Loop("i", Sym("i0_"), Sym("i1_"), ibody))
            epilogue = self.pop()
            self.floor = 0
        gemm = L.Gemm(t.dtype, tuple(L.dim_expr(d) for d in t.shape[:kept]), bvars[:kept],
                      L.dim_expr(dim_prod(t.shape[kept:-1])), L.dim_expr(t.shape[-1]),
                      L.dim_expr(mm.operands[0].type.shape[-1]), operands[0], operands[1], c, epilogue,
                      b_dtype=b_dtype, ab_dtype=None if casts is None else casts[0].operands[0].type.dtype)
        self.emit(gemm)
        return self.pop_root()

    def row_epilogue(self, ix: tuple) -> None:
        """Row i of a product reduced along its columns (softmax over attention scores), as
        a row kernel computes a row (row_passes, then the full-shape stores). The runtime gives
        this epilogue whole rows (schedule.row_epilogue), so its passes run over all N
        columns; the row is read from the product's buffer and written back in place (each
        value at the index it is read from)."""
        F = self.group.domain
        self.row_passes(ix, [("j", L.dim_expr(F[-1]))])
        self.push(("j",))
        for v in self.group.stores:
            if v.type.shape == F:
                self.emit(L.Store(self.param(v, output=True), L.flat_index(ix, F), self.ev(v, ix)))
        self.emit(L.Loop("j", Const(0, INDEX), L.dim_expr(F[-1]), self.pop()))


def _rows_of_batch(mm: Op, views: list) -> int:
    """How many of the product's last batch dims can be rows of one product instead: those
    that A steps through row after row (its rows continue across them) and B does not vary
    along (a weight shared by a batch of sequences: B is then packed once, not per entry)."""
    t = mm.results[0].type
    (_, _, sa), (_, _, sb) = views
    a, b = mm.operands
    nb, rows, n = t.rank - 2, t.shape[-2], 0
    while n < nb:
        k = nb - 1 - n
        ja, jb = k - (nb - (a.type.rank - 2)), k - (nb - (b.type.rank - 2))
        a_steps = ja >= 0 and a.type.shape[ja] == t.shape[k] and sa[ja] == dim_mul(rows, sa[-2])
        b_shared = jb < 0 or b.type.shape[jb] == 1 or sb[jb] == 0
        if not (a_steps and b_shared):
            break
        rows, n = dim_mul(rows, t.shape[k]), n + 1
    return n


_BOOL = DTYPES["bool"]
_NAN_FLAG = {"f32": DTYPES["i32"], "f64": DTYPES["i64"]}  # a float max/min's NaN flag, by float type


def _scan_acc(y: Value):
    """The dtype cumsum y accumulates in: f64 for floats (spec), else its own (integers wrap)."""
    return DTYPES["f64"] if y.type.dtype.is_float else y.type.dtype


def _converted(e: L.Expr, dt) -> L.Expr:
    """e as dtype dt (a cast when it is another)."""
    return e if e.dtype == dt else L.Op("cast", (e,), dt, (("to", dt),))


def _init(name: str, dt):
    if name in ("reduce_sum",):
        return 0
    if name == "reduce_prod":
        return 1
    big = name in ("reduce_max", "argmax")
    if dt.is_float:
        return -math.inf if big else math.inf
    if dt.name == "bool":
        return 0 if big else 1
    info = np.iinfo(np.dtype(_NP_INT[dt.name]))
    return int(info.min) if big else int(info.max)


_NP_INT = {"i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64",
           "u8": "uint8", "u16": "uint16", "u32": "uint32", "u64": "uint64"}


def _row_shapes(F, R):
    return tuple(1 if i in R else d for i, d in enumerate(F)), tuple(d for i, d in enumerate(F) if i not in R)


COLUMN_BLOCK = 64  # columns a reduction down columns keeps accumulators for, see build_columns
_COMBINE = {"reduce_sum": "add", "reduce_prod": "mul", "reduce_max": "max", "reduce_min": "min"}
SUM_BLOCK = 2048  # the most terms one running float sum takes, see KernelBuilder.sum_level


def _down_columns(g: Group) -> bool:
    """Whether a row kernel reduces over outer dims only, keeping the last (contiguous) one."""
    F, R = g.domain, g.axes
    last = len(F) - 1
    return (bool(g.passes) and last >= 0 and last not in R and F[last] not in (0, 1) and any(F[k] != 1 for k in R)
            and all(p.name in _COMBINE for p in g.passes))


def _row_index(full_ix: tuple, R: tuple, keepdims: bool) -> tuple:
    """The index of a row value (reduced over R) at full index full_ix."""
    if keepdims:
        return tuple(Const(0, INDEX) if k in R else i for k, i in enumerate(full_ix))
    return tuple(i for k, i in enumerate(full_ix) if k not in R)


def _batch_binds(bvars: tuple, dims: tuple, flat: L.Expr) -> list:
    """Bind each batch variable from the flat batch index (row-major)."""
    binds = []
    stride: L.Expr = Const(1, INDEX)
    for pos, (name, d) in enumerate(reversed(list(zip(bvars, dims)))):
        e = L.idiv(flat, stride)
        if pos != len(bvars) - 1:
            e = L.imod(e, L.dim_expr(d))
        binds.append(L.Bind(name, e))
        stride = L.imul(stride, L.dim_expr(d))
    return list(reversed(binds))


def _free_dims(body: list) -> set:
    """Symbols a kernel body reads that no loop or Bind of it defines (its dim arguments)."""
    used: set = set()
    bound: set = set()

    def expr(e):
        used.update(n for n in L.free_syms(e))

    def walk(stmts):
        for s in stmts:
            if isinstance(s, L.Loop):
                bound.add(s.var)
                expr(s.start), expr(s.stop)
                if s.parallel is not None:
                    expr(s.parallel)
                walk(s.body)
            elif isinstance(s, (L.Let, L.Assign)):
                bound.add(s.var.name)
                expr(s.value)
            elif isinstance(s, L.Bind):
                bound.add(s.name)
                expr(s.value)
            elif isinstance(s, L.Store):
                expr(s.index), expr(s.value)
            elif isinstance(s, L.If):
                expr(s.cond)
                walk(s.body)
            elif isinstance(s, L.Gemm):
                bound.update(s.batch_vars)
                bound.update(("bt", "i0_", "i1_", "j0_", "j1_", s.ivar, s.jvar))
                for e in (*s.batch, s.m, s.n, s.k):
                    expr(e)
                for st in (s.a, s.b, s.c):
                    expr(st.offset), expr(st.rows), expr(st.cols)
                walk(s.epilogue or [])
            elif isinstance(s, L.Quant):
                expr(s.blocks)
    walk(body)
    return used - bound


def zero_if_one(d: Dim, i: L.Expr) -> L.Expr:
    return Const(0, INDEX) if d == 1 else i


def select_index(cond: L.Expr, i: L.Expr) -> L.Expr:
    """i where cond (0 or 1) holds, else 0: an index always inside a non-empty buffer. Written
    as i * cond, not a conditional: GCC 12 with -march=znver3 -O3 miscompiles loads whose
    address is a conditional expression (if-converted into masked loads)."""
    if isinstance(cond, Const):
        return i if cond.value else Const(0, INDEX)
    if isinstance(i, Const) and i.value == 0:
        return i
    return L.imul(i, cond)


def broadcast_index(ix: tuple, src: tuple, dst: tuple) -> tuple:
    """The index of a broadcast operand of shape src at result index ix (shape dst)."""
    lead = len(dst) - len(src)
    return tuple(Const(0, INDEX) if s == 1 else ix[lead + k] for k, s in enumerate(src))


def reshape_index(ix: tuple, src: tuple, dst: tuple) -> tuple:
    """The source index of a reshape at result index ix, group by group."""
    groups = reshape_groups(src, dst) or [(list(range(len(src))), list(range(len(dst))))]
    out: list = [Const(0, INDEX)] * len(src)
    for si, di in groups:
        if len(si) == 1 and len(di) == 1:
            out[si[0]] = zero_if_one(src[si[0]], ix[di[0]])
            continue
        lin: L.Expr = Const(0, INDEX)
        stride: L.Expr = Const(1, INDEX)
        for k in reversed(di):
            lin = L.iadd(lin, L.imul(ix[k], stride))
            stride = L.imul(stride, L.dim_expr(dst[k]))
        real = [k for k in si if src[k] != 1]
        stride = Const(1, INDEX)
        for pos, k in enumerate(reversed(real)):
            e = L.idiv(lin, stride)
            if pos != len(real) - 1:
                e = L.imod(e, L.dim_expr(src[k]))
            out[k] = e
            stride = L.imul(stride, L.dim_expr(src[k]))
    return tuple(out)


# --- the pass -----------------------------------------------------------------------------

def lower_loops(sched: Schedule) -> Program:
    """Buffers for every parameter, constant and stored value; a step per group."""
    func = sched.func
    producer = {r: op for op in func.ops for r in op.results}
    buffers: dict[Value, Buffer] = {}
    order: list[Buffer] = []

    def add(v: Value, kind: str, **kw) -> Buffer:
        b = Buffer(f"b{len(order)}", v.type, kind, v, **kw)
        buffers[v] = b
        order.append(b)
        return b

    for i, p in enumerate(func.params):
        add(p, "param", index=i)
    for op in sched.consts:
        add(op.results[0], "const", data=op.attrs["value"].to_numpy())
    returned = set(func.returns)
    for grp in sched.groups:
        for v in grp.stores:
            if v not in buffers:
                planned = grp.kind != "fallback" or writes_into(grp.op) or is_move(grp.op)
                kind = "fallback" if not planned else ("output" if v in returned else "temp")
                add(v, kind)
    steps = []
    for n, grp in enumerate(sched.groups):
        name = f"k{n}_{grp.name}" if grp.kind != "fallback" else f"f{n}_{grp.op.name}"
        if grp.kind == "fallback" and is_move(grp.op):
            steps.append(MoveStep(f"m{n}_{grp.op.name}", grp.op, [buffers[v] for v in grp.op.operands],
                                  [buffers[v] for v in grp.op.results]))
            continue
        if grp.kind == "fallback":
            steps.append(FallbackStep(name, grp.op, [buffers[v] for v in grp.op.operands],
                                      [buffers[v] for v in grp.op.results]))
            continue
        kb = KernelBuilder(grp, sched, producer, buffers, name)
        kernel = kb.build()
        steps.append(KernelStep(name, kernel, list(kb.param_bufs), grp, ops=list(grp.ops)))
    rets = [buffers[v] for v in func.returns]
    symbols = sorted({s for v in list(func.params) for d in v.type.shape if isinstance(d, SymDim)
                      for s in d.symbols})
    return Program(func, order, steps, rets, symbols)


__all__ = ["lower_loops", "KernelBuilder", "LoweringError"]
