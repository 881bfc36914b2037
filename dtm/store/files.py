"""Where a store's files live: a local directory (written durably, read through memory
maps) or a process-local dict (`memory://`). Paths are relative, `/`-separated, and already
checked by keys.py, so neither backend can be led outside its root."""

from __future__ import annotations

import os
import shutil
from typing import Iterable

import numpy as np


class LocalFiles:
    """Files under the directory `root`."""

    def __init__(self, root: str):
        self.root = root

    def path(self, rel: str) -> str:
        return os.path.join(self.root, *rel.split("/"))

    def write(self, rel: str, parts: Iterable[memoryview | bytes]) -> None:
        """Write a new file from `parts`, and fsync it before returning."""
        path = self.path(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "xb") as f:  # "x": a version directory is fresh, so is each of its files
            for p in parts:
                f.write(p)
            f.flush()
            os.fsync(f.fileno())

    def sync_tree(self, rel: str) -> None:
        """fsync every directory under `rel`, then `rel`'s ancestors up to the root, so the
        new files' names are as durable as their bytes."""
        top = self.path(rel)
        for dirpath, _, _ in os.walk(top, topdown=False):
            _fsync_dir(dirpath)
        d = os.path.dirname(top)
        while len(d) >= len(self.root):
            _fsync_dir(d)
            d = os.path.dirname(d)

    def read_bytes(self, rel: str) -> bytes:
        with open(self.path(rel), "rb") as f:
            return f.read()

    def map(self, rel: str) -> np.ndarray:
        """The file's bytes as a read-only uint8 array, memory-mapped (no copy)."""
        path = self.path(rel)
        if os.path.getsize(path) == 0:  # mmap refuses empty files
            return np.empty(0, np.uint8)
        return np.memmap(path, np.uint8, mode="r")

    def remove_tree(self, rel: str) -> None:
        shutil.rmtree(self.path(rel), ignore_errors=True)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class MemoryFiles:
    """Files in a dict, for `memory://` stores: process-local, gone when the process ends."""

    def __init__(self) -> None:
        self._files: dict[str, bytes] = {}

    def path(self, rel: str) -> str:
        return "memory://" + rel

    def write(self, rel: str, parts: Iterable[memoryview | bytes]) -> None:
        self._files[rel] = b"".join(parts)  # a copy: the caller may change its array later

    def sync_tree(self, rel: str) -> None:
        """Nothing to sync: memory is as durable as a memory store promises."""

    def read_bytes(self, rel: str) -> bytes:
        try:
            return self._files[rel]
        except KeyError:
            raise FileNotFoundError(rel) from None

    def map(self, rel: str) -> np.ndarray:
        return np.frombuffer(self.read_bytes(rel), np.uint8)

    def remove_tree(self, rel: str) -> None:
        for k in [k for k in self._files if k.startswith(rel + "/")]:
            del self._files[k]
