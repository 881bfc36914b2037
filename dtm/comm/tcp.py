"""The TCP transport: one connection per pair of ranks, frames of spec 9.1 on each.

    listener = listen()                                  # 127.0.0.1, a free port
    ... tell every rank every other rank's (host, port) ...
    transport = connect_mesh(rank, world_size, addresses, token, listener=listener)

`connect_mesh` connects to every lower rank and accepts every higher one; each connection
opens with the three-Hello handshake of `dtm.protocol.handshake`, which proves that both
sides hold the cluster token (HMAC over the other side's challenge; the token never
travels) and negotiates the protocol version. A connection that sends anything else, or
nothing within `HELLO_TIMEOUT_S`, is dropped with a logged reason while the others go on.

On the established mesh each rank's single thread drives non-blocking sockets: frames
queued before a wait leave in one `sendmsg`, which takes frame headers and the tensor's
memoryviews together (no copy of the tensor), and a
Data frame whose receive is posted is read with `recv_into` straight into its numpy buffer.
Every frame's CRC32C is checked before its bytes are used (`ChecksumError`), every length
is bounded before a buffer is allocated, and a peer whose connection ends without a Leave
frame is reported as `PeerLost` at once.

The ring passes of all_gather, and of f32 or f64 all_reduce and reduce_scatter (sum, avg),
and the compressed ones (spec 9.5.1, `compressed_ring_pass`, the codec inside the loop),
run in C (`ring_pass`, `ring_pump.c`): the same frames, read and written without Python's
per-frame work, which on a small machine is what decides whether DTM keeps up with gloo.
Python hands the pump the two connections at a frame boundary and takes them back the
same way.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import logging
import os
import select
import socket
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from ..errors import DTMError, ErrorCode as E
from ..protocol import checksums
from ..protocol.caps import Cap, level_caps
from ..protocol.compressed import check_chunk
from ..protocol.errors import ProtocolError, StaleEpochError
from ..protocol.frame import FLAG_COMPRESSED, HEADER_SIZE, MAX_PAYLOAD, FrameHeader, MsgType, decode_header, encode_header, \
    verify_payload
from ..protocol.handshake import Handshake
from ..protocol.messages import MIN_MAX_PAYLOAD, Leave, decode_message
from . import pump
from .algorithms import RingReceive
from .transport import DATA_HEADER, DEFAULT_TIMEOUT_S, Buffer, Handle, PeerLost, Transport

log = logging.getLogger("dtm.comm")

HELLO_TIMEOUT_S = 10.0     # an accepted connection must finish its handshake within this
MAX_HANDSHAKING = 64       # accepted connections still in their handshake; past this the oldest goes
READ_BUFFER = 256 << 10    # per connection, for headers and small frames
READ_AHEAD = 16 << 10      # the most read into it at once
MAX_IOV = 64               # buffers per sendmsg call
FLUSH_BYTES = 4 << 20      # bytes offered per sendmsg call, about what a loopback socket takes at once
LEVEL = 1                  # conformance level announced in Hello (membership, wire collectives, P2P)
NO_QUANT_ENV = "DTM_NO_CAP_QUANT"  # a test hook: "1" and this side does not announce CAP_QUANT


def announced_caps() -> int:
    """The capability bits a mesh connection's Hello announces: those of LEVEL, CAP_QUANT
    (compressed collectives, spec 9.5.1) unless DTM_NO_CAP_QUANT=1, and CAP_CHECKSUMS
    (end-to-end tensor checksums, spec 9.4.9) unless DTM_CHECKSUMS=0."""
    caps = level_caps(LEVEL)
    if os.environ.get(NO_QUANT_ENV, "") != "1":
        caps |= Cap.QUANT
    if checksums.enabled():
        caps |= Cap.CHECKSUMS
    return int(caps)


def listen(host: str = "127.0.0.1", port: int = 0, backlog: int = 128) -> socket.socket:
    """A listening socket for `connect_mesh`; port 0 picks a free port (`getsockname()`)."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(backlog)
    return s


def _fresh(nbytes: int) -> memoryview:
    """A new buffer for a payload no posted receive takes, not zeroed (it is read over)."""
    return memoryview(np.empty(nbytes, np.uint8))


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)


class _Out:
    """A frame on its way out: the views not yet sent, and its handle."""

    __slots__ = ("views", "handle", "seq", "started")

    def __init__(self, views: list[memoryview], handle: Handle, seq: int):
        self.views, self.handle, self.seq = views, handle, seq
        self.started = False  # some of its bytes left: the rest must follow


class Connection:
    """One established connection and its reading and writing state."""

    def __init__(self, peer: int, sock: socket.socket, version: tuple[int, int], peer_max_payload: int,
                 name: str, seq_out: int, seq_in: int, caps: int | None = None):
        self.peer, self.sock, self.version, self.name = peer, sock, version, name
        self.caps = caps                       # what the peer's Hello announced
        self.fd = sock.fileno()
        self.max_send = peer_max_payload
        self.out: collections.deque[_Out] = collections.deque()
        self.seq_out: dict[int, int] = collections.defaultdict(int)
        self.seq_out[0] = seq_out  # the handshake used the first numbers of the control stream
        self.seq_in: dict[int, int] = collections.defaultdict(int)
        self.seq_in[0] = seq_in
        self.rbuf = bytearray(READ_BUFFER)
        self.rstart = self.rend = 0
        self.header: FrameHeader | None = None
        self.chunk_header: tuple | None = None  # (seq, chunk, step, offset, nbytes) of the Data frame being read
        self.dest: memoryview | None = None    # where the payload being read goes
        self.dest_pos = 0
        self.direct = False                    # dest is the posted receive's own buffer
        self.skip = 0                          # payload bytes of a stale frame still to drop
        self.left = False                      # the peer said Leave
        self.severed = False                   # the failure detector declared the peer lost
        self.closed: str | None = None         # why the connection is gone
        self.writing = False                   # registered for POLLOUT
        self.polled = sock.fileno() >= 0       # a socket in the poller, not a shared-memory channel
        self.pump_reads = False                # the ring pump reads it now: Python does not
        self.pump_writes = False               # the ring pump writes it now: Python does not


