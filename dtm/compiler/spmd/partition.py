"""Partitioning: a global-view function becomes the local-view function one rank runs, with
the collectives explicit (docs/architecture.md, "Two views").

    f0 = partition(module, "mlp", rank=0)            # a Func; its values are rank 0's pieces
    print(dtm.ir.format(local_module(module, "mlp", rank=0)))

Steps: propagate shardings (propagate.py); give each parameter its local type; then for
every op, in program order, bring each operand to the sharding the op's plan asks for
(redistribute.py: collectives and local slices, each emitted once per value and target and
reused by later uses), emit the op on the local pieces (its shape attributes made local),
and redistribute its result when the user annotated another sharding; last, bring each
returned value to the declared result sharding. The result verifies (dtm.ir.verify).

Every rank's function issues the same collectives in the same order; only local shapes,
slice bounds and the fill of partial addends depend on the rank. Uneven chunks give ranks
different local types, which is why the result is one function per rank. Values keep their
global names and carry their global sharding as an informative annotation (spec 1.2).

A local-view function (written with explicit collectives, as shard_map produces) is already
what every rank runs: it is returned as it is. So is a function with no shardings.
"""

from __future__ import annotations

from typing import Sequence

from ...errors import DTMError, ErrorCode as E
from ...ir.diagnostics import TypeRuleError
from ...ir.dtypes import DTYPES
from ...ir.module import Func, Module, Op, Value
from ...ir.registry import REGISTRY
from ...ir.types import Mesh, Sharding, TensorType
from ..irutil import Emitter, verify_pass, with_func
from ...ir.chunks import chunk, coords
from .layout import local_type
from .propagate import OpPlan, choose, propagate
from .redistribute import Lowering, plan

i64 = DTYPES["i64"]


class _Names:
    """Fresh value names: `x.gathered`, then `x.gathered.1`, ..."""

    def __init__(self, taken: set[str]):
        self.taken = taken

    def __call__(self, base: str) -> str:
        name, i = base, 0
        while name in self.taken:
            i += 1
            name = f"{base}.{i}"
        self.taken.add(name)
        return name


