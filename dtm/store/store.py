"""`Store`: the embedded tensor store of one process (spec 9.2): put, get, info, keys,
delete, du, quotas and verify over an index (index.py) and a file backend (files.py), in the
Zarr v3 layout of format.py, or, for a small tensor, inline in its index row. Distributed
tensors go piece by piece (sharded.py)."""

from __future__ import annotations

import contextlib
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np

from ..errors import ErrorCode
from ..ir.dtypes import DTYPES, DType, from_numpy, numpy_dtype
from ..ir.types import TensorType
from ..protocol import checksums
from ..runtime.mesh import Shards
from ..runtime.process_group import check_cancelled
from . import format as fmt
from . import sharded
from .errors import ChecksumError, KeyMissing, StoreCorrupt, StoreError, StoreIOError, StoreTypeError
from .files import FsspecFiles, LocalFiles
from .index import Entry, Row, SqliteIndex
from .refindex import RefIndex
from .keys import check_key, version_dir
from .crc import checksum as crc_of

# What `get` wraps its array in, and its pieces with a mesh: (type, Shards) -> a distributed
# tensor. The store sits below the user-facing API (docs/architecture.md, layer 8), so `dtm/__init__.py`
# installs the Tensor's here; until then get gives numpy, and a Shards with a mesh.
_tensor_factory: Callable[[np.ndarray], Any] = lambda a: a
_distributed_factory: Callable[[TensorType, Shards], Any] = lambda t, v: v


def set_tensor_factory(factory: Callable[[np.ndarray], Any],
                       distributed: Callable[[TensorType, Shards], Any] | None = None) -> None:
    """Install what `get` wraps its array in (`factory`) and, when given, what it makes of a
    value's type and pieces on a mesh (`distributed`); `dtm/__init__.py` installs the Tensor's."""
    global _tensor_factory, _distributed_factory
    _tensor_factory = factory
    if distributed is not None:
        _distributed_factory = distributed


# A version directory `data/KEY/@ID` or a path inside it (keys have no `@` segments, 9.2.1)
_VERSION_DIR = re.compile(r"(data/(?:[^/]+/)+?@[0-9a-f]{16})(?:/|$)")

COMMIT_GROUP = 256  # versions committed in one index transaction, each held open (a descriptor) until then
Info = Entry  # what info() returns: dtype, shape, nbytes, checksum, version, written


class Pending(NamedTuple):
    """A version written and not yet committed (`Store.put_array(..., commit=False)`)."""

    key: str
    dir: str
    layout: fmt.Layout
    checksum: str


@dataclass
class VerifyReport:
    """What `verify` found: `bad` lists (key, chunk, reason); chunk is "zarr.json" for
    metadata. `ok` when nothing is bad."""

    keys: int = 0
    chunks: int = 0
    bad: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.bad

    @property
    def bad_keys(self) -> list[str]:
        return sorted({k for k, _, _ in self.bad})


def as_store_dtype(d: Any) -> DType:
    """A DTM dtype from a DType, a DTM dtype name, or a numpy dtype (E0401 otherwise)."""
    if isinstance(d, DType):
        return d
    if isinstance(d, str) and d in DTYPES:
        return DTYPES[d]
    try:
        return from_numpy(np.dtype(d))
    except (TypeError, KeyError):
        raise StoreTypeError(ErrorCode.UNKNOWN_DTYPE, f"{d!r} is not a DTM dtype") from None