class TcpTransport(Transport):
    """Frames over established, authenticated connections (made by `connect_mesh`)."""

    def __init__(self, rank: int, world_size: int, conns: dict[int, tuple[socket.socket, Handshake]], *,
                 epoch: int = 0, timeout: float = DEFAULT_TIMEOUT_S, max_payload: int = MAX_PAYLOAD,
                 names: Sequence[str] | None = None):
        super().__init__(rank, world_size, timeout=timeout)
        self.epoch, self.max_payload = epoch, max_payload
        self._names = list(names) if names is not None else [f"rank {r}" for r in range(world_size)]
        self._poller = select.poll()
        self._conns: dict[int, Connection] = {}
        self._by_fd: dict[int, Connection] = {}
        self._closed = 0  # connections lost or closed
        self.pump_runs = 0  # ring passes run by ring_pump.c
        self.pump_handoffs = 0  # frames it gave back to Python (a neighbour's CollectiveStart, about one a pass)
        self._pump_tmp = np.empty(0, np.uint8)  # the pump's receive buffer for chunks it reduces
        self._own_caps: int | None = announced_caps()
        for peer, (sock, hs) in conns.items():
            _tune(sock)
            # The handshake numbered the control stream's first frames: the connecting side sent 2 Hellos.
            c = Connection(peer, sock, hs.version, hs.peer.max_payload, self._names[peer], hs.next_seq,
                           1 if hs.role == "connect" else 2, hs.peer.caps)
            self._own_caps = hs.hello.caps
            self._conns[peer] = c
            self._by_fd[c.fd] = c
            self._poller.register(c.fd, select.POLLIN)
        if self._conns:
            self.max_data = min(c.max_send for c in self._conns.values()) - DATA_HEADER.size

    def peer_name(self, peer: int) -> str:
        return self._names[peer]

    def peer_caps(self, peer: int) -> int | None:
        c = self._conns.get(peer)
        return None if c is None else c.caps

    def own_caps(self) -> int | None:
        return self._own_caps

    # --- sending ----------------------------------------------------------------------------

    def send(self, peer: int, stream: int, msg_type: MsgType, parts: Sequence[Buffer], flags: int = 0) -> Handle:
        c = self._conn_for(peer, stream)
        if c is None:
            raise DTMError(E.INVALID_GROUP, f"rank {self.rank} has no connection to rank {peer}")
        if c.closed is not None:
            raise PeerLost(peer, f"a {msg_type.name} frame to {c.name}", c.closed)
        length = sum(len(p) if not isinstance(p, memoryview) else p.nbytes for p in parts)
        if length > c.max_send:
            raise DTMError(E.FRAME_TOO_LARGE, f"a {length}-byte {msg_type.name} frame for {c.name}, which accepts "
                           f"at most {c.max_send} bytes")
        seq = c.seq_out[stream]
        c.seq_out[stream] = seq + 1
        header = encode_header(msg_type, parts, epoch=self.epoch, stream=stream, seq=seq, version=c.version,
                               flags=flags)
        h = Handle(peer, stream, "send")
        views = [memoryview(header)] + [p if isinstance(p, memoryview) else memoryview(p) for p in parts]
        c.out.append(_Out([v for v in views if v.nbytes], h, seq))
        self._count_sent(c, HEADER_SIZE + length)
        return h  # sent by the next wait or poll, together with the frames queued after it

    def discard(self, peer: int, stream: int) -> None:
        c = self._conn_for(peer, stream)
        if c is None:
            return
        dropped = [item for item in c.out if not item.started and item.handle.stream == stream]
        if dropped:  # the stream's sequence numbers go on from the first frame dropped
            c.out = collections.deque(item for item in c.out if item.started or item.handle.stream != stream)
            c.seq_out[stream] = dropped[0].seq
            self._count_sent(c, -sum(v.nbytes for item in dropped for v in item.views))

    def _count_sent(self, c: Connection, nbytes: int) -> None:
        """Count bytes queued on `c` (negative: taken back) in the transport's figures."""
        self.bytes_sent += nbytes

    def _conn_for(self, peer: int, stream: int) -> Connection | None:
        """The connection frames of `stream` to `peer` travel on."""
        return self._conns.get(peer)

    def _flush(self, c: Connection, op: str) -> int:
        """Send as much of c's queue as the socket takes now; the bytes sent."""
        total = 0
        while c.out:
            iov: list[memoryview] = []
            offered = 0  # no more than a socket takes at once: a long queue is not walked on every call
            for item in c.out:
                for v in item.views:
                    iov.append(v)
                    offered += v.nbytes
                if len(iov) >= MAX_IOV or offered >= FLUSH_BYTES:
                    break
            if len(iov) > MAX_IOV:
                offered -= sum(v.nbytes for v in iov[MAX_IOV:])
                iov = iov[:MAX_IOV]
            try:
                sent = c.sock.sendmsg(iov)
            except BlockingIOError:
                break
            except OSError as e:
                self._lost(c, f"sending failed: {e.strerror or e}")
                raise PeerLost(c.peer, op, c.closed) from None
            total += sent
            full = sent < offered
            while c.out:
                item = c.out[0]
                while item.views and sent >= item.views[0].nbytes:
                    sent -= item.views[0].nbytes
                    item.views.pop(0)
                    item.started = True
                if item.views:
                    if sent:
                        item.views[0] = item.views[0][sent:]
                        item.started = True
                    break
                item.handle.done = True
                c.out.popleft()
            if full:
                break
        want = bool(c.out)
        if want != c.writing and c.closed is None and c.polled:
            self._poller.modify(c.fd, select.POLLIN | (select.POLLOUT if want else 0))
            c.writing = want
        return total

    # --- receiving ---------------------------------------------------------------------------

    def _progress(self, deadline: float, waiting: Iterable[Handle], op: str) -> None:
        sent, ended = 0, False
        for c in self._conns.values():
            if c.out and c.closed is None and not c.pump_writes:
                try:
                    sent += self._flush(c, op)
                except PeerLost:
                    ended = True  # marked lost: raised below if what we wait for needs it, else on reading
        if self._closed:
            for h in waiting:  # a peer that is gone cannot complete what we wait for
                c = self._conns.get(h.peer)
                if c is not None and c.closed is not None and not h.done:
                    raise PeerLost(h.peer, op, c.closed)
        events = self._poller.poll(0)
        if not events and not sent and not ended:  # nothing moved: sleep until something can
            left = deadline - time.monotonic()
            if left <= 0:
                return
            events = self._poller.poll(max(1, int(min(left, 1.0) * 1000)))
        for fd, ev in events:
            c = self._by_fd[fd]
            if ev & select.POLLOUT and not c.pump_writes:
                self._flush(c, op)
            if ev & (select.POLLIN | select.POLLHUP | select.POLLERR) and not c.pump_reads:
                self._read(c, op)

    def _read(self, c: Connection, op: str, exact: bool = False) -> None:
        """Read and deliver everything c's socket has now; with `exact`, only up to the
        end of the frame c is in, so that the next frame stays in the socket."""
        try:
            while c.closed is None:
                if c.dest is not None:  # a payload, straight into its buffer
                    n = c.sock.recv_into(c.dest[c.dest_pos:])
                    if n == 0:
                        return self._eof(c, op)
                    c.dest_pos += n
                    if c.dest_pos == c.dest.nbytes:
                        self._payload_done(c, op)
                    continue
                if c.skip:
                    n = c.sock.recv_into(c.rbuf, min(c.skip, len(c.rbuf)))
                    if n == 0:
                        return self._eof(c, op)
                    c.skip -= n
                    continue
                while c.dest is None and not c.skip and self._parse(c, op):
                    pass
                if c.dest is not None or c.skip:
                    continue
                if exact and self._at_boundary(c):
                    return
                if c.rstart == c.rend:
                    c.rstart = c.rend = 0
                elif c.rend == len(c.rbuf):  # keep the partial frame, make room after it
                    c.rbuf[:c.rend - c.rstart] = c.rbuf[c.rstart:c.rend]
                    c.rend -= c.rstart
                    c.rstart = 0
                # A bounded read: the bytes after a Data header should land in their own
                # buffer, not here (where they would be copied once more).
                n = c.sock.recv_into(memoryview(c.rbuf)[c.rend:c.rend + (self._need(c) if exact else READ_AHEAD)])
                if n == 0:
                    return self._eof(c, op)
                c.rend += n
        except (BlockingIOError, InterruptedError):
            return
        except ProtocolError as e:
            self._lost(c, str(e))
            raise e.at(c.name, op) from None
        except OSError as e:
            self._lost(c, f"reading failed: {e.strerror or e}")
            raise PeerLost(c.peer, op, c.closed) from None

    @staticmethod
    def _at_boundary(c: Connection) -> bool:
        return c.header is None and c.dest is None and not c.skip and c.rstart == c.rend

    @staticmethod
    def _need(c: Connection) -> int:
        """The bytes c's read buffer lacks for `_parse` to take the next step."""
        avail = c.rend - c.rstart
        if c.header is None:
            return HEADER_SIZE - avail
        return (DATA_HEADER.size if c.header.msg_type is MsgType.DATA else c.header.length) - avail

    def _to_boundary(self, c: Connection, op: str, deadline: float) -> None:
        """Read and deliver the rest of the frame c is in the middle of, and nothing after it."""
        poller = select.poll()
        poller.register(c.fd, select.POLLIN)
        while True:
            self._read(c, op, exact=True)
            if c.closed is not None:
                raise PeerLost(c.peer, op, c.closed)
            if self._at_boundary(c):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise DTMError(E.TIMEOUT, f"{op} on rank {self.rank}: waited {self.timeout:.1f} s for the rest of a "
                                          f"frame from {c.name}")
            poller.poll(max(1, int(min(left, 1.0) * 1000)))

    def _parse(self, c: Connection, op: str) -> bool:
        """Take one frame (or the start of a large payload) from c's read buffer; False
        when more bytes are needed first."""
        avail = c.rend - c.rstart
        buf = memoryview(c.rbuf)
        if c.header is None:
            if avail < HEADER_SIZE:
                return False
            try:
                h = decode_header(buf[c.rstart:c.rstart + HEADER_SIZE], max_payload=self.max_payload,
                                  expected_epoch=self.epoch, expected_version=c.version)
            except StaleEpochError as e:
                log.warning("rank %d: dropped a frame from %s: %s", self.rank, c.name, e)
                c.skip = int.from_bytes(c.rbuf[c.rstart + 16:c.rstart + 24], "little")
                c.rstart += HEADER_SIZE
                take = min(c.skip, c.rend - c.rstart)
                c.rstart += take
                c.skip -= take
                return True
            want = c.seq_in[h.stream]
            if h.seq != want:
                raise ProtocolError(E.OUT_OF_SEQUENCE, f"{h.msg_type.name} frame on stream {h.stream} has seq {h.seq}, "
                                                       f"expected {want}")
            c.seq_in[h.stream] = want + 1
            c.header = h
            c.rstart += HEADER_SIZE
            avail -= HEADER_SIZE
        h = c.header
        if h.msg_type is MsgType.DATA:
            if avail < DATA_HEADER.size:
                return False
            if h.length < DATA_HEADER.size:
                raise ProtocolError(E.BAD_PAYLOAD, f"a Data frame of {h.length} bytes is shorter than its "
                                                   f"{DATA_HEADER.size}-byte chunk header")
            fields = DATA_HEADER.unpack_from(c.rbuf, c.rstart)
            nbytes = fields[4]
            if nbytes != h.length - DATA_HEADER.size:
                raise ProtocolError(E.BAD_PAYLOAD, f"a Data chunk header says {nbytes} bytes, the frame holds "
                                                   f"{h.length - DATA_HEADER.size}")
            c.chunk_header = fields
            c.rstart += DATA_HEADER.size
            avail -= DATA_HEADER.size
            target = self._target(c.peer, h.stream)
            c.direct = target is not None and target.buf.nbytes == nbytes
            c.dest = target.buf if c.direct else _fresh(nbytes)
        elif h.length <= len(c.rbuf) - HEADER_SIZE:  # small: wait until it is all in the read buffer
            if avail < h.length:
                if c.rstart + h.length > len(c.rbuf):
                    c.rbuf[:avail] = c.rbuf[c.rstart:c.rend]
                    c.rstart, c.rend = 0, avail
                return False
            payload = bytes(c.rbuf[c.rstart:c.rstart + h.length])
            c.rstart += h.length
            c.header = None
            verify_payload(h, payload)
            self._control_frame(c, h, payload)
            return True
        else:
            c.direct = False
            c.dest = _fresh(h.length)
        take = min(avail, c.dest.nbytes)
        c.dest[:take] = buf[c.rstart:c.rstart + take]
        c.rstart += take
        c.dest_pos = take
        if take == c.dest.nbytes:
            self._payload_done(c, op)
        return True

    def _payload_done(self, c: Connection, op: str) -> None:
        h, dest = c.header, c.dest
        c.header, c.dest, c.dest_pos = None, None, 0
        if h.msg_type is MsgType.DATA:
            seq, chunk, _step, _offset, nbytes = c.chunk_header
            verify_payload(h, [DATA_HEADER.pack(*c.chunk_header), dest])
            if h.flags & FLAG_COMPRESSED:
                check_chunk(dest)  # E0910 when its block count disagrees with its length (spec 9.5.1)
            self._deliver_data(c.peer, h.stream, seq, chunk, nbytes, None if c.direct else dest, h.flags & 0x0F)
        else:
            verify_payload(h, dest)
            self._control_frame(c, h, bytes(dest))

    def _control_frame(self, c: Connection, h: FrameHeader, payload: bytes) -> None:
        if h.msg_type is MsgType.LEAVE:
            c.left = True
            log.info("rank %d: %s left the mesh: %s", self.rank, c.name, decode_message(h, payload).reason)
            return
        self._deliver_control(c.peer, h.msg_type, h.stream, payload)

    def _eof(self, c: Connection, op: str) -> None:
        if c.left:
            self._lost(c, "it left the mesh")
            return
        self._lost(c, "the failure detector declared it lost" if c.severed else
                   "its connection closed without Leave: the process ended or was killed")
        raise PeerLost(c.peer, op, c.closed)

    def _lost(self, c: Connection, why: str) -> None:
        if c.closed is None:
            c.closed = why
            self._closed += 1
            if c.polled:
                self._poller.unregister(c.fd)
            c.sock.close()

    def ended(self, peer: int) -> str | None:
        """Why the connection to `peer` ended (it left, died, was severed); None while it is open."""
        c = self._conns.get(peer)
        return None if c is None else c.closed

    def sever(self, peer: int) -> None:
        """The failure detector's word (safe from any thread) that `peer` is gone, e.g. stuck
        with its socket still open: shut its connection down, so whatever waits for it ends
        with PeerLost now, not at the timeout."""
        c = self._conns.get(peer)
        if c is not None and c.closed is None:
            c.severed = True
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # --- ring passes in C (pump.py) -------------------------------------------------------------

    def ring_pass(self, left: int, right: int, stream: int, seq: int, start: bytes, work: np.ndarray,
                  first: Sequence[tuple[int, int]], plan: Sequence[RingReceive], op: str, n: int, what: str,
                  finished: np.ndarray | None = None, finished_base: int = 0) -> bool:
        """Run one ring pass in `ring_pump.c` (see `Transport.ring_pass`).

        The pump takes the left connection at a frame boundary (Python first reads the rest
        of any frame it is in, exactly) with the Data frames of this collective that
        already arrived, and the right one with nothing queued. While it runs, Python keeps
        off what it does (reading the left, writing the right: `pump_reads`, `pump_writes`)
        and, between its calls, serves the rest, the right connection's reading included
        (a Cancel or Error from that neighbour ends the pump's call), checks
        the deadline, and takes each frame the pump hands back (a control frame, or one it
        did not expect), exactly as `_read` would. On any error the pump's half-sent and
        half-read frames become Python's, so the connections stay in step (`_PumpedPass`)."""
        fits = pump.can_run(op, work.dtype, any(r.reduce for r in plan), None if finished is None else finished.dtype)
        loaded = pump.ring_pump() if fits else None
        return self._pumped(loaded, left, right, stream, seq, start, what, lambda: pump.RingPassState(work, first, plan),
                            op, n, finished, finished_base)

    def compressed_ring_pass(self, left: int, right: int, stream: int, seq: int, start: bytes, work: np.ndarray,
                             first: Sequence[tuple[int, int]], plan: Sequence[RingReceive], codec, mode: str,
                             what: str, recv_arena: np.ndarray, send_arena: np.ndarray) -> bool:
        """Run one compressed ring pass (spec 9.5.1) in `ring_pump.c` with the codec inside
        its loop (`pump.CompressedPassState`): `algorithms.compressed_ring`'s frames and
        bits, taken over and given back as `ring_pass` does."""
        if codec.lib is None or work.dtype != np.float32:
            return False
        return self._pumped(pump.compressed_ring_pump(), left, right, stream, seq, start, what,
                            lambda: pump.CompressedPassState(work, first, plan, codec, mode, recv_arena, send_arena),
                            "sum", 0, None, 0, codec=codec)

    def _pumped(self, loaded, left: int, right: int, stream: int, seq: int, start: bytes, what: str, make,
                op: str, n: int, finished: np.ndarray | None, finished_base: int, codec=None) -> bool:
        """A ring pass in the pump `loaded` (None: it cannot run) on the connections to `left`
        and `right`, with the state `make()` builds; False where it cannot run here."""
        cl, cr = self._conns.get(left), self._conns.get(right)
        if (loaded is None or cl is None or cr is None or not (cl.polled and cr.polled) or cr.out
                or cl.closed is not None or cr.closed is not None):
            return False
        fn, crc = loaded
        deadline = time.monotonic() + self.timeout
        self._to_boundary(cl, what, deadline)
        ring = make()
        tmp = self._pump_scratch(ring.largest_receive())
        prefix = self._pump_prefix(cr, stream, start)
        ring.begin(left=cl.fd, right=cr.fd, crc=crc, op=op, n=n, stream=stream, epoch=self.epoch, seq=seq,
                   out_version=cr.version, in_version=cl.version, prefix=prefix, tmp=tmp, finished=finished,
                   finished_base=finished_base)
        _PumpedPass(self, ring, cl, cr, stream, what, deadline, codec).run(fn)
        return True

    def _pump_scratch(self, nbytes: int) -> np.ndarray:
        """The pump's receive buffer for the chunks it reduces, kept for the next pass (fresh
        pages cost more than reusing these)."""
        if self._pump_tmp.nbytes < nbytes:
            self._pump_tmp = np.empty(nbytes, np.uint8)
        return self._pump_tmp

    def _pump_prefix(self, cr: Connection, stream: int, start: bytes) -> bytes:
        """The CollectiveStart frame the pump sends to `cr` before its first Data frame,
        numbered and counted as `send` would."""
        prefix = encode_header(MsgType.COLLECTIVE_START, [start], epoch=self.epoch, stream=stream,
                               seq=cr.seq_out[stream], version=cr.version) + start
        cr.seq_out[stream] += 1
        self._count_sent(cr, len(prefix))
        return prefix

    # --- closing -------------------------------------------------------------------------------

    def _push_until(self, done: Callable[[], bool]) -> None:
        """Drive the transport while closing until `done()`, for at most the timeout (a
        second once it has failed); errors only end the connections they concern."""
        deadline = time.monotonic() + (self.timeout if self.failed is None else 1.0)
        while not done() and time.monotonic() < deadline:
            try:
                self._progress(deadline, (), "close")
            except DTMError:
                pass

    def close(self) -> None:
        """Say Leave to every peer, push what is queued (bounded by the timeout), close."""
        leave = Leave(self.rank, "closed").parts()
        handles = []
        for c in self._conns.values():
            if c.closed is None:
                try:
                    handles.append(self.send(c.peer, 0, MsgType.LEAVE, leave))
                except DTMError:
                    pass
        # A peer that is gone (a lost rank, when the others go on without it) takes no Leave:
        # waiting for it would hold this rank until the timeout.
        self._push_until(lambda: all(h.done or self._conns[h.peer].closed is not None for h in handles))
        for c in self._conns.values():
            if c.closed is None:
                try:
                    c.sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                self._lost(c, "this rank closed the connection")


