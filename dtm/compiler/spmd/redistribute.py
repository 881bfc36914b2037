"""Redistribution: the collectives (and local slices) that turn a value of one sharding into
the same value under another, on one mesh.

One mesh axis changes per step, and each change has one move:

    from \\ to     replicate         shard(j)                 partial(op)
    partial(op)   all_reduce        reduce_scatter(dim j)    all_reduce, then as replicate
    shard(i)      all_gather        all_to_all(i -> j)       all_gather, then as replicate
    replicate     -                 local slice              local: coordinate 0 keeps the
                                                             value, others the identity (sum
                                                             0, prod 1; max, min, avg: all keep it)

`plan` orders the steps so that data shrinks before it moves: local slices first, then
reductions (all_reduce, reduce_scatter), then all_to_all, then all_gather, then the local
moves to partial. A move whose target dim another axis still shards waits until that axis
has moved; when every pending move waits, one axis goes to replicate first. Adjacent
all_reduces with one op merge into one over several axes.

Uneven chunks (layout.py): a piece is padded to the full chunk size `k` before `all_gather`
and `all_to_all` (and a whole dim to `n*k` before `reduce_scatter` and `all_to_all`), and
the padding is sliced off after, so every rank passes the collective operands of one type.

`transition_cost` prices one axis's move, for propagation's choice of strategy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ...ir.module import Value
from ...ir.symbolic import dim_mul, dim_sub, is_static
from ...ir.types import Mesh, Placement, Replicate, Sharding, TensorType
from ..irutil import Emitter
from ...ir.chunks import block, chunk
from .layout import PARTIAL_IDENTITY

R = Replicate()

# The direct move from one placement kind to another (None: through replicate first).
_MOVE = {
    ("partial", "replicate"): "all_reduce", ("partial", "shard"): "reduce_scatter", ("partial", "partial"): None,
    ("shard", "replicate"): "all_gather", ("shard", "shard"): "all_to_all", ("shard", "partial"): None,
    ("replicate", "shard"): "slice", ("replicate", "partial"): "to_partial",
}
_TO_REPLICATE = {"partial": "all_reduce", "shard": "all_gather"}
_ORDER = {"slice": 0, "reduce_scatter": 1, "all_reduce": 2, "all_to_all": 3, "all_gather": 4, "to_partial": 5}


@dataclass(frozen=True)
class Step:
    """One move: `kind` over mesh axes `axes` (indices into the mesh's axes; several only
    for a merged all_reduce), from sharding `before` to `after`."""

    kind: str
    axes: tuple[int, ...]
    before: Sharding
    after: Sharding

    def describe(self, mesh: Mesh) -> str:
        names = [mesh.axes[a][0] for a in self.axes]
        return f"{self.kind} over {names}: {self.before} -> {self.after}"


def plan(src: Sharding, dst: Sharding, mesh: Mesh) -> list[Step]:
    """The steps from `src` to `dst` (both valid shardings on `mesh`)."""
    assert src.mesh == dst.mesh == mesh.name, (src, dst, mesh)
    cur, want = list(src.placements), dst.placements
    steps: list[Step] = []
    while True:
        options = []
        for a, (have, to) in enumerate(zip(cur, want)):
            if have == to:
                continue
            kind = _MOVE[(have.kind, to.kind)]
            blocked = to.kind == "shard" and any(p == to for b, p in enumerate(cur) if b != a)
            if kind is None or blocked:
                if have.kind != "replicate":  # go through replicate; a blocked replicate waits
                    options.append((10 + _ORDER[_TO_REPLICATE[have.kind]], a, R, _TO_REPLICATE[have.kind]))
            else:
                options.append((_ORDER[kind], a, to, kind))
        if not options:
            break
        _, a, to, kind = min(options)
        before = Sharding(src.mesh, tuple(cur))
        cur[a] = to
        step = Step(kind, (a,), before, Sharding(src.mesh, tuple(cur)))
        last = steps[-1] if steps else None
        if kind == "all_reduce" and last is not None and last.kind == "all_reduce" \
                and last.before.placements[last.axes[0]] == before.placements[a]:
            steps[-1] = Step(kind, last.axes + (a,), last.before, step.after)  # one all_reduce, several axes
        else:
            steps.append(step)
    assert tuple(cur) == want, (src, dst, cur)
    return steps


def transition_cost(have: Placement, want: Placement, nbytes: float, n: int) -> float:
    """The price of moving one axis from `have` to `want` for a piece of `nbytes`: bytes a
    rank sends (ring algorithms), except that a partial value has to be reduced sooner or
    later anyway, so reducing it is priced at what it costs beyond the cheapest reduction,
    a reduce_scatter: 0 to a shard, the second half of an all_reduce to replicate."""
    if have == want or have.kind == "replicate":
        return 0.0
    share = (n - 1) / n
    if have.kind == "partial":
        return 0.0 if want.kind == "shard" else share * nbytes
    if want.kind == "shard":
        return share * nbytes
    return (n - 1) * nbytes  # all_gather: every other rank's piece comes in


# --- lowering ----------------------------------------------------------------------------

Namer = Callable[[str], str]


class Lowering:
    """Emits the local ops of redistributions for the rank at coordinates `at`."""

    def __init__(self, e: Emitter, mesh: Mesh, at: Sequence[int], fresh: Namer):
        self.e, self.mesh, self.at, self.fresh = e, mesh, at, fresh

    def _op(self, opname: str, x: Value, base: str, sharding: Sharding | None = None, **attrs) -> Value:
        v = self.e(opname, x, **attrs)
        v.name, v.sharding = self.fresh(base), sharding
        return v

    def full(self, value, t: TensorType, base: str, sharding: Sharding | None = None) -> Value:
        v = self.e("full", type=t, value=value)
        v.name, v.sharding = self.fresh(base), sharding
        return v

    def pad(self, x: Value, high: dict[int, object], base: str) -> Value:
        """x with dim d grown to high[d] (zeros at the end)."""
        ups = [0] * x.type.rank
        for d, size in high.items():
            grow = dim_sub(size, x.type.shape[d])
            assert is_static(grow) and grow >= 0, (x.type, d, size)
            ups[d] = grow
        if not any(ups):
            return x
        return self._op("pad", x, base, low=[0] * x.type.rank, high=ups, value=0)

    def crop(self, x: Value, ranges: dict[int, tuple], base: str, sharding: Sharding | None = None) -> Value:
        """x sliced to [start, stop) on each dim of `ranges`; x itself when nothing changes."""
        start = [0] * x.type.rank
        stop = list(x.type.shape)
        for d, (lo, hi) in ranges.items():
            start[d], stop[d] = lo, hi
        if start == [0] * x.type.rank and stop == list(x.type.shape):
            if x.sharding is None:  # an intermediate of this lowering: label it
                x.sharding = sharding
            return x
        return self._op("slice", x, base, sharding, start=start, stop=stop, step=[1] * x.type.rank)

    def run(self, x: Value, t: TensorType, steps: Sequence[Step]) -> Value:
        """The local value after `steps`, from the local value x (global type t)."""
        base = x.name or "v"
        for s in steps:
            x = self.step(x, t, s, base)
        return x

    def step(self, x: Value, t: TensorType, s: Step, base: str) -> Value:
        mesh = self.mesh
        axes = tuple(b for b in s.axes if mesh.axes[b][1] > 1)
        if not axes:  # an axis of size 1: every placement on it is the whole value
            return x
        a = axes[0]
        n, c = mesh.axes[a][1], self.at[a]
        have, want = s.before.placements[a], s.after.placements[a]
        group = dict(mesh=mesh.name, axes=[mesh.axes[b][0] for b in axes])
        if s.kind == "all_reduce":
            return self._op("all_reduce", x, f"{base}.{have.arg}", s.after, op=have.arg, **group)
        if s.kind == "all_gather":
            d = have.arg
            size, k = t.shape[d], block(t.shape[d], n)
            x = self.pad(x, {d: k}, f"{base}.pad")
            y = self._op("all_gather", x, f"{base}.gathered", None, dim=d, **group)
            return self.crop(y, {d: (0, size)}, f"{base}.whole", s.after)
        if s.kind == "reduce_scatter":
            d = want.arg
            k = block(t.shape[d], n)
            lo, hi = chunk(t.shape[d], n, c)
            x = self.pad(x, {d: dim_mul(k, n)}, f"{base}.pad")
            y = self._op("reduce_scatter", x, f"{base}.scattered", None, dim=d, op=have.arg, **group)
            return self.crop(y, {d: (0, dim_sub(hi, lo))}, f"{base}.chunk", s.after)
        if s.kind == "all_to_all":
            i, j = have.arg, want.arg
            ki, kj = block(t.shape[i], n), block(t.shape[j], n)
            lo, hi = chunk(t.shape[j], n, c)
            x = self.pad(x, {i: ki, j: dim_mul(kj, n)}, f"{base}.pad")
            y = self._op("all_to_all", x, f"{base}.exchanged", None, split_dim=j, concat_dim=i, **group)
            return self.crop(y, {i: (0, t.shape[i]), j: (0, dim_sub(hi, lo))}, f"{base}.chunk", s.after)
        if s.kind == "slice":
            d = want.arg
            return self.crop(x, {d: chunk(t.shape[d], n, c)}, f"{base}.chunk", s.after)
        assert s.kind == "to_partial", s
        if c == 0 or want.arg not in PARTIAL_IDENTITY:
            return x
        return self.full(PARTIAL_IDENTITY[want.arg], x.type, f"{base}.zero" if want.arg == "sum" else f"{base}.one", s.after)
