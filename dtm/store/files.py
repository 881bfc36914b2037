"""Where a store's files live: a local directory (written durably, read through memory
maps), or an fsspec file system (object stores, `memory://`). Paths are relative, `/`-separated, and already
checked by keys.py, so neither backend can be led outside its root."""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import os
import queue
import secrets
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator

import numpy as np


# Files below this size are read rather than mapped: np.memmap costs about 60 us a file, the
# read of 64 KiB from the page cache 5-10 us
MAP_BYTES = 64 << 10
# A replaced version this large is removed in the background (remove_later), a smaller one at once
REMOVE_LATER_BYTES = 16 << 20


# Where each process that writes to a directory store keeps a file it holds locked while it
# lives (spec 9.2.3): one found unlocked names a writer that died, maybe inside a put
WRITERS = "writers"
SYNC_THREADS = 16  # LocalFiles.sync: concurrent fsyncs, which the file system commits together
EARLY_SYNC_THREADS = 4  # LocalFiles.start_sync: fsyncs beside the writes that follow


class LocalFiles:
    """Files under the directory `root`. A version being written is held (`hold`): a shared
    flock on its directory, which the kernel drops when the writer dies, even by SIGKILL,
    so that garbage collection tells a put in flight from the remains of a killed one."""

    def __init__(self, root: str, durable: bool = True):
        self.root = root
        self._writer: tuple[int, str] | None = None  # (fd, path) of this process's writer file
        # durable=False: writes and sync_tree only note what they would sync, and `sync` syncs
        # it all at once, in parallel, for a caller whose commit point comes later (a
        # checkpoint's manifest): one batch instead of several fsyncs in a row per file
        self.durable = durable
        self._unsynced: set[str] = set()
        self._written: list[str] = []  # the files of _unsynced that start_sync may sync early
        self._early: tuple[ThreadPoolExecutor, list] | None = None  # start_sync's threads, its fsyncs

    @contextlib.contextmanager
    def hold(self, rel: str) -> Iterator[None]:
        """Hold the version directory `rel` (a shared flock) until the block ends, so that
        `remove_unheld` spares it; FileNotFoundError when a collection removed it since its
        creation (the put then fails, E1104, and nothing is lost). Never creates it: a
        version removed half-written must not come back to be committed."""
        self._register_writer()
        top = self.path(rel)
        fd = os.open(top, os.O_RDONLY)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # a collection holds it to remove it
                raise FileNotFoundError(errno.ENOENT, "removed by a garbage collection", top) from None
            if os.fstat(fd).st_nlink == 0:  # removed before the lock was taken
                raise FileNotFoundError(errno.ENOENT, "removed by a garbage collection", top)
            yield
        finally:
            os.close(fd)

    def remove_unheld(self, rel: str) -> bool:
        """Remove the version directory `rel` unless a live writer holds it; whether it did."""
        try:
            fd = os.open(self.path(rel), os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            self.remove_tree(rel)  # under the lock: a writer that opens it now finds it gone
            return True
        finally:
            os.close(fd)

    def _register_writer(self) -> None:
        """Before this process's first write: create and lock its writer file, unlinked
        again by `close` or at exit."""
        if self._writer is not None:
            return
        os.makedirs(self.path(WRITERS), exist_ok=True)
        name = f"{os.getpid()}-{secrets.token_hex(8)}"
        # Locked before it is in WRITERS (a rename keeps the lock): another process opening the
        # store must never see it unlocked, count it dead and collect this writer's versions.
        fresh = self.path(f"{WRITERS}/.{name}")  # (a dot name: not a writer yet, see dead_writers)
        fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        fcntl.flock(fd, fcntl.LOCK_EX)  # a fresh file: no one else holds it
        path = self.path(f"{WRITERS}/{name}")
        os.rename(fresh, path)
        self._writer = (fd, path)
        atexit.register(self.close)

    def dead_writers(self) -> list[str]:
        """The writer files no live process holds: each a writer that ended without `close`
        (killed, maybe inside a put)."""
        try:
            names = os.listdir(self.path(WRITERS))
        except FileNotFoundError:
            return []
        return [n for n in names if not n.startswith(".") and not _held(self.path(f"{WRITERS}/{n}"))]

    def forget_writers(self, names: list[str]) -> None:
        """Remove the writer files `names` of dead writers, once their leftovers are removed."""
        for n in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(f"{WRITERS}/{n}"))

    def close(self) -> None:
        """Wait for queued removals and early syncs, then unlink and release this process's
        writer file."""
        self.drain()
        with contextlib.suppress(OSError):
            self._finish_early()
        if self._writer is not None:
            fd, path = self._writer
            self._writer = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            os.close(fd)

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if os.sep == "/" else os.path.join(self.root, *rel.split("/"))

    def make_dirs(self, rel: str, names: Iterable[str]) -> None:
        """Create the directory `rel` (and what is missing above it) and those its files
        `names` (relative paths) sit in, so that the writes of those files find them (a
        write that does not makes them itself)."""
        top = self.path(rel)
        try:
            os.mkdir(top)
        except FileNotFoundError:
            os.makedirs(top, exist_ok=True)
        except FileExistsError:  # by another rank of a distributed put
            pass
        for sub in sorted(dirs_of(names), key=len):
            try:
                os.mkdir(f"{top}/{sub}")
            except FileExistsError:  # (another rank's chunk of a distributed put sits there too)
                pass

    def write(self, rel: str, parts: Iterable[memoryview | bytes]) -> None:
        """Write a new file from `parts`, and fsync it before returning."""
        path = self.path(rel)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)  # a version's files are fresh
        try:
            fd = os.open(path, flags, 0o666)
        except FileNotFoundError:  # its directory is new (os.makedirs on every write: 3 stats a put)
            parent = os.path.dirname(path)
            try:
                os.mkdir(parent)  # most often the version directory alone is new
            except FileNotFoundError:
                os.makedirs(parent, exist_ok=True)
            except FileExistsError:
                pass
            fd = os.open(path, flags, 0o666)
        try:
            for p in parts:
                view = memoryview(p).cast("B")
                while view:
                    view = view[os.write(fd, view):]
            if self.durable:
                os.fsync(fd)
            else:
                self._unsynced.add(path)
                self._written.append(path)
        finally:
            os.close(fd)

    def sync_tree(self, rel: str, names: Iterable[str] = ()) -> None:
        """fsync the directories that the new files `names` (relative to `rel`) sit in,
        `rel`, then its ancestors up to the root, so the new files' names are as durable as
        their bytes."""
        top = self.path(rel)
        dirs = [f"{top}/{sub}" for sub in sorted(dirs_of(names), key=len, reverse=True)] + [top]
        d = os.path.dirname(top)
        while len(d) >= len(self.root):
            dirs.append(d)
            d = os.path.dirname(d)
        if not self.durable:
            self._unsynced.update(dirs)
            return
        for d in dirs:
            fsync_dir(d)

    def start_sync(self) -> None:
        """Begin to fsync, on EARLY_SYNC_THREADS threads in the background, the files
        written since the last call (durable=False), so that their writeback overlaps the
        writes that follow; `sync` waits for them. Directories wait for `sync`: files may
        still be made in them."""
        files, self._written = self._written, []
        if not files:
            return
        self._unsynced.difference_update(files)
        if self._early is None:  # (its threads start from the caller's: a writer's lower priority too)
            self._early = (ThreadPoolExecutor(EARLY_SYNC_THREADS, thread_name_prefix="dtm-sync-early"), [])
        pool, futures = self._early
        futures.extend(pool.submit(fsync_dir, f) for f in files)

    def _finish_early(self) -> None:
        """Wait for start_sync's fsyncs, raising the first one's error."""
        early, self._early = self._early, None
        if early is not None:
            pool, futures = early
            try:
                for f in futures:
                    f.result()
            finally:
                pool.shutdown(wait=True)

    def sync(self, threads: int = SYNC_THREADS) -> None:
        """fsync every file and directory that writes and sync_tree noted since the last
        call (durable=False), on `threads` threads: the file system commits concurrent
        syncs together; and wait for those start_sync began. Nothing to do for a durable
        LocalFiles."""
        pending, self._unsynced, self._written = sorted(self._unsynced), set(), []
        try:
            if pending:
                with ThreadPoolExecutor(min(threads, len(pending)), thread_name_prefix="dtm-sync") as pool:
                    list(pool.map(fsync_dir, pending))  # (fsync_dir opens read-only: files too)
        finally:
            self._finish_early()

    def replace(self, rel: str, data: bytes) -> None:
        """Write the file `rel` whole, atomically and durably: a temporary name, fsync,
        rename over `rel`, fsync of its directory."""
        tmp = f"{rel}.tmp-{secrets.token_hex(4)}"
        self.write(tmp, [data])
        os.replace(self.path(tmp), self.path(rel))
        self.sync_dir(rel.rpartition("/")[0])

    def sync_dir(self, rel: str) -> None:
        """fsync the directory `rel` ("" for the root), so the names in it are durable."""
        fsync_dir(self.path(rel) if rel else self.root)

    def read_bytes(self, rel: str) -> bytes:
        with open(self.path(rel), "rb") as f:
            return f.read()

    def map(self, rel: str) -> np.ndarray:
        """The file's bytes as a read-only uint8 array: memory-mapped (no copy), or read when
        smaller than MAP_BYTES (a small tensor's get spent half its time building the map)."""
        with open(self.path(rel), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < MAP_BYTES:  # (mmap refuses empty files)
                return np.frombuffer(f.read(), np.uint8)
            return np.memmap(f, np.uint8, mode="r", shape=(size,))

    def walk(self, rel: str) -> Iterator[tuple[str, float]]:
        """(path relative to the root, modification time) of every file and directory below
        `rel`: a put killed early leaves directories with no file in them."""
        for dirpath, dirs, names in os.walk(self.path(rel)):
            for n in dirs + names:
                p = os.path.join(dirpath, n)
                with contextlib.suppress(FileNotFoundError):  # removed by a concurrent put
                    yield os.path.relpath(p, self.root).replace(os.sep, "/"), os.stat(p).st_mtime

    def remove_tree(self, rel: str) -> None:
        shutil.rmtree(self.path(rel), ignore_errors=True)

    def size(self, rel: str) -> int:
        """Bytes of the files below `rel` (their sizes, not the blocks they take)."""
        total = 0
        for dirpath, _, names in os.walk(self.path(rel)):
            for n in names:
                with contextlib.suppress(FileNotFoundError):
                    total += os.stat(os.path.join(dirpath, n)).st_size
        return total

    def remove_version(self, rel: str, names: Callable[[], list[str]], nbytes: int) -> None:
        """Remove a replaced or deleted version of `nbytes` bytes: its directory, at once when
        small, else in the background (a small put replacing a key ran 6x slower while the
        removing thread took turns with it for the GIL: 42 -> 268 us for its two files). A
        small one goes file by file, by the `names()` its metadata gives, then its
        directories, deepest first (shutil.rmtree lists and stats each: 3x the time); what
        that leaves, rmtree removes."""
        if nbytes >= REMOVE_LATER_BYTES:
            self.remove_later(rel)
            return
        top = self.path(rel)
        try:
            files = names()
            for name in files:
                os.unlink(f"{top}/{name}")
            for sub in sorted(dirs_of(files), key=len, reverse=True):
                os.rmdir(f"{top}/{sub}")
            os.rmdir(top)
        except (OSError, ValueError, KeyError, TypeError):  # not as its metadata says: remove what is there
            self.remove_tree(rel)

    def remove_later(self, rel: str) -> None:
        """remove_tree on a thread of its own, for a version no key names any more: unlinking
        a large file costs a quarter of a put (0.1 s for 512 MiB here) and nothing needs to
        wait for it (a reader that mapped the version keeps its pages; what a process that
        ends first leaves, `Store.collect` removes)."""
        if getattr(self, "_doomed", None) is None:
            self._doomed: queue.Queue = queue.Queue()
            threading.Thread(target=self._reap, name="dtm-store-reaper", daemon=True).start()
            atexit.register(self.drain)
        self._doomed.put(rel)

    def _reap(self) -> None:
        while True:
            rel = self._doomed.get()
            self.remove_tree(rel)
            self._doomed.task_done()

    def drain(self) -> None:
        """Until every removal remove_later queued is done."""
        if getattr(self, "_doomed", None) is not None:
            self._doomed.join()


def _held(path: str) -> bool:
    """Whether a live process holds a lock on the file `path` (a vanished one counts as held:
    its writer just closed it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def dirs_of(names: Iterable[str]) -> set[str]:
    """The directories that the relative paths `names` sit in, with every directory
    between (`c` and `c/0` for `c/0/0`)."""
    dirs = set()
    for name in names:
        parts = name.split("/")[:-1]
        dirs.update("/".join(parts[:n]) for n in range(1, len(parts) + 1))
    return dirs


def fsync_dir(path: str) -> None:
    """Sync a directory's entries (a rename into it, a file made or removed in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FsspecFiles:
    """Files under `root` of an fsspec file system (object stores, `memory://`). Writing
    one object is atomic there, and durable once the call returns."""

    def __init__(self, fs: Any, root: str):
        self.fs, self.root = fs, root.rstrip("/")

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def write(self, rel: str, parts: Iterable[memoryview | bytes]) -> None:
        self.replace(rel, b"".join(parts))

    def replace(self, rel: str, data: bytes) -> None:
        """Write the object `rel` whole, replacing any earlier one in one step."""
        self.fs.pipe_file(self.path(rel), data)

    def make_dirs(self, rel: str, names: Iterable[str]) -> None:
        """Nothing to make: an object store has no directories."""

    def sync_tree(self, rel: str, names: Iterable[str] = ()) -> None:
        """Nothing to sync: each object was durable when its write returned."""

    def sync(self) -> None:
        """Nothing to sync (as sync_tree)."""

    def start_sync(self) -> None:
        """Nothing to sync (as sync_tree)."""

    def read_bytes(self, rel: str) -> bytes:
        return self.fs.cat_file(self.path(rel))

    def map(self, rel: str) -> np.ndarray:
        return np.frombuffer(self.read_bytes(rel), np.uint8)

    def walk(self, rel: str) -> Iterator[tuple[str, float]]:
        """(path relative to the root, modification time) of every file below `rel`; a file
        system that keeps no times gives the current time, so nothing counts as old."""
        for p in self.find(rel):
            try:
                t = self.fs.modified(self.path(p)).timestamp()
            except (NotImplementedError, FileNotFoundError):
                t = time.time()
            yield p, t

    def find(self, rel: str) -> list[str]:
        """Every file below `rel`, as paths relative to the root."""
        try:
            return [p[len(self.root) + 1:] for p in self.fs.find(self.path(rel))]
        except FileNotFoundError:
            return []

    def remove(self, rel: str) -> None:
        self.fs.rm_file(self.path(rel))

    def remove_tree(self, rel: str) -> None:
        try:
            self.fs.rm(self.path(rel), recursive=True)
        except FileNotFoundError:
            pass

    def size(self, rel: str) -> int:
        """Bytes of the objects below `rel`."""
        try:
            return int(self.fs.du(self.path(rel)))
        except FileNotFoundError:
            return 0

    def remove_version(self, rel: str, names: Callable[[], list[str]], nbytes: int) -> None:
        """Remove a replaced or deleted version object by object, by the names its metadata
        gives: listing a prefix can cost a scan of every object in the store (fsspec's
        memory file system does that), which made each put of a store of 10,000 keys 43 ms."""
        try:
            found = names()
        except (OSError, ValueError, KeyError, TypeError):  # no readable metadata: look for the files
            self.remove_tree(rel)
            return
        for name in found:
            try:
                self.remove(f"{rel}/{name}")
            except FileNotFoundError:
                pass

    def drain(self) -> None:
        """Nothing queued: removals here are done when they return."""

    def close(self) -> None:
        """Nothing held."""

    @contextlib.contextmanager
    def hold(self, rel: str) -> Iterator[None]:
        """Nothing to hold: an object store has no locks, so a version in flight is told from
        a killed put's by its age alone (`Store.collect`)."""
        yield

    def remove_unheld(self, rel: str) -> bool:
        """Remove the version `rel` (no writer can hold one here)."""
        self.remove_tree(rel)
        return True

    def dead_writers(self) -> list[str]:
        """None known: writers leave no trace here."""
        return []


class MemoryFiles(FsspecFiles):
    """fsspec's memory file system (`memory://`), written and read through its dict of files
    (`fs.store`, path -> MemoryFile) rather than its file API: the same objects, at the paths
    any fsspec user of the same file system finds them, at a dict's cost (its `pipe_file`
    checks that no parent of the path is a file, a walk up the path: two thirds of a small
    put's time went there)."""

    def __init__(self, fs: Any, root: str):
        super().__init__(fs, root)
        from fsspec.implementations.memory import MemoryFile  # (fsspec: only stores behind URLs need it)
        self._file = MemoryFile

    def replace(self, rel: str, data: bytes) -> None:
        path = self.path(rel)
        self._file(self.fs, path, data).commit()  # what the file API does once its checks pass

    def read_bytes(self, rel: str) -> bytes:
        try:
            return self.fs.store[self.path(rel)].getvalue()
        except KeyError:
            raise FileNotFoundError(self.path(rel)) from None

    def remove(self, rel: str) -> None:
        try:
            del self.fs.store[self.path(rel)]
        except KeyError:
            raise FileNotFoundError(self.path(rel)) from None