# --- a ring pass in C: Python's part between the pump's calls -----------------------------------

class _PumpedPass:
    """One ring pass that ring_pump.c runs on two connections of `transport` (see
    `TcpTransport.ring_pass`), and Python's part in it: between the pump's calls it serves
    each status the pump returns, and on an error it takes both connections back. A class
    of its own so that the pass's state (`ring`, the neighbours, the deadline) lives in one
    place rather than in every method's arguments; it reaches into the transport as the
    transport's own methods would."""

    def __init__(self, transport: TcpTransport, ring: pump.RingPassState, cl: Connection, cr: Connection,
                 stream: int, what: str, deadline: float, codec=None):
        self.transport, self.ring, self.cl, self.cr = transport, ring, cl, cr
        self.stream, self.what, self.deadline, self.codec = stream, what, deadline, codec
        self.watched = -1  # the transport's count of closed connections when the watch list was made

    def run(self, fn: ctypes._CFuncPtr) -> None:
        """Call the pump (`fn`) until the pass is done, serving each status it returns."""
        cl, cr = self.cl, self.cr
        cl.pump_reads = cr.pump_writes = True
        self.transport.pump_runs += 1
        try:
            while True:
                self._prepare_call()
                status = self._call(fn)
                if status == pump.DONE:
                    return
                self._serve(status)
        except BaseException:
            self._hand_back()
            raise
        finally:
            cl.pump_reads = cr.pump_writes = False

    def _prepare_call(self) -> None:
        """Before each call: never hand the pump a closed socket's number, tell it which
        other sockets to watch, and give it what Python read of this collective."""
        t, ring = self.transport, self.ring
        for c, needed in ((self.cl, ring.receiving()), (self.cr, ring.sending())):
            if needed and c.closed is not None:
                self._neighbour_gone(c)
        if self.watched != t._closed:  # the other sockets: a readable one ends the pump's call
            ring.watch([c.fd for c in t._conns.values() if c.polled and c.closed is None and c is not self.cl])
            self.watched = t._closed
        self._take_early()

    def _take_early(self) -> None:
        """Give the pump the Data frames of this collective that Python has read (and
        checked) already, as the payloads of its next receives."""
        t, ring, s = self.transport, self.ring, self.ring.state
        stash = t._unexpected.get((self.cl.peer, self.stream))
        j = s.rh
        while stash:
            got_seq, got_chunk, payload, got_flags = stash.popleft()
            t._unexpected_bytes -= len(payload)
            into = ring.receive_view(j) if j < len(ring.pre) else memoryview(b"")
            t._check_chunk(Handle(self.cl.peer, self.stream, "recv", into, s.coll_seq, j, flags=s.data_flags),
                           got_seq, got_chunk, len(payload), got_flags)
            ring.take(j, np.frombuffer(payload, np.uint8))
            j += 1

    def _call(self, fn: ctypes._CFuncPtr) -> int:
        """One call of the pump: the connections' frame numbers go in and come back, and
        the bytes it moved are counted in the transport's figures."""
        t, cl, cr, s, stream = self.transport, self.cl, self.cr, self.ring.state, self.stream
        s.seq_in, s.seq_out = cl.seq_in[stream], cr.seq_out[stream]
        status = self.ring.call(fn)
        cl.seq_in[stream], cr.seq_out[stream] = s.seq_in, s.seq_out
        t._count_sent(cr, s.bytes_out)
        t.bytes_received += s.bytes_in
        s.bytes_out = s.bytes_in = 0
        return status

    def _serve(self, status: int) -> None:
        """What a call that did not finish the pass asks of Python."""
        if status == pump.HANDOFF:
            self._take_handoff()
        elif status == pump.YIELD:
            self._serve_others()
        elif status == pump.LEFT_CLOSED:  # Python reads the end itself: Leave, Error, or a death
            self._neighbour_gone(self.cl)
        elif status in (pump.LEFT_ERROR, pump.RIGHT_ERROR):
            self._socket_failed(status)
        elif status == pump.BAD_CHUNK:
            self._bad_chunk()
        else:
            self._bad_crc(status)

    def _take_handoff(self) -> None:
        """A frame for Python: its header bytes are in rhdr; Python reads the rest of it,
        and nothing after it, and takes it as `_read` would."""
        t, cl, s = self.transport, self.cl, self.ring.state
        t.pump_handoffs += 1
        head = bytes(s.rhdr[:s.rhlen])
        s.rhlen = 0
        cl.rbuf[:len(head)] = head
        cl.rstart, cl.rend = 0, len(head)
        t._to_boundary(cl, self.what, self.deadline)

    def _serve_others(self) -> None:
        """The pump yielded (its time slice ended, another socket turned readable or a
        signal came): check the deadline and serve every other connection."""
        t = self.transport
        if time.monotonic() >= self.deadline:
            raise DTMError(E.TIMEOUT, f"{self.what} on rank {t.rank}: waited {t.timeout:.1f} s for "
                                      f"{self.cl.name} and {self.cr.name}")
        t._progress(time.monotonic(), (), self.what)

    def _socket_failed(self, status: int) -> None:
        """Reading the left or writing the right socket failed (`state.err`)."""
        t, cl, cr = self.transport, self.cl, self.cr
        c, doing = (cl, "reading") if status == pump.LEFT_ERROR else (cr, "sending")
        if c is cr and cr is not cl:  # what the right neighbour said before it went (Cancel, Error)
            t._read(cr, self.what)
        t._lost(c, f"{doing} failed: {os.strerror(self.ring.state.err)}")
        self._neighbour_gone(c)

    def _bad_crc(self, status: int) -> None:
        """The frame's CRC32C does not match: check it the way Python checks every frame,
        so that the error is the one Python's ring would raise."""
        assert status == pump.BAD_CRC, status
        t, cl, s = self.transport, self.cl, self.ring.state
        try:
            verify_payload(decode_header(bytes(s.rhdr[:HEADER_SIZE]), max_payload=t.max_payload),
                           [bytes(s.rhdr[HEADER_SIZE:]), self.ring.landing()])
        except ProtocolError as e:
            t._lost(cl, str(e))
            raise e.at(cl.name, self.what) from None
        raise AssertionError("ring_pump.c and verify_payload disagree on a CRC32C")

    def _bad_chunk(self) -> None:
        """A compressed chunk whose head is not the one due (its frame was read whole): the
        codec's own check says how, as in Python's ring (E0910 naming the neighbour)."""
        s = self.ring.state
        s.rhlen = s.roff = 0
        got = self.ring.landing() if not s.pre[s.rh] else next(p for p in self.ring.early
                                                               if p.ctypes.data == s.pre[s.rh])
        who = f"compressed {self.ring.mode} from {self.cl.name}"
        self.codec.check(np.frombuffer(got, np.uint8), int(self.ring.recv_count[s.rh]), who)
        raise AssertionError("ring_pump.c and Codec.check disagree on a compressed chunk")

    def _neighbour_gone(self, c: Connection) -> None:
        """A neighbour the pump needs is gone. The peer that saw why has usually said so
        (Error, Cancel): read what the connections hold first, so that its word ends
        the collective, as it would in Python's ring; else PeerLost."""
        self._hand_back()
        self.cl.pump_reads = self.cr.pump_writes = False
        self.transport._progress(time.monotonic(), (), self.what)
        raise PeerLost(c.peer, self.what, c.closed)

    def _hand_back(self) -> None:
        """The pump stops for good mid-collective: queue the rest of its half-sent frame
        (and the CollectiveStart, if it never left) first in Python's queue, and make its
        half-read frame Python's, so both connections stay in step for what follows
        (an Error, a Cancel, Leave). Once: it leaves the pump with nothing in flight."""
        s, cl, cr, stream = self.ring.state, self.cl, self.cr, self.stream
        if cr.closed is None:
            if s.prefix_sent < s.prefix_len:
                item = _Out([memoryview(self.ring.prefix)[s.prefix_sent:]], Handle(cr.peer, stream, "send"),
                            cr.seq_out[stream] - 1)
                item.started = s.prefix_sent > 0
                cr.out.appendleft(item)
            elif s.soff:
                frame = memoryview(bytes(s.shdr))
                views = [frame[s.soff:]] if s.soff < pump.FRAMING else []
                views.append(self.ring.sending_payload()[max(0, s.soff - pump.FRAMING):])
                item = _Out(views, Handle(cr.peer, stream, "send"), s.seq_out - 1)
                item.started = True
                cr.out.appendleft(item)
        if cl.closed is None and s.rhlen:
            if s.rhlen < pump.FRAMING or not s.roff:  # only header bytes: Python parses them again
                if s.rhlen >= HEADER_SIZE:
                    cl.seq_in[stream] -= 1
                cl.rbuf[:s.rhlen] = bytes(s.rhdr[:s.rhlen])
                cl.rstart, cl.rend = 0, s.rhlen
            else:  # in the payload: Python reads the rest into a buffer of its own, then checks it
                cl.header = decode_header(bytes(s.rhdr[:HEADER_SIZE]), max_payload=self.transport.max_payload)
                cl.chunk_header = DATA_HEADER.unpack(bytes(s.rhdr[HEADER_SIZE:pump.FRAMING]))
                cl.dest = _fresh(s.recv_len[s.rh])
                cl.dest[:s.roff] = self.ring.landing()[:s.roff]
                cl.dest_pos, cl.direct = s.roff, False
        s.prefix_sent, s.soff, s.rhlen, s.roff = s.prefix_len, 0, 0, 0


