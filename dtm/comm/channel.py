"""Point-to-point channels in shared memory: for ranks of one host, the byte streams that
carry point-to-point frames instead of a TCP connection.

A channel is one direction between two ranks: a ring of `capacity` bytes with two
counters, the bytes ever written (the writer's) and the bytes ever read (the reader's),
each on a cache line of its own. The frames on it are the frames of spec 9.1 (header,
CRC32C and all) exactly as they would cross a socket, so the TCP transport reads and
writes a channel with the same code as a connection: `sendmsg` and `recv_into` copy into
and out of the ring and raise BlockingIOError when it is full or empty, as a non-blocking
socket does. One copy in and one copy out per byte, against a socket's kernel copies and
wake-ups.

One segment per host holds a channel for every ordered pair of the host's ranks, and one
futex word per rank: a writer rings the reader's word after writing, a reader rings the
writer's after making room, and a rank with nothing to do sleeps on its own word. Pages
are allocated only as a channel is first used. The host's lowest rank creates the
segment; each rank marks its line once it has mapped it, and the creator unlinks the name
once all have.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from . import segment
from .segment import LINE

_MAGIC = 0x44544D5032503031  # "DTMP2P01"
_HEAD = 64                   # magic, number of ranks, channel capacity


class Channel:
    """One direction of a pair: a single-writer, single-reader byte ring (see the module doc)."""

    def __init__(self, buf: memoryview, off: int, capacity: int, reader_bell: segment.Futex,
                 writer_bell: segment.Futex):
        self.counters = np.ndarray((2, LINE // 8), np.int64, buf, off)  # [0, 0] written, [1, 0] read
        self.data = buf[off + 2 * LINE:off + 2 * LINE + capacity]
        self.capacity = capacity
        self.reader_bell, self.writer_bell = reader_bell, writer_bell

    def readable(self) -> bool:
        return int(self.counters[0, 0]) != int(self.counters[1, 0])

    def sendmsg(self, views: Sequence[memoryview]) -> int:
        """Copy as much of `views` (back to back) as the ring has room for; the bytes copied."""
        written = int(self.counters[0, 0])
        room = self.capacity - (written - int(self.counters[1, 0]))
        if room == 0:
            raise BlockingIOError
        total = 0
        for v in views:
            take = min(v.nbytes, room - total)
            self._copy_in(written + total, v[:take])
            total += take
            if total == room:
                break
        self.counters[0, 0] = written + total  # after the bytes: the reader trusts what it counts
        self.reader_bell.ring()
        return total

    def recv_into(self, buf, nbytes: int = 0) -> int:
        """Copy what the ring holds, up to `nbytes` (0: len(buf)), into `buf`; the bytes copied."""
        view = memoryview(buf)
        if nbytes:
            view = view[:nbytes]
        read = int(self.counters[1, 0])
        take = min(int(self.counters[0, 0]) - read, view.nbytes)
        if take == 0:
            if view.nbytes == 0:
                return 0
            raise BlockingIOError
        self._copy_out(read, view[:take])
        self.counters[1, 0] = read + take
        self.writer_bell.ring()
        return take

    def _copy_in(self, at: int, v: memoryview) -> None:
        i = at % self.capacity
        first = min(v.nbytes, self.capacity - i)
        self.data[i:i + first] = v[:first]
        if first < v.nbytes:
            self.data[:v.nbytes - first] = v[first:]

    def _copy_out(self, at: int, v: memoryview) -> None:
        i = at % self.capacity
        first = min(v.nbytes, self.capacity - i)
        v[:first] = self.data[i:i + first]
        if first < v.nbytes:
            v[first:] = self.data[:v.nbytes - first]


class Channels:
    """This rank's channels to and from the other ranks of its host, in one segment."""

    def __init__(self, rank: int, ranks: Sequence[int], name: str, capacity: int, timeout: float,
                 between: Callable[[], None] = lambda: None):
        self.rank, self.ranks, self.name = rank, tuple(sorted(ranks)), name
        n, me = len(self.ranks), self.ranks.index(rank)
        capacity = -(-capacity // LINE) * LINE
        self.off_marks = _HEAD
        self.off_bells = self.off_marks + n * LINE
        self.off_rings = self.off_bells + n * LINE
        stride = 2 * LINE + capacity
        size = self.off_rings + n * n * stride
        self.creator = me == 0
        where = f"rank {rank} ({name}, the point-to-point channels of ranks {list(self.ranks)})"
        self.segment = segment.attach(
            name, size, create=self.creator, magic=_MAGIC, layout={"ranks": n, "channel bytes": capacity},
            await_ready=lambda ready, what: segment.await_ready(ready, what, timeout, where, between))
        buf = self.segment.buf
        self.marks = np.ndarray((n, LINE), np.uint8, buf, self.off_marks)
        self.marks[me, 0] = 1
        bells = [segment.Futex(np.ndarray((1,), np.uint32, buf, self.off_bells + m * LINE)) for m in range(n)]
        self.bell = bells[me]  # this rank sleeps on it
        ring = lambda src, dst: Channel(buf, self.off_rings + (src * n + dst) * stride,  # noqa: E731
                                        capacity, bells[dst], bells[src])
        self.to = {r: ring(me, m) for m, r in enumerate(self.ranks) if r != rank}
        self.frm = {r: ring(m, me) for m, r in enumerate(self.ranks) if r != rank}

    def unlink_when_mapped(self) -> None:
        """The creator drops the name once every rank has mapped the segment."""
        if self.segment.named and self.marks[:, 0].all():
            self.segment.unlink()

    def close(self) -> None:
        self.segment.unlink()
        for ch in list(self.to.values()) + list(self.frm.values()):
            ch.counters = ch.data = ch.reader_bell = ch.writer_bell = None
        self.marks = self.bell = self.to = self.frm = None  # drop the views before unmapping
        self.segment.release()
