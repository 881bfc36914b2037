"""Meshes the runtime runs programs on, and the values of distributed tensors.

    mesh = DeviceMesh((("dp", 2), ("tp", 2)), devices)     # dtm.Mesh (dtm.parallel) is one
    value = mesh.split(array, (Shard(0), Replicate()))     # a Shards: one piece per mesh rank
    outs = run(module, "main", [value, w])                 # execute.py: any captured module

A `DeviceMesh` is a named grid of devices: the process's L0 devices (threads of this
process), or, when `process` is set, the ranks of the group dtm.init() formed, one mesh rank
per process (runtime L1: this process holds only its own piece of every value and runs only
its own rank's program). Its IR form (`ir()`, always named @mesh) is what a captured module
holds; `DeviceMesh.of` finds the mesh again from that object, which is how a module's run
finds its devices. `local_modules` partitions a global-view function into one local-view
module per rank (cached by module hash) and `run` runs such modules on the mesh's devices.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import OrderedDict
from typing import Any, Mapping, Sequence

import numpy as np

from ..compiler.spmd import FREE, bucket_all_reduces, local_module, partition_all
from ..compiler.spmd.layout import assemble, check_sharding, split_array
from ..errors import DTMError, ErrorCode as E, user_error
from ..ir.module import Module
from ..ir.types import Mesh as IRMesh, Placement, Replicate, Shard, Sharding, TensorType
from . import l0, l1
from .backend import release_plans
from .cpu import ModuleHashes
from .process_group import ProcessGroup

IR_NAME = "mesh"  # in a program every distributed value is on one mesh, which the IR calls @mesh
BUCKET_BYTES = 25 << 20  # gradient all_reduces merge into flat buffers of about this size (DDP)
_BY_IR: "weakref.WeakValueDictionary[int, DeviceMesh]" = weakref.WeakValueDictionary()


class Shards:
    """The value of a distributed tensor: mesh rank r holds pieces[r], laid out by
    `placements` over `mesh` (spec 2.7). On a process mesh the other ranks' pieces are None."""

    __slots__ = ("mesh", "placements", "pieces")

    def __init__(self, mesh: "DeviceMesh", placements: Sequence[Placement], pieces: Sequence[Any]):
        self.mesh, self.placements, self.pieces = mesh, tuple(placements), list(pieces)

    def numpy(self) -> np.ndarray:
        """The whole value, assembled on the host (on a process mesh: gathered from every
        process, so every rank calls this)."""
        return self.mesh.assemble(self.pieces, self.placements)


