"""In-memory snapshots (spec 9.4.12, tier 1 of checkpoints): `snapshot(state)` copies each
rank's pieces of a training state into the memory of `replicas` other ranks, through the
mesh's store (its parts live in /dev/shm), so that losing any one rank loses no state;
`load(state, "mem://")` (dtm.checkpoint.load) restores the newest complete snapshot that
the live ranks hold, laid out as the live tensors are now.

    for step in range(steps):
        train_step()
        dtm.checkpoint.snapshot(state)            # every rank, every step (completes the one before)
    ...
    dtm.checkpoint.load(state, "mem://")          # after a rank was lost: from the survivors

A snapshot costs each rank one copy of the pieces it writes, into one byte array (its blob,
which it keeps), before `snapshot` returns. A rank that holds every piece of another
writer's blob (data-parallel replicas) packs that blob too, from its own pieces: a replica
for a copy in memory (`_mirrors`). What is not mirrored `replicas` times, a background
thread puts, under `snapshot/SLOT/rank-R`, on the next ranks of the ring, while the next
training step runs. When a rank is lost, every survivor publishes the blobs it holds (its
own and its mirrors) into its own part of the store (their replicas may have been on the
lost rank). Every rank computes the same layout (which pieces each rank
writes, where in its blob) from the state alone, so no layout travels. The commit is one
all_gather of a status row per snapshot, in the caller's thread (the training's collectives
are never met from another thread), at the handle's `wait()` or the next `snapshot`: it
checks that every rank's blob is in and that the layouts agree. Each process keeps the
manifests of the newest `KEEP` complete snapshots in its own memory (the manifest of spec
9.4.2 with `pieces` in place of `chunks`); a snapshot's blobs are removed from the peers only
by a later snapshot's put into its slot, once two newer ones are complete: survivors whose
newest differ by one (a rank lost during the all_gather) still share a complete one. A blob's
key names its snapshot's step, never only its slot: a reader waiting for a survivor to
publish a blob must not find another snapshot's under the same key (an adopted snapshot's
blob of slot 0 was once read as a later one's, restoring a mix of two steps).

Layer: row 8 (dtm/ckpt), beside the store; tensors are duck-typed as in dtm/ckpt/__init__.
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from .. import store as _store
from ..errors import DTMError, ErrorCode
from ..ir.dtypes import DType, numpy_dtype
from ..ir.types import TensorType
from ..runtime import process_group
from ..runtime.mesh import Shards
from ..store import sharded
from ..store.crc import checksum as crc32c
from ..store.errors import KeyLost, KeyMissing, StoreCorrupt
from ..store.store import as_distributed, as_store_dtype
from . import manifest as mf
from .errors import CheckpointInvalid, NoSnapshot, SnapshotFailed

__all__ = ["snapshot", "snapshots", "Handle", "URL", "KEEP", "is_memory", "find", "carry", "adopt", "Carried", "publish"]

URL = "mem://"
KEEP = 2        # complete snapshots each process keeps (see the module's docstring)
ALIGN = 64      # each piece starts at a multiple of this many bytes of its blob
PUBLISH_WAIT_S = 30.0  # how long a load waits for a live holder to publish a blob after a loss

Box = sharded.Box


def is_memory(path: Any) -> bool:
    """Whether a load path names the in-memory snapshots."""
    return isinstance(path, str) and path == URL


def blob_key(step: int, owner: int) -> str:
    """The mesh store's key of process rank `owner`'s blob of the snapshot of `step`."""
    return f"snapshot/{step}/rank-{owner}"


@dataclass
class _Held:
    """A complete snapshot as this process holds it: its step, the slot of its blobs'
    keys, its manifest (`tensors` with their `pieces`), the ranks holding each writer's
    blob (the writer first: in its memory, in its store part once a rank is lost), and this
    process's own blob."""

    step: int
    slot: int
    doc: dict
    holders: dict[int, list[int]]
    blobs: dict[int, np.ndarray]
    packing: "_Packing | None" = None  # how this rank packed its blobs (for a later snapshot to reuse)
    in_part: tuple[int, ...] = ()  # the writers whose blobs `adopt` put into this rank's part of the store


class Handle:
    """A snapshot taken: its `step`; `wait()` completes it (on a mesh of processes every
    rank calls it, or the next `snapshot`, which does the same) and raises its error;
    `done()` says whether it is complete or failed."""

    def __init__(self, step: int):
        self.step = step
        self._done = False
        self._error: BaseException | None = None

    def wait(self) -> "Handle":
        ses = _sessions.get(_session(_group()))
        if not self._done and ses is not None and ses.pending is not None and ses.pending.handle is self:
            _finish(ses, _group())
        if self._error is not None:
            raise self._error
        return self

    def done(self) -> bool:
        return self._done

    def __repr__(self) -> str:
        state = "failed" if self._error else "complete" if self._done else "in flight"
        return f"<snapshot step={self.step} {state}>"


