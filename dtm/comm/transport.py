"""The point-to-point layer every collective algorithm runs on.

A `Transport` connects one rank to every other rank of a world and moves frames (spec 9.1)
between them. `send_data` queues a Data frame (the 32-byte chunk header of
`dtm.protocol.messages.Data`, then the bytes), `recv` names the buffer the next Data frame
of a (peer, stream) lands in, and `wait` drives the transport until the given handles
complete. Frames of one (peer, stream) arrive in the order they were sent, so a receiver
posts its receives in the sender's order; the chunk header's `seq` (the collective or P2P
transfer) and `chunk` (the frame's number within it, per peer) must be the ones the
receive expects, else the two sides lost their place (E0908). Its `step` and `offset` are
0: DTM's receivers know where each chunk goes from its order.

Nothing happens in the background: a transport makes progress only inside `wait` (and
`poll`), so queued sends leave while the rank waits for something (every collective and
`recv` does; `close` flushes what is left).

Other frames (CollectiveStart, P2P_SEND, Error, ...) are not matched to receives: each is
handed, as it arrives, to the handler set with `on_control`, which may raise to end the
current `wait`; that is how a mismatched collective is reported the moment its descriptor
arrives, whatever the local rank was waiting for.

A Data frame that arrives before its `recv` is posted is kept (copied) until one is, up to
`max_unexpected` bytes in all; past that the transport fails with E1003.

One thread drives a transport. A `recv` callback runs on that thread inside `wait`, as soon
as its frame has landed and before the next frame is read, so it can post the receive the
next frame needs (that is how a pipelined algorithm keeps its frames landing in place).
"""

from __future__ import annotations

import collections
import itertools
import struct
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Union

import numpy as np

from ..errors import DTMError, ErrorCode as E
from ..protocol.frame import FLAG_COMPRESSED, MsgType
from ..protocol.messages import DATA_HEADER_SIZE

Buffer = Union[bytes, bytearray, memoryview]
ControlHandler = Callable[[int, MsgType, int, bytes], None]  # (peer, type, stream, payload)

DEFAULT_TIMEOUT_S = 60.0
P2P_STREAM = 1  # the stream of point-to-point transfers (collectives use others, control frames 0)
DEFAULT_MAX_UNEXPECTED = 1 << 30
DATA_HEADER = struct.Struct("<QIIQQ")  # seq, chunk, step, offset, nbytes: the layout of messages.Data
assert DATA_HEADER.size == DATA_HEADER_SIZE
MAX_HELD_CONTROLS = 64  # control frames (each at most one control payload) kept until a handler is set


class PeerLost(DTMError):
    """A peer closed its connection or died while this rank needed it (E1001). `peer` is
    None when another rank saw the loss and reported it."""

    def __init__(self, peer: int | None, op: str, detail: str = ""):
        who = f"rank {peer}" if peer is not None else "a peer"
        super().__init__(E.PEER_LOST, f"{who} was lost during {op}" + (f": {detail}" if detail else ""))
        self.peer, self.op, self.detail = peer, op, detail


class CollectiveMismatch(DTMError):
    """The ranks of a group called different collectives at the same point (E0803)."""

    def __init__(self, message: str):
        super().__init__(E.COLLECTIVE_MISMATCH, message)


class CollectiveAborted(DTMError):
    """The operation was abandoned because another rank reported an error, or this
    transport failed earlier and is no longer usable (E1002)."""

    def __init__(self, message: str):
        super().__init__(E.COLLECTIVE_ABORTED, message)


class Handle:
    """One queued send or posted receive. `done` turns true once the frame has left (a
    send: its buffers may be reused) or has been written into its buffer (a receive)."""

    __slots__ = ("peer", "stream", "kind", "done", "buf", "seq", "chunk", "on_done", "flags")

    def __init__(self, peer: int, stream: int, kind: str, buf: memoryview | None = None, seq: int = 0,
                 chunk: int = 0, on_done: Callable[[], None] | None = None, flags: int = 0):
        self.peer, self.stream, self.kind = peer, stream, kind
        self.buf, self.seq, self.chunk, self.on_done = buf, seq, chunk, on_done
        self.flags = flags  # a receive: the end-to-end flags its frame must carry (FLAG_COMPRESSED)
        self.done = False


