"""The errors the tensor store raises: each a `DTMError` with its spec code (chapter 10) and
the key it concerns (`key`, None when the fault is the store's own)."""

from __future__ import annotations

import os

from ..errors import DTMError, ErrorCode
from .format import INLINE_BYTES


class StoreError(DTMError):
    """Base of the store's errors; `key` names the key, where one is concerned."""

    def __init__(self, code: ErrorCode, message: str, key: str | None = None):
        super().__init__(code, message)
        self.key = key


class KeyMissing(StoreError, KeyError):
    """No tensor under the key (E0804); a KeyError too, as a missing dict key is."""

    def __init__(self, key: str):
        super().__init__(ErrorCode.STORE_KEY_MISSING, f"no tensor is stored under {key!r}", key)


class StoreTypeError(StoreError, TypeError):
    """The stored tensor's dtype (E0402) or shape (E0403) is not the one asked for."""


# How much of a bad key an error shows: an over-long key (10 KB) echoed whole buried the reason
SHOWN_KEY_CHARS = 64


class InvalidKey(StoreError, ValueError):
    """A key that breaks the key syntax of spec 9.2.1 (E1101); the message shows at most
    SHOWN_KEY_CHARS of it."""

    def __init__(self, key: object, why: str):
        super().__init__(ErrorCode.INVALID_STORE_KEY, f"invalid store key {_shown(key)}: {why}",
                         key if isinstance(key, str) else None)


def _shown(key: object) -> str:
    """`key`'s repr, cut to its first SHOWN_KEY_CHARS characters and its length when longer."""
    if isinstance(key, (str, bytes)) and len(key) > SHOWN_KEY_CHARS:
        return f"{key[:SHOWN_KEY_CHARS]!r}... ({len(key)} {'characters' if isinstance(key, str) else 'bytes'})"
    return repr(key)


class ChecksumError(StoreError):
    """A chunk whose CRC32C or length does not match (E1102); `chunk` is its chunk key."""

    def __init__(self, key: str, chunk: str, why: str):
        super().__init__(ErrorCode.STORE_CHUNK_CORRUPT, f"key {key!r}, chunk {chunk!r}: {why}", key)
        self.chunk = chunk


class QuotaExceeded(StoreError):
    """A put that would pass a prefix's byte quota (E1103); nothing was written."""

    def __init__(self, key: str, prefix: str, limit: int, would_use: int, asked: int, in_use: int):
        under = f"prefix {prefix!r}" if prefix else "the store"
        super().__init__(ErrorCode.STORE_QUOTA_EXCEEDED,
                         f"put {key!r} asks for {asked:,} bytes; {in_use:,} bytes are in use under {under}, whose quota "
                         f"is {limit:,} bytes: the put would use {would_use:,}", key)
        self.prefix, self.limit, self.would_use, self.asked, self.in_use = prefix, limit, would_use, asked, in_use


class StoreIOError(StoreError):
    """The storage failed (E1104): a path that is a file or not writable, a full disk, a read
    or write error. `path` names the file or directory."""

    def __init__(self, message: str, path: str, key: str | None = None):
        super().__init__(ErrorCode.STORE_IO_ERROR, f"{message} ({path})", key)
        self.path = path


class StoreCorrupt(StoreError):
    """The index or a tensor's metadata cannot be read or contradicts itself (E1105)."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(ErrorCode.STORE_CORRUPT, message, key)


class IndexLost(StoreError):
    """A directory store's index is missing or damaged (E1107): its keys cannot be read or
    written until `dtm store recover` rebuilds it from the versions on disk (spec 9.2.12)."""

    def __init__(self, path: str, what: str):
        super().__init__(ErrorCode.STORE_INDEX_LOST,
                         f"the store index {path} {what}; no key can be read or written until "
                         f"`dtm store --store {os.path.dirname(path)} recover` (dtm.store.recover) rebuilds it from "
                         f"the versions on disk; tensors kept inline in the index (<= {INLINE_BYTES} bytes) cannot be "
                         "recovered")
        self.path = path


class KeyLost(StoreError, KeyError):
    """Every rank that may have held the key is lost (E1106): no live rank of the mesh
    holds it, and some of the ranks it was placed on are gone. `detail`: how a rank was lost
    while this read waited for it, when one was."""

    def __init__(self, key: str, lost: list[int], detail: str = ""):
        super().__init__(ErrorCode.STORE_KEY_LOST,
                         f"no live rank holds {key!r}; the ranks it was placed on that are lost: {lost}"
                         + (f" ({detail})" if detail else ""), key)
        self.lost = lost


_BY_CODE: dict[ErrorCode, type[StoreError]] = {
    ErrorCode.STORE_KEY_MISSING: KeyMissing, ErrorCode.DTYPE_MISMATCH: StoreTypeError,
    ErrorCode.SHAPE_MISMATCH: StoreTypeError, ErrorCode.INVALID_STORE_KEY: InvalidKey,
    ErrorCode.STORE_CHUNK_CORRUPT: ChecksumError, ErrorCode.STORE_QUOTA_EXCEEDED: QuotaExceeded,
    ErrorCode.STORE_IO_ERROR: StoreIOError, ErrorCode.STORE_CORRUPT: StoreCorrupt}


def remote_error(code: ErrorCode, message: str, key: str, peer: str) -> StoreError:
    """The error a peer's store answered with, as the class this side raises for its code
    (so `except KeyMissing` catches a key missing on another rank too), naming the peer."""
    err = StoreError.__new__(_BY_CODE.get(code, StoreError))
    StoreError.__init__(err, code, f"{peer}: {message}", key)
    return err
