"""The tensor checksum (spec 9.2.5) of a tensor no process holds whole: the CRC32C of its
storage bytes in row-major order, put together from its pieces.

A CRC is affine in its message: for messages of one length L, `crc(M) = h(M) ^ crc(0^L)`
with `h` linear (the CRC register run from zero, without CRC32C's initial and final
inversion). A piece alone, in place in a message of zeros, has `h` = `box_crc`; the pieces
of a tensor are disjoint, so the tensor's CRC is the XOR of its pieces' and `crc(0^L)`
(`tensor_crc`). Moving values past zero bytes (`dtm.protocol.crc.shift`) works on numpy
arrays, so folding a piece's runs together costs log2(runs) array steps, not a step per run.
`checksum`, `combine` and `zeros` are the protocol's, named here for the store's modules.
"""

from __future__ import annotations

import math
from functools import reduce
from operator import xor
from typing import Iterable, Sequence

import numpy as np
from crc32c import crc32c

from ..protocol.crc import checksum, combine, shift, zeros

__all__ = ["checksum", "combine", "zeros", "box_crc", "tensor_crc"]


def _fold(h: np.ndarray, stride: int) -> np.ndarray:
    """Along h's last axis, values of runs whose ends lie `stride` bytes apart, folded into
    the value of them all (ending where the last ends): pairs at a time, so in log2 steps."""
    while h.shape[-1] > 1:
        if h.shape[-1] % 2:  # a zero in front: it leaves every run's distance to the end as it is
            h = np.concatenate([np.zeros((*h.shape[:-1], 1), np.uint32), h], axis=-1)
        h = shift(h[..., 0::2], stride) ^ h[..., 1::2]
        stride *= 2
    return h[..., 0]


def box_crc(piece: np.ndarray, box: Sequence[tuple[int, int]], shape: Sequence[int],
            piece_crc: int | None = None) -> int:
    """h of a tensor of storage shape `shape` holding `piece` (its storage array, C order)
    at `box` ([start, stop) per dim) and zero bytes elsewhere. `piece_crc`: the CRC32C of
    the piece's bytes when the caller has it (a chunk just written), used where the piece
    lies in the tensor as one run of bytes."""
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
    if nruns == 1 and piece_crc is not None:
        crcs = np.array([piece_crc], np.uint32)
    else:
        crcs = np.fromiter((crc32c(flat[r * run:(r + 1) * run]) for r in range(nruns)), np.uint32, nruns)
    h = (crcs ^ np.uint32(zeros(run))).reshape(ext[:j])  # each run's h, in place at the runs' grid
    for d in reversed(range(j)):
        h = _fold(h, stride[d])
    end = sum((b - 1) * s for (_, b), s in zip(box[:j], stride)) + box[j][1] * stride[j]
    return int(shift(h, total - end))


def tensor_crc(pieces: Iterable[int], nbytes: int) -> int:
    """The CRC32C of a tensor of `nbytes` storage bytes from the `box_crc` of each of its
    pieces (disjoint, together the whole tensor)."""
    return reduce(xor, (int(p) for p in pieces), zeros(nbytes))
