"""One connection of the mesh's store service (spec 9.2.11): the frames of spec 9.1 over a
blocking socket, opened with the three-Hello handshake at level L2 (the peer must announce
CAP_STORE), then StoreRequest / StoreReply messages on stream 0 with a tensor's bytes in
Data frames.

    conn = StoreConnection.connect(("127.0.0.1", port), token, rank=0, epoch=1, timeout=30)
    conn.send(StoreRequest(...), data=array_bytes)       # Data frames follow a put
    reply = conn.receive(deadline, "get")                # the next message
    layout = conn.get_layout(reply, dtype, shape, "get")  # what a get's reply announces, bounded
    a = conn.read_array(reply.id, layout, deadline, "get")  # its bytes, straight into the array

The store's requests come at any moment, unlike a collective, which both sides enter, so
they travel on connections of their own, served by a pool of threads (service.py), and
never queue behind a collective on the mesh's data connections. Every frame's CRC32C is
checked and sequence numbers count 0, 1, 2, ... each way after the handshake's Hellos (spec
9.1.7). Every length is bounded before a buffer is allocated, by what the frame may carry
(spec 9.2.11): a handshake frame, before the peer has proven the token, by 64 KiB
(`MIN_MAX_PAYLOAD`, the coordinator's bound too); every other message but the reply to a
`keys` request by the same; a tensor's Data frames by the bytes its request or reply
announced, and those by what this machine has free.
"""

from __future__ import annotations

import select
import socket
import struct
import time
from collections.abc import Callable, Sequence

import numpy as np

from ..errors import DTMError, ErrorCode as E
from ..ir.dtypes import DType
from ..protocol.caps import Cap, level_caps
from ..protocol.errors import ProtocolError
from ..protocol.frame import HEADER_SIZE, MAX_PAYLOAD, FrameHeader, MsgType, decode_header, verify_payload
from ..protocol.handshake import CONTROL_STREAM, Handshake
from ..protocol.messages import (DATA_HEADER_SIZE, MIN_MAX_PAYLOAD, Data, Error, Message, StoreReply, StoreRequest,
                                 decode_message, frame_parts)
from ..runtime.host import available_bytes
from . import format as fmt
from .store import as_store_dtype

LEVEL = 2                   # the store is level L2 (spec 8.1): CAP_STORE
DATA_CHUNK = 512 << 10      # tensor bytes per Data frame (at most the peer's max_payload): small enough that a
                            # chunk just received is still in L2 when its CRC is checked (1 MiB: 0.44-0.56x
                            # raw TCP on the 2-core Xeon, 512 KiB: 0.78-0.92x; benchmarks/store.py (d))
MAX_IOV = 64                # buffers per sendmsg call
SKIP_BYTES = 1 << 20        # scratch for reading a refused put's bytes
SEND_TIMEOUT_S = 120.0      # a peer that takes none of a frame's bytes for this long is gone: no send waits forever
# The bytes of an error's message in a StoreReply or an Error: the frame's other fields fit in
# the KiB left, so every message but a keys reply stays within MIN_MAX_PAYLOAD (spec 9.2.11).
MESSAGE_BYTES = MIN_MAX_PAYLOAD - 1024
_DATA_HEADER = struct.Struct("<QIIQQ")  # seq, chunk, step, offset, nbytes (spec 9.1.5)


