"""Host arrays for data that lives long and is read often: a model's weights, a plan's
slots. At 2 MiB and up they start on a 2 MiB boundary of memory of their own, which Linux
is asked to back with transparent huge pages (madvise MADV_HUGEPAGE).

Why: reading memory through 4 KiB pages costs a page-table walk every 4 KiB, and in a
virtual machine each walk is two. numpy aligns nothing and asks for huge pages only from
4 MiB, so a GPT-2 weight of 768 x 768 f32 (2.25 MiB) sat wholly on 4 KiB pages, and every
larger one on them for up to 2 MiB at each end: about 18% of its 497 MB. A matrix-vector
product reads a weight once a token at memory speed; a two-thread read of 496 MB ran at
14.6 GB/s on 4 KiB pages and 25.7 on 2 MiB ones (a C harness), and GPT-2's decode went up
2-7% with every weight aligned (alternated runs).

Elsewhere (not Linux, or no mmap flags) the arrays are plain numpy ones.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

from ..errors import ErrorCode, user_error

HUGE_PAGE = 2 << 20
# arrays at least this large are aligned: a smaller one would hold less than one huge page
ALIGN_FROM = HUGE_PAGE

_PRIVATE = getattr(mmap, "MAP_PRIVATE", None), getattr(mmap, "MAP_ANONYMOUS", None)
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)


def empty(shape: tuple[int, ...] | int, dtype: Any) -> np.ndarray:
    """An uninitialised C-contiguous array, 2 MiB-aligned on huge pages when it is large
    (its memory is freed with the array, like any numpy array's); E0810 at the user's line
    when the system refuses the memory."""
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    try:
        return _empty(shape, dtype, nbytes)
    except MemoryError:
        raise user_error(ErrorCode.OUT_OF_MEMORY, f"out of memory: the system refused {nbytes / 2**30:.1f} GiB "
                         f"({nbytes:,} bytes) for an array of {dtype} of shape {shape}") from None


def _empty(shape: tuple[int, ...], dtype: np.dtype, nbytes: int) -> np.ndarray:
    """empty's array: numpy's below ALIGN_FROM bytes, else on a 2 MiB boundary of a
    mapping of its own."""
    if nbytes < ALIGN_FROM or None in _PRIVATE:
        return np.empty(shape, dtype)
    # a private anonymous mapping (a shared one is shmem, which gets no huge pages here),
    # one huge page longer than the array so that it can start on a boundary
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=_PRIVATE[0] | _PRIVATE[1])
        if _ADVICE is not None:
            region.madvise(_ADVICE)
    except OSError:  # no mapping to be had (a limit on them): numpy's memory, or its MemoryError
        return np.empty(shape, dtype)
    raw = np.frombuffer(region, np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def copy(array: Any, dtype: Any = None) -> np.ndarray:
    """A copy of `array` (as `dtype` when given) in memory from `empty`."""
    array = np.asarray(array)
    out = empty(array.shape, array.dtype if dtype is None else dtype)
    out[...] = array
    return out


def is_aligned(array: np.ndarray) -> bool:
    """Whether `array`'s data starts on a huge-page boundary."""
    return array.ctypes.data % HUGE_PAGE == 0
