"""The frame codec (spec 9.1.1 to 9.1.3): a fixed 40-byte little-endian header, then the
payload. No sockets here: a transport reads `HEADER_SIZE` bytes, calls `decode_header`
(which bounds the length before anything is allocated), reads `header.length` bytes into a
buffer of its choice and calls `verify_payload`. A sender calls `encode_header` and hands
`[header, *payload_buffers]` to `sendmsg`, so tensor bytes are never copied.

    offset size field
     0     4    magic        b"DTMW"
     4     1    major        protocol (= spec) major version
     5     1    minor        protocol (= spec) minor version
     6     1    type         MsgType
     7     1    flags        bits 0-3 end to end (covered by the CRC), bits 4-7 per hop (not)
     8     8    epoch        u64, mesh epoch of the sender
    16     8    length       u64, payload bytes
    24     4    stream       u32, logical stream on this connection (0 = control)
    28     4    crc          u32, CRC32C of bytes 0-27 (hop bits of byte 7 cleared), then the payload
    32     8    seq          u64, per (connection, stream) frame counter, per hop: not covered

Like Kafka's record batch, what a relay changes (the per-hop flag bits and the
per-connection sequence number) lies outside the checksum, so a frame can be forwarded
without re-reading its payload and its CRC still protects it end to end. Like RocksDB's log,
every frame carries the epoch of the membership it was sent in, so a frame of an older mesh
is recognised and refused (`StaleEpochError`).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

from crc32c import crc32c

from ..errors import ErrorCode as E
from ..ir.version import SPEC_VERSION
from .errors import ChecksumError, ProtocolError, StaleEpochError

Buffer = Union[bytes, bytearray, memoryview]
Payload = Union[Buffer, Sequence[Buffer]]

MAGIC = b"DTMW"
PROTOCOL_VERSION: tuple[int, int] = (SPEC_VERSION[0], SPEC_VERSION[1])
HEADER_SIZE = 40
MAX_PAYLOAD = 1 << 30  # the default bound a receiver puts on `length`; Hello announces the real one

_HEADER = struct.Struct("<4sBBBBQQIIQ")
assert _HEADER.size == HEADER_SIZE
CRC_OFFSET = 28  # the CRC covers bytes [0, CRC_OFFSET) of the header (hop bits cleared), then the payload
_COVERED = struct.Struct("<4sBBBBQQI")
assert _COVERED.size == CRC_OFFSET

FLAG_LAST = 0x01       # end to end: the last frame of a message split over several frames
FLAG_COMPRESSED = 0x02  # end to end: a Data frame whose data is a compressed chunk (spec 9.5.1, CAP_QUANT)
FLAG_RELAYED = 0x10    # per hop: a relay forwarded this frame unchanged
END_TO_END_FLAGS = 0x0F
HOP_FLAGS = 0xF0


class MsgType(enum.IntEnum):
    """The `type` byte. Values are stable within a major version (spec 9.1.4)."""

    HELLO = 1
    JOIN_MESH = 2
    MESH_VIEW = 3
    HEARTBEAT = 4
    LEAVE = 5
    COLLECTIVE_START = 6
    DATA = 7
    P2P_SEND = 8
    ERROR = 9
    CANCEL = 10
    STORE_REQUEST = 11
    STORE_REPLY = 12


# The protocol version that added each message type after 1.0 (spec 11, docs/spec/versions.json):
# a frame of an older version never carries it, in either direction (E0903)
MESSAGE_SINCE: dict[MsgType, tuple[int, int]] = {MsgType.STORE_REQUEST: (1, 1), MsgType.STORE_REPLY: (1, 1)}


def check_known(msg_type: MsgType, version: tuple[int, int]) -> None:
    """E0903 when protocol `version` has no message `msg_type` (one added later)."""
    since = MESSAGE_SINCE.get(msg_type)
    if since is not None and since > tuple(version):
        raise ProtocolError(E.UNKNOWN_MESSAGE, f"{msg_type.name} is a message of protocol {since[0]}.{since[1]} "
                                               f"and later; this frame is {version[0]}.{version[1]} (the version "
                                               "the connection negotiated)")


# Never stale (spec 9.1.7): Hello and JoinMesh come before the sender knows an epoch, and an
# Error, sent before a connection closes, is always heard.
EPOCH_EXEMPT = frozenset({MsgType.HELLO, MsgType.JOIN_MESH, MsgType.ERROR})


@dataclass(frozen=True)
class FrameHeader:
    version: tuple[int, int]
    msg_type: MsgType
    flags: int
    epoch: int
    stream: int
    seq: int
    length: int
    crc: int


def _buffers(payload: Payload) -> Sequence[Buffer]:
    return (payload,) if isinstance(payload, (bytes, bytearray, memoryview)) else payload


def _nbytes(buf: Buffer) -> int:
    return buf.nbytes if isinstance(buf, memoryview) else len(buf)


def frame_crc(covered_header: bytes, payload: Payload) -> int:
    """CRC32C of the first CRC_OFFSET header bytes (hop flag bits already cleared) and the
    payload buffers, in order."""
    crc = crc32c(covered_header)
    for buf in _buffers(payload):
        crc = crc32c(buf, crc)
    return crc


def _covered(version: tuple[int, int], msg_type: int, flags: int, epoch: int, length: int, stream: int) -> bytes:
    """The header bytes the CRC covers: offsets 0 to 27, per-hop flag bits cleared."""
    return _COVERED.pack(MAGIC, version[0], version[1], int(msg_type), flags & END_TO_END_FLAGS, epoch, length, stream)


def encode_header(msg_type: MsgType, payload: Payload, *, epoch: int, stream: int, seq: int,
                  flags: int = 0, version: tuple[int, int] = PROTOCOL_VERSION) -> bytes:
    """The 40 header bytes of a frame carrying `payload` (one buffer, or several sent back
    to back, e.g. a Data chunk header and a memoryview of the tensor)."""
    length = sum(_nbytes(b) for b in _buffers(payload))
    check_known(msg_type, version)  # (a peer of an older minor cannot read it: never sent)
    try:
        crc = frame_crc(_covered(version, msg_type, flags, epoch, length, stream), payload)
        return _HEADER.pack(MAGIC, version[0], version[1], int(msg_type), flags, epoch, length, stream, crc, seq)
    except struct.error as e:
        raise ValueError(f"a header field is out of range ({e}): flags {flags}, epoch {epoch}, stream {stream}, "
                         f"seq {seq}, version {version}") from None


def encode_frame(msg_type: MsgType, payload: Payload, *, epoch: int, stream: int, seq: int,
                 flags: int = 0, version: tuple[int, int] = PROTOCOL_VERSION) -> bytes:
    """Header and payload in one bytes object (for control messages, tests and tools)."""
    header = encode_header(msg_type, payload, epoch=epoch, stream=stream, seq=seq, flags=flags, version=version)
    return b"".join([header, *_buffers(payload)])


def decode_header(buf: Buffer, *, max_payload: int = MAX_PAYLOAD, expected_epoch: int | None = None,
                  expected_version: tuple[int, int] | None = None) -> FrameHeader:
    """Check and decode the first HEADER_SIZE bytes of `buf`, in the order of spec 9.1.3:
    size (E0905), magic (E0901), major version, or the whole version when `expected_version`
    is given (E0902), type (E0903), length against `max_payload` (E0904), and, when
    `expected_epoch` is given, the epoch (E0907, `StaleEpochError`). The CRC needs the
    payload: `verify_payload`."""
    if len(buf) < HEADER_SIZE:
        raise ProtocolError(E.TRUNCATED_FRAME, f"a frame header is {HEADER_SIZE} bytes, only {len(buf)} arrived")
    magic, major, minor, mtype, flags, epoch, length, stream, crc, seq = _HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise ProtocolError(E.BAD_MAGIC, f"expected magic {MAGIC.hex()} ({MAGIC.decode()}), found {magic.hex()}: "
                                         "not a DTM peer, or the stream lost its place")
    want = expected_version or PROTOCOL_VERSION
    if major != want[0] or (expected_version is not None and minor != want[1]):
        said = f"{want[0]}.{want[1]} (negotiated)" if expected_version else f"{want[0]}.x"
        raise ProtocolError(E.UNSUPPORTED_PROTOCOL_VERSION,
                            f"frame is protocol version {major}.{minor}; this connection speaks {said}")
    try:
        msg_type = MsgType(mtype)
    except ValueError:
        raise ProtocolError(E.UNKNOWN_MESSAGE, f"unknown message type {mtype} (known: 1 to {max(MsgType)})") from None
    check_known(msg_type, (major, minor))
    if length > max_payload:
        raise ProtocolError(E.FRAME_TOO_LARGE, f"{msg_type.name} frame announces a {length}-byte payload; "
                                               f"the limit is {max_payload} bytes")
    if expected_epoch is not None and epoch < expected_epoch and msg_type not in EPOCH_EXEMPT:
        raise StaleEpochError(f"{msg_type.name} frame (stream {stream}, seq {seq}) is from mesh epoch {epoch}; "
                              f"the current epoch is {expected_epoch}")
    return FrameHeader((major, minor), msg_type, flags, epoch, stream, seq, length, crc)


def verify_payload(header: FrameHeader, payload: Payload) -> None:
    """ChecksumError (E0906) unless `payload` is the header's length and its CRC matches."""
    n = sum(_nbytes(b) for b in _buffers(payload))
    if n != header.length:
        raise ProtocolError(E.TRUNCATED_FRAME, f"{header.msg_type.name} frame announces {header.length} payload "
                                               f"bytes, {n} given")
    crc = frame_crc(_covered(header.version, header.msg_type, header.flags, header.epoch, header.length,
                             header.stream), payload)
    if crc != header.crc:
        raise ChecksumError(f"{header.msg_type.name} frame (stream {header.stream}, seq {header.seq}, "
                            f"{header.length} payload bytes): CRC32C is {crc:#010x}, the header says {header.crc:#010x}")