def byte_view(buf) -> memoryview:
    """A flat byte view of a contiguous buffer (numpy arrays included), without a copy."""
    if isinstance(buf, np.ndarray):  # through numpy: the buffer protocol knows no bf16 or f8
        if not buf.flags.c_contiguous:
            raise ValueError("transport buffers must be C-contiguous")
        return memoryview(buf.reshape(-1).view(np.uint8))
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise ValueError("transport buffers must be C-contiguous")
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


class Transport(ABC):
    """Frames between this rank and every other rank of the world (see the module doc)."""

    def __init__(self, rank: int, world_size: int, *, timeout: float = DEFAULT_TIMEOUT_S,
                 max_unexpected: int = DEFAULT_MAX_UNEXPECTED):
        if not 0 <= rank < world_size:
            raise DTMError(E.INVALID_GROUP, f"rank {rank} is not in a world of {world_size} ranks")
        self.rank, self.world_size, self.timeout = rank, world_size, float(timeout)
        self.max_unexpected = max_unexpected
        self._posted: dict[tuple[int, int], collections.deque[Handle]] = collections.defaultdict(collections.deque)
        self._unexpected: dict[tuple[int, int], collections.deque[tuple[int, int, Buffer, int]]] = \
            collections.defaultdict(collections.deque)
        self._unexpected_bytes = 0
        self._completed: collections.deque[Handle] = collections.deque()
        self._control: ControlHandler | None = None
        self._held_controls: list[tuple[int, MsgType, int, bytes]] = []  # frames that came before the handler
        self.failed: DTMError | None = None  # set once; every later wait raises CollectiveAborted
        self.max_data = 1 << 30  # the most tensor bytes one Data frame may carry to any peer
        self.bytes_sent = 0
        self.bytes_received = 0
        # each rank's node (spec 9.6: a MeshView member's `node`, equal on ranks of one host),
        # set by whoever formed the mesh; None: unknown (collectives run flat)
        self.nodes: tuple[str, ...] | None = None

    # --- what a concrete transport provides ---------------------------------------------

    @abstractmethod
    def send(self, peer: int, stream: int, msg_type: MsgType, parts: Sequence[Buffer], flags: int = 0) -> Handle:
        """Queue one frame whose payload is `parts` back to back (with end-to-end `flags`).
        The buffers must stay unchanged until the handle is done."""

    @abstractmethod
    def _progress(self, deadline: float, waiting: Iterable[Handle], op: str) -> None:
        """Move bytes until something happened or `deadline` passed (at once when it has);
        hand arrived frames to `_deliver_data` / `_deliver_control`; raise PeerLost when a
        peer one of `waiting` needs is gone."""

    def close(self) -> None:
        """Flush queued sends (bounded by the timeout) and release the connections."""

    def peer_name(self, peer: int) -> str:
        return f"rank {peer}"

    # --- Data frames ----------------------------------------------------------------------

    def send_data(self, peer: int, stream: int, buf, *, seq: int, chunk: int, flags: int = 0) -> Handle:
        """Queue `buf` (contiguous, unchanged until the handle is done) as one Data frame
        (`flags`: FLAG_COMPRESSED for a compressed chunk, spec 9.5.1)."""
        view = byte_view(buf)
        return self.send(peer, stream, MsgType.DATA, [DATA_HEADER.pack(seq, chunk, 0, 0, view.nbytes), view],
                         flags)

    def peer_caps(self, peer: int) -> int | None:
        """The capability bits `peer` announced in its Hello (spec 8.2); None where no
        Hello was exchanged (threads of one process: every capability of this side)."""
        return None

    def own_caps(self) -> int | None:
        """The capability bits this side announced; None where it announced none."""
        return None

    def recv(self, peer: int, stream: int, out, *, seq: int, chunk: int,
             on_done: Callable[[], None] | None = None, flags: int = 0) -> Handle:
        """Receive the next Data frame of (peer, stream) into `out` (contiguous, exactly the
        frame's size); `on_done` runs inside `wait` once it has landed. `flags`: the
        end-to-end flags the frame must carry (FLAG_COMPRESSED: a compressed chunk is due)."""
        h = Handle(peer, stream, "recv", byte_view(out), seq, chunk, on_done, flags)
        key = (peer, stream)
        stash = self._unexpected.get(key)
        if stash and not self._posted[key]:
            got_seq, got_chunk, payload, got_flags = stash.popleft()
            self._unexpected_bytes -= len(payload)
            self._check_chunk(h, got_seq, got_chunk, len(payload), got_flags)
            h.buf[:] = payload
            h.done = True
            if on_done is not None:  # run by `wait`, not here: the callback may post the next recv
                self._completed.append(h)
        else:
            self._posted[key].append(h)
        return h

    def _target(self, peer: int, stream: int) -> Handle | None:
        """The receive the next Data frame of (peer, stream) is for, if one is posted."""
        q = self._posted.get((peer, stream))
        return q[0] if q else None

    def _check_chunk(self, h: Handle, seq: int, chunk: int, nbytes: int, flags: int = 0) -> None:
        if (flags ^ h.flags) & FLAG_COMPRESSED:  # spec 9.5.1: a compressed chunk where one is due, else raw
            raise DTMError(E.BAD_PAYLOAD, f"{self.peer_name(h.peer)} sent chunk {chunk} of transfer {seq} on stream "
                           f"{h.stream} {'with' if flags & FLAG_COMPRESSED else 'without'} the COMPRESSED flag; "
                           f"this rank expected {'a compressed' if h.flags & FLAG_COMPRESSED else 'an uncompressed'} "
                           "chunk")
        if (seq, chunk, nbytes) != (h.seq, h.chunk, h.buf.nbytes):
            raise DTMError(E.OUT_OF_SEQUENCE, f"{self.peer_name(h.peer)} sent chunk {chunk} of transfer {seq} "
                           f"({nbytes} bytes) on stream {h.stream}; this rank expected chunk {h.chunk} of transfer "
                           f"{h.seq} ({h.buf.nbytes} bytes)")

    def _deliver_data(self, peer: int, stream: int, seq: int, chunk: int, nbytes: int,
                      payload: Buffer | None, flags: int = 0) -> None:
        """A whole, checked Data frame arrived: either already written into the posted
        receive's buffer (payload None) or held in `payload`, a buffer the transport gives
        away (copied to a posted buffer, or kept as it is until one is posted)."""
        self.bytes_received += nbytes
        q = self._posted.get((peer, stream))
        if q:
            h = q.popleft()
            self._check_chunk(h, seq, chunk, nbytes, flags)
            if payload is not None:
                h.buf[:] = payload
            h.done = True
            if h.on_done is not None:
                # At once, before the next frame is read: the callback frees and re-posts
                # receive buffers, so that frame can land in place.
                h.on_done()
            return
        assert payload is not None, "a frame was received into a receive that is not posted"
        self._unexpected_bytes += nbytes
        if self._unexpected_bytes > self.max_unexpected:
            raise DTMError(E.RECEIVE_BUFFER_FULL,
                           f"{self.peer_name(peer)} sent {self._unexpected_bytes} bytes that no receive was posted "
                           f"for yet (stream {stream}); the limit is {self.max_unexpected} bytes")
        self._unexpected[(peer, stream)].append((seq, chunk, payload, flags))

    def _deliver_control(self, peer: int, msg_type: MsgType, stream: int, payload: bytes) -> None:
        if self._control is None:
            # A peer that finished connecting first may start a collective while this rank still
            # sets its transport up (attaching shared memory, say): its frames wait for the
            # handler, a bounded number of them.
            if len(self._held_controls) >= MAX_HELD_CONTROLS:
                raise DTMError(E.UNEXPECTED_MESSAGE, f"{self.peer_name(peer)} sent a {msg_type.name} frame, one of "
                               f"more than {MAX_HELD_CONTROLS} before anything on this rank could handle them")
            self._held_controls.append((peer, msg_type, stream, bytes(payload)))
            return
        self._control(peer, msg_type, stream, payload)

    def on_control(self, handler: ControlHandler | None) -> None:
        """Hand every control frame to `handler` from now on, first those that came before."""
        self._control = handler
        held, self._held_controls = self._held_controls, []
        if handler is not None:
            for frame in held:
                handler(*frame)

    # --- waiting ------------------------------------------------------------------------

    def wait(self, handles: list[Handle], op: str, timeout: float | None = None) -> None:
        """Drive the transport until every handle in `handles` is done, running receive
        callbacks as their data lands; handles a callback appends to the same list are
        waited for too. Raises TIMEOUT after `timeout` (default: the transport's) seconds
        naming the peers still owed; PeerLost when one of them is gone; and whatever a
        control handler or callback raised. After any error the transport is failed:
        later waits raise CollectiveAborted quoting the first error."""
        self.check_usable(op)
        limit = self.timeout if timeout is None else timeout
        start = time.monotonic()
        deadline = start + limit
        done = 0  # handles[:done] are known to be done
        try:
            while True:
                while self._completed:
                    self._completed.popleft().on_done()
                while done < len(handles) and handles[done].done:
                    done += 1
                if done == len(handles):
                    return
                now = time.monotonic()
                if now >= deadline:
                    raise self._timeout([h for h in handles if not h.done], op, now - start)
                self._progress(deadline, itertools.islice(handles, done, None), op)
        except DTMError as e:
            self.fail(e)
            raise

    def poll(self, op: str) -> None:
        """Deliver whatever already arrived, without waiting (raises like `wait`)."""
        self.wait([], op)
        try:
            self._progress(time.monotonic(), (), op)
        except DTMError as e:
            self.fail(e)
            raise

    def ring_pass(self, left: int, right: int, stream: int, seq: int, start: bytes, work: np.ndarray,
                  first: Sequence[tuple[int, int]], plan: Sequence, op: str, n: int, what: str,
                  finished: np.ndarray | None = None, finished_base: int = 0) -> bool:
        """Run a whole ring pass of a group of `n` natively, if this transport can: send
        the CollectiveStart `start` and then the chunks `first` of `work` to `right`,
        receive `plan` (`algorithms.ring_schedule`) from `left` into `work`, reducing with
        `op` where the plan says, in exactly the frames `algorithms.ring` would use. Each
        finished chunk is also copied to `finished` (which holds `work`'s elements from
        `finished_base` on), when given. False: it cannot here, and the caller runs
        `algorithms.ring`."""
        return False

    def compressed_ring_pass(self, left: int, right: int, stream: int, seq: int, start: bytes, work: np.ndarray,
                             first: Sequence[tuple[int, int]], plan: Sequence, codec, mode: str, what: str,
                             recv_arena: np.ndarray, send_arena: np.ndarray) -> bool:
        """`algorithms.compressed_ring` run natively, if this transport can: the same frames
        and the same bits (spec 9.5.1). False: it cannot here, and the caller runs it."""
        return False

    def discard(self, peer: int, stream: int) -> None:
        """Drop the frames of `stream` queued for `peer` that have not begun to leave (the
        rest of an abandoned transfer), so that a frame queued next goes out at once."""

    def notify(self, peers: Sequence[int], stream: int, msg_type: MsgType, parts: Sequence[Buffer],
               grace: float = 1.0) -> None:
        """Best effort, for reporting an error: queue one frame to each peer and push for at
        most `grace` seconds; a peer that cannot be reached, or whose connection ends
        meanwhile (severed for a lost peer or a cancelled job), is skipped."""
        handles = []
        for p in peers:
            try:
                handles.append(self.send(p, stream, msg_type, parts))
            except DTMError:
                continue
        deadline = time.monotonic() + grace
        while any(not h.done and self.ended(h.peer) is None for h in handles) and time.monotonic() < deadline:
            try:
                self._progress(deadline, (), "reporting an error")
            except DTMError:
                return

    def ended(self, peer: int) -> str | None:
        """Why the connection to `peer` ended; None while it is open (and where connections
        do not end)."""
        return None

    def _timeout(self, pending: Sequence[Handle], op: str, waited: float) -> DTMError:
        owed = sorted({(h.peer, h.kind) for h in pending})
        what = ", ".join(f"{'data from' if k == 'recv' else 'a send to'} {self.peer_name(p)}" for p, k in owed)
        return DTMError(E.TIMEOUT, f"{op} on rank {self.rank}: waited {waited:.1f} s for {what}")

    def fail(self, err: DTMError) -> None:
        if self.failed is None:
            self.failed = err

    def check_usable(self, op: str) -> None:
        if self.failed is not None:
            raise CollectiveAborted(f"{op} on rank {self.rank}: this rank's connections failed earlier and cannot be "
                                    f"used again (first error: {self.failed})")