class StoreConnection:
    """A handshaken connection to one peer's store service (either side)."""

    def __init__(self, sock: socket.socket, hs: Handshake, peer: str, epoch: int,
                 send_timeout: float = SEND_TIMEOUT_S):
        self.sock, self.hs, self.peer, self.epoch, self.send_timeout = sock, hs, peer, epoch, send_timeout
        self.version = hs.version
        self.max_send = hs.peer.max_payload
        self.next_in = hs_frames_received(hs)
        self.bytes_received = 0
        self._asked = ""     # the op of the last request sent: what its reply may carry
        self._dropping = 0   # bytes of a refused put still to drop, if its client goes on sending them
        self._readable = select.poll()
        self._readable.register(sock, select.POLLIN)

    # --- opening ------------------------------------------------------------------------------

    @classmethod
    def connect(cls, address: tuple[str, int], token: bytes, *, rank: int, epoch: int, timeout: float,
                peer: str, opened: Callable[[socket.socket], None] | None = None) -> "StoreConnection":
        """Dial `address` and run the connecting side of the handshake. `opened(sock)` is
        called once the socket is connected, before the handshake, so that its owner can
        shut it down from another thread (its peer declared lost) during any wait."""
        try:
            sock = socket.create_connection(address, timeout=timeout)
        except OSError as e:
            raise DTMError(E.PEER_LOST, f"the store of {peer} at {address[0]}:{address[1]} cannot be reached: "
                                        f"{e.strerror or e}") from None
        if opened is not None:
            opened(sock)
        return cls._handshake(sock, "connect", token, rank=rank, epoch=epoch, timeout=timeout, peer=peer)

    @classmethod
    def accept(cls, sock: socket.socket, token: bytes, *, rank: int, epoch: int, timeout: float) -> "StoreConnection":
        """Run the accepting side of the handshake on `sock`, blocking (a peer that serves one
        connection; the service moves many at once without blocking, service.py)."""
        return cls._handshake(sock, "accept", token, rank=rank, epoch=epoch, timeout=timeout, peer="a peer")

    @classmethod
    def _handshake(cls, sock: socket.socket, role: str, token: bytes, *, rank: int, epoch: int, timeout: float,
                   peer: str) -> "StoreConnection":
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hs = store_handshake(role, token, rank)
        deadline = time.monotonic() + timeout
        try:
            for frame in hs.start():
                sock.sendall(frame)
            while not hs.done:
                header, payload = _read_frame(sock, deadline, f"the handshake with {peer}")
                verify_payload(header, payload)
                for frame in hs.receive(header, payload):
                    sock.sendall(frame)
            return cls.proven(sock, hs, peer, epoch, send_timeout=timeout)
        except ProtocolError as err:
            try:
                sock.sendall(hs.error_frame(err))
            except OSError:
                pass
            sock.close()
            raise err.at(peer, "opening a store connection") from None
        except (OSError, DTMError) as err:
            sock.close()
            if isinstance(err, DTMError):
                raise
            raise DTMError(E.PEER_LOST, f"opening a store connection to {peer}: {err.strerror or err}") from None

    @classmethod
    def proven(cls, sock: socket.socket, hs: Handshake, peer: str, epoch: int,
               send_timeout: float = SEND_TIMEOUT_S) -> "StoreConnection":
        """The connection over `sock` once handshake `hs` is done: E0911 unless the peer
        announced CAP_STORE. `peer` names it in errors until its Hello gives its rank."""
        if not hs.peer.caps & Cap.STORE:
            raise ProtocolError(E.UNEXPECTED_MESSAGE, f"{peer} does not announce CAP_STORE: it serves no store")
        sock.setblocking(True)
        return cls(sock, hs, f"rank {hs.peer.rank}" if hs.peer.rank >= 0 else peer, epoch, send_timeout)

    # --- sending ------------------------------------------------------------------------------

    def _stamp(self) -> int:
        seq = self.hs.next_seq
        self.hs.next_seq += 1
        return seq

    def send(self, msg: Message, data: memoryview | None = None) -> None:
        """`msg`'s frame, then `data` (raw bytes) in Data frames numbered by the message's id.
        A request's bytes (a put's) stop as soon as the service has answered: it refused the
        put before reading them (spec 9.2.11), and its reply is what `receive` reads next."""
        if isinstance(msg, StoreRequest):
            self._asked = msg.op
        head = frame_parts(msg, epoch=self.epoch, stream=CONTROL_STREAM, seq=self._stamp(), version=self.version)
        if data is None or not len(data):
            self._sendmsg([memoryview(b).cast("B") for b in head])
            return
        # One frame at a time: each chunk's CRC is computed while the peer reads the last one.
        step = max(1, min(DATA_CHUNK, self.max_send - DATA_HEADER_SIZE))
        for i, off in enumerate(range(0, len(data), step)):
            if i and isinstance(msg, StoreRequest) and self._readable.poll(0):
                return
            chunk = Data(msg.id, i, 0, off, data[off:off + step])
            parts = frame_parts(chunk, epoch=self.epoch, stream=CONTROL_STREAM, seq=self._stamp(), version=self.version)
            self._sendmsg([memoryview(b).cast("B") for b in (*head, *parts)])
            head = ()

    def send_error(self, err: DTMError, rank: int) -> None:
        """An Error frame before this side closes the connection (best effort)."""
        try:
            self._sendmsg([memoryview(b).cast("B") for b in frame_parts(
                Error(err.code.value, fit_message(str(err.message)), rank), epoch=self.epoch, stream=CONTROL_STREAM,
                seq=self._stamp(), version=self.version)])
        except (OSError, DTMError):
            pass

    def _sendmsg(self, views: list[memoryview]) -> None:
        self.sock.settimeout(self.send_timeout)  # each call must move some bytes within it
        try:
            while views:
                sent = self.sock.sendmsg(views[:MAX_IOV])
                while sent and views:
                    n = len(views[0])
                    if sent >= n:
                        sent -= n
                        views.pop(0)
                    else:
                        views[0] = views[0][sent:]
                        sent = 0
        except socket.timeout:
            raise DTMError(E.TIMEOUT, f"sending to the store of {self.peer}: it took no bytes for "
                                      f"{self.send_timeout:g} s") from None
        except OSError as e:
            raise DTMError(E.PEER_LOST, f"sending to the store of {self.peer}: {e.strerror or e}") from None

    # --- receiving ----------------------------------------------------------------------------

    def receive(self, deadline: float, during: str) -> Message:
        """The next message; an Error from the peer is raised as its DTMError. A Data frame
        where a message is due is E0911, refused before its payload is read."""
        return self._message(self._header(deadline, during), deadline, during)

    def next_request(self, deadline: float, during: str) -> Message | None:
        """The service's `receive`: the next message, past the Data frames of a refused put
        that its client still sends (`drop_data`); None when only such frames had come and
        nothing more has yet, so that no thread waits for the client's next request."""
        header = self._header(deadline, during)
        while self._dropping and header.msg_type is MsgType.DATA:
            self._drop(header, deadline, during)
            if not self._readable.poll(0):
                return None
            header = self._header(deadline, during)
        self._dropping = 0  # a message came in their place: the client stopped sending them
        return self._message(header, deadline, during)

    def get_layout(self, reply: StoreReply, dtype: DType | None, shape: tuple[int, ...] | None,
                   during: str) -> fmt.Layout:
        """The layout of the tensor a get's `reply` announces, checked before anything is
        allocated for it (spec 9.2.11): E0910 when it is not a DTM dtype, not the `dtype`
        or `shape` the request named, or `nbytes` is not its size; E1003 when it is more
        than this machine has free. Its Data frames are then left unread: the caller drops
        the connection."""
        what = f"{reply.dtype}{list(reply.shape)}"
        try:
            dt = as_store_dtype(reply.dtype)
        except DTMError:
            raise DTMError(E.BAD_PAYLOAD, f"{during}: {self.peer} answered with {what}, not a DTM dtype") from None
        if (dtype is not None and dt is not dtype) or (shape is not None and tuple(shape) != tuple(reply.shape)):
            asked = f"{dtype.name if dtype else 'any dtype'}{list(shape) if shape is not None else ''}"
            raise DTMError(E.BAD_PAYLOAD, f"{during}: {self.peer} answered with {what}; the request asked for {asked}")
        layout = fmt.plan(dt, tuple(reply.shape))
        if reply.nbytes != layout.nbytes:
            raise DTMError(E.BAD_PAYLOAD, f"{during}: {self.peer} announces {reply.nbytes} bytes for {what}, which "
                                          f"holds {layout.nbytes}")
        free = available_bytes()
        if free is not None and layout.nbytes > free:
            raise DTMError(E.RECEIVE_BUFFER_FULL, f"{during}: {self.peer} announces {what}, {layout.nbytes} bytes; "
                                                  f"this machine has {free} bytes of memory free")
        return layout

    def read_array(self, seq: int, layout: fmt.Layout, deadline: float, during: str) -> np.ndarray:
        """The tensor of transfer `seq`, laid out as `layout` (whose size the caller has
        bounded), read from its Data frames into a buffer of its own."""
        buf = np.empty(layout.storage_shape, layout.storage_dtype)
        self.read_data(seq, memoryview(buf.reshape(-1).view(np.uint8)), deadline, during)
        return fmt.from_storage(buf, layout.dtype)

    def read_data(self, seq: int, out: memoryview, deadline: float, during: str) -> None:
        """Fill `out` from the Data frames of transfer `seq`, each read straight into it and
        checked (CRC32C, seq, offset) before the next."""
        filled = 0
        for chunk in range(1 << 62):
            if filled == len(out):
                return
            header = self._header(deadline, during)
            if header.msg_type is not MsgType.DATA:
                msg = self._message(header, deadline, during)
                raise ProtocolError(E.UNEXPECTED_MESSAGE, f"{during}: a {type(msg).__name__} from {self.peer} where "
                                                          f"Data of transfer {seq} was due")
            if header.length < DATA_HEADER_SIZE:
                raise ProtocolError(E.BAD_PAYLOAD, f"{during}: a Data payload of {header.length} bytes from "
                                                   f"{self.peer}, the chunk header alone is {DATA_HEADER_SIZE}")
            head = _recv_exact(self.sock, DATA_HEADER_SIZE, deadline, during, self.peer)
            got_seq, got_chunk, _step, offset, nbytes = _DATA_HEADER.unpack(head)
            if nbytes != header.length - DATA_HEADER_SIZE:
                raise ProtocolError(E.BAD_PAYLOAD, f"{during}: a Data chunk header from {self.peer} says {nbytes} "
                                                   f"bytes, its frame holds {header.length - DATA_HEADER_SIZE}")
            if (got_seq, got_chunk, offset) != (seq, chunk, filled) or filled + nbytes > len(out):
                raise ProtocolError(E.BAD_PAYLOAD, f"{during}: Data from {self.peer} for transfer {got_seq} chunk "
                                                   f"{got_chunk} at byte {offset} ({nbytes} bytes); expected transfer "
                                                   f"{seq} chunk {chunk} at byte {filled}, {len(out) - filled} bytes "
                                                   "left")
            dest = out[filled:filled + nbytes]
            _recv_into(self.sock, dest, deadline, during, self.peer)
            verify_payload(header, [head, dest])
            filled += nbytes
            self.bytes_received += nbytes

    def drop_data(self, nbytes: int) -> None:
        """This side refused a put of `nbytes` and answered before reading them: the Data
        frames of it that its client still sends are read and dropped by `next_request` (a DTM
        client stops sending them once it has the answer; spec 9.2.11)."""
        self._dropping = nbytes

    def _drop(self, header: FrameHeader, deadline: float, during: str) -> None:
        """Read and drop one Data frame of a refused put: no CRC check, its seq was checked."""
        if not DATA_HEADER_SIZE <= header.length <= self._dropping + DATA_HEADER_SIZE:
            raise ProtocolError(E.BAD_PAYLOAD, f"{during}: a Data frame of {header.length} bytes from {self.peer} "
                                               f"where at most {self._dropping} bytes of a refused put were due")
        scratch = memoryview(bytearray(min(header.length, SKIP_BYTES)))
        body = header.length
        while body:
            n = min(body, len(scratch))
            _recv_into(self.sock, scratch[:n], deadline, during, self.peer)
            body -= n
        self._dropping -= header.length - DATA_HEADER_SIZE

    def _message(self, header: FrameHeader, deadline: float, during: str) -> Message:
        """The message of the frame whose `header` was just read; an Error is raised as its
        DTMError, and a Data frame is E0911."""
        if header.msg_type is MsgType.DATA:
            raise ProtocolError(E.UNEXPECTED_MESSAGE, f"{during}: a Data frame from {self.peer} where a message "
                                                      "was due")
        payload = _recv_exact(self.sock, header.length, deadline, during, self.peer)
        verify_payload(header, payload)
        msg = decode_message(header, payload)
        if isinstance(msg, Error):
            raise DTMError(msg.known_code(), f"the store of {self.peer} reported {msg.code} during {during}: "
                                             f"{msg.message}")
        return msg

    def _header(self, deadline: float, during: str) -> FrameHeader:
        """The next frame's header, its length bounded before anything is read for it: a Data
        frame's by the max_payload this side announced (its bytes go into a buffer that its
        request or reply bounded, or are dropped), any other frame's by `_limit()`."""
        raw = _recv_exact(self.sock, HEADER_SIZE, deadline, during, self.peer)
        header = decode_header(raw, max_payload=MAX_PAYLOAD, expected_epoch=self.epoch, expected_version=self.version)
        limit = self._limit()
        if header.msg_type is not MsgType.DATA and header.length > limit:
            raise ProtocolError(E.FRAME_TOO_LARGE, f"{during}: a {header.msg_type.name} frame of {header.length} "
                                                   f"bytes from {self.peer}; a message here fits in {limit}")
        if header.seq != self.next_in:
            raise ProtocolError(E.OUT_OF_SEQUENCE, f"{during}: frame seq {header.seq} from {self.peer}, expected "
                                                f"{self.next_in}")
        self.next_in += 1
        return header

    def _limit(self) -> int:
        """The longest message the peer may send now (spec 9.2.11): the reply to a keys
        request lists up to this side's max_payload of keys; a request, any other reply and
        an Error fit in MIN_MAX_PAYLOAD."""
        return MAX_PAYLOAD if self._asked == "keys" else MIN_MAX_PAYLOAD

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def hs_frames_received(hs: Handshake) -> int:
    """How many frames the peer sent during the handshake: its next seq on stream 0."""
    return 2 if hs.role == "accept" else 1


