"""Checkpoints (spec 9.4): `save` a training state (objects with state_dict(), tensors,
plain values) into a directory, `load` it back in place onto whatever mesh and placements
the live tensors have now, `list` the complete ones.

    h = dtm.checkpoint.save({"model": m, "optim": opt, "step": 100}, "runs/a", step=100)
    h.wait()                                     # or h.done(), h.progress()
    dtm.checkpoint.load(state, "runs/a")         # the newest complete checkpoint
    dtm.checkpoint.list("runs/a")                # [Checkpoint(step, time, size, mesh, ...)]
    dtm.checkpoint.snapshot(state)               # in the memory of another rank (snapshot.py)
    dtm.checkpoint.load(state, "mem://")         # the newest complete snapshot

Layout: ROOT/step-NNNNNNNNNNNN/ is a directory tensor store (dtm/store: Zarr v3 arrays with
CRC32C chunks, every tensor an array, none inline), and its `manifest.json`, written last
(temporary name, fsync, rename, fsync), is the commit point: a step directory without it
is an unfinished save, which list and load do not see. A distributed tensor is put piece by
piece by the ranks that hold it (dtm/store/sharded.py) and got back with the live tensor's
mesh and placements, each rank reading only the chunks its piece overlaps.

Layer: `dtm/ckpt` is row 8 of docs/architecture.md's table. It imports the store, the runtime's
process group, `dtm/ir` and `dtm/errors`, and never the user-facing API: tensors, modules
and optimizers are duck-typed (`shape`, `dtype`, `numpy()`, `device_mesh`, `placements`,
`local_shards()`, `state_dict()`, `load_state_dict()`, `copy_()`).
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import os
import re
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from .. import store as _store
from ..errors import DTMError, ErrorCode
from ..runtime import process_group
from ..protocol import checksums
from ..store import format as fmt
from ..store.crc import checksum as _crc
from ..store.errors import ChecksumError, KeyMissing, StoreCorrupt, StoreIOError
from ..store import sharded
from ..store.keys import version_dir
from ..store.store import as_store_dtype
from . import agree
from . import manifest as mf
from . import progress as _progress
from . import snapshot as _snapshot
from .snapshot import snapshot
from .lock import SaveLock
from .place import Place
from .errors import (CheckpointChunkError, CheckpointError, CheckpointExists, CheckpointInvalid, CheckpointKeyError,
                     CheckpointTypeError, CheckpointVersionError, NoSnapshot, NotACheckpoint, SnapshotFailed)

__all__ = ["save", "load", "snapshot", "list", "verify", "export", "read_manifest", "Handle", "Checkpoint", "VerifyReport",
           "CheckpointError", "NotACheckpoint", "CheckpointInvalid", "CheckpointVersionError", "CheckpointExists",
           "CheckpointChunkError", "CheckpointKeyError", "CheckpointTypeError", "NoSnapshot", "SnapshotFailed"]

_list = list  # (the module's `list` is the function below)
_STEP_DIR = re.compile(r"^step-(\d{12})$")
WRITER_NICE = 10  # a background save's thread where SCHED_IDLE is missing: the training's steps beside it come first
# While nobody waits for a save (wait(), the next save, the program's exit), its writer rests
# after each tensor this many times as long as the tensor took to write (at most REST_S): the
# training beside it shares the cores, memory and GIL less; a wait ends the rest at once.
REST = 1.0
REST_S = 0.25


def step_dir_name(step: int) -> str:
    return f"step-{step:012d}"


# --- saving -----------------------------------------------------------------------------

class _Frozen:
    """A copy of a distributed tensor's pieces taken when `save` was called, with what the
    store's sharded put reads (duck-typed as dtm/store/sharded.py expects)."""

    def __init__(self, x: Any):
        self.device_mesh = x.device_mesh
        self.placements = tuple(x.placements)
        self.dtype, self.shape = x.dtype, tuple(x.shape)
        self._pieces = [None if s is None else np.array(s, copy=True) for s in mf.local_arrays(x)]

    def local_shards(self) -> _list:
        return self._pieces


@dataclass
class _Item:
    name: str
    key: str
    value: Any          # a _Frozen, or a numpy copy
    dtype: Any
    nbytes: int