class Store:
    """An embedded tensor store. Open one with `dtm.store.open`, which keeps tensors of at
    most `fmt.INLINE_BYTES` inline; built directly, a store keeps those of at most
    `inline_bytes` (default 0: none, every tensor a Zarr array)."""

    def __init__(self, url: str, files: LocalFiles | FsspecFiles, index: SqliteIndex | RefIndex,
                 chunk_bytes: int = fmt.DEFAULT_CHUNK_BYTES, inline_bytes: int = 0):
        self.url = url
        self._files = files
        self._index = index
        if not 0 <= inline_bytes <= fmt.INLINE_BYTES:  # spec 9.2.3's bound: large rows slow the index's scans
            raise StoreError(ErrorCode.ATTRIBUTE_VALUE,
                             f"inline_bytes is 0 to {fmt.INLINE_BYTES} (spec 9.2.3), not {inline_bytes!r}")
        self._chunk_bytes = chunk_bytes
        self._inline_bytes = inline_bytes

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._files.close()
        self._index.close()

    def sync(self) -> None:
        """Sync every file written since the last sync, in one parallel batch: what a store
        opened with `durable=False` defers (its index is synced by each commit as always)."""
        self._files.sync()

    def start_sync(self) -> None:
        """Begin, in the background, the syncs of the files written since the last call
        (`durable=False`), so that they overlap the writes that follow; `sync` waits for them."""
        self._files.start_sync()

    def clean_up_after_dead_writers(self) -> list[str]:
        """Remove what writers that died (SIGKILL, a crash) left: every version no key names
        and no live writer holds (spec 9.2.3). Only when one died since the last clean-up,
        so that opening a store walks its files only then. Returns the directories removed."""
        dead = self._files.dead_writers()
        if not dead:
            return []
        removed = self.collect(older_than_s=0)
        self._files.forget_writers(dead)
        return removed

    # --- writing ------------------------------------------------------------------------

    def put(self, key: str, x: Any, dtype: Any = None) -> Info:
        """Store a copy of `x` (a dtm.Tensor, numpy array or anything np.asarray takes)
        under `key`, replacing what was there; visible whole or not at all. A distributed
        tensor (dtm.distribute) is written piece by piece, without a gather (spec 9.2.10):
        on a mesh of processes every rank calls put."""
        if getattr(x, "device_mesh", None) is not None:
            return sharded.put(self, check_key(key), x, as_store_dtype(x.dtype if dtype is None else dtype))
        _refuse_masked(key, x)  # (np.asarray drops the mask)
        return self.put_array(key, np.asarray(x), dtype)

    def put_many(self, items: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> list[Info]:
        """`put` of each (key, value): the tensors kept inline in one index transaction, one
        sync for all of them (all committed or none), each larger one as a put of its own.
        Returns their infos, in order."""
        pairs = list(items.items() if isinstance(items, Mapping) else items)
        staged = [self._stage(k, v) for k, v in pairs]  # every key and dtype checked before any write
        small = [i for i, (_, layout, _) in enumerate(staged) if self._keeps_inline(layout)]
        done = self._index.commit_many([self._inline_row(*staged[i]) for i in small]) if small else []
        infos: dict[int, Info] = {}
        for i, (entry, old) in zip(small, done):
            self._drop(old)
            infos[i] = entry
        for i, (key, layout, data) in enumerate(staged):
            if i not in infos:
                infos[i] = self._put_files(key, layout, data)
        return [infos[i] for i in range(len(staged))]

    def put_array(self, key: str, a: np.ndarray, dtype: Any = None, *, commit: bool = True) -> Info | Pending:
        """Store `a` under `key`. `dtype` converts it; for `q8_0`/`q4_0` `a` is the uint8
        block storage of shape [..., K/32 * block bytes] (dtm/ref/quant.py). `commit=False`
        (a tensor kept in files): write its version and return it as a `Pending`, which
        `commit_pending` commits with others in one index transaction (a checkpoint of many
        tensors: one commit instead of one per tensor); until then the key is unchanged."""
        key, layout, data = self._stage(key, a, dtype)
        if self._keeps_inline(layout):
            return self._put_inline(key, layout, data)
        return self._put_files(key, layout, data, commit)

    def commit_pending(self, pending: Sequence[Pending]) -> list[Info]:
        """Commit versions that `put_array(..., commit=False)` wrote (spec 9.2.6 steps 2 to 4),
        COMMIT_GROUP to an index transaction; their infos, in order."""
        return self._commit_many([tuple(p) for p in pending])

    def _stage(self, key: str, a: Any, dtype: Any = None) -> tuple[str, fmt.Layout, np.ndarray]:
        """The checked key, the layout and the storage array of a put of `a` (E1101, E0401,
        E0408 before anything is written)."""
        key = check_key(key)
        _refuse_masked(key, a)
        a = np.asarray(a)
        dt = as_store_dtype(a.dtype if dtype is None else dtype)
        if dt.is_quant:
            shape = quant_shape(key, a, dt)
        else:
            if dtype is not None:
                a = a.astype(numpy_dtype(dt), copy=False)
            shape = tuple(a.shape)
        return key, fmt.plan(dt, shape, self._chunk_bytes), fmt.to_storage(a, dt)

    def _keeps_inline(self, layout: fmt.Layout) -> bool:
        return 0 < self._inline_bytes and layout.nbytes <= self._inline_bytes

    def _put_files(self, key: str, layout: fmt.Layout, data: np.ndarray, commit: bool = True) -> Info | Pending:
        """A put of a tensor as a Zarr array, its version held (files.hold) from its first
        file to its commit, so that no garbage collection takes it for a killed put's; with
        `commit=False` the version written, not committed (`put_array`)."""
        self._index.check_quota(key, layout.nbytes)
        rel = version_dir(key, secrets.randbits(64))
        with self._writing(key, rel):
            self._files.make_dirs(rel, layout.chunk_keys())
            with self._files.hold(rel):
                checksum = self._write_chunks(rel, layout, data)
                return self._commit(key, rel, layout, checksum) if commit else Pending(key, rel, layout, checksum)

    def _write_chunks(self, rel: str, layout: fmt.Layout, data: np.ndarray) -> str:
        """Write every chunk of `data` into version `rel`; the tensor's checksum."""
        crc = 0
        for i in layout.chunks():
            crc = self._write_chunk(rel, layout, i, data[_slices(layout.chunk_box(i))])
        # one unpadded chunk: its CRC is the tensor's; else one more pass over the bytes
        whole = layout.nchunks == 1 and layout.chunk_data_bytes == layout.nbytes
        checksum = crc if whole else crc_of(data.reshape(-1).view(np.uint8) if data.size else b"")
        return f"{checksum:08x}"

    def _put_inline(self, key: str, layout: fmt.Layout, data: np.ndarray) -> Info:
        """A put of a small tensor (spec 9.2.3): its storage bytes go into its index row, whose
        commit (quotas checked there) is the whole put: no file, no directory, one sync."""
        entry, old = self._index.commit(*self._inline_row(key, layout, data))
        self._drop(old)
        return entry

    @staticmethod
    def _inline_row(key: str, layout: fmt.Layout, data: np.ndarray) -> Row:
        """The index row that keeps `data` inline; its checksum is of `data` itself, before the
        row's copy (spec 9.4.9: a copy damaged in memory fails the get, E1102)."""
        checksum = f"{crc_of(data.reshape(-1).view(np.uint8)):08x}"
        return Row(key, "", layout.dtype, layout.shape, layout.nbytes, checksum, data.tobytes())

    def _write_chunk(self, rel: str, layout: fmt.Layout, i: tuple[int, ...], block: np.ndarray) -> int:
        """Write chunk i of a new version (bytes, edge padding, CRC32C, fsync); its CRC32C.
        A cancelled job writes no further chunk (spec 9.4.10): the put fails as any put does."""
        check_cancelled(f"writing chunk {layout.chunk_key(i)} of {rel}")
        parts, crc = fmt.encode_chunk(layout, block)
        self._files.write(f"{rel}/{layout.chunk_key(i)}", parts)
        return crc

    def _commit(self, key: str, rel: str, layout: fmt.Layout, checksum: str) -> Info:
        """Steps 2 to 4 of spec 9.2.6 once the chunks are written: `zarr.json`, the syncs,
        the index switch (the commit point), the removal of the version it replaced."""
        return self._commit_many([(key, rel, layout, checksum)])[0]

    def _commit_many(self, versions: Sequence[tuple[str, str, fmt.Layout, str]]) -> list[Info]:
        """`_commit` of each (key, version, layout, checksum), every group of COMMIT_GROUP
        switched in one index transaction (one sync of the index for the group: all of it
        or none); on a failure the group's versions are removed."""
        out: list[Info] = []
        for g in range(0, len(versions), COMMIT_GROUP):
            group = versions[g:g + COMMIT_GROUP]
            with contextlib.ExitStack() as held:
                for key, rel, layout, checksum in group:
                    held.enter_context(self._writing(key, rel))
                    held.enter_context(self._files.hold(rel))  # (a distributed put's chunks were held apart)
                    self._files.write(f"{rel}/zarr.json", [fmt.metadata(layout, checksum)])
                    self._files.sync_tree(rel, layout.chunk_keys())
                done = self._index.commit_many([Row(key, rel, layout.dtype, layout.shape, layout.nbytes, checksum)
                                                for key, rel, layout, checksum in group])
            for entry, old in done:
                self._drop(old)
                out.append(entry)
        return out

    def _drop(self, old: Entry | None) -> None:
        """Remove the version `old` names, which no key names any more: its zarr.json and
        its chunks (nothing for no entry, or a tensor that was inline: its row is gone)."""
        if old is None or old.inline:
            return

        def names() -> list[str]:
            layout, _ = fmt.parse_metadata(self._files.read_bytes(f"{old.dir}/zarr.json"))  # (parsed once per text)
            return [*layout.chunk_keys(), "zarr.json"]
        self._files.remove_version(old.dir, names, old.nbytes)

    @contextlib.contextmanager
    def _writing(self, key: str, rel: str, remove: bool = True) -> Iterator[None]:
        """Writing version `rel` of `key`: on any failure the version is removed (the key
        keeps its earlier tensor), and an OSError becomes E1104. `remove=False` where other
        ranks write into the same version: the one that commits removes it once all are done."""
        try:
            yield
        except OSError as e:
            if remove:
                self._files.remove_tree(rel)
            raise StoreIOError(f"put {key!r} failed, the earlier tensor is kept: {e.strerror or e}",
                               self._files.path(rel), key) from None
        except BaseException:
            if remove:
                self._files.remove_tree(rel)
            raise

    def delete(self, key: str) -> None:
        """Remove `key` (E0804 when it is not stored)."""
        key = check_key(key)
        entry = self._index.delete(key)
        if entry is None:
            raise KeyMissing(key)
        self._drop(entry)

    def set_quota(self, nbytes: int | None, prefix: str = "") -> None:
        """Limit the bytes stored under `prefix` (every key for ""); None lifts the limit."""
        if nbytes is not None and (not isinstance(nbytes, int) or nbytes < 0):
            raise StoreError(ErrorCode.ATTRIBUTE_VALUE, f"a quota is a byte count >= 0, not {nbytes!r}")
        self._index.set_quota(prefix, nbytes)

    # --- reading ------------------------------------------------------------------------

    def info(self, key: str) -> Info:
        key = check_key(key)
        entry = self._index.get(key)
        if entry is None:
            raise KeyMissing(key)
        return entry

    def keys(self, prefix: str = "") -> list[str]:
        return self._index.keys(prefix)

    def du(self, prefix: str = "", *, garbage: bool = False) -> int:
        """Bytes of tensor data stored under `prefix` (what quotas limit); with `garbage`,
        the bytes on disk of the versions under it that no key names instead: puts in flight,
        and what killed puts left until a clean-up or `collect` removes it (spec 9.2.3)."""
        if garbage:
            return sum(self._files.size(d) for d in self._garbage(0.0, prefix))
        return self._index.usage(prefix)

    def quotas(self) -> dict[str, int]:
        return self._index.quotas()

    def __contains__(self, key: str) -> bool:
        return self._index.get(check_key(key)) is not None

    def get(self, key: str, dtype: Any = None, shape: tuple[int, ...] | None = None, *, mesh: Any = None,
            placements: Any = None) -> Any:
        """The tensor under `key` as a dtm.Tensor; with `dtype`/`shape`, E0402/E0403 when
        the stored type differs. Quantized tensors: use get_array. With `mesh` (a dtm.Mesh)
        and `placements` (as dtm.distribute takes them; default: replicated), a distributed
        tensor laid out so, each rank reading only the chunks its piece overlaps (spec
        9.2.10); on a mesh of processes every rank calls get."""
        if mesh is not None or placements is not None:
            return as_distributed(*sharded.get(self, key, dtype, shape, mesh, placements))
        return as_tensor(key, self._checked(key, dtype, shape).dtype, self.get_array(key, dtype, shape))

    def get_many(self, requests: Sequence[tuple[str, Any, Any]]) -> list[Any]:
        """`get(key, mesh=mesh, placements=placements)` of each (key, mesh, placements), the
        ranks agreeing once for them all rather than once per key (every mesh of one
        process group); on a mesh of processes every rank calls it with the same keys."""
        got = sharded.get_many(self, [(key, None, None, mesh, placements) for key, mesh, placements in requests])
        return [as_distributed(t, shards) for t, shards in got]

    def _tensor_entry(self, key: str, dtype: Any, shape: tuple[int, ...] | None) -> Entry:
        """The key's entry, checked as `_checked` does, and refused (E0408) when its dtype is
        one a dtm.Tensor cannot hold."""
        entry = self._checked(key, dtype, shape)
        refuse_quantized(key, entry.dtype)
        return entry

    def get_array(self, key: str, dtype: Any = None, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """The tensor under `key` as a read-only numpy array, memory-mapped when it is one
        chunk of MAP_BYTES or more on a local disk; every chunk's CRC32C is checked first
        (E1102), and a tensor kept inline against its row's checksum."""
        entry = self._checked(key, dtype, shape)
        try:
            return self._read(entry)
        except (ChecksumError, StoreCorrupt):
            # A put or delete of the key that committed after our lookup removes the version
            # we were reading: that is not damage; read what the key holds now (or E0804).
            if self.info(key).dir == entry.dir:
                raise
            return self.get_array(key, dtype, shape)

    def _checked(self, key: str, dtype: Any, shape: tuple[int, ...] | None) -> Entry:
        """The key's entry, once its stored type is the one asked for (E0402, then E0403)."""
        entry = self.info(key)
        if dtype is not None and as_store_dtype(dtype) is not entry.dtype:
            raise StoreTypeError(ErrorCode.DTYPE_MISMATCH,
                                 f"{key!r} holds {entry.dtype}{list(entry.shape)}, not dtype {as_store_dtype(dtype)}", key)
        if shape is not None and tuple(shape) != entry.shape:
            raise StoreTypeError(ErrorCode.SHAPE_MISMATCH,
                                 f"{key!r} holds {entry.dtype}{list(entry.shape)}, not shape {list(shape)}", key)
        return entry

    def _read(self, entry: Entry) -> np.ndarray:
        layout = self._layout(entry)
        if layout.nchunks == 1 and layout.chunk_data_bytes == layout.nbytes:  # no copy: the mapped chunk
            with self._reading(entry):
                out = fmt.decode_chunk(layout, self._chunk(entry, layout, next(layout.chunks())))
        else:  # pieces of several chunks copied into one array: the copies are checked too
            out = self._read_box(entry, layout, tuple((0, n) for n in layout.storage_shape))
            if checksums.enabled():
                checksums.verify(out, int(entry.checksum, 16), what=f"key {entry.key!r}", op="get",
                                 peer=f"the store at {self.url}")
        out = fmt.from_storage(out, entry.dtype)
        out.flags.writeable = False
        return out

    def _read_box(self, entry: Entry, layout: fmt.Layout, box: Sequence[tuple[int, int]]) -> np.ndarray:
        """The storage elements of `box` ([start, stop) per storage dim), a new array read
        from the chunks that overlap the box and no others, each checked (E1102)."""
        out = np.empty(tuple(b - a for a, b in box), layout.storage_dtype)
        with self._reading(entry):
            for i in layout.chunks_over(box):
                chunk_box = layout.chunk_box(i)
                both = [(max(a, s), min(b, t)) for (a, b), (s, t) in zip(box, chunk_box)]
                chunk = fmt.decode_chunk(layout, self._chunk(entry, layout, i))
                out[_slices(both, box)] = chunk[_slices(both, chunk_box)]
        return out

    @contextlib.contextmanager
    def _reading(self, entry: Entry) -> Iterator[None]:
        """Reading a version of `entry`'s key: an OSError becomes E1104."""
        try:
            yield
        except OSError as e:
            raise StoreIOError(f"get {entry.key!r}: {e.strerror or e}", self._files.path(entry.dir), entry.key) from None

    def _layout(self, entry: Entry) -> fmt.Layout:
        """The layout of the key's version: from its zarr.json, checked against the index
        (E1105); a tensor kept inline is one chunk, its row's bytes."""
        if entry.inline:
            return fmt.plan(entry.dtype, entry.shape)
        try:
            layout, checksum = fmt.parse_metadata(self._files.read_bytes(f"{entry.dir}/zarr.json"))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise StoreCorrupt(f"the metadata of {entry.key!r} cannot be read: {e}", entry.key) from None
        if layout.dtype is not entry.dtype or layout.shape != entry.shape or checksum != entry.checksum:
            raise StoreCorrupt(f"the metadata of {entry.key!r} contradicts the index", entry.key)
        return layout

    def _chunk(self, entry: Entry, layout: fmt.Layout, i: tuple[int, ...]) -> np.ndarray:
        """Chunk i's data bytes (without its CRC), checked against its CRC32C."""
        if entry.inline:
            return _inline_body(entry, layout)
        name = layout.chunk_key(i)
        try:
            raw = self._files.map(f"{entry.dir}/{name}")
        except FileNotFoundError:
            raise ChecksumError(entry.key, name, "the chunk file is missing") from None
        want = layout.chunk_data_bytes + fmt.CRC_BYTES
        if raw.size != want:
            raise ChecksumError(entry.key, name, f"{raw.size} bytes, expected {want} (truncated or padded)")
        body = raw[:-fmt.CRC_BYTES]
        stored = int.from_bytes(raw[-fmt.CRC_BYTES:].tobytes(), "little")
        got = crc_of(body)
        if got != stored:
            raise ChecksumError(entry.key, name, f"CRC32C {got:08x}, the chunk says {stored:08x}")
        return body

    def verify(self, prefix: str = "") -> VerifyReport:
        """Scrub: re-check every chunk of every key under `prefix`."""
        report = VerifyReport()
        for entry in self._index.entries(prefix):
            report.keys += 1
            try:
                layout = self._layout(entry)
            except StoreCorrupt as e:
                report.bad.append((entry.key, "zarr.json", e.message))
                continue
            for i in layout.chunks():
                report.chunks += 1
                try:
                    self._chunk(entry, layout, i)
                except ChecksumError as e:
                    report.bad.append((entry.key, e.chunk, e.message))
                except OSError as e:
                    report.bad.append((entry.key, layout.chunk_key(i), str(e)))
        return report

    def collect(self, older_than_s: float = 3600.0) -> list[str]:
        """Remove version directories no key names (spec 9.2.3: left by a put killed before
        its commit, or by one killed between its commit and its cleanup) whose newest file
        is older than `older_than_s` and, in a directory store, that no live writer holds,
        so that puts still in flight are spared. Refused (E1107) when the index was lost:
        every version would look like garbage. Returns the directories removed."""
        return [d for d in self._garbage(older_than_s) if self._files.remove_unheld(d)]

    def _garbage(self, older_than_s: float, prefix: str = "") -> list[str]:
        """The version directories under `prefix` that no key names, whose newest file is
        older than `older_than_s`."""
        self._index.check_alive()
        current = {e.dir for e in self._index.entries(prefix)}
        newest: dict[str, float] = {}
        for rel, mtime in self._files.walk(_walk_root(prefix)):
            m = _VERSION_DIR.match(rel)  # not a ref object (`@ref`), which is a key's index row
            if m and m.group(1).startswith(f"data/{prefix}"):
                newest[m.group(1)] = max(newest.get(m.group(1), 0.0), mtime)
        cutoff = time.time() - older_than_s
        return sorted(d for d, t in newest.items() if d not in current and t <= cutoff)


def _walk_root(prefix: str) -> str:
    """The deepest directory that holds every version of the keys under `prefix`."""
    return "data/" + prefix.rsplit("/", 1)[0] if "/" in prefix else "data"


def _refuse_masked(key: str, x: Any) -> None:
    """E0401 for a numpy masked array: storing its data would drop its mask in silence, as
    np.asarray does (object arrays are refused the same way)."""
    if isinstance(x, np.ma.MaskedArray):
        raise StoreTypeError(ErrorCode.UNKNOWN_DTYPE,
                             f"put {key!r}: a masked array's mask has no place in a stored tensor; put "
                             "x.filled(value), or its data and np.ma.getmaskarray(x) under two keys", key)


def _inline_body(entry: Entry, layout: fmt.Layout) -> np.ndarray:
    """The bytes of a tensor kept inline, once their size is the layout's and their CRC32C
    the row's checksum (E1102 naming the chunk `inline`: a row damaged on the disk)."""
    body = np.frombuffer(entry.data, np.uint8)
    if body.size != layout.nbytes:
        raise ChecksumError(entry.key, fmt.INLINE_CHUNK, f"{body.size} bytes, expected {layout.nbytes}")
    got = f"{crc_of(body):08x}"
    if got != entry.checksum:
        raise ChecksumError(entry.key, fmt.INLINE_CHUNK, f"CRC32C {got}, the index says {entry.checksum}")
    return body


def as_tensor(key: str, stored: DType, a: np.ndarray) -> Any:
    """What `get` returns for the array under `key`: a dtm.Tensor (numpy before dtm/__init__
    installs the factory); a quantized tensor refused (E0408), as no dtm.Tensor holds one."""
    refuse_quantized(key, stored)
    return _tensor_factory(a)


def as_distributed(t: TensorType, value: Shards) -> Any:
    """A distributed dtm.Tensor of type `t` holding `value` (a Shards: its pieces on its
    mesh), as `get` with a mesh returns one (the Shards itself before dtm/__init__ installs
    the factory)."""
    return _distributed_factory(t, value)


def refuse_quantized(key: str, stored: DType) -> None:
    """E0408 for a quantized tensor where a dtm.Tensor is asked for."""
    if stored.is_quant:
        raise StoreTypeError(ErrorCode.QUANTIZED_MISUSE,
                             f"{key!r} holds {stored}, which a dtm.Tensor cannot hold; use get_array", key)


def _slices(box: Sequence[tuple[int, int]], within: Sequence[tuple[int, int]] | None = None) -> tuple:
    """A numpy index of `box`, counted from the start of box `within` (default: the origin);
    `...` for a scalar's, so that it gives an array."""
    starts = [a for a, _ in within] if within is not None else [0] * len(box)
    return tuple(slice(a - s, b - s) for (a, b), s in zip(box, starts)) or (Ellipsis,)


def quant_shape(key: str, a: np.ndarray, dt: DType) -> tuple[int, ...]:
    """The logical shape of quantized block storage `a`."""
    if a.dtype != np.uint8 or a.ndim < 1 or a.shape[-1] % dt.itemsize:
        raise StoreTypeError(ErrorCode.QUANTIZED_MISUSE,
                             f"put {key!r}: {dt} data is uint8 blocks of {dt.itemsize} bytes along the last dim, "
                             f"not {a.dtype}{list(a.shape)}", key)
    return (*a.shape[:-1], a.shape[-1] // dt.itemsize * dt.block)