def store_handshake(role: str, token: bytes, rank: int) -> Handshake:
    """One side of a store connection's handshake: level L2, whose capabilities include
    CAP_STORE."""
    return Handshake(role, token, level=LEVEL, caps=int(level_caps(LEVEL)), rank=rank, name=f"store of rank {rank}",
                     max_payload=MAX_PAYLOAD)


def fit_message(text: str) -> str:
    """`text` cut to MESSAGE_BYTES of UTF-8, never inside a character: what an error's
    message in a StoreReply or an Error may hold."""
    return text.encode("utf-8", "replace")[:MESSAGE_BYTES].decode("utf-8", "ignore")


def _read_frame(sock: socket.socket, deadline: float, during: str) -> tuple[FrameHeader, bytes]:
    """One frame of the handshake, its length bounded by MIN_MAX_PAYLOAD before anything is
    allocated for it, whatever max_payload this side announces: the peer has not proven the
    token yet (spec 9.1.9; the coordinator's bound too)."""
    header = decode_header(_recv_exact(sock, HEADER_SIZE, deadline, during, "the peer"), max_payload=MIN_MAX_PAYLOAD)
    return header, _recv_exact(sock, header.length, deadline, during, "the peer")


def _recv_exact(sock: socket.socket, n: int, deadline: float, during: str, peer: str) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf), deadline, during, peer)
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview, deadline: float, during: str, peer: str) -> None:
    got = 0
    while got < len(view):
        left = deadline - time.monotonic()
        if left <= 0:
            raise DTMError(E.TIMEOUT, f"{during}: waited for {peer}'s store past the deadline "
                                      f"({got} of {len(view)} bytes came)")
        sock.settimeout(left)
        try:
            n = sock.recv_into(view[got:])
        except socket.timeout:
            continue
        except OSError as e:
            raise DTMError(E.PEER_LOST, f"{during}: the connection to {peer}'s store failed: {e.strerror or e}") \
                from None
        if n == 0:
            raise DTMError(E.PEER_LOST, f"{during}: {peer}'s store closed the connection")
        got += n


__all__: Sequence[str] = ["StoreConnection", "LEVEL", "store_handshake", "fit_message"]
