"""The fusion pass: which values are stored to memory, and which kernel computes each.

Every value that is not stored is recomputed inline wherever a kernel reads it: elementwise
ops, broadcasts, `full` and `iota`, and movement ops (index arithmetic, no copies). A value
is stored (`Schedule.stored`) when
  - the function returns it, or a fallback op (one `lower` has no loops for) reads it;
  - it is elementwise and read by several ops, one of them a movement op (it would be
    recomputed at each index it is read at);
  - it is the base of a matrix product operand that is not a strided view of a stored value;
  - it is a reduction or matrix product that the kernel reading it cannot compute in place
    (see below); or it is computed from a parameter that an `assign` later overwrites and
    read after that assign;
  - inlined, it would count more than INLINE_LIMIT ops (every copy counted): the bound on
    the size of a kernel's code;
  - it is elementwise, read by several ops, and inlined it would read more than READS_LIMIT
    arrays of its own size: a chain like a residual stream (x = x + f(x), layer after
    layer) is otherwise recomputed from every layer's output by every reader, work that
    grows with the square of the depth.

Each stored value gets a kernel, one of:
  - elementwise: loops over the value's shape;
  - reduce (a row kernel): loops over the outer dims of a full shape F; for each outer
    index, one pass per reduction over the reduced axes R (in program order, each reading
    the earlier ones' results), then the stores. Values of shape F and "row" values (F with
    R removed, or set to 1) read the reductions in place: softmax and layer_norm over the
    last dim are one kernel each;
  - matmul: a matrix product, followed by an epilogue: the elementwise ops that read the
    product at its own index and produce one stored value of its type (bias, activation,
    residual: gelu(x @ w + b) is one kernel). A product whose B is a Linear's view of a
    narrow weight, permute(cast(W, f32)) with W q8_0, q4_0 or bf16 (`narrow_weight`), reads
    W itself: the cast is absorbed (kind "narrow") and never stored when every reader of it
    is such a product, so the weight is read narrow, once per product (c_narrow.py);
  - scan: a running sum (`cumsum`) along one axis F[a] of its shape F: a sequential loop
    along the axis, the other dims in parallel; it computes its operand inline and is
    always stored (its own kernel; reductions and products its operand reads are stored);
  - convert: a `cast` between f32 and a block type (q8_0, q4_0): quantize or dequantize,
    block by block, in C (its operand stored, contiguous). A cast between a block type and
    another float dtype goes through f32 (`decompose` splits it: exact, as the reference
    computes it). Casts to and from the narrow floats (f16, bf16, f8e4m3, f8e5m2) are
    elementwise: their values are held as their bits, which only a cast reads;
  - fallback: any other op (scatter, argsort, random, collectives, store, call, other ops on
    narrow floats or quantized dtypes) runs the reference implementation; gather,
    dynamic_slice and dynamic_update_slice are fallback groups too, which the lowering makes
    move steps (program.MoveStep: row copies in the runtime's C).
Loop kernels over the same shape that are related are then merged when the merged kernel
can compute everything in place (see `merge`). Kernels are ordered by their data
dependencies, effects in program order, and an `assign` after every kernel that reads its
target.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from ..ir.module import Func, Op, Value
from ..ir.registry import REGISTRY, Category
from ..ir.symbolic import format_dim
from ..backends.cpu.c_runtime import WHOLE_ROWS  # (the cpu products' widest row an epilogue sees whole)
from .views import MOVES, STRIDED_MOVES, strided_view

NATIVE = frozenset(("bool", "i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64", "f32", "f64"))
NARROW_FLOATS = frozenset(("f16", "bf16", "f8e4m3", "f8e5m2"))  # held as their bits; only `cast` reads them
BLOCK_TYPES = frozenset(("q8_0", "q4_0"))
EW_CATEGORIES = (Category.UNARY, Category.BINARY, Category.COMPARE, Category.TERNARY)
REDUCES = ("reduce_sum", "reduce_prod", "reduce_max", "reduce_min", "argmax", "argmin")
SCANS = ("cumsum",)
SOURCES = ("full", "iota")

FULL, ROW, OTHER = "full", "row", "other"
MERGE_TRIES = 4  # merge candidates tried per kernel (the nearest related ones)
# the most values one merged kernel stores. GCC's time grows faster than a function's size: an
# optimizer's update of GPT-2's 74 weights of shape [768], merged into one kernel of 2,166
# lines and 222 outputs, took 3.7 s to compile, most of the first training step's compile, on
# one core; in kernels of at most 24 outputs the same work compiles in parallel units, and a
# step runs as fast
MERGE_STORES = 24
INLINE_LIMIT = 4096  # ops an inlined expression may count (each copy counted), see bound_inlining
READS_LIMIT = 4  # arrays of its size a value read by several ops may read inlined, see bound_inlining


def op_kind(op: Op) -> str:
    """How the compiler handles an op: ew, move, source, random, const, reduce, scan, matmul or fallback."""
    types = [v.type for v in op.operands] + [r.type for r in op.results]
    if op.name == "cast":
        src, dst = types[0].dtype.name, types[1].dtype.name
        if (src in BLOCK_TYPES and dst == "f32") or (dst in BLOCK_TYPES and src == "f32"):
            return "convert"
        if src in NATIVE | NARROW_FLOATS and dst in NATIVE | NARROW_FLOATS:
            return "ew"
    if any(t.dtype.name not in NATIVE for t in types):
        return "fallback"
    cat = REGISTRY[op.name].category
    if cat in EW_CATEGORIES:
        return "ew"
    if op.name in MOVES:
        return "move"
    if op.name == "random" and op.attrs["distribution"] == "uniform":
        return "random"  # computed where it is read: Philox of the element's index (c_random)
    if op.name in SOURCES:
        return "source"
    if op.name == "constant":
        return "const"
    if op.name in REDUCES:
        return "reduce"
    if op.name in SCANS:
        return "scan"
    if op.name == "matmul":
        return "matmul"
    return "fallback"


def _size(shape: tuple) -> tuple:
    """A shape's element count, comparable across reshapes (symbolic dims by name)."""
    static = 1
    for d in shape:
        static *= d if isinstance(d, int) else 1
    return static, sorted(str(d) for d in shape if not isinstance(d, int))


