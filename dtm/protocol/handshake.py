"""Version negotiation and mutual authentication (spec 9.1.6), without sockets.

Three Hellos open every connection; the cluster token never travels, only HMAC-SHA256
answers to fresh random challenges:

    connecting peer C                                accepting peer A
    Hello(challenge cC, no answer)          ->
                                            <-       Hello(challenge cA, answer HMAC(token, "accept" cC cA))
    checks A's answer
    Hello(challenge cC, answer HMAC(token, "connect" cA cC)) ->
                                                     checks C's answer

The role in the HMAC input keeps a peer from replaying one side's answer as the other's.
`Handshake` is the state machine both sides run: the transport feeds it the frames it
receives and sends the frames it returns, and on a ProtocolError sends `error_frame(err)`
before closing.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Sequence

from ..errors import ErrorCode as E
from .errors import ProtocolError
from .frame import MAX_PAYLOAD, PROTOCOL_VERSION, FrameHeader, MsgType
from .messages import ANSWER_SIZE, CHALLENGE_SIZE, Error, Hello, decode_message, encode_message

ROLES = ("connect", "accept")
SPOKEN: tuple[tuple[int, int], ...] = (PROTOCOL_VERSION,)  # (major, highest minor) pairs this code speaks
CONTROL_STREAM = 0


def format_versions(versions: Sequence[tuple[int, int]]) -> str:
    """`[(1, 2)]` -> "1.0 to 1.2"."""
    return ", ".join(f"{a}.0" if b == 0 else f"{a}.0 to {a}.{b}" for a, b in sorted(versions)) or "nothing"


def negotiate(ours: Sequence[tuple[int, int]], theirs: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The highest version both sides speak; each side speaks major.0 to major.minor for each
    (major, minor) it lists. E0902 naming both sides' versions when there is none."""
    theirs_by_major = dict(theirs)
    common = [(major, min(minor, theirs_by_major[major])) for major, minor in ours if major in theirs_by_major]
    if not common:
        raise ProtocolError(E.UNSUPPORTED_PROTOCOL_VERSION,
                            f"no protocol version in common: this side speaks {format_versions(ours)}, "
                            f"the peer speaks {format_versions(theirs)}")
    return max(common)


def hmac_answer(token: bytes, challenge: bytes, *, responder_challenge: bytes, role: str) -> bytes:
    """The answer that peer `role` ("connect" or "accept"), whose own challenge is
    `responder_challenge`, gives to the other peer's `challenge`:
    HMAC-SHA256(token, "DTM hello " + role + challenge + responder_challenge)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, found {role!r}")
    if len(challenge) != CHALLENGE_SIZE or len(responder_challenge) != CHALLENGE_SIZE:
        raise ValueError(f"challenges are {CHALLENGE_SIZE} bytes")
    return hmac.new(token, b"DTM hello " + role.encode() + challenge + responder_challenge, hashlib.sha256).digest()


def check_answer(token: bytes, challenge: bytes, answer: bytes, *, responder_challenge: bytes, role: str) -> None:
    """E0909 unless `answer` is `hmac_answer(token, challenge, ...)`; compared in constant
    time, so the time taken tells nothing about how much of the answer was right."""
    want = hmac_answer(token, challenge, responder_challenge=responder_challenge, role=role)
    if len(answer) != ANSWER_SIZE or not hmac.compare_digest(want, answer):
        raise ProtocolError(E.AUTH_FAILED, f"the {role}ing peer's answer to the challenge does not prove the cluster "
                                           "token: the two sides have different DTM_TOKEN values")


def remote_error(header: FrameHeader, payload: bytes, during: str) -> ProtocolError:
    """The ProtocolError for an Error message a peer sent: its code when this side knows
    it, else E0911, with the peer's message."""
    err = decode_message(header, payload)
    assert isinstance(err, Error)
    who = f"rank {err.rank}" if err.rank >= 0 else "the peer"
    return ProtocolError(err.known_code(), f"{who} reported {err.code} during {during}: {err.message}")