# --- forming the mesh -------------------------------------------------------------------------------

class PendingHandshake:
    """A connection in its handshake; frames are read exactly, so bytes after the last
    Hello stay in the socket for the transport (or the store connection) that takes it."""

    def __init__(self, sock: socket.socket, hs: Handshake, deadline: float, addr: str, target: int | None):
        self.sock, self.hs, self.deadline, self.addr, self.target = sock, hs, deadline, addr, target
        self.inbuf = bytearray()
        self.header: FrameHeader | None = None
        self.out = bytearray()
        self.connected = target is None  # an outgoing connect may still be in progress

    def need(self) -> int:
        return HEADER_SIZE - len(self.inbuf) if self.header is None else self.header.length - len(self.inbuf)


def connect_mesh(rank: int, world_size: int, addresses: Sequence[tuple[str, int]], token: bytes | str, *,
                 listener: socket.socket | None = None, timeout: float = DEFAULT_TIMEOUT_S, epoch: int = 0,
                 max_payload: int = MAX_PAYLOAD, transport_class: type = TcpTransport, **kw) -> TcpTransport:
    """Connect rank `rank` to every other rank: it listens at addresses[rank] (or on
    `listener`, already bound there), connects to each lower rank and accepts each higher
    one, all authenticated with `token`. Returns once every connection is up, the listener
    closed (a connection after that is refused by the kernel, never accepted and left
    unread); TIMEOUT after `timeout` seconds naming the ranks that did not come."""
    token = token.encode() if isinstance(token, str) else token
    if len(addresses) != world_size:
        raise DTMError(E.INVALID_GROUP, f"{len(addresses)} addresses for a world of {world_size} ranks")
    if listener is None and rank < world_size - 1:
        listener = listen(*addresses[rank])
    names = [f"rank {r} at {h}:{p}" for r, (h, p) in enumerate(addresses)]
    start = time.monotonic()
    mesh = _MeshForming(rank, world_size, addresses, names, token, listener, start + timeout, max_payload)
    while len(mesh.done) < world_size - 1:
        now = time.monotonic()
        if now >= mesh.deadline:
            raise mesh.give_up(now - start)
        mesh.start_connects(now)
        mesh.serve(mesh.wait())
        mesh.expire()
    if listener is not None:  # every peer is connected: nobody else may connect (spec 9.6.2)
        listener.close()
    return transport_class(rank, world_size, mesh.done, epoch=epoch, timeout=timeout, max_payload=max_payload,
                           names=names, **kw)


