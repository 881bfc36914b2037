"""A directory store whose index was lost (spec 9.2.12): telling a lost index from a new
store when it is opened, and rebuilding the index from the versions on disk, each key's
newest complete version as its `zarr.json` describes it (dtype, shape, checksum). A tensor
kept inline lived in the index alone, so a rebuilt index lacks it."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import sqlite3
import time
from dataclasses import dataclass, field

from . import forkserver
from . import format as fmt
from .errors import IndexLost, InvalidKey
from .files import LocalFiles
from .index import Row, SqliteIndex
from .keys import check_key

INDEX = "index.sqlite"
# Written once a store has an index: without it, a store whose index and data are both gone
# (every tensor kept inline) would open as a new, empty one in silence
MARKER = "store.json"
_MARKER_TEXT = b'{"dtm_store": 1, "index": "index.sqlite"}\n'
_VERSION = re.compile(r"@[0-9a-f]{16}")
MAX_METADATA_BYTES = 1 << 20  # a zarr.json the store wrote is under 1 KiB; more is not one of its


@dataclass
class RecoveryReport:
    """What `recover` did: `keys` rebuilt; `inline_lost`, how many tensors the old index
    kept inline (gone with it; None when the old index could not be read to count them);
    `quotas` carried over; `skipped`, (version directory, why) for versions not complete;
    `set_aside`, where the old index files were moved."""

    keys: int = 0
    inline_lost: int | None = None
    quotas: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)
    set_aside: list[str] = field(default_factory=list)


def check_index(root: str) -> None:
    """IndexLost (E1107) when the store at `root` has no index but has had one (its marker,
    or versions under `data/`); a new store passes."""
    if os.path.exists(os.path.join(root, INDEX)):
        return
    if os.path.exists(os.path.join(root, MARKER)) or _has_versions(root):
        raise IndexLost(os.path.join(root, INDEX), "is missing")


def mark(root: str) -> None:
    """Write the store's marker, once its index exists (a stat when it is there already)."""
    if not os.path.exists(os.path.join(root, MARKER)):
        LocalFiles(root).replace(MARKER, _MARKER_TEXT)


def _has_versions(root: str) -> bool:
    with contextlib.suppress(FileNotFoundError), os.scandir(os.path.join(root, "data")) as it:
        return any(True for _ in it)
    return False


def recover(root: str) -> RecoveryReport:
    """Rebuild the index of the directory store at `root` from its versions: each key's
    newest complete version (by the time of its `zarr.json`), at version 1. The old index
    files are moved aside, not deleted; the new index replaces them in one rename, so a
    handle opened before fails its next commit (E1107) rather than write to the old one.
    Run it while no other process writes to the store."""
    files = LocalFiles(root)
    path = os.path.join(root, INDEX)
    report = RecoveryReport()
    report.inline_lost, quotas = _salvage(path)
    rows = _newest_versions(files, report.skipped)
    tmp = f"{path}.recover-{secrets.token_hex(4)}"
    index = SqliteIndex(tmp)
    try:
        if rows:
            index.commit_many(rows)
        for prefix, nbytes in quotas.items():
            index.set_quota(prefix, nbytes)
    finally:
        index.close()
    report.keys, report.quotas = len(rows), len(quotas)
    report.set_aside = _set_aside(path)
    os.replace(tmp, path)
    files.sync_dir("")
    mark(root)
    return report


def _salvage(path: str) -> tuple[int | None, dict[str, int]]:
    """From the old index, if it can still be read: how many tensors it kept inline, and its
    quotas; (None, {}) when it is missing or unreadable."""
    if not os.path.exists(path):
        return None, {}
    forkserver.before_sqlite()
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            (n,), = db.execute("SELECT count(*) FROM keys WHERE data IS NOT NULL")
            return n, dict(db.execute("SELECT prefix, bytes FROM quotas"))
        finally:
            db.close()
    except sqlite3.DatabaseError:
        return None, {}


def _newest_versions(files: LocalFiles, skipped: list[tuple[str, str]]) -> list[Row]:
    """The row of each key's newest complete version under `data/`; incomplete versions go
    to `skipped` with the reason."""
    newest: dict[str, tuple[float, Row]] = {}
    for top, dirs, _ in os.walk(files.path("data")):
        for d in [d for d in dirs if _VERSION.fullmatch(d)]:
            dirs.remove(d)  # a version's own files are not keys
            rel = os.path.relpath(os.path.join(top, d), files.root).replace(os.sep, "/")
            try:
                when, row = _version_row(files, rel)
            except (OSError, ValueError, KeyError, TypeError, InvalidKey) as e:
                skipped.append((rel, str(e)))
                continue
            if row.key not in newest or when > newest[row.key][0]:
                newest[row.key] = (when, row)
    return [row for _, row in sorted(newest.values(), key=lambda t: t[1].key)]


def _version_row(files: LocalFiles, rel: str) -> tuple[float, Row]:
    """The time and index row of the version `rel`, once its `zarr.json` parses and every
    chunk file it names is there at its full length (ValueError or OSError otherwise)."""
    meta = files.path(f"{rel}/zarr.json")
    st = os.stat(meta)
    if st.st_size > MAX_METADATA_BYTES:
        raise ValueError(f"zarr.json of {st.st_size} bytes")
    layout, checksum = fmt.parse_metadata(files.read_bytes(f"{rel}/zarr.json"))
    want = layout.chunk_data_bytes + fmt.CRC_BYTES
    for name in layout.chunk_keys():
        size = os.stat(files.path(f"{rel}/{name}")).st_size
        if size != want:
            raise ValueError(f"chunk {name} is {size} bytes, expected {want}")
    key = check_key(rel[len("data/"):rel.rindex("/@")])
    return st.st_mtime, Row(key, rel, layout.dtype, layout.shape, layout.nbytes, checksum)


def _set_aside(path: str) -> list[str]:
    """Move the old index and its `-wal`/`-shm` files to `.lost-TIME` names (a stale `-wal`
    beside the new index would be replayed into it); the new names."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    moved = []
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(path + suffix):
            os.replace(path + suffix, f"{path}.lost-{stamp}{suffix}")
            moved.append(f"{path}.lost-{stamp}{suffix}")
    return moved
