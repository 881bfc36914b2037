"""The tensor checksum (spec 9.2.5) of a tensor no process holds whole: the CRC32C of its
storage bytes in row-major order, put together from its pieces.

A CRC is affine in its message: for messages of one length L, `crc(M) = h(M) ^ crc(0^L)`
with `h` linear (the CRC register run from zero, without CRC32C's initial and final
inversion). A piece alone, in place in a message of zeros, has `h` = `box_crc`; the pieces
of a tensor are disjoint, so the tensor's CRC is the XOR of its pieces' and `crc(0^L)`
(`tensor_crc`). Moving a value past n zero bytes multiplies it by x^(8n) modulo CRC32C's
polynomial (zlib's crc32_combine does the same for CRC32); that product is computed on
numpy arrays, so folding a piece's runs together costs log2(runs) array steps, not a step
per run.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache, reduce
from operator import xor
from typing import Iterable, Sequence

import numpy as np
from crc32c import crc32c

_POLY = np.uint32(0x82F63B78)  # CRC32C's polynomial, bit-reflected
_ONE = 1 << 31                 # the polynomial 1 (bit-reflected: x^k is bit 31 - k)


def _mul(a: int, b: np.ndarray) -> np.ndarray:
    """a(x) * b(x) modulo the polynomial, for each element of b (zlib's multmodp)."""
    b = np.asarray(b, np.uint32)
    p = np.zeros_like(b)
    m = _ONE
    while a:
        if a & m:
            p ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ ((b & 1) * _POLY)
    return p


def _square(a: int) -> int:
    return int(_mul(a, np.uint32(a)))


_X2K = [_ONE >> 1]  # x^(2^k) modulo the polynomial, k = 0, 1, ...: x, x^2, x^4, ...
for _ in range(66):
    _X2K.append(_square(_X2K[-1]))


@lru_cache(maxsize=256)
def _x8n(n: int) -> int:
    """x^(8n) modulo the polynomial: the multiplier that moves a value past n zero bytes."""
    p, k = _ONE, 3
    while n:
        if n & 1:
            p = int(_mul(_X2K[k], np.uint32(p)))
        n >>= 1
        k += 1
    return p


def _shift(h: np.ndarray, n: int) -> np.ndarray:
    """h of messages followed by n zero bytes more."""
    return _mul(_x8n(n), h)


def combine(first: int, second: int, second_bytes: int) -> int:
    """The CRC32C of A then B from crc(A), crc(B) and B's length (zlib's crc32_combine)."""
    return int(_shift(np.uint32(first), second_bytes)) ^ second


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


def zeros(n: int) -> int:
    """The CRC32C of n zero bytes."""
    return int(_shift(np.uint32(0xFFFFFFFF), n)) ^ 0xFFFFFFFF


def _fold(h: np.ndarray, stride: int) -> np.ndarray:
    """Along h's last axis, values of runs whose ends lie `stride` bytes apart, folded into
    the value of them all (ending where the last ends): pairs at a time, so in log2 steps."""
    while h.shape[-1] > 1:
        if h.shape[-1] % 2:  # a zero in front: it leaves every run's distance to the end as it is
            h = np.concatenate([np.zeros((*h.shape[:-1], 1), np.uint32), h], axis=-1)
        h = _shift(h[..., 0::2], stride) ^ h[..., 1::2]
        stride *= 2
    return h[..., 0]


def box_crc(piece: np.ndarray, box: Sequence[tuple[int, int]], shape: Sequence[int]) -> int:
    """h of a tensor of storage shape `shape` holding `piece` (its storage array, C order)
    at `box` ([start, stop) per dim) and zero bytes elsewhere."""
    piece = np.ascontiguousarray(piece)
    ext = [b - a for a, b in box]
    total = math.prod(shape) * piece.dtype.itemsize
    if not shape:
        return crc32c(piece) ^ zeros(total)
    if 0 in ext:
        return 0
    # The piece lies in the tensor as runs of bytes: along the last dim the box does not
    # cover whole (and every dim after it), one run per index of the dims before it.
    j = max((d for d in range(len(shape)) if ext[d] != shape[d]), default=0)
    stride = [math.prod(shape[d + 1:]) * piece.dtype.itemsize for d in range(len(shape))]
    run = ext[j] * stride[j]
    flat = piece.reshape(-1).view(np.uint8)
    nruns = math.prod(ext[:j])
    crcs = np.fromiter((crc32c(flat[r * run:(r + 1) * run]) for r in range(nruns)), np.uint32, nruns)
    h = (crcs ^ np.uint32(zeros(run))).reshape(ext[:j])  # each run's h, in place at the runs' grid
    for d in reversed(range(j)):
        h = _fold(h, stride[d])
    end = sum((b - 1) * s for (_, b), s in zip(box[:j], stride)) + box[j][1] * stride[j]
    return int(_shift(h, total - end))


def tensor_crc(pieces: Iterable[int], nbytes: int) -> int:
    """The CRC32C of a tensor of `nbytes` storage bytes from the `box_crc` of each of its
    pieces (disjoint, together the whole tensor)."""
    return reduce(xor, (int(p) for p in pieces), zeros(nbytes))
