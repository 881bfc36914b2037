"""CRC32C, the one checksum of the protocol, the store and checkpoints (spec 9.1.2, 9.2.5,
9.4): `checksum` (over several cores for large buffers), `combine` (the CRC of two messages
from theirs), `zeros` and `shift`, the arithmetic `dtm.store.crc` builds a tensor's checksum
from its pieces with.

A CRC is affine in its message: for messages of one length L, `crc(M) = h(M) ^ crc(0^L)`
with `h` linear (the CRC register run from zero, without CRC32C's initial and final
inversion). Moving a value past n zero bytes multiplies it by x^(8n) modulo CRC32C's
polynomial (zlib's crc32_combine does the same for CRC32); that product is computed on
numpy arrays, so many values move in one array step.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import numpy as np
from crc32c import crc32c

_POLY = 0x82F63B78  # CRC32C's polynomial, bit-reflected
_ONE = 1 << 31      # the polynomial 1 (bit-reflected: x^k is bit 31 - k)


def _mul(a: int, b):
    """a(x) * b(x) modulo the polynomial (zlib's multmodp), for `b` one Python int or each
    element of a uint32 array: a Python int's step is a tenth of a numpy step per bit."""
    p, m = b * 0, _ONE
    while a:
        if a & m:
            p ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ ((b & 1) * _POLY)
    return p


_X2K = [_ONE >> 1]  # x^(2^k) modulo the polynomial, k = 0, 1, ...: x, x^2, x^4, ...
for _ in range(66):
    _X2K.append(_mul(_X2K[-1], _X2K[-1]))


@lru_cache(maxsize=256)
def _x8n(n: int) -> int:
    """x^(8n) modulo the polynomial: the multiplier that moves a value past n zero bytes."""
    p, k = _ONE, 3
    while n:
        if n & 1:
            p = _mul(_X2K[k], p)
        n >>= 1
        k += 1
    return p


def shift(h: np.ndarray, n: int) -> np.ndarray:
    """h (see the module doc) of messages followed by n zero bytes more, elementwise."""
    if np.ndim(h) == 0:  # (one value: on a Python int)
        return np.uint32(_mul(_x8n(n), int(h)))
    return _mul(_x8n(n), np.asarray(h, np.uint32))


def combine(first: int, second: int, second_bytes: int) -> int:
    """The CRC32C of A then B from crc(A), crc(B) and B's length (zlib's crc32_combine)."""
    return _mul(_x8n(second_bytes), int(first)) ^ second


PARALLEL_BYTES = 32 << 20  # below this a checksum is one call: threads would cost more than they save
_CORES = min(os.cpu_count() or 1, 8)  # asked once: os.cpu_count() takes microseconds
_pool: ThreadPoolExecutor | None = None


def checksum(buf: memoryview | np.ndarray) -> int:
    """crc32c(buf), over the machine's cores for large buffers: crc32c releases the
    GIL, and one core's CRC (about 14 GB/s) is what a get or put of a large tensor waits on
    after the bytes are in memory."""
    global _pool
    view = memoryview(buf).cast("B") if not isinstance(buf, memoryview) or buf.format != "B" else buf
    if len(view) < PARALLEL_BYTES:
        return crc32c(view)
    if _pool is None:
        _pool = ThreadPoolExecutor(_CORES, thread_name_prefix="dtm-crc")
    k = min(_CORES, len(view) // (PARALLEL_BYTES // 2))
    if k < 2:
        return crc32c(view)
    step = -(-len(view) // k)
    parts = [view[i:i + step] for i in range(0, len(view), step)]
    crcs = list(_pool.map(crc32c, parts))
    out = crcs[0]
    for c, part in zip(crcs[1:], parts[1:]):
        out = combine(out, c, len(part))
    return out


@lru_cache(maxsize=256)
def zeros(n: int) -> int:
    """The CRC32C of n zero bytes (cached: a tensor's pieces and chunks have few lengths)."""
    return _mul(_x8n(n), 0xFFFFFFFF) ^ 0xFFFFFFFF