_SCALAR = _size(())  # one element


def reduce_axes(op: Op) -> tuple[int, ...]:
    return (op.attrs["axis"],) if op.name in ("argmax", "argmin") else tuple(sorted(op.attrs["axes"]))


def row_shapes(F: tuple, R: tuple) -> tuple[tuple, tuple]:
    """The shape of a reduction's result over axes R of shape F: (keepdims, without)."""
    return (tuple(1 if i in R else d for i, d in enumerate(F)), tuple(d for i, d in enumerate(F) if i not in R))


@dataclass
class Group:
    """One kernel. `stores` are the values it writes; `loads` those it reads from memory."""

    kind: str                                   # elementwise | reduce | scan | matmul | convert | fallback
    stores: list[Value]
    domain: tuple = ()                          # F: the shape the loops run over
    axes: tuple = ()                            # R: reduced axes of F (reduce kernels), the scanned one (scan)
    passes: list[Op] = field(default_factory=list)
    matmul: Op | None = None
    op: Op | None = None                        # the fallback op
    ops: list[Op] = field(default_factory=list)  # every op computed here, program order
    loads: list[Value] = field(default_factory=list)
    first: int = 0                              # program position of its first op

    @property
    def name(self) -> str:
        names = []
        for op in self.ops:
            if op.name not in names and op.name not in ("full", "iota"):
                names.append(op.name)
        text = "_".join(names[:4]) + ("_etc" if len(names) > 4 else "")
        return text or "copy"


@dataclass
class Schedule:
    func: Func
    groups: list[Group]
    stored: set
    consts: list[Op]

    def __str__(self) -> str:
        names = _names(self.func)
        lines = [f"schedule of @{self.func.name}: {len(self.groups)} kernel(s)"]
        for i, g in enumerate(self.groups):
            dom = "[" + ", ".join(format_dim(d) for d in g.domain) + "]"
            head = f"k{i} {g.kind}"
            if g.kind in ("fallback", "convert"):
                head += f" {g.op.name}"
            else:
                along = "along axis" if g.kind == "scan" else "reducing axes"
                head += f" over {dom}" + (f" {along} {list(g.axes)}" if g.axes else "")
            lines.append(head)
            if g.passes:
                lines.append("  passes: " + ", ".join(f"{names.get(p.results[0], '?')} = {p.name}" for p in g.passes))
            if g.matmul is not None:
                lines.append(f"  matmul: {names.get(g.matmul.results[0], '?')}")
            lines.append("  ops: " + " ".join(op.name for op in g.ops))
            lines.append("  reads: " + (", ".join(names.get(v, "?") for v in g.loads) or "-"))
            lines.append("  writes: " + (", ".join(names.get(v, "?") for v in g.stores) or "-"))
        return "\n".join(lines)


def _names(f: Func) -> dict:
    names = {}
    for p in f.params:
        names[p] = "%" + str(p.name)
    for op in f.ops:
        for r in op.results:
            names[r] = "%" + str(r.name)
    return names


