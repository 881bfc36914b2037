"""Fully sharded data parallelism (ZeRO-3): parameters, gradients and optimizer state split
across an axis; each layer's parameters gathered just for its forward.

    model = dtm.parallel.fsdp(model, mesh)        # then train as usual

No engine: every parameter becomes Shard(0) on `axis` (dim 0 split, unevenly where it does
not divide; a 0-d one replicated), and the tensor arguments of forward Shard(0) on it, as in
DDP. While a module that owns parameters runs forward, it sees them redistributed to
Replicate on `axis`: an all_gather before use. Autograd differentiates through that
redistribution, so each gradient comes out partial(sum) over the axis and is brought to its
parameter's Shard(0): a reduce_scatter. The optimizer's update then runs on each rank's
shard (its state is sharded alike).
"""

from __future__ import annotations

from ..errors import ErrorCode as E
from ..ir.types import Replicate, Shard
from ..nn import Module
from ..tensor import error
from .ddp import shard_batch
from .dtensor import place
from .mesh import Mesh


def _gather_in_forward(m: Module, axis: str) -> None:
    """Run m's forward with its own parameters gathered along `axis`."""
    inner = m.forward
    names = list(m._parameters)

    def forward(*args, **kwargs):
        own = {n: m._parameters[n] for n in names if m._parameters[n] is not None}
        try:
            for n, p in own.items():
                object.__setattr__(m, n, p.redistribute({axis: Replicate()}))
            return inner(*args, **kwargs)
        finally:
            for n, p in own.items():
                object.__setattr__(m, n, p)

    object.__setattr__(m, "forward", forward)


class FSDP(Module):
    """`module` fully sharded over `axis` of `mesh` (see the module docstring)."""

    def __init__(self, module: Module, mesh: Mesh, axis: str | None = None):
        super().__init__()
        axis = axis if axis is not None else mesh.axis_names[0]
        if axis not in mesh.shape:
            raise error(E.UNKNOWN_MESH_AXIS, f"fsdp: {mesh} has axes {list(mesh.axis_names)}, not {axis!r}")
        self.module = module
        self.mesh, self.axis = mesh, axis
        for mname, m in module.named_modules():
            if not m._parameters:
                continue
            for pname, p in m._parameters.items():
                if p is not None:
                    spec = {axis: Shard(0) if p.ndim else Replicate()}
                    place(p, mesh, spec, f"fsdp: parameter {mname + '.' if mname else ''}{pname}")
            _gather_in_forward(m, axis)

    def forward(self, *args, **kwargs):
        return self.module(*(shard_batch(a, self.mesh, self.axis) for a in args), **kwargs)


def fsdp(model: Module, mesh: Mesh, axis: str | None = None) -> FSDP:
    """`model` fully sharded over `axis` (default: the mesh's first axis)."""
    return FSDP(model, mesh, axis)


__all__ = ["fsdp", "FSDP"]