@dataclass
class _Pending:
    """A snapshot whose pieces are being put on a background thread: what its commit
    compares (its layout's digest, its slot), the replicas of other ranks' blobs this rank
    packed from its own pieces (`copies`, by writer), and what the thread reports (`took`: the
    ranks holding this rank's blob, `error`)."""

    handle: Handle
    slot: int
    doc: dict | None
    digest: int
    width: int
    blob: np.ndarray | None
    copies: dict[int, np.ndarray]
    packing: "_Packing | None"
    error: BaseException | None = None
    took: list[int] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)  # the ranks of `took` that the blob was put on
    put: threading.Event = field(default_factory=threading.Event)  # set when the puts are done
    replaces: tuple[int, list[int]] | None = None  # (step, ranks) of this rank's blob that last had the slot


@dataclass
class _Session:
    """The snapshots of one mesh (or of this process alone): the complete ones, oldest
    first, and the one in flight."""

    held: list[_Held] = field(default_factory=list)
    pending: _Pending | None = None
    puts: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # (its thread's work: _putter)
    published: set[int] = field(default_factory=set)  # the steps whose own blob is in this rank's part
    # one publication at a time: the loss watcher's thread starts one at the notice and the
    # resize's own call comes while it runs; the second waits for it and finds the steps
    # published (both putting the same blobs doubled a GPT-2 survivor's 2.5 s of copying)
    publishing: threading.Lock = field(default_factory=threading.Lock)
    # the blobs of the snapshot that last dropped out, for the next one to pack into: memory
    # already mapped (a fresh array costs its page faults at every snapshot), and no more
    # than the peak (the kept snapshots and the one being packed) held anyway
    spare: "_Packing | None" = None
    # by slot: the step of this rank's blob that was put there last and the ranks it was put
    # on, which the next put into the slot removes (the store's memory stays KEEP + 1 blobs)
    placed: dict[int, tuple[int, list[int]]] = field(default_factory=dict)


_sessions: dict[str | None, _Session] = {}  # by the mesh's session (None: this process alone)


def _group() -> Any:
    """The process group of a mesh of several processes, else None."""
    if process_group.is_initialized() and process_group.world_size() > 1:
        return process_group.current()
    return None


def _session(pg: Any) -> str | None:
    return None if pg is None else pg.session


def snapshots() -> list[int]:
    """The steps of the complete snapshots this process holds, oldest first."""
    ses = _sessions.get(_session(_group()))
    return [h.step for h in ses.held] if ses is not None else []


# --- taking one ------------------------------------------------------------------------------

def snapshot(state: dict, replicas: int = 1, step: int | None = None) -> Handle:
    """Copy `state` (as dtm.checkpoint.save takes it) into the memory of `replicas` other
    ranks; every rank of a mesh of processes calls it. It copies this rank's pieces (one
    writer per distinct piece, the least loaded of the ranks that hold it) into one array
    before it returns, and puts that on the peers on a background thread: a training step
    runs meanwhile. The snapshot is complete, and `load(state, "mem://")` sees it, once
    every rank's pieces are in, which the ranks agree on (one small all_gather) in the
    handle's `wait()` or the next `snapshot`, whichever comes first; a failure (another
    rank's: E1406) is raised there. The two newest complete snapshots are kept.

    `step` (default: the newest complete snapshot's plus one) must be greater than the
    newest complete snapshot's; a failed step may be taken again. Returns a Handle.

    In one process (no mesh of several processes) there is no other rank: the snapshot is
    a copy in this process's own memory, complete when this returns, which
    `load(state, "mem://")` reads back (a rollback, not a protection against losing the
    process)."""
    pg = _group()
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise DTMError(ErrorCode.ATTRIBUTE_VALUE, f"checkpoint.snapshot: replicas is an int >= 1, not {replicas!r}")
    ses = _sessions.get(_session(pg)) or _new_session(pg)
    _finish(ses, pg)  # the snapshot in flight: complete, or its error raised
    newest = ses.held[-1].step if ses.held else -1
    if step is None:
        step = newest + 1
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not newest < int(step) < 1 << 62:
        raise DTMError(ErrorCode.ATTRIBUTE_VALUE, f"checkpoint.snapshot: step is an int greater than the newest "
                       f"complete snapshot's ({newest}), not {step!r}")
    handle = Handle(int(step))
    world, me = (1, 0) if pg is None else (pg.world_size, pg.rank)
    # the slot no kept snapshot uses: a put into it replaces the blobs of one already dropped
    slot = min(set(range(KEEP + 1)) - {h.slot for h in ses.held})
    width = min(replicas, world - 1)
    err: DTMError | None = None
    digest, doc, blob, mirrors, copies, packing = 0, None, None, {}, {}, None
    try:
        entries, kinds, sources = _walk(state)
        doc, sizes, digest, mirrors, moves = _plan(kinds, sources, world, handle.step, entries, width)
        spare, ses.spare = ses.spare, None
        packing = _pack(moves, sources, me, [me] + [o for o, ranks in mirrors.items() if me in ranks], sizes, spare)
        copies = dict(packing.blobs)
        blob = copies.pop(me)
    except DTMError as e:
        err = e
    except (TypeError, ValueError) as e:  # a value a checkpoint does not hold
        err = DTMError(ErrorCode.ATTRIBUTE_TYPE, f"checkpoint.snapshot: {e}")
    if pg is None:
        if err is not None:
            raise err
        _keep(ses, _Held(handle.step, slot, doc, {0: [0]}, {0: blob}, packing), spare=True)
        handle._done = True
        return handle
    # the other ranks hear of this rank's error at the commit: every rank fails it there
    pending = _Pending(handle, slot, doc, digest, width, blob, copies, packing, error=err,
                       took=[me] + mirrors.get(me, []), replaces=ses.placed.get(slot))
    ses.placed[slot] = (handle.step, pending.sent)
    if err is None and blob.size and len(pending.took) < width + 1:
        ses.puts.put((_put, (pending, blob, me, world)))
    else:
        pending.put.set()
    ses.pending = pending
    return handle


