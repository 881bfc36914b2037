"""The key index of a store behind an fsspec URL (spec 9.2.4): SQLite cannot live on object
storage, so each key's row is a small JSON object, its *ref*, at `data/KEY/@ref`, and the
quotas are `quotas.json` at the root. Writing one object is atomic on object stores (and on
fsspec's memory file system), so switching a ref is a put's commit point, as switching a
SQLite row is for a directory store. A tensor kept inline is in its ref, as base64 text."""

from __future__ import annotations

import base64
import json
import threading
import time

from ..ir.dtypes import DTYPES, DType
from .errors import StoreCorrupt
from .files import FsspecFiles
from .index import Entry, Row, check_quotas

REF = "@ref"
QUOTAS = "quotas.json"
# Commits of one process to one store are serialized, so a version count and a quota check
# are exact within a process; between processes an object store offers no transaction.
_LOCK = threading.RLock()


class RefIndex:
    """The index of one store's ref objects, under `files`' root."""

    def __init__(self, files: FsspecFiles):
        self._files = files

    def close(self) -> None:
        """Nothing to release: every call reads and writes whole objects."""

    def get(self, key: str) -> Entry | None:
        try:
            raw = self._files.read_bytes(f"data/{key}/{REF}")
        except FileNotFoundError:
            return None
        try:
            doc = json.loads(raw)
            data = doc.get("data")  # (refs written before tensors were kept inline lack it)
            inline = None if data is None else base64.b64decode(data, validate=True)
            return Entry(key, doc["dir"], DTYPES[doc["dtype"]], tuple(doc["shape"]), doc["nbytes"], doc["checksum"],
                         doc["version"], doc["written"], inline)
        except (ValueError, KeyError, TypeError) as e:
            raise StoreCorrupt(f"the ref of {key!r} cannot be read: {e}", key) from None

    def keys(self, prefix: str) -> list[str]:
        # list only below the deepest directory the prefix names in full
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        found = self._files.find("data/" + base if base else "data")
        keys = [p[len("data/"):-len(REF) - 1] for p in found if p.endswith("/" + REF)]
        return sorted((k for k in keys if k.startswith(prefix)), key=lambda k: k.encode("utf-8"))

    def entries(self, prefix: str) -> list[Entry]:
        return [e for k in self.keys(prefix) if (e := self.get(k)) is not None]

    def usage(self, prefix: str) -> int:
        return sum(e.nbytes for e in self.entries(prefix))

    def quotas(self) -> dict[str, int]:
        try:
            return json.loads(self._files.read_bytes(QUOTAS))
        except FileNotFoundError:
            return {}
        except ValueError as e:
            raise StoreCorrupt(f"{QUOTAS} cannot be read: {e}") from None

    def set_quota(self, prefix: str, nbytes: int | None) -> None:
        with _LOCK:
            q = self.quotas()
            if nbytes is None:
                q.pop(prefix, None)
            else:
                q[prefix] = nbytes
            self._files.replace(QUOTAS, json.dumps(q).encode("utf-8"))

    def check_quota(self, key: str, nbytes: int) -> None:
        def old() -> int:
            entry = self.get(key)
            return entry.nbytes if entry else 0
        check_quotas(key, nbytes, old, self.quotas(), self.usage)

    def commit(self, key: str, dir: str, dtype: DType, shape: tuple[int, ...], nbytes: int,
               checksum: str, data: bytes | None = None) -> tuple[Entry, Entry | None]:
        with _LOCK:
            self.check_quota(key, nbytes)
            old = self.get(key)
            entry = Entry(key, dir, dtype, shape, nbytes, checksum, old.version + 1 if old else 1, time.time(), data)
            doc = {"dir": dir, "dtype": dtype.name, "shape": list(shape), "nbytes": nbytes, "checksum": checksum,
                   "version": entry.version, "written": entry.written,
                   "data": None if data is None else base64.b64encode(data).decode("ascii")}
            self._files.replace(f"data/{key}/{REF}", json.dumps(doc).encode("utf-8"))
        return entry, old

    def commit_many(self, rows: list[Row]) -> list[tuple[Entry, Entry | None]]:
        """`commit` of each row in turn: an object store has no transaction over several
        objects, so a failure part way leaves the rows before it committed."""
        with _LOCK:
            return [self.commit(*r) for r in rows]

    def check_alive(self) -> None:
        """Nothing to check: the refs are the index, each key's own."""

    def delete(self, key: str) -> Entry | None:
        with _LOCK:
            old = self.get(key)
            if old is not None:
                self._files.remove(f"data/{key}/{REF}")
        return old
