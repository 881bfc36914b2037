"""Collectives and point-to-point transfers on tensors: one function each, whichever name
reaches it (`dtm.all_reduce`, `dtm.distributed.all_reduce` and `dtm.parallel.all_reduce`
are the same function). Arguments follow torch.distributed's order: the tensor, then the
reduce op, then the dims; `axis` names mesh axes (a name or several): the collective runs
within the ranks that differ only along them; None means every rank.

    def f(x, w):                                        # inside dtm.shard_map: recorded
        return dtm.all_reduce(x @ w, op="sum", axis="tp")
    dtm.init()                                          # between processes: run at once
    g = dtm.all_reduce(grad, op="avg", axis="dp")
    dtm.shutdown()

- Inside a function given to dtm.shard_map they record the IR collective (spec 3.11) over
  the named axes of that shard_map's mesh; it runs when the shard_map runs, on its devices.
- Elsewhere, after `dtm.init()`, they run between the processes of the mesh, on a dtm.Tensor
  (or a numpy array), returning the same kind, through `dtm.runtime.process_group` and from
  there `dtm.comm`. `src` of broadcast is a position within the group (a rank, when `axis`
  is None); `dst` and `src` of send and recv are ranks (those run between processes only).
  A collective that fails because a peer died or hung raises `PeerLost` (E1001) naming it.
- Anywhere else they are an error (NOT_INITIALIZED) that says both ways.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import ErrorCode as E
from .ir.dtypes import numpy_dtype
from .ir.types import Mesh as IRMesh
from .runtime.process_group import Axis, current, is_initialized
from .tensor import STATE, Tensor, apply, as_dtype, error, normalize_dim, tensor as as_tensor


def _traced_mesh() -> IRMesh | None:
    """The mesh of the shard_map whose function is being traced on this thread, if any."""
    return next(iter(STATE.meshes.values()), None)


def _axes(mesh: IRMesh, axis: Axis, name: str) -> list[str]:
    names = [a for a, _ in mesh.axes]
    axes = names if axis is None else [axis] if isinstance(axis, str) else list(axis)
    unknown = [a for a in axes if a not in names]
    if unknown or not axes or len(set(axes)) != len(axes):
        raise error(E.UNKNOWN_MESH_AXIS if unknown else E.INVALID_GROUP,
                    f"dtm.{name}: axis={axis!r}, but the shard_map's {mesh} has axes {names}; "
                    "name one or more of them, each once")
    return axes


def _collective(name: str, x: Any, axis: Axis, **attrs: Any) -> Any:
    """Record collective `name` in the shard_map being traced, or run it between processes."""
    mesh = _traced_mesh()
    if mesh is not None:
        x = x if isinstance(x, Tensor) else as_tensor(x)
        for k in ("dim", "split_dim", "concat_dim"):  # torch-style dims: negative counts from the end
            if k in attrs:
                attrs[k] = normalize_dim(attrs[k], x.ndim)
        return apply(name, x, mesh=mesh.name, axes=_axes(mesh, axis, name), **attrs)
    pg = _process_group(name)
    result = getattr(pg, name)(_array(x), **attrs, axis=axis)
    return Tensor.from_numpy(result) if isinstance(x, Tensor) else result


def _process_group(name: str):
    if not is_initialized():
        raise error(E.NOT_INITIALIZED, f"dtm.{name} outside dtm.shard_map: call it inside a function given to "
                    "dtm.shard_map (the local view of a mesh of devices), or after dtm.init() in a program that "
                    "runs as several processes")
    return current()


def _array(x: Any) -> np.ndarray:
    return x.numpy() if isinstance(x, Tensor) else np.asarray(x)


def all_reduce(x: Any, op: str = "sum", axis: Axis = None, compress: str | None = None) -> Any:
    """Every rank of the group gets the elementwise `op` (sum, prod, max, min, avg) of all
    ranks' `x`. Between processes, `compress="q8_0"` or `"bf16"` sends the chunks
    compressed (sum and avg of floats; every member must announce CAP_QUANT, else E1006),
    `"auto"` compresses (q8_0) when every member can and sends uncompressed otherwise;
    the error bound is spec 9.5.1's."""
    return _collective("all_reduce", x, axis, op=op, **_compress_kw(compress))


def all_gather(x: Any, dim: int = 0, axis: Axis = None, compress: str | None = None) -> Any:
    """Every rank gets the group's `x` joined along `dim`, in group order (`compress`: as
    for all_reduce, each block rounded once)."""
    return _collective("all_gather", x, axis, dim=dim, **_compress_kw(compress))


def reduce_scatter(x: Any, op: str = "sum", dim: int = 0, axis: Axis = None, compress: str | None = None) -> Any:
    """The reduction of the group's `x`, split along `dim`: group member i gets block i
    (`compress`: as for all_reduce)."""
    return _collective("reduce_scatter", x, axis, op=op, dim=dim, **_compress_kw(compress))


def _compress_kw(compress: str | None) -> dict:
    if compress is None:
        return {}
    if _traced_mesh() is not None:
        raise error(E.ATTRIBUTE_VALUE, "compress= applies to collectives between processes (after dtm.init()), "
                    "not to those recorded inside dtm.shard_map")
    return {"compress": compress}


def broadcast(x: Any, src: int = 0, axis: Axis = None) -> Any:
    """Every rank of the group gets member `src`'s `x` (the others pass a tensor of its type)."""
    return _collective("broadcast", x, axis, src=src)


def all_to_all(x: Any, split_dim: int = 0, concat_dim: int = 0, axis: Axis = None) -> Any:
    """Block j of `x` along `split_dim` goes to group member j; the blocks received join
    along `concat_dim` in sender order."""
    return _collective("all_to_all", x, axis, split_dim=split_dim, concat_dim=concat_dim)


def barrier(axis: Axis = None) -> None:
    """Returns once every member has called it (between processes)."""
    _process_group("barrier").barrier(axis)


def send(x: Any, dst: int) -> None:
    """Send `x` to rank `dst`. Returns once its bytes are in flight, without waiting for the
    matching `recv`; a tensor larger than the transport's buffers waits until rank `dst`'s
    process (inside any DTM call) reads it, as torch.distributed's `send` does."""
    _process_group("send").send(_array(x), dst)


def recv(src: int, *, dtype: Any = None, shape: Sequence[int] | None = None) -> Tensor:
    """The oldest tensor rank `src` sent to this rank, as a Tensor; `dtype` and `shape`, when
    given, are checked against what was sent (E0402, E0403)."""
    dtype = numpy_dtype(as_dtype(dtype)) if dtype is not None else None
    return Tensor.from_numpy(_process_group("recv").recv(src, dtype=dtype, shape=shape))


__all__ = ["is_initialized", "all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "barrier",
           "send", "recv"]
