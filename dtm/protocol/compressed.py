"""The compressed chunk of a Data frame (spec 9.5.1): what a compressed collective (CAP_QUANT)
sends in place of raw f32 elements. A Data frame whose end-to-end flag bit 1
(`FLAG_COMPRESSED`, 0x02) is set carries, after its 32-byte chunk header, an 8-byte chunk
head and then the encoded elements:

    offset size field
     0     1    encoding   u8: 1 = q8_0, 2 = bf16
     1     1    reserved   0
     2     2    reserved   0 (u16)
     4     4    count      u32: the number of elements the chunk holds
     8     ...  body       q8_0: ceil(count / 32) blocks of 34 bytes (spec 2.2: f16 scale, 32 int8;
                           the last block's elements past `count` are 0);
                           bf16: count values of 2 bytes

The body's length MUST be what `count` and the encoding give (E0910): a receiver checks
it, and the encoding and reserved bytes, before it decodes a byte.
"""

from __future__ import annotations

import struct

from ..errors import ErrorCode as E
from .errors import ProtocolError

ENCODINGS = {"q8_0": 1, "bf16": 2}
NAMES = {v: k for k, v in ENCODINGS.items()}
CHUNK_HEAD = struct.Struct("<BBHI")  # encoding, reserved, reserved, count
HEAD_SIZE = CHUNK_HEAD.size
assert HEAD_SIZE == 8
Q8_BLOCK, Q8_BLOCK_BYTES = 32, 34
MAX_COUNT = (1 << 32) - 1


def body_bytes(encoding: str, count: int) -> int:
    """Bytes of the body that holds `count` elements in `encoding`."""
    if encoding == "q8_0":
        return -(-count // Q8_BLOCK) * Q8_BLOCK_BYTES
    if encoding == "bf16":
        return 2 * count
    raise ValueError(f"unknown encoding {encoding!r}")


def chunk_bytes(encoding: str, count: int) -> int:
    """Bytes of a whole compressed chunk (head and body) of `count` elements."""
    return HEAD_SIZE + body_bytes(encoding, count)


def pack_head(encoding: str, count: int) -> bytes:
    if not 0 <= count <= MAX_COUNT:
        raise ValueError(f"a compressed chunk holds at most {MAX_COUNT} elements, not {count}")
    return CHUNK_HEAD.pack(ENCODINGS[encoding], 0, 0, count)


def check_chunk(data) -> tuple[str, int]:
    """(encoding, count) of a compressed chunk (a Data frame's data with FLAG_COMPRESSED);
    ProtocolError E0910 when its head is malformed or its length disagrees with it."""
    view = memoryview(data).cast("B")
    if len(view) < HEAD_SIZE:
        raise ProtocolError(E.BAD_PAYLOAD, f"compressed Data: {len(view)} data bytes, the chunk head alone is "
                                           f"{HEAD_SIZE}")
    code, r8, r16, count = CHUNK_HEAD.unpack_from(view)
    if code not in NAMES:
        raise ProtocolError(E.BAD_PAYLOAD, f"compressed Data: unknown encoding {code} (1 q8_0, 2 bf16)")
    if r8 or r16:
        raise ProtocolError(E.BAD_PAYLOAD, "compressed Data: the chunk head's reserved bytes are not 0")
    encoding = NAMES[code]
    want = body_bytes(encoding, count)
    if len(view) - HEAD_SIZE != want:
        unit = f"{-(-count // Q8_BLOCK)} blocks of {Q8_BLOCK_BYTES} bytes" if encoding == "q8_0" else \
            f"{count} values of 2 bytes"
        raise ProtocolError(E.BAD_PAYLOAD, f"compressed Data: {count} {encoding} elements need {want} bytes "
                                           f"({unit}), the chunk holds {len(view) - HEAD_SIZE}")
    return encoding, count


__all__ = ["ENCODINGS", "HEAD_SIZE", "body_bytes", "chunk_bytes", "pack_head", "check_chunk"]
