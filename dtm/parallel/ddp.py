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
until their bucket is reduced). A gradient of 1 MiB or more keeps an all_reduce of its own
(bucket.SOLO_BYTES): copying it into a bucket would cost more than its call.

Compression: `compress="q8_0"` (or "bf16", "auto") makes the gradient buckets' all_reduces
between processes (L1) travel compressed (spec 9.5.1): every float sum/avg all_reduce of at
least 1024 elements the step runs on the mesh; smaller ones (the loss) stay exact. On L0
(threads of one process) nothing travels, and it changes nothing.

The batch: every rank passes the same global batch, and DDP gives each its rows (a torch
user passes each rank its own batch: here that would train on half of every rank's rows,
silently). So across processes (L1) each batch argument's CRC32C and shape are compared
along `axis` (one all_gather of 16 bytes a rank) before it is split, on every eager call
and, under dtm.jit, on every call before the program runs; ranks that passed different
batches fail with E0803 at the user's line. A batch a jitted function computes from its
arguments (`data[:, :-1]`) is compared through those arguments; one computed from the
step's own intermediates is not (the comparison would be a collective inside the program).

Overlap: none on L0. A device thread runs its kernels and then its share of a collective
(the in-process collectives are memory copies and adds done by the device's own core), so
there is no idle link to overlap with; the merged all_reduce sits where its last gradient
is computed. Overlap pays across processes (L1), where a transfer waits on the network.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from ..comm.compress import COMPRESSIONS
from ..errors import ErrorCode as E
from ..functional import ValueCheck, _checked as checked, _value_source as value_source, function_of_known
from ..ir.types import Replicate, Shard
from ..nn import Module as NNModule
from ..protocol.crc import checksum
from ..ref.context import group_ranks
from ..runtime.process_group import ProcessGroup
from ..tensor import STATE, Tensor, error, tensor as as_tensor
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
    """A plain tensor (or array) argument split by rows over `axis`; anything else as is.
    Across processes, every rank along `axis` must pass the same value (the module doc)."""
    if isinstance(a, np.ndarray):
        a = as_tensor(a)
    if isinstance(a, Tensor) and a.ndim >= 1 and a._mesh is None:
        if mesh.process is not None and mesh.shape[axis] > 1:
            group = group_ranks(mesh.axes, mesh.rank, (axis,))
            fault = functools.partial(_batch_differs, mesh.process, group, axis)
            a = _compared(a, ValueCheck(E.COLLECTIVE_MISMATCH, fault, lambda _: None, ""))
        return distribute(a, mesh, {axis: Shard(0)})
    return a


def _compared(a: Tensor, check: ValueCheck) -> Tensor:
    """`a` with `check` made on its value (eagerly now; under dtm.jit on each call, before
    the program runs). A batch a jitted function computes from its arguments alone (a slice
    of one, `data[:, :-1]`, however large) has the check made on those arguments instead:
    equal arguments give equal batches (the known tensors it also reads, constants and
    captured ones, are taken as the same on every rank). One computed from anything else is
    not compared."""
    trace = STATE.trace
    if trace is None or a._buffer is not None or id(value_source(a)) in trace.placeholders:
        return checked(a, check)
    for source in function_of_known(a, trace.placeholders, math.inf, math.inf) or ():
        if id(source) in trace.placeholders:
            checked(source, check)
    return a


def _batch_differs(pg: ProcessGroup, group: tuple[int, ...], axis: str, value: np.ndarray) -> str | None:
    """What is wrong when the processes of `group` (along `axis`) passed different batches
    (`value` is this one's), else None: one all_gather of each one's CRC32C and shape's."""
    value = np.ascontiguousarray(value)
    kind = np.frombuffer(f"{value.dtype}{value.shape}".encode(), np.uint8)
    mine = np.array([[checksum(value.reshape(-1).view(np.uint8)), checksum(kind)]], np.int64)
    rows = pg.collective("all_gather", mine, group, dim=0)
    differ = [r for r, row in zip(group, rows) if (row != rows[0]).any()]
    if not differ:
        return None
    return (f"DDP over {axis!r}: process ranks {list(group)} passed different batches (ranks {differ} "
            f"differ from rank {group[0]}; this rank's is {value.dtype}{list(value.shape)}). DDP takes the global "
            "batch, the same on every rank, and gives each rank its rows; a torch-style batch of each rank's own "
            "would train on half of each. Pass every rank the same batch (batch i of the whole run), or shard it "
            f"yourself with dtm.distribute(x, mesh, {{{axis!r}: dtm.Shard(0)}}) from the global batch")


__all__ = ["DDP", "shard_batch"]
