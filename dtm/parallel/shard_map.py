"""shard_map: the local view, written by hand (docs/architecture.md, "Two views").

    def f(x, w):                                      # runs on every rank, on its own pieces
        return dtm.all_reduce(x @ w, axis="tp")       # collectives are explicit
    y = dtm.shard_map(f, mesh, in_specs=(Shard(1), Shard(0)), out_specs=Replicate())(x, w)

Each argument is brought to its in_spec over `mesh` (distributed, or redistributed), and
`fn` is traced on placeholders of the local pieces' types: one IR function per distinct
local signature (uneven shards give ranks different ones), the collectives in it naming the
mesh's axes. The functions run at once on the mesh's devices (on a process mesh, runtime L1:
each process runs only its own rank's function, its collectives going over the process
group, and keeps only its own pieces of the outputs). Output i's pieces form a distributed tensor laid out by out_specs[i] (Replicate: the ranks hold equal pieces; Shard(d):
chunks along d, as spec 2.7 lays them; Partial(op): pieces to reduce). Tensors fn reads from
outside are given whole to every rank.

shard_map runs when called (it is a boundary of the lazy graph) and records no gradient:
differentiate through the global view instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Sequence

from ..compiler.spmd.layout import local_type
from ..ir.chunks import coords
from ..errors import ErrorCode as E
from ..ir.types import Placement
from ..runtime.mesh import Shards
from ..tensor import STATE, Tensor, capture, error, is_grad_enabled, no_grad, tensor as as_tensor
from .dtensor import distribute
from .mesh import IR_NAME, Mesh


def _is_spec(s: Any) -> bool:
    return s is None or isinstance(s, (Placement, Mapping)) or \
        (isinstance(s, (tuple, list)) and len(s) > 0 and all(isinstance(p, Placement) for p in s))


def _specs(specs: Any, n: int, what: str) -> list:
    """One spec per argument (or output): a lone spec stands for a lone argument."""
    if n == 1 and _is_spec(specs) and not (isinstance(specs, (tuple, list)) and len(specs) == 1):
        return [specs]
    if not isinstance(specs, (tuple, list)) or len(specs) != n or not all(_is_spec(s) for s in specs):
        raise error(E.PLACEMENT_COUNT, f"shard_map: {what} must give one spec per {'argument' if 'in' in what else 'output'} "
                    f"({n}), each placements (or None for a non-tensor argument); found {specs!r}")
    return list(specs)


def shard_map(fn: Callable, mesh: Mesh, in_specs: Any, out_specs: Any) -> Callable:
    """`fn` as a local-view program over `mesh` (see the module docstring)."""
    if not isinstance(mesh, Mesh):
        raise error(E.INVALID_MESH, f"shard_map: expected a dtm.Mesh, found {type(mesh).__name__}")

    def run(*args):
        specs = _specs(in_specs, len(args), "in_specs")
        inputs: list[Tensor | None] = []
        for i, (a, spec) in enumerate(zip(args, specs)):
            if spec is None:
                inputs.append(None)
                continue
            t = a if isinstance(a, Tensor) else as_tensor(a)
            if t.requires_grad and is_grad_enabled():
                raise error(E.ATTRIBUTE_VALUE, f"shard_map: argument {i} requires grad, and shard_map records no "
                            "gradient; call it under dtm.no_grad() or differentiate the global view")
            d = distribute(t, mesh, spec)
            d.realize()
            inputs.append(d)
        ir_mesh = mesh.ir()
        # every rank's local argument types (computed, so that a process knows the others')
        by_rank = [[local_type(x._type, mesh.sharding(x._buffer.placements), ir_mesh, coords(ir_mesh, r))
                    if x is not None else None for x in inputs] for r in range(mesh.size)]
        traced: dict[tuple, tuple] = {}  # local signature -> (module, captured tensors, out_is_tuple)
        per_rank = []  # rank -> its traced entry
        for r in range(mesh.size):
            sig = tuple(tuple(t.shape) if t is not None else None for t in by_rank[r])
            if sig not in traced:
                traced[sig] = _trace(fn, mesh, args, inputs, by_rank[r])
            per_rank.append(traced[sig])
        modules = [m for m, _, _ in per_rank]

        def rank_inputs(r: int) -> list:
            return [x._buffer.pieces[r] for x in inputs if x is not None] + [c.numpy() for c in per_rank[r][1]]

        # every rank at once on the mesh's devices (on a process mesh: this process's own)
        mine = range(mesh.size) if mesh.process is None else (mesh.rank,)
        outs = mesh.run(modules, "main", [rank_inputs(r) if r in mine else None for r in range(mesh.size)])
        out_is_tuple = next(iter(traced.values()))[2]
        n_out = len(modules[0].funcs["main"].result_types)
        results = []
        for i, spec in enumerate(_specs(out_specs, n_out, "out_specs")):
            pieces = [outs[r][i] if outs[r] is not None else None for r in range(mesh.size)]
            results.append(_assemble_output(i, pieces, modules, mesh, spec))
        return tuple(results) if out_is_tuple else results[0]

    return run


def _trace(fn: Callable, mesh: Mesh, args: Sequence, inputs: Sequence, types: Sequence) -> tuple:
    """Trace fn on placeholders of one rank's local argument types into a local-view module."""
    placeholders = [Tensor(t) if t is not None else a for a, t in zip(args, types)]
    prev_meshes = STATE.meshes
    STATE.tracing += 1
    STATE.meshes = {IR_NAME: mesh.ir()}  # collectives in fn record over this mesh (dtm.distributed)
    try:
        with no_grad():
            out = fn(*placeholders)
    finally:
        STATE.tracing -= 1
        STATE.meshes = prev_meshes
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    if not outs or not all(isinstance(o, Tensor) for o in outs):
        raise error(E.RETURN_MISMATCH, f"shard_map: the function must return tensors, found {out!r}")
    params = [p for p in placeholders if isinstance(p, Tensor) and p._buffer is None and p._op is None]
    module, found = capture(outs, params=params)
    captured = found[len(params):]
    for c in captured:
        if c._mesh is not None:
            raise error(E.MESH_MISMATCH, f"shard_map: the function reads a distributed {c._type} from outside; "
                        "pass it as an argument with an in_spec")
    module.meshes[IR_NAME] = mesh.ir()
    return module, captured, isinstance(out, (tuple, list))


