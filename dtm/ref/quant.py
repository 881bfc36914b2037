"""Quantized block types in memory, and the quantize / dequantize that `cast` performs.

A tensor of logical type q8_0[..., K] or q4_0[..., K] (K a multiple of 32) is held as a
uint8 array of shape [..., K/32 * block_bytes]: the GGML block layout, blocks of 32
consecutive elements along the last dim, each a little-endian f16 scale `d` followed by

  q8_0 (34 bytes): 32 int8 values q;            element = d * q
  q4_0 (18 bytes): 16 bytes of packed nibbles;  element = d * (q - 8), where element j of
                   the block is the low nibble of byte j and element j + 16 its high nibble.

Quantization is GGML's reference quantizer (quantize_row_q8_0_ref / quantize_row_q4_0_ref),
bit for bit, so files written by llama.cpp and by DTM agree. It computes in f32:

  q8_0: amax = max |x|, d = amax / 127, id = 1/d (0 when d = 0), q = roundf(x * id)
        (roundf: half away from zero).
  q4_0: m = the first element of largest |x| (sign kept), d = m / -8, id = 1/d (0 when
        d = 0), q = min(15, trunc(f32(x * id + 8.5))).

The scale is stored as f16(d) (round to nearest even), while q is computed with the f32 d,
as GGML does. A NaN in a block gives a NaN scale and q = 0 (the cast rule for NaN); for q8_0
that scale is the quiet NaN (f16 0x7e00), for q4_0 the first NaN's bits through d = m / -8.
"""

from __future__ import annotations

import math

import numpy as np

from ..ir.dtypes import DTYPES, DType, numpy_dtype
from ..ir.types import TensorType

BLOCK = 32
QUANT_DTYPES = tuple(d for d in DTYPES.values() if d.is_quant)
_F16 = np.dtype("<f2")


def whole_blocks(dtype: DType, shape: tuple[int, ...]) -> bool:
    """Whether a static `shape` of `dtype` is whole blocks (spec 2.2): always for the
    unblocked dtypes; a quantized shape has a last dim that is a multiple of the block. A
    shape that is not has no storage size (`storage_shape` would round it down)."""
    return not dtype.is_quant or (len(shape) > 0 and shape[-1] % dtype.block == 0)


def storage_shape(t: TensorType) -> tuple[int, ...]:
    """The shape of the numpy array holding a value of static type `t`."""
    if not t.dtype.is_quant:
        return tuple(t.shape)
    *lead, k = t.shape
    return (*lead, k // t.dtype.block * t.dtype.itemsize)


def storage_dtype(dtype: DType) -> np.dtype:
    """The numpy dtype holding `dtype`: uint8 bytes for the quantized block types."""
    return np.dtype(np.uint8) if dtype.is_quant else numpy_dtype(dtype)


def storage_bytes(t: TensorType) -> int:
    """The bytes of the numpy array holding a value of static type `t`."""
    return math.prod(storage_shape(t)) * storage_dtype(t.dtype).itemsize


def dtype_of_storage(nbytes: int, k: int) -> DType:
    """Which quantized dtype stores K = `k` logical elements in `nbytes` bytes per row."""
    for d in QUANT_DTYPES:
        if k % d.block == 0 and nbytes == k // d.block * d.itemsize:
            return d
    raise TypeError(f"{nbytes} bytes hold no whole number of quantized blocks of {k} elements")


def _blocks(x: np.ndarray) -> np.ndarray:
    """x as f32 blocks of 32: shape [..., K/32, 32]."""
    return np.asarray(x, np.float32).reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def _to_int(v: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """f32 values already rounded to integers, clamped into [lo, hi], NaN -> 0."""
    return np.clip(np.nan_to_num(v, nan=0.0), lo, hi).astype(np.int16)


def _scales(d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(id = 1/d or 0, the f16 scale bytes [..., nb, 2])."""
    with np.errstate(all="ignore"):
        inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    return inv, d.astype(_F16)[..., None].view(np.uint8)


def quantize(x: np.ndarray, dtype: DType) -> np.ndarray:
    """Float array [..., K] -> uint8 storage [..., K/32 * block_bytes] of `dtype`."""
    b = _blocks(x)
    with np.errstate(all="ignore"):
        if dtype.name == "q8_0":
            # a block holding NaN: the quiet NaN (numpy's max keeps a payload or not, by position)
            amax = np.where(np.isnan(b).any(-1), np.float32(np.nan), np.max(np.abs(b), axis=-1))
            d = (amax / np.float32(127)).astype(np.float32)
            inv, scale = _scales(d)
            v = (b * inv[..., None]).astype(np.float64)     # f32 product, widened exactly
            q = _to_int(np.trunc(v + np.copysign(0.5, v)), -128, 127).astype(np.int8)
            body = q.view(np.uint8)
        elif dtype.name == "q4_0":
            first = np.argmax(np.abs(b), axis=-1)              # first index of the largest |x|
            m = np.take_along_axis(b, first[..., None], axis=-1)[..., 0]
            d = (m / np.float32(-8)).astype(np.float32)
            inv, scale = _scales(d)
            t = (b * inv[..., None] + np.float32(8.5)).astype(np.float32)  # in f32, as GGML
            q = _to_int(np.trunc(t), 0, 15).astype(np.uint8)
            body = q[..., :16] | (q[..., 16:] << 4)
        else:
            raise TypeError(f"{dtype} is not a quantized dtype")
    out = np.concatenate([scale, body], axis=-1)                 # [..., K/32, block_bytes]
    return out.reshape(*x.shape[:-1], b.shape[-2] * dtype.itemsize)


def dequantize(data: np.ndarray, dtype: DType, out: np.dtype) -> np.ndarray:
    """uint8 storage of `dtype` -> values d * q in f32, then cast to the numpy dtype `out`."""
    nb = data.shape[-1] // dtype.itemsize
    blocks = np.ascontiguousarray(data).reshape(*data.shape[:-1], nb, dtype.itemsize)
    d = np.ascontiguousarray(blocks[..., :2]).view(_F16)[..., 0].astype(np.float32)
    body = blocks[..., 2:]
    if dtype.name == "q8_0":
        q = np.ascontiguousarray(body).view(np.int8).astype(np.float32)
    elif dtype.name == "q4_0":
        q = np.concatenate([body & 0x0F, body >> 4], axis=-1).astype(np.float32) - np.float32(8)
    else:
        raise TypeError(f"{dtype} is not a quantized dtype")
    with np.errstate(all="ignore"):
        vals = (d[..., None] * q).astype(np.float32)
    return vals.reshape(*data.shape[:-1], nb * BLOCK).astype(out)
