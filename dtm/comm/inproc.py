"""The in-process transport: ranks are threads of one process, frames are Python objects
in per-rank inboxes. It runs the same algorithms as the wire transports, so tests of the
algorithms need no sockets, and it is the L0 transport between the devices of a process.

    transports = InprocHub(4).transports(timeout=10)   # one per rank, each for one thread
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterable, Sequence

from ..protocol.frame import MsgType
from .transport import DATA_HEADER, DEFAULT_TIMEOUT_S, Buffer, Handle, PeerLost, Transport


class InprocHub:
    """The inboxes of `world_size` ranks living in one process."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.cond = threading.Condition()
        self.inbox: list[collections.deque] = [collections.deque() for _ in range(world_size)]
        self.closed: set[int] = set()

    def transports(self, *, timeout: float = DEFAULT_TIMEOUT_S) -> list["InprocTransport"]:
        return [InprocTransport(self, r, timeout=timeout) for r in range(self.world_size)]


class InprocTransport(Transport):
    def __init__(self, hub: InprocHub, rank: int, *, timeout: float = DEFAULT_TIMEOUT_S):
        super().__init__(rank, hub.world_size, timeout=timeout)
        self.hub = hub

    def send(self, peer: int, stream: int, msg_type: MsgType, parts: Sequence[Buffer], flags: int = 0) -> Handle:
        """Copies the payload, so the handle is done at once (never, when the peer is gone:
        the wait for it reports PeerLost, after what the peer sent before it went)."""
        h = Handle(peer, stream, "send")
        payload = b"".join(bytes(p) for p in parts)
        with self.hub.cond:
            if peer in self.hub.closed:
                return h
            self.hub.inbox[peer].append((self.rank, msg_type, stream, payload, flags))
            self.hub.cond.notify_all()
        self.bytes_sent += len(payload)
        h.done = True
        return h

    def _progress(self, deadline: float, waiting: Iterable[Handle], op: str) -> None:
        inbox = self.hub.inbox[self.rank]
        with self.hub.cond:
            while not inbox:
                lost = next((h.peer for h in waiting if not h.done and h.peer in self.hub.closed), None)
                if lost is not None:
                    raise PeerLost(lost, op, "its transport was closed")
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.hub.cond.wait(left)
            frames = list(inbox)
            inbox.clear()
        for src, msg_type, stream, payload, flags in frames:
            if msg_type is MsgType.DATA:
                seq, chunk, _step, _offset, nbytes = DATA_HEADER.unpack_from(payload)
                self._deliver_data(src, stream, seq, chunk, nbytes, memoryview(payload)[DATA_HEADER.size:], flags)
            else:
                self._deliver_control(src, msg_type, stream, payload)

    def close(self) -> None:
        with self.hub.cond:
            self.hub.closed.add(self.rank)
            self.hub.cond.notify_all()
