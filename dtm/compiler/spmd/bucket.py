"""Gradient bucketing: a local-view pass that merges all_reduces into one all_reduce per flat
buffer of up to `cap_bytes`: fewer, larger collectives, as torch's DDP does
(`bucket_cap_mb`). It merges the all_reduces of one group, op and dtype (each under
SOLO_BYTES), in program order, whose results no op uses before the last of them: a
data-parallel step's gradients, whether they are returned (an eager backward) or read by
the optimizer's updates after the backward pass (a whole training step under dtm.jit: 52
all_reduces of the char model's gradients became one).

    local = bucket_all_reduces(local_module(module, "step", rank=0), "step", 25 << 20)

Every rank of a group has the same local types for such values (they are partial, not
sharded, along the group's axes), so every member merges alike, and the collectives of
every group keep one order on every rank. The merged all_reduce sits where its last member
was: no overlap is attempted (L0's devices reduce with their own cores, so there is no idle
link to overlap with).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...ir.dtypes import DTYPES
from ...ir.module import Func, Module, Op
from ...ir.registry import REGISTRY, Category
from ...ir.types import TensorType
from ..irutil import Emitter, verify_pass, with_func


# An all_reduce of at least this many bytes is not merged: its own call costs a few tens of
# microseconds, while copying it into a bucket costs a read and a write of every byte (a
# GPT-2 step's 496 MB of gradients: 64 ms of copies a step on 2 ranks, against under 10 ms
# of calls for its 50 large ones).
SOLO_BYTES = 1 << 20


def bucket_all_reduces(module: Module, func: str, cap_bytes: int) -> Module:
    """`module` with @func's all_reduces merged per (group, op, dtype) into flat buffers of
    at most `cap_bytes` (a lone one, or one larger than the cap, stays as is).

    One pass in program order. An all_reduce joins the open bucket of its key; the ops that
    read a member's result, and the ops that read theirs, are held back (keeping their
    order) until the bucket is emitted, which is when: the next member would pass the cap;
    a collective reads a held value; an op with an effect that is not a collective (an
    assign, a check, a send) comes, since those keep their order; or the function ends.
    Collectives move past one another only, alike on every rank, so each group's members
    still meet its collectives in one order."""
    f = module.funcs[func]
    out_ops: list[Op] = []
    e = Emitter(out_ops, module, prefix="grad_bucket")
    open_: dict[tuple, _Bucket] = {}      # by key
    waits_for: dict[int, set[int]] = {}    # a value's id -> the serials of the open buckets it waits for
    held: list[Op] = []                    # in program order
    merged = False

    def waits(op: Op) -> set[int]:
        live = {b.serial for b in open_.values()}
        return {s for v in op.operands for s in waits_for.get(id(v), ()) if s in live}

    def close(serials: set[int]) -> None:
        """Emit the open buckets `serials` (in the order of their first members), then
        every held op that waits for no open bucket any more."""
        nonlocal merged
        for b in sorted((b for b in open_.values() if b.serial in serials), key=lambda b: b.serial):
            del open_[b.key]
            if len(b.ops) > 1:
                _emit_bucket(e, b.ops)
                merged = True
            else:
                out_ops.append(b.ops[0])
        still = []
        for op in held:
            ws = waits(op)
            (still.append if ws else out_ops.append)(op)
            for r in op.results:
                waits_for[id(r)] = ws
        held[:] = still

    for i, op in enumerate(f.ops):
        key = _key(op)
        if key is not None:
            while ws := waits(op):  # (it reads held values: their buckets go first)
                close(ws)
            b = open_.get(key)
            if b is not None and b.bytes + _nbytes(op) > cap_bytes:
                close({b.serial})
            b = open_.setdefault(key, _Bucket(key, i, [], 0))
            b.ops.append(op)
            b.bytes += _nbytes(op)
            waits_for[id(op.results[0])] = {b.serial}
        elif REGISTRY[op.name].category is Category.COLLECTIVE:
            while ws := waits(op):  # (the group's other collectives pass the open buckets)
                close(ws)
            out_ops.append(op)
        elif REGISTRY[op.name].effect:
            close({b.serial for b in open_.values()})
            out_ops.append(op)
        elif ws := waits(op):
            held.append(op)
            for r in op.results:
                waits_for[id(r)] = ws
        else:
            out_ops.append(op)
    close({b.serial for b in open_.values()})
    if not merged:
        return module
    g = Func(f.name, list(f.params), list(f.result_types), out_ops, list(f.returns), f.loc, f.return_loc)
    out = with_func(module, g)
    verify_pass(out)
    return out


@dataclass
class _Bucket:
    """An open bucket: its key, a serial (the position of its first member), its
    all_reduces in program order, and their bytes."""

    key: tuple
    serial: int
    ops: list[Op]
    bytes: int


def _key(op: Op) -> tuple | None:
    """The bucket key of an all_reduce that can merge (its group, op and dtype), else None:
    one of SOLO_BYTES or more stays alone."""
    if op.name != "all_reduce" or not op.operands[0].type.is_static or _nbytes(op) >= SOLO_BYTES:
        return None
    return (op.attrs["mesh"], tuple(op.attrs["axes"]), op.attrs["op"], op.operands[0].type.dtype.name)


def _nbytes(op: Op) -> int:
    """The bytes of an all_reduce's operand."""
    x = op.operands[0].type
    return int(np.prod(x.shape, dtype=np.int64)) * x.dtype.bits // 8


def _emit_bucket(e: Emitter, bucket: list[Op]) -> None:
    """One all_reduce of the members' values laid end to end; each member's result is then
    its slice of the reduced buffer, reshaped. The buffer is zeros with each member written
    at its offset by a dynamic_update_slice: a move step that copies the member's bytes into
    the buffer in place (a concat of the members lowers to one loop that selects among all
    of them at every element: 52 gradients took 14 ms a step)."""
    flats = [e("reshape", op.operands[0], shape=[int(np.prod(op.operands[0].type.shape, dtype=np.int64))])
             for op in bucket]
    dtype = bucket[0].operands[0].type.dtype
    size = sum(flat.type.shape[0] for flat in flats)
    buffer = e("full", type=TensorType(dtype, (size,)), value=0)
    start = 0
    for flat in flats:
        at = e("constant", type=TensorType(DTYPES["i64"], ()), value=start)
        buffer = e("dynamic_update_slice", buffer, flat, at, axis=0)
        start += flat.type.shape[0]
    a = bucket[0].attrs
    total = e("all_reduce", buffer, mesh=a["mesh"], axes=list(a["axes"]), op=a["op"])
    start = 0
    for op, flat in zip(bucket, flats):
        n = flat.type.shape[0]
        piece = e("slice", total, start=[start], stop=[start + n], step=[1])
        e("reshape", piece, shape=list(op.results[0].type.shape), result=op.results[0])
        start += n


__all__ = ["bucket_all_reduces"]
