"""Counter-based random numbers for the `random` op: Philox4x32-10 (Salmon et al., "Parallel
random numbers: as easy as 1, 2, 3", SC 2011; the Random123 reference), vectorised over
counters with numpy uint64 arithmetic.

Element i (row-major index) of a `random` result uses the block for counter
(i mod 2^32, i >> 32, 0, 0) under key (key[0], key[1]), and reads its first words x0, x1:

  uniform, f64 result:  u = (((x0 << 21) ^ (x1 >> 11)) & (2^53 - 1)) * 2^-53
  uniform, otherwise:   u = (x0 >> 8) * 2^-24, in f64, then rounded to the result dtype
  normal:               u1 = ((x0 >> 8) + 1) * 2^-24, u2 = (x1 >> 8) * 2^-24,
                        z = sqrt(-2 ln u1) * cos(2 pi u2), in f64, then rounded

so any element can be computed alone, on any rank, in any order.
"""

from __future__ import annotations

import numpy as np

M0, M1 = 0xD2511F53, 0xCD9E8D57       # round multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85       # key schedule: golden ratio, sqrt(3) - 1
ROUNDS = 10
_MASK32 = np.uint64(0xFFFFFFFF)


def _mulhilo(a: int, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(high, low) 32-bit halves of the 64-bit product a * b (b holds u32 values in u64)."""
    p = np.uint64(a) * b                   # < 2^64: no overflow
    return p >> np.uint64(32), p & _MASK32


def philox4x32(counter: tuple[np.ndarray, ...], key: tuple[int, int], rounds: int = ROUNDS) -> tuple[np.ndarray, ...]:
    """Philox4x32-`rounds` of four u32 counter words (arrays) under a two-word key;
    returns the four u32 output words as uint32 arrays."""
    c0, c1, c2, c3 = (np.asarray(c, np.uint64) & _MASK32 for c in counter)
    k0, k1 = int(key[0]) & 0xFFFFFFFF, int(key[1]) & 0xFFFFFFFF
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + W0) & 0xFFFFFFFF, (k1 + W1) & 0xFFFFFFFF
        hi0, lo0 = _mulhilo(M0, c0)
        hi1, lo1 = _mulhilo(M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ np.uint64(k0), lo1, hi0 ^ c3 ^ np.uint64(k1), lo0
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


_CHUNK = 1 << 20  # elements drawn at once: bounds the u64 temporaries (a 38M-element embedding needs no 3 GB)


def _words(key: np.ndarray, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """x0, x1 (as uint64) for elements start..start+n-1."""
    i = np.arange(start, start + n, dtype=np.uint64)
    zero = np.zeros(n, np.uint64)
    x0, x1, _, _ = philox4x32((i & _MASK32, i >> np.uint64(32), zero, zero), (int(key[0]), int(key[1])))
    return x0.astype(np.uint64), x1.astype(np.uint64)


def _draw(key: np.ndarray, shape: tuple[int, ...], dtype: np.dtype, values, words=_words) -> np.ndarray:
    """An array of `shape` whose element i is values(x0, x1) of Philox's words for index i,
    computed a chunk at a time. `words(key, start, n)`: where the words come from (this
    module's numpy, or a faster implementation of the same bits)."""
    n = int(np.prod(shape, dtype=np.int64))
    out = np.empty(n, dtype)
    for lo in range(0, n, _CHUNK):
        hi = min(n, lo + _CHUNK)
        out[lo:hi] = values(*words(key, lo, hi - lo)).astype(dtype)
    return out.reshape(shape)


def uniform(key: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    if np.dtype(dtype) == np.float64:
        def values(x0, x1):
            return (((x0 << np.uint64(21)) ^ (x1 >> np.uint64(11))) & np.uint64(2**53 - 1)).astype(np.float64) * 2.0**-53
    else:
        # Keep only as many bits as the dtype's significand holds, so the value is exact in
        # the dtype and never rounds up to 1.0: uniform stays in [0, 1) for every dtype.
        p = _SIGNIFICAND_BITS[np.dtype(dtype).name]

        def values(x0, x1):
            return (x0 >> np.uint64(32 - p)).astype(np.float64) * 2.0**-p
    return _draw(key, shape, dtype, values)


# Significand bits (with the implicit one) of the float dtypes narrower than f64.
_SIGNIFICAND_BITS = {"float32": 24, "float16": 11, "bfloat16": 8, "float8_e4m3fn": 4, "float8_e5m2": 3}


def _box_muller(x0: np.ndarray, x1: np.ndarray) -> np.ndarray:
    u1 = ((x0 >> np.uint64(8)) + np.uint64(1)).astype(np.float64) * 2.0**-24   # in (0, 1]: log is finite
    u2 = (x1 >> np.uint64(8)).astype(np.float64) * 2.0**-24
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def normal(key: np.ndarray, shape: tuple[int, ...], dtype: np.dtype, words=_words) -> np.ndarray:
    return _draw(key, shape, dtype, _box_muller, words)
