"""The index of a store (spec 9.2.4): one SQLite database mapping each key to the version
directory that holds its tensor, with the tensor's type, size, checksum, version and time,
plus the byte quotas; a small tensor's bytes are in its row instead (kept inline, 9.2.3).
Switching a key's row is a put's commit point: SQLite's transaction (WAL journal,
synchronous=FULL) makes it atomic and durable. Stores behind fsspec URLs, where SQLite
cannot live, use refindex.py instead, with the same methods."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple

from ..ir.dtypes import DTYPES, DType
from . import forkserver
from .errors import IndexLost, QuotaExceeded, StoreCorrupt, StoreIOError

SCHEMA_VERSION = 2  # 2 added `keys.data`, the bytes of a tensor kept inline
BUSY_TIMEOUT_MS = 30_000  # how long a writer waits for another process's transaction

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS keys(
    key TEXT PRIMARY KEY, dir TEXT NOT NULL, dtype TEXT NOT NULL, shape TEXT NOT NULL,
    nbytes INTEGER NOT NULL, checksum TEXT NOT NULL, version INTEGER NOT NULL, written REAL NOT NULL,
    data BLOB);
CREATE TABLE IF NOT EXISTS quotas(prefix TEXT PRIMARY KEY, bytes INTEGER NOT NULL);
"""


@dataclass(frozen=True)
class Entry:
    """One key's row: what `Store.info` returns. `written` is seconds since the epoch;
    `data` is the storage bytes of a tensor kept inline (its `dir` is then ""), else None."""

    key: str
    dir: str
    dtype: DType
    shape: tuple[int, ...]
    nbytes: int
    checksum: str
    version: int
    written: float
    data: bytes | None = field(default=None, repr=False)

    @property
    def inline(self) -> bool:
        """Whether the tensor is kept in its row rather than as a version directory."""
        return self.data is not None


class Row(NamedTuple):
    """What a commit writes for one key: an Entry less the version and time it is given."""

    key: str
    dir: str
    dtype: DType
    shape: tuple[int, ...]
    nbytes: int
    checksum: str
    data: bytes | None = None


def check_quotas(key: str, nbytes: int, old: Callable[[], int], quotas: dict[str, int],
                 usage: Callable[[str], int]) -> None:
    """QuotaExceeded when replacing the `old()` bytes under `key` by `nbytes` passes the
    quota of a prefix of `key` (spec 9.2.7); `usage(prefix)` is du(prefix) now. Neither is
    asked when no quota covers the key (most puts: one look-up less each)."""
    for prefix, limit in quotas.items():
        if key.startswith(prefix):
            in_use = usage(prefix)
            would = in_use - old() + nbytes
            if would > limit:
                raise QuotaExceeded(key, prefix, limit, would, nbytes, in_use)


def _under(prefix: str) -> tuple[str, tuple]:
    """A WHERE clause for keys that start with `prefix` (substr counts characters, so it
    holds for any Unicode prefix)."""
    return "substr(key, 1, ?) = ?", (len(prefix), prefix)


class _Closed:
    """A closed index's connection: any use is E1104 naming the store, not sqlite3's
    ProgrammingError from inside."""

    def __init__(self, path: str):
        self.path = path

    def __getattr__(self, name: str):
        raise StoreIOError("the store was closed; open it again", self.path)


