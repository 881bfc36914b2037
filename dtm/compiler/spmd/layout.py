"""Where the pieces of a sharded tensor live (spec 2.7), and checks that a sharding can be
laid out at all.

Chunking is spec 2.7's rule (`dtm.ir.chunks`: `chunk`, `block`, `coords`): a dim of size
`D` split `n` ways gives chunk `i` the indices `[i*k, min((i+1)*k, D))` with `k = ceil(D/n)`,
so the first chunks are full and the last ones smaller, possibly empty. Collectives need equal pieces on every rank, so the partitioner pads a piece
to `k` before `all_gather` / `all_to_all` and slices the padding off after; because only
the tail chunks are short, the gathered, padded blocks sit at their global offsets and one
slice `[0, D)` recovers the dim. A symbolic dim may be sharded only when the split is exact
(`2*B` over 2 is `B` each); `B` over 2 has no chunk size the IR can write.

Each tensor dim is sharded by at most one mesh axis (E0503), so a rank's piece is, dim by
dim, one chunk (or the whole dim); `partial` axes do not change the piece's shape.

`split_array` and `assemble` are the host side of the same convention: the piece of a global
numpy array a rank holds, and the global array from every rank's piece.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ...errors import DTMError, ErrorCode as E
from ...ir.module import Func, Module
from ...ir.chunks import block, chunk, coords
from ...ir.symbolic import dim_sub, format_dim, is_static
from ...ir.types import REDUCE_OPS, Mesh, Placement, Sharding, TensorType
from ...ref.reduction import reduce_in_order


def shardable(t: TensorType, dim: int, n: int) -> bool:
    """Whether dim `dim` of t can be split n ways: any static dim, a symbolic one exactly;
    the last dim of a quantized tensor only in whole blocks."""
    k = block(t.shape[dim], n)
    if k is None:
        return False
    if t.dtype.is_quant and dim == t.rank - 1:
        return is_static(k) and k % t.dtype.block == 0
    return True


def local_type(t: TensorType, sh: Sharding | None, mesh: Mesh | None, at: Sequence[int]) -> TensorType:
    """The type of the piece held by the device at coordinates `at`."""
    if sh is None:
        return t
    shape = list(t.shape)
    for (_, n), c, p in zip(mesh.axes, at, sh.placements):
        if p.kind == "shard":
            start, stop = chunk(t.shape[p.arg], n, c)
            shape[p.arg] = dim_sub(stop, start)
    return t.with_shape(shape)


def replicated(mesh: Mesh) -> Sharding:
    return Sharding(mesh.name, tuple(Placement("replicate") for _ in mesh.axes))


# --- checks ------------------------------------------------------------------------------

def check_sharding(what: str, t: TensorType, sh: Sharding, meshes: dict[str, Mesh]) -> Mesh:
    """The mesh of `sh`, after checking `sh` places a value of type t; raises DTMError
    naming `what` (the value), the mesh and the placement at fault."""
    mesh = meshes.get(sh.mesh)
    if mesh is None:
        raise DTMError(E.UNDEFINED_MESH, f"{what}: {t} {sh} names mesh @{sh.mesh}, which the module does not "
                       f"declare (it declares: {', '.join('@' + m for m in meshes) or 'none'})")
    where = f"{what}: {t} {sh} on {mesh}"
    if len(sh.placements) != len(mesh.axes):
        raise DTMError(E.PLACEMENT_COUNT, f"{where}: {len(sh.placements)} placement(s) for {len(mesh.axes)} mesh "
                       f"axes {list(mesh.axis_names)}; give one per axis")
    sharded_by: dict[int, str] = {}
    for (axis, n), p in zip(mesh.axes, sh.placements):
        if p.kind == "shard":
            if not isinstance(p.arg, int) or not 0 <= p.arg < t.rank:
                raise DTMError(E.SHARD_DIM_OUT_OF_RANGE, f"{where}: {p} on axis {axis!r} names dim {p.arg}, "
                               f"but the tensor has dims 0..{t.rank - 1}")
            if p.arg in sharded_by:
                raise DTMError(E.DIM_SHARDED_TWICE, f"{where}: dim {p.arg} is sharded by axis {sharded_by[p.arg]!r} "
                               f"and again by axis {axis!r}; shard a dim over one axis")
            if not shardable(t, p.arg, n):
                d = format_dim(t.shape[p.arg])
                if t.dtype.is_quant and is_static(t.shape[p.arg]):
                    raise DTMError(E.QUANTIZED_MISUSE, f"{where}: {p} on axis {axis!r} splits the last dim {d} "
                                   f"into chunks that are not whole {t.dtype} blocks of {t.dtype.block}")
                raise DTMError(E.SHAPE_MISMATCH, f"{where}: {p} on axis {axis!r} splits symbolic dim {d} "
                               f"{n} ways, which needs every coefficient divisible by {n}")
            sharded_by[p.arg] = axis
        elif p.kind == "partial":
            if any(q.kind == "partial" and q.arg != p.arg for q in sh.placements):
                raise DTMError(E.INVALID_PLACEMENT, f"{where}: partial axes with different reduce ops; the order "
                               "of the reductions would be undefined, so a value is partial over one op only")
            if p.arg not in REDUCE_OPS:
                raise DTMError(E.INVALID_PLACEMENT, f"{where}: {p} on axis {axis!r}; partial takes one of "
                               f"{', '.join(REDUCE_OPS)}")
            if not t.dtype.is_numeric:
                raise DTMError(E.INVALID_PLACEMENT, f"{where}: {p} on axis {axis!r}, but {t.dtype} values "
                               "cannot be reduced; only numeric tensors can be partial")
        elif p.kind != "replicate":
            raise DTMError(E.INVALID_PLACEMENT, f"{where}: unknown placement {p} on axis {axis!r}")
    return mesh


def function_mesh(module: Module, f: Func) -> Mesh | None:
    """The one mesh the shardings in `f` name (None when nothing in it is sharded), after
    checking every sharding; values on two meshes in one function are an error (E0508)."""
    found: tuple[str, Mesh] | None = None

    def see(what: str, t: TensorType, sh: Sharding | None) -> None:
        nonlocal found
        if sh is None:
            return
        mesh = check_sharding(what, t, sh, module.meshes)
        if found is None:
            found = (what, mesh)
        elif found[1].name != mesh.name:
            raise DTMError(E.MESH_MISMATCH, f"@{f.name}: {what} is placed on {mesh} ({sh}), but {found[0]} is on "
                           f"{found[1]}; one function runs on one mesh: redistribute onto a single mesh first")

    for i, p in enumerate(f.params):
        see(f"%{p.name} (parameter {i} of @{f.name})", p.type, p.sharding)
    for op in f.ops:
        for r in op.results:
            see(f"%{r.name} (result of {op.name} in @{f.name})", r.type, r.sharding)
    for i, (t, sh) in enumerate(f.result_types):
        see(f"result {i} of @{f.name}", t, sh)
    return None if found is None else found[1]


# --- host arrays -------------------------------------------------------------------------

# What the devices off coordinate 0 of a partial axis hold when a whole value becomes
# partial; for max, min and avg (absent here) every device holds the value itself.
PARTIAL_IDENTITY = {"sum": 0, "prod": 1}


def _index(t_shape: Sequence[int], sh: Sharding, mesh: Mesh, at: Sequence[int]) -> tuple[slice, ...]:
    idx = [slice(None)] * len(t_shape)
    for (_, n), c, p in zip(mesh.axes, at, sh.placements):
        if p.kind == "shard":
            start, stop = chunk(t_shape[p.arg], n, c)
            idx[p.arg] = slice(start, stop)
    return tuple(idx)


def split_array(x: np.ndarray, sh: Sharding, mesh: Mesh, rank: int) -> np.ndarray:
    """The piece of global array x that mesh rank `rank` holds under `sh`. A `partial`
    axis gives the value to coordinate 0 and the reduction's identity to the others (sum:
    0, prod: 1); for max, min and avg every device holds the value."""
    at = coords(mesh, rank)
    piece = np.array(x[_index(x.shape, sh, mesh, at)], copy=True)
    for c, p in zip(at, sh.placements):
        if p.kind == "partial" and c != 0 and p.arg in PARTIAL_IDENTITY:
            piece[...] = PARTIAL_IDENTITY[p.arg]
    return piece


def assemble(pieces: Sequence[np.ndarray], sh: Sharding, mesh: Mesh) -> np.ndarray:
    """The global array from every rank's piece (pieces[r] is mesh rank r's): shards are
    placed at their offsets, the pieces along partial axes reduced as `all_reduce` reduces
    them (in rank order), replicas read from coordinate 0."""
    if len(pieces) != mesh.size:
        raise DTMError(E.INVALID_GROUP, f"assemble: {mesh} has {mesh.size} ranks, found {len(pieces)} pieces")
    ops = {p.arg for p in sh.placements if p.kind == "partial"}
    assert len(ops) <= 1, f"{sh}: partial axes must share one reduce op"
    shape = list(pieces[0].shape)
    for a, ((_, n), p) in enumerate(zip(mesh.axes, sh.placements)):
        if p.kind == "shard":  # the chunks along axis a, at coordinate 0 of every other axis
            shape[p.arg] = sum(pieces[_rank(mesh, [c if b == a else 0 for b in range(len(mesh.axes))])].shape[p.arg]
                               for c in range(n))
    groups: dict[tuple[int, ...], list[np.ndarray]] = {}
    for r in range(mesh.size):
        at = coords(mesh, r)
        if all(c == 0 for c, p in zip(at, sh.placements) if p.kind == "replicate"):
            key = tuple(c if p.kind == "shard" else 0 for c, p in zip(at, sh.placements))
            groups.setdefault(key, []).append(pieces[r])
    out = np.empty(shape, pieces[0].dtype)
    for at, values in groups.items():
        value = reduce_in_order(values, next(iter(ops))) if ops else values[0]
        out[_index(shape, sh, mesh, at)] = np.asarray(value).astype(out.dtype, copy=False)
    return out


def _rank(mesh: Mesh, at: Sequence[int]) -> int:
    r = 0
    for (_, size), c in zip(mesh.axes, at):
        r = r * size + c
    return r
