"""End-to-end tensor checksums (spec 9.4.9): a tensor's CRC32C is computed where it is
produced (the sender's array, the caller's array of a put, the frozen copy of a save) and
checked where it is consumed (after the last byte landed, after a get assembled its
pieces, after a load read them). The frames' and chunks' own CRCs cover the bytes on the
wire and on the disk; this one covers the copies in memory between them.

`DTM_CHECKSUMS=0` turns it off in a process: it then neither computes nor checks, and its
Hello does not announce CAP_CHECKSUMS, so its peers send it no checksum.
"""

from __future__ import annotations

import os

import numpy as np

from ..errors import DTMError, ErrorCode
from .crc import checksum

ENV = "DTM_CHECKSUMS"


def enabled() -> bool:
    """Whether this process computes and checks end-to-end checksums (DTM_CHECKSUMS is not "0")."""
    return os.environ.get(ENV, "1") != "0"


class TensorChecksumMismatch(DTMError):
    """E1008: a tensor whose CRC32C where it is consumed differs from the one computed where
    it was produced; `what` names the tensor or transfer, `op` the operation, `peer` the
    rank, store or directory it came from (a put's: went to), `expected` and `found` the
    two CRCs, `outcome` what became of the value, `key` the store key when it came from one."""

    def __init__(self, what: str, op: str, peer: str, expected: int, found: int,
                 outcome: str = "the value is not returned", key: str | None = None):
        toward = "to" if op == "put" else "from"
        super().__init__(ErrorCode.TENSOR_CHECKSUM_MISMATCH,
                         f"{op} of {what} {toward} {peer}: the tensor's CRC32C is {found:08x} where it arrived, "
                         f"{expected:08x} where it was produced: its bytes changed in memory on the way (the frames' "
                         f"and chunks' own CRCs passed); {outcome}")
        self.what, self.op, self.peer, self.expected, self.found = what, op, peer, expected, found
        self.key = key


def array_crc(a: np.ndarray) -> int:
    """The CRC32C of a C-contiguous array's bytes, whatever its dtype (bfloat16 included)."""
    return checksum(a.reshape(-1).view(np.uint8))


def verify(a: np.ndarray, expected: int, *, what: str, op: str, peer: str) -> None:
    """Raise TensorChecksumMismatch unless the bytes of `a` (C-contiguous) have CRC32C `expected`."""
    found = array_crc(a)
    if found != expected:
        raise TensorChecksumMismatch(what, op, peer, expected, found)