class Handle:
    """A save in progress: `wait()` until it is complete (raising its error), `done()`,
    `progress()` (the fraction of the bytes written, 1.0 when committed)."""

    def __init__(self, path: str, step: int, total: int):
        self.path, self.step = path, step
        self._total, self._written = max(total, 1), 0
        self._done = threading.Event()
        self._hurry = threading.Event()  # someone waits for it: the writer no longer rests
        self._error: BaseException | None = None
        self._delivered = False
        self._thread: threading.Thread | None = None

    @property
    def step_dir(self) -> str:
        """The step directory (path or URL) this save writes."""
        return f"{self.path}/{step_dir_name(self.step)}"

    def _finish(self) -> BaseException | None:
        """Wait for the save, hurrying its writer; its error when nobody was given it yet
        (which is then given)."""
        self._hurry.set()
        self._done.wait()
        if self._error is None or self._delivered:
            return None
        self._delivered = True
        return self._error

    def wait(self, timeout: float | None = None) -> "Handle":
        self._hurry.set()
        if not self._done.wait(timeout):
            raise DTMError(ErrorCode.TIMEOUT, f"the save of step {self.step} into {self.path} was not done within "
                           f"{timeout} s ({self.progress():.0%} written)")
        if self._error is not None:
            self._delivered = True
            raise self._error
        return self

    def done(self) -> bool:
        return self._done.is_set()

    def progress(self) -> float:
        return 1.0 if self._done.is_set() and self._error is None else min(self._written / self._total, 0.99)

    def __repr__(self) -> str:
        state = "failed" if self._error else "done" if self.done() else f"{self.progress():.0%}"
        return f"<checkpoint save step={self.step} {self.path} {state}>"


_last: Handle | None = None
_last_lock = threading.Lock()


def _finish_at_exit() -> None:
    """A save still being written when the program ends is finished first (its writer's
    waits are bounded), so that a program that saves and exits keeps its checkpoint; an
    error nobody waited for is printed."""
    error = _last._finish() if _last is not None else None
    if error is not None:
        print(f"dtm.checkpoint: {error}", file=sys.stderr)


# Run at exit before concurrent.futures refuses new work (its own hook of this kind), which
# the writer's batched syncs and CRCs still need; plain atexit hooks run after that.
getattr(threading, "_register_atexit", atexit.register)(_finish_at_exit)


def _process_group():
    """The process group of a mesh of several processes, else None."""
    if process_group.is_initialized() and process_group.world_size() > 1:
        return process_group.current()
    return None


def save(state: dict, path: str | os.PathLike, step: int, keep: int | None = None,
         progress: bool | None = None) -> Handle:
    """Save `state` ({name: an object with state_dict(), a tensor, or a plain value}) as
    checkpoint `step` under directory `path`; every rank calls it. The values are copied
    before it returns; the files are written by a background thread, in one process and
    on a mesh of processes alike (there with no collective: spec 9.4.11). `keep=N` removes
    all but the newest N complete checkpoints once this one is complete, and before it
    starts what an earlier save killed before its own removal left (so no more than N + 1
    ever stay). `progress`: a bar
    on rank 0's stderr once a save has run 2 s (None: when stderr is a terminal). Raises the
    error of an earlier save that failed and was not waited for."""
    global _last
    if not isinstance(state, dict):
        raise DTMError(ErrorCode.ATTRIBUTE_TYPE, f"checkpoint.save takes a dict of named state, not "
                       f"{type(state).__name__}")
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 0 <= int(step) < 10 ** 12:
        raise DTMError(ErrorCode.ATTRIBUTE_VALUE, f"checkpoint.save: step is an int from 0 to 10**12 - 1, not {step!r}")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise DTMError(ErrorCode.ATTRIBUTE_VALUE, f"checkpoint.save: keep is None or an int >= 1, not {keep!r}")
    with _last_lock:
        previous, _last = _last, None
    error = previous._finish() if previous is not None else None
    if error is not None:
        raise error
    root = Place.of(path).url
    items: _list[_Item] = []
    meshes: _list[dict] = []

    def take(name: str, x: Any) -> None:
        mesh = getattr(x, "device_mesh", None)
        if mesh is not None:
            value = _Frozen(x)
            desc = {"axes": [[a, n] for a, n in mesh.axes]}
            if desc not in meshes:
                meshes.append(desc)
        else:
            value = np.array(x.numpy() if callable(getattr(x, "numpy", None)) else x, copy=True)
        dt = as_store_dtype(x.dtype)
        items.append(_Item(name, f"t/{len(items)}", value, dt, fmt.plan(dt, tuple(x.shape)).nbytes))

    try:
        entries = mf.encode_state(state, take)
    except TypeError as e:
        raise DTMError(ErrorCode.ATTRIBUTE_TYPE, f"checkpoint.save: {e}") from None
    h = Handle(root, int(step), sum(i.nbytes for i in items))
    pg = _process_group()
    lock, seed = _start(h, pg)
    if not h.done():
        h._thread = threading.Thread(target=_write, args=(h, keep, entries, items, meshes, pg, lock, seed),
                                     name=f"dtm-checkpoint-{step}", daemon=True)
        h._thread.start()
        if (pg is None or pg.rank == 0) and _progress.wanted(progress):
            _progress.watch(h)
    with _last_lock:
        _last = h
    return h



