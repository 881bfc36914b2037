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
import weakref
from typing import Any, Mapping, Sequence

from ..compiler.spmd.layout import assemble, check_sharding, coords
from ..errors import DTMError, ErrorCode as E
from ..ir.types import Mesh as IRMesh, Partial, Placement, Replicate, Shard, Sharding, TensorType
from ..runtime import l0, process_group
from ..tensor import error

IR_NAME = "mesh"
_BY_IR: "weakref.WeakValueDictionary[int, Mesh]" = weakref.WeakValueDictionary()
# A placement left open by redistribute({axis: ...}): the value keeps on that axis what
# propagation gives it. Resolved before a program is partitioned; never in the IR.
FREE = Placement("free")
BUCKET_BYTES = 25 << 20  # gradient all_reduces merge into flat buffers of about this size (DDP)


def devices(n: int | None = None) -> list[l0.Device]:
    """The local devices; with `n`, first make the process have n virtual CPU devices."""
    if n is not None:
        if not isinstance(n, int) or n < 1:
            raise error(E.INVALID_MESH, f"dtm.devices({n!r}): the number of devices is a whole number >= 1")
        return list(l0.set_device_count(n).devices)
    return list(l0.executor().devices)


class Mesh:
    """A named grid of local devices. `shape` maps axis names to sizes, in order; `devices`
    (default: the first ones) are laid out row-major, the last axis varying fastest."""

    def __init__(self, shape: Mapping[str, int] | Sequence[tuple[str, int]], devices: Sequence[Any] | None = None):
        axes = tuple(shape.items()) if isinstance(shape, Mapping) else tuple(tuple(a) for a in shape)
        bad = [(a, s) for a, s in axes if not (isinstance(a, str) and a.isidentifier())
               or not isinstance(s, int) or s < 1]
        if not axes or bad or len({a for a, _ in axes}) != len(axes):
            raise error(E.INVALID_MESH, f"Mesh({dict(axes)}): a mesh needs at least one axis, axis names that "
                        f"are distinct identifiers and sizes >= 1 (at fault: {bad or 'the axis names'})")
        self.axes: tuple[tuple[str, int], ...] = axes
        self.size = math.prod(s for _, s in axes)
        self.process = _process_group(self.size) if devices is None else None
        if self.process is not None:  # one mesh rank per process (runtime L1): rank r is process r
            self.devices = tuple(l0.Device(r, "process") for r in range(self.size))
            self.bucket_bytes = BUCKET_BYTES
            self._ir = IRMesh(IR_NAME, axes)
            _BY_IR[id(self._ir)] = self
            return
        present = l0.executor().devices
        if devices is None:
            if self.size > len(present):
                raise error(E.MESH_TOO_LARGE, f"Mesh({dict(axes)}) needs {self.size} devices, but this process "
                            f"has {len(present)} ({', '.join(map(str, present))}); call dtm.devices({self.size}) "
                            f"or set DTM_DEVICES={self.size} first")
            devices = present[:self.size]
        ids = tuple(d.index if isinstance(d, l0.Device) else int(d) for d in devices)
        if len(ids) != self.size or len(set(ids)) != len(ids) or any(not 0 <= i < len(present) for i in ids):
            raise error(E.MESH_TOO_LARGE, f"Mesh({dict(axes)}) needs {self.size} distinct devices out of the "
                        f"{len(present)} present, found {list(ids)}")
        self.devices: tuple[l0.Device, ...] = tuple(present[i] for i in ids)
        self.bucket_bytes = BUCKET_BYTES
        self._ir = IRMesh(IR_NAME, axes)
        _BY_IR[id(self._ir)] = self

    @property
    def rank(self) -> int | None:
        """This process's mesh rank on a process mesh; None on a mesh of local devices."""
        return self.process.rank if self.process is not None else None

    def assemble(self, pieces: Sequence[Any], placements: Sequence[Placement]) -> Any:
        """The whole value of a distributed tensor from its pieces. On a process mesh only
        this rank's piece is here: every rank sends its piece to all (one all_gather of
        the pieces flattened and padded to the largest), so every rank must call this."""
        sharding = self.sharding(placements)
        if self.process is None:
            return assemble(pieces, sharding, self._ir)
        import numpy as np

        mine = np.asarray(pieces[self.rank], order="C")  # (ascontiguousarray makes a 0-d array 1-d)
        shapes = self.process.all_gather(np.array([mine.shape], np.int64), dim=0)  # pieces may be uneven
        sizes = [math.prod(int(d) for d in s) for s in shapes]
        flat = np.zeros((1, max(sizes)), mine.dtype)
        flat[0, :mine.size] = mine.reshape(-1)
        every = self.process.all_gather(flat, dim=0)
        return assemble([every[r, :n].reshape(tuple(int(d) for d in shapes[r])) for r, n in enumerate(sizes)],
                        sharding, self._ir)

    @staticmethod
    def of(ir_mesh: IRMesh) -> "Mesh | None":
        """The Mesh whose `ir()` is `ir_mesh` (the very object a captured module holds)."""
        mesh = _BY_IR.get(id(ir_mesh))
        return mesh if mesh is not None and mesh._ir is ir_mesh else None

    # -- shape --
    @property
    def shape(self) -> dict[str, int]:
        return dict(self.axes)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(a for a, _ in self.axes)

    @property
    def ndim(self) -> int:
        return len(self.axes)

    def coordinates(self, rank: int) -> dict[str, int]:
        """The coordinates of mesh rank `rank` on each axis."""
        return dict(zip(self.axis_names, coords(self._ir, rank)))

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

    # -- the IR's view --
    def ir(self) -> IRMesh:
        return self._ir

    def sharding(self, placements: Sequence[Placement]) -> Sharding:
        return Sharding(IR_NAME, tuple(placements))

    def placements(self, spec: Any, t: TensorType, what: str, rest: Placement = Replicate()) -> tuple[Placement, ...]:
        """Checked placements on this mesh for a value `what` of type t, from one placement
        per axis, a {axis: placement} dict (the axes it does not name get `rest`) or, on a
        1-D mesh, one placement (Replicate() alone: on every axis). Negative shard dims
        count from the end."""
        if isinstance(spec, Placement):
            spec = (spec,) * (self.ndim if spec.kind == "replicate" else 1)
        if isinstance(spec, Mapping):
            unknown = [a for a in spec if a not in self.shape]
            if unknown:
                raise error(E.UNKNOWN_MESH_AXIS, f"{what}: placements {dict(spec)} name axes {unknown}, but {self} "
                            f"has axes {list(self.axis_names)}")
            spec = tuple(spec.get(a, rest) for a in self.axis_names)
        if not isinstance(spec, (tuple, list)) or not all(isinstance(p, Placement) for p in spec):
            raise error(E.INVALID_PLACEMENT, f"{what}: placements {spec!r} on {self}: give dtm.Shard(dim), "
                        "dtm.Replicate() or dtm.Partial(op), one per mesh axis or as {axis: placement}")
        out = tuple(Shard(p.arg + t.rank) if p.kind == "shard" and isinstance(p.arg, int) and p.arg < 0 else p
                    for p in spec)
        try:
            known = tuple(Replicate() if p == FREE else p for p in out)
            check_sharding(what, t, self.sharding(known), {IR_NAME: self._ir})
        except DTMError as e:
            raise error(e.code, f"{e.message} ({self!r})") from None
        return out

    # -- identity --
    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mesh) and (self.axes, self.devices) == (other.axes, other.devices)

    def __hash__(self) -> int:
        return hash((self.axes, self.devices))

    def __repr__(self) -> str:
        return f"Mesh({dict(self.axes)}, devices=[{', '.join(map(str, self.devices))}])"

    __str__ = __repr__


def _process_group(size: int) -> "process_group.ProcessGroup | None":
    """The process group a mesh of `size` ranks spans: the one dtm.init() formed, when it
    has more than one process and exactly `size` of them; else None (local devices)."""
    if not process_group.is_initialized():
        return None
    pg = process_group.current()
    return pg if pg.world_size > 1 and pg.world_size == size else None


__all__ = ["Mesh", "devices", "Shard", "Replicate", "Partial", "Placement", "IR_NAME", "FREE"]