class _Graph:
    """Def-use facts about one function."""

    def __init__(self, func: Func):
        self.func = func
        self.producer: dict[Value, Op] = {}
        self.pos: dict[Op, int] = {}
        self.users: dict[Value, list[Op]] = {}
        for i, op in enumerate(func.ops):
            self.pos[op] = i
            for r in op.results:
                self.producer[r] = op
            for v in op.operands:
                self.users.setdefault(v, []).append(op)
        self.kind = {op: op_kind(op) for op in func.ops}
        self.params = set(func.params)
        for cast in _absorbed_casts(self):
            self.kind[cast] = "narrow"


@dataclass
class _Walk:
    passes: list = field(default_factory=list)
    need: set = field(default_factory=set)
    matmuls: dict = field(default_factory=dict)    # matmul op -> set of modes reached in
    loads: list = field(default_factory=list)
    ops: set = field(default_factory=set)
    through: set = field(default_factory=set)      # the unstored values it went through


class _Ancestry:
    """The kernels that must run before each kernel (by id), directly (`deps`) and at all (a
    bit mask per kernel), kept up to date as kernels merge: whether a merge would make a cycle
    is then a look at a few masks, not a walk of the graph (GPT-2's step walked it 1,214 times)."""

    def __init__(self, deps: dict[int, set]):
        self.deps = deps
        self.bit = {k: 1 << n for n, k in enumerate(deps)}
        self.bits = len(deps)  # bits handed out: a merged kernel gets the next
        self.before: dict[int, int] = {}
        for k in _topological(deps, {k: n for n, k in enumerate(deps)}):
            mask = 0
            for d in deps[k]:
                mask |= self.bit[d] | self.before[d]
            self.before[k] = mask

    def indirect(self, a: int, b: int) -> bool:
        """Whether a path through some third kernel joins a and b (merging would make a cycle)."""
        return any(self.before[d] & self.bit[a] for d in self.deps[b] if d != a) or \
            any(self.before[d] & self.bit[b] for d in self.deps[a] if d != b)

    def merge(self, a: int, b: int, c: int) -> None:
        """Kernels a and b became kernel c."""
        gone = {a, b}
        mask = self.bit.pop(a) | self.bit.pop(b)
        self.bit[c], self.bits = 1 << self.bits, self.bits + 1
        self.deps[c] = (self.deps.pop(a) | self.deps.pop(b)) - gone
        self.before[c] = (self.before.pop(a) | self.before.pop(b)) & ~mask
        for d in self.deps.values():
            if d & gone:
                d -= gone
                d.add(c)
        for k, m in self.before.items():
            if m & mask:
                self.before[k] = (m & ~mask) | self.bit[c] | self.before[c]


def _topological(deps: dict[int, set], rank: dict[int, int]) -> list[int]:
    """The kernels of `deps` (each kernel's id -> those that must run before it) in an order
    that puts each after all of those: of the kernels whose dependencies have run, the one of
    lowest `rank` next."""
    waiting = {k: len(d) for k, d in deps.items()}
    after: dict[int, list[int]] = {}
    for k, d in deps.items():
        for x in d:
            after.setdefault(x, []).append(k)
    ready = [(rank[k], k) for k, n in waiting.items() if n == 0]
    heapq.heapify(ready)
    out: list[int] = []
    while ready:
        _, k = heapq.heappop(ready)
        out.append(k)
        for later in after.get(k, ()):
            waiting[later] -= 1
            if waiting[later] == 0:
                heapq.heappush(ready, (rank[later], later))
    if len(out) != len(deps):  # pragma: no cover - the scheduler never builds a cycle
        raise AssertionError("dtm.compiler bug: the kernel graph has a cycle")
    return out


def _child_mode(mode: str, w_shape: tuple, u_shape: tuple, F: tuple, R: tuple) -> str:
    if mode == FULL:
        if w_shape == F:
            return FULL
        if R and w_shape == row_shapes(F, R)[0]:
            return ROW
        return OTHER
    if mode == ROW and w_shape == u_shape:
        return ROW
    return OTHER


def _move_mode(op: Op, mode: str, F: tuple, R: tuple) -> str:
    src, dst = op.operands[0].type.shape, op.results[0].type.shape
    keep, drop = row_shapes(F, R)
    if op.name == "broadcast_to" and mode == FULL and R and src == keep and dst == F:
        return ROW
    if op.name == "reshape":
        if mode == FULL and src == dst:
            return FULL
        if mode == ROW and src in (keep, drop) and dst in (keep, drop):
            return ROW
    return OTHER