class FrameDecoder:
    """Incremental decoding of a byte stream: `feed(data)` returns the frames completed so
    far as (header, payload) pairs; `close()` raises E0905 when the stream ended inside a
    frame. With `check_seq`, each stream's `seq` must count 0, 1, 2, ... (E0908), or from
    `next_seq[stream]` for a decoder that takes over a connection part-way.

    A frame from an older epoch (E0907) is skipped without buffering its payload, and its
    error is appended to `discarded` for the caller to log; the stream goes on. Any other
    error is final: the decoder, like the connection it serves, is then closed."""

    def __init__(self, *, max_payload: int = MAX_PAYLOAD, expected_epoch: int | None = None,
                 check_seq: bool = False, next_seq: dict[int, int] | None = None):
        self.max_payload = max_payload
        self.expected_epoch = expected_epoch
        self.check_seq = check_seq
        self.discarded: list[StaleEpochError] = []
        self._buf = bytearray()
        self._header: FrameHeader | None = None
        self._skip = 0  # payload bytes of a stale frame still to drop
        self._next_seq: dict[int, int] = dict(next_seq or {})  # per stream; 0 for a stream not named
        self._failed: ProtocolError | None = None

    def feed(self, data: Buffer) -> list[tuple[FrameHeader, bytes]]:
        if self._failed is not None:
            raise self._failed
        self._buf += data
        frames = []
        try:
            while True:
                if self._skip:
                    n = min(self._skip, len(self._buf))
                    del self._buf[:n]
                    self._skip -= n
                    if self._skip:
                        break
                if self._header is None:
                    if len(self._buf) < HEADER_SIZE:
                        break
                    try:
                        self._header = decode_header(self._buf, max_payload=self.max_payload,
                                                     expected_epoch=self.expected_epoch)
                    except StaleEpochError as e:
                        *_, length, stream, _crc, seq = _HEADER.unpack_from(self._buf)  # length bounded already
                        self._count(stream, seq, "stale")
                        self.discarded.append(e)
                        self._skip = length
                        del self._buf[:HEADER_SIZE]
                        continue
                    del self._buf[:HEADER_SIZE]
                h = self._header
                if len(self._buf) < h.length:
                    break
                payload = bytes(self._buf[:h.length])
                del self._buf[:h.length]
                self._header = None
                verify_payload(h, payload)
                self._count(h.stream, h.seq, h.msg_type.name)
                frames.append((h, payload))
        except ProtocolError as e:
            self._failed = e
            raise
        return frames

    def _count(self, stream: int, seq: int, what: str) -> None:
        if self.check_seq:
            want = self._next_seq.get(stream, 0)
            if seq != want:
                raise ProtocolError(E.OUT_OF_SEQUENCE, f"{what} frame on stream {stream} has seq {seq}, expected {want}")
            self._next_seq[stream] = want + 1

    def close(self) -> None:
        """The stream ended: E0905 if it ended inside a frame."""
        if self._failed is not None:
            raise self._failed
        h = self._header
        if h is not None or self._buf or self._skip:
            if h is not None:
                what, have, want = f"{h.msg_type.name} frame", HEADER_SIZE + len(self._buf), HEADER_SIZE + h.length
            elif self._skip:
                what, have, want = "stale frame", 0, self._skip
            else:
                what, have, want = "frame header", len(self._buf), HEADER_SIZE
            raise ProtocolError(E.TRUNCATED_FRAME, f"the stream ended inside a {what}: {have} of {want} bytes arrived")


__all__ = ["MAGIC", "HEADER_SIZE", "MAX_PAYLOAD", "PROTOCOL_VERSION", "CRC_OFFSET", "FLAG_LAST", "FLAG_RELAYED",
           "END_TO_END_FLAGS", "HOP_FLAGS", "EPOCH_EXEMPT", "MESSAGE_SINCE", "check_known", "MsgType", "FrameHeader", "frame_crc",
           "encode_header", "encode_frame", "decode_header", "verify_payload", "FrameDecoder"]