class _Partitioner:
    def __init__(self, module: Module, g: Func, mesh: Mesh, rank: int):
        self.module, self.g, self.mesh, self.rank = module, g, mesh, rank
        self.at = coords(mesh, rank)
        self.ops: list[Op] = []
        self.e = Emitter(self.ops, module, prefix="spmd")
        names = {v.name for v in g.params if v.name} | {r.name for op in g.ops for r in op.results if r.name}
        self.fresh = _Names(names)
        self.lower = Lowering(self.e, mesh, self.at, self.fresh)
        self.env: dict[Value, tuple[Value, Sharding]] = {}    # global value -> (local value, its sharding)
        self.moved: dict[tuple[Value, Sharding], Value] = {}  # (global value, target) -> local value

    def local(self, t: TensorType, sh: Sharding) -> TensorType:
        return local_type(t, sh, self.mesh, self.at)

    def fetch(self, v: Value, want: Sharding) -> Value:
        """The local piece of global value v under sharding `want`."""
        lv, have = self.env[v]
        if have == want:
            return lv
        key = (v, want)
        if key not in self.moved:
            try:
                self.moved[key] = self.lower.run(lv, v.type, plan(have, want, self.mesh))
            except TypeRuleError as e:  # quantized values take no pad or slice
                raise DTMError(e.code, f"@{self.g.name} on rank {self.rank}: %{v.name}: {v.type} cannot move from "
                               f"{have} to {want} on {self.mesh}: {e.message}") from None
        return self.moved[key]

    def run(self) -> Func:
        g = self.g
        params = []
        for p in g.params:
            lp = Value(self.local(p.type, p.sharding), p.name, p.sharding)
            self.env[p] = (lp, p.sharding)
            params.append(lp)
        for op in g.ops:
            p = choose(op, [self.env[v][1] for v in op.operands], self.mesh)
            xs = [self.fetch(v, sh) for v, sh in zip(op.operands, p.ins)]
            outs = self.emit(op, xs, p)
            for r, lr, sh in zip(op.results, outs, p.outs):
                self.env[r] = (lr, sh)
                if r.sharding != sh:  # the user asked for another placement of this value
                    self.env[r] = (self.fetch(r, r.sharding), r.sharding)
        returns = [self.fetch(v, sh) for v, (_, sh) in zip(g.returns, g.result_types)]
        result_types = [(self.local(t, sh), sh) for t, sh in g.result_types]
        return Func(g.name, params, result_types, self.ops, returns, g.loc, g.return_loc)

    # -- ops --
    def emit(self, op: Op, xs: Sequence[Value], p: OpPlan) -> tuple[Value, ...]:
        want = tuple(self.local(r.type, sh) for r, sh in zip(op.results, p.outs))
        if p.local:
            (a, how), = p.local
            self.e.prefix = f"{op.results[0].name or 'v'}.t"  # names of its temporaries
            y = getattr(self, how)(op, xs, a)
            y.name, y.sharding = op.results[0].name, p.outs[0]
            assert y.type == want[0], (op.name, y.type, want[0])
            return (y,)
        attrs = self.local_attrs(op, xs, want)
        declared = want if REGISTRY[op.name].declared else ()
        got = REGISTRY[op.name].rule(op.name, tuple(x.type for x in xs), attrs, declared, self.e.ctx)
        assert tuple(got) == want, f"partition bug: local {op.name} gives {got}, the sharding says {want}"
        results = tuple(Value(t, r.name, sh) for t, r, sh in zip(want, op.results, p.outs))
        self.ops.append(Op(op.name, tuple(xs), attrs, results, op.loc))
        return results

    def local_attrs(self, op: Op, xs: Sequence[Value], want: Sequence[TensorType]) -> dict:
        """The op's attributes for local pieces: target shapes are the local result's, and
        a slice's bound on a whole (possibly sharded) dim is the local dim."""
        attrs = op.attrs
        if op.name in ("reshape", "broadcast_to"):
            attrs = dict(attrs, shape=want[0].shape)
        elif op.name == "slice":
            whole, local = op.operands[0].type.shape, xs[0].type.shape
            stop = tuple(loc if (lo == 0 and hi == d and st == 1) else hi
                         for lo, hi, st, d, loc in zip(attrs["start"], attrs["stop"], attrs["step"], whole, local))
            attrs = dict(attrs, stop=stop)
        return attrs

    def _named(self, v: Value, name: str) -> Value:
        v.name = self.fresh(name)
        return v

    def _rows(self, op: Op, xs: Sequence[Value], a: int) -> tuple[Value, Value]:
        """For a table x sharded by rows (dim `axis`) over mesh axis a: the indices clamped
        into the whole table (as gather clamps them) and made local, in i64, and the mask of
        the indices whose rows this rank holds, shaped to broadcast against the result."""
        x, idx = xs[0], xs[1]
        axis, whole = op.attrs["axis"], op.operands[0].type.shape[op.attrs["axis"]]
        start, stop = chunk(whole, self.mesh.axes[a][1], self.at[a])
        e, base = self.e, op.results[0].name or "v"

        def const(value: int, name: str) -> Value:
            return self._named(e.full(value, TensorType(i64, ())), f"{base}.{name}")

        i = e("cast", idx, to=i64) if idx.type.dtype is not i64 else idx
        first = const(start, "first_row")
        i = self._named(e("min", e("max", i, const(0, "zero")), const(max(whole - 1, 0), "last")), f"{base}.index")
        mine = e("logical_and", e("ge", i, first), e("lt", i, const(stop, "end_row")))
        shape = (1,) * axis + idx.type.shape + (1,) * (x.type.rank - axis - 1)
        return (self._named(e("sub", i, first), f"{base}.local_index"),
                self._named(e("reshape", mine, shape=shape), f"{base}.mine"))

    def masked_gather(self, op: Op, xs: Sequence[Value], a: int) -> Value:
        """gather from this rank's rows; zeros where an index falls in another rank's rows.
        The ranks' results add up to the gather from the whole table (partial(sum))."""
        i, mine = self._rows(op, xs, a)
        got = self.e("gather", xs[0], i, axis=op.attrs["axis"])
        return self.e("where", mine, got, self.e.full(0, TensorType(got.type.dtype, ())))

    def masked_scatter_add(self, op: Op, xs: Sequence[Value], a: int) -> Value:
        """scatter_add into this rank's rows of only the updates whose index falls in them."""
        i, mine = self._rows(op, xs, a)
        upd = xs[2]
        kept = self.e("where", mine, upd, self.e.full(0, TensorType(upd.type.dtype, ())))
        return self.e("scatter_add", xs[0], i, kept, axis=op.attrs["axis"])


def partition(module: Module, func: str, rank: int, *, devices: int | None = None) -> Func:
    """The local-view function mesh rank `rank` runs for global-view function @func of
    `module` (see the module docstring). `devices`, when given, is how many devices the
    executor has: a larger mesh is an error (E0509)."""
    g, mesh = propagate(module, func)
    if mesh is None:
        return g
    if devices is not None and mesh.size > devices:
        raise DTMError(E.MESH_TOO_LARGE, f"@{func} runs on {mesh}, which has {mesh.size} devices, but the executor "
                       f"has {devices}; make the mesh smaller or give the executor more devices")
    if not 0 <= rank < mesh.size:
        raise DTMError(E.INVALID_GROUP, f"partition @{func}: rank {rank} is not on {mesh} of {mesh.size} ranks")
    local = _Partitioner(module, g, mesh, rank).run()
    verify_pass(with_func(module, local))
    return local


def local_module(module: Module, func: str, rank: int, *, devices: int | None = None) -> Module:
    """`module` with @func replaced by rank `rank`'s local-view function (to print or run)."""
    return with_func(module, partition(module, func, rank, devices=devices))


def partition_all(module: Module, func: str, *, devices: int | None = None) -> list[Module]:
    """`local_module` for every rank of @func's mesh, in rank order (one module when the
    function is local-view or unsharded)."""
    g, mesh = propagate(module, func)
    n = mesh.size if mesh is not None else 1
    return [local_module(module, func, r, devices=devices) for r in range(n)]