class _Scheduler:
    def __init__(self, func: Func):
        self.g = _Graph(func)
        self.stored: set[Value] = set()
        self._cones: dict[Value, frozenset] = {}  # _cone's memory, valid while len(stored) is _cones_at
        self._cones_at = -1
        self._walks: dict[tuple, _Walk] = {}      # walk_one's memory, made with the values in _walked_with stored
        self._walked_with: set[Value] = set()

    # -- the cone of a stored value --
    def is_boundary(self, v: Value, own: set) -> bool:
        return v in self.g.params or (v in self.stored and v not in own)

    def walk(self, roots: list[Value], F: tuple, R: tuple, own: set) -> _Walk:
        g, w = self.g, _Walk()
        seen: set = set()
        loads_seen: set = set()
        stack = []
        for v in roots:
            op = g.producer[v]
            mode = ROW if (g.kind[op] == "reduce" or v.type.shape != F) else FULL
            stack.append((v, mode))
        passes: set = set()
        while stack:
            u, mode = stack.pop()
            if (u, mode) in seen:
                continue
            seen.add((u, mode))
            if self.is_boundary(u, own) or (u not in own and g.kind.get(g.producer.get(u)) == "const"):
                if u not in loads_seen:
                    loads_seen.add(u)
                    w.loads.append(u)
                continue
            w.through.add(u)
            op = g.producer[u]
            kind = g.kind[op]
            if kind in ("fallback", "convert", "const"):  # stored by its own kernel, or a constant buffer
                if u not in loads_seen:
                    loads_seen.add(u)
                    w.loads.append(u)
                continue
            w.ops.add(op)
            if kind == "reduce":
                if mode == ROW and reduce_axes(op) == R and op.operands[0].type.shape == F:
                    if op not in passes:
                        passes.add(op)
                    stack.append((op.operands[0], FULL))
                else:
                    w.need.add(u)
            elif kind == "matmul":
                w.matmuls.setdefault(op, set()).add(mode)
                for x in op.operands:  # strided views of stored values (the gemm reads them) or inlined
                    stack.append((x, OTHER))
            elif kind == "ew":
                for x in op.operands:
                    stack.append((x, _child_mode(mode, x.type.shape, u.type.shape, F, R)))
            elif kind == "move":
                for x in op.operands:
                    stack.append((x, _move_mode(op, mode, F, R)))
            elif kind == "narrow":  # the product reads the narrow weight itself
                stack.append((op.operands[0], OTHER))
            elif kind == "random":  # reads the two words of its key
                stack.append((op.operands[0], OTHER))
            elif kind == "scan":  # read element by element along the scan: what is not inlined is stored
                stack.append((op.operands[0], OTHER))
            # sources read nothing
        w.passes = sorted(passes, key=lambda op: g.pos[op])
        return w

    def walk_one(self, v: Value, F: tuple, R: tuple) -> _Walk:
        """walk([v], F, R, {v}), remembered until a value it went through is stored. The
        stored set only grows, and a walk changes only where it meets a newly stored value;
        run() walks every stored value again in each round (GPT-2's fuse: 4 rounds)."""
        if len(self._walked_with) != len(self.stored):
            grown = self.stored - self._walked_with
            self._walks = {key: w for key, w in self._walks.items() if w.through.isdisjoint(grown)}
            self._walked_with = set(self.stored)
        w = self._walks.get((v, F, R))
        if w is None:
            w = self._walks[(v, F, R)] = self.walk([v], F, R, {v})
        return w

    def cone_reduces(self, v: Value) -> list[Op]:
        """Reductions reachable from v without crossing a stored value, program order."""
        g = self.g
        op = g.producer.get(v)
        if op is None or g.kind[op] in ("fallback", "convert", "const"):
            return []
        out = {op} if g.kind[op] == "reduce" else set()
        for x in op.operands:
            out |= self._cone(x)
        return sorted(out, key=g.pos.get)

    def _cone(self, root: Value) -> frozenset:
        """The reductions an unstored value's expression computes (cone_reduces without the
        value itself stored), remembered per value while the stored set stays the same: the
        cones of a program's values overlap, and fusing GPT-2 walked them 2,955 times."""
        g = self.g
        if self._cones_at != len(self.stored):  # the stored set only grows: its size says when it changed
            self._cones, self._cones_at = {}, len(self.stored)
        memo = self._cones
        stack = [(root, False)]
        while stack:
            u, operands_done = stack.pop()
            if u in memo:
                continue
            op = g.producer.get(u)
            if self.is_boundary(u, set()) or op is None or g.kind[op] in ("fallback", "convert", "const"):
                memo[u] = frozenset()
            elif not operands_done:
                stack.append((u, True))
                stack.extend((x, False) for x in op.operands if x not in memo)
            else:
                cone = set().union(*(memo[x] for x in op.operands))
                if g.kind[op] == "reduce":
                    cone.add(op)
                memo[u] = frozenset(cone)
        return memo[root]

    def domain(self, v: Value) -> tuple[tuple, tuple]:
        """The loops of v's kernel: (F, R). A reduction's are its own; otherwise, among the
        reductions v reads (unstored) whose shapes fit v, the one whose kernel computes the
        most of them in place (ties: the one nearest v)."""
        op = self.g.producer[v]
        if self.g.kind[op] == "reduce":
            return op.operands[0].type.shape, reduce_axes(op)
        if self.g.kind[op] == "scan":
            return v.type.shape, (op.attrs["axis"],)
        shape = v.type.shape
        best, best_score = (shape, ()), None
        seen = set()
        for r in reversed(self.cone_reduces(v)):
            F, R = r.operands[0].type.shape, reduce_axes(r)
            if (F, R) in seen or not (shape == F or shape in row_shapes(F, R)):
                continue
            seen.add((F, R))
            w = self.walk_one(v, F, R)
            score = (len(w.need), -len(w.passes))
            if best_score is None or score < best_score:
                best, best_score = (F, R), score
        return best

    # -- what must be stored --
    def initial(self) -> None:
        g = self.g
        self.stored.update(v for v in g.func.returns if v not in g.params)
        self.stored.update(self.read_across_assigns())
        for op in g.func.ops:
            kind = g.kind[op]
            if kind in ("fallback", "convert"):
                self.stored.update(op.results)
                self.stored.update(v for v in op.operands if v not in g.params)
            elif kind in ("const", "scan"):  # a scan is a kernel of its own
                self.stored.update(op.results)
            if kind in ("ew", "move"):
                # read at two different indices (through a movement op): computed once, not once per
                # index; this also bounds the code a chain of slices and concats could inline. A
                # strided view of a stored value costs nothing to read again (a product reads it
                # in place), so it is not copied out.
                users = set(g.users.get(op.results[0], ()))
                if (len(users) >= 2 and any(g.kind[u] == "move" for u in users)
                        and not self.is_view(op.results[0])):
                    self.stored.add(self.reshaped_from(op.results[0]))
        self.bound_inlining()
        self.stored.update(self.dropped_reductions())

    def dropped_reductions(self) -> set[Value]:
        """The operands x of dropouts, where(keep, x * s, 0) with keep a stored comparison of a
        draw and s a scalar, that compute a reduction inline and are read by another op as
        well: attention's probabilities, softmax(q k^T), which the backward pass reads again.
        Stored, the softmax is q k^T's epilogue as it is without dropout; inlined, q k^T was
        stored and the dropout's kernel and the backward's each ran the softmax again from it
        (a step of the char model: 0.45 ms a layer). simplify keeps x * s whole for this."""
        g, out = self.g, set()
        for op in g.func.ops:
            if op.name != "where" or op.operands[0] not in self.stored:
                continue
            cmp = g.producer.get(op.operands[0])
            if cmp is None or not any(g.kind.get(g.producer.get(x)) == "random" for x in cmp.operands):
                continue
            scaled = g.producer.get(op.operands[1])
            if scaled is None or scaled.name != "mul":
                continue
            x, s = scaled.operands if _size(scaled.operands[1].type.shape) == _SCALAR else scaled.operands[::-1]
            if (_size(s.type.shape) == _SCALAR and x.type.shape == op.results[0].type.shape and x not in self.stored
                    and x not in g.params and len(set(g.users.get(x, ()))) >= 2 and self.cone_reduces(x)):
                out.add(x)
        return out

    def view(self, v: Value):
        """strided_view of v over the values stored so far and the parameters."""
        return strided_view(v, self.g.producer, lambda u: u in self.g.params or u in self.stored)

    def is_view(self, v: Value) -> bool:
        """Whether v is a strided view of another value that is stored or a parameter."""
        view = self.view(v)
        return view is not None and view[0] is not v

    def reshaped_from(self, v: Value) -> Value:
        """The value v is a reshape (or a chain of reshapes) of, else v: both have the same
        elements in the same order, so storing that value stores v as well, and a product
        whose result it is can compute it in its epilogue."""
        g = self.g
        while (op := g.producer.get(v)) is not None and op.name == "reshape" and op.operands[0] not in g.params:
            v = op.operands[0]
        return v

    def bound_inlining(self) -> None:
        """Store every value whose inlined expression would exceed INLINE_LIMIT ops, counting
        each copy (a value read twice is inlined twice): no kernel's code grows without
        bound, whatever chain of elementwise and movement ops a program builds (its own
        kernel then inlines at most INLINE_LIMIT ops per operand). Store as well a value read
        by several ops whose expression reads more than READS_LIMIT arrays of its own size
        (TorchInductor's realize_reads_threshold is the same rule): each reader would read
        them all again."""
        g, cost, reads = self.g, {}, {}
        for op in g.func.ops:
            if g.kind[op] not in ("ew", "move", "source", "random"):
                continue
            r = op.results[0]
            # A draw costs as much as the limit (Philox: ten rounds): what reads it is stored,
            # a dropout's mask, so the passes that read it again (a layer norm's, the backward
            # pass's) read one byte an element instead of drawing again.
            own = INLINE_LIMIT if g.kind[op] == "random" else 1
            c = own + sum(cost.get(v, 0) for v in op.operands if v not in self.stored)
            size, arrays = _size(r.type.shape), set()
            for v in op.operands:
                if v in reads and v not in self.stored:
                    arrays |= reads[v]
                elif _size(v.type.shape) == size:
                    arrays.add(v)
            if c > INLINE_LIMIT or (len(arrays) > READS_LIMIT and len(set(g.users.get(r, ()))) >= 2):
                self.stored.add(r)
            cost[r], reads[r] = c, arrays

    def read_across_assigns(self) -> set[Value]:
        """The values computed from a parameter before an `assign` overwrites it and read
        after that assign: they are stored, so that their kernel runs before the assign.
        (Values only read before it, a training step's whole forward and backward whose
        updates come last, stay inlined, views of the weights included.)"""
        g = self.g
        written = {op.operands[0]: g.pos[op] for op in g.func.ops if op.name == "assign"}
        if not written:
            return set()
        reads: dict[Value, int] = {}  # a value -> the earliest assign over what its expression reads
        out = set()
        for op in g.func.ops:
            if op.name == "assign" or not op.results:
                continue
            first = min([written[v] for v in op.operands if v in written] +
                        [reads[v] for v in op.operands if v in reads], default=None)
            if first is None or first < g.pos[op]:
                continue  # reads nothing assigned later (an op after the assign has E0207)
            for r in op.results:
                reads[r] = first
                if any(g.pos[u] > first for u in g.users.get(r, ())):
                    out.add(r)
        return out

    def matmul_operands(self) -> bool:
        """Store what the gemm's operands need; True when something was added."""
        g, added = self.g, False
        for op in g.func.ops:
            if g.kind[op] != "matmul" or not gemm_dtype(op):
                continue
            casts = bf16_operands(op, g.producer)
            for n, x in enumerate(op.operands):
                view = self.view(x)
                # not a view: the value its reshapes start from is stored, and read through them
                target = self.reshaped_from(x) if view is None else view[0]
                if casts is not None:
                    target = casts[n].operands[0]  # the bf16 product reads the bf16 value the cast widens
                elif g.kind.get(g.producer.get(target)) == "narrow":
                    target = g.producer[target].operands[0]  # the gemm reads the narrow weight the cast reads
                if target not in g.params and target not in self.stored:
                    self.stored.add(target)
                    added = True
        return added

    def groups_once(self) -> tuple[list[Group], set]:
        """One kernel per stored value, and the values that must be stored as well."""
        g, groups, need = self.g, [], set()
        reach: dict[Op, list] = {}
        for v in sorted(self.stored, key=self._order):
            op = g.producer.get(v)
            if op is None or g.kind[op] in ("fallback", "convert", "const"):
                continue
            F, R = self.domain(v)
            w = self.walk_one(v, F, R)
            need |= w.need
            kind = "scan" if g.kind[op] == "scan" else "reduce" if w.passes else "elementwise"
            grp = Group(kind, [v], F, R if kind != "elementwise" else (), w.passes, None, None,
                        sorted(w.ops, key=g.pos.get), w.loads)
            for mm, modes in w.matmuls.items():
                reach.setdefault(mm, []).append((grp, modes))
            groups.append(grp)
        for mm, users in reach.items():
            r = mm.results[0]
            if r in self.stored:
                continue
            (grp, modes), *more = users
            sink = grp.stores[0]
            ok = (not more and modes == {FULL} and (not grp.passes or self.row_epilogue(grp, mm))
                  and sink.type == r.type and grp.matmul is None)
            if ok:
                grp.kind, grp.matmul = "matmul", mm
            else:
                need.add(r)
        for grp in groups:
            op = g.producer[grp.stores[0]]
            if g.kind[op] == "matmul" and grp.matmul is None:
                grp.kind, grp.matmul = "matmul", op
        return groups, need

    def row_epilogue(self, grp: Group, mm: Op) -> bool:
        """Whether row kernel grp (softmax over attention scores, a residual's layer norm) can
        be the epilogue of product mm: it reduces along the product's rows, which the f32 and
        f64 runtime gives an epilogue whole (more than one row, at most WHOLE_ROWS columns:
        c_runtime; not the narrow weights' runtime), so each row is reduced while it is in
        cache instead of in a pass of its own over the whole product."""
        shape = mm.results[0].type.shape
        rows, cols = shape[-2], shape[-1]
        return (grp.domain == shape and grp.axes == (len(shape) - 1,) and isinstance(rows, int) and rows > 1
                and isinstance(cols, int) and 1 < cols <= WHOLE_ROWS and not self.narrow_product(mm))

    def narrow_product(self, mm: Op) -> bool:
        """Whether product mm reads a narrow weight (the cast absorbed: c_narrow's runtime)."""
        g = self.g
        views = [self.view(x) for x in mm.operands]
        return any(view is not None and g.kind.get(g.producer.get(view[0])) == "narrow" for view in views)

    def _order(self, v: Value) -> int:
        op = self.g.producer.get(v)
        return self.g.pos[op] if op is not None else -1

    def run(self) -> Schedule:
        g = self.g
        self.initial()
        while True:
            added = self.matmul_operands()
            groups, need = self.groups_once()
            need -= self.stored
            if not need and not added:
                break
            self.stored |= need
        for op in g.func.ops:
            if g.kind[op] in ("fallback", "convert"):
                groups.append(Group(g.kind[op], list(op.results), op=op, ops=[op], loads=list(op.operands)))
        for grp in groups:
            grp.first = min(g.pos[op] for op in grp.ops) if grp.ops else 0
        groups.sort(key=lambda grp: grp.first)
        groups = self.merge(groups)
        consts = [op for op in g.func.ops if g.kind[op] == "const"]
        return Schedule(g.func, self.order(groups), self.stored, consts)

    # -- merging and ordering --
    def merge(self, groups: list[Group]) -> list[Group]:
        """Merge loop kernels over the same shape that are related (they share a reduction or
        an input, or one reads what the other stores) when the merged kernel computes every
        value in place (its own stores inline, reductions as passes) and no other kernel has
        to run between the two. A row kernel absorbs the reductions and elementwise kernels
        over its rows: softmax's max returned beside it, or a value derived from its result."""
        out = list(groups)
        order = _Ancestry(self.deps(out))
        i = 0
        while i < len(out):
            grp = out[i]
            merged = None
            tries = 0
            if grp.kind in ("elementwise", "reduce"):
                for j in range(i - 1, -1, -1):
                    other = out[j]
                    if other.kind not in ("elementwise", "reduce") or other.domain != grp.domain:
                        continue
                    if other.axes and grp.axes and other.axes != grp.axes:
                        continue
                    if not self._related(other, grp):
                        continue
                    tries += 1
                    if tries > MERGE_TRIES:
                        break
                    cand = self._merged(other, grp)
                    if cand is not None and not order.indirect(id(other), id(grp)):
                        merged = (j, cand)
                        break
            if merged is None:
                i += 1
                continue
            j, cand = merged
            order.merge(id(out[j]), id(grp), id(cand))
            out[j] = cand
            out.pop(i)
        return out

    @staticmethod
    def _related(a: Group, b: Group) -> bool:
        """Whether merging a and b saves a pass over memory: they share a reduction, one reads
        what the other stores, or both read one array. Not a shared scalar: the AdamW updates
        of same-shaped weights all read the step's scalars, and merged they were half of a
        training step's C, where apart they are one body (share.py)."""
        return bool(set(a.passes) & set(b.passes) or set(a.stores) & set(b.loads) or set(b.stores) & set(a.loads)
                    or any(_size(v.type.shape) != _SCALAR for v in set(a.loads) & set(b.loads)))

    def _merged(self, a: Group, b: Group) -> Group | None:
        stores = a.stores + b.stores
        if len(stores) > MERGE_STORES:
            return None
        R = a.axes or b.axes
        w = self.walk(stores, a.domain, R, set(stores))
        if w.need or w.matmuls:
            return None
        grp = Group("reduce" if w.passes else "elementwise", stores, a.domain, R if w.passes else (), w.passes,
                    None, None, sorted(w.ops, key=self.g.pos.get), w.loads)
        grp.first = min(a.first, b.first)
        return grp

    def deps(self, groups: list[Group]) -> dict[int, set]:
        """For each kernel (by id), the kernels that must run before it: those storing what it
        loads; effects in program order; an assign or call after the kernels reading what it
        writes."""
        by_store = {v: grp for grp in groups for v in grp.stores}
        deps: dict[int, set] = {id(grp): set() for grp in groups}
        for grp in groups:
            for v in grp.loads:
                if v in by_store and by_store[v] is not grp:
                    deps[id(grp)].add(id(by_store[v]))
        effects = [grp for grp in groups if grp.kind == "fallback" and
                   (REGISTRY[grp.op.name].effect or grp.op.name == "call")]
        effects.sort(key=lambda grp: grp.first)
        for a, b in zip(effects, effects[1:]):
            deps[id(b)].add(id(a))
        readers: dict[Value, list[Group]] = {}
        for grp in groups:
            for v in grp.loads:
                readers.setdefault(v, []).append(grp)
        for e in effects:
            # Only assign and call write into their operands; other effects (collectives,
            # store_put, send) read them like any op. A group's `first` can be early because it
            # recomputes a cheap producer, so this rule must not reach further than it needs.
            if e.op.name not in ("assign", "call"):
                continue
            written = [e.op.operands[0]] if e.op.name == "assign" else list(e.op.operands)
            for v in written:
                for grp in readers.get(v, ()):
                    if grp is not e and grp.first < e.first:
                        deps[id(e)].add(id(grp))
        return deps

    def order(self, groups: list[Group]) -> list[Group]:
        """The kernels in an order that respects `deps`, else program order: of the kernels
        whose dependencies have run, the one first in the program runs next."""
        by_id = {id(grp): grp for grp in groups}
        rank = {id(grp): i for i, grp in enumerate(sorted(groups, key=lambda grp: grp.first))}
        return [by_id[k] for k in _topological(self.deps(groups), rank)]