def _start(h: Handle, pg: Any) -> tuple[SaveLock | None, int]:
    """What a save does before it returns, beside the copies: process rank 0 prepares the
    step directory (`_prepare`); on a mesh of processes one all_gather, in the caller's
    thread like every collective of the training, tells every rank whether it did and
    carries rank 0's draw of the version directories' ids. A failure is recorded in `h`."""
    step_dir = h.step_dir
    lock, err = None, None
    if pg is None or pg.rank == 0:
        try:
            lock = _prepare(h)
        except DTMError as e:
            err = e
    seed = secrets.randbits(63)
    if pg is not None:
        try:
            row = pg.all_gather(np.array([[0 if err is None else 1, seed]], np.int64), dim=0)[0]
        except DTMError:  # (the job's cancel, a lost rank): no save, and nothing of it is left
            if lock is not None:
                Place.of(step_dir).remove_tree()
                lock.release()
            raise
        if row[0] and err is None:
            err = DTMError(ErrorCode.STORE_IO_ERROR, f"process rank 0 could not prepare {step_dir}")
        seed = int(row[1])
    if err is not None:
        _record(h, err)
        h._done.set()
    return lock, seed


def _record(h: Handle, e: BaseException) -> None:
    """Record error `e` as the outcome of save `h`, named for the checkpoint (E1104 for an OSError;
    the job's cancel, whatever error it caused on this rank or another, spec 9.4.10)."""
    cancel = process_group.cancelled()
    if cancel is not None:
        cause, e = e, cancel.during(f"the save of checkpoint step {h.step} into {h.path}, which was not saved: "
                                    "the earlier checkpoints are kept")
        e.__cause__ = cause
    elif isinstance(e, OSError):
        e = StoreIOError(f"checkpoint step {h.step} was not saved, the earlier checkpoints are kept: "
                         f"{e.strerror or e}", e.filename or h.path)
    elif isinstance(e, DTMError) and not isinstance(e, CheckpointError):
        e = e.in_context(f"checkpoint step {h.step} into {h.path} was not saved, the earlier checkpoints are kept")
    h._error = e


def _write(h: Handle, keep: int | None, entries: dict, items: _list[_Item], meshes: _list[dict], pg: Any,
           lock: SaveLock | None, seed: int) -> None:
    """Write checkpoint `h.step` into the directory `_start` prepared (spec 9.4.3), on a
    background thread, and record the outcome in `h`. On a mesh of processes no collective
    runs here: each rank writes its pieces and the ranks agree through files (agree.py)."""
    root, step = h.path, h.step
    lead = pg is None or pg.rank == 0
    step_dir = h.step_dir
    _yield_cpu()
    st = None
    try:
        if lead and keep is not None:  # what an earlier save killed before its own prune left: at most keep + 1 stay
            _prune(root, keep)
        try:
            infos: _list[Any] = []
            pieces: _list[tuple[str, fmt.Layout, int] | None] = []  # a distributed tensor's version, layout, CRC part
            err = None
            try:  # (on a mesh, every failure of this rank's part is reported to the others)
                st = _store.open(step_dir, inline_bytes=0, durable=False)  # synced in batches below
                pending: _list[tuple[int, Any]] = []  # (item, its version written, committed below)
                for i, it in enumerate(items):
                    info, piece, t0 = None, None, time.perf_counter()
                    if isinstance(it.value, _Frozen) and it.value.device_mesh.process is not None:
                        piece = _write_pieces(st, it, version_dir(it.key, (seed + i) % (1 << 63)))
                    elif isinstance(it.value, _Frozen) and lead:  # (on local devices: no collective)
                        info = st.put(it.key, it.value, it.dtype)
                    elif lead:
                        pending.append((i, st.put_array(it.key, it.value, it.dtype, commit=False)))
                    infos.append(info)
                    pieces.append(piece)
                    h._written += it.nbytes
                    st.start_sync()  # (the files' writeback beside the next tensors' writes)
                    if not h._hurry.is_set():
                        h._hurry.wait(min((time.perf_counter() - t0) * REST, REST_S))
                if pending:  # one index transaction for them all, not one per tensor
                    for (i, _), entry in zip(pending, st.commit_pending([p for _, p in pending])):
                        infos[i] = entry
                st.sync()  # this rank's files, before its status says they are written
            except (DTMError, OSError) as e:
                if pg is None:
                    raise
                err = _as_dtm_error(e, step_dir)
            if pg is not None:
                _agree(st, step_dir, items, infos, pieces, err, pg)
            if lead:
                st.sync()  # what the commits of the distributed tensors wrote, before the manifest
                tensors = [_tensor_entry(step_dir, it, info) for it, info in zip(items, infos)]
                mf.write(step_dir, mf.new(step, entries, tensors, meshes, time.time()))
        finally:
            if st is not None:
                st.close()
        if lead and keep is not None:
            _prune(root, keep)
    except BaseException as e:  # noqa: BLE001 - recorded, raised by wait() and the next save
        if lock is not None and not Place.of(step_dir).exists(mf.MANIFEST):
            Place.of(step_dir).remove_tree()
        _record(h, e)
    finally:
        if lock is not None:
            lock.release()
        h._done.set()


