"""Distributed tensors: the global view (docs/architecture.md, "Two views").

    x = dtm.distribute(dtm.randn(8, 4), mesh, [dtm.Shard(0)])   # each device holds 4 rows
    y = (x @ w).relu()            # every Tensor op; lazy, as always
    y.placements                  # (Shard(0),): what propagation gives y
    y.redistribute([dtm.Replicate()]).local_shards()[1]         # rank 1's piece, whole
    y.full_tensor()               # a plain tensor

A distributed tensor is a Tensor whose value is a `Shards` (one piece per mesh rank) or whose
inputs are distributed; the Tensor itself records its mesh and placements and has the
methods above (dtm/tensor.py). Ops record as usual; realize captures one global-view IR
function whose parameters carry their shardings (and whose values carry the layouts the
user pinned with redistribute), and the runtime partitions it into one local-view function
per rank (dtm.compiler.spmd) and runs those on the mesh's devices (dtm.runtime.execute).
Each result keeps its per-rank pieces, laid out as propagation placed it. Gradients come
the same way: backward differentiates the global-view function, and each gradient is
brought to its leaf's placements before it is partitioned. Plain tensors mixed in are
replicated.

This file holds what makes a tensor distributed: `distribute`, and `place`, which DDP,
tensor_parallel and fsdp are made of.
"""

from __future__ import annotations

from typing import Any

from ..errors import ErrorCode as E
from ..ir.types import Replicate
from ..tensor import Tensor, apply, error, no_grad, tensor as as_tensor
from .mesh import Mesh


def distribute(t: Any, mesh: Mesh, placements: Any) -> Tensor:
    """`t` laid out over `mesh` by `placements` (one per mesh axis, a {axis: placement}
    dict, or one placement on a 1-D mesh). A leaf stays a leaf (it gets `.grad`, with these
    placements); a tensor with gradient history keeps it."""
    t = t if isinstance(t, Tensor) else as_tensor(t)
    if not isinstance(mesh, Mesh):
        raise error(E.INVALID_MESH, f"distribute: expected a dtm.Mesh, found {type(mesh).__name__}")
    pl = mesh.placements(placements, t._type, f"distribute({t._describe()})")
    if t._mesh is not None:
        if t._mesh != mesh:
            raise error(E.MESH_MISMATCH, f"distribute({t._describe()}, {mesh}, {list(pl)}): the tensor is already on "
                        f"{t._mesh}; full_tensor() it first to move it to another mesh")
        return t.redistribute(pl)
    if (t.requires_grad and t._op is not None) or t._buffer is None:
        # keep the history (or a dtm.jit placeholder's place): the program slices it on each device
        out = apply("reshape", t, shape=t.shape)
        out._mesh, out._placements = mesh, pl
        return out
    return Tensor(t._type, buffer=mesh.split(t.numpy(), pl), requires_grad=t.requires_grad)


def place(p: Tensor, mesh: Mesh, spec: dict, what: str) -> None:
    """Give tensor p (a parameter: changed in place, so modules and optimizers keep it) the
    placements `spec` ({axis: placement}); its other axes keep theirs (a plain tensor's:
    replicated). DDP, tensor_parallel and fsdp are made of this."""
    if p._mesh is not None and p._mesh != mesh:
        raise error(E.MESH_MISMATCH, f"{what} ({p._describe()}) is on {p._mesh}, not on {mesh}")
    current = p.placements if p._mesh is not None else (Replicate(),) * mesh.ndim
    merged = mesh.placements({**dict(zip(mesh.axis_names, current)), **spec}, p._type, what)
    if p._mesh is None:
        value = mesh.split(p.numpy(), merged)
    elif merged != current:
        with no_grad():
            value = p.redistribute(merged).realize()._buffer
    else:
        return
    p._set_value(value)
    p.grad = None


__all__ = ["distribute", "place"]
