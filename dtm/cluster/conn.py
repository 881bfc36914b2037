"""One control connection between a rank and the coordinator (spec 9.6), as bytes in and
messages out, without sockets: the coordinator drives many of them from one event loop, a
rank drives its one with blocking reads.

The connection opens with the three-Hello handshake (`Handshake`); then every frame is on
stream 0, carries the negotiated version and the sender's epoch, and is numbered by
`seq`. Frames are bounded by `recv_limit` before anything is allocated for them.
"""

from __future__ import annotations

import logging

from ..errors import DTMError, ErrorCode as E
from ..protocol.caps import Cap, level_caps
from ..protocol.errors import ProtocolError
from ..protocol.frame import Buffer, FrameDecoder, MsgType
from ..protocol.handshake import CONTROL_STREAM, Handshake
from ..protocol.messages import MIN_MAX_PAYLOAD, Error, Message, decode_message, encode_message

log = logging.getLogger("dtm.cluster")

LEVEL = 1  # membership is level L1 (spec 8.1)
# Both sides read a Heartbeat's worker rows (spec 9.1.5); a rank sends them only to a
# coordinator that announced this too. Both relay and hear a job's cancel (spec 9.4.10): a
# rank asks for one only of a coordinator that announced CAP_CANCEL.
CAPS = int(level_caps(LEVEL) | Cap.WORKER_ROWS | Cap.CANCEL | Cap.RESIZE)  # RESIZE: spec 9.6.7


class Control:
    """The framing state of one control connection. `feed` returns what to send back (the
    handshake's replies) and the messages that arrived after the handshake; a ProtocolError
    from it ends the connection (send `error_frame(err)` first)."""

    def __init__(self, role: str, token: bytes, *, rank: int = -1, name: str = "", max_payload: int,
                 peer: str = "the peer"):
        self.hs = Handshake(role, token, level=LEVEL, caps=CAPS, rank=rank, name=name,
                            max_payload=max_payload)
        # Until the peer has proven the token, its frames are held to the handshake's limit
        # (spec 9.1.9); after, to what this side announced.
        self.max_payload = max_payload
        self.decoder = FrameDecoder(max_payload=min(max_payload, MIN_MAX_PAYLOAD), check_seq=True)
        self.epoch = 0     # stamped on every frame this side sends
        self.peer = peer   # for logs

    @property
    def ready(self) -> bool:
        return self.hs.done

    def start(self) -> bytes:
        return b"".join(self.hs.start())

    def feed(self, data: Buffer) -> tuple[bytes, list[Message]]:
        reply: list[bytes] = []
        messages: list[Message] = []
        for header, payload in self.decoder.feed(data):
            if not self.hs.done:
                reply += self.hs.receive(header, payload)
                if self.hs.done:
                    self.decoder.max_payload = self.max_payload
                continue
            if header.version != self.hs.version:
                raise ProtocolError(E.UNSUPPORTED_PROTOCOL_VERSION,
                                    f"{header.msg_type.name} frame is protocol version {header.version[0]}."
                                    f"{header.version[1]}; this connection negotiated {self.hs.version[0]}."
                                    f"{self.hs.version[1]}")
            if header.msg_type is MsgType.HELLO:
                raise ProtocolError(E.UNEXPECTED_MESSAGE, "a Hello after the handshake")
            messages.append(decode_message(header, payload))
        while self.decoder.discarded:
            log.warning("dropped a frame from %s: %s", self.peer, self.decoder.discarded.pop(0))
        return b"".join(reply), messages

    @property
    def peer_reads_worker_rows(self) -> bool:
        """Whether the peer's Hello announced CAP_WORKER_ROWS (after the handshake)."""
        return self.hs.peer is not None and bool(self.hs.peer.caps & Cap.WORKER_ROWS)

    def encode(self, msg: Message, *, flags: int = 0) -> bytes:
        """`msg`'s frame, numbered next on the control stream (after the handshake)."""
        frame = encode_message(msg, epoch=self.epoch, stream=CONTROL_STREAM, seq=self.hs.next_seq, flags=flags,
                               version=self.hs.version)
        self.hs.next_seq += 1
        return frame

    def error_frame(self, err: DTMError, rank: int = -1) -> bytes:
        """The Error frame that reports `err` to the peer before the connection closes."""
        if not self.hs.done:  # in the version of the peer's Hello, which it reads
            return self.hs.error_frame(err)
        return self.encode(Error.from_exception(err, rank))


def remote_error(err: Error, who: str) -> DTMError:
    """The DTMError an Error message from `who` stands for: its code when this side knows
    it, else E0911, with the peer's message."""
    return DTMError(err.known_code(), f"{who} reported {err.code}: {err.message}")