def _new_session(pg: Any) -> _Session:
    """The snapshots of the mesh `pg` is in now (None: this process alone), empty."""
    ses = _sessions[_session(pg)] = _Session()
    if pg is not None:
        # one thread puts every snapshot's blob (one start, not one per step)
        threading.Thread(target=_putter, args=(ses.puts,), name="dtm-snapshot-puts", daemon=True).start()
        if pg.membership is not None:
            pg.membership.watch_lost(lambda r, notice: _publish_soon(ses, pg.rank))
    return ses


def _finish(ses: _Session, pg: Any) -> None:
    """Complete the snapshot in flight, if any: wait for this rank's puts, then one
    all_gather of every rank's status row (its error code, its layout's digest and slot,
    the ranks holding its blob): the commit point. A snapshot that failed anywhere leaves
    the complete ones as they were, and its error is raised (and kept in its handle)."""
    p = ses.pending
    if p is None:
        return
    ses.pending = None
    p.put.wait()
    step, me, kept = p.handle.step, pg.rank, [h.step for h in ses.held]
    err = p.error
    code = 0 if err is None else int(err.code.value[1:]) if isinstance(err, DTMError) else \
        int(ErrorCode.STORE_IO_ERROR.value[1:])
    row = [code, p.digest, p.slot] + p.took + [-1] * (p.width + 1 - len(p.took))
    try:
        rows = pg.all_gather(np.array([row], np.int64), dim=0)  # every blob is in past here
    except DTMError as e:  # a rank lost meanwhile (E1001), a cancel: not complete
        rows, err = None, err or e
    failed = [] if rows is None else np.flatnonzero(rows[:, 0]).tolist()
    differ = [] if rows is None else np.flatnonzero((rows[:, 1:3] != rows[0, 1:3]).any(axis=1)).tolist()
    if rows is None or failed or differ:
        _discard(step, me, [me] + p.sent)
        if err is None and failed:
            codes = ", ".join(f"rank {r}: E{int(rows[r, 0]):04d}" for r in failed)
            err = SnapshotFailed(f"snapshot {step}: {codes} failed, so it is not complete; the earlier snapshots "
                                 f"{kept} are kept")
        elif err is None:
            err = SnapshotFailed(f"snapshot {step}: the state of ranks {differ} differs from rank 0's (other names, "
                                 "shapes, dtypes or placements, or other snapshots kept), so their pieces do not "
                                 f"make one state; nothing is kept of it, the earlier snapshots {kept} are kept")
        elif isinstance(err, DTMError) and not isinstance(err, SnapshotFailed):
            err = err.in_context(f"snapshot {step} was not taken, the earlier snapshots {kept} are kept")
        p.handle._error = err
        p.handle._done = True
        raise err
    holders = {o: [int(h) for h in rows[o, 3:] if h >= 0] for o in range(pg.world_size)}
    # (after a loss, a dropped snapshot's blobs may still be being published: none reused)
    dropped = _keep(ses, _Held(step, p.slot, p.doc, holders, {me: p.blob, **p.copies}, p.packing),
                    spare=pg.membership is None or not pg.membership.lost)
    for owner in dropped.in_part if dropped is not None else ():
        _discard(dropped.step, owner, [me])
    p.handle._done = True
    if pg.membership is not None and pg.membership.lost:
        _publish(ses, me)  # (a rank was lost before: the others may need this one's blob now)


def _keep(ses: _Session, snap: _Held, spare: bool) -> _Held | None:
    """Keep the complete snapshot `snap`, the KEEP newest kept; with `spare`, the blobs of
    the one that drops out are the next snapshot's to pack into. The one that dropped out."""
    kept = ses.held + [snap]
    ses.held = kept[-KEEP:]
    if len(kept) <= KEEP:
        return None
    if spare:
        ses.spare = kept[-KEEP - 1].packing
    return kept[-KEEP - 1]


# What the layout of one tensor of the state depends on: (its name, its store dtype's
# name, its shape, its mesh and placements as `_placed` gives them). A plain tuple: the
# walk makes one per tensor at every snapshot, and the plan compares them all.
Kind = tuple[str, str, tuple[int, ...], "tuple | None"]


def _walk(state: dict) -> tuple[dict, list[Kind], list[Any]]:
    """The manifest's `state` field, each tensor's kind and the live tensors themselves, in
    the order the state names them."""
    if not isinstance(state, dict):
        raise TypeError(f"the state is a dict of named values, not {type(state).__name__}")
    kinds: list[Kind] = []
    sources: list[Any] = []

    def take(name: str, x: Any) -> None:
        kinds.append((name, as_store_dtype(x.dtype).name, tuple(map(int, x.shape)), _placed(x)))
        sources.append(x)

    return mf.encode_state(state, take), kinds, sources


