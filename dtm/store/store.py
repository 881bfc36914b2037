"""`Store`: the embedded tensor store of one process (spec 9.2): put, get, info, keys,
delete, du, quotas and verify over an index (index.py) and a file backend (files.py), in the
Zarr v3 layout of format.py."""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from crc32c import crc32c

from ..errors import ErrorCode
from ..ir.dtypes import DTYPES, DType, from_numpy, numpy_dtype
from . import format as fmt
from .errors import ChecksumError, KeyMissing, StoreCorrupt, StoreError, StoreIOError, StoreTypeError
from .files import FsspecFiles, LocalFiles
from .index import Entry, SqliteIndex
from .refindex import RefIndex
from .keys import check_key

# What `get` wraps its array in. The store sits below the user-facing API (DESIGN.md, layer
# 8), so `dtm/__init__.py` installs `Tensor.from_numpy` here; until then get gives numpy.
_tensor_factory: Callable[[np.ndarray], Any] = lambda a: a


def set_tensor_factory(factory: Callable[[np.ndarray], Any]) -> None:
    global _tensor_factory
    _tensor_factory = factory


# A version directory `data/KEY/@ID` or a path inside it (keys have no `@` segments, 9.2.1)
_VERSION_DIR = re.compile(r"(data/(?:[^/]+/)+?@[0-9a-f]{16})(?:/|$)")

