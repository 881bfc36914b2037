"""The tensor store (spec 9.2): keys mapped to tensors, durable, checksummed and atomic.

`open()` gives a `Store`: by default a directory (`$DTM_STORE`, else ~/.cache/dtm/store),
a path or `file://` URL (a directory store, indexed in SQLite), `memory://NAME` for a
process-local store, or any other fsspec URL (`s3://...`, indexed by ref objects). `use(st)` makes
a store the process's current one, which `store_get`/`store_put` in programs read and write;
`current()` returns it, opening the default lazily. After `dtm.init()` in a mesh of several
processes, `mesh()` is the store spread over the mesh's ranks (mesh_store.py), and the current
store unless `use` named another.

Layer: `dtm/store` is row 8 of docs/architecture.md's table (L2 services). It imports `dtm/ir`
(dtypes), `dtm/protocol` (frames), `dtm/runtime` (the process group; the meshes and
`Shards` for distributed tensors), the piece geometry of `dtm/compiler/spmd` (sharded.py),
`dtm/errors`, the standard library, numpy and crc32c, and never the user-facing API of
row 9: `get` returns a `dtm.Tensor` through factories that `dtm/__init__.py` installs
(`set_tensor_factory`), and a distributed tensor given to `put` is duck-typed.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import weakref
from typing import Iterator

from .errors import (ChecksumError, IndexLost, InvalidKey, KeyMissing, QuotaExceeded, StoreCorrupt, StoreError,
                     StoreIOError, StoreTypeError)
from .files import FsspecFiles, LocalFiles, MemoryFiles
from .format import DEFAULT_CHUNK_BYTES, INLINE_BYTES
from .index import SqliteIndex
from ..errors import ErrorCode
from ..runtime import process_group
from .errors import KeyLost
from .keys import MAX_KEY_BYTES, check_key
from .mesh_store import MeshStore, part_of, start_service
from .recover import INDEX, RecoveryReport, check_index, mark
from .recover import recover as _recover
from .refindex import RefIndex
from .store import Info, Store, VerifyReport, set_tensor_factory

__all__ = ["open", "recover", "RecoveryReport", "mesh", "use", "scoped", "current", "Store", "MeshStore", "KeyLost", "Info", "VerifyReport", "StoreError", "KeyMissing", "StoreTypeError",
           "InvalidKey", "ChecksumError", "QuotaExceeded", "StoreIOError", "StoreCorrupt", "IndexLost", "MAX_KEY_BYTES",
           "check_key", "set_tensor_factory"]

_current: Store | MeshStore | None = None
# a task graph's store while one of its tasks runs: per thread (and asyncio task), so the
# graph's tasks and the rest of the process each see their own store at the same time
_scoped: contextvars.ContextVar[Store | MeshStore | None] = contextvars.ContextVar("dtm_store", default=None)
_lock = threading.RLock()  # current() opens the default store while holding it
_meshes: "weakref.WeakKeyDictionary[object, dict[tuple, MeshStore]]" = weakref.WeakKeyDictionary()  # by group

process_group.on_join(start_service)  # every rank of a mesh serves its part of the mesh's store


def default_path() -> str:
    return os.environ.get("DTM_STORE") or os.path.join(os.path.expanduser("~"), ".cache", "dtm", "store")


def open(url: str | os.PathLike | None = None, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,  # noqa: A001
         inline_bytes: int = INLINE_BYTES, durable: bool = True) -> Store:
    """Open (creating it if needed) the store at `url`: a path, `file://PATH`, or
    `memory://NAME`; None for the default directory. E1104 when the path is a file or not
    writable. A tensor put whole of at most `inline_bytes` is kept in its index row, which
    Zarr readers do not see (spec 9.2.3); 0 makes every tensor a Zarr array.
    `durable=False` (a directory store): a put's files are synced only by `Store.sync`, for
    a writer whose own commit point follows every put (a checkpoint's manifest)."""
    url = default_path() if url is None else os.fspath(url)
    if "://" in url and not url.startswith("file://"):
        return _open_fsspec(url, chunk_bytes, inline_bytes)
    root = _make_root(url)
    check_index(root)
    st = Store("file://" + root, LocalFiles(root, durable), SqliteIndex(os.path.join(root, INDEX)), chunk_bytes, inline_bytes)
    mark(root)
    st.clean_up_after_dead_writers()
    return st


def recover(url: str | os.PathLike | None = None) -> RecoveryReport:
    """Rebuild the index of the directory store at `url` (None: the default) from the
    versions on disk, after the index was deleted or damaged (E1107 on open); tensors that
    were kept inline in it cannot be recovered (spec 9.2.12). Run it while no other
    process writes to the store."""
    url = default_path() if url is None else os.fspath(url)
    if "://" in url and not url.startswith("file://"):
        raise StoreError(ErrorCode.ATTRIBUTE_VALUE, f"{url}: only a directory store has an index to recover "
                                                    "(a store behind a URL keeps a ref per key, 9.2.4)")
    return _recover(_make_root(url))


def _make_root(url: str) -> str:
    """The absolute root directory of the directory store `url`, with its `data/` made
    (E1104 when it is a file, cannot be made or is not writable)."""
    root = os.path.abspath(os.path.expanduser(url.removeprefix("file://")))
    if os.path.exists(root) and not os.path.isdir(root):
        raise StoreIOError("the store path is not a directory", root)
    try:
        os.makedirs(os.path.join(root, "data"), exist_ok=True)
    except OSError as e:
        raise StoreIOError(f"cannot create the store: {e.strerror or e}", root) from None
    if not os.access(root, os.W_OK) or not os.access(os.path.join(root, "data"), os.W_OK):
        raise StoreIOError("the store directory is not writable", root)
    return root


def _open_fsspec(url: str, chunk_bytes: int, inline_bytes: int) -> Store:
    """A store behind any other fsspec URL, with the user's own fsspec back ends and
    credentials: `memory://NAME` (fsspec's process-local memory file system), `s3://...`."""
    import fsspec  # only stores behind URLs need it

    try:
        fs, root = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:
        raise StoreIOError(f"fsspec cannot open the store: {e}", url) from None
    from fsspec.implementations.memory import MemoryFileSystem

    files = MemoryFiles(fs, root) if isinstance(fs, MemoryFileSystem) else FsspecFiles(fs, root)
    return Store(url, files, RefIndex(files), chunk_bytes, inline_bytes)


def mesh(*, replicas: int | None = None, share_memory: bool = True) -> MeshStore:
    """The mesh's store (spec 9.2.11), after `dtm.init()`: the same keys from every rank,
    each kept on `replicas` ranks (default 2, at most the world size). `share_memory=False`
    makes gets from ranks on this machine travel over the wire as from another host's.
    Without a mesh of several processes, E1005."""
    pg = process_group.current() if process_group.is_initialized() else None
    part = part_of(pg) if pg is not None else None
    if part is None:
        raise StoreError(ErrorCode.NOT_INITIALIZED, "dtm.store.mesh() needs a mesh of several processes: call "
                                                    "dtm.init() under `dtm launch` first (a single process has "
                                                    "dtm.store.open())")
    with _lock:
        made = _meshes.setdefault(pg, {})
        key = (pg.epoch, replicas, share_memory)  # an elastic mesh's next epoch has a store of its own
        if key not in made:
            for old in [k for k in made if k[0] != pg.epoch]:
                del made[old]
            made[key] = MeshStore(pg, *part, replicas=replicas, share_memory=share_memory)
        return made[key]


def use(store: Store | MeshStore) -> Store | MeshStore:
    """Make `store` the process's current store (what `current()` and programs use)."""
    global _current
    if not isinstance(store, (Store, MeshStore)):
        raise TypeError(f"dtm.store.use takes a Store, not {type(store).__name__}")
    _current = store
    return store


@contextlib.contextmanager
def scoped(store: Store | MeshStore) -> Iterator[Store | MeshStore]:
    """Make `store` what `current()` returns in this thread until the block ends (a task
    graph's store while one of its tasks runs: its programs' store_get / store_put)."""
    token = _scoped.set(store)
    try:
        yield store
    finally:
        _scoped.reset(token)


def current() -> Store | MeshStore:
    """The process's current store: inside `scoped(st)`, st; else the one last given to
    `use`; else, in a mesh of several processes, the mesh's store; else the default one."""
    global _current
    if (found := _scoped.get()) is not None:
        return found
    with _lock:
        if _current is not None:
            return _current
        if process_group.is_initialized() and part_of(process_group.current()) is not None:
            return mesh()
        _current = open()
        return _current
