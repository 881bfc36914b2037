"""Distributed tensors in the store (spec 9.2.10): `put` writes each piece of a tensor laid
out over a mesh as its own chunk of one stored tensor, without a gather; `get` with a mesh
and placements reads, for each mesh rank this process holds, the chunks its piece overlaps
and no others.

The chunk grid of such a put is the piece grid (spec 2.7's chunking): along a dim sharded
n ways the chunk is ceil(D/n), the full chunk of a piece; along the others the whole dim. So
each non-empty piece is exactly one chunk, and replicas of a piece are one chunk, written by
the lowest mesh rank that holds it. On a mesh of processes (runtime L1) every rank calls
put and get: the ranks agree through small all_gathers of status rows, so that a failure on
one rank fails the operation on every rank instead of leaving the others waiting, and a put
is committed by process rank 0 alone, after every rank's chunks are written: the commit
point stays the one index switch of spec 9.2.6.

The tensor is duck-typed (`device_mesh`, `placements`, `local_shards`, `dtype`, `shape`):
the store sits below the user-facing API (docs/architecture.md, layer 8). Meshes are the runtime's
DeviceMesh, and a get returns the runtime's Shards for the store's factory to wrap.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import numpy as np

from ..ir.chunks import chunk, coords
from ..errors import DTMError, ErrorCode
from ..ir.dtypes import DType, numpy_dtype
from ..ir.types import Placement, Replicate, TensorType
from ..runtime.mesh import DeviceMesh, Shards
from ..protocol import checksums
from ..protocol.checksums import TensorChecksumMismatch
from . import crc
from . import format as fmt
from .errors import ChecksumError, KeyMissing, StoreCorrupt, StoreError, StoreIOError
from .index import Entry
from .keys import version_dir

if TYPE_CHECKING:
    from .store import Store

Box = tuple[tuple[int, int], ...]  # [start, stop) along each dim of the tensor

GET_ATTEMPTS = 5  # lookups a get tries when the ranks see different versions of the key (a put between)
_RACED = -1       # a status row's code: the version read was replaced mid-read, read the key again


def boxes(shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]) -> list[Box]:
    """Each mesh rank's piece of a tensor of `shape`, as a box of the tensor."""
    out = []
    for r in range(mesh.size):
        box = [(0, n) for n in shape]
        for (_, n), c, p in zip(mesh.axes, coords(mesh.ir(), r), placements):
            if p.kind == "shard":
                box[p.arg] = chunk(shape[p.arg], n, c)
        out.append(tuple(box))
    return out


