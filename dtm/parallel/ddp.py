"""Data parallelism: parameters replicated along an axis, the batch sharded along it.

    model = dtm.parallel.DDP(model, mesh, axis="dp")
    loss = loss_fn(model(x), y); loss.backward(); opt.step()

No engine: DDP only sets shardings. The parameters become Replicate on `axis`; the tensor
arguments of forward become Shard(0) on it. Autograd differentiates the global program,
each gradient comes out partial(sum) over `axis` (every rank saw its own rows) and is
brought to its parameter's Replicate: an all_reduce, which the partitioner writes.

Bucketing: `bucket_cap_mb` sets the mesh's bucket size; the runtime runs the compiler's
`bucket_all_reduces` (dtm/compiler/spmd/bucket.py) on every partitioned program, which
merges the gradients' all_reduces into one all_reduce per flat buffer of up to that many
MiB: fewer, larger collectives, as torch's DDP does; in an eager backward (the gradients
returned) and in a whole step under dtm.jit (the optimizer's updates read them: held back
until their bucket is reduced).

Compression: `compress="q8_0"` (or "bf16", "auto") makes the gradient buckets' all_reduces
between processes (L1) travel compressed (spec 9.5.1): every float sum/avg all_reduce of at
least 1024 elements the step runs on the mesh; smaller ones (the loss) stay exact. On L0
(threads of one process) nothing travels, and it changes nothing.

Overlap: none on L0. A device thread runs its kernels and then its share of a collective
(the in-process collectives are memory copies and adds done by the device's own core), so
there is no idle link to overlap with; the merged all_reduce sits where its last gradient
is computed. Overlap pays across processes (L1), where a transfer waits on the network.
"""

from __future__ import annotations

import numpy as np

from ..comm.compress import COMPRESSIONS
from ..errors import ErrorCode as E
from ..ir.types import Replicate, Shard
from ..nn import Module as NNModule
from ..tensor import Tensor, error, tensor as as_tensor
from .dtensor import distribute, place
from .mesh import Mesh


class DDP(NNModule):
    """`module` data-parallel over `axis` of `mesh` (see the module docstring)."""

    def __init__(self, module: NNModule, mesh: Mesh, axis: str = "dp", bucket_cap_mb: float = 25,
                 compress: str | None = None):
        super().__init__()
        if axis not in mesh.shape:
            raise error(E.UNKNOWN_MESH_AXIS, f"DDP: {mesh} has axes {list(mesh.axis_names)}, not {axis!r}")
        if compress is not None and compress not in COMPRESSIONS + ("auto",):
            raise error(E.ATTRIBUTE_VALUE, f"DDP: compress={compress!r} is not a compression; use one of "
                        f"{', '.join(repr(c) for c in COMPRESSIONS)}, 'auto' or None")
        self.module = module
        self.mesh, self.axis = mesh, axis
        for name, p in module.named_parameters():
            place(p, mesh, {axis: Replicate()}, f"DDP: parameter {name}")
        mesh.bucket_bytes = int(bucket_cap_mb * (1 << 20))
        mesh.compress = compress

    def forward(self, *args, **kwargs):
        return self.module(*(shard_batch(a, self.mesh, self.axis) for a in args), **kwargs)


def shard_batch(a, mesh: Mesh, axis: str):
    """A plain tensor (or array) argument split by rows over `axis`; anything else as is."""
    if isinstance(a, np.ndarray):
        a = as_tensor(a)
    if isinstance(a, Tensor) and a.ndim >= 1 and a._mesh is None:
        return distribute(a, mesh, {axis: Shard(0)})
    return a


__all__ = ["DDP", "shard_batch"]