def gemm_dtype(op: Op) -> bool:
    """Whether a matmul runs on the tiled runtime kernel (f32, f64) or as plain loops."""
    return op.results[0].type.dtype.name in ("f32", "f64")


def bf16_operands(mm: Op, producer: dict) -> tuple[Op, Op] | None:
    """The casts through which f32 matmul `mm` reads two bf16 values, when both its operands
    are strided views (movement ops only) of cast(x, f32) with x bf16: the product then runs
    on the bf16 values themselves, with f32 sums (c_bf16.py), the same sums as on the
    widened values (a product of two bf16 values is exact in f32). widen.py makes every
    product of an autocast program so."""
    if mm.results[0].type.dtype.name != "f32":
        return None
    out = []
    for x in mm.operands:
        view = strided_view(x, producer, lambda u: _bf16_cast(producer.get(u)))
        cast = None if view is None else producer.get(view[0])
        if not _bf16_cast(cast):
            return None
        out.append(cast)
    return out[0], out[1]


def _bf16_cast(op: Op | None) -> bool:
    return (op is not None and op.name == "cast" and op.operands[0].type.dtype.name == "bf16"
            and op.results[0].type.dtype.name == "f32")


NARROW_WEIGHTS = ("q8_0", "q4_0", "bf16")  # the weight dtypes of c_narrow's products


