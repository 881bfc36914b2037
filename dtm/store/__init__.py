"""The tensor store (spec 9.2): keys mapped to tensors, durable, checksummed and atomic.

`open()` gives a `Store`: by default a directory (`$DTM_STORE`, else ~/.cache/dtm/store),
or any path or `file://` URL, or `memory://NAME` for a process-local store. `use(st)` makes
a store the process's current one, which `store_get`/`store_put` in programs read and write;
`current()` returns it, opening the default lazily.

Layer: `dtm/store` is row 8 of DESIGN.md's table (L2 services). It imports only `dtm/ir`
(dtypes), `dtm/errors` and the standard library, numpy and crc32c, and never the
user-facing API of row 9: `get` returns a `dtm.Tensor` through a factory that
`dtm/__init__.py` installs (`set_tensor_factory`).
"""

from __future__ import annotations

import os
import threading

from .errors import (ChecksumError, InvalidKey, KeyMissing, QuotaExceeded, StoreCorrupt, StoreError, StoreIOError,
                     StoreTypeError)
from .files import LocalFiles, MemoryFiles
from .format import DEFAULT_CHUNK_BYTES
from .index import Index
from .keys import MAX_KEY_BYTES, check_key
from .store import Info, Store, VerifyReport, set_tensor_factory

__all__ = ["open", "use", "current", "Store", "Info", "VerifyReport", "StoreError", "KeyMissing", "StoreTypeError",
           "InvalidKey", "ChecksumError", "QuotaExceeded", "StoreIOError", "StoreCorrupt", "MAX_KEY_BYTES",
           "check_key", "set_tensor_factory"]

_current: Store | None = None
_lock = threading.RLock()  # current() opens the default store while holding it
# memory:// stores by name, so two opens of one name in a process see one store
_memory: dict[str, tuple[MemoryFiles, Index]] = {}


def default_path() -> str:
    return os.environ.get("DTM_STORE") or os.path.join(os.path.expanduser("~"), ".cache", "dtm", "store")


def open(url: str | os.PathLike | None = None, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Store:  # noqa: A001
    """Open (creating it if needed) the store at `url`: a path, `file://PATH`, or
    `memory://NAME`; None for the default directory. E1104 when the path is a file or not
    writable."""
    url = default_path() if url is None else os.fspath(url)
    if url.startswith("memory://"):
        with _lock:
            if url not in _memory:
                _memory[url] = (MemoryFiles(), Index(":memory:"))
            files, index = _memory[url]
        return Store(url, files, index, chunk_bytes)
    if "://" in url and not url.startswith("file://"):
        raise StoreIOError("only local paths, file:// and memory:// stores are supported by this version", url)
    root = os.path.abspath(os.path.expanduser(url.removeprefix("file://")))
    if os.path.exists(root) and not os.path.isdir(root):
        raise StoreIOError("the store path is not a directory", root)
    try:
        os.makedirs(os.path.join(root, "data"), exist_ok=True)
    except OSError as e:
        raise StoreIOError(f"cannot create the store: {e.strerror or e}", root) from None
    if not os.access(root, os.W_OK) or not os.access(os.path.join(root, "data"), os.W_OK):
        raise StoreIOError("the store directory is not writable", root)
    return Store("file://" + root, LocalFiles(root), Index(os.path.join(root, "index.sqlite")), chunk_bytes)


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
