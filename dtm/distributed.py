"""Collectives and point-to-point transfers between the processes of a mesh, after
`dtm.init()`: each takes a dtm.Tensor (or a numpy array) and returns the result as the same
kind. `axis` names mesh axes (a name or several): the collective runs within the ranks that
differ only along them; None means every rank. `src` and `dst` of broadcast are positions
within that group (ranks, when `axis` is None); those of send and recv are ranks.

    dtm.init()
    g = dtm.distributed.all_reduce(grad, op="avg", axis="dp")
    dtm.shutdown()

They delegate to `dtm.runtime.process_group` (numpy) and from there to `dtm.comm`. A
collective that fails because a peer died or hung raises `PeerLost` (E1001) naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .ir.dtypes import numpy_dtype
from .runtime.process_group import Axis, current, is_initialized
from .tensor import Tensor, as_dtype


def _array(x: Any) -> np.ndarray:
    return x.numpy() if isinstance(x, Tensor) else np.asarray(x)


def _like(x: Any, result: np.ndarray) -> Any:
    return Tensor.from_numpy(result) if isinstance(x, Tensor) else result


def all_reduce(x: Any, op: str = "sum", axis: Axis = None) -> Any:
    """Every rank gets the elementwise `op` (sum, prod, max, min, avg) of all ranks' `x`."""
    return _like(x, current().all_reduce(_array(x), op, axis))


def all_gather(x: Any, dim: int = 0, axis: Axis = None) -> Any:
    """Every rank gets all ranks' `x` joined along `dim`, in group order."""
    return _like(x, current().all_gather(_array(x), dim, axis))


def reduce_scatter(x: Any, op: str = "sum", dim: int = 0, axis: Axis = None) -> Any:
    """The reduction of all ranks' `x`, split along `dim`: group member i gets block i."""
    return _like(x, current().reduce_scatter(_array(x), op, dim, axis))


def broadcast(x: Any, src: int = 0, axis: Axis = None) -> Any:
    """Every rank gets member `src`'s `x` (the others pass a tensor of the same type)."""
    return _like(x, current().broadcast(_array(x), src, axis))


def all_to_all(x: Any, split_dim: int = 0, concat_dim: int = 0, axis: Axis = None) -> Any:
    """Block j of `x` along `split_dim` goes to member j; received blocks join along `concat_dim`."""
    return _like(x, current().all_to_all(_array(x), split_dim, concat_dim, axis))


def barrier(axis: Axis = None) -> None:
    """Returns once every member has called it."""
    current().barrier(axis)


def send(x: Any, dst: int) -> None:
    """Send `x` to rank `dst`. Returns once its bytes are in flight, without waiting for the
    matching `recv`; a tensor larger than the transport's buffers waits until rank `dst`'s
    process (inside any DTM call) reads it, as torch.distributed's `send` does."""
    current().send(_array(x), dst)


def recv(src: int, *, dtype: Any = None, shape: Sequence[int] | None = None) -> Tensor:
    """The oldest tensor rank `src` sent to this rank, as a Tensor; `dtype` and `shape`, when
    given, are checked against what was sent (E0402, E0403)."""
    dtype = numpy_dtype(as_dtype(dtype)) if dtype is not None else None
    return Tensor.from_numpy(current().recv(src, dtype=dtype, shape=shape))


__all__ = ["is_initialized", "all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "barrier", "send", "recv"]