def _yield_cpu() -> None:
    """Make the calling (writer) thread run only on CPU time the training leaves idle:
    SCHED_IDLE where the system schedules threads so (Linux), else a nice of WRITER_NICE;
    the threads it starts (the batched syncs) inherit it. A nice of 10 still took a tenth
    of a busy core: a step of the char model beside a GPT-2 save took 1.10-1.20x its time,
    1.04-1.06x with SCHED_IDLE. A save someone waits for is not slowed: the waiting
    thread leaves its core idle."""
    me = threading.get_native_id()
    try:
        os.sched_setscheduler(me, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):  # (no such policy here, or not allowed: a nice value then)
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, me, WRITER_NICE)
    except (AttributeError, OSError):  # (no per-thread priority here, or not allowed: the save goes on)
        pass


def _as_dtm_error(e: DTMError | OSError, where: str) -> DTMError:
    """An OSError as E1104 naming its file (else `where`); a DTMError as it is."""
    return e if isinstance(e, DTMError) else StoreIOError(str(e.strerror or e), e.filename or where)


def _write_pieces(st: Any, it: _Item, rel: str) -> tuple[str, fmt.Layout, int]:
    """Write this process's pieces of distributed tensor `it` as version `rel` (no collective)."""
    layout, boxes = sharded.plan(it.key, it.value, it.dtype)
    part = sharded.write_pieces(st, it.key, rel, layout, boxes, it.value.local_shards(), it.dtype, remove=False)
    return rel, layout, part


def _agree(st: Any, step_dir: str, items: _list[_Item], infos: _list[Any],
           pieces: _list[tuple[str, fmt.Layout, int] | None], err: DTMError | None, pg: Any) -> None:
    """The ranks' agreement on a save written in the background (agree.py): the others
    each report their status and learn the outcome; rank 0 gathers the statuses, commits
    each distributed tensor in `infos` from every rank's CRC parts, or, when a rank failed,
    writes the outcome and waits for every rank to have read it. Raises the failure."""
    lost = (lambda: pg.membership.wait_lost(0.0)) if pg.membership is not None else (lambda: None)
    waiter = agree.Waiter(step_dir, agree.timeout_for(sum(it.nbytes for it in items)), lost)
    if pg.rank != 0:
        mf.write_json(step_dir, agree.status_name(pg.rank),
                      agree.status(pg.rank, err, [None if p is None else p[2] for p in pieces]))
        outcome = waiter.outcome()
        if outcome is not None:
            mf.write_json(step_dir, agree.seen_name(pg.rank), {})
            raise err or agree.error_of(outcome, step_dir)
        return
    failed = None if err is None else agree.status(0, err, [])
    try:
        if failed is None:
            statuses = waiter.statuses(pg.world_size, len(items))
            failed = next((s for s in statuses if s["code"]), None)
        if failed is None:
            versions = []
            for i, p in enumerate(pieces):
                if p is not None:
                    parts = [p[2]] + [s["parts"][i] for s in statuses]
                    if None in parts:
                        raise CheckpointInvalid(f"{step_dir}: tensor {items[i].name!r} is distributed, but process "
                                                f"rank {parts.index(None)}'s status has no CRC part for it", step_dir)
                    versions.append((i, (items[i].key, p[0], p[1], parts)))
            for (i, _), entry in zip(versions, sharded.commit_pieces(st, [v for _, v in versions])):
                infos[i] = entry
            for r in range(1, pg.world_size):
                waiter.place.remove(agree.status_name(r))
            return
    except (DTMError, OSError) as e:
        err = err or _as_dtm_error(e, step_dir)
        failed = agree.status(0, err, [])
    mf.write_json(step_dir, agree.OUTCOME, failed)
    seen = [agree.seen_name(r) for r in range(1, pg.world_size)]
    try:
        waiter.until("every rank to read the outcome", lambda: all(waiter.place.exists(n) for n in seen))
    except DTMError:
        pass  # (a rank that never reads it finds the step directory gone, a failure too)
    raise err or agree.error_of(failed, step_dir)


def _prepare(h: Handle) -> SaveLock:
    """Take save `h`'s root's save lock (E1407 while another process saves into it), then
    make its step directory, removing what an unfinished save of the same step left: E1404
    when the step is already complete, E1104 when the root is not a directory or its disk
    has not the save's bytes free (refused before anything is written)."""
    root, step_dir, step, nbytes = h.path, h.step_dir, h.step, h._total
    place, name = Place.of(root), step_dir_name(step)
    place.make()
    try:
        lock = SaveLock.acquire(place, step)
    except OSError as e:
        raise StoreIOError(f"cannot take the save lock: {e.strerror or e}", root) from None
    try:
        if place.exists(f"{name}/{mf.MANIFEST}"):
            raise CheckpointExists(f"{step_dir} is already a complete checkpoint; save another step, or remove it",
                                   step_dir)
        free = place.free()
        if free is not None and nbytes > free:
            raise StoreIOError(f"the checkpoint needs {nbytes:,} bytes, its disk has {free:,} bytes free; nothing "
                               "was written", root)
        place.remove_tree(name)  # an unfinished save's leftovers (it never had a manifest)
        if place.local:
            os.makedirs(step_dir)
    except BaseException as e:
        lock.release()
        if isinstance(e, OSError):
            raise StoreIOError(f"cannot create the checkpoint directory: {e.strerror or e}", step_dir) from None
        raise
    return lock