def _plan(kinds: list[Kind], sources: list[Any], world: int, step: int, entries: dict,
          width: int) -> tuple[dict, list[int], int, dict[int, list[int]], list[list[_Move]]]:
    """The snapshot's manifest, the size of each rank's blob, a digest of the layout (which
    the ranks compare), the mirrors of each writer's blob (`_mirrors`, for `width`
    replicas) and each tensor's moves into the blobs (`_moves`). A state whose tensors are
    of the kinds of the previous snapshot's has that snapshot's layout, and its manifest
    the same tensor entries (every step's: they are not changed once made)."""
    shape_of = (world, width, tuple(kinds))
    if _last_plan and _last_plan[0] == shape_of:
        tensors, sizes, meshes, digest, mirrors, moves = _last_plan[1]
    else:
        tensors = [{"name": name, "key": f"t/{i}", "dtype": dtype, "shape": list(shape)}
                   for i, (name, dtype, shape, _) in enumerate(kinds)]
        layouts, sizes, meshes, holding = _layout(tensors, sources, world)
        mirrors = _mirrors(holding, world, width)
        digest = crc32c(json.dumps([shape_of, layouts], sort_keys=True, default=str).encode())
        moves = [_moves(t, layout, x) for t, layout, x in zip(tensors, layouts, sources)]
        for t, layout in zip(tensors, layouts):
            t.update(layout)
        _last_plan[:] = [shape_of, (tensors, sizes, meshes, digest, mirrors, moves)]
    return mf.new(step, entries, tensors, meshes, time.time()), sizes, digest, mirrors, moves


class _Move(NamedTuple):
    """One piece of tensor `name` into a blob: its writer, its bytes' place in the blob, its
    shape and numpy dtype, and which of the tensor's local shards holds it (None: the
    tensor is on no mesh, the whole value; -1: this rank's own, on a process mesh)."""

    name: str
    owner: int
    start: int
    stop: int
    shape: tuple[int, ...]
    npd: np.dtype
    shard: int | None


def _moves(t: dict, layout: dict, x: Any) -> list[_Move]:
    """The moves of the pieces of tensor `t` (`layout`'s; the live tensor `x`) into their
    writers' blobs."""
    npd = numpy_dtype(as_store_dtype(t["dtype"]))
    mesh = layout["mesh"]
    own = mesh is not None and x.device_mesh.process is not None  # a process mesh: this rank's piece
    return [_Move(t["name"], p["owner"], p["offset"], p["offset"] + p["nbytes"], tuple(b - a for a, b in p["box"]), npd,
                  None if mesh is None else -1 if own else p["source"]) for p in layout["pieces"]]


def _mirrors(holding: dict[int, set[int]], world: int, width: int) -> dict[int, list[int]]:
    """{writer: the ranks, at most `width`, that pack a replica of its blob from their own
    pieces}: those of the ranks that hold every piece the writer writes (`holding`), in the
    order of the ring after it. Replicated state (data parallel) is so held: its replicas
    cost a copy in memory each, not a put over the wire and a write on the peer."""
    return {o: [r for r in ((o + k) % world for k in range(1, world)) if r in ranks][:width]
            for o, ranks in holding.items()}


_last_plan: list = []  # [what a state's layout depends on, its layout]: the one of the last snapshot


def _placed(x: Any) -> tuple | None:
    """What the pieces of tensor `x` depend on beside its shape: its mesh and placements."""
    mesh = getattr(x, "device_mesh", None)
    if mesh is None:
        return None
    return tuple(mesh.axes), mesh.process is not None, tuple(x.placements)


