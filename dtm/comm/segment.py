"""Named shared-memory segments of one host, and the futex words ranks sleep on in them.

The workspaces of `shm` (one per group) and the point-to-point channels of `channel` (one
segment per host) are both made this way: the first member creates the segment under a
name in /dev/shm, the others map it by that name, and the creator unlinks the name as soon
as every member has mapped it, so nothing is left behind even when processes are killed.
A name a killed creator had not dropped yet (its resource tracker, which would, killed with
it) is removed by `remove_all`: by the survivors as they close, and by `dtm launch`.
Counters in a segment have one writer each and are read after the data they publish; that
relies on x86-64's store order, so other CPUs use the socket algorithms (`SUPPORTED`).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import platform
import time
from collections.abc import Callable
from multiprocessing import shared_memory

import numpy as np

from ..errors import DTMError, ErrorCode as E

SUPPORTED = platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")
LINE = 64  # a cache line: counters with different writers never share one


class Futex:
    """Sleep until a 32-bit word in shared memory changes, and wake the sleepers (Linux
    futex(2), non-private so it works across processes)."""

    _SYS_FUTEX = 202  # x86-64
    _WAIT, _WAKE = 0, 1

    class _Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    _libc = ctypes.CDLL(None, use_errno=True) if SUPPORTED else None

    def __init__(self, word: np.ndarray):
        self.word = word  # a uint32 array of one element, in the shared segment
        self.addr = ctypes.c_void_p(word.ctypes.data)

    def value(self) -> int:
        return int(self.word[0])

    def wait(self, seen: int, timeout: float) -> None:
        ts = self._Timespec(int(timeout), int((timeout % 1) * 1e9))
        self._libc.syscall(ctypes.c_long(self._SYS_FUTEX), self.addr, ctypes.c_int(self._WAIT), ctypes.c_uint(seen),
                           ctypes.byref(ts), ctypes.c_void_p(0), ctypes.c_int(0))

    def ring(self) -> None:
        self.word[0] = (int(self.word[0]) + 1) & 0xFFFFFFFF
        self._libc.syscall(ctypes.c_long(self._SYS_FUTEX), self.addr, ctypes.c_int(self._WAKE),
                           ctypes.c_int(1 << 30), ctypes.c_void_p(0), ctypes.c_void_p(0), ctypes.c_int(0))


def _create(name: str, size: int) -> shared_memory.SharedMemory:
    """A new segment of `size` zero bytes (pages are allocated as they are first touched)."""
    try:
        return shared_memory.SharedMemory(name, create=True, size=size)
    except FileExistsError:  # left by a process of an earlier run that was killed early
        stale = shared_memory.SharedMemory(name)
        stale.close()
        stale.unlink()
        return shared_memory.SharedMemory(name, create=True, size=size)


def _open_created(name: str, size: int, await_ready: Callable[[Callable[[], bool], str], None]) -> mmap.mmap:
    """Map the segment another member creates, once it exists at its full size;
    `await_ready(ready, what)` waits (bounded) until `ready()`. Opened as a plain file of
    /dev/shm rather than a SharedMemory, which would register the name with the resource
    tracker a second time."""
    found: list[mmap.mmap] = []

    def opened() -> bool:
        try:
            fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
        except FileNotFoundError:
            return False
        try:
            if os.fstat(fd).st_size < size:  # created, not sized yet
                return False
            found.append(mmap.mmap(fd, size))
            return True
        finally:
            os.close(fd)

    await_ready(opened, "the first member to create shared memory")
    return found[0]


class Segment:
    """One mapped segment: its bytes, and (on the member that created it) its name until
    `unlink`."""

    def __init__(self, mapping, buf: memoryview, named: bool):
        self.mapping, self.buf, self.named = mapping, buf, named

    def unlink(self) -> None:
        if self.named:
            self.named = False
            try:
                self.mapping.unlink()
            except FileNotFoundError:
                pass

    def release(self) -> None:
        """Unmap, once the owner has dropped its views into `buf`."""
        try:
            self.buf.release()
            self.mapping.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with the process
            pass


def attach(name: str, size: int, *, create: bool, magic: int, layout: dict[str, int],
           await_ready: Callable[[Callable[[], bool], str], None]) -> Segment:
    """Create (the first member: `create`) or map (the others) segment `name` of `size`
    bytes, whose first line holds `magic` and then the numbers of `layout`, on which every
    member must agree."""
    if create:
        shm = _create(name, size)
        buf = shm.buf
    else:
        shm = _open_created(name, size, await_ready)
        buf = memoryview(shm)
    head = np.ndarray((1 + len(layout),), np.int64, buf, 0)
    want = tuple(layout.values())
    if create:
        head[1:] = want
        head[0] = magic  # last: the others wait for it
    else:
        await_ready(lambda: head[0] == magic, "the first member to set up shared memory")
        if tuple(int(v) for v in head[1:]) != want:
            found = ", ".join(f"{k} {int(v)}" for k, v in zip(layout, head[1:]))
            raise DTMError(E.INVALID_GROUP, f"shared memory {name}: laid out for {found}; this rank expects "
                           + ", ".join(f"{k} {v}" for k, v in layout.items()))
    return Segment(shm, buf, create)


def remove_all(prefix: str, dirs: bool = False) -> list[str]:
    """Remove every segment name in /dev/shm that starts with `prefix`: those of a mesh
    whose creator was killed, with multiprocessing's resource tracker that would have
    removed them, before it dropped them (the survivors or the launcher call this once the
    mesh is over). With `dirs`, directories too: the parts of the mesh's store
    (dtm/store/mesh_store.py names them so), which only the launcher removes, once every
    rank ended (a survivor's own part is still served). The names removed."""
    try:
        names = [n for n in os.listdir("/dev/shm") if n.startswith(prefix)
                 and (dirs or not os.path.isdir(f"/dev/shm/{n}"))]
    except FileNotFoundError:  # no /dev/shm: no segments either
        return []
    for n in names:
        path = f"/dev/shm/{n}"
        try:
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
        except FileNotFoundError:  # another survivor was first
            pass
    return names


def await_ready(ready: Callable[[], bool], what: str, timeout: float, where: str,
                between: Callable[[], None] = lambda: None) -> None:
    """Until `ready()`, running `between()` (e.g. a look at the sockets) between tries;
    TIMEOUT after `timeout` seconds naming `what` and `where`."""
    start = time.monotonic()
    while not ready():
        waited = time.monotonic() - start
        if waited > timeout:
            raise DTMError(E.TIMEOUT, f"{where}: waited {waited:.1f} s for {what}")
        between()
        time.sleep(0.002)
