"""The reference semantics of the collectives and point-to-point ops (spec 3.11, 3.12).

`result(name, attrs, xs, index)` is what collective `name` gives group member `index` when
the members' operands are `xs`, in group order: the one statement of each collective's
meaning. The ops registered here hand the call to the context's device group
(`RefContext.comm.collective`), which gathers the operands however it can: threads of one
process meeting on shared buffers (`LocalGroup`, and L0's `DeviceGroup`, which reads the
same operands with a ring for large reductions), or processes over dtm.comm (L1). A group
of one needs no device group: its result is computed here.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..errors import DTMError, ErrorCode as E
from ..ir.registry import COLLECTIVES
from .context import RefContext
from .ops import expect_value, register
from .reduction import reduce_in_order


def result(name: str, attrs: dict[str, Any], xs: Sequence[np.ndarray], index: int) -> np.ndarray | None:
    """Group member `index`'s result of collective `name`, from every member's operand `xs`
    in group order (a new array: it shares no memory with any operand; None for barrier)."""
    n = len(xs)
    if name == "all_reduce":
        return reduce_in_order(xs, attrs["op"])
    if name == "reduce_scatter":  # block `index` of the reduction: only that block is reduced
        return reduce_in_order([np.split(x, n, axis=attrs["dim"])[index] for x in xs], attrs["op"])
    if name == "all_gather":
        return np.concatenate(xs, axis=attrs["dim"])
    if name == "all_to_all":  # source j's block `index` comes here; blocks join in source order
        return np.concatenate([np.split(x, n, axis=attrs["split_dim"])[index] for x in xs], axis=attrs["concat_dim"])
    if name == "broadcast":
        return xs[attrs["src"]].copy()
    assert name == "barrier", name
    return None


def describe(name: str, attrs: dict[str, Any], x: np.ndarray) -> str:
    """One collective call as its members compare it, e.g. "reduce_scatter(sum, dim=1)
    float32[4, 8]": members whose calls differ raise COLLECTIVE_MISMATCH."""
    return f"{name}({call_args(attrs)}) {x.dtype}{list(x.shape)}"


def call_args(attrs: dict[str, Any]) -> str:
    """A collective's arguments as errors and heartbeats name them: the reduce op first and
    bare, then the others as name=value ("sum, dim=1"); the group (mesh, axes) left out."""
    params = sorted(((k, v) for k, v in attrs.items() if k not in ("mesh", "axes")), key=lambda kv: kv[0] != "op")
    return ", ".join(str(v) if k == "op" else f"{k}={v}" for k, v in params)


def _no_group(name: str, attrs: dict[str, Any], members: Sequence[int]) -> DTMError:
    return DTMError(E.INVALID_GROUP, f"{name}: a group of {len(members)} ranks over {list(attrs['axes'])} of "
                    f"@{attrs['mesh']} needs a device group (RefContext.comm), and this context has none")


def _collective(ctx: RefContext, name: str, attrs: dict[str, Any], x: np.ndarray) -> np.ndarray | None:
    members, index = ctx.group(attrs["mesh"], attrs["axes"])
    if len(members) == 1:
        return result(name, attrs, [x], 0)
    if ctx.comm is None:
        raise _no_group(name, attrs, members)
    return ctx.comm.collective(name, attrs, x, members, index, ctx.rank, ctx.timeout)


def collective_into(ctx: RefContext, name: str, attrs: dict[str, Any], x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Collective `name` (all_reduce) with its result written into `out`, which it returns,
    by a context whose comm takes `out` (`takes_out`: between processes); over a group of
    one, a result of its own."""
    members, index = ctx.group(attrs["mesh"], attrs["axes"])
    if len(members) == 1:
        return _collective(ctx, name, attrs, x)
    return ctx.comm.collective(name, attrs, x, members, index, ctx.rank, ctx.timeout, out=out)


def _register(name: str) -> None:
    @register(name)
    def impl(ctx, attrs, *operand, out_types):
        y = _collective(ctx, name, attrs, operand[0] if operand else np.zeros(0, np.uint8))
        return () if y is None else (y,)


for _name in COLLECTIVES:
    _register(_name)


def _peer(ctx: RefContext, name: str, attrs: dict[str, Any], peer: str) -> int:
    """The global rank of group rank attrs[peer]."""
    members, _ = ctx.group(attrs["mesh"], attrs["axes"])
    if ctx.comm is None and len(members) > 1:
        raise _no_group(name, attrs, members)
    return members[attrs[peer]]


@register("send")
def _send(ctx, attrs, x, *, out_types):
    """Buffered: returns once x is queued for the peer, without waiting for its recv."""
    dst = _peer(ctx, "send", attrs, "dst")
    ctx.p2p().send(ctx.rank, dst, x, ctx.timeout)
    return ()


@register("recv")
def _recv(ctx, attrs, *, out_types):
    """The oldest tensor the peer sent to this rank (FIFO per ordered pair of ranks)."""
    src = _peer(ctx, "recv", attrs, "src")
    x = ctx.p2p().recv(src, ctx.rank, ctx.timeout)
    expect_value(x, out_types[0], f"recv from rank {src}")
    return (x,)


__all__ = ["result", "describe", "call_args"]
