"""Narrow weights (CAP_QUANT, spec 2.2.4): a model's Linear and Embedding weights held as
q8_0, q4_0 or bf16, and read narrow by the compiled products (dtm/backends/cpu/c_narrow.py).

    qmodel = dtm.quant.quantize(model, "q8_0")      # in place, like model.half(); returns it
    qmodel.generate(ids, max_new_tokens=64)         # the same API, narrow weights

`quantize(model, dtype)` is duck-typed, so this layer (8) never imports dtm.nn (9): it calls
`quantize_(dtype)` on every module of `model` that has one (Linear and Embedding replace
their weight by its narrow form, a model drops what it compiled for the old weights).

The arrays: `quantize_weight` is the reference quantizer (dtm.ref.quant, GGML's, bit for
bit) with the checks a weight needs, and `pack` / `unpack` carry narrow weights through
safetensors, which has no block dtypes: a q8_0 or q4_0 tensor is stored as its uint8
block bytes (a bf16 one as safetensors' BF16), and the file's metadata key `dtm.quant` maps
each narrow tensor's name to its dtype and logical shape (a JSON object:
{"name": {"dtype": "q8_0", "shape": [N, K]}}). A narrow weight is stored in the layout the
model holds it in (blocks run along a row), since blocks cannot be transposed.
"""

from __future__ import annotations

import json
import mmap
from typing import Any, Mapping

import numpy as np

from ..errors import DTMError, ErrorCode as E
from ..ir.dtypes import DTYPES, DType, numpy_dtype
from ..ref import quant as refquant

NARROW = ("q8_0", "q4_0", "bf16")  # the weight dtypes `quantize` makes
METADATA_KEY = "dtm.quant"


def narrow_dtype(dtype: str | DType) -> DType:
    """The DType of a narrow weight dtype name; E0408 for any other."""
    name = dtype.name if isinstance(dtype, DType) else str(dtype)
    if name not in NARROW:
        raise DTMError(E.QUANTIZED_MISUSE, f"dtm.quant: weights are quantized to one of {', '.join(NARROW)}, "
                       f"not {name!r}")
    return DTYPES[name]


