"""Where a checkpoint root lives (spec 9.4.2): a directory, or any fsspec URL (`s3://...`,
`memory://NAME`). Checkpoint code reads and writes the root's own files (manifests, the save
lock, the step directories' listing) through a `Place`; each step directory's tensors go
through the tensor store opened at `place.url_of(step_dir)`, which takes either form too.

A directory's manifest is committed by rename (temporary name, fsync, rename, fsync of the
directory); an object store's by writing the object whole, which is atomic and durable when
the call returns (as the store's own index refs, 9.2.4).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Any

from ..store.errors import StoreIOError
from ..store.files import FsspecFiles, LocalFiles, MemoryFiles, fsync_dir
from .errors import NotACheckpoint


def is_url(path: str) -> bool:
    """A URL other than file:// (those are served by fsspec)."""
    return "://" in path and not path.startswith("file://")


class Place:
    """A checkpoint root: `url` names it in messages and manifests' paths; `files` reads and
    writes below it (paths relative to the root, `/`-separated)."""

    def __init__(self, url: str, files: Any, fs: Any = None):
        self.url, self.files, self.fs = url, files, fs

    @classmethod
    def of(cls, path: str | os.PathLike) -> "Place":
        """The root named by a path or URL (nothing is made yet)."""
        text = os.fspath(path)
        if not is_url(text):
            root = os.path.abspath(os.path.expanduser(text.removeprefix("file://")))
            return cls(root, LocalFiles(root))
        import fsspec  # (only roots behind URLs need it)
        from fsspec.implementations.memory import MemoryFileSystem

        try:
            fs, root = fsspec.core.url_to_fs(text)
        except (ImportError, ValueError) as e:
            raise StoreIOError(f"fsspec cannot open the checkpoint root: {e}", text) from None
        files = MemoryFiles(fs, root) if isinstance(fs, MemoryFileSystem) else FsspecFiles(fs, root)
        return cls(text.rstrip("/"), files, fs)

    @property
    def local(self) -> bool:
        return self.fs is None

    def url_of(self, rel: str) -> str:
        """The path or URL of `rel` below the root (what the store opens)."""
        return f"{self.url}/{rel}"

    def names(self) -> list[str]:
        """The names directly below the root; E1401 when it is not a directory (or, behind
        a URL, holds nothing)."""
        if self.local:
            if not os.path.isdir(self.url):
                raise NotACheckpoint(f"{self.url} is not a checkpoint directory "
                                     f"({'a file' if os.path.exists(self.url) else 'absent'})", self.url)
            return os.listdir(self.url)
        try:
            found = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.files.root, detail=False)]
        except FileNotFoundError:
            found = []
        if not found:
            raise NotACheckpoint(f"{self.url} holds nothing (not a checkpoint root)", self.url)
        return found

    def is_there(self) -> bool:
        """Whether the root still exists (behind a URL, where a directory is only a prefix of
        names: always)."""
        return os.path.isdir(self.url) if self.local else True

    def exists(self, rel: str) -> bool:
        return os.path.exists(self.files.path(rel)) if self.local else self.fs.exists(self.files.path(rel))

    def make(self) -> None:
        """Make the root (a directory and what is missing above it; nothing behind a URL):
        E1104 when it is a file or cannot be made."""
        if not self.local:
            return
        if os.path.exists(self.url) and not os.path.isdir(self.url):
            raise StoreIOError("the checkpoint path is not a directory", self.url)
        try:
            os.makedirs(self.url, exist_ok=True)
        except OSError as e:
            raise StoreIOError(f"cannot create the checkpoint directory: {e.strerror or e}", self.url) from None

    def size(self, rel: str) -> int:
        """Bytes of the file `rel`."""
        return os.path.getsize(self.files.path(rel)) if self.local else int(self.fs.size(self.files.path(rel)))

    def tail(self, rel: str, n: int) -> bytes:
        """The last `n` bytes of the file `rel` (a chunk's CRC32C), without reading the rest."""
        if self.local:
            with open(self.files.path(rel), "rb") as f:
                f.seek(-n, os.SEEK_END)
                return f.read(n)
        return self.fs.cat_file(self.files.path(rel), start=-n)

    def read(self, rel: str) -> bytes:
        return self.files.read_bytes(rel)

    def commit(self, rel: str, data: bytes) -> None:
        """Write the file `rel` whole, atomically and durably (the manifest's commit point):
        in a directory a temporary name, fsync, rename, fsync of the directory."""
        if not self.local:
            self.files.replace(rel, data)
            return
        path = self.files.path(rel)
        tmp = f"{os.path.dirname(path)}/.{os.path.basename(path)}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path))

    def remove(self, rel: str) -> None:
        """Remove the file `rel`, durably (its directory synced)."""
        if self.local:
            os.remove(self.files.path(rel))
            self.files.sync_dir(rel.rpartition("/")[0])
        else:
            self.files.remove(rel)

    def remove_tree(self, rel: str = "") -> None:
        """Remove `rel` and all below it ("": the root itself), if it is there."""
        if rel:
            self.files.remove_tree(rel)
        elif self.local:
            shutil.rmtree(self.url, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self.files.root, recursive=True)

    def free(self) -> int | None:
        """Bytes free on the root's file system; None behind a URL (not known)."""
        return shutil.disk_usage(self.url).free if self.local else None
