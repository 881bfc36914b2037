"""The bound on the kernel cache (build.py's directory): its objects are removed, least
recently used first, once they pass $DTM_CACHE_MAX bytes (default 2 GiB; `0` for no bound).

Every build writes three files under one key (`<key>.so`, `<key>.c`, `<key>.sha256`) and
nothing removed them: a test suite's runs left 65,000 files and 700 MB here. Now a process
that compiled something looks at the cache (once an hour at most, on a thread of its own),
and when it holds more than the bound removes whole keys, oldest use first, down to TRIM_TO
of it, so that the next processes find room without trimming again. A key's use is its
object's modification time: build.py touches an object when a process first loads it from
the cache.

Only names a build writes are touched (40 hex digits and those suffixes, and the temporary
files of builds that died): anything else in the directory (the default tensor store lives
in `store/` under it) is left alone. A key used in the last MIN_AGE_S seconds is never
removed, so another process between finding an object and loading it does not lose it.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from pathlib import Path

log = logging.getLogger("dtm.compiler")

DEFAULT_MAX_BYTES = 2 << 30
TRIM_TO = 0.75          # a trim leaves the cache at this fraction of the bound
MIN_AGE_S = 3600.0      # keys used more recently than this stay
TRIM_EVERY_S = 3600.0   # a process looks at the cache only when none did for this long
MARKER = ".last-trim"
_NAME = re.compile(r"([0-9a-f]{40})\.(so|c|sha256)")
_TEMPORARY = re.compile(r"\.([0-9a-f]{40})\..*\.tmp")

_started: set[str] = set()
_lock = threading.Lock()


def max_bytes() -> int:
    """$DTM_CACHE_MAX: bytes, with an optional K, M or G suffix (powers of 1024); 0 for
    no bound."""
    text = os.environ.get("DTM_CACHE_MAX", "").strip()
    if not text:
        return DEFAULT_MAX_BYTES
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMG]?)i?B?", text, re.IGNORECASE)
    if m is None:
        log.warning("DTM_CACHE_MAX=%r is not a size (such as 2G or 500M): the cache keeps its default bound", text)
        return DEFAULT_MAX_BYTES
    return int(float(m.group(1)) * 1024 ** " KMG".index(m.group(2).upper() or " "))


def trim_later(directory: Path) -> None:
    """trim(directory) on a thread of its own, at most once per process and directory, and
    only when no process has started one in the last TRIM_EVERY_S seconds (the time of the
    marker file MARKER says when): a look at a cache of 65,000 files takes 0.4 s of Python,
    which a program's first compile should not share its core with every time."""
    key = str(directory)
    with _lock:
        if key in _started:
            return
        _started.add(key)
    marker = directory / MARKER
    try:
        if time.time() - marker.stat().st_mtime < TRIM_EVERY_S:
            return
    except FileNotFoundError:
        pass
    try:
        marker.touch()
    except OSError:  # (a cache shared read-only: nothing to trim from here)
        return
    threading.Thread(target=_trim_quietly, args=(directory,), name="dtm-cache-trim", daemon=True).start()


def _trim_quietly(directory: Path) -> None:
    try:
        trim(directory)
    except OSError as e:  # a cache we cannot list or clean is not the program's failure
        log.warning("could not trim the kernel cache %s: %s", directory, e)


def trim(directory: Path, limit: int | None = None, min_age_s: float = MIN_AGE_S,
         now: float | None = None) -> list[str]:
    """Remove the least recently used keys of the cache in `directory` while it holds more
    than `limit` bytes (default max_bytes()), down to TRIM_TO of it, sparing keys used in the
    last `min_age_s` seconds; and temporary files older than that. Returns the keys removed."""
    limit = max_bytes() if limit is None else limit
    now = time.time() if now is None else now
    sizes: dict[str, int] = {}
    used: dict[str, float] = {}
    stale: list[Path] = []
    with os.scandir(directory) as entries:
        for entry in entries:
            m = _NAME.fullmatch(entry.name)
            t = _TEMPORARY.fullmatch(entry.name)
            if not (m or t) or not entry.is_file(follow_symlinks=False):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # removed meanwhile by another process
                continue
            if t:
                if st.st_mtime < now - min_age_s:
                    stale.append(Path(entry.path))
                continue
            k = m.group(1)
            sizes[k] = sizes.get(k, 0) + st.st_size
            used[k] = max(used.get(k, 0.0), st.st_mtime)
    for p in stale:
        p.unlink(missing_ok=True)
    total = sum(sizes.values())
    if not limit or total <= limit:
        return []
    removed = []
    for k in sorted(sizes, key=lambda k: used[k]):
        if total <= limit * TRIM_TO or used[k] >= now - min_age_s:
            break
        # the object first, so that no process finds an object whose source is gone
        for suffix in ("so", "sha256", "c"):
            (directory / f"{k}.{suffix}").unlink(missing_ok=True)
        total -= sizes[k]
        removed.append(k)
    log.info("kernel cache %s: removed %d least recently used kernels, %d bytes left", directory, len(removed), total)
    return removed