def _tensor_entry(step_dir: str, it: _Item, info: Any) -> dict:
    """The manifest's entry of a saved tensor: its type, layout at save time, chunks and CRCs."""
    place = Place.of(step_dir)
    layout, _ = fmt.parse_metadata(place.read(f"{info.dir}/zarr.json"))
    chunks = []
    for i in layout.chunks():
        rel = f"{info.dir}/{layout.chunk_key(i)}"
        if not place.exists(rel):
            continue  # (an empty piece's chunk is never written: reads fill it with zeros)
        crc = int.from_bytes(place.tail(rel, fmt.CRC_BYTES), "little")
        chunks.append({"file": rel, "crc32c": f"{crc:08x}", "box": [_list(b) for b in layout.chunk_box(i)]})
    v = it.value
    entry = {"name": it.name, "key": it.key, "dtype": it.dtype.name, "shape": _list(layout.shape),
             "nbytes": layout.nbytes, "checksum": info.checksum, "dir": info.dir,
             "chunk_shape": _list(layout.chunk_shape), "chunks": chunks, "mesh": None, "placements": None}
    if isinstance(v, _Frozen):
        entry["mesh"] = {"axes": [[a, n] for a, n in v.device_mesh.axes]}
        entry["placements"] = [str(p) for p in v.placements]
    return entry


def _prune(root: str, keep: int) -> None:
    """Remove all but the newest `keep` complete checkpoints: each made invisible first (its
    manifest removed, the directory synced), then deleted."""
    place = Place.of(root)
    for step, d in _complete(root)[:-keep]:
        name = step_dir_name(step)
        place.remove(f"{name}/{mf.MANIFEST}")
        place.remove_tree(name)


# --- finding and listing ------------------------------------------------------------------

def _complete(root: str) -> _list[tuple[int, str]]:
    """(step, step directory) of each complete checkpoint under `root`, oldest first."""
    place = Place.of(root)
    return sorted((int(m.group(1)), place.url_of(n)) for n in place.names()
                  if (m := _STEP_DIR.match(n)) and place.exists(f"{n}/{mf.MANIFEST}"))


def _find(path: str | os.PathLike, step: int | None) -> str:
    """The step directory of checkpoint `step` (None: the newest complete one), E1401 else."""
    place = Place.of(path)
    root = place.url
    found = _complete(root)
    if not found:
        unfinished = sorted(n for n in place.names() if _STEP_DIR.match(n))
        raise NotACheckpoint(f"{root} holds no complete checkpoint (expected step-NNNNNNNNNNNN/{mf.MANIFEST}"
                             + (f"; unfinished saves without a manifest: {unfinished}" if unfinished else "") + ")",
                             root)
    if step is None:
        return found[-1][1]
    for s, d in found:
        if s == step:
            return d
    raise NotACheckpoint(f"{root} holds no complete checkpoint of step {step}; it holds steps {[s for s, _ in found]}",
                         root)


@dataclass
class Checkpoint:
    """A complete checkpoint: its step, when it was committed (Unix seconds), its tensor
    bytes, the meshes its tensors were laid out on ("dp=2 x tp=2"; None: no mesh)."""

    step: int
    time: float
    size: int
    mesh: str | None
    path: str
    dtm_version: str = ""
    tensors: int = 0


def _mesh_text(meshes: _list[dict]) -> str | None:
    return ", ".join(" x ".join(f"{a}={n}" for a, n in m["axes"]) for m in meshes) or None


def list(path: str | os.PathLike) -> _list[Checkpoint]:  # noqa: A001 - dtm.checkpoint.list, as the issue names it
    """The complete checkpoints under `path`, oldest first (E1401 when it is not a directory)."""
    out = []
    for _, d in _complete(Place.of(path).url):
        doc = mf.read(d)
        out.append(Checkpoint(doc["step"], float(doc["time"]), doc["bytes"], _mesh_text(doc["meshes"]), d,
                              str(doc.get("dtm_version", "")), len(doc["tensors"])))
    return out


def read_manifest(path: str | os.PathLike, step: int | None = None) -> dict:
    """The manifest of checkpoint `step` (None: the newest complete one) under `path`."""
    return mf.read(_find(path, step))


# --- loading ------------------------------------------------------------------------------

def _flat_tensors(x: Any, name: str, out: dict) -> dict:
    """{name: tensor} of the tensors in live value `x`, named as `save` names them."""
    if mf.is_tensor(x):
        out[name] = x
    elif isinstance(x, (_list, tuple)):
        for i, v in enumerate(x):
            _flat_tensors(v, f"{name}/{i}", out)
    elif isinstance(x, dict):
        for k, v in x.items():
            _flat_tensors(v, f"{name}/{k}", out)
    return out


