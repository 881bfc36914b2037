"""Errors of the wire protocol (spec 9.1, codes E09xx).

The codec knows bytes, not peers: it raises with `peer=None`, and the transport that read
the bytes names the peer and the operation with `err.at(peer, op)` before reporting it.
"""

from __future__ import annotations

from ..errors import DTMError, ErrorCode


class ProtocolError(DTMError):
    """A frame or message that breaks spec 9.1. The receiver drops the connection and logs
    `str(err)`, except for `StaleEpochError`, where it drops only the frame."""

    def __init__(self, code: ErrorCode, message: str, *, peer: str | None = None, op: str | None = None):
        super().__init__(code, message)
        self.peer = peer
        self.op = op

    def at(self, peer: str, op: str | None = None) -> "ProtocolError":
        """The same error, naming the peer (e.g. "rank 3 at 127.0.0.1:5001") and the
        operation that was reading; same class, so `except ChecksumError` still matches."""
        err = type(self).__new__(type(self))
        ProtocolError.__init__(err, self.code, self.message, peer=peer, op=op or self.op)
        return err

    def __str__(self) -> str:
        where = "".join(f"{k} {v}: " for k, v in (("peer", self.peer), ("during", self.op)) if v)
        return f"{self.code.value}: {where}{self.message}"


class ChecksumError(ProtocolError):
    """A frame whose CRC32C does not match its header and payload (E0906): the bytes were
    damaged on the way and MUST NOT be used."""

    def __init__(self, message: str, **kw):
        super().__init__(ErrorCode.CHECKSUM_MISMATCH, message, **kw)


class StaleEpochError(ProtocolError):
    """A well-formed frame from an older mesh epoch (E0907): discard it, keep the connection."""

    def __init__(self, message: str, **kw):
        super().__init__(ErrorCode.STALE_EPOCH, message, **kw)