class _MeshForming:
    """`connect_mesh` under way: the connections in their handshake (`pending`), those
    that finished it (`done`, by the peer's rank), and the lower ranks not connected yet,
    with when to try each next (`retry_at`). Every socket is non-blocking; one poll loop
    moves all the handshakes, so a peer that is slow or silent holds up no other."""

    def __init__(self, rank: int, world_size: int, addresses: Sequence[tuple[str, int]], names: Sequence[str],
                 token: bytes, listener: socket.socket | None, deadline: float, max_payload: int):
        self.rank, self.world_size, self.addresses, self.names = rank, world_size, addresses, names
        self.token, self.listener, self.deadline, self.max_payload = token, listener, deadline, max_payload
        self.caps = announced_caps()
        self.done: dict[int, tuple[socket.socket, Handshake]] = {}
        self.pending: list[PendingHandshake] = []
        self.retry_at = {r: 0.0 for r in range(rank)}  # lower ranks to connect to, and when to try next
        if listener is not None:
            listener.setblocking(False)

    def _handshake(self, role: str) -> Handshake:
        return Handshake(role, self.token, level=LEVEL, caps=self.caps, rank=self.rank, name=self.names[self.rank],
                         max_payload=self.max_payload)

    def give_up(self, waited: float) -> DTMError:
        """The deadline passed: close what is in its handshake; the TIMEOUT to raise."""
        for p in self.pending:
            p.sock.close()
        missing = [self.names[r] for r in range(self.world_size) if r != self.rank and r not in self.done]
        return DTMError(E.TIMEOUT, f"forming the mesh, rank {self.rank} waited {waited:.1f} s for "
                                   f"{', '.join(missing)}")

    def start_connects(self, now: float) -> None:
        """Start a connection to each lower rank whose time to try has come."""
        for r, when in list(self.retry_at.items()):
            if when <= now:
                del self.retry_at[r]
                s = socket.socket(socket.AF_INET6 if ":" in self.addresses[r][0] else socket.AF_INET,
                                  socket.SOCK_STREAM)
                s.setblocking(False)
                err = s.connect_ex(tuple(self.addresses[r]))
                p = PendingHandshake(s, self._handshake("connect"), self.deadline, self.names[r], r)
                self.pending.append(p)
                if err not in (0, errno.EINPROGRESS):
                    self._drop(p, OSError(err, "connect failed"))

    def wait(self) -> list[tuple[int, int]]:
        """The (fd, events) of the sockets ready, waiting at most until the next deadline or retry."""
        poller = select.poll()
        if self.listener is not None:
            poller.register(self.listener.fileno(), select.POLLIN)
        for p in self.pending:
            poller.register(p.sock.fileno(), select.POLLIN | (select.POLLOUT if p.out or not p.connected else 0))
        wake = min([self.deadline] + list(self.retry_at.values()) + [p.deadline for p in self.pending])
        return poller.poll(max(0, int((wake - time.monotonic()) * 1000)) + 1)

    def serve(self, events: list[tuple[int, int]]) -> None:
        """Accept the connections waiting, and move the handshake of each ready socket."""
        by_fd = {p.sock.fileno(): p for p in self.pending}  # as polled: an accept may reuse a dropped one's fd
        for fd, ev in events:
            if self.listener is not None and fd == self.listener.fileno():
                self._accept()
                continue
            p = by_fd.get(fd)
            if p is not None and p in self.pending:
                self._advance(p, ev)

    def _accept(self) -> None:
        """Take a connection from a higher rank (or anyone), to go through its handshake;
        past MAX_HANDSHAKING at once, the oldest such one is dropped."""
        try:
            s, addr = self.listener.accept()
        except OSError:
            return
        s.setblocking(False)
        accepted = [q for q in self.pending if q.target is None]
        if len(accepted) >= MAX_HANDSHAKING:
            self._drop(accepted[0], DTMError(E.TIMEOUT, f"more than {MAX_HANDSHAKING} connections in their handshake"))
        hello_by = min(self.deadline, time.monotonic() + HELLO_TIMEOUT_S)
        self.pending.append(PendingHandshake(s, self._handshake("accept"), hello_by, f"{addr[0]}:{addr[1]}", None))

    def _advance(self, p: PendingHandshake, ev: int) -> None:
        """Move p's handshake as far as its socket allows (`ev`: its poll events)."""
        try:
            if not p.connected:
                err = p.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    raise OSError(err, "connect failed")
                p.connected = True
                for frame in p.hs.start():
                    p.out += frame
            if p.out:
                n = p.sock.send(p.out)
                del p.out[:n]
            if ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
                read_handshake(p)
            if p.hs.done and not p.out:
                self._finish(p)
        except BlockingIOError:
            return
        except (ProtocolError, OSError) as e:
            if p.target is not None and isinstance(e, ProtocolError) and e.code is E.AUTH_FAILED:
                try:  # tell the peer why, then give up: this rank cannot join with its token
                    p.sock.send(p.hs.error_frame(e))
                except OSError:
                    pass
                for q in self.pending:
                    q.sock.close()
                raise e.at(self.names[p.target], "forming the mesh") from None
            self._drop(p, e)

    def _finish(self, p: PendingHandshake) -> None:
        """p's handshake is over: keep the connection if the peer is the rank it should be."""
        peer, rank = p.hs.peer.rank, self.rank
        if p.target is not None and peer != p.target:
            raise ProtocolError(E.UNEXPECTED_MESSAGE, f"expected rank {p.target}, the peer says it is rank {peer}")
        if p.target is None and not (rank < peer < self.world_size and peer not in self.done):
            raise ProtocolError(E.UNEXPECTED_MESSAGE, f"a peer claiming rank {peer} connected; rank {rank} accepts "
                                                      f"ranks {rank + 1} to {self.world_size - 1}, once each")
        self.pending.remove(p)
        self.done[peer] = (p.sock, p.hs)

    def expire(self) -> None:
        """Drop the accepted connections that did not finish their handshake in time."""
        for p in [p for p in self.pending if p.target is None and time.monotonic() >= p.deadline]:
            self._drop(p, DTMError(E.TIMEOUT, f"no handshake within {HELLO_TIMEOUT_S:g} s"))

    def _drop(self, p: PendingHandshake, err: Exception) -> None:
        """Close a connection that failed; a lower rank's is tried again a little later."""
        if p.target is None:
            log.warning("rank %d: dropped the connection from %s: %s", self.rank, p.addr, err)
        else:  # usually the peer is not listening yet
            log.debug("rank %d: connecting to %s failed, trying again: %s", self.rank, p.addr, err)
        if isinstance(err, ProtocolError) and p.connected:
            try:
                p.sock.send(p.hs.error_frame(err))
            except OSError:
                pass
        p.sock.close()
        self.pending.remove(p)
        if p.target is not None:  # try that rank again
            self.retry_at[p.target] = time.monotonic() + 0.05


def read_handshake(p: PendingHandshake) -> None:
    """Read what the handshake needs, frame by frame, and answer: until it is done, or the
    non-blocking socket has nothing more (BlockingIOError). Each frame is bounded by 64 KiB
    before anything is allocated for it, whatever `max_payload` this side announces: the
    peer has not proven the token yet. The store service drives its handshakes with it too."""
    while not p.hs.done:
        chunk = p.sock.recv(p.need())
        if not chunk:
            raise OSError(errno.ECONNRESET, "the peer closed the connection during the handshake")
        p.inbuf += chunk
        if p.need():
            continue
        if p.header is None:
            # Handshake frames are small: bound them by the least payload a peer must accept.
            p.header = decode_header(p.inbuf, max_payload=MIN_MAX_PAYLOAD)
            p.inbuf.clear()
            if p.header.length:
                continue
        header, payload = p.header, bytes(p.inbuf)
        p.header = None
        p.inbuf.clear()
        verify_payload(header, payload)
        for frame in p.hs.receive(header, payload):
            p.out += frame
        if p.out:
            n = p.sock.send(p.out)
            del p.out[:n]
