"""The tensor store (spec 9.2): keys mapped to tensors, durable, checksummed and atomic.

`open()` gives a `Store`: by default a directory (`$DTM_STORE`, else ~/.cache/dtm/store),
a path or `file://` URL (a directory store, indexed in SQLite), `memory://NAME` for a
process-local store, or any other fsspec URL (`s3://...`, indexed by ref objects). `use(st)` makes
a store the process's current one, which `store_get`/`store_put` in programs read and write;
`current()` returns it, opening the default lazily. After `dtm.init()` in a mesh of several
processes, `mesh()` is the store spread over the mesh's ranks (mesh_store.py), and the current
store unless `use` named another.

Layer: `dtm/store` is row 8 of DESIGN.md's table (L2 services). It imports `dtm/ir`
(dtypes), `dtm/protocol` (frames), `dtm/runtime` (the process group; the meshes and
`Shards` for distributed tensors), the piece geometry of `dtm/compiler/spmd` (sharded.py),
`dtm/errors`, the standard library, numpy and crc32c, and never the user-facing API of
row 9: `get` returns a `dtm.Tensor` through factories that `dtm/__init__.py` installs
(`set_tensor_factory`), and a distributed tensor given to `put` is duck-typed.
"""

from __future__ import annotations

import os
import threading
import weakref

from .errors import (ChecksumError, InvalidKey, KeyMissing, QuotaExceeded, StoreCorrupt, StoreError, StoreIOError,
                     StoreTypeError)
from .files import FsspecFiles, LocalFiles, MemoryFiles
from .format import DEFAULT_CHUNK_BYTES, INLINE_BYTES
from .index import SqliteIndex
from ..errors import ErrorCode
from ..runtime import process_group
from .errors import KeyLost
from .keys import MAX_KEY_BYTES, check_key
from .mesh_store import MeshStore, part_of, start_service
from .refindex import RefIndex
from .store import Info, Store, VerifyReport, set_tensor_factory

__all__ = ["open", "mesh", "use", "current", "Store", "MeshStore", "KeyLost", "Info", "VerifyReport", "StoreError", "KeyMissing", "StoreTypeError",
           "InvalidKey", "ChecksumError", "QuotaExceeded", "StoreIOError", "StoreCorrupt", "MAX_KEY_BYTES",
           "check_key", "set_tensor_factory"]

_current: Store | MeshStore | None = None
_lock = threading.RLock()  # current() opens the default store while holding it
_meshes: "weakref.WeakKeyDictionary[object, dict[tuple, MeshStore]]" = weakref.WeakKeyDictionary()  # by group

process_group.on_join(start_service)  # every rank of a mesh serves its part of the mesh's store


def default_path() -> str:
    return os.environ.get("DTM_STORE") or os.path.join(os.path.expanduser("~"), ".cache", "dtm", "store")


def open(url: str | os.PathLike | None = None, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,  # noqa: A001
         inline_bytes: int = INLINE_BYTES) -> Store:
    """Open (creating it if needed) the store at `url`: a path, `file://PATH`, or
    `memory://NAME`; None for the default directory. E1104 when the path is a file or not
    writable. A tensor put whole of at most `inline_bytes` is kept in its index row, which
    Zarr readers do not see (spec 9.2.3); 0 makes every tensor a Zarr array."""
    url = default_path() if url is None else os.fspath(url)
    if "://" in url and not url.startswith("file://"):
        return _open_fsspec(url, chunk_bytes, inline_bytes)
    root = os.path.abspath(os.path.expanduser(url.removeprefix("file://")))
    if os.path.exists(root) and not os.path.isdir(root):
        raise StoreIOError("the store path is not a directory", root)
    try:
        os.makedirs(os.path.join(root, "data"), exist_ok=True)
    except OSError as e:
        raise StoreIOError(f"cannot create the store: {e.strerror or e}", root) from None
    if not os.access(root, os.W_OK) or not os.access(os.path.join(root, "data"), os.W_OK):
        raise StoreIOError("the store directory is not writable", root)
    return Store("file://" + root, LocalFiles(root), SqliteIndex(os.path.join(root, "index.sqlite")), chunk_bytes,
                 inline_bytes)


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
        if (replicas, share_memory) not in made:
            made[replicas, share_memory] = MeshStore(pg, *part, replicas=replicas, share_memory=share_memory)
        return made[replicas, share_memory]


def use(store: Store | MeshStore) -> Store | MeshStore:
    """Make `store` the process's current store (what `current()` and programs use)."""
    global _current
    if not isinstance(store, (Store, MeshStore)):
        raise TypeError(f"dtm.store.use takes a Store, not {type(store).__name__}")
    _current = store
    return store


def current() -> Store | MeshStore:
    """The process's current store: the one last given to `use`; else, in a mesh of several
    processes, the mesh's store; else the default one."""
    global _current
    with _lock:
        if _current is not None:
            return _current
        if process_group.is_initialized() and part_of(process_group.current()) is not None:
            return mesh()
        _current = open()
        return _current
