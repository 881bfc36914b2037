"""One connection of the mesh's store service (spec 9.2.11): the frames of spec 9.1 over a
blocking socket, opened with the three-Hello handshake at level L2 (the peer must announce
CAP_STORE), then StoreRequest / StoreReply messages on stream 0 with a tensor's bytes in
Data frames.

    conn = StoreConnection.connect(("127.0.0.1", port), token, rank=0, epoch=1, timeout=30)
    conn.send(StoreRequest(...), data=array_bytes)       # Data frames follow a put
    reply = conn.receive(deadline)                       # the next message
    conn.read_data(reply.id, out_bytes, deadline)        # a get's bytes, straight into `out`

The store's requests come at any moment, unlike a collective, which both sides enter, so
they travel on connections of their own, served by a thread per connection (service.py),
and never queue behind a collective on the mesh's data connections. Every frame's CRC32C
is checked, every length bounded before a buffer is allocated, and sequence numbers count
0, 1, 2, ... each way after the handshake's Hellos (spec 9.1.7).
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Sequence

from ..errors import DTMError, ErrorCode as E
from ..protocol.caps import Cap, level_caps
from ..protocol.errors import ProtocolError
from ..protocol.frame import HEADER_SIZE, MAX_PAYLOAD, FrameHeader, MsgType, decode_header, verify_payload
from ..protocol.handshake import CONTROL_STREAM, Handshake
from ..protocol.messages import DATA_HEADER_SIZE, Data, Error, Message, decode_message, frame_parts

LEVEL = 2                   # the store is level L2 (spec 8.1): CAP_STORE
DATA_CHUNK = 512 << 10      # tensor bytes per Data frame (at most the peer's max_payload): small enough that a
                            # chunk just received is still in L2 when its CRC is checked (1 MiB: 0.44-0.56x
                            # raw TCP on the 2-core Xeon, 512 KiB: 0.78-0.92x; benchmarks/store.py (d))
MAX_IOV = 64                # buffers per sendmsg call
SKIP_BYTES = 1 << 20        # scratch for reading a refused put's bytes
_DATA_HEADER = struct.Struct("<QIIQQ")  # seq, chunk, step, offset, nbytes (spec 9.1.5)


class StoreConnection:
    """A handshaken connection to one peer's store service (either side)."""

    def __init__(self, sock: socket.socket, hs: Handshake, peer: str, epoch: int):
        self.sock, self.hs, self.peer, self.epoch = sock, hs, peer, epoch
        self.version = hs.version
        self.max_send = hs.peer.max_payload
        self.next_in = hs_frames_received(hs)
        self.bytes_received = 0

    # --- opening ------------------------------------------------------------------------------

    @classmethod
    def connect(cls, address: tuple[str, int], token: bytes, *, rank: int, epoch: int, timeout: float,
                peer: str) -> "StoreConnection":
        """Dial `address` and run the connecting side of the handshake."""
        try:
            sock = socket.create_connection(address, timeout=timeout)
        except OSError as e:
            raise DTMError(E.PEER_LOST, f"the store of {peer} at {address[0]}:{address[1]} cannot be reached: "
                                        f"{e.strerror or e}") from None
        return cls._handshake(sock, "connect", token, rank=rank, epoch=epoch, timeout=timeout, peer=peer)

    @classmethod
    def accept(cls, sock: socket.socket, token: bytes, *, rank: int, epoch: int, timeout: float) -> "StoreConnection":
        return cls._handshake(sock, "accept", token, rank=rank, epoch=epoch, timeout=timeout, peer="a peer")

    @classmethod
    def _handshake(cls, sock: socket.socket, role: str, token: bytes, *, rank: int, epoch: int, timeout: float,
                   peer: str) -> "StoreConnection":
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hs = Handshake(role, token, level=LEVEL, caps=int(level_caps(LEVEL)), rank=rank,
                       name=f"store of rank {rank}", max_payload=MAX_PAYLOAD)
        deadline = time.monotonic() + timeout
        conn = None
        try:
            for frame in hs.start():
                sock.sendall(frame)
            while not hs.done:
                header, payload = _read_frame(sock, deadline, MAX_PAYLOAD, None, f"the handshake with {peer}")
                verify_payload(header, payload)
                for frame in hs.receive(header, payload):
                    sock.sendall(frame)
            if not hs.peer.caps & Cap.STORE:
                raise ProtocolError(E.UNEXPECTED_MESSAGE, f"{peer} does not announce CAP_STORE: it serves no store")
            conn = cls(sock, hs, f"rank {hs.peer.rank}" if hs.peer.rank >= 0 else peer, epoch)
            return conn
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

    # --- sending ------------------------------------------------------------------------------

    def _stamp(self) -> int:
        seq = self.hs.next_seq
        self.hs.next_seq += 1
        return seq

    def send(self, msg: Message, data: memoryview | None = None) -> None:
        """`msg`'s frame, then `data` (raw bytes) in Data frames numbered by the message's id."""
        head = frame_parts(msg, epoch=self.epoch, stream=CONTROL_STREAM, seq=self._stamp(), version=self.version)
        if data is None or not len(data):
            self._sendmsg([memoryview(b).cast("B") for b in head])
            return
        # One frame at a time: each chunk's CRC is computed while the peer reads the last one.
        step = max(1, min(DATA_CHUNK, self.max_send - DATA_HEADER_SIZE))
        for i, off in enumerate(range(0, len(data), step)):
            chunk = Data(msg.id, i, 0, off, data[off:off + step])
            parts = frame_parts(chunk, epoch=self.epoch, stream=CONTROL_STREAM, seq=self._stamp(), version=self.version)
            self._sendmsg([memoryview(b).cast("B") for b in (*head, *parts)])
            head = ()

    def send_error(self, err: DTMError, rank: int) -> None:
        """An Error frame before this side closes the connection (best effort)."""
        try:
            self._sendmsg([memoryview(b).cast("B") for b in frame_parts(
                Error.from_exception(err, rank), epoch=self.epoch, stream=CONTROL_STREAM, seq=self._stamp(),
                version=self.version)])
        except (OSError, DTMError):
            pass

    def _sendmsg(self, views: list[memoryview]) -> None:
        self.sock.settimeout(None)
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
        except OSError as e:
            raise DTMError(E.PEER_LOST, f"sending to the store of {self.peer}: {e.strerror or e}") from None

    # --- receiving ----------------------------------------------------------------------------

    def receive(self, deadline: float, during: str) -> Message:
        """The next message; an Error from the peer is raised as its DTMError."""
        header, payload = self._next(deadline, during)
        verify_payload(header, payload)
        msg = decode_message(header, payload)
        if isinstance(msg, Error):
            raise DTMError(msg.known_code(), f"the store of {self.peer} reported {msg.code} during {during}: "
                                             f"{msg.message}")
        return msg

    def read_data(self, seq: int, out: memoryview, deadline: float, during: str) -> None:
        """Fill `out` from the Data frames of transfer `seq`, each read straight into it and
        checked (CRC32C, seq, offset) before the next."""
        filled = 0
        for chunk in range(1 << 62):
            if filled == len(out):
                return
            header = self._header(deadline, during)
            if header.msg_type is not MsgType.DATA:
                payload = _recv_exact(self.sock, header.length, deadline, during, self.peer)
                verify_payload(header, payload)
                msg = decode_message(header, payload)
                if isinstance(msg, Error):
                    raise DTMError(msg.known_code(), f"the store of {self.peer} reported {msg.code} during "
                                                     f"{during}: {msg.message}")
                raise ProtocolError(E.UNEXPECTED_MESSAGE, f"{during}: a {header.msg_type.name} frame from "
                                                          f"{self.peer} where Data of transfer {seq} was due")
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

    def skip_data(self, seq: int, nbytes: int, deadline: float, during: str) -> None:
        """Read and drop the `nbytes` of transfer `seq` (a refused put's), so that the next
        frame is read where it starts. Dropped bytes need no CRC check; their frames' seq do."""
        scratch = memoryview(bytearray(SKIP_BYTES))
        left = nbytes
        while left:
            header = self._header(deadline, during)
            if header.msg_type is not MsgType.DATA or not DATA_HEADER_SIZE <= header.length <= left + DATA_HEADER_SIZE:
                raise ProtocolError(E.BAD_PAYLOAD, f"{during}: a {header.msg_type.name} frame of {header.length} "
                                                   f"bytes from {self.peer} where {left} bytes of Data were due")
            body = header.length
            while body:
                n = min(body, len(scratch))
                _recv_into(self.sock, scratch[:n], deadline, during, self.peer)
                body -= n
            left -= header.length - DATA_HEADER_SIZE

    def _next(self, deadline: float, during: str) -> tuple[FrameHeader, bytes]:
        header = self._header(deadline, during)
        return header, _recv_exact(self.sock, header.length, deadline, during, self.peer)

    def _header(self, deadline: float, during: str) -> FrameHeader:
        raw = _recv_exact(self.sock, HEADER_SIZE, deadline, during, self.peer)
        header = decode_header(raw, max_payload=MAX_PAYLOAD, expected_epoch=self.epoch, expected_version=self.version)
        if header.seq != self.next_in:
            raise ProtocolError(E.OUT_OF_SEQUENCE, f"{during}: frame seq {header.seq} from {self.peer}, expected "
                                                f"{self.next_in}")
        self.next_in += 1
        return header

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def hs_frames_received(hs: Handshake) -> int:
    """How many frames the peer sent during the handshake: its next seq on stream 0."""
    return 2 if hs.role == "accept" else 1


def _read_frame(sock: socket.socket, deadline: float, max_payload: int, epoch: int | None,
                during: str) -> tuple[FrameHeader, bytes]:
    header = decode_header(_recv_exact(sock, HEADER_SIZE, deadline, during, "the peer"), max_payload=max_payload,
                           expected_epoch=epoch)
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


__all__: Sequence[str] = ["StoreConnection", "LEVEL"]
