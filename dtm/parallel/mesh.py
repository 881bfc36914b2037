"""Meshes of the local devices, and the placements of distributed tensors on them.

    dtm.devices()                        # the virtual CPU devices (DTM_DEVICES, or dtm.devices(n))
    mesh = dtm.Mesh({"dp": 2, "tp": 2})  # devices 0-3, row-major: rank 1 is dp=0, tp=1
    mesh["tp"]                           # the 1-D mesh along tp at dp = 0; mesh.submesh("tp", dp=1)
    dtm.Shard(0), dtm.Replicate(), dtm.Partial("sum")   # one per mesh axis, or {"tp": Shard(1)}

After dtm.init() has formed a group of several processes, a Mesh of exactly that many
ranks spans the processes instead (mesh rank r = process rank r, runtime L1): each process
keeps only its own piece of every distributed tensor and runs only its own rank's program.

A placement is the IR's (spec 2.7), so what a user writes is what the compiler reads. In a
program every distributed value is on one mesh, which the IR calls @mesh.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from ..compiler.spmd import FREE
from ..ir.chunks import coords
from ..errors import ErrorCode as E
from ..ir.types import Partial, Placement, Replicate, Shard
from ..runtime import l0, process_group
from ..runtime.mesh import IR_NAME, DeviceMesh
from ..tensor import error


def devices(n: int | None = None) -> list[l0.Device]:
    """The local devices; with `n`, first make the process have n virtual CPU devices."""
    if n is not None:
        if not isinstance(n, int) or n < 1:
            raise error(E.INVALID_MESH, f"dtm.devices({n!r}): the number of devices is a whole number >= 1")
        return list(l0.set_device_count(n).devices)
    return list(l0.executor().devices)


class Mesh(DeviceMesh):
    """A named grid of local devices. `shape` maps axis names to sizes, in order; `devices`
    (default: the first ones) are laid out row-major, the last axis varying fastest. (What
    the runtime needs of a mesh, placements, splitting and assembling values and running
    on it, is DeviceMesh's, dtm/runtime/mesh.py; this class is how a user makes and slices
    one.)"""

    def __init__(self, shape: Mapping[str, int] | Sequence[tuple[str, int]], devices: Sequence[Any] | None = None):
        axes = tuple(shape.items()) if isinstance(shape, Mapping) else tuple(tuple(a) for a in shape)
        bad = [(a, s) for a, s in axes if not (isinstance(a, str) and a.isidentifier())
               or not isinstance(s, int) or s < 1]
        if not axes or bad or len({a for a, _ in axes}) != len(axes):
            raise error(E.INVALID_MESH, f"Mesh({dict(axes)}): a mesh needs at least one axis, axis names that "
                        f"are distinct identifiers and sizes >= 1 (at fault: {bad or 'the axis names'})")
        size = math.prod(s for _, s in axes)
        process = _process_group(size) if devices is None else None
        if process is not None:  # one mesh rank per process (runtime L1): rank r is process r
            super().__init__(axes, tuple(l0.Device(r, "process") for r in range(size)), process)
            return
        super().__init__(axes, _local_devices(axes, size, devices))

    def coordinates(self, rank: int) -> dict[str, int]:
        """The coordinates of mesh rank `rank` on each axis."""
        return dict(zip(self.axis_names, coords(self.ir(), rank)))

    def __getitem__(self, names: str | tuple[str, ...]) -> "Mesh":
        return self.submesh(*((names,) if isinstance(names, str) else names))

    def submesh(self, *names: str, **at: int) -> "Mesh":
        """The mesh along axes `names` (in that order), at coordinate `at[axis]` (default 0)
        of every other axis."""
        sizes = self.shape
        for a in (*names, *at):
            if a not in sizes:
                raise error(E.UNKNOWN_MESH_AXIS, f"{self} has axes {list(sizes)}, not {a!r}")
        rest = [a for a in sizes if a not in names]
        fixed = {a: at.get(a, 0) for a in rest}
        if any(not 0 <= c < sizes[a] for a, c in fixed.items()) or set(at) & set(names):
            raise error(E.INVALID_GROUP, f"{self}.submesh{names}: coordinates {at} out of range or on a kept axis")
        members = [r for r in range(self.size) if all(self.coordinates(r)[a] == c for a, c in fixed.items())]
        # members are row-major in the mesh's axis order; reorder to the order of `names`
        members.sort(key=lambda r: [self.coordinates(r)[a] for a in names])
        return Mesh({a: sizes[a] for a in names}, [self.devices[r] for r in members])


def _local_devices(axes: tuple, size: int, devices: Sequence[Any] | None) -> tuple[l0.Device, ...]:
    """The process's devices a mesh of `size` ranks lays out: the first ones, or those named
    (as Devices or indices), checked to be distinct and present."""
    present = l0.executor().devices
    if devices is None:
        if size > len(present):
            raise error(E.MESH_TOO_LARGE, f"Mesh({dict(axes)}) needs {size} devices, but this process "
                        f"has {len(present)} ({', '.join(map(str, present))}); call dtm.devices({size}) "
                        f"or set DTM_DEVICES={size} first")
        devices = present[:size]
    ids = tuple(d.index if isinstance(d, l0.Device) else int(d) for d in devices)
    if len(ids) != size or len(set(ids)) != len(ids) or any(not 0 <= i < len(present) for i in ids):
        raise error(E.MESH_TOO_LARGE, f"Mesh({dict(axes)}) needs {size} distinct devices out of the "
                    f"{len(present)} present, found {list(ids)}")
    return tuple(present[i] for i in ids)


def _process_group(size: int) -> "process_group.ProcessGroup | None":
    """The process group a mesh of `size` ranks spans: the one dtm.init() formed, when it
    has more than one process and exactly `size` of them; else None (local devices)."""
    if not process_group.is_initialized():
        return None
    pg = process_group.current()
    return pg if pg.world_size > 1 and pg.world_size == size else None


__all__ = ["Mesh", "devices", "Shard", "Replicate", "Partial", "Placement", "IR_NAME", "FREE"]