class DeviceMesh:
    """A named grid of devices, laid out row-major (the last axis varies fastest)."""

    def __init__(self, axes: Sequence[tuple[str, int]], devices: Sequence[l0.Device],
                 process: ProcessGroup | None = None):
        self.axes: tuple[tuple[str, int], ...] = tuple(axes)
        self.size = math.prod(s for _, s in self.axes)
        self.devices: tuple[l0.Device, ...] = tuple(devices)
        self.process = process
        self.bucket_bytes = BUCKET_BYTES
        self.compress: str | None = None  # DDP(compress=): gradient all_reduces between processes (spec 9.5.1)
        self._ir = IRMesh(IR_NAME, self.axes)
        _BY_IR[id(self._ir)] = self

    def resize(self, axes: Sequence[tuple[str, int]]) -> None:
        """Take the shape of a process mesh after a live resize (dtm/elastic): the same axis
        names with the sizes of the new view, one mesh rank per process of the group again.
        The values laid out on the old shape are stale until they are loaded anew, and every
        program traced on it is traced again (`generation`)."""
        global _generation
        if self.process is None:
            raise DTMError(E.INVALID_MESH, f"{self!r} is a mesh of local devices; only a process mesh resizes")
        if [a for a, _ in axes] != list(self.axis_names):
            raise DTMError(E.INVALID_MESH, f"a resize keeps the axes {list(self.axis_names)}, not {[a for a, _ in axes]}")
        self.axes = tuple((a, int(n)) for a, n in axes)
        self.size = math.prod(n for _, n in self.axes)
        self.devices = tuple(l0.Device(r, "process") for r in range(self.size))
        self._ir = IRMesh(IR_NAME, self.axes)
        _BY_IR[id(self._ir)] = self
        _generation += 1
        release_plans()  # the plans of the old shape held its shards

    @staticmethod
    def of(ir_mesh: IRMesh) -> "DeviceMesh | None":
        """The mesh whose `ir()` is `ir_mesh` (the very object a captured module holds)."""
        mesh = _BY_IR.get(id(ir_mesh))
        return mesh if mesh is not None and mesh._ir is ir_mesh else None

    @property
    def rank(self) -> int | None:
        """This process's mesh rank on a process mesh; None on a mesh of local devices."""
        return self.process.rank if self.process is not None else None

    @property
    def shape(self) -> dict[str, int]:
        return dict(self.axes)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(a for a, _ in self.axes)

    @property
    def ndim(self) -> int:
        return len(self.axes)

    # -- the IR's view --
    def ir(self) -> IRMesh:
        return self._ir

    def sharding(self, placements: Sequence[Placement]) -> Sharding:
        return Sharding(IR_NAME, tuple(placements))

    def placements(self, spec: Any, t: TensorType, what: str, rest: Placement = Replicate()) -> tuple[Placement, ...]:
        """Checked placements on this mesh for a value `what` of type t, from one placement
        per axis, a {axis: placement} dict (the axes it does not name get `rest`; FREE
        leaves them to propagation) or, on a 1-D mesh, one placement (Replicate() alone:
        on every axis). Negative shard dims count from the end."""
        if isinstance(spec, Placement):
            spec = (spec,) * (self.ndim if spec.kind == "replicate" else 1)
        if isinstance(spec, Mapping):
            unknown = [a for a in spec if a not in self.shape]
            if unknown:
                raise user_error(E.UNKNOWN_MESH_AXIS, f"{what}: placements {dict(spec)} name axes {unknown}, but "
                                 f"{self} has axes {list(self.axis_names)}")
            spec = tuple(spec.get(a, rest) for a in self.axis_names)
        if not isinstance(spec, (tuple, list)) or not all(isinstance(p, Placement) for p in spec):
            raise user_error(E.INVALID_PLACEMENT, f"{what}: placements {spec!r} on {self}: give dtm.Shard(dim), "
                             "dtm.Replicate() or dtm.Partial(op), one per mesh axis or as {axis: placement}")
        out = tuple(Shard(p.arg + t.rank) if p.kind == "shard" and isinstance(p.arg, int) and p.arg < 0 else p
                    for p in spec)
        try:
            known = tuple(Replicate() if p == FREE else p for p in out)
            check_sharding(what, t, self.sharding(known), {IR_NAME: self._ir})
        except DTMError as e:
            raise user_error(e.code, f"{e.message} ({self!r})") from None
        return out

    # -- values --
    def split(self, array: np.ndarray, placements: Sequence[Placement]) -> Shards:
        """The pieces of a whole array under `placements` (spec 2.7; partial: the value on
        coordinate 0, the reduction's identity elsewhere). A process keeps its own piece."""
        sh = self.sharding(placements)
        ranks = range(self.size) if self.process is None else (self.rank,)
        return Shards(self, placements, [split_array(array, sh, self._ir, r) if r in ranks else None
                                         for r in range(self.size)])

    def assemble(self, pieces: Sequence[Any], placements: Sequence[Placement]) -> np.ndarray:
        """The whole value of a distributed tensor from its pieces. On a process mesh only
        this rank's piece is here: every rank sends its piece to all (one all_gather of
        the pieces flattened and padded to the largest), so every rank must call this."""
        sharding = self.sharding(placements)
        if self.process is None:
            return assemble(pieces, sharding, self._ir)
        mine = np.asarray(pieces[self.rank], order="C")  # (ascontiguousarray makes a 0-d array 1-d)
        shapes = self.process.all_gather(np.array([mine.shape], np.int64), dim=0)  # pieces may be uneven
        sizes = [math.prod(int(d) for d in s) for s in shapes]
        flat = np.zeros((1, max(sizes)), mine.dtype)
        flat[0, :mine.size] = mine.reshape(-1)
        every = self.process.all_gather(flat, dim=0)
        return assemble([every[r, :n].reshape(tuple(int(d) for d in shapes[r])) for r, n in enumerate(sizes)],
                        sharding, self._ir)

    # -- running --
    def local_modules(self, module: Module, func: str) -> list[Module | None]:
        """One local-view module per mesh rank of global-view @func (partitioned once per
        module hash; gradient all_reduces bucketed by `bucket_bytes`). On a process mesh
        only this rank's: the others are None (each process partitions for itself)."""
        if self.process is not None:
            return [self.local_module(module, func, r) if r == self.rank else None for r in range(self.size)]
        n = len(l0.executor())
        return _cached((_HASHES(module), func, n, self.bucket_bytes), lambda: [
            bucket_all_reduces(m, func, self.bucket_bytes) for m in partition_all(module, func, devices=n)])

    def local_module(self, module: Module, func: str, rank: int) -> Module:
        """Mesh rank `rank`'s local-view module of global-view @func alone, cached the same way."""
        return _cached((_HASHES(module), func, "rank", rank, self.bucket_bytes), lambda: [
            bucket_all_reduces(local_module(module, func, rank), func, self.bucket_bytes)])[0]

    def run(self, modules: Sequence[Module | None], func: str, inputs: Sequence[Sequence | None]) -> list[list | None]:
        """Run modules[r] on inputs[r] as mesh rank r: every rank at once on the mesh's L0
        devices; on a process mesh this process's rank alone (L1), the others' results None."""
        if self.process is not None:
            mine = l1.executor().run(modules[self.rank], func, inputs[self.rank], compress=self.compress)
            return [mine if r == self.rank else None for r in range(self.size)]
        return l0.executor().run(modules, func, inputs, devices=[d.index for d in self.devices])

    # -- identity --
    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeviceMesh) and (self.axes, self.devices) == (other.axes, other.devices)

    def __hash__(self) -> int:
        return hash((self.axes, self.devices))

    def __repr__(self) -> str:
        return f"Mesh({dict(self.axes)}, devices=[{', '.join(map(str, self.devices))}])"

    __str__ = __repr__


_generation = 0  # how many process meshes resized so far (part of every traced program's key)


def generation() -> int:
    """A number that changes whenever a process mesh resizes: a program traced before then
    may hold the old shape, so dtm.jit's traces are keyed by it."""
    return _generation


_HASHES = ModuleHashes()  # a module partitioned again (a step's program, run each step) is not hashed again
_PARTITIONED: OrderedDict[tuple, list[Module]] = OrderedDict()
_PARTITIONED_LOCK = threading.Lock()
_MAX_PARTITIONED = 128


def _cached(key: tuple, make) -> list[Module]:
    """The partitioned modules under `key`, made by `make()` the first time (least recently
    used dropped past _MAX_PARTITIONED)."""
    with _PARTITIONED_LOCK:
        mods = _PARTITIONED.get(key)
        if mods is not None:
            _PARTITIONED.move_to_end(key)
            return mods
    mods = make()
    with _PARTITIONED_LOCK:
        _PARTITIONED[key] = mods
        while len(_PARTITIONED) > _MAX_PARTITIONED:
            _PARTITIONED.popitem(last=False)
    return mods


__all__ = ["DeviceMesh", "Shards", "IR_NAME", "BUCKET_BYTES", "generation"]