def block(shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]) -> tuple[int, ...]:
    """The chunk shape of a put with these placements: the shape of a full piece."""
    out = list(shape)
    for (_, n), p in zip(mesh.axes, placements):
        if p.kind == "shard":
            out[p.arg] = -(-shape[p.arg] // n)
    return tuple(out)


def writers(pieces: Sequence[Box]) -> list[int]:
    """The ranks that write a piece: the lowest rank of each distinct non-empty box."""
    first: dict[Box, int] = {}
    for r, box in enumerate(pieces):
        if all(a < b for a, b in box):
            first.setdefault(box, r)
    return sorted(first.values())


def put(store: "Store", key: str, x: Any, dtype: DType) -> Entry:
    """Store distributed tensor `x` under `key` as `dtype`, each piece by a rank that holds it."""
    mesh: DeviceMesh = x.device_mesh
    values = x.local_shards()  # realized; on a process mesh the other processes' pieces are None
    layout, pieces = plan(key, x, dtype)
    pg, lead = mesh.process, mesh.process is None or mesh.process.rank == 0
    # one version directory for all ranks: process rank 0's draw (63 bits: an int64 row)
    rel = version_dir(key, int(_rows(pg, [secrets.randbits(63)])[0, 0]))
    code, part, err = 0, 0, None
    try:  # (on a process mesh, rank 0 removes the version below when a rank failed)
        part = write_pieces(store, key, rel, layout, pieces, values, dtype, remove=pg is None)
    except DTMError as e:
        code, err = _code(e), e
    rows = _rows(pg, [code, part])  # every rank's chunks are written (and synced) past here
    if rows[:, 0].any():
        if lead:
            store._files.remove_tree(rel)
        raise err or _failed(rows, key, "put", "could not write its pieces; the earlier tensor is kept")
    checksum = f"{crc.tensor_crc(rows[:, 1], layout.nbytes):08x}"
    entry, result = None, [0, 0, 0]
    if lead:
        try:
            entry, = commit_pieces(store, [(key, rel, layout, rows[:, 1])])
            result = [0, entry.version, np.float64(entry.written).view(np.int64)]
        except DTMError as e:
            result, err = [_code(e), 0, 0], e
    rows = _rows(pg, result)[:1]  # rank 0's
    code, version, written = rows[0]
    if code:
        raise err or _failed(rows, key, "put", "could not commit it; the earlier tensor is kept")
    return entry or Entry(key, rel, dtype, tuple(x.shape), layout.nbytes, checksum, int(version),
                          float(np.int64(written).view(np.float64)))


def plan(key: str, x: Any, dtype: DType) -> tuple[fmt.Layout, list[Box]]:
    """The layout of a put of distributed tensor `x` as `dtype` (its chunks the full pieces)
    and each mesh rank's piece; E0507 for a partial tensor, whose pieces are not its value."""
    mesh: DeviceMesh = x.device_mesh
    placements = tuple(x.placements)
    if any(p.kind == "partial" for p in placements):
        raise StoreError(ErrorCode.INVALID_PLACEMENT,
                         f"put {key!r}: the tensor is partial ({list(placements)} on {mesh}), so no rank's piece is "
                         "its value; reduce it first, as x.redistribute() with Replicate() for each Partial", key)
    shape = tuple(x.shape)
    return fmt.plan_grid(dtype, shape, block(shape, mesh, placements)), boxes(shape, mesh, placements)


def write_pieces(store: "Store", key: str, rel: str, layout: fmt.Layout, pieces: Sequence[Box],
                 values: Sequence[Any], dtype: DType, *, remove: bool) -> int:
    """Write, as chunks of version `rel` of `key`, the pieces of a distributed tensor that
    this process writes (`values[r]` not None for the lowest mesh rank `r` of a piece), with
    no collective; returns their CRC part (XOR of `crc.box_crc`) for `commit_pieces`.
    `remove=False` where other processes write into the same version: the one that commits
    it removes it when any of them failed."""
    part = 0
    store._index.check_quota(key, layout.nbytes)
    mine = [r for r in writers(pieces) if values[r] is not None]
    with store._writing(key, rel, remove=remove):
        # (the chunks' directories too: each chunk's first open no longer fails and retries)
        store._files.make_dirs(rel, [layout.chunk_key(_chunk_of(layout, pieces[r])) for r in mine])
        with store._files.hold(rel):  # (a garbage collection spares it; its commit holds it again)
            for r in mine:
                data = fmt.to_storage(np.asarray(values[r]).astype(numpy_dtype(dtype), copy=False), dtype)
                c = store._write_chunk(rel, layout, _chunk_of(layout, pieces[r]), data)
                # a piece that fills its chunk (no padding): the chunk's CRC is its bytes' CRC,
                # so box_crc need not read them again
                whole = c if data.shape == layout.chunk_shape else None
                part ^= crc.box_crc(data, pieces[r], layout.storage_shape, whole)
    return part


def commit_pieces(store: "Store", versions: Sequence[tuple[str, str, fmt.Layout, Sequence[int]]]) -> list[Entry]:
    """Commit each (key, version, layout, CRC parts) once every process's pieces are
    written and synced: its tensor checksum from every process's CRC part, `zarr.json`, the
    index switch (of many versions in one transaction: Store._commit_many)."""
    return store._commit_many([(key, rel, layout, f"{crc.tensor_crc(parts, layout.nbytes):08x}")
                               for key, rel, layout, parts in versions])


def get(store: "Store", key: str, dtype: Any, shape: tuple[int, ...] | None, mesh: Any,
        placements: Any) -> tuple[TensorType, Shards]:
    """The type of the tensor under `key` and its pieces on `mesh` laid out by `placements`
    (None: replicated), those of this process's ranks read."""
    return get_many(store, [(key, dtype, shape, mesh, placements)])[0]


def get_many(store: "Store", requests: Sequence[tuple[str, Any, tuple[int, ...] | None, Any, Any]]
             ) -> list[tuple[TensorType, Shards]]:
    """`get` of each (key, dtype, shape, mesh, placements), in order, the ranks agreeing in
    two all_gathers for all the keys rather than two per key (a checkpoint's load of hundreds
    of tensors). Every mesh shares one process group (or none: local devices). The first
    key that fails on any rank fails the call on every rank; keys whose version changed
    between the ranks' lookups or under a read are looked up and read again."""
    for key, _, _, mesh, placements in requests:
        if not isinstance(mesh, DeviceMesh):
            raise StoreError(ErrorCode.INVALID_MESH, f"get {key!r}: placements {placements!r} need mesh=, a dtm.Mesh, "
                             f"not {type(mesh).__name__}", key)
    pg = requests[0][3].process if requests else None
    if any(mesh.process is not pg for _, _, _, mesh, _ in requests):
        raise StoreError(ErrorCode.INVALID_MESH, "get_many: the meshes do not share one process group",
                         requests[0][0])
    out: list[Any] = [None] * len(requests)
    todo = list(range(len(requests)))
    for _ in range(GET_ATTEMPTS):
        looked = [_look_up(store, *requests[i]) for i in todo]
        rows = _rows(pg, [v for lk in looked for v in (lk.code, lk.entry.version if lk.entry else 0)])
        for n, i in enumerate(todo):  # (rows of a key: columns 2n and 2n + 1)
            if rows[:, 2 * n].any():
                raise looked[n].error or _failed(rows[:, 2 * n:], requests[i][0], "get", "could not look the key up")
        same = [n for n in range(len(todo)) if (rows[:, 2 * n + 1] == rows[0, 2 * n + 1]).all()]
        read = [_read_pieces(store, looked[n].entry, requests[todo[n]][3], looked[n].placements) for n in same]
        rows = _rows(pg, [v for rd in read for v in (rd.code, rd.part, rd.check)])
        again = [todo[n] for n in sorted(set(range(len(todo))) - set(same))]
        for m, n in enumerate(same):  # (rows of a key: columns 3m to 3m + 2)
            i, entry, pl, rd = todo[n], looked[n].entry, looked[n].placements, read[m]
            status = rows[:, 3 * m:3 * m + 3]
            key, mesh = requests[i][0], requests[i][3]
            if (status[:, 0] > 0).any():  # a rank failed: every rank fails
                raise rd.error if rd.code > 0 else _failed(status, key, "get", "could not read its piece")
            if status[:, 0].any():  # a rank read a version that a put or delete replaced under it
                again.append(i)
                continue
            if status[:, 2].all():  # every process checks, or none does (DTM_CHECKSUMS=0 on one)
                found = crc.tensor_crc(status[:, 1], store._layout(entry).nbytes)
                if f"{found:08x}" != entry.checksum:
                    raise TensorChecksumMismatch(f"key {key!r} laid out as {list(pl)} on {mesh}", "get",
                                                 f"the store at {store.url}", int(entry.checksum, 16), found,
                                                 key=key)
            out[i] = (TensorType(entry.dtype, entry.shape), Shards(mesh, pl, rd.pieces))
        if not again:
            return out
        todo = sorted(again)
    raise StoreIOError(f"get {requests[todo[0]][0]!r}: the key changed under every one of {GET_ATTEMPTS} reads "
                       "(puts in between)", store.url, requests[todo[0]][0])


class _Looked(NamedTuple):
    """A get's first step on this rank: the key's entry and its placements checked against
    its type, or the error (`code` its number, 0 for none)."""

    entry: Entry | None
    placements: Any
    code: int
    error: DTMError | None


class _Read(NamedTuple):
    """A get's second step on this rank: the pieces of this process's mesh ranks, the CRC
    part of those it counts (each distinct piece once over the mesh), whether it checks CRCs
    (0/1), and the error (`code` its number, _RACED: the version was replaced under the read;
    0 for none)."""

    pieces: list[Any]
    part: int
    check: int
    code: int
    error: DTMError | None


def _look_up(store: "Store", key: str, dtype: Any, shape: tuple[int, ...] | None, mesh: DeviceMesh,
             placements: Any) -> _Looked:
    """A get's first step on this rank (see _Looked)."""
    entry = None
    try:
        entry = store._tensor_entry(key, dtype, shape)
        pl = mesh.placements(Replicate() if placements is None else placements,
                             TensorType(entry.dtype, entry.shape), f"get({key!r})")
        if any(p.kind == "partial" for p in pl):
            raise StoreError(ErrorCode.INVALID_PLACEMENT, f"get {key!r}: {list(pl)} on {mesh}: a stored tensor "
                             "is got whole, shard or replicate it; partial values are not stored", key)
        return _Looked(entry, pl, 0, None)
    except DTMError as e:
        return _Looked(entry, None, _code(e), e)


def _read_pieces(store: "Store", entry: Entry, mesh: DeviceMesh, pl: Any) -> _Read:
    """A get's second step on this rank (see _Read)."""
    part, pieces, check = 0, [None] * mesh.size, checksums.enabled()
    pg = mesh.process
    try:
        layout = store._layout(entry)
        got = boxes(entry.shape, mesh, pl)
        counted = set(writers(got))  # the lowest rank of each distinct piece: the tensor once
        for r, box in enumerate(got):
            if pg is None or r == mesh.rank:
                data = store._read_box(entry, layout, box)
                if check and r in counted:  # the piece as assembled, after its chunks' copies
                    part ^= crc.box_crc(data, box, layout.storage_shape)
                pieces[r] = fmt.from_storage(data, entry.dtype)
    except (ChecksumError, StoreCorrupt) as e:
        return _Read(pieces, part, int(check), _RACED if _replaced(store, entry) else _code(e), e)
    except DTMError as e:
        return _Read(pieces, part, int(check), _code(e), e)
    return _Read(pieces, part, int(check), 0, None)


def _chunk_of(layout: fmt.Layout, box: Box) -> tuple[int, ...]:
    """The id of the chunk that is exactly the piece `box`."""
    return tuple(a // c for (a, _), c in zip(box, layout.chunk_shape))


def _replaced(store: "Store", entry: Entry) -> bool:
    """Whether `entry`'s version is no longer the key's (replaced or deleted since it was looked up)."""
    try:
        return store.info(entry.key).dir != entry.dir
    except KeyMissing:
        return True


def _rows(pg: Any, row: Sequence[int]) -> np.ndarray:
    """Every process's `row` of int64s, in process rank order: one all_gather over a mesh of
    processes; this process's row alone over local devices."""
    mine = np.array([row], np.int64)
    return mine if pg is None else pg.all_gather(mine, dim=0)


def _code(e: DTMError) -> int:
    """An error code as the number a status row carries (E1104: 1104)."""
    return int(e.code.value[1:])


def _failed(rows: np.ndarray, key: str, op: str, what: str) -> StoreError:
    """The error a rank raises when another rank's status row says it failed: that rank's code."""
    r = int(np.flatnonzero(rows[:, 0] > 0)[0])
    code = ErrorCode(f"E{int(rows[r, 0]):04d}")
    return StoreError(code, f"{op} {key!r}: process rank {r} {what} ({code.value})", key)