def narrow_weight(mm: Op, producer: dict) -> Op | None:
    """The cast through which matmul `mm` reads a narrow weight as its B operand, when the
    runtime's product with narrow weights can read the weight itself: the product is f32,
    and B is the plain transpose of cast(W, f32) (broadcast along batch dims), W a static
    2-d q8_0, q4_0 or bf16 value [N, K], so that each column of B is a whole row of W (the
    layout of a Linear's weight, and of a tied embedding used as the output head)."""
    if mm.results[0].type.dtype.name != "f32" or bf16_operands(mm, producer) is not None:
        return None  # (two bf16 operands: the bf16 product reads both)
    view = strided_view(mm.operands[1], producer, lambda u: getattr(producer.get(u), "name", None) == "cast")
    if view is None:
        return None
    base, off, st = view
    cast = producer.get(base)
    if cast is None or cast.name != "cast":
        return None
    w = cast.operands[0]
    b_shape = mm.operands[1].type.shape
    if w.type.dtype.name not in NARROW_WEIGHTS or w.type.rank != 2 or not all(isinstance(d, int) for d in w.type.shape):
        return None
    n, k = w.type.shape
    if off != 0 or b_shape[-2] != k or st[-2] != 1 or st[-1] != k or any(s != 0 for s in st[:-2]):
        return None
    return cast


def _absorbed_casts(g: "_Graph") -> set[Op]:
    """The casts of narrow weights that only products on narrow weights read (through
    strided movement ops): none of them is computed, the products read their operand."""
    readers: dict[Op, set] = {}
    for op in g.func.ops:
        if g.kind[op] == "matmul":
            cast = narrow_weight(op, g.producer)
            if cast is not None:
                readers.setdefault(cast, set()).add(op)
    returned = set(g.func.returns)

    def only_products(v: Value, products: set) -> bool:
        if v in returned:
            return False
        for u in g.users.get(v, ()):
            if u.name in STRIDED_MOVES:
                if not only_products(u.results[0], products):
                    return False
            elif not (u in products and u.operands[0] is not v):
                return False
        return True

    return {cast for cast, products in readers.items() if only_products(cast.results[0], products)}


def fuse(func: Func) -> Schedule:
    """Group the ops of `func` into kernels (see the module docstring)."""
    return _Scheduler(func).run()