def _layout(tensors: list[dict], sources: list[Any], world: int
            ) -> tuple[list[dict], list[int], list[dict], dict[int, set[int]]]:
    """Each tensor's distinct pieces, each with the process rank that writes it (the least
    loaded so far of those that hold it) and its place in that rank's blob; the size of
    each rank's blob; the meshes; {writer: the other ranks that hold every piece it writes}.
    Every rank computes the same."""
    layouts: list[dict] = []
    sizes = [0] * world
    meshes: list[dict] = []
    holding: dict[int, set[int]] = {}
    for t, x in zip(tensors, sources):
        itemsize = as_store_dtype(t["dtype"]).itemsize
        mesh = getattr(x, "device_mesh", None)
        shape = tuple(t["shape"])
        layout: dict[str, Any] = {"nbytes": math.prod(shape) * itemsize, "mesh": None, "placements": None}
        if mesh is None:
            held_by = {tuple((0, n) for n in shape): (list(range(world)), None)}
        else:
            placements = tuple(x.placements)
            if any(p.kind == "partial" for p in placements):
                raise DTMError(ErrorCode.INVALID_PLACEMENT, f"snapshot: tensor {t['name']!r} is partial "
                               f"({list(placements)} on {mesh}), so no rank's piece is its value; reduce it first")
            layout["mesh"] = {"axes": [[a, n] for a, n in mesh.axes]}
            layout["placements"] = [str(p) for p in placements]
            if layout["mesh"] not in meshes:
                meshes.append(layout["mesh"])
            held_by = {}
            for r, box in enumerate(sharded.boxes(shape, mesh, placements)):
                if all(a < b for a, b in box):
                    # a process mesh's rank r is process r; a mesh of local devices is in every process,
                    # whose `source` is the lowest of its devices that holds the piece
                    procs, src = held_by.setdefault(box, ([] if mesh.process is not None else list(range(world)), r))
                    if mesh.process is not None:
                        procs.append(r)
        layout["pieces"] = []
        for box, (procs, src) in held_by.items():
            nbytes = math.prod(b - a for a, b in box) * itemsize
            owner = min(procs, key=lambda p: (sizes[p], p))
            holding[owner] = holding.get(owner, set(range(world)) - {owner}) & set(procs)
            layout["pieces"].append({"box": [list(b) for b in box], "owner": owner, "offset": sizes[owner],
                                     "nbytes": nbytes, "source": src})
            sizes[owner] += -(-nbytes // ALIGN) * ALIGN
        layouts.append(layout)
    return layouts, sizes, meshes, holding


class _Packing(NamedTuple):
    """A rank's blobs of one snapshot, by writer, and the copies that pack them: for each
    tensor of the state, (which of its local arrays, the piece's view in its blob, the
    move), made for the layout's `moves`. A later snapshot of the same layout packs into
    the same blobs through the same views (`_keep`'s spare): made once, not at every step."""

    moves: list[list[_Move]]
    blobs: dict[int, np.ndarray]
    copies: list[list[tuple[int, np.ndarray, _Move]]]


def _pack(moves: list[list[_Move]], sources: list[Any], me: int, owners: list[int], sizes: list[int],
          spare: _Packing | None) -> _Packing:
    """The blobs of writers `owners` packed by this rank (`me`) from its own pieces, in one
    pass over the state (`sources`, each tensor's `moves`): the bytes of every piece each
    writes, at its offset (this rank holds each of them: its own blob, and those it mirrors,
    see `_mirrors`); into the `spare` blobs where they have the size."""
    reuse = spare is not None and spare.moves is moves and sorted(spare.blobs) == sorted(owners)
    packing = spare if reuse else _packing(moves, me, owners, sizes, spare)
    for x, copies in zip(sources, packing.copies):
        if not copies:
            continue
        if copies[0][2].shard is None:  # (on no mesh: the whole value)
            arrays = [x.numpy() if callable(getattr(x, "numpy", None)) else x]
        else:
            arrays = mf.local_arrays(x)
        for i, dst, m in copies:
            src = np.asarray(arrays[i])
            if src.shape != m.shape:
                raise DTMError(ErrorCode.SHAPE_MISMATCH, f"snapshot: tensor {m.name!r}: this rank's piece is "
                               f"{list(src.shape)}, its placements say {list(m.shape)}")
            if src.dtype == dst.dtype:
                dst[...] = src  # (a third of np.copyto's call: 156 tensors a step)
            else:
                np.copyto(dst, src, casting="same_kind")
    return packing


def _packing(moves: list[list[_Move]], me: int, owners: list[int], sizes: list[int],
             spare: _Packing | None) -> _Packing:
    """The blobs of writers `owners` (each the `spare` one when that has its size, else a
    new array) and the views of `moves`' pieces in them, each with the local array it is
    copied from (see _Move.shard)."""
    old = spare.blobs if spare is not None else {}
    blobs = {o: old[o] if o in old and old[o].size == sizes[o] else np.empty(sizes[o], np.uint8) for o in owners}
    copies = [[(0 if m.shard is None else me if m.shard < 0 else m.shard,
                _view(blobs[m.owner], m.start, m.stop, m.npd, m.shape), m) for m in todo if m.owner in blobs]
              for todo in moves]
    return _Packing(moves, blobs, copies)


def _view(blob: np.ndarray, start: int, stop: int, npd: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A piece's bytes `start:stop` of `blob` as an array of its dtype and shape."""
    return blob[start:stop].view(npd).reshape(shape)


def _putter(work: queue.SimpleQueue) -> None:
    """A session's thread: runs each (function, arguments) put on `work`, one at a time."""
    while True:
        fn, args = work.get()
        fn(*args)


def _put(p: _Pending, blob: np.ndarray, me: int, world: int) -> None:
    """On the session's thread: put this rank's blob on the next `p.width` ranks of the
    ring that take it (a lost one is passed over for the next); records the ranks that hold
    it, this one first (its own copy stays in its memory: `_publish`), or the error."""
    st = _store.mesh()
    key = blob_key(p.handle.step, me)
    try:
        if p.replaces is not None:  # (dropped on every rank by now: two newer snapshots are complete)
            _discard(p.replaces[0], me, p.replaces[1])
        for k in range(1, world):
            if len(p.took) == p.width + 1:
                break
            r = (me + k) % world
            if r in p.took:  # (a mirror: it packed this blob itself)
                continue
            try:
                st.put_array(key, blob, ranks=[r])
            except DTMError as e:
                if e.code is not ErrorCode.PEER_LOST:
                    raise
                continue
            p.took.append(r)
            p.sent.append(r)
        if len(p.took) < p.width + 1:
            raise DTMError(ErrorCode.PEER_LOST, f"{key}: only ranks {p.took[1:]} of the {world - 1} others could "
                           f"take this rank's pieces, {p.width} were asked for")
    except BaseException as e:  # noqa: BLE001 - raised by the commit, in the caller's thread
        p.error = e
    finally:
        p.put.set()


def _publish_soon(ses: _Session, me: int) -> None:
    """The membership's word (on its heartbeat thread, which must not block) that a rank
    was lost: publish this rank's blobs on a thread of their own."""
    threading.Thread(target=_publish, args=(ses, me), name="dtm-snapshot-publish", daemon=True).start()


def _publish(ses: _Session, me: int) -> None:
    """Put the blobs this rank keeps in its memory of each kept snapshot (its own, and the
    mirrors it packed of other writers') into its own part of the mesh's store: while every
    rank lives they stay in this process's memory alone (a rank that needs one reads a
    replica), but once a rank is lost a survivor's only replica may have been on it, and
    the other survivors read the blob here."""
    with ses.publishing:
        for snap in list(ses.held):
            if snap.step in ses.published:
                continue
            try:
                for owner, blob in snap.blobs.items():
                    if blob.size:
                        _store.mesh().put_array(blob_key(snap.step, owner), blob, ranks=[me])
                ses.published.add(snap.step)
            except DTMError:
                pass  # (its readers wait for it, bounded, then name the missing blob)


def _discard(step: int, owner: int, ranks: list[int]) -> None:
    """Remove `owner`'s blob of the snapshot of `step` from `ranks` (what a snapshot that
    failed left, or one that dropped out); ranks lost meanwhile hold nothing any more."""
    if not ranks:
        return
    try:
        _store.mesh().delete(blob_key(step, owner), ranks=ranks)
    except (KeyMissing, KeyLost):
        pass
    except DTMError as e:
        if e.code is not ErrorCode.PEER_LOST:
            raise


# --- reading one back ------------------------------------------------------------------------

def _get_blob(step: int, owner: int, ranks: list[int], hopeless: Callable[[], bool]) -> np.ndarray:
    """Writer `owner`'s blob of the snapshot of `step` from the first of `ranks` that has it.
    A live holder that keeps it in memory publishes it once it hears of a loss (`_publish`),
    so a missing blob is waited for, at most PUBLISH_WAIT_S, until `hopeless()`; then the
    last KeyMissing or KeyLost."""
    deadline = time.monotonic() + PUBLISH_WAIT_S
    while True:
        try:
            return _store.mesh().get_array(blob_key(step, owner), ranks=ranks)
        except (KeyMissing, KeyLost):
            if hopeless() or time.monotonic() > deadline:
                raise
        time.sleep(0.01)


class Reader:
    """A complete snapshot chosen for a load: `where` names it, `doc` is its manifest,
    `read(t, like)` gives tensor entry `t` laid out like the live tensor `like` (`read_many`
    a list of them)."""

    def __init__(self, snap: _Held, pg: Any):
        self.snap, self.pg = snap, pg
        self.where = f"{URL} (snapshot {snap.step})"
        self.doc = snap.doc
        self._blobs: dict[int, np.ndarray] = dict(snap.blobs)

    def read(self, t: dict, like: Any) -> Any:
        """Tensor `t` laid out by `like`'s mesh and placements (each rank assembling only the
        pieces it holds, from the saved pieces they overlap); a whole numpy array when
        `like` is not distributed."""
        dt = as_store_dtype(t["dtype"])
        shape = tuple(t["shape"])
        mesh = getattr(like, "device_mesh", None) if like is not None else None
        if mesh is None:
            return self._assemble(t, dt, tuple((0, n) for n in shape))
        placements = tuple(like.placements)
        if any(p.kind == "partial" for p in placements):
            raise DTMError(ErrorCode.INVALID_PLACEMENT, f"load {t['name']!r}: {list(placements)} on {mesh}: a live "
                           "tensor that is partial cannot receive a saved value; shard or replicate it")
        pieces: list[Any] = [None] * mesh.size
        for r, box in enumerate(sharded.boxes(shape, mesh, placements)):
            if mesh.process is None or r == mesh.rank:
                pieces[r] = self._assemble(t, dt, box)
        return as_distributed(TensorType(dt, shape), Shards(mesh, placements, pieces))

    def read_many(self, todo: list[tuple[dict, Any]]) -> list[Any]:
        """`read` of each (t, like), in order (no collective: each rank assembles its own)."""
        return [self.read(t, like) for t, like in todo]

    def _assemble(self, t: dict, dt: DType, box: Box) -> np.ndarray:
        """The box of tensor `t` from the saved pieces that overlap it."""
        npd = numpy_dtype(dt)
        out = np.empty(tuple(b - a for a, b in box), npd)
        filled = 0
        for p in t["pieces"]:
            inter = [(max(a, pa), min(b, pb)) for (a, b), (pa, pb) in zip(box, p["box"])]
            if any(a >= b for a, b in inter):
                continue
            src = _view(self._blob(p["owner"]), p["offset"], p["offset"] + p["nbytes"], npd,
                        tuple(b - a for a, b in p["box"]))
            out[tuple(slice(a - s, b - s) for (a, b), (s, _) in zip(inter, box))] = \
                src[tuple(slice(a - s, b - s) for (a, b), (s, _) in zip(inter, p["box"]))]
            filled += math.prod(b - a for a, b in inter)
        if filled != out.size:
            raise CheckpointInvalid(f"{self.where}: tensor {t['name']!r}: its pieces cover {filled} of the "
                                    f"{out.size} elements of box {[list(b) for b in box]}", URL)
        return out

    def _blob(self, owner: int) -> np.ndarray:
        """Writer `owner`'s blob: this rank's own from its memory, another's from the first
        of its holders that has it. A live holder that keeps it in memory (the writer, or a
        mirror of a lost writer's) publishes it (`_publish`) once it hears of a loss: waited
        for while any holder lives, at most PUBLISH_WAIT_S. (Waiting only while the writer
        lived failed a load whose writer was lost before its live mirror had published.)"""
        if owner in self._blobs:
            return self._blobs[owner]
        holders = self.snap.holders[owner]
        try:
            self._blobs[owner] = _get_blob(self.snap.step, owner, holders,
                                           lambda: all(r in _gone(self.pg) for r in holders))
        except (KeyMissing, KeyLost) as e:
            raise NoSnapshot(f"{self.where}: the pieces of rank {owner} are held by none of ranks {holders} "
                             f"(lost: {sorted(_gone(self.pg))}; waited up to {PUBLISH_WAIT_S:.0f} s for a live "
                             f"one to publish them): {e}") from None
        return self._blobs[owner]

    def close(self) -> None:
        self._blobs.clear()


def find(step: int | None = None) -> Reader:
    """The newest complete snapshot this process holds (or the one of `step`) whose every
    blob some live rank still holds; E1405 when there is none."""
    pg = _group()
    ses = _sessions.get(_session(pg))
    held = ses.held if ses is not None else []
    chosen = [h for h in held if step is None or h.step == step]
    if not chosen:
        raise NoSnapshot("this process holds no complete in-memory snapshot"
                         + (f" of step {step}; it holds steps {[h.step for h in held]}" if step is not None and held
                            else " (take one with dtm.checkpoint.snapshot(state) on every rank)"))
    gone = _gone(pg)
    lost: list[str] = []
    for snap in reversed(chosen):
        missing = [o for o, ranks in snap.holders.items() if ranks and all(r in gone for r in ranks)]
        if not missing:
            return Reader(snap, pg)
        lost.append(f"snapshot {snap.step}: the pieces of ranks {missing} (held by "
                    f"{[snap.holders[o] for o in missing]})")
    raise NoSnapshot(f"every complete in-memory snapshot this process holds lost pieces with all their replicas "
                     f"(lost ranks {sorted(gone)}): " + "; ".join(lost))


def _gone(pg: Any) -> set[int]:
    """The ranks lost or left: they hold nothing any more."""
    m = pg.membership if pg is not None else None
    return set() if m is None else set(m.lost) | set(m.left)


# --- across a live resize (dtm/elastic) -------------------------------------------------------

@dataclass
class Carried:
    """A complete snapshot as one rank carries it from one epoch of its mesh into the next:
    its step and manifest, and the blobs this rank holds of it by writer (process rank in
    the old epoch): its own, and the replicas in its part of the old epoch's store."""

    step: int
    doc: dict
    blobs: dict[int, np.ndarray]


def publish() -> None:
    """Put this rank's own blobs of the snapshots it holds into its part of the store now
    (what a loss starts on a thread of its own), so that a survivor can `carry` them."""
    pg = _group()
    ses = _sessions.get(_session(pg))
    if pg is not None and ses is not None:
        _publish(ses, pg.rank)


def carry(everything: bool = False) -> list[Carried]:
    """Before this rank leaves an epoch of its mesh: every complete snapshot it holds, with
    the blobs it has of each (read from its own part of the store, which closes with the
    epoch). With `everything`, also every other blob a live rank holds, fetched from it:
    the lowest survivor of a loss does this, since the next epoch may have no place for the
    ranks that hold the only copies (the new shape's spares end)."""
    pg = _group()
    ses = _sessions.pop(_session(pg), None)
    if ses is None:
        return []
    if pg is None:  # a mesh resized down to this one process: its snapshots are in its own memory
        return [Carried(h.step, h.doc, dict(h.blobs)) for h in ses.held]
    _finish_quietly(ses, pg)
    out = []
    gone = _gone(pg)
    held, ses.held = ses.held, []  # (its loss watcher must publish nothing into the next epoch's store)
    for snap in held:
        blobs = dict(snap.blobs)
        for owner, ranks in snap.holders.items():
            live = [r for r in ranks if r not in gone]
            fetch = [pg.rank] if pg.rank in ranks else live if everything else []
            if owner in blobs or not fetch:
                continue
            try:  # (from this rank's own part, its put may not have landed: another holder may have it)
                blobs[owner] = _get_blob(snap.step, owner, fetch, lambda: not everything)
            except (KeyMissing, KeyLost, StoreCorrupt):  # (a dead writer's version collected as it was read)
                continue  # this snapshot lacks the blob here: adopt() takes one that has all, or says none does
        out.append(Carried(snap.step, snap.doc, blobs))
    return out


def _writers(doc: dict) -> list[int]:
    """The ranks whose blobs a snapshot's manifest reads pieces from."""
    return sorted({p["owner"] for t in doc["tensors"] for p in t.get("pieces", [])})


def _adopt_alone(carried: list[Carried]) -> int:
    """`adopt` on a mesh resized down to one process: the newest snapshot it carried with
    every writer's blob (no peer can hold the rest) becomes its one snapshot, read from its
    own memory as one process's snapshots are."""
    for c in sorted(carried, key=lambda c: -c.step):
        writers = _writers(c.doc)
        if all(o in c.blobs for o in writers):
            ses = _sessions.get(None) or _new_session(None)
            ses.held = [_Held(c.step, 0, c.doc, {o: [0] for o in writers}, dict(c.blobs))]
            return c.step
    lacking = {c.step: [o for o in _writers(c.doc) if o not in c.blobs] for c in carried}
    raise NoSnapshot("the mesh is one process now, which holds no complete snapshot: "
                     + ("; ".join(f"snapshot {s} lacks the pieces of ranks {r}" for s, r in lacking.items())
                        or "it carried none"))


def _finish_quietly(ses: _Session, pg: Any) -> None:
    """Complete the snapshot in flight if the mesh still can; one that cannot is not kept."""
    try:
        _finish(ses, pg)
    except DTMError:
        pass


def adopt(carried: list[Carried]) -> int:
    """In the new epoch, every rank (those that carried snapshots and those that joined with
    none): agree on the newest step that every carrier holds, learn its manifest from new
    rank 0, learn who holds which blob (one all_gather), and put each blob that some rank
    lacks into the store part of one of its holders (`_putters`), so that
    `load(state, "mem://")` reads it laid out on the new mesh (on a mesh resized down to one
    process: `_adopt_alone`). Returns its step. E1405 when no step is held by every carrier
    or a writer's blob is held by no rank."""
    pg = _group()
    if pg is None:
        return _adopt_alone(carried)
    steps = np.full((1, KEEP), -1, np.int64)
    mine = sorted(c.step for c in carried)[-KEEP:]
    steps[0, :len(mine)] = mine
    every = pg.all_gather(steps, dim=0)
    carriers = [set(int(s) for s in row if s >= 0) for row in every]
    common = set.intersection(*[c for c in carriers if c]) if any(carriers) else set()
    if not common:
        raise NoSnapshot(f"no in-memory snapshot is held by every rank that carried one into epoch {pg.epoch}: "
                         f"their steps are {[sorted(c) for c in carriers]}")
    step = max(common)
    chosen = next((c for c in carried if c.step == step), None)
    text = json.dumps(chosen.doc).encode() if chosen is not None and pg.rank == 0 else b""
    size = int(pg.broadcast(np.array([len(text)], np.int64), src=0)[0])
    doc_bytes = pg.broadcast(np.frombuffer(text, np.uint8) if pg.rank == 0 else np.empty(size, np.uint8), src=0)
    doc = json.loads(doc_bytes.tobytes())
    writers = _writers(doc)
    width = max(writers, default=-1) + 1
    blobs = chosen.blobs if chosen is not None else {}
    row = np.zeros((1, max(width, 1)), np.int64)
    for owner in blobs:
        if owner < width:
            row[0, owner] = 1
    held = pg.all_gather(row, dim=0)
    holders = {o: [int(r) for r in np.flatnonzero(held[:, o])] for o in writers}
    missing = [o for o, ranks in holders.items() if not ranks]
    if missing:
        raise NoSnapshot(f"snapshot {step}: the pieces written by ranks {missing} of the last epoch are held by no "
                         f"rank of epoch {pg.epoch}")
    putters = _putters(doc, holders, pg.world_size)
    mine = tuple(o for o, r in putters.items() if r == pg.rank and blobs[o].size)
    for owner in mine:  # (a reader that lacks one waits for it, bounded: its key names this snapshot alone)
        _store.mesh().put_array(blob_key(step, owner), blobs[owner], ranks=[pg.rank])
    for owner, r in putters.items():  # the one that put it first: a reader tries the holders in order
        holders[owner] = [r] + [h for h in holders[owner] if h != r]
    ses = _sessions.get(_session(pg)) or _new_session(pg)
    # (slot 0: the next snapshots take 1 and 2, then 0 once this one dropped out and its
    # blobs left this rank's part)
    ses.held = [_Held(step, 0, doc, holders, dict(blobs), in_part=mine)]
    return step


def _putters(doc: dict, holders: dict[int, list[int]], world: int) -> dict[int, int]:
    """{writer: the rank that puts its blob into its store part}, for each writer whose blob
    some rank of the new epoch lacks: of its holders, the one with the fewest bytes to put so
    far (ties: the lowest), writers taken from the largest blob. A blob every rank holds is
    read from memory only and put nowhere (spec 9.6.7, "Moving the state", step 4)."""
    size = {}
    for t in doc["tensors"]:
        for p in t.get("pieces", []):
            size[p["owner"]] = max(size.get(p["owner"], 0), p["offset"] + p["nbytes"])
    load = [0] * world
    out = {}
    for owner in sorted(holders, key=lambda o: (-size.get(o, 0), o)):
        if len(holders[owner]) < world:
            r = min(holders[owner], key=lambda h: (load[h], h))
            out[owner] = r
            load[r] += size.get(owner, 0)
    return out
