"""The tensor store (spec 9.2): keys mapped to tensors, durable, checksummed and atomic.

`open()` gives a `Store`: by default a directory (`$DTM_STORE`, else ~/.cache/dtm/store),
a path or `file://` URL (a directory store, indexed in SQLite), `memory://NAME` for a
process-local store, or any other fsspec URL (`s3://...`, indexed by ref objects). `use(st)` makes
a store the process's current one, which `store_get`/`store_put` in programs read and write;
`current()` returns it, opening the default lazily.

Layer: `dtm/store` is row 8 of DESIGN.md's table (L2 services). It imports `dtm/ir`
(dtypes), `dtm/errors`, for distributed tensors (sharded.py) the piece geometry of
`dtm/compiler/spmd` and the meshes and `Shards` of `dtm/runtime`, and the standard
library, numpy and crc32c, and never the user-facing API of row 9: `get` returns a
`dtm.Tensor` through factories that `dtm/__init__.py` installs (`set_tensor_factory`), and
a distributed tensor given to `put` is duck-typed.
"""

from __future__ import annotations

import os
import threading

from .errors import (ChecksumError, InvalidKey, KeyMissing, QuotaExceeded, StoreCorrupt, StoreError, StoreIOError,
                     StoreTypeError)
from .files import FsspecFiles, LocalFiles
from .format import DEFAULT_CHUNK_BYTES
from .index import SqliteIndex
from .keys import MAX_KEY_BYTES, check_key
from .refindex import RefIndex
from .store import Info, Store, VerifyReport, set_tensor_factory

__all__ = ["open", "use", "current", "Store", "Info", "VerifyReport", "StoreError", "KeyMissing", "StoreTypeError",
           "InvalidKey", "ChecksumError", "QuotaExceeded", "StoreIOError", "StoreCorrupt", "MAX_KEY_BYTES",
           "check_key", "set_tensor_factory"]

_current: Store | None = None
_lock = threading.RLock()  # current() opens the default store while holding it


def default_path() -> str:
    return os.environ.get("DTM_STORE") or os.path.join(os.path.expanduser("~"), ".cache", "dtm", "store")


def open(url: str | os.PathLike | None = None, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Store:  # noqa: A001
    """Open (creating it if needed) the store at `url`: a path, `file://PATH`, or
    `memory://NAME`; None for the default directory. E1104 when the path is a file or not
    writable."""
    url = default_path() if url is None else os.fspath(url)
    if "://" in url and not url.startswith("file://"):
        return _open_fsspec(url, chunk_bytes)
    root = os.path.abspath(os.path.expanduser(url.removeprefix("file://")))
    if os.path.exists(root) and not os.path.isdir(root):
        raise StoreIOError("the store path is not a directory", root)
    try:
        os.makedirs(os.path.join(root, "data"), exist_ok=True)
    except OSError as e:
        raise StoreIOError(f"cannot create the store: {e.strerror or e}", root) from None
    if not os.access(root, os.W_OK) or not os.access(os.path.join(root, "data"), os.W_OK):
        raise StoreIOError("the store directory is not writable", root)
    return Store("file://" + root, LocalFiles(root), SqliteIndex(os.path.join(root, "index.sqlite")), chunk_bytes)


def _open_fsspec(url: str, chunk_bytes: int) -> Store:
    """A store behind any other fsspec URL, with the user's own fsspec back ends and
    credentials: `memory://NAME` (fsspec's process-local memory file system), `s3://...`."""
    import fsspec  # only stores behind URLs need it

    try:
        fs, root = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:
        raise StoreIOError(f"fsspec cannot open the store: {e}", url) from None
    files = FsspecFiles(fs, root)
    return Store(url, files, RefIndex(files), chunk_bytes)


def use(store: Store) -> Store:
    """Make `store` the process's current store (what `current()` and programs use)."""
    global _current
    if not isinstance(store, Store):
        raise TypeError(f"dtm.store.use takes a Store, not {type(store).__name__}")
    _current = store
    return store


def current() -> Store:
    """The process's current store: the one last given to `use`, else the default one."""
    global _current
    with _lock:
        if _current is None:
            _current = open()
        return _current
