"""Distributed tensors: the global view (DESIGN.md, "Two views").

    x = dtm.distribute(dtm.randn(8, 4), mesh, [dtm.Shard(0)])   # each device holds 4 rows
    y = (x @ w).relu()            # every Tensor op; lazy, as always
    y.placements                  # (Shard(0),): what propagation gives y
    y.redistribute([dtm.Replicate()]).local_shards()[1]         # rank 1's piece, whole
    y.full_tensor()               # a plain tensor

A distributed tensor is a Tensor whose value is a `Shards` (one piece per mesh rank) or whose
inputs are distributed. Ops record as usual; realize captures one global-view IR function
whose parameters carry their shardings (and whose values carry the layouts the user pinned
with redistribute), partitions it into one local-view function per rank
(dtm.compiler.spmd), and runs those on the mesh's devices (dtm.runtime.l0). Each result
keeps its per-rank pieces, laid out as propagation placed it. Gradients come the same way:
autograd differentiates the global-view function, and each gradient is brought to its
leaf's placements before it is partitioned. Plain tensors mixed in are replicated.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Sequence

import numpy as np

from ..compiler.spmd import local_module, partition_all, propagate_shardings, split_array
from ..errors import ErrorCode as E
from ..ir.module import Module
from ..ir.types import Replicate
from ..runtime import l0
from ..tensor import Shards, Tensor, apply, capture, error, no_grad, tensor as as_tensor
from .mesh import FREE, IR_NAME, Mesh


def split(array: np.ndarray, mesh: Mesh, placements: Sequence) -> Shards:
    """The pieces of a whole array under `placements` (spec 2.7; partial: the value on
    coordinate 0, the reduction's identity elsewhere)."""
    sh = mesh.sharding(placements)
    if mesh.process is not None:  # a process keeps its own piece only
        return Shards(mesh, placements, [split_array(array, sh, mesh.ir(), r) if r == mesh.rank else None
                                         for r in range(mesh.size)])
    return Shards(mesh, placements, [split_array(array, sh, mesh.ir(), r) for r in range(mesh.size)])


def _describe(t: Tensor) -> str:
    layout = f" {list(t._placements)}" if t._placements is not None else ""
    return f"tensor {t.type}{layout}"


def distribute(t: Any, mesh: Mesh, placements: Any) -> Tensor:
    """`t` laid out over `mesh` by `placements` (one per mesh axis, a {axis: placement}
    dict, or one placement on a 1-D mesh). A leaf stays a leaf (it gets `.grad`, with these
    placements); a tensor with gradient history keeps it."""
    t = t if isinstance(t, Tensor) else as_tensor(t)
    if not isinstance(mesh, Mesh):
        raise error(E.INVALID_MESH, f"distribute: expected a dtm.Mesh, found {type(mesh).__name__}")
    pl = mesh.placements(placements, t.type, f"distribute({_describe(t)})")
    if t._mesh is not None:
        if t._mesh != mesh:
            raise error(E.MESH_MISMATCH, f"distribute({_describe(t)}, {mesh}, {list(pl)}): the tensor is already on "
                        f"{t._mesh}; full_tensor() it first to move it to another mesh")
        return redistribute(t, pl)
    if t.requires_grad and t._op is not None:  # keep the history: the program slices it on each device
        out = apply("reshape", t, shape=t.shape)
        out._mesh, out._placements = mesh, pl
        return out
    return Tensor(t.type, buffer=split(t.numpy(), mesh, pl), requires_grad=t.requires_grad)


def placements_of(t: Tensor) -> tuple | None:
    """A distributed tensor's placements: its value's, the pinned ones, or (pending and
    unpinned) what sharding propagation gives it. None for a plain tensor."""
    if t._mesh is None:
        return None
    if t._placements is not None and FREE not in t._placements:
        return t._placements
    module, _ = capture([t])
    module.meshes[IR_NAME] = t._mesh.ir()
    resolve_free(module, "main")
    return propagate_shardings(module, "main").result_types[0][1].placements


def resolve_free(module: Module, func: str) -> None:
    """Fill the open (FREE) axes of pinned shardings in @func with what propagation gives
    those values without the pins. (One propagation for all of them: each mesh axis is
    placed on its own, so a pin on one axis barely moves the others; and any complete
    sharding is correct, the open axes only decide what is cheaper.)"""
    f = module.funcs[func]
    pinned = [(i, k, r.sharding) for i, op in enumerate(f.ops) for k, r in enumerate(op.results)
              if r.sharding is not None and FREE in r.sharding.placements]
    if not pinned:
        return
    for i, k, _ in pinned:
        f.ops[i].results[k].sharding = None
    g = propagate_shardings(module, func)
    for i, k, sh in pinned:
        got = g.ops[i].results[k].sharding.placements
        f.ops[i].results[k].sharding = type(sh)(sh.mesh, tuple(q if p == FREE else p
                                                             for p, q in zip(sh.placements, got)))


def redistribute(t: Tensor, placements: Any) -> Tensor:
    """The same value laid out by `placements` on the same mesh (lazy; the partitioner
    picks the collectives, spec 2.9). Differentiable. With a {axis: placement} dict, the
    axes it does not name keep what propagation gives them."""
    if t._mesh is None:
        raise error(E.INVALID_PLACEMENT, f"redistribute: {_describe(t)} is not distributed; use "
                    "dtm.distribute(t, mesh, placements)")
    pl = t._mesh.placements(placements, t.type, f"redistribute({_describe(t)})", rest=FREE)
    out = apply("reshape", t, shape=t.shape)
    out._placements = pl
    return out


def full_tensor(t: Tensor) -> Tensor:
    """A plain tensor with the whole value (lazy and differentiable, like every op)."""
    if t._mesh is None:
        return t
    out = apply("reshape", t, shape=t.shape)
    out._mesh = out._placements = None
    return out


def local_shards(t: Tensor) -> list[Tensor]:
    """Each mesh rank's piece, as plain tensors, in rank order. On a process mesh (runtime
    L1) a process holds only its own rank's piece: the others are None (full_tensor() or
    numpy() gathers the whole value, every rank calling it)."""
    t.realize()
    if type(t._buffer) is not Shards:
        return [Tensor.from_numpy(t._buffer)]
    return [Tensor.from_numpy(p) if p is not None else None for p in t._buffer.pieces]  # None: another process's


def place(p: Tensor, mesh: Mesh, spec: dict, what: str) -> None:
    """Give tensor p (a parameter: changed in place, so modules and optimizers keep it) the
    placements `spec` ({axis: placement}); its other axes keep theirs (a plain tensor's:
    replicated). DDP, tensor_parallel and fsdp are made of this."""
    if p._mesh is not None and p._mesh != mesh:
        raise error(E.MESH_MISMATCH, f"{what} ({_describe(p)}) is on {p._mesh}, not on {mesh}")
    current = placements_of(p) if p._mesh is not None else (Replicate(),) * mesh.ndim
    merged = mesh.placements({**dict(zip(mesh.axis_names, current)), **spec}, p.type, what)
    if p._mesh is None:
        value = split(p.numpy(), mesh, merged)
    elif merged != current:
        with no_grad():
            value = redistribute(p, merged).realize()._buffer
    else:
        return
    p._set_value(value)
    p.grad = None


# --- running a global-view function -------------------------------------------------------

_PARTITIONED: OrderedDict[tuple, list[Module]] = OrderedDict()
_PARTITIONED_LOCK = threading.Lock()
_MAX_PARTITIONED = 128


def _partitioned(module: Module, func: str, mesh: Mesh) -> list[Module]:
    """One local-view module per rank (cached by the global module's hash), gradient
    all_reduces bucketed (ddp.bucket_all_reduces)."""
    from .ddp import bucket_all_reduces

    n = len(l0.executor())
    key = (module.hash(), func, n, mesh.bucket_bytes)
    with _PARTITIONED_LOCK:
        mods = _PARTITIONED.get(key)
        if mods is not None:
            _PARTITIONED.move_to_end(key)
            return mods
    mods = [bucket_all_reduces(m, func, mesh.bucket_bytes) for m in partition_all(module, func, devices=n)]
    with _PARTITIONED_LOCK:
        _PARTITIONED[key] = mods
        while len(_PARTITIONED) > _MAX_PARTITIONED:
            _PARTITIONED.popitem(last=False)
    return mods


def _mesh_of(module: Module, params: Sequence[Tensor]) -> Mesh:
    """The mesh a captured program runs on; every distributed parameter must be on it."""
    mesh = Mesh.of(module.meshes[IR_NAME])
    assert mesh is not None, "a distributed program names a mesh that dtm.parallel did not make"
    for t in params:
        if t._mesh is not None and t._mesh != mesh:
            raise error(E.MESH_MISMATCH, f"one program reads tensors on {mesh} and {_describe(t)} on {t._mesh}; "
                        "a program runs on one mesh: distribute them on the same mesh")
    return mesh


def run_distributed(module: Module, func: str, params: Sequence[Tensor]) -> list[Shards]:
    """Run global-view @func of `module` (captured: its mesh is a dtm.parallel Mesh's) on
    that mesh: params[i] (realized) is parameter i; a plain one is replicated."""
    mesh = _mesh_of(module, params)
    resolve_free(module, func)
    if mesh.process is not None:
        return _run_on_processes(module, func, params, mesh)
    modules = _partitioned(module, func, mesh)
    inputs = [[t._buffer.pieces[r] if type(t._buffer) is Shards else t._buffer for t in params]
              for r in range(mesh.size)]
    outs = l0.executor().run(modules, func, inputs, devices=[d.index for d in mesh.devices])
    layouts = [sh.placements if sh is not None else (Replicate(),) * mesh.ndim
               for _, sh in modules[0].funcs[func].result_types]
    return [Shards(mesh, pl, [outs[r][i] for r in range(mesh.size)]) for i, pl in enumerate(layouts)]


def _local_partitioned(module: Module, func: str, mesh: Mesh, rank: int) -> Module:
    """Rank `rank`'s local-view module alone (a process mesh: each process partitions for
    itself), cached like `_partitioned`."""
    from .ddp import bucket_all_reduces

    key = (module.hash(), func, "rank", rank, mesh.bucket_bytes)
    with _PARTITIONED_LOCK:
        mods = _PARTITIONED.get(key)
        if mods is not None:
            _PARTITIONED.move_to_end(key)
            return mods[0]
    local = bucket_all_reduces(local_module(module, func, rank), func, mesh.bucket_bytes)
    with _PARTITIONED_LOCK:
        _PARTITIONED[key] = [local]
        while len(_PARTITIONED) > _MAX_PARTITIONED:
            _PARTITIONED.popitem(last=False)
    return local


def _run_on_processes(module: Module, func: str, params: Sequence[Tensor], mesh: Mesh) -> list[Shards]:
    """run_distributed on a process mesh (runtime L1): this process partitions and runs
    its own rank's program; its results keep only its own pieces."""
    from ..runtime import l1

    rank = mesh.rank
    local = _local_partitioned(module, func, mesh, rank)
    inputs = [t._buffer.pieces[rank] if type(t._buffer) is Shards else t._buffer for t in params]
    outs = l1.executor().run(local, func, inputs)
    layouts = [sh.placements if sh is not None else (Replicate(),) * mesh.ndim
               for _, sh in local.funcs[func].result_types]
    return [Shards(mesh, pl, [outs[i] if r == rank else None for r in range(mesh.size)])
            for i, pl in enumerate(layouts)]


def local_view(module: Module, func: str, rank: int) -> Module:
    """Rank `rank`'s local-view module of captured global-view @func: the program that
    runs (`module` itself when nothing in it is distributed)."""
    if not module.meshes:
        return module
    mesh = _mesh_of(module, ())
    resolve_free(module, func)
    mods = _partitioned(module, func, mesh)
    if not 0 <= rank < len(mods):
        raise error(E.INVALID_GROUP, f"rank {rank} is not on {mesh} of {len(mods)} ranks")
    return mods[rank]


__all__ = ["distribute", "redistribute", "full_tensor", "local_shards", "placements_of", "split", "place",
           "run_distributed", "local_view", "resolve_free", "Shards"]