def load(state: dict, path: str | os.PathLike, step: int | None = None, strict: bool = True) -> dict:
    """Load checkpoint `step` (None: the newest complete one) under `path` into `state`, in
    place: each object's load_state_dict, each tensor's copy_, each plain value replaced.
    A tensor is read laid out like the live one (its mesh and placements now), each rank
    reading only the chunks its pieces overlap. Every check (keys with `strict`, dtypes,
    shapes, chunks) passes before anything in `state` changes. Returns `state`.
    `path` "mem://" reads the newest complete in-memory snapshot (`snapshot`; `step`: the
    one of that step) that the live ranks hold, with no collective between the ranks."""
    source = _snapshot.find(step) if _snapshot.is_memory(path) else _Directory(path, step)
    step_dir, doc = source.where, source.doc
    saved = doc["state"]
    by_name = {t["name"]: t for t in doc["tensors"]}
    live = {name: (v.state_dict() if mf.is_object(v) else v) for name, v in state.items()}
    missing, unexpected = [], []
    for name in state:
        if name not in saved:
            missing.append(name)
    for name, entry in saved.items():
        if not isinstance(entry, dict) or entry.get("kind") not in ("object", "value") or "tree" not in entry:
            raise CheckpointInvalid(f"{step_dir}/{mf.MANIFEST}: state entry {name!r} is not {{kind, tree}}", step_dir)
        if name not in state:
            unexpected.append(name)
        elif entry["kind"] == "object" and mf.is_object(state[name]):
            have = set(map(str, live[name])) if isinstance(live[name], dict) else set()
            keys = {str(k) for k, _ in entry["tree"].get("dict", [])}
            missing += [f"{name}/{k}" for k in sorted(have - keys)]
            unexpected += [f"{name}/{k}" for k in sorted(keys - have)]
    if strict and (missing or unexpected):
        raise CheckpointKeyError(sorted(missing), sorted(unexpected), step_dir)
    names = [n for n in state if n in saved]
    live_tensors: dict[str, Any] = {}
    for n in names:
        _flat_tensors(live[n], n, live_tensors)
    layouts = _layouts(state, names, by_name, live_tensors)
    for tname, t in by_name.items():  # every check before any read
        x = live_tensors.get(tname)
        if x is None:
            continue
        want = f"{_list(t['shape'])}"
        have = f"{_list(x.shape)}"
        if have != want:
            raise CheckpointTypeError(ErrorCode.SHAPE_MISMATCH, tname, have, want, step_dir)
        if as_store_dtype(x.dtype).name != t["dtype"]:
            raise CheckpointTypeError(ErrorCode.DTYPE_MISMATCH, tname, as_store_dtype(x.dtype).name, t["dtype"],
                                      step_dir)
    dropped = set(unexpected)
    wanted: dict[str, tuple[dict, Any]] = {}  # {tensor name: (its manifest entry, the live tensor to lay it out like)}
    for n in names:
        for tname in _tensor_names(saved[n]["tree"], step_dir):
            if tname in wanted or any(tname == d or tname.startswith(d + "/") for d in dropped):
                continue
            t = by_name.get(tname)
            if t is None:
                raise CheckpointInvalid(f"{step_dir}/{mf.MANIFEST}: {tname!r} is in the state but not among "
                                        "the tensors", step_dir)
            wanted[tname] = (t, live_tensors.get(tname, layouts.get(tname)))
    try:
        read = dict(zip(wanted, source.read_many(_list(wanted.values()))))
    finally:
        source.close()
    values = {}
    for n in names:
        try:
            value = mf.decode(saved[n]["tree"], lambda k: read.get(k), f"{step_dir}/{mf.MANIFEST}")
        except ValueError as e:
            raise CheckpointInvalid(str(e), step_dir) from None
        if isinstance(value, dict) and saved[n]["kind"] == "object":
            value = {k: v for k, v in value.items() if f"{n}/{k}" not in dropped}
        values[n] = value
    for n, value in values.items():  # every value read and checked: now change the state
        obj = state[n]
        if saved[n]["kind"] == "object" and mf.is_object(obj):
            if "strict" in inspect.signature(obj.load_state_dict).parameters:
                obj.load_state_dict(value, strict=strict)
            else:
                obj.load_state_dict(value)
        elif mf.is_tensor(obj) and callable(getattr(obj, "copy_", None)) and value is not None:
            obj.copy_(value)
        elif isinstance(obj, np.ndarray) and value is not None:
            np.copyto(obj, np.asarray(value))
        else:
            state[n] = value
    return state