def quantize_weight(x: np.ndarray, dtype: str | DType, name: str = "weight") -> np.ndarray:
    """The storage of float array `x` as narrow `dtype`: uint8 blocks for q8_0 and q4_0 (the
    reference quantizer, dtm.ref.quant), bfloat16 values (round to nearest even) for bf16.

    E0408 for an integer or bool array, for a block type when the last dim is not a multiple
    of 32, and for a NaN or an infinity: the cast op turns a block holding one into a NaN or
    infinite scale with every q = 0 (spec 2.2), which a weight never means, so a weight
    holding one is refused here, naming the first such element.

    The rows are converted BLOCK_BYTES of f32 at a time, so the work arrays stay small; an `x`
    that is a view of a file mapping (a weight still on disk: dtm.nn.weights.load_safetensors
    with mmap=True) gives back each block's pages once converted, so the f32 weight is never
    resident whole either."""
    dt = narrow_dtype(dtype)
    x = np.asarray(x)
    if x.dtype.kind not in "f" and x.dtype != numpy_dtype(DTYPES["bf16"]):
        raise DTMError(E.QUANTIZED_MISUSE, f"dtm.quant: {name} has dtype {x.dtype}; only float tensors are "
                       f"quantized (to {dt})")
    if not refquant.whole_blocks(dt, x.shape):
        raise DTMError(E.QUANTIZED_MISUSE, f"dtm.quant: {name} of shape {list(x.shape)} cannot be {dt}: its last "
                       f"dim must be a multiple of {dt.block} (blocks of {dt.block} elements)")
    if x.ndim < 2:
        return _quantize_block(x, dt, name, ())
    rows = max(1, BLOCK_BYTES // (4 * int(np.prod(x.shape[1:], dtype=np.int64)) or 1))
    out = np.empty(storage_shape(x.shape, dt), np.uint8 if dt.is_quant else numpy_dtype(DTYPES["bf16"]))
    for lo in range(0, x.shape[0], rows):
        out[lo:lo + rows] = _quantize_block(x[lo:lo + rows], dt, name, (lo,))
        release_pages(x[lo:lo + rows])
    return out


BLOCK_BYTES = 1 << 20  # f32 bytes converted at a time by quantize_weight


def _quantize_block(x: np.ndarray, dt: DType, name: str, at: tuple[int, ...]) -> np.ndarray:
    """quantize_weight on rows of a weight, the first of them row `at` of it (for the error)."""
    bad = ~np.isfinite(x.astype(np.float32))
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        full = [where[0] + at[0], *where[1:]] if at else list(where)
        raise DTMError(E.QUANTIZED_MISUSE, f"dtm.quant: {name} holds {x[where]} at {full}; a weight must be "
                       f"finite to be quantized to {dt}")
    if dt.is_quant:
        return refquant.quantize(x.astype(np.float32), dt)
    return x.astype(numpy_dtype(DTYPES["bf16"]))


def release_pages(view: np.ndarray) -> None:
    """When `view` lies in a read-only file mapping, drop the whole pages it spans from this
    process's memory (MADV_DONTNEED): clean file pages, which the kernel reads again if they
    are touched, so no value changes. Anything else is left alone."""
    base = view
    while isinstance(base, np.ndarray):
        base = base.base
    mapping = base.obj if isinstance(base, memoryview) else None
    if not isinstance(mapping, mmap.mmap) or not view.flags.c_contiguous or view.flags.writeable:
        return
    start = view.ctypes.data - np.frombuffer(mapping, np.uint8, 1).ctypes.data
    page = mmap.PAGESIZE
    lo, hi = -(-start // page) * page, (start + view.nbytes) // page * page
    if hi > lo:
        mapping.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def dequantize_weight(storage: np.ndarray, dtype: str | DType) -> np.ndarray:
    """The f32 values of a narrow weight's storage."""
    dt = narrow_dtype(dtype)
    if dt.is_quant:
        return refquant.dequantize(storage, dt, np.dtype(np.float32))
    return np.asarray(storage).astype(np.float32)


def storage_shape(shape: tuple[int, ...], dtype: str | DType) -> tuple[int, ...]:
    """The shape of the array holding a narrow weight of logical `shape`."""
    dt = narrow_dtype(dtype)
    if not dt.is_quant:
        return tuple(shape)
    return (*shape[:-1], shape[-1] // dt.block * dt.itemsize)


def pack(arrays: Mapping[str, tuple[np.ndarray, DType, tuple[int, ...]]]) -> tuple[dict, dict[str, str]]:
    """{name: (storage, dtype, logical shape)} -> (arrays safetensors can hold, metadata):
    block storage as uint8 under its own name, every one listed in the metadata (module
    docstring)."""
    out, listed = {}, {}
    for name, (storage, dt, shape) in arrays.items():
        check_storage(name, storage, dt, tuple(shape))
        out[name] = storage
        listed[name] = {"dtype": dt.name, "shape": [int(d) for d in shape]}
    return out, ({METADATA_KEY: json.dumps(listed, sort_keys=True)} if listed else {})


def unpack(metadata: Mapping[str, str]) -> dict[str, tuple[DType, tuple[int, ...]]]:
    """The narrow tensors a file's metadata lists: {name: (dtype, logical shape)}; E0408 for
    a listing that is not one (unknown dtype, a shape that is not whole blocks)."""
    text = metadata.get(METADATA_KEY)
    if not text:
        return {}
    try:
        listed = json.loads(text)
        out = {}
        for name, info in listed.items():
            dt = narrow_dtype(info["dtype"])
            shape = tuple(int(d) for d in info["shape"])
            if not shape or not refquant.whole_blocks(dt, shape) or min(shape) < 0:
                raise ValueError(f"{name}: {info}")
            out[name] = (dt, shape)
        return out
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DTMError(E.QUANTIZED_MISUSE, f"dtm.quant: the file's {METADATA_KEY!r} metadata is not a list of "
                       f"quantized tensors: {e}") from None


def check_storage(name: str, storage: np.ndarray, dt: DType, shape: tuple[int, ...]) -> None:
    """E0408 unless `storage` is exactly the storage of a `dt` tensor of `shape` (uint8
    blocks, or bfloat16 values)."""
    want = storage_shape(shape, dt)
    kind = np.dtype(np.uint8) if dt.is_quant else numpy_dtype(DTYPES["bf16"])
    if storage.dtype != kind or tuple(storage.shape) != want:
        raise DTMError(E.QUANTIZED_MISUSE, f"dtm.quant: {name} is {storage.dtype}{list(storage.shape)}, not the "
                       f"{kind}{list(want)} storage of {dt}{list(shape)}")


def quantize(model: Any, dtype: str) -> Any:
    """Make the Linear and Embedding weights of `model` narrow (q8_0, q4_0 or bf16), in
    place, and return it (see the module docstring)."""
    dt = narrow_dtype(dtype)
    for module in list(model.modules()):
        hook = getattr(module, "quantize_", None)
        if hook is not None:
            hook(dt)
    return model


__all__ = ["NARROW", "METADATA_KEY", "narrow_dtype", "quantize_weight", "release_pages", "dequantize_weight", "storage_shape",
           "pack", "unpack", "check_storage", "quantize"]
