"""Where the pieces of a sharded tensor live: spec 2.7's chunking, the same as torch
DTensor's `Shard`. A dim of size `D` split `n` ways gives chunk `i` the indices
`[i*k, min((i+1)*k, D))` with `k = ceil(D/n)`, so the first chunks are full and the last ones
smaller, possibly empty (D = 5 over 4 ranks: 2, 2, 1, 0). A symbolic dim splits only exactly
(`2*B` over 2 is `B` each). A mesh rank's coordinates are row-major (spec 2.6).

The compiler's partitioner, the runtime, the store and `dtm.parallel` all place pieces by
these three functions.
"""

from __future__ import annotations

from .symbolic import Dim, dim_div_exact, dim_mul, format_dim, is_static
from .types import Mesh


def coords(mesh: Mesh, rank: int) -> tuple[int, ...]:
    """The coordinates of mesh rank `rank`, one per axis (row-major, spec 2.6)."""
    out = []
    for _, size in reversed(mesh.axes):
        out.append(rank % size)
        rank //= size
    return tuple(reversed(out))


def block(size: Dim, n: int) -> Dim | None:
    """k, the size of a full chunk of a dim of `size` split n ways; None for a symbolic
    dim that does not split exactly."""
    if is_static(size):
        return -(-size // n)
    return dim_div_exact(size, n)


def chunk(size: Dim, n: int, i: int) -> tuple[Dim, Dim]:
    """[start, stop) of chunk i of a dim of `size` split n ways."""
    k = block(size, n)
    assert k is not None, f"{format_dim(size)} does not split {n} ways"
    if is_static(size):
        return min(i * k, size), min((i + 1) * k, size)
    return dim_mul(i, k), dim_mul(i + 1, k)


__all__ = ["block", "chunk", "coords"]