class SqliteIndex:
    """The key index of a directory store, over one SQLite connection to `path`."""

    def __init__(self, path: str):
        deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
        forkserver.before_sqlite()
        try:
            self._db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                                       check_same_thread=False)
            while True:
                try:
                    schema = self._set_up()
                    break
                except sqlite3.OperationalError as e:
                    # Processes opening a new store at once: switching it to WAL takes a lock
                    # SQLite refuses at once ("database is locked") rather than waiting for,
                    # as waiting could deadlock; the setup is idempotent, so try again.
                    if "locked" not in str(e) or time.monotonic() > deadline:
                        raise
                    time.sleep(0.005)
        except sqlite3.DatabaseError as e:
            raise IndexLost(path, f"cannot be opened ({e})") from None
        if schema != str(SCHEMA_VERSION):
            raise StoreCorrupt(f"the store index {path} has schema {schema}, this reader reads {SCHEMA_VERSION}")
        self._lock = threading.Lock()  # one connection, shared by the process's threads
        self._path = path
        self._file = _identity(path)

    def check_alive(self) -> None:
        """IndexLost when `index.sqlite` is no longer the file this connection opened
        (deleted, or replaced by `recover`): a commit into the orphaned file would report
        success and be gone on the next open. One stat, before each commit."""
        try:
            same = _identity(self._path) == self._file
        except FileNotFoundError:
            raise IndexLost(self._path, "was deleted while the store was open") from None
        if not same:
            raise IndexLost(self._path, "was replaced while the store was open; open the store again")

    def _set_up(self) -> str:
        """WAL, full syncs, the tables; the schema version the index holds."""
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._db.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
        (schema,), = self._db.execute("SELECT value FROM meta WHERE name = 'schema'")
        return self._upgrade() if schema == "1" else schema

    def _upgrade(self) -> str:
        """Schema 1 to 2: add the `data` column, NULL in every row (each names its version
        directory), so that stores written before tensors were kept inline stay readable. Under
        the write lock, and looked at again there: processes opening the store at once
        upgrade it once."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            (schema,), = self._db.execute("SELECT value FROM meta WHERE name = 'schema'")
            if schema == "1":
                self._db.execute("ALTER TABLE keys ADD COLUMN data BLOB")
                self._db.execute("UPDATE meta SET value = '2' WHERE name = 'schema'")
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise
        return "2"

    def close(self) -> None:
        self._db.close()
        self._db = _Closed(self._path)

    def get(self, key: str) -> Entry | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM keys WHERE key = ?", (key,)).fetchone()
        return _entry(row) if row else None

    def keys(self, prefix: str) -> list[str]:
        where, args = _under(prefix)
        with self._lock:
            return [k for k, in self._db.execute(f"SELECT key FROM keys WHERE {where} ORDER BY key", args)]

    def entries(self, prefix: str) -> list[Entry]:
        where, args = _under(prefix)
        with self._lock:
            return [_entry(r) for r in self._db.execute(f"SELECT * FROM keys WHERE {where} ORDER BY key", args)]

    def usage(self, prefix: str) -> int:
        with self._lock:
            return self._usage(prefix)

    def set_quota(self, prefix: str, nbytes: int | None) -> None:
        with self._lock:
            if nbytes is None:
                self._db.execute("DELETE FROM quotas WHERE prefix = ?", (prefix,))
            else:
                self._db.execute("INSERT OR REPLACE INTO quotas VALUES (?, ?)", (prefix, nbytes))

    def quotas(self) -> dict[str, int]:
        with self._lock:
            return dict(self._db.execute("SELECT prefix, bytes FROM quotas"))

    def check_quota(self, key: str, nbytes: int) -> None:
        """QuotaExceeded when storing `nbytes` under `key` (replacing what is there) would
        pass a quota of a prefix of `key`."""
        with self._lock:
            self._check_quota(key, nbytes)

    def commit(self, key: str, dir: str, dtype: DType, shape: tuple[int, ...], nbytes: int,
               checksum: str, data: bytes | None = None) -> tuple[Entry, Entry | None]:
        """Point `key` at `dir` (or, with `data`, hold the tensor's bytes inline) in one
        transaction, after checking the quotas again (another process may have put since the
        caller's check). Returns the new entry and the entry it replaced, whose directory is
        now garbage."""
        return self.commit_many([Row(key, dir, dtype, shape, nbytes, checksum, data)])[0]

    def commit_many(self, rows: list[Row]) -> list[tuple[Entry, Entry | None]]:
        """`commit` of every row in one transaction (one sync: a group commit), all or none;
        each row's quotas are checked with the rows before it counted."""
        with self._transaction(rows[0].key if rows else ""):
            done = [self._switch(r, time.time()) for r in rows]
        return done

    def _switch(self, r: Row, now: float) -> tuple[Entry, Entry | None]:
        """Within a transaction: check the quotas and point row `r`'s key at its tensor."""
        self._check_quota(r.key, r.nbytes)
        found = self._db.execute("SELECT * FROM keys WHERE key = ?", (r.key,)).fetchone()
        old = _entry(found) if found else None
        entry = Entry(r.key, r.dir, r.dtype, r.shape, r.nbytes, r.checksum, old.version + 1 if old else 1, now, r.data)
        self._db.execute("INSERT OR REPLACE INTO keys VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                         (r.key, r.dir, r.dtype.name, json.dumps(list(r.shape)), r.nbytes, r.checksum, entry.version,
                          entry.written, r.data))
        return entry, old

    def delete(self, key: str) -> Entry | None:
        """Remove `key`'s row; its entry (whose directory is now garbage), or None."""
        with self._transaction(key):
            row = self._db.execute("SELECT * FROM keys WHERE key = ?", (key,)).fetchone()
            self._db.execute("DELETE FROM keys WHERE key = ?", (key,))
        return _entry(row) if row else None

    @contextlib.contextmanager
    def _transaction(self, key: str) -> Iterator[None]:
        """One write transaction, taken at once (IMMEDIATE) so that its reads see what it
        replaces; a failure of SQLite itself (a disk error, a lock held past the timeout)
        is E1104, and the transaction is rolled back."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                yield
                self.check_alive()
                self._db.execute("COMMIT")
            except BaseException as e:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                if isinstance(e, sqlite3.OperationalError):
                    raise StoreIOError(f"the index transaction for {key!r} failed: {e}", self._path, key) from None
                raise

    def _check_quota(self, key: str, nbytes: int) -> None:
        def old() -> int:
            row = self._db.execute("SELECT nbytes FROM keys WHERE key = ?", (key,)).fetchone()
            return row[0] if row else 0
        check_quotas(key, nbytes, old, dict(self._db.execute("SELECT prefix, bytes FROM quotas")), self._usage)

    def _usage(self, prefix: str) -> int:
        where, args = _under(prefix)
        (n,), = self._db.execute(f"SELECT coalesce(sum(nbytes), 0) FROM keys WHERE {where}", args)
        return n


def _identity(path: str) -> tuple[int, int]:
    """The device and inode of the file at `path`."""
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _entry(row: tuple) -> Entry:
    key, dir, dtype, shape, nbytes, checksum, version, written, data = row
    if dtype not in DTYPES:
        raise StoreCorrupt(f"the index gives key {key!r} the unknown dtype {dtype!r}", key)
    return Entry(key, dir, DTYPES[dtype], tuple(json.loads(shape)), nbytes, checksum, version, written, data)