Info = Entry  # what info() returns: dtype, shape, nbytes, checksum, version, written


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
    """An embedded tensor store. Open one with `dtm.store.open`."""

    def __init__(self, url: str, files: LocalFiles | FsspecFiles, index: SqliteIndex | RefIndex,
                 chunk_bytes: int = fmt.DEFAULT_CHUNK_BYTES):
        self.url = url
        self._files = files
        self._index = index
        self._chunk_bytes = chunk_bytes

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._files.drain()
        self._index.close()

    # --- writing ------------------------------------------------------------------------

    def put(self, key: str, x: Any, dtype: Any = None) -> Info:
        """Store a copy of `x` (a dtm.Tensor, numpy array or anything np.asarray takes)
        under `key`, replacing what was there; visible whole or not at all."""
        return self.put_array(key, np.asarray(x), dtype)

    def put_array(self, key: str, a: np.ndarray, dtype: Any = None) -> Info:
        """Store `a` under `key`. `dtype` converts it; for `q8_0`/`q4_0` `a` is the uint8
        block storage of shape [..., K/32 * block bytes] (dtm/ref/quant.py)."""
        key = check_key(key)
        dt = as_store_dtype(a.dtype if dtype is None else dtype)
        if dt.is_quant:
            shape = quant_shape(key, a, dt)
        else:
            if dtype is not None:
                a = a.astype(numpy_dtype(dt), copy=False)
            shape = tuple(a.shape)
        data = fmt.to_storage(a, dt)
        layout = fmt.plan(dt, shape, self._chunk_bytes)
        self._index.check_quota(key, layout.nbytes)
        rel = f"data/{key}/@{secrets.token_hex(8)}"  # 16 hex digits, as _VERSION_DIR expects
        try:
            checksum = self._write_chunks(rel, layout, data)
            self._files.write(f"{rel}/zarr.json", [fmt.metadata(layout, checksum)])
            self._files.sync_tree(rel)
            entry, old = self._index.commit(key, rel, dt, shape, layout.nbytes, checksum)
        except OSError as e:
            self._files.remove_tree(rel)
            raise StoreIOError(f"put {key!r} failed, the earlier tensor is kept: {e.strerror or e}",
                               self._files.path(rel), key) from None
        except BaseException:
            self._files.remove_tree(rel)
            raise
        if old is not None:
            self._files.remove_later(old)
        return entry

    def _write_chunks(self, rel: str, layout: fmt.Layout, data: np.ndarray) -> str:
        """Write every chunk (bytes, edge padding, CRC32C); the tensor's checksum, the CRC32C
        of all its storage bytes in order."""
        flat = data.reshape(-1).view(np.uint8) if data.size else np.empty(0, np.uint8)
        total, row = 0, layout.row_bytes
        for i in range(layout.nchunks):
            start, stop = layout.chunk_rows(i)
            body = memoryview(flat[start * row:stop * row]) if layout.storage_shape else memoryview(flat)
            pad = bytes(layout.chunk_data_bytes - len(body))
            crc = crc32c(pad, crc32c(body))
            total = crc32c(body, total) if layout.nchunks > 1 or pad else crc
            self._files.write(f"{rel}/{layout.chunk_key(i)}", [body, pad, crc.to_bytes(fmt.CRC_BYTES, "little")])
        return f"{total:08x}"

    def delete(self, key: str) -> None:
        """Remove `key` (E0804 when it is not stored)."""
        key = check_key(key)
        entry = self._index.delete(key)
        if entry is None:
            raise KeyMissing(key)
        self._files.remove_tree(entry.dir)

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

    def du(self, prefix: str = "") -> int:
        """Bytes of tensor data stored under `prefix`."""
        return self._index.usage(prefix)

    def quotas(self) -> dict[str, int]:
        return self._index.quotas()

    def __contains__(self, key: str) -> bool:
        return self._index.get(check_key(key)) is not None

    def get(self, key: str, dtype: Any = None, shape: tuple[int, ...] | None = None) -> Any:
        """The tensor under `key` as a dtm.Tensor; with `dtype`/`shape`, E0402/E0403 when
        the stored type differs. Quantized tensors: use get_array."""
        return as_tensor(key, self._checked(key, dtype, shape).dtype, self.get_array(key, dtype, shape))

    def get_array(self, key: str, dtype: Any = None, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """The tensor under `key` as a read-only numpy array, memory-mapped when it is one
        chunk on a local disk; every chunk's CRC32C is checked first (E1102)."""
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
        try:
            chunks = [self._chunk(entry, layout, i) for i in range(layout.nchunks)]
        except OSError as e:
            raise StoreIOError(f"get {entry.key!r}: {e.strerror or e}", self._files.path(entry.dir), entry.key) from None
        if layout.nchunks == 1 and layout.chunk_data_bytes == layout.nbytes:  # no copy: the mapped chunk
            out = chunks[0].view(layout.storage_dtype).reshape(layout.storage_shape)
        else:
            out = np.empty(layout.storage_shape, layout.storage_dtype)
            flat = out.reshape(-1).view(np.uint8)
            for i, c in enumerate(chunks):
                start, stop = layout.chunk_rows(i)
                flat[start * layout.row_bytes:stop * layout.row_bytes] = c[:(stop - start) * layout.row_bytes]
        out = fmt.from_storage(out, entry.dtype)
        out.flags.writeable = False
        return out

    def _layout(self, entry: Entry) -> fmt.Layout:
        try:
            layout, checksum = fmt.parse_metadata(self._files.read_bytes(f"{entry.dir}/zarr.json"))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise StoreCorrupt(f"the metadata of {entry.key!r} cannot be read: {e}", entry.key) from None
        if layout.dtype is not entry.dtype or layout.shape != entry.shape or checksum != entry.checksum:
            raise StoreCorrupt(f"the metadata of {entry.key!r} contradicts the index", entry.key)
        return layout

    def _chunk(self, entry: Entry, layout: fmt.Layout, i: int) -> np.ndarray:
        """Chunk i's data bytes (without its CRC), checked against its CRC32C."""
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
        got = crc32c(body)
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
            for i in range(layout.nchunks):
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
        is older than `older_than_s`, so that puts still in flight are spared. Returns the
        directories removed."""
        current = {e.dir for e in self._index.entries("")}
        newest: dict[str, float] = {}
        for rel, mtime in self._files.walk("data"):
            m = _VERSION_DIR.match(rel)  # not a ref object (`@ref`), which is a key's index row
            if m:
                newest[m.group(1)] = max(newest.get(m.group(1), 0.0), mtime)
        cutoff = time.time() - older_than_s
        garbage = sorted(d for d, t in newest.items() if d not in current and t < cutoff)
        for d in garbage:
            self._files.remove_tree(d)
        return garbage


def as_tensor(key: str, stored: DType, a: np.ndarray) -> Any:
    """What `get` returns for the array under `key`: a dtm.Tensor (numpy before dtm/__init__
    installs the factory); a quantized tensor refused (E0408), as no dtm.Tensor holds one."""
    if stored.is_quant:
        raise StoreTypeError(ErrorCode.QUANTIZED_MISUSE,
                             f"{key!r} holds {stored}, which a dtm.Tensor cannot hold; use get_array", key)
    return _tensor_factory(a)


def quant_shape(key: str, a: np.ndarray, dt: DType) -> tuple[int, ...]:
    """The logical shape of quantized block storage `a`."""
    if a.dtype != np.uint8 or a.ndim < 1 or a.shape[-1] % dt.itemsize:
        raise StoreTypeError(ErrorCode.QUANTIZED_MISUSE,
                             f"put {key!r}: {dt} data is uint8 blocks of {dt.itemsize} bytes along the last dim, "
                             f"not {a.dtype}{list(a.shape)}", key)
    return (*a.shape[:-1], a.shape[-1] // dt.itemsize * dt.block)