def _layouts(state: dict, names: _list[str], by_name: dict, live: dict) -> dict[str, Any]:
    """{saved tensor name: a live tensor to lay it out like} for the saved tensors the state
    has none of yet, from the objects' `checkpoint_layouts()` ({path prefix: tensor}): a
    fresh optimizer's moments, read for their parameters' layouts, so that each rank reads
    only its pieces (spec 9.4.4). A prefix's tensor serves the names below it of its shape."""
    out: dict[str, Any] = {}
    for n in names:
        hint = getattr(state[n], "checkpoint_layouts", None)
        if not callable(hint) or not mf.is_object(state[n]):
            continue
        for prefix, like in hint().items():
            for tname, t in by_name.items():
                if (tname not in live and tname.startswith(f"{n}/{prefix}/")
                        and _list(t["shape"]) == _list(like.shape)):
                    out[tname] = like
    return out


class _Directory:
    """A complete checkpoint on disk chosen for a load: `where` (its step directory), `doc`
    (its manifest), `read_many([(t, like), ...])` (saved tensors `t` laid out like the live
    `like`s)."""

    def __init__(self, path: str | os.PathLike, step: int | None):
        self.where = _find(path, step)
        self.doc = mf.read(self.where)
        self._store: Any = None

    def read_many(self, todo: _list[tuple[dict, Any]]) -> _list[Any]:
        """Each saved tensor `t` of `todo` laid out like its live `like`, in order: whole
        numpy arrays one by one, distributed tensors got together (the ranks agree once
        for them all, not once per tensor: spec 9.2.10's status rows)."""
        if self._store is None:
            self._store = _store.open(self.where)
        out: _list[Any] = [None] * len(todo)
        spread: dict[int, _list[int]] = {}  # {id of a process group (0: local devices): [index in todo]}
        for i, (t, like) in enumerate(todo):
            mesh = getattr(like, "device_mesh", None) if like is not None else None
            if mesh is None:
                out[i] = _read_tensor(self._store, self.where, t)
            else:
                spread.setdefault(id(mesh.process) if mesh.process is not None else 0, []).append(i)
        for group in spread.values():
            for i, value in zip(group, _read_spread(self._store, self.where, [todo[i] for i in group])):
                out[i] = value
        return out

    def close(self) -> None:
        if self._store is not None:
            self._store.close()


def _tensor_names(node: Any, where: str) -> _list[str]:
    """The tensor names a tree node refers to, in order."""
    out: _list[str] = []

    def walk(n: Any, depth: int) -> None:
        if depth > mf.MAX_DEPTH or not isinstance(n, dict) or len(n) != 1:
            return
        (kind, v), = n.items()
        if kind == "tensor" and isinstance(v, str):
            out.append(v)
        elif kind in ("list", "tuple") and isinstance(v, _list):
            for c in v:
                walk(c, depth + 1)
        elif kind == "dict" and isinstance(v, _list):
            for c in v:
                if isinstance(c, _list) and len(c) == 2:
                    walk(c[1], depth + 1)
    walk(node, 0)
    return out


def _read_tensor(st: Any, step_dir: str, t: dict) -> np.ndarray:
    """Saved tensor `t` as a whole numpy array, checked against the manifest's version and
    checksum; store errors named for the checkpoint."""
    with _named_errors(step_dir, {t["key"]: t}):
        _check_version(st, step_dir, t)
        value = np.array(st.get_array(t["key"]))
        if checksums.enabled():  # the copy the state receives, against the frozen copy's checksum
            checksums.verify(value, int(t["checksum"], 16), what=f"key {t['key']!r}", op="load", peer="the store")
        return value


def _read_spread(st: Any, step_dir: str, todo: _list[tuple[dict, Any]]) -> _list[Any]:
    """Saved tensors `t`, each laid out like its live distributed tensor `like` (every
    mesh of one process group), each rank reading only the chunks its pieces overlap; their
    pieces checked against the frozen copy's checksum (spec 9.4.9)."""
    by_key = {t["key"]: t for t, _ in todo}
    with _named_errors(step_dir, by_key):
        for t, _ in todo:
            _check_version(st, step_dir, t)
        return st.get_many([(t["key"], like.device_mesh, tuple(like.placements)) for t, like in todo])


def _check_version(st: Any, step_dir: str, t: dict) -> None:
    """CheckpointInvalid unless the store's version of `t` is the one the manifest names."""
    info = st.info(t["key"])
    if info.dir != t["dir"] or info.checksum != t.get("checksum"):
        raise CheckpointInvalid(f"{step_dir}: tensor {t['name']!r}: the store's version of {t['key']!r} ({info.dir}, "
                                f"checksum {info.checksum}) is not the manifest's ({t['dir']}, checksum "
                                f"{t.get('checksum')})", step_dir)


