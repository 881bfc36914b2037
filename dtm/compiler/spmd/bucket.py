"""Gradient bucketing: a local-view pass that merges the all_reduces whose results are only
returned (as a data-parallel step's gradients are) into one all_reduce per flat buffer of up
to `cap_bytes`: fewer, larger collectives, as torch's DDP does (`bucket_cap_mb`).

    local = bucket_all_reduces(local_module(module, "step", rank=0), "step", 25 << 20)

Every rank of a group has the same local types for such values (they are partial, not
sharded, along the group's axes), so every member merges alike. The merged all_reduce sits
where its last member was: no overlap is attempted (L0's devices reduce with their own
cores, so there is no idle link to overlap with).
"""

from __future__ import annotations

import numpy as np

from ...ir.module import Func, Module, Op
from ...ir.verifier import verify
from ..irutil import Emitter, with_func


def bucket_all_reduces(module: Module, func: str, cap_bytes: int) -> Module:
    """`module` with @func's returned-only all_reduces merged per (group, op, dtype) into
    flat buffers of at most `cap_bytes` (a lone one, or one larger than the cap, stays as is)."""
    f = module.funcs[func]
    merged = [b for b in _buckets(f, cap_bytes) if len(b) > 1]
    if not merged:
        return module
    ends = {id(b[-1]): b for b in merged}
    deferred = {id(op) for b in merged for op in b}
    ops: list[Op] = []
    e = Emitter(ops, module, prefix="grad_bucket")
    for op in f.ops:
        if id(op) in ends:
            _emit_bucket(e, ends[id(op)])
        elif id(op) not in deferred:
            ops.append(op)
    g = Func(f.name, list(f.params), list(f.result_types), ops, list(f.returns), f.loc, f.return_loc)
    out = with_func(module, g)
    verify(out)
    return out


def _buckets(f: Func, cap_bytes: int) -> list[list[Op]]:
    """The returned-only all_reduces of f, grouped in program order per (group, op, dtype)
    into runs of at most `cap_bytes`."""
    used = {id(v) for op in f.ops for v in op.operands}
    returned = {id(v) for v in f.returns}
    buckets: list[list[Op]] = []
    open_: dict[tuple, tuple[list[Op], int]] = {}
    for op in f.ops:
        if op.name != "all_reduce":
            continue
        x, r = op.operands[0], op.results[0]
        if id(r) in used or id(r) not in returned or not x.type.is_static:
            continue
        nbytes = int(np.prod(x.type.shape, dtype=np.int64)) * x.type.dtype.bits // 8
        key = (op.attrs["mesh"], tuple(op.attrs["axes"]), op.attrs["op"], x.type.dtype.name)
        ops, size = open_.get(key, (None, 0))
        if ops is None or size + nbytes > cap_bytes:
            ops, size = [], 0
            buckets.append(ops)
        ops.append(op)
        open_[key] = (ops, size + nbytes)
    return buckets


def _emit_bucket(e: Emitter, bucket: list[Op]) -> None:
    """One all_reduce of the members' values laid end to end; each member's result is then
    its slice of the reduced buffer, reshaped."""
    flats = [e("reshape", op.operands[0], shape=[int(np.prod(op.operands[0].type.shape, dtype=np.int64))])
             for op in bucket]
    a = bucket[0].attrs
    total = e("all_reduce", e("concat", *flats, axis=0), mesh=a["mesh"], axes=list(a["axes"]), op=a["op"])
    start = 0
    for op, flat in zip(bucket, flats):
        n = flat.type.shape[0]
        piece = e("slice", total, start=[start], stop=[start + n], step=[1])
        e("reshape", piece, shape=list(op.results[0].type.shape), result=op.results[0])
        start += n


__all__ = ["bucket_all_reduces"]
