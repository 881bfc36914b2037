"""What identifies one collective call: its CollectiveStart descriptor (spec 9.1.5), how two
are compared, how one is named in an error, and where in the user's code it was made.

Descriptors travel and are compared as their encoded payloads: two ranks that make the same
call at the same line send identical bytes, so the common case costs a bytes comparison,
and a payload is decoded only when it differs. Encoding is cached by everything but the
sequence number, which leads the payload (a u64), so each call encodes nothing new.

CollectiveStart has no field for the dims of all_gather, reduce_scatter and all_to_all;
until the protocol has one, they travel at the end of `where`, after "; ", and count in
the comparison.
"""

from __future__ import annotations

import os
import struct
import sys
import zlib

from ..protocol.messages import CollectiveStart

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_SEQ = struct.Struct("<Q")  # CollectiveStart's first field
_TAILS: dict[tuple, bytes] = {}
_MAX_TAILS = 4096


def call_site() -> str:
    """"file:line" of the innermost frame outside the dtm package (the user's call)."""
    f = sys._getframe(1)
    while f is not None and f.f_code.co_filename.startswith(_PACKAGE_DIR):
        f = f.f_back
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}" if f is not None else "?"


def group_stream(ranks: tuple[int, ...]) -> int:
    """The frame stream of a group's collectives: the same on every member, 2 and up (0 is
    control, 1 point-to-point). Two groups that share a pair of ranks collide with
    probability 2^-32; their frames still arrive in order, and the descriptors differ."""
    return 2 + zlib.crc32(struct.pack(f"<{len(ranks)}I", *ranks)) % (2 ** 32 - 2)


def encode_start(seq: int, op: str, reduce_op: str, dtype: str, shape: tuple[int, ...], group: tuple[int, ...],
                 root: int, where: str, args: str = "") -> bytes:
    """The CollectiveStart payload of a call (validated the first time it is made)."""
    key = (op, reduce_op, dtype, shape, group, root, where, args)
    tail = _TAILS.get(key)
    if tail is None:
        if len(_TAILS) >= _MAX_TAILS:
            _TAILS.clear()
        full_where = f"{where}; {args}" if args else where
        tail = _TAILS[key] = CollectiveStart(0, op, reduce_op, dtype, shape, group, root, full_where).encode()[8:]
    return _SEQ.pack(seq) + tail


def seq_of(payload: bytes) -> int | None:
    return _SEQ.unpack_from(payload)[0] if len(payload) >= 8 else None


def args_of(start: CollectiveStart) -> str:
    return start.where.partition("; ")[2]


def same_call(mine: bytes, theirs: bytes) -> bool:
    """Equal in everything but the call site (raises BAD_PAYLOAD on a malformed `theirs`)."""
    if mine == theirs:
        return True
    a, b = CollectiveStart.decode(mine), CollectiveStart.decode(theirs)
    return (a.seq, a.op, a.reduce_op, a.dtype, a.shape, a.group, a.root, args_of(a)) == \
        (b.seq, b.op, b.reduce_op, b.dtype, b.shape, b.group, b.root, args_of(b))


def describe(payload: bytes) -> str:
    """E.g. `all_gather(dim=1) f32[4, 8] at train.py:42`."""
    start = CollectiveStart.decode(payload)
    where, _, args = start.where.partition("; ")
    inner = ", ".join(a for a in (start.reduce_op, args) if a)
    root = f" root {start.root}" if start.root >= 0 else ""
    return f"{start.op}({inner}) {start.dtype}{list(start.shape)}{root} at {where}"


def mismatch_message(group: tuple[int, ...], seq: int, mine: bytes, me: int, theirs: bytes, peer: int) -> str:
    return (f"collective #{seq} of group {list(group)} differs between ranks: rank {me} called "
            f"{describe(mine)}; rank {peer} called {describe(theirs)}")
