"""Data parallelism: parameters replicated along an axis, the batch sharded along it.

    model = dtm.parallel.DDP(model, mesh, axis="dp")
    loss = loss_fn(model(x), y); loss.backward(); opt.step()

No engine: DDP only sets shardings. The parameters become Replicate on `axis`; the tensor
arguments of forward become Shard(0) on it. Autograd differentiates the global program,
each gradient comes out partial(sum) over `axis` (every rank saw its own rows) and is
brought to its parameter's Replicate: an all_reduce, which the partitioner writes.

Bucketing: `bucket_all_reduces` (run on every partitioned program) merges all_reduces whose
results are only returned, as gradients are, into one all_reduce per flat buffer of up to
`bucket_cap_mb` MiB: fewer, larger collectives, as torch's DDP does.

Overlap: none on L0. A device thread runs its kernels and then its share of a collective
(the in-process collectives are memory copies and adds done by the device's own core), so
there is no idle link to overlap with; the merged all_reduce sits where its last gradient
is computed. Overlap pays across processes (L1), where a transfer waits on the network.
"""

from __future__ import annotations

import numpy as np

from ..compiler.irutil import Emitter, with_func
from ..errors import ErrorCode as E
from ..ir.module import Func, Module, Op
from ..ir.types import Replicate, Shard
from ..ir.verifier import verify
from ..nn import Module as NNModule
from ..tensor import Tensor, error, tensor as as_tensor
from .dtensor import distribute, place
from .mesh import Mesh


def bucket_all_reduces(module: Module, func: str, cap_bytes: int) -> Module:
    """`module` with @func's returned-only all_reduces merged per (group, op, dtype) into
    flat buffers of at most `cap_bytes` (a lone one, or one larger than the cap, stays as is).
    Every rank of a group has the same local types for such values (they are partial, not
    sharded, along the group's axes), so every member merges alike."""
    f = module.funcs[func]
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
    merged = [b for b in buckets if len(b) > 1]
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


class DDP(NNModule):
    """`module` data-parallel over `axis` of `mesh` (see the module docstring)."""

    def __init__(self, module: NNModule, mesh: Mesh, axis: str = "dp", bucket_cap_mb: float = 25):
        super().__init__()
        if axis not in mesh.shape:
            raise error(E.UNKNOWN_MESH_AXIS, f"DDP: {mesh} has axes {list(mesh.axis_names)}, not {axis!r}")
        self.module = module
        self.mesh, self.axis = mesh, axis
        for name, p in module.named_parameters():
            place(p, mesh, {axis: Replicate()}, f"DDP: parameter {name}")
        mesh.bucket_bytes = int(bucket_cap_mb * (1 << 20))

    def forward(self, *args, **kwargs):
        return self.module(*(shard_batch(a, self.mesh, self.axis) for a in args), **kwargs)


def shard_batch(a, mesh: Mesh, axis: str):
    """A plain tensor (or array) argument split by rows over `axis`; anything else as is."""
    if isinstance(a, np.ndarray):
        a = as_tensor(a)
    if isinstance(a, Tensor) and a.ndim >= 1 and a._mesh is None:
        return distribute(a, mesh, {axis: Shard(0)})
    return a


__all__ = ["DDP", "bucket_all_reduces", "shard_batch"]
