"""`dtm.data.ingest`: files -> tensors in the store, in parallel worker processes.

    m = dtm.data.ingest(paths, dtm.data.tokenize.word_tokens, "corpus", workers=2, store=st)

Each input file becomes one shard, `PREFIX/shard/RUN/NNNNNN` in input order, holding what
`fn` returned for the file's bytes, RUN being this ingest's fresh id; then the manifest
(manifest.py) is written. The manifest is the commit point: a reader sees the earlier
manifest or this one, and since no shard of the earlier dataset is overwritten, a re-ingest
killed at any moment leaves the earlier dataset whole. After the switch every shard under
the prefix that the new manifest does not name is removed: the earlier dataset's, and those
of runs killed before their manifest (so one ingest at a time per prefix: a second, running
beside it, would lose its shards to the first one's sweep).

How the work is seen: the parent samples every worker's CPU and resident memory from /proc
and counts its files and bytes from its replies (workers send no heartbeats; they are not
ranks). About once a second it hands `progress` per-worker rows (the columns of `dtm top`)
and adds the totals to this process's activity (dtm/cluster/activity.py), so when ingest
runs inside a mesh rank, that rank's heartbeats, the coordinator's metrics and `dtm top`
carry its workers' figures.

Faults: a missing or unreadable input is E1301 before any work starts; `fn` raising on a
file is E1302 naming the file and the worker, not retried (it would fail again); a worker
that dies on a file (SIGKILL, a crash) is replaced and the file retried `retries` times
(default 1) on the new worker, then E1303 naming the file, the workers and how they ended; a
file that takes longer than `timeout` s is E0802 (its worker is killed; not retried).
"""

from __future__ import annotations

import logging
import os
import selectors
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..cluster.activity import activity
from ..cluster.activity import Row
from ..errors import ErrorCode as E
from .errors import DataError, IngestError
from .fnref import name_of
from .manifest import Manifest, Shard, new_run, save, shard_key, shards_prefix
from .pool import Worker
from .worker import ingest_one

log = logging.getLogger("dtm.data")

FILE_TIMEOUT_S = 600.0
READY_TIMEOUT_S = 60.0     # a worker must have imported the function and opened the store by then
DEPTH = 2                  # files queued per worker, so it never waits for the parent between two
TICK_S = 1.0               # progress and activity refresh


@dataclass
class Progress:
    files_done: int
    files_total: int
    read_bytes: int
    written_bytes: int
    elapsed_s: float
    workers: list[Row] = field(default_factory=list)


ProgressFn = Callable[[Progress], None]


def _inputs(paths: Sequence[str | os.PathLike]) -> list[str]:
    files = [os.path.abspath(os.fspath(p)) for p in paths]
    if not files:
        raise IngestError(E.INGEST_INPUT_MISSING, "no input files were given")
    bad = [f for f in files if not os.path.isfile(f) or not os.access(f, os.R_OK)]
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise IngestError(E.INGEST_INPUT_MISSING, f"{bad[0]}{more}: no such readable file; nothing was ingested",
                          bad[0])
    return files


def _open(store):
    from .. import store as stores

    if store is None:
        return stores.current()
    return stores.open(store) if isinstance(store, (str, os.PathLike)) else store


def ingest(paths: Sequence[str | os.PathLike], fn: Callable[[bytes], object], out_prefix: str, *, workers: int = 1,
           store=None, retries: int = 1, timeout: float = FILE_TIMEOUT_S,
           progress: ProgressFn | None = None) -> Manifest:
    """Turn each file of `paths` into a tensor with `fn(bytes)` and store it under
    `out_prefix` (see the module doc); the manifest, also stored at OUT_PREFIX/manifest.
    `workers=0` runs `fn` in this process (and works with a memory:// store); `store` is a
    Store, a path or URL, or None for the current store."""
    files = _inputs(paths)
    prefix = out_prefix.rstrip("/")
    st = _open(store)
    if workers < 0:
        raise DataError(E.ATTRIBUTE_VALUE, f"workers={workers}: expected 0 (in this process) or more")
    fn_name = name_of(fn) if workers else f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', fn)}"
    if workers and str(st.url).startswith("memory://"):
        raise DataError(E.ATTRIBUTE_VALUE, f"{st.url} lives in this process; worker processes cannot write to it: "
                                           "use a store directory or URL, or workers=0")
    run = new_run()
    shards = [shard_key(prefix, run, i) for i in range(len(files))]
    a = activity()
    try:
        if workers:
            replies = _Run(files, shards, fn_name, st.url, min(workers, len(files)), retries, timeout, progress).run()
        else:
            replies, start = [], time.monotonic()
            for i, (path, key) in enumerate(zip(files, shards)):
                replies.append(ingest_one(st, fn, path, key, "inline"))
                a.items, a.bytes_read, a.bytes_written = a.items + 1, a.bytes_read + replies[-1]["read"], \
                    a.bytes_written + replies[-1]["written"]
                if progress is not None:
                    progress(Progress(i + 1, len(files), sum(r["read"] for r in replies),
                                      sum(r["written"] for r in replies), time.monotonic() - start))
    finally:
        a.state = ""
    m = Manifest(prefix, fn_name, [Shard(key, path, r["dtype"], tuple(r["shape"]), r["checksum"], r["read"])
                                   for key, path, r in zip(shards, files, replies)])
    save(st, m)
    _sweep(st, prefix, set(shards))
    return m