def _assemble_output(i: int, pieces: list, modules: list, mesh: Mesh, spec: Any) -> Tensor:
    """Output i as a distributed tensor: its global type from every rank's result type and
    the spec, checked against each of them. (From the types, not the pieces: on a process
    mesh only this rank's piece is here.)"""
    shapes = [tuple(m.funcs["main"].result_types[i][0].shape) for m in modules]
    t0 = modules[0].funcs["main"].result_types[i][0]
    # placements first against the rank-0 type (dims in range), then the global shape
    pl = mesh.placements(spec, t0, f"shard_map output {i} ({t0})")
    shape = list(shapes[0])
    ir_mesh = mesh.ir()
    for a, ((axis, n), p) in enumerate(zip(mesh.axes, pl)):
        if p.kind == "shard":
            along = [r for r in range(mesh.size) if all(c == 0 for b, c in enumerate(coords(ir_mesh, r)) if b != a)]
            shape[p.arg] = sum(shapes[r][p.arg] for r in along)
    t = t0.with_shape(tuple(shape))
    sh = mesh.sharding(pl)
    for r in range(mesh.size):
        want = local_type(t, sh, ir_mesh, coords(ir_mesh, r))
        if tuple(want.shape) != shapes[r]:
            raise error(E.SHAPE_MISMATCH, f"shard_map output {i}: rank {r} returned a piece of shape "
                        f"{list(shapes[r])}, but out_specs {list(pl)} on {mesh} make a {t} whose piece on "
                        f"rank {r} is {list(want.shape)}")
    return Tensor(t, buffer=Shards(mesh, pl, pieces))


__all__ = ["shard_map"]
