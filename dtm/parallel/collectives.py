"""The explicit collectives of the local view: dtm.all_reduce, all_gather, reduce_scatter,
all_to_all and broadcast (spec 3.11). Each returns its result.

Inside a function given to dtm.shard_map they record the IR collective over the named axes
of that shard_map's mesh (`axis`: one name, several, or None for every axis). Outside one,
in a multi-process program (`dtm.init()`), they hand the call to `dtm.distributed`, which
runs it between processes; anywhere else they are an error.
"""

from __future__ import annotations

from typing import Sequence

from .. import distributed
from ..errors import ErrorCode as E
from ..tensor import Tensor, apply, error, normalize_dim, tensor as as_tensor
from .mesh import IR_NAME, Mesh
from .shard_map import current_mesh


def _axes(mesh: Mesh, axis: str | Sequence[str] | None, name: str) -> list[str]:
    axes = list(mesh.axis_names) if axis is None else [axis] if isinstance(axis, str) else list(axis)
    unknown = [a for a in axes if a not in mesh.shape]
    if unknown or not axes or len(set(axes)) != len(axes):
        raise error(E.UNKNOWN_MESH_AXIS if unknown else E.INVALID_GROUP,
                    f"dtm.{name}: axis={axis!r}, but the shard_map's {mesh} has axes {list(mesh.axis_names)}; "
                    "name one or more of them, each once")
    return axes


def _process_level(name: str, *args, **kwargs):
    """The same collective between processes, when dtm.init() has formed a process group."""
    if distributed.is_initialized():
        return getattr(distributed, name)(*args, **kwargs)
    raise error(E.NOT_INITIALIZED, f"dtm.{name} outside dtm.shard_map: call it inside a function given to "
                "dtm.shard_map (the local view of a mesh of devices), or after dtm.init() in a program that "
                "runs as several processes")


def _record(name: str, x, axis, **attrs) -> Tensor:
    mesh = current_mesh()
    x = x if isinstance(x, Tensor) else as_tensor(x)
    for k in ("dim", "split_dim", "concat_dim"):  # torch-style dims: negative counts from the end
        if k in attrs:
            attrs[k] = normalize_dim(attrs[k], x.ndim)
    return apply(name, x, mesh=IR_NAME, axes=_axes(mesh, axis, name), **attrs)


def all_reduce(x, op: str = "sum", axis: str | Sequence[str] | None = None):
    """Every rank of the group gets the reduction (sum, prod, max, min, avg) of their x."""
    if current_mesh() is None:
        return _process_level("all_reduce", x, op=op, axis=axis)
    return _record("all_reduce", x, axis, op=op)


def all_gather(x, dim: int = 0, axis: str | Sequence[str] | None = None):
    """Every rank gets the group's x joined along `dim`, in group-rank order."""
    if current_mesh() is None:
        return _process_level("all_gather", x, dim=dim, axis=axis)
    return _record("all_gather", x, axis, dim=dim)


def reduce_scatter(x, dim: int = 0, op: str = "sum", axis: str | Sequence[str] | None = None):
    """The reduction of the group's x, split along `dim`: group rank i gets block i."""
    if current_mesh() is None:
        return _process_level("reduce_scatter", x, dim=dim, op=op, axis=axis)
    return _record("reduce_scatter", x, axis, dim=dim, op=op)


def all_to_all(x, split_dim: int, concat_dim: int, axis: str | Sequence[str] | None = None):
    """Block j of x (split along split_dim) goes to group rank j; received blocks join along
    concat_dim in sender order."""
    if current_mesh() is None:
        return _process_level("all_to_all", x, split_dim=split_dim, concat_dim=concat_dim, axis=axis)
    return _record("all_to_all", x, axis, split_dim=split_dim, concat_dim=concat_dim)


def broadcast(x, src: int = 0, axis: str | Sequence[str] | None = None):
    """Every rank of the group gets group rank src's x."""
    if current_mesh() is None:
        return _process_level("broadcast", x, src=src, axis=axis)
    return _record("broadcast", x, axis, src=src)


__all__ = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"]