def _sweep(st, prefix: str, keep: set[str]) -> None:
    """Remove the shards under `prefix` that the manifest just written does not name."""
    from ..store import KeyMissing

    for stale in set(st.keys(shards_prefix(prefix))) - keep:
        try:
            st.delete(stale)
        except KeyMissing:  # another sweep of this prefix got there first
            pass


class _Run:
    """One parallel ingest: the parent's loop over its workers' replies (see the module doc)."""

    def __init__(self, files: list[str], keys: list[str], fn: str, store_url: str, n: int, retries: int,
                 timeout: float, progress: ProgressFn | None):
        self.files, self.keys, self.fn, self.url = files, keys, fn, store_url
        self.retries, self.timeout, self.progress = retries, timeout, progress
        self.results: list[dict | None] = [None] * len(files)
        self.attempts = [0] * len(files)
        self.pending = deque(range(len(files)))
        self.sel = selectors.DefaultSelector()
        self.workers: list[Worker] = []
        self.start = time.monotonic()
        self.done = self.read = self.written = 0
        for slot in range(n):
            self._spawn(slot)

    def _spawn(self, slot: int) -> None:
        w = Worker(slot, self.fn, self.url)
        if slot < len(self.workers):
            self.workers[slot] = w
        else:
            self.workers.append(w)
        self.sel.register(w.fd, selectors.EVENT_READ, w)

    def run(self) -> list[dict]:
        try:
            next_tick = time.monotonic()
            while self.done < len(self.files):
                for key, _ in self.sel.select(timeout=0.2):
                    self._read(key.data)
                now = time.monotonic()
                self._check_time(now)
                self._dispatch()
                if now >= next_tick:
                    self._tick(now)
                    next_tick = now + TICK_S
            self._tick(time.monotonic())
            for w in self.workers:  # all at once: their interpreters' teardowns overlap
                w.close_tasks()
            for w in self.workers:
                w.finish()
            return self.results  # type: ignore[return-value] - every entry is set once done == len
        except BaseException:
            for w in self.workers:
                w.kill()
            raise
        finally:
            self.sel.close()
            for w in self.workers:
                activity().drop_worker(w.row_name)

    def _dispatch(self) -> None:
        for w in self.workers:
            while w.ready and self.pending and len(w.inflight) < DEPTH:
                i = self.pending.popleft()
                w.send(i, self.files[i], self.keys[i])
            if w.ready and w.inflight:
                w.state = f"{os.path.basename(self.files[w.inflight[0]])}"
            elif w.ready:
                w.state = "idle"

    def _read(self, w: Worker) -> None:
        replies = w.replies()
        if replies is None:
            return self._died(w)
        for r in replies:
            if "ready" in r:
                if not r["ready"]:
                    raise DataError(E(r.get("code", E.INGEST_FN_NOT_IMPORTABLE.value)), f"{w.name} could not start: "
                                                                                       f"{r.get('error')}")
                w.ready = True
                continue
            i = w.done()
            if not r["ok"]:
                raise IngestError(E(r["code"]), r["error"], self.files[i], w.name)
            self.results[i] = r
            w.items, w.read_bytes, w.written_bytes = w.items + 1, w.read_bytes + r["read"], \
                w.written_bytes + r["written"]
            self.done, self.read, self.written = self.done + 1, self.read + r["read"], self.written + r["written"]
            a = activity()
            a.items, a.bytes_read, a.bytes_written = a.items + 1, a.bytes_read + r["read"], \
                a.bytes_written + r["written"]

    def _died(self, w: Worker) -> None:
        """`w` closed its replies pipe: it ended. Retry its file on a fresh worker, or fail."""
        self.sel.unregister(w.fd)
        activity().drop_worker(w.row_name)
        how = w.status()
        w.finish()
        if not w.inflight:
            raise IngestError(E.INGEST_WORKER_LOST, f"{w.name} ended ({how}) before it was given a file")
        i = w.inflight[0]
        self.attempts[i] += 1
        path = self.files[i]
        if self.attempts[i] > self.retries:
            raise IngestError(E.INGEST_WORKER_LOST, f"{path}: {w.name} ended ({how}) while working on it, "
                                                    f"{self.attempts[i]} time(s) (retries={self.retries})", path,
                              w.name)
        log.warning("ingest: %s ended (%s) while working on %s; retrying it on a new worker", w.name, how, path)
        self.pending.extendleft(reversed(w.inflight))
        self._spawn(w.slot)

    def _check_time(self, now: float) -> None:
        for w in self.workers:
            if not w.ready and now - w.started > READY_TIMEOUT_S:
                w.kill()
                raise IngestError(E.TIMEOUT, f"{w.name} did not start within {READY_TIMEOUT_S:g} s")
            if w.inflight and now - w.head_since > self.timeout:
                path = self.files[w.inflight[0]]
                w.kill()
                raise IngestError(E.TIMEOUT, f"{path}: {w.name} worked on it for {now - w.head_since:.0f} s, the "
                                             f"limit is {self.timeout:g} s; it was killed", path, w.name)

    def _tick(self, now: float) -> None:
        rows = [w.sample() for w in self.workers]
        a = activity()
        for r in rows:
            a.report_worker(r)
        a.state = f"ingest: {self.done}/{len(self.files)} files"
        if self.progress is not None:
            self.progress(Progress(self.done, len(self.files), self.read, self.written, now - self.start, rows))