@contextlib.contextmanager
def _named_errors(step_dir: str, by_key: dict[str, dict]) -> Iterator[None]:
    """Store errors inside the block raised as checkpoint errors that name the tensor (of
    `by_key`, {store key: manifest entry}) and its file."""
    def tensor(e: Any) -> dict:
        return by_key.get(getattr(e, "key", None)) or next(iter(by_key.values()))
    try:
        yield
    except checksums.TensorChecksumMismatch as e:
        t = tensor(e)
        raise checksums.TensorChecksumMismatch(f"tensor {t['name']!r} of checkpoint {step_dir}", "load",
                                               os.path.join(step_dir, t["dir"]), e.expected, e.found,
                                               "nothing in the state was changed") from None
    except ChecksumError as e:
        t, why = tensor(e), e.message.split(": ", 1)[-1]
        raise CheckpointChunkError(t["name"], e.chunk, os.path.join(step_dir, t["dir"], e.chunk), why) from None
    except StoreCorrupt as e:
        t = tensor(e)
        raise CheckpointChunkError(t["name"], "zarr.json", os.path.join(step_dir, t["dir"], "zarr.json"),
                                   e.message) from None
    except KeyMissing as e:
        t = tensor(e)
        raise CheckpointInvalid(f"{step_dir}: tensor {t['name']!r} ({t['key']!r}) is in the manifest but not in the "
                                "checkpoint's store", step_dir) from None


# --- exporting ----------------------------------------------------------------------------

def export(path: str | os.PathLike, out: str | os.PathLike, step: int | None = None) -> dict[str, str]:
    """Write each group of checkpoint `step` (a top-level name of its state that holds
    tensors: "model", "optim") as `OUT/<group>.safetensors`, its tensors whole and named by
    their path in the group with dots (`h.0.attn.c_attn.weight`, `state.3.exp_avg`), for
    safetensors and transformers to read. Returns {group: file}. (The `dtm checkpoint export`
    command writes a group saved from a model that records its Hugging Face config as that
    model's own checkpoint directory instead.)"""
    from safetensors.numpy import save_file

    step_dir = _find(path, step)
    doc = mf.read(step_dir)
    by_name = {t["name"]: t for t in doc["tensors"]}
    os.makedirs(out, exist_ok=True)
    written = {}
    st = _store.open(step_dir)
    try:
        for group, entry in doc["state"].items():
            names = _tensor_names(entry["tree"], step_dir)
            if not names:
                continue
            arrays = {n.split("/", 1)[1].replace("/", ".") if "/" in n else n:
                      np.ascontiguousarray(_read_tensor(st, step_dir, by_name[n])) for n in names}
            file = os.path.join(out, f"{group}.safetensors")
            save_file(arrays, file + ".tmp", metadata={"format": "pt", "dtm_step": str(doc["step"])})
            os.replace(file + ".tmp", file)
            written[group] = file
    finally:
        st.close()
    return written


# --- verifying ----------------------------------------------------------------------------

@dataclass
class VerifyReport:
    """What `verify` found: `bad` lists (step, tensor, chunk file, problem)."""

    checkpoints: int = 0
    tensors: int = 0
    chunks: int = 0
    bad: _list[tuple[int, str, str, str]] = field(default_factory=_list)

    @property
    def ok(self) -> bool:
        return not self.bad


def verify(path: str | os.PathLike, step: int | None = None) -> VerifyReport:
    """Re-read every chunk of every complete checkpoint under `path` (or of `step`) and check
    its length, its own CRC32C and the manifest's."""
    report = VerifyReport()
    dirs = [_find(path, step)] if step is not None else [d for _, d in _complete(Place.of(path).url)]
    if not dirs:
        _find(path, None)  # E1401, naming what is there
    for d in dirs:
        doc, place = mf.read(d), Place.of(d)
        report.checkpoints += 1
        for t in doc["tensors"]:
            report.tensors += 1
            try:
                layout, _ = fmt.parse_metadata(place.read(f"{t['dir']}/zarr.json"))
            except (OSError, ValueError, KeyError, TypeError) as e:
                report.bad.append((doc["step"], t["name"], f"{t['dir']}/zarr.json", f"unreadable: {e}"))
                continue
            want = layout.chunk_data_bytes + fmt.CRC_BYTES
            for c in t["chunks"]:
                report.chunks += 1
                rel = c.get("file", "?")
                try:
                    raw = place.read(rel)
                except OSError as e:
                    report.bad.append((doc["step"], t["name"], rel, f"cannot be read: {e.strerror or e}"))
                    continue
                if len(raw) != want:
                    report.bad.append((doc["step"], t["name"], rel, f"{len(raw)} bytes, expected {want} (truncated)"))
                    continue
                stored = int.from_bytes(raw[-fmt.CRC_BYTES:], "little")
                got = _crc(memoryview(raw)[:-fmt.CRC_BYTES])
                if got != stored:
                    report.bad.append((doc["step"], t["name"], rel, f"CRC32C {got:08x}, the chunk says {stored:08x}"))
                elif f"{stored:08x}" != c.get("crc32c"):
                    report.bad.append((doc["step"], t["name"], rel,
                                       f"CRC32C {stored:08x}, the manifest says {c.get('crc32c')}"))
    return report