class Handshake:
    """One side of the three-Hello handshake. `start()` returns the frames to send first;
    `receive(header, payload)` returns the frames to send in reply, raises ProtocolError on
    a failure, and sets `done` once both sides are proven. Then `version` is the negotiated
    version (every later frame carries it), `peer` the peer's last Hello, and `next_seq`
    the next sequence number of this side on the control stream."""

    def __init__(self, role: str, token: bytes, *, level: int, caps: int, rank: int = -1, name: str = "",
                 max_payload: int = MAX_PAYLOAD, versions: Sequence[tuple[int, int]] = SPOKEN,
                 challenge: bytes | None = None):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, found {role!r}")
        self.role = role
        self.token = token
        self.hello = Hello(tuple(versions), level, caps, max_payload, rank, name,
                           challenge if challenge is not None else os.urandom(CHALLENGE_SIZE))
        self.version: tuple[int, int] | None = None
        self.peer: Hello | None = None
        self.done = False
        self.next_seq = 0
        self._peer_frame_version: tuple[int, int] | None = None  # what the peer wrote, so it can read it

    def _send(self, hello: Hello) -> bytes:
        # Sent in the lowest major this side speaks, so that a peer of that major can read it.
        frame = encode_message(hello, epoch=0, stream=CONTROL_STREAM, seq=self.next_seq, version=min(hello.versions))
        self.next_seq += 1
        return frame

    def start(self) -> list[bytes]:
        return [self._send(self.hello)] if self.role == "connect" else []

    def receive(self, header: FrameHeader, payload: bytes) -> list[bytes]:
        if self.done:
            raise ProtocolError(E.UNEXPECTED_MESSAGE, f"{header.msg_type.name} frame handed to a finished handshake")
        if header.msg_type is MsgType.ERROR:
            raise remote_error(header, payload, "the handshake")
        if header.msg_type is not MsgType.HELLO:
            raise ProtocolError(E.UNEXPECTED_MESSAGE, f"expected Hello to open the connection, found "
                                                      f"{header.msg_type.name}")
        self._peer_frame_version = self._peer_frame_version or header.version
        hello = decode_message(header, payload)
        assert isinstance(hello, Hello)
        other = "accept" if self.role == "connect" else "connect"
        if self.peer is None:  # the peer's first Hello
            self.version = negotiate(self.hello.versions, hello.versions)
            self.peer = hello
            if self.role == "accept":
                if hello.answer:
                    raise ProtocolError(E.UNEXPECTED_MESSAGE, "the connecting peer's first Hello answers a challenge "
                                                              "it has not been sent")
                return [self._send(self._answering(hello))]
            check_answer(self.token, self.hello.challenge, hello.answer, responder_challenge=hello.challenge,
                         role=other)
            self.done = True
            return [self._send(self._answering(hello))]
        # the accepting side gets the connecting peer's second Hello: the first one, answered
        if (hello.versions, hello.challenge) != (self.peer.versions, self.peer.challenge):
            raise ProtocolError(E.UNEXPECTED_MESSAGE, "the connecting peer's second Hello changed its versions or "
                                                      "its challenge")
        check_answer(self.token, self.hello.challenge, hello.answer, responder_challenge=hello.challenge, role=other)
        self.peer, self.done = hello, True
        return []

    def _answering(self, peer: Hello) -> Hello:
        answer = hmac_answer(self.token, peer.challenge, responder_challenge=self.hello.challenge, role=self.role)
        h = self.hello
        return Hello(h.versions, h.level, h.caps, h.max_payload, h.rank, h.name, h.challenge, answer)

    def error_frame(self, err: ProtocolError) -> bytes:
        """The Error frame to send before closing after `err`: in the negotiated version, or
        before there is one, in the version of the peer's Hello frame, which the peer reads."""
        version = self.version or self._peer_frame_version or min(self.hello.versions)
        frame = encode_message(Error.from_exception(err, self.hello.rank), epoch=0, stream=CONTROL_STREAM,
                               seq=self.next_seq, version=version)
        self.next_seq += 1
        return frame
