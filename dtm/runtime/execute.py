"""Running a captured module: the one entry the lazy Tensor calls.

    results = run(module, "main", inputs)      # inputs: numpy arrays, or Shards on a mesh

What the module holds picks the executor. A module that names no mesh runs on one device,
on the backend named by `backend` (else DTM_BACKEND, else `cpu`). A module that names a mesh
(a distributed tensor's program, in the global view) runs on that mesh: it is partitioned
into one local-view module per rank (dtm.compiler.spmd), and the ranks run at once on the
mesh's L0 devices, or, on a process mesh, this process runs its own rank (L1). Its results
are then `Shards`, laid out as propagation placed them; a plain input is replicated.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..compiler.spmd import resolve_free
from ..errors import ErrorCode as E, user_error
from ..ir.module import Module
from ..ir.types import Replicate
from .backend import get_backend
from .mesh import IR_NAME, DeviceMesh, Shards


def run(module: Module, func: str, inputs: Sequence[Any], backend: str | None = None,
        donated: frozenset = frozenset()) -> list[Any]:
    """Run @func of `module` on `inputs` (one per parameter) and return its results.
    `donated`: positions of inputs the caller gives up, whose memory a backend that can
    (the `cpu` backend's plans) may write results into (Plan.run); others ignore it."""
    if not module.meshes:
        b = get_backend(backend)
        if donated and getattr(b, "name", None) == "cpu":
            return b.run(module, func, inputs, donated=donated)
        return b.run(module, func, inputs)
    mesh = mesh_of(module, inputs)
    resolve_free(module, func)
    local = mesh.local_modules(module, func)
    per_rank = [[x.pieces[r] if type(x) is Shards else x for x in inputs] if local[r] is not None else None
                for r in range(mesh.size)]
    outs = mesh.run(local, func, per_rank)
    mine = next(m for m in local if m is not None)
    layouts = [sh.placements if sh is not None else (Replicate(),) * mesh.ndim
               for _, sh in mine.funcs[func].result_types]
    return [Shards(mesh, pl, [o[i] if o is not None else None for o in outs]) for i, pl in enumerate(layouts)]


def repeat(module: Module, func: str, inputs: Sequence[Any], times: int, feed: tuple[int, int],
           advance: tuple[int, int], backend: str | None = None, donated: frozenset = frozenset(),
           stop: tuple[np.ndarray, int, np.ndarray] | None = None) -> tuple[list[Any], np.ndarray] | None:
    """Run @func `times` times by one call, each run's result feed[0] the next run's input
    feed[1] and the scalar input advance[0] grown by advance[1] after each, until `stop`
    says (eos ids, pad id, alive rows: the `cpu` backend's Plan.repeat, greedy decoding).
    Returns the last run's results and result feed[0] of every run, stacked; None, running
    nothing, where the backend or the program cannot (a mesh, another backend), and the
    caller runs it itself."""
    b = get_backend(backend)
    if module.meshes or getattr(b, "name", None) != "cpu":
        return None
    return b.plan(module, func).repeat(inputs, times, feed, advance, donated=donated, stop=stop)


def compile(module: Module, func: str, backend: str | None = None) -> None:
    """Compile @func now, where the backend compiles (the `cpu` backend's plan), so that a
    failure to compile shows here rather than at the first run."""
    plan = getattr(get_backend(backend), "plan", None)
    if plan is not None:
        plan(module, func)


def prepare(dtypes: set[str], backend: str | None = None) -> None:
    """A program on tensors of `dtypes` (names) is about to be traced: the backend may start
    building what running it will need, on another core while the trace runs (the `cpu`
    backend: its runtime libraries, CpuBackend.prepare)."""
    start = getattr(get_backend(backend), "prepare", None)
    if start is not None:
        start(dtypes)


def mesh_of(module: Module, inputs: Sequence[Any] = ()) -> DeviceMesh:
    """The mesh a captured module runs on; every distributed input must be on it."""
    mesh = DeviceMesh.of(module.meshes[IR_NAME])
    assert mesh is not None, "a distributed program names a mesh that no DeviceMesh made"
    for x in inputs:
        if type(x) is Shards and x.mesh != mesh:
            raise user_error(E.MESH_MISMATCH, f"one program reads values on {mesh} and a value laid out "
                             f"{list(x.placements)} on {x.mesh}; a program runs on one mesh: distribute them "
                             "on the same mesh")
    return mesh


def local_view(module: Module, func: str, rank: int) -> Module:
    """Rank `rank`'s local-view module of captured global-view @func: the program that
    runs (`module` itself when nothing in it is distributed)."""
    if not module.meshes:
        return module
    mesh = mesh_of(module)
    resolve_free(module, func)
    if not 0 <= rank < mesh.size:
        raise user_error(E.INVALID_GROUP, f"rank {rank} is not on {mesh} of {mesh.size} ranks")
    if mesh.process is None:
        return mesh.local_modules(module, func)[rank]
    return mesh.local_module(module, func, rank)


__all__ = ["run", "mesh_of", "local_view"]
